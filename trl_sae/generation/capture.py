"""Generation that records per-token log-probabilities and entropies, and the matching teacher-forced pass.

PPO needs, for every sampled token, the log-probability the *rollout* policy gave it (the "old" logprob of
the ratio, and SAE's probability segmenter, ``boundaries[t] = exp(logprob[t]) < p``). TRL's PPOTrainer gets
it by generating with ``output_scores=True`` and stacking the scores: a ``(B, T, V)`` float32 tensor, 2.5 GB
at Qwen3's vocabulary (151,936), ``B = 8`` and ``T = 512``, held twice while the tuple is stacked.

:func:`generate_with_logprobs` instead reduces each step's scores to two numbers per row (the sampled
token's log-probability and the entropy) *while generating*, so it never holds more than one step of
scores, ``O(B x V)``. It hooks into ``model.generate`` through ``custom_generate`` (a callable that receives
the fully prepared logits processors and stopping criteria and runs the standard decoding loop):

* a :class:`~transformers.LogitsProcessor` appended *after* every processor and warper ``generate`` built,
  so it sees exactly the scores ``_sample`` turns into the sampling distribution (temperature applied);
  it stores that step's log-softmax and entropy and returns the scores unchanged;
* a :class:`~transformers.StoppingCriteria` appended after the built ones: it runs right after the token
  is chosen, gathers its log-probability from the stored step and drops the ``(B, V)`` tensor. It never
  stops anything.

:func:`forward_logprobs` is the teacher-forced counterpart used for the PPO update (with grad) and the
reference policy: it computes the same quantities from one forward pass, chunk by chunk, without ever holding
``(B, T, V)`` logits. :func:`sequence_logprobs` runs the decoder *without* its output head, keeps the final
hidden states of the valid completion positions and applies the head to ``chunk_size`` of them at a time,
reducing each chunk's logits to the sampled token's log-probability (and entropy) at once from one float32
log-softmax, with a hand-written backward; under grad every chunk is checkpointed, so backward recomputes its
logits instead of autograd storing them. Extra memory is ``O(chunk_size x V)`` whatever ``T`` is, and the
default ``chunk_size`` is chosen from ``V`` so that it stays near :data:`LOGPROB_CHUNK_BUDGET_BYTES` (64 MiB).
Models whose forward changes the head's output (logit soft-capping or scaling) or whose head cannot be found
fall back to the model's own logits (:func:`logprobs_from_logits`).

Sampling parameters and PPO: with ``top_k``/``top_p``/``min_p`` the captured distribution is the
*truncated* one that actually sampled the token, which a teacher-forced pass (plain softmax over the full
vocabulary) does not reproduce. PPO callers should generate with ``top_k=0, top_p=1.0`` (and no other
truncating processor) so that old logprobs, new logprobs and reference logprobs share one distribution:
:func:`pure_sampling_config` builds such a config.

What these passes build on lives beside this module, which re-exports its public names:
:mod:`~trl_sae.generation.token_logprobs` (one chunk's logits to log-probabilities and entropies, the chunk
size, the full-logits path), :mod:`~trl_sae.generation.output_head` (the decoder and head under wrappers) and
:mod:`~trl_sae.generation.sharding` (what a pass over an FSDP2 or ZeRO-3 model must do).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria
from transformers.generation import GenerationMode
from transformers.utils import logging

from trl_sae.generation.inputs import eos_token_id_list, sequence_inputs
from trl_sae.generation.output_head import (
    head_vocab_size,
    output_head_split,
    supports_logits_to_keep,
)
from trl_sae.generation.output_head import unwrap_model as _unwrap_model  # noqa: F401  (its name before the split)
from trl_sae.generation.sharding import agreed_head_calls, fsdp2_root_unsharded, has_fsdp2_modules
from trl_sae.generation.token_logprobs import (
    LOGPROB_CHUNK_BUDGET_BYTES,
    LOGPROB_CHUNK_BYTES_PER_ELEMENT,
    checkpointed,
    default_logprob_chunk_size,
    logprobs_from_logits,
    resolve_chunk_size,
)
from trl_sae.generation.token_logprobs import chunk_logprobs as _chunk_logprobs  # its name before the split

__all__ = [
    "LOGPROB_CHUNK_BUDGET_BYTES",
    "LOGPROB_CHUNK_BYTES_PER_ELEMENT",
    "RolloutOutput",
    "default_logprob_chunk_size",
    "forward_logprobs",
    "fsdp2_root_unsharded",
    "generate_with_logprobs",
    "logprobs_from_hidden_states",
    "logprobs_from_logits",
    "output_head_split",
    "pure_sampling_config",
    "sequence_logprobs",
]

logger = logging.get_logger(__name__)


@dataclass
class RolloutOutput:
    """What one batched rollout produces.

    Attributes:
        completion_ids: ``(B, T)`` long, right-padded with the pad token id after the first EOS.
        completion_mask: ``(B, T)`` long, 1 on valid tokens up to and including the first EOS, 0 after.
        logprobs: ``(B, T)`` float32, log-probability of each sampled token under the distribution that
            sampled it (after every logits processor, temperature included); 0 where the mask is 0.
        entropies: ``(B, T)`` float32, entropy in nats of that distribution; 0 where the mask is 0.
        is_truncated: ``(B,)`` bool, True where no EOS was produced within the generation budget.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor
    is_truncated: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` long: number of valid completion tokens per row (``L_i`` in docs/design.md)."""
        return self.completion_mask.sum(-1)

    def to(self, device: torch.device | str) -> RolloutOutput:
        """A copy with every tensor moved to ``device``."""
        return RolloutOutput(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def _logprobs_and_entropy(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, V)`` processed scores -> ``(B, V)`` log-probabilities and ``(B,)`` entropy in nats.

    Tokens that a top-k/top-p warper set to ``-inf`` would give ``0 * -inf = nan`` in ``sum p log p``: the
    log-probabilities are clamped to the most negative finite float first (in place, no extra ``(B, V)``),
    which makes those terms exactly 0. ``softmax`` + ``vecdot`` rather than ``exp`` + ``entr`` + ``sum``:
    about 4x faster per step on CPU at Qwen3's vocabulary.
    """
    scores = scores.float()
    logp = torch.log_softmax(scores, dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    entropy = -torch.linalg.vecdot(torch.softmax(scores, dim=-1), logp)
    return logp, entropy


class _StepScoresCapture(LogitsProcessor):
    """Last logits processor: keeps the current step's log-softmax and writes its entropy; changes nothing.

    Holds exactly one ``(B, V)`` float32 tensor between the processor call and the token choice; the
    matching :class:`_SampledTokenCapture` releases it once the token is known. Per-step results go into
    ``(B, capacity)`` buffers preallocated at the first step: appending a small tensor per step instead
    interleaves long-lived small blocks with the freed ``(B, V)`` blocks, and glibc's heap then grows by
    about one ``(B, V)`` block per step (measured: +147 MiB of RSS for 64 steps at B=4 and Qwen3's vocabulary).
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity  # expected number of steps (max_new_tokens); grows if exceeded
        self.step = 0
        self.step_logprobs: torch.Tensor | None = None  # (B, V), only between processor and criteria
        self.logprobs: torch.Tensor | None = None  # (B, capacity) float32
        self.entropies: torch.Tensor | None = None  # (B, capacity) float32

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.logprobs is None:
            shape = (scores.shape[0], max(self.capacity, 1))
            self.logprobs = torch.zeros(shape, dtype=torch.float32, device=scores.device)
            self.entropies = torch.zeros(shape, dtype=torch.float32, device=scores.device)
        elif self.step >= self.logprobs.shape[1]:  # more steps than announced: double the buffers
            self.logprobs = torch.cat([self.logprobs, torch.zeros_like(self.logprobs)], dim=1)
            self.entropies = torch.cat([self.entropies, torch.zeros_like(self.entropies)], dim=1)
        logp, entropy = _logprobs_and_entropy(scores)
        self.entropies[:, self.step] = entropy
        self.step_logprobs = logp
        return scores

    def captured(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, steps)`` logprobs and entropies of the steps run so far."""
        if self.logprobs is None:
            raise RuntimeError("logprob capture: no step was captured")
        return self.logprobs[:, : self.step], self.entropies[:, : self.step]


class _SampledTokenCapture(StoppingCriteria):
    """Last stopping criterion: ``input_ids[:, -1]`` is the token just chosen; record its logprob.

    Finished rows receive the pad token here; their logprob is junk and is masked out afterwards.
    """

    def __init__(self, scores_capture: _StepScoresCapture) -> None:
        self.scores_capture = scores_capture

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs
    ) -> torch.Tensor:
        capture = self.scores_capture
        step = capture.step_logprobs
        if step is None:  # pragma: no cover - the processor always runs first in `_sample`
            raise RuntimeError("logprob capture: stopping criteria called before the logits processor")
        tokens = input_ids[:, -1:].to(step.device)
        capture.logprobs[:, capture.step] = step.gather(-1, tokens).squeeze(-1)
        capture.step_logprobs = None  # drop the (B, V) tensor: only one step is ever held
        capture.step += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def pure_sampling_config(
    temperature: float, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int | None
) -> GenerationConfig:
    """Pure temperature sampling, ``softmax(logits / temperature)``: the distribution PPO's logprobs describe.

    Every truncating or penalising field is set to its neutral value explicitly because ``generate`` fills
    each unset (``None``) field from the checkpoint's ``generation_config`` (Qwen3 ships ``top_k=20,
    top_p=0.95``, Qwen2.5 ``repetition_penalty=1.05``), which would sample another policy than the one the
    teacher-forced logprobs describe. ``min_new_tokens`` is 0: a forced minimum would change the
    distribution too, and ``generate`` sets ``min_length`` from it (prompt length + 0), whatever a
    checkpoint's ``min_length``. ``min_length`` itself stays unset: setting it too made transformers warn
    at every call that both are set. ``eos_token_id`` is passed as a list: an empty list means "never stop",
    where None would fall back to the checkpoint's EOS. ``prefill_chunk_size`` is decided by
    :func:`generate_with_logprobs`, not here: it prefills in one call whatever a checkpoint sets (None here
    would be filled from the checkpoint).
    """
    return GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=list(eos_token_id),
    )


def _expected_new_tokens(config: GenerationConfig, prompt_len: int) -> int:
    """Buffer size for the per-step results of a resolved config (+1 for a deferred-stop extra step)."""
    if config.max_length is not None:  # `generate` has set it from max_new_tokens by now
        return max(config.max_length - prompt_len, 0) + 1
    return 256  # unknown budget: the buffers grow by doubling


def _needs_synced_gpus(model: torch.nn.Module) -> bool:
    """Mirror of ``generate``'s own default: under ZeRO-3/FSDP every rank must keep stepping until all finish.

    ``generate`` drops its ``synced_gpus`` keyword for a callable ``custom_generate``, so we recompute it.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() <= 1:
        return False
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    try:
        from transformers.distributed.fsdp import is_fsdp_managed_module
    except ImportError:  # older transformers
        from transformers.integrations.fsdp import is_fsdp_managed_module
    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model) or has_fsdp2_modules(model))


@torch.no_grad()
def generate_with_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig | None = None,
) -> RolloutOutput:
    """Sample (or greedily decode) completions and record each token's log-probability and entropy.

    Memory: one step of scores, ``O(B x V)``, instead of the ``(B, T, V)`` stack that
    ``output_scores=True`` keeps.

    Args:
        model: a causal LM with ``generate`` (a ``PreTrainedModel`` or a ``peft.PeftModel`` around one).
            Put it in ``eval()`` mode first if it has dropout.
        input_ids: ``(B, P)`` long, LEFT-padded prompts.
        attention_mask: ``(B, P)``, 1 on prompt tokens, 0 on left padding.
        generation_config: decoding settings (``do_sample``, ``temperature``, ``max_new_tokens``,
            ``eos_token_id``, ...); defaults to ``model.generation_config``. It is not modified; unset
            fields fall back to ``model.generation_config`` exactly as in ``generate``. Only sampling and
            greedy decoding are supported (``num_beams=1``, no assistant model). ``num_return_sequences=n``
            returns ``B * n`` rows. Completions are delimited by EOS only: a custom stopping rule that ends
            a row without EOS (``stop_strings``, ``max_time``) is not reflected in the mask.

    Returns:
        :class:`RolloutOutput`. ``logprobs``/``entropies`` describe the distribution the token was drawn
        from: the processed scores (temperature, repetition penalty, top-k/top-p truncation, ...) when
        sampling, the unscaled softmax when greedy (``generate`` applies no temperature then). For PPO use
        ``top_k=0, top_p=1.0`` so that :func:`forward_logprobs` with the same temperature reproduces them.
    """
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    # The whole point is not to keep per-step scores: make sure `generate` does not keep them either.
    config.output_scores = False
    config.output_logits = False
    config.return_dict_in_generate = False

    scores_capture = _StepScoresCapture()
    token_capture = _SampledTokenCapture(scores_capture)
    resolved: dict[str, Any] = {}
    synced_gpus = _needs_synced_gpus(model)

    def decode_with_capture(
        model: torch.nn.Module,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria,
        generation_config: GenerationConfig,
        **model_kwargs,
    ) -> torch.LongTensor:
        # `generate` has merged the caller's config with the model defaults and built every processor and
        # warper; appending here (not via `generate(logits_processor=...)`, which inserts custom processors
        # *before* the temperature/top-k/top-p warpers) puts the capture after all of them.
        mode = generation_config.get_generation_mode()
        if mode not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH):
            raise ValueError(f"generate_with_logprobs supports sampling and greedy decoding only, got {mode}")
        # One prefill call: a checkpoint's generation_config.json may set prefill_chunk_size, which the merge
        # above copies into any config left at None (a GenerationConfig cannot say "None, meant"), and what
        # records each decoder call (the head critic's values, the shared prefix's states) reads the last
        # position of the first call as the state before the first sampled token. The sampled distribution
        # is the same either way.
        generation_config.prefill_chunk_size = None
        resolved["eos"] = eos_token_id_list(generation_config.eos_token_id)
        resolved["pad"] = generation_config.pad_token_id
        scores_capture.capacity = _expected_new_tokens(generation_config, input_ids.shape[1])
        logits_processor.append(scores_capture)
        stopping_criteria.append(token_capture)
        return type(model)._sample(
            model,
            input_ids,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            synced_gpus=synced_gpus,
            **model_kwargs,
        )

    sequences = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        custom_generate=decode_with_capture,
    )

    prompt_len = input_ids.shape[1]
    generated = sequences[:, prompt_len:]
    batch, steps = generated.shape
    device = generated.device
    # Some decoding loops (transformers' deferred stop check) run one step more and drop its token: keep
    # the captured steps that correspond to returned tokens.
    if steps > 0:
        logprobs, entropies = scores_capture.captured()
        logprobs, entropies = logprobs[:, :steps].to(device), entropies[:, :steps].to(device)
    else:
        logprobs = torch.zeros(batch, 0, device=device)
        entropies = torch.zeros(batch, 0, device=device)

    eos_ids = resolved.get("eos", [])
    pad_id = resolved.get("pad")
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    if eos_ids:
        is_eos = torch.isin(generated, torch.tensor(eos_ids, device=device))
    else:
        is_eos = torch.zeros_like(generated, dtype=torch.bool)
    # Valid = no EOS strictly before t. Computed from EOS positions, not `!= pad`: Qwen3's pad token
    # (<|endoftext|>) is also one of its EOS ids.
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()
    mask = eos_before == 0
    is_truncated = ~is_eos.any(dim=1)

    # Trim trailing columns that are padding in every row: the longest valid row sets T.
    width = int(mask.sum(dim=1).max().item()) if batch > 0 else 0
    mask = mask[:, :width]
    completion_ids = generated[:, :width].masked_fill(~mask, pad_id)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return RolloutOutput(
        completion_ids=completion_ids,
        completion_mask=mask.long(),
        logprobs=torch.where(mask, logprobs[:, :width].float(), zero),
        entropies=torch.where(mask, entropies[:, :width].float(), zero),
        is_truncated=is_truncated,
    )


def _head_chunk_logprobs(
    states: torch.Tensor,
    tokens: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, H)`` hidden states, ``(n,)`` tokens -> ``(n,)`` logprobs and entropies via ``head``'s logits."""
    return _chunk_logprobs(head(states), tokens, temperature, with_entropy)


def logprobs_from_hidden_states(
    hidden_states: torch.Tensor,
    head: torch.nn.Module,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of completion tokens from the final hidden states that predict them.

    Only the valid positions are used: they are gathered across rows into ``(N, H)`` (N = number of valid
    tokens) and ``head`` is applied to ``chunk_size`` of them at a time; each chunk's logits are reduced to
    the sampled token's log-probability (and entropy) at once and dropped. Under grad every chunk is
    checkpointed (non-reentrant), so backward recomputes its logits: no ``(B, T, V)`` tensor exists in the
    forward or the backward, and the extra memory is at most three ``(chunk_size, V)`` float32 tensors
    (:data:`LOGPROB_CHUNK_BYTES_PER_ELEMENT`).

    Args:
        hidden_states: ``(B, T, H)``; ``hidden_states[:, t]`` predicts ``completion_ids[:, t]``.
        head: the output head (``model.get_output_embeddings()``), applied as a module.
        completion_ids: ``(B, T)`` long.
        completion_mask: ``(B, T)``, 1 on valid tokens.
        temperature: the sampling temperature the logits are divided by.
        return_entropy: also return per-token entropies of the tempered distribution.
        chunk_size: positions per head call; None: :func:`default_logprob_chunk_size` of the head's
            vocabulary (a ~64 MiB working set).

    Returns:
        ``(logprobs, entropies)``: ``(B, T)`` float32 each, 0 on masked positions; ``entropies`` is None
        unless ``return_entropy``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk_size = resolve_chunk_size(chunk_size, head_vocab_size(head))
    valid = completion_mask.bool()
    states = hidden_states[valid]  # (N, H), row-major: the order masked_scatter fills back in
    targets = completion_ids[valid]
    chunks = list(zip(states.split(chunk_size), targets.split(chunk_size)))
    # A sharded head gathers its weight in every call (and again in the backward of each checkpointed chunk),
    # so every process must call it as often as the one with the most valid tokens: the others add padding
    # chunks whose results are multiplied by 0.
    num_padding = agreed_head_calls(head, len(chunks), hidden_states.device) - len(chunks)
    use_checkpoint = torch.is_grad_enabled()

    def run(chunk: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return checkpointed(
            _head_chunk_logprobs, chunk, tokens, head, temperature, return_entropy, enabled=use_checkpoint
        )

    pieces_lp: list[torch.Tensor] = []
    pieces_ent: list[torch.Tensor] = []
    for chunk, tokens in chunks:
        lp, ent = run(chunk, tokens)
        pieces_lp.append(lp)
        pieces_ent.append(ent)
    zeros = torch.zeros(valid.shape, dtype=torch.float32, device=hidden_states.device)
    logprobs = zeros.masked_scatter(valid, torch.cat(pieces_lp)) if pieces_lp else zeros
    entropies = None
    if return_entropy:
        entropies = zeros.masked_scatter(valid, torch.cat(pieces_ent)) if pieces_ent else zeros.clone()
    if num_padding > 0:
        padding = _padding_chunk(hidden_states, completion_ids)
        for _ in range(num_padding):
            lp, ent = run(*padding)
            # Times 0, but in the graph: the backward recomputes the chunk (one more gather, as the other
            # processes' real chunks do) whether or not the head itself is trained.
            logprobs = logprobs + lp.sum() * 0.0
            if entropies is not None:
                entropies = entropies + ent.sum() * 0.0
    return logprobs, entropies


def _padding_chunk(
    hidden_states: torch.Tensor, completion_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One position for a padding head call: the first hidden state (a slice, so the call's backward runs
    when the decoder is trained and the head frozen, e.g. LoRA) and its token; zeros if there is none."""
    states = hidden_states.reshape(-1, hidden_states.shape[-1])
    if states.shape[0] == 0:
        return hidden_states.new_zeros(1, hidden_states.shape[-1]), completion_ids.new_zeros(1)
    return states[:1], completion_ids.reshape(-1)[:1]


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    num_completion_tokens: int,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of the last ``num_completion_tokens`` tokens of each sequence.

    The inputs are :func:`~trl_sae.generation.inputs.sequence_inputs`' ``[left-padded prompt | right-padded
    completion]``: the completion is ``input_ids[:, -T:]`` with mask ``attention_mask[:, -T:]``. When
    :func:`output_head_split` finds the decoder and the head, the decoder runs without the head and
    :func:`logprobs_from_hidden_states` applies the head chunk by chunk (no ``(B, T, V)`` logits); otherwise
    the model is asked for ``logits_to_keep = T + 1`` logits, reduced by :func:`logprobs_from_logits`, and
    the reason is logged once.

    Args:
        model: causal LM (``PreTrainedModel``, ``PeftModel``, or a DDP-style wrapper of one).
        input_ids: ``(B, P + T)`` long.
        attention_mask: ``(B, P + T)``.
        position_ids: ``(B, P + T)``.
        num_completion_tokens: ``T``.
        temperature: the sampling temperature of the rollout.
        return_entropy: also return per-token entropies.
        chunk_size: positions per chunk; None: chosen from the vocabulary
            (:func:`default_logprob_chunk_size`).

    Returns:
        ``(logprobs, entropies)``: ``(B, T)`` float32 each, 0 on masked positions; ``entropies`` is None
        unless ``return_entropy``. Differentiable w.r.t. the model's parameters.
    """
    steps = num_completion_tokens
    completion_ids = input_ids[:, input_ids.shape[1] - steps :]
    completion_mask = attention_mask[:, attention_mask.shape[1] - steps :]
    if steps == 0:
        empty = torch.zeros(input_ids.shape[0], 0, device=input_ids.device)
        return empty, (empty.clone() if return_entropy else None)
    split = output_head_split(model)
    if isinstance(split, str):
        logger.warning_once(
            f"Log-probabilities through full logits ((B, T, V) in memory): {split}; the chunked head "
            "needs get_decoder()/get_output_embeddings() and no logit transform after the head."
        )
        kwargs: dict[str, Any] = {}
        if supports_logits_to_keep(model):
            # Only the last T + 1 positions are needed: skip the lm_head over the prompt.
            kwargs["logits_to_keep"] = steps + 1
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **kwargs,
        )
        # Position P - 1 + t predicts completion token t.
        logits = outputs.logits[:, -(steps + 1) : -1]
        return logprobs_from_logits(
            logits, completion_ids, completion_mask, temperature, return_entropy, chunk_size
        )
    decoder, head = split
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    # Position P - 1 + t predicts completion token t.
    hidden = hidden[:, -(steps + 1) : -1]
    return logprobs_from_hidden_states(
        hidden, head, completion_ids, completion_mask, temperature, return_entropy, chunk_size
    )


def forward_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced log-probabilities of completion tokens (the PPO update and the reference policy).

    Runs the model on ``[left-padded prompt | right-padded completion]`` with
    ``position_ids = cumsum(attention_mask) - 1`` and evaluates the tempered ``log_softmax`` of the
    positions that predict each completion token at that token (:func:`sequence_logprobs`): the output
    head is applied ``chunk_size`` valid positions at a time and, under grad, each chunk is checkpointed,
    so neither the forward nor the backward holds ``(B, T, V)`` logits. Differentiable w.r.t. the model's
    parameters.

    Args:
        model: causal LM (``PreTrainedModel`` or ``PeftModel``).
        prompt_ids: ``(B, P)`` long, left-padded.
        prompt_mask: ``(B, P)``, 0 on left padding.
        completion_ids: ``(B, T)`` long, right-padded.
        completion_mask: ``(B, T)``, 1 on valid tokens (up to and including EOS).
        temperature: the sampling temperature of the rollout (1.0 for greedy rollouts).
        return_entropy: also return per-token entropies of the tempered distribution.
        chunk_size: positions per chunk (None: chosen from the vocabulary); peak extra memory is about
            ``LOGPROB_CHUNK_BYTES_PER_ELEMENT * chunk_size * V`` bytes, 64 MiB by default.

    Returns:
        ``(logprobs, entropies)``: ``(B, T)`` float32 each, 0 on masked positions; ``entropies`` is None
        unless ``return_entropy``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    inputs = sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    return sequence_logprobs(
        model,
        **inputs,
        num_completion_tokens=completion_ids.shape[1],
        temperature=temperature,
        return_entropy=return_entropy,
        chunk_size=chunk_size,
    )
