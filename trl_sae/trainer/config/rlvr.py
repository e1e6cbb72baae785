"""The RLVR knobs (docs/guides/rlvr.md): dynamic sampling, the loss's aggregation and clip-higher, overlong shaping, VAPO's positive NLL, the high-entropy token mask."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LOSS_AGG_MODES", "RLVRConfig"]

# How the policy loss aggregates token terms (trainer/objectives/losses.py, docs/guides/rlvr.md).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class RLVRConfig:
    """The RLVR knobs (docs/guides/rlvr.md): dynamic sampling, the loss's aggregation and clip-higher, overlong shaping, VAPO's positive NLL, the high-entropy token mask. Mixed into :class:`~trl_sae.SAEPPOConfig`, whose docstring documents each field."""

    filter_groups: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling (verl's filter_groups.enable): drop prompts whose rewards agree."
        },
    )
    max_num_gen_batches: int = field(
        default=10,
        metadata={"help": "With filter_groups: generation rounds per step at most, as verl's (>= 1)."},
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient."})
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={"help": "token-mean, seq-mean-token-mean or seq-mean-token-sum-norm (Dr. GRPO)."},
    )
    # RLVR knobs (docs/guides/rlvr.md); their math is in trainer/objectives/losses.py and trainer/objectives/shaping.py.
    cliprange_high: float | None = field(
        default=None,
        metadata={
            "help": "DAPO's clip-higher (TRL's epsilon_high): upper policy-ratio clip epsilon (None: cliprange)."
        },
    )
    overlong_buffer_length: int = field(
        default=0,
        metadata={
            "help": "DAPO's soft overlong punishment (verl's overlong_buffer.len): a linear penalty over this many "
            "tokens before response_length (0: off)."
        },
    )
    overlong_penalty_factor: float = field(
        default=1.0,
        metadata={"help": "The overlong penalty at response_length (verl's overlong_buffer.penalty_factor)."},
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "As TRL's GRPO: drop completions cut at response_length from the policy loss (the critic keeps "
            "them)."
        },
    )
    positive_nll_coef: float = field(
        default=0.0,
        metadata={
            "help": "VAPO's positive-example LM loss: NLL weight on completions rewarded above "
            "positive_nll_threshold (0: off)."
        },
    )
    positive_nll_threshold: float = field(
        default=0.0,
        metadata={"help": "VAPO's positive examples: reward a completion must exceed for the NLL loss."},
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "TRL's name (Beyond the 80/20 Rule): policy loss on the top-q entropy tokens only, in (0, 1] "
            "(1: all)."
        },
    )

    def _validate_rlvr_knobs(self, fail: Any) -> None:
        # Ranges of the coefficients are in _MINIMUMS; here what depends on other fields.
        if self.overlong_buffer_length >= self.response_length:
            fail(
                "overlong_buffer_length",
                f"{self.overlong_buffer_length} must be below response_length={self.response_length} (the "
                "penalty grows over the last overlong_buffer_length tokens before it).",
            )
        if self.overlong_buffer_length == 0 and self.overlong_penalty_factor != 1.0:
            fail(
                "overlong_penalty_factor",
                "is set but overlong_buffer_length=0, so no penalty applies; set overlong_buffer_length > 0.",
            )
        if self.positive_nll_coef == 0 and self.positive_nll_threshold != 0.0:
            fail(
                "positive_nll_threshold",
                "is set but positive_nll_coef=0, so no NLL loss applies; set positive_nll_coef > 0.",
            )
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            fail(
                "top_entropy_quantile",
                f"must be in (0, 1], got {self.top_entropy_quantile} (0.2 trains on the top 20% entropy "
                "tokens, 1.0 on all).",
            )
        if self.mask_truncated_completions and self.stop_token is None and self.stop_token_id is None:
            fail(
                "mask_truncated_completions",
                "with stop_token=None and no stop_token_id every completion runs to response_length and would "
                "be dropped; set stop_token='eos' or a stop_token_id.",
            )
