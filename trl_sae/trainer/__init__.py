"""SAEPPOTrainer and everything it is built from: the config, model construction (policy, critic,
reference), the step phases, losses, checkpointing and metrics."""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CHECKPOINT_PREFIX": "checkpointing",
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
    "build_critic_from_policy": "critic",
    "load_critic": "critic",
    "RolloutBatch": "sae_ppo_trainer",
    "SAEPPOTrainer": "sae_ppo_trainer",
    "deepspeed_gradient_clipping": "sae_ppo_trainer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
