"""SAEPPOTrainer and everything it is built from: the config, model construction (policy, critic,
reference), the step phases, losses, checkpointing and metrics."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CHECKPOINT_PREFIX": "checkpointing",
    "CheckpointDiskFullError": "checkpointing",
    "DamagedCheckpointError": "checkpointing",
    "MANIFEST_NAME": "checkpointing",
    "StartPlan": "checkpointing",
    "check_fresh_start": "checkpointing",
    "checkpoint_problems": "checkpointing",
    "checkpoint_step": "checkpointing",
    "parse_resume_flag": "checkpointing",
    "plan_training_start": "checkpointing",
    "remove_checkpoints": "checkpointing",
    "sorted_checkpoints": "checkpointing",
    "verify_checkpoint": "checkpointing",
    "write_manifest": "checkpointing",
    "SAEPPOConfig": "config",
    "UNSUPPORTED_FIELDS": "config",
    "PolicyAndCritic": "critic",
    "SharedBaseCritic": "critic",
    "adapter_parameters": "critic",
    "merge_adapter_into_full_model": "critic",
    "clip_fractions": "losses",
    "clipped_policy_loss": "losses",
    "clipped_value_loss": "losses",
    "entropy_bonus": "losses",
    "kl_penalty": "losses",
    "masked_mean": "losses",
    "masked_whiten": "losses",
    "positive_nll_loss": "losses",
    "average_logs": "metrics",
    "step_metrics": "metrics",
    "build_critic_from_policy": "models",
    "build_reference": "models",
    "disable_dropout": "models",
    "load_critic": "models",
    "load_policy": "models",
    "load_tokenizer": "models",
    "Rollouts": "rollout",
    "RolloutBatch": "rollout_batch",
    "SAEPPOTrainer": "sae_ppo_trainer",
    "build_accelerator": "setup_utils",
    "high_entropy_mask": "shaping",
    "overlong_penalty": "shaping",
    "PPOUpdate": "update",
    "token_budget_micro_batches": "update",
    "deepspeed_batch_sizes": "setup_utils",
    "deepspeed_gradient_clipping": "setup_utils",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
