"""What a rollout samples and scores: completions per prompt, prompt length, reward weights and time limits."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OVERLONG_PROMPTS", "RolloutConfig"]

OVERLONG_PROMPTS = ("filter", "truncate", "error")


@dataclass
class RolloutConfig:
    """What a rollout samples and scores: completions per prompt, prompt length, reward weights and time limits. Mixed into :class:`~trl_sae.SAEPPOConfig`, whose docstring documents each field."""

    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt."})
    eval_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Temperature of evaluate()'s one completion per prompt: 0 greedy; None: temperature."
        },
    )
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Longest prompt in tokens; see overlong_prompts (None: no limit)."}
    )
    overlong_prompts: str = field(
        default="filter",
        metadata={
            "help": "Prompts over max_prompt_length: filter (drop them, with a warning), truncate (keep their "
            "opening (BOS, chat template's start) and last tokens, max_prompt_length in all) or error."
        },
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the reward functions."}
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one reward-function call may take before training stops (None: no limit)."
        },
    )
