"""The sampled tokens' log-probabilities and entropies from logits, a chunk of positions at a time.

:func:`chunk_logprobs` reduces one chunk's ``(n, V)`` logits to ``(n,)`` log-probabilities and entropies from
one float32 log-softmax, with a hand-written backward (:class:`_TokenLogprobAndEntropy`), so a chunk holds at
most three ``(n, V)`` float32 tensors. :func:`default_logprob_chunk_size` chooses the chunk from the
vocabulary (a working set near :data:`LOGPROB_CHUNK_BUDGET_BYTES`), and :func:`logprobs_from_logits` applies
the chunks to a model's full ``(B, T, V)`` logits, the fallback for models whose head cannot be applied on
its own. The chunked head itself (no ``(B, T, V)`` logits at all) is
:func:`trl_sae.generation.capture.logprobs_from_hidden_states`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "LOGPROB_CHUNK_BUDGET_BYTES",
    "LOGPROB_CHUNK_BYTES_PER_ELEMENT",
    "checkpointed",
    "chunk_logprobs",
    "default_logprob_chunk_size",
    "logprobs_from_logits",
    "resolve_chunk_size",
]

_Result = TypeVar("_Result")

# Working set of one chunk of the head + log-softmax. The default chunk size is chosen from the vocabulary
# so that a chunk's (chunk, V) temporaries stay near this budget whatever the completion length: a fixed
# 256 positions held ~750 MiB at Qwen3's vocabulary (151,936), most of a whole PPO step's extra memory.
LOGPROB_CHUNK_BUDGET_BYTES = 64 * 2**20
# Bytes per (chunk x V) element a chunk holds at its peak, float32 logits: the logits, the float32
# log-softmax and one more float32 (chunk, V) tensor (exp for the entropy in the forward; the
# probabilities and the gradient in the backward, the saved log-softmax being freed only after it).
# Measured at 12-13 B by benchmarks/bench_logprobs_memory.py; bf16 logits hold 2 B less.
LOGPROB_CHUNK_BYTES_PER_ELEMENT = 12


def default_logprob_chunk_size(vocab_size: int, budget_bytes: int = LOGPROB_CHUNK_BUDGET_BYTES) -> int:
    """Positions per head chunk so that one chunk's ``(chunk, V)`` working set stays within ``budget_bytes``.

    ``budget_bytes / (LOGPROB_CHUNK_BYTES_PER_ELEMENT x V)``, rounded down to a multiple of 8 (whole
    matmul tiles) when that leaves at least 8, and at least 1: 36 -> 32 positions at Qwen3's 151,936
    tokens, 128 at a 32k vocabulary.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    positions = budget_bytes // (LOGPROB_CHUNK_BYTES_PER_ELEMENT * vocab_size)
    if positions >= 8:
        positions -= positions % 8
    return max(1, int(positions))


def resolve_chunk_size(chunk_size: int | None, vocab_size: int) -> int:
    """``chunk_size`` as given, or the vocabulary's default when None; refuses anything below 1."""
    if chunk_size is None:
        return default_logprob_chunk_size(vocab_size)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    return chunk_size


def _entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """``(n, V)`` finite log-probabilities -> ``(n,)`` entropies ``-sum_v p_v log p_v``.

    A batched ``(1, V) @ (V, 1)`` product per row: ``vecdot`` and ``(p * logp).sum`` materialise the
    ``(n, V)`` product as one more temporary.
    """
    probs = logp.exp()
    return -torch.matmul(probs.unsqueeze(-2), logp.unsqueeze(-1)).reshape(logp.shape[:-1])


class _TokenLogprobAndEntropy(torch.autograd.Function):
    """``(n, V)`` logits -> the sampled tokens' ``(n,)`` log-probabilities and ``(n,)`` entropies.

    Both come from one float32 log-softmax, and the backward is written out rather than left to autograd,
    which would keep the log-softmax, the probabilities and the entropy's product for every op and build
    a gradient per term. With ``x = logits / temperature``, ``p = softmax(x)``, ``H = -sum p log p``:

    * ``d log p_y / dx = onehot(y) - p``;
    * ``dH / dx = -p * (log p + H)``.

    Only the float32 log-softmax is saved (the logits are not: under checkpointing they are recomputed
    anyway), so a chunk holds at most three ``(n, V)`` float32 tensors at once, forward or backward.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Float32 throughout, also under autocast (which would run the entropy's matmul in bf16).
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return _TokenLogprobAndEntropy._forward(ctx, logits, tokens, temperature, with_entropy)

    @staticmethod
    def _forward(
        ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = logits.float()  # a copy for bf16 logits (then updated in place); the tensor itself for fp32
        if temperature != 1.0:
            scaled = scaled.div_(temperature) if scaled is not logits else scaled / temperature
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        logp = scaled.sub_(lse) if scaled is not logits else scaled - lse
        del scaled, lse
        token_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        entropy = _entropy_from_logprobs(logp) if with_entropy else logp.new_zeros(0)
        ctx.save_for_backward(logp, tokens, entropy)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.logits_dtype = logits.dtype
        return token_logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None]:
        logp, tokens, entropy = ctx.saved_tensors
        probs = logp.exp()
        if ctx.with_entropy and grad_entropy is not None:
            # -p * (g_lp + g_H (log p + H)), built in one buffer.
            grad = (logp + entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
            if grad_logp is not None:
                grad.add_(grad_logp.unsqueeze(-1))
            grad.mul_(probs).neg_()
        elif grad_logp is not None:
            grad = probs.mul_(-grad_logp.unsqueeze(-1))
        else:  # pragma: no cover - autograd calls backward only when an output has a gradient
            grad = torch.zeros_like(probs)
        del probs
        if grad_logp is not None:
            grad.scatter_add_(-1, tokens.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None


def chunk_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, V)`` logits, ``(n,)`` tokens -> ``(n,)`` logprobs and ``(n,)`` entropies (empty if not asked).

    The float32 upcast lives only for one chunk (:class:`_TokenLogprobAndEntropy`).
    """
    return _TokenLogprobAndEntropy.apply(logits, tokens, float(temperature), bool(with_entropy))


