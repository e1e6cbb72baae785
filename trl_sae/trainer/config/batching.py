"""Memory knobs of the update and the log-prob passes: token-budget micro-batches and the output head's chunk size."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BatchingConfig"]


@dataclass
class BatchingConfig:
    """Memory knobs of the update and the log-prob passes: token-budget micro-batches and the output head's chunk size. Mixed into :class:`~trl_sae.SAEPPOConfig`, whose docstring documents each field."""

    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "Padded-token budget of one update micro-batch (None: per_device_train_batch_size rows)."
        },
    )
    logprob_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Completion positions per output-head call for log-probs (None: ~64 MiB from the vocabulary)."
        },
    )
