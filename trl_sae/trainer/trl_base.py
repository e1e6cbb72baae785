"""The bases ``SAEPPOConfig`` and ``SAEPPOTrainer`` stand on, for every supported TRL line.

TRL 1.12 has ``trl.experimental.ppo`` (``PPOConfig``, ``PPOTrainer``, ``OnlineTrainerState``): there the two
classes stay subclasses of TRL's, so ``isinstance(trainer, trl.experimental.ppo.PPOTrainer)`` holds. TRL 1.13
deleted that module. From 1.13 on the bases below take its place, written for what trl-sae uses and no more:

- :class:`PPOFieldsConfig`: TRL's common trainer config (``trl.trainer.base_config._BaseConfig``, which every
  TRL line keeps) plus the PPO settings under the same names and defaults as 1.12's ``PPOConfig``, so a recipe
  or a checkpoint's saved arguments mean the same on either line, and ``UNSUPPORTED_FIELDS`` refuses the
  same ones.
- :class:`EpisodeTrainerState`: ``transformers.TrainerState`` with the ``episode`` counter (the only field
  ``OnlineTrainerState`` added), saved in and read from ``trainer_state.json`` unchanged.
- :class:`PPOBaseTrainer`: TRL's common trainer base (``trl.trainer.base_trainer._BaseTrainer``: a
  ``transformers.Trainer`` with TRL's model card). ``SAEPPOTrainer`` overrides every other method it used
  from ``PPOTrainer`` (``__init__``, ``train``, ``save_model``, ``_save_checkpoint``, ``null_ref_context``),
  so nothing else is needed.

``TRL_HAS_PPO`` says which line is installed; ``PPOConfig``, ``PPOTrainer`` and ``OnlineTrainerState`` are
the bases to use: TRL's where they exist, else ours.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import TrainerState
from trl.trainer.base_config import _BaseConfig
from trl.trainer.base_trainer import _BaseTrainer

__all__ = [
    "SAE_PAPER",
    "TRL_HAS_PPO",
    "EpisodeTrainerState",
    "OnlineTrainerState",
    "PPOBaseTrainer",
    "PPOConfig",
    "PPOFieldsConfig",
    "PPOTrainer",
]

_BATCH = "derived by the trainer from the batch settings; leave unset"


@dataclass
class PPOFieldsConfig(_BaseConfig):
    """TRL's common trainer settings plus the PPO ones, named and defaulted as TRL 1.12's ``PPOConfig``.

    Only the base of ``SAEPPOConfig`` where TRL has no ``PPOConfig`` (TRL >= 1.13); ``SAEPPOConfig`` gives
    the meaning each field has in trl-sae (or refuses it).
    """

    learning_rate: float = field(default=3e-6, metadata={"help": "Learning rate of the optimizer."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Worker processes that prepare the dataset (None: this process)."}
    )
    num_mini_batches: int = field(
        default=1, metadata={"help": "Mini-batches each rollout batch is cut into."}
    )
    total_episodes: int | None = field(
        default=None, metadata={"help": "Completions to train on in all (None: from num_train_epochs)."}
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Sequences per no-grad forward pass during rollouts, per process."}
    )
    num_sample_generations: int = field(
        default=10, metadata={"help": "How many times to print sample completions during training."}
    )
    response_length: int = field(default=53, metadata={"help": "Maximum new tokens per completion."})
    stop_token: Literal["eos"] | None = field(
        default=None, metadata={"help": "'eos' stops completions at the tokenizer's end-of-sequence token."}
    )
    stop_token_id: int | None = field(default=None, metadata={"help": "Token id that stops a completion."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of rollouts."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the reward of a completion that never stops."}
    )
    sft_model_path: str = field(
        default="EleutherAI/pythia-160m", metadata={"help": "Policy checkpoint of TRL's PPO example scripts."}
    )
    world_size: int | None = field(default=None, metadata={"help": f"Process count ({_BATCH})."})
    num_total_batches: int | None = field(default=None, metadata={"help": f"Training steps ({_BATCH})."})
    micro_batch_size: int | None = field(
        default=None, metadata={"help": f"Sequences per forward pass, all processes ({_BATCH})."}
    )
    local_batch_size: int | None = field(
        default=None, metadata={"help": f"Rollout batch per process ({_BATCH})."}
    )
    batch_size: int | None = field(
        default=None, metadata={"help": f"Rollout batch, all processes ({_BATCH})."}
    )
    local_mini_batch_size: int | None = field(
        default=None, metadata={"help": f"Mini-batch per process ({_BATCH})."}
    )
    mini_batch_size: int | None = field(
        default=None, metadata={"help": f"Mini-batch, all processes ({_BATCH})."}
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Upload the trained model to the Hub."})
    reward_model_path: str = field(
        default="EleutherAI/pythia-160m", metadata={"help": "Reward model of TRL's PPO example scripts."}
    )
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "The PEFT adapter to train when the policy has several."}
    )
    ref_adapter_name: str | None = field(
        default=None,
        metadata={"help": "The PEFT adapter that is the reference policy when the policy has several."},
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the rewards before advantages."})
    kl_coef: float = field(
        default=0.05, metadata={"help": "Weight of the KL penalty to the reference policy."}
    )
    kl_estimator: Literal["k1", "k3"] = field(
        default="k1", metadata={"help": "KL estimator: 'k1' (log ratio) or 'k3' (lower variance)."}
    )
    cliprange: float = field(default=0.2, metadata={"help": "PPO ratio clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value update."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "Under DeepSpeed ZeRO-3, gather the policy's weights to generate."}
    )


@dataclass
class EpisodeTrainerState(TrainerState):
    """``transformers.TrainerState`` plus ``episode``: completions trained on so far."""

    episode: int = 0


class PPOBaseTrainer(_BaseTrainer):
    """TRL's trainer base (``transformers.Trainer`` with TRL's model card) under ``SAEPPOTrainer`` on
    TRL >= 1.13. ``SAEPPOTrainer`` sets up and runs everything itself; the card's tags come from its
    ``_tag_names``, ``_name`` and ``_paper``."""


try:  # TRL 1.12
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo.ppo_trainer import OnlineTrainerState

    TRL_HAS_PPO = True
except ImportError:  # TRL >= 1.13 deleted trl.experimental.ppo
    PPOConfig = PPOFieldsConfig  # type: ignore[assignment,misc]
    PPOTrainer = PPOBaseTrainer  # type: ignore[assignment,misc]
    OnlineTrainerState = EpisodeTrainerState  # type: ignore[assignment,misc]
    TRL_HAS_PPO = False


# The paper TRL's model card cites for trainers built on these bases (``_paper``).
SAE_PAPER: dict[str, Any] = {
    "title": "Segmental Advantage Estimation: Enhancing PPO for Long-Context LLM Training",
    "id": None,
    "citation": textwrap.dedent("""\
        @inproceedings{sae2026,
            title        = {{Segmental Advantage Estimation: Enhancing PPO for Long-Context LLM Training}},
            year         = 2026,
        }"""),
}
