"""SAEPPOTrainer and everything it is built from, one sub-package per job (docs/guides/layout.md):

* ``config/``: :class:`SAEPPOConfig`;
* ``setup/``: what the trainer builds before its first step (policy, reference, PEFT plumbing, the
  Accelerator, prompt datasets, vLLM, precision);
* ``critics/``: the three critics, the shared prefix of a shared-base critic, building them;
* ``parts/``: the step's parts (rollouts, the PPO update, evaluation, metrics) and the batch they pass along;
* ``objectives/``: the loss terms, reward shaping and dynamic sampling as tensor functions;
* ``checkpoints/``: checkpoint folders and what a checkpoint holds;
* ``sae_ppo_trainer.py``: the trainer, the phases in order; ``trl_base.py``: its TRL bases.
"""

from __future__ import annotations

from trl_sae._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CHECKPOINT_PREFIX": "checkpoints.folders",
    "CheckpointDiskFullError": "checkpoints.folders",
    "DamagedCheckpointError": "checkpoints.folders",
    "MANIFEST_NAME": "checkpoints.folders",
    "StartPlan": "checkpoints.folders",
    "check_fresh_start": "checkpoints.folders",
    "checkpoint_problems": "checkpoints.folders",
    "checkpoint_step": "checkpoints.folders",
    "parse_resume_flag": "checkpoints.folders",
    "plan_training_start": "checkpoints.folders",
    "remove_checkpoints": "checkpoints.folders",
    "sorted_checkpoints": "checkpoints.folders",
    "verify_checkpoint": "checkpoints.folders",
    "write_manifest": "checkpoints.folders",
    "SAEPPOConfig": "config",
    "UNSUPPORTED_FIELDS": "config",
    "PolicyAndCritic": "critics.policy_and_critic",
    "SharedBaseCritic": "critics.policy_and_critic",
    "adapter_parameters": "setup.adapters",
    "merge_adapter_into_full_model": "setup.adapters",
    "clip_fractions": "objectives.losses",
    "clipped_policy_loss": "objectives.losses",
    "clipped_value_loss": "objectives.losses",
    "entropy_bonus": "objectives.losses",
    "kl_penalty": "objectives.losses",
    "masked_mean": "objectives.losses",
    "masked_whiten": "objectives.losses",
    "positive_nll_loss": "objectives.losses",
    "average_logs": "parts.metrics",
    "step_metrics": "parts.metrics",
    "build_critic_from_policy": "critics.build",
    "build_reference": "setup.models",
    "disable_dropout": "setup.models",
    "load_critic": "critics.build",
    "load_policy": "setup.models",
    "load_tokenizer": "setup.models",
    "Rollouts": "parts.rollout",
    "RolloutBatch": "rollout_batch",
    "SAEPPOTrainer": "sae_ppo_trainer",
    "build_accelerator": "setup.distributed",
    "high_entropy_mask": "objectives.shaping",
    "overlong_penalty": "objectives.shaping",
    "PPOUpdate": "parts.update",
    "token_budget_micro_batches": "parts.update",
    "deepspeed_batch_sizes": "setup.distributed",
    "deepspeed_gradient_clipping": "setup.distributed",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