def checkpointed(fn: Callable[..., _Result], *args: Any, enabled: bool) -> _Result:
    """``fn(*args)``; when ``enabled``, under non-reentrant activation checkpointing, so autograd keeps only
    the inputs and the backward runs ``fn`` again (a chunk's ``(n, V)`` logits are never stored)."""
    if not enabled:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def logprobs_from_logits(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of completion tokens from logits that predict them.

    The fallback of :func:`~trl_sae.generation.capture.sequence_logprobs` for models whose head cannot be applied separately (the
    ``(B, T, V)`` logits then exist once).

    The float32 log-softmax is computed ``chunk_size`` tokens of one row at a time, never for the whole
    ``(B, T, V)``; when grad is on, each chunk is checkpointed so backward recomputes it instead of
    autograd saving every chunk's float32 copy. Positions after a row's last valid token are not computed.

    Args:
        logits: ``(B, T, V)`` logits; ``logits[:, t]`` predicts ``completion_ids[:, t]`` (any dtype).
        completion_ids: ``(B, T)`` long.
        completion_mask: ``(B, T)``, 1 on valid tokens.
        temperature: the sampling temperature the logits are divided by.
        return_entropy: also return per-token entropies of the tempered distribution.
        chunk_size: tokens per float32 chunk (None: chosen from the vocabulary).

    Returns:
        ``(logprobs, entropies)``: ``(B, T)`` float32 each, 0 on masked positions; ``entropies`` is None
        unless ``return_entropy``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch, steps = completion_ids.shape
    if steps == 0:
        empty = torch.zeros(batch, 0, device=completion_ids.device)
        return empty, (empty.clone() if return_entropy else None)
    chunk_size = resolve_chunk_size(chunk_size, logits.shape[-1])
    valid = completion_mask.bool()
    # Right padding: only positions before each row's last valid token are computed (usually the first
    # L_i); positions after it are filled with zeros without touching their logits.
    positions = torch.arange(steps, device=valid.device)
    lengths = torch.where(valid, positions + 1, 0).amax(dim=1).tolist()
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    row_logprobs: list[torch.Tensor] = []
    row_entropies: list[torch.Tensor] = []
    # unbind/split rather than logits[row, a:b]: the backward of each basic slice is a zero tensor of the
    # full (B, T, V) shape, while unbind and split assemble one gradient for all their pieces.
    for row, (row_logits, row_tokens) in enumerate(zip(logits.unbind(0), completion_ids.unbind(0))):
        length = int(lengths[row])
        pieces_lp: list[torch.Tensor] = []
        pieces_ent: list[torch.Tensor] = []
        for index, (chunk, tokens) in enumerate(
            zip(row_logits.split(chunk_size), row_tokens.split(chunk_size))
        ):
            start = index * chunk_size
            if start >= length:
                break
            if start + chunk.shape[0] > length:  # a chunk-sized slice, never a row-sized one
                chunk, tokens = chunk[: length - start], tokens[: length - start]
            lp, ent = checkpointed(
                chunk_logprobs, chunk, tokens, temperature, return_entropy, enabled=use_checkpoint
            )
            pieces_lp.append(lp)
            pieces_ent.append(ent)
        pad = logits.new_zeros(steps - length, dtype=torch.float32)
        row_logprobs.append(torch.cat([*pieces_lp, pad]))
        if return_entropy:
            row_entropies.append(torch.cat([*pieces_ent, pad]))

    logprobs = torch.stack(row_logprobs)
    # Zero any holes inside the computed prefix too (a mask need not be a prefix).
    logprobs = logprobs * valid
    entropies = torch.stack(row_entropies) * valid if return_entropy else None
    return logprobs, entropies
