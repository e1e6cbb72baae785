"""Configuration of :class:`~trl_sae.SAEPPOTrainer`: :class:`SAEPPOConfig`, one flat dataclass (recipes, the
CLI and ``trl-sae docs`` see every field in one place) assembled from one mixin per concern: the estimator
(:mod:`.estimator`), rollouts (:mod:`.rollouts`), the critic (:mod:`.critic`), the RLVR knobs (:mod:`.rlvr`),
memory (:mod:`.batching`), models, logs and checkpoints (:mod:`.outputs`) and vLLM (:mod:`.vllm`), with
what it does to the fields it inherits from TRL and transformers in :mod:`.inherited`."""

from __future__ import annotations

from trl_sae.trainer.config.inherited import UNSUPPORTED_FIELDS, deepspeed_cpu_backend
from trl_sae.trainer.config.rollouts import OVERLONG_PROMPTS
from trl_sae.trainer.config.sae_ppo_config import SAEPPOConfig
from trl_sae.trainer.config.vllm import VLLM_MODES

__all__ = ["OVERLONG_PROMPTS", "UNSUPPORTED_FIELDS", "VLLM_MODES", "SAEPPOConfig", "deepspeed_cpu_backend"]
