"""Peak memory of one PPO + SAE step in three set-ups: measured on CPU, and a formula for GPUs.

Set-ups (the same Qwen3-shaped model, batch, response length and seeds; ``kl_coef=0``, so no reference model;
activation checkpointing on, as the GPU formula assumes):

* ``full`` (a): full policy + a full critic built from the policy's weights (no peft),
* ``lora`` (b): LoRA policy (r=16, all linear layers) + a separate full critic (``value_model=<path>``),
* ``qlora_shared`` (c): QLoRA (NF4 base via ``load_in_4bit=True`` from a path) + the default shared critic
  (a second LoRA adapter and a value head on the policy's own base, ``value_model="shared"``).

Usage::

    python benchmarks/bench_memory.py                  # measure (a), (b), (c) on CPU, then the GPU estimates
    python benchmarks/bench_memory.py --estimate-only  # only the GPU estimate table (instant)
    python benchmarks/bench_memory.py --smoke          # tiny shapes, all three in-process (seconds)

Two results:

1. **Measured (CPU, float32)**: each set-up runs in a fresh subprocess: a warm-up PPO step (it creates the
   AdamW states), then the measured one (rollout, values, advantages, one update); the table gives that
   step's peak resident memory above the process baseline after imports, a
   static count of weight / gradient / optimizer-state bytes, the ratio to (a), and :func:`estimate_gpu_memory`
   evaluated for the same shape in float32 with the ratio measured / formula.
2. **Estimated (GPU, bf16)**: :func:`estimate_gpu_memory` for Qwen3-0.6B/1.7B/4B/8B at 2k and 8k context. No
   GPU was available when this was written: those numbers are a formula, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _memory as memory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GIB = 1024**3
MIB = 1024**2
QWEN3_VOCAB_SIZE = 151_936
SETUPS = ("full", "lora", "qlora_shared")
# What benchmarks/gpu_check.py runs besides (c): a bf16 LoRA policy with the head critic (a value head on the
# policy's own hidden states, no second pass) or with the shared-base critic (a second adapter on the same
# bf16 base). Not in the guide's three-column table; the check prints its own.
CHECK_SETUPS = ("lora_head", "lora_shared")
# Bytes per (chunk x V) element of one log-prob chunk's working set (trl_sae.generation.token_logprobs):
# the logits, the float32 log-softmax and one more float32 temporary; measured 12 B in float32 (bench_logprobs_memory.py);
# in bf16 the logits take 2 B less and the bf16 copy of the gradient 2 B more: 12 B too (estimated).
LOGPROB_CHUNK_BYTES_PER_ELEMENT = 12
LOGPROB_CHUNK_BUDGET_BYTES = 64 * MIB  # trl_sae's default chunk keeps its working set within this


def default_logprob_chunk_size(vocab_size: int) -> int:
    """Positions per head call that ``sequence_logprobs`` chooses for ``vocab_size`` (logprob_chunk_size=None).

    Mirrors ``trl_sae.generation.token_logprobs.default_logprob_chunk_size`` (tests/test_bench_memory.py
    checks it) without importing torch, so ``--estimate-only`` stays instant.
    """
    positions = LOGPROB_CHUNK_BUDGET_BYTES // (LOGPROB_CHUNK_BYTES_PER_ELEMENT * vocab_size)
    if positions >= 8:
        positions -= positions % 8
    return max(1, positions)


SETUP_LABELS = {
    "full": "(a) full policy + full critic",
    "lora": "(b) LoRA policy + full critic",
    "qlora_shared": "(c) QLoRA + shared critic adapter",
}

# =========================================================================================================
# GPU memory formula
# =========================================================================================================


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a Qwen3 causal LM that memory depends on."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = QWEN3_VOCAB_SIZE
    tie_word_embeddings: bool = True

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_linears(self) -> list[tuple[int, int]]:
        """``(in, out)`` of the seven linear layers of one decoder layer (q, k, v, o, gate, up, down)."""
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]

    @property
    def layer_linear_params(self) -> int:
        return sum(i * o for i, o in self.layer_linears())

    @property
    def layer_norm_params(self) -> int:
        # input and post-attention RMSNorm (hidden) + Qwen3's per-head q_norm and k_norm (head_dim)
        return 2 * self.hidden_size + 2 * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def body_params(self) -> int:
        """Decoder layers + final norm (everything but the embedding and the head)."""
        return self.num_layers * (self.layer_linear_params + self.layer_norm_params) + self.hidden_size

    @property
    def policy_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.body_params + self.embedding_params + head

    @property
    def critic_params(self) -> int:
        """A separate critic: the backbone + a one-label score head (hidden -> 1, no bias), no lm_head."""
        return self.body_params + self.embedding_params + self.hidden_size

    def lora_params(self, r: int) -> int:
        """Parameters of one LoRA adapter of rank ``r`` on every linear layer of the decoder (not lm_head)."""
        return self.num_layers * r * sum(i + o for i, o in self.layer_linears())

    def layer_activation_elements(self, lora_r: int = 0) -> int:
        """Elements autograd saves per token for one decoder layer's backward (its input excluded).

        ``5 h + 4 q + 4 kv + 4 I``, fitted exactly (residual 0) to ``torch.autograd.graph.saved_tensors_hooks``
        counts of a transformers 5.23 ``Qwen3DecoderLayer`` with SDPA attention over six shapes: the two
        RMSNorms keep float32 intermediates, q/k norms and RoPE keep copies of q and k, SDPA keeps q, k, v
        and its output, the SwiGLU MLP keeps gate, up, act(gate) and their product. A LoRA adapter adds its
        rank-``r`` intermediate on each of the 7 linears.
        """
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return 5 * h + 4 * q + 4 * kv + 4 * inter + 7 * lora_r


# Public configs of the Qwen3 dense models (config.json on the Hub): hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab 151936; the three small ones
# tie the embedding and the lm_head.
QWEN3_SHAPES: dict[str, ModelShape] = {
    "Qwen3-0.6B": ModelShape("Qwen3-0.6B", 1024, 28, 16, 8, 128, 3072, tie_word_embeddings=True),
    "Qwen3-1.7B": ModelShape("Qwen3-1.7B", 2048, 28, 16, 8, 128, 6144, tie_word_embeddings=True),
    "Qwen3-4B": ModelShape("Qwen3-4B", 2560, 36, 32, 8, 128, 9728, tie_word_embeddings=True),
    "Qwen3-8B": ModelShape("Qwen3-8B", 4096, 36, 32, 8, 128, 12288, tie_word_embeddings=False),
}

# NF4 with double quantisation (QLoRA's recipe, the trainer's `_four_bit_config`): 4 bits per weight, one
# 8-bit absmax per 64-weight block, and one float32 absmax per 256 of those blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass
class MemoryEstimate:
    """An estimate of one PPO step's peak memory, term by term (bytes).

    ``terms`` names every contribution; ``phases`` adds them up per phase (the rollout's KV cache and the
    update's activations never coexist); the peak is the largest phase.
    """

    model: str
    setup: str
    context: int
    batch: int
    micro_batch: int
    precision: str
    terms: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return max(self.phases.values())

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)


def estimate_gpu_memory(
    model: str | ModelShape,
    setup: str,
    context: int,
    batch: int = 8,
    *,
    micro_batch: int = 1,
    prompt_length: int = 256,
    lora_r: int = 16,
    precision: str = "bf16",
    runtime_overhead_gib: float = 0.5,
    shared_critic_checkpointed: bool = True,
    logprob_chunk_size: int | None = None,
) -> MemoryEstimate:
    r"""Estimate the peak accelerator memory of one SAEPPOTrainer step (rollout + values + update).

    Args:
        model: a key of :data:`QWEN3_SHAPES` (``"Qwen3-0.6B"`` ... ``"Qwen3-8B"``) or a :class:`ModelShape`.
        setup: ``"full"`` (a), ``"lora"`` (b) or ``"qlora_shared"`` (c), as in the module docstring; or
            ``"lora_head"`` / ``"lora_shared"`` (:data:`CHECK_SETUPS`): a bf16 base with a LoRA policy and the
            head critic (one adapter + a value head, the policy's pass only) or the shared-base critic (two
            adapters + a value head, checkpointed like (c) but in bf16), as ``benchmarks/gpu_check.py`` runs.
        context: tokens per sequence, prompt + response (``S``); the response is ``R = S - prompt_length``.
        batch: completions generated together in the rollout (``per_device_train_batch_size x
            gradient_accumulation_steps``, e.g. 1 prompt x ``num_generations=8``); sets the KV cache and the
            no-grad value pass.
        micro_batch: completions per forward/backward in the update (``per_device_train_batch_size``).
        prompt_length: prompt tokens (``P``); logits are only computed for the ``R`` response positions.
        lora_r: LoRA rank of every adapter (all linear layers of the decoder, not the lm_head).
        precision: ``"bf16"`` (GPU: bf16 weights and activations, fp32 master weights and AdamW states) or
            ``"fp32"`` (everything float32: what the CPU benchmark runs, used to check the formula).
        runtime_overhead_gib: CUDA context + kernels, added once (0 for the CPU check).
        shared_critic_checkpointed: (c)'s shared critic pass is checkpointed like the policy's (the trainer
            does this on one process by running the critic's forward and backward with its adapter active);
            False models several processes (DDP), where the critic pass keeps its activations.

    Returns:
        A :class:`MemoryEstimate` whose ``total_bytes`` is the largest of the three phases.

    Assumptions, term by term (``a`` = activation bytes, 2 in bf16 and 4 in fp32; ``L`` layers, ``h`` hidden,
    ``q = heads x head_dim``, ``kv = kv_heads x head_dim``, ``I`` MLP width, ``V`` = 151,936):

    * **Weights.** (a) policy + separate critic (backbone + a hidden->1 score head, no lm_head) in bf16, 2 B
      each. (b) frozen bf16 policy base + the full critic. (c) the decoder's linear weights in NF4 with
      double quantisation, ``0.5 + 1/64 + 4/16384`` ~ 0.516 B/param (quant constants included); the
      embedding (and the separate lm_head of the 8B) and the norms in **fp32**, 4 B/param, because
      ``peft.prepare_model_for_kbit_training`` (which the trainer calls for a quantized base) upcasts every
      non-4-bit parameter to float32.
    * **LoRA adapters.** Rank ``lora_r`` (default r=16) on q, k, v, o, gate, up, down of every layer:
      ``r x (in + out)`` parameters per linear. PEFT keeps adapter weights in fp32 (``autocast_adapter_dtype``).
      (b) has one adapter (the policy); (c) two (policy and critic) plus the value head (``h + 1`` params).
    * **Gradients + AdamW.** Full fine-tuning under bf16 mixed precision: bf16 weights (2) + bf16 gradients
      (2) + an fp32 master copy (4) + fp32 ``m`` and ``v`` (8) = 16 B/param (torch AMP with fp32 weights and
      fp32 gradients also comes to 16). Loading bf16 weights and letting torch's AdamW keep bf16 states would
      be 8 B/param but rounds away updates at the paper's actor lr of 1e-6, so it is not assumed. LoRA
      adapters and the value head: fp32 weight + fp32 gradient + fp32 ``m``, ``v`` = 16 B/param. In fp32 mode
      there is no master copy (4 + 4 + 8). Gradients exist only during the update (``zero_grad`` sets them to
      None); weights, master copies and AdamW states persist through every phase.
    * **KV cache (rollout).** ``2 x L x kv x S x batch x a`` (K and V for every generated position); every
      sequence is padded to the longest, so ``S`` is the full context. Plus the per-step ``(batch, V)`` logits
      and the two fp32 ``(batch, V)`` tensors the logprob capture and the sampler hold (``rollout_logits``).
      The prompt prefill is ignored (``P`` is small next to ``S``).
    * **Value pass.** A no-grad critic forward over the ``batch`` completions at once: one layer's live
      tensors (``(2 h + 3 I) x a`` per token, the SwiGLU block) plus the bool ``(batch, 1, S, S)`` mask
      transformers builds for padded SDPA inputs.
    * **Activations (update), with activation checkpointing.** Per checkpointed model, the input of every
      layer: ``L x micro_batch x S x h x a`` (the policy; the separate critic in (a) and (b)). The backward
      recomputes one layer at a time: its saved tensors (:meth:`ModelShape.layer_activation_elements`,
      ``5 h + 4 q + 4 kv + 4 I`` per token) plus about as much again of gradients in flight, so twice that.
      (c)'s shared critic is checkpointed on one process (its forward and backward run with the critic
      adapter active); under DDP (``shared_critic_checkpointed=False``) it keeps every layer's saved tensors,
      ``L x micro_batch x S x (5 h + 4 q + 4 kv + 4 I + 7 r) x a``. And (c)'s
      activations and KV cache are **fp32** (``a = 4``) even under bf16: the upcast embedding makes the
      residual stream fp32 and bitsandbytes returns each 4-bit layer's output in its input dtype (checked on
      CPU: after ``prepare_model_for_kbit_training`` with a bf16 compute dtype, hidden states and the KV
      cache are float32, with or without bf16 autocast).
    * **Log-probs (update).** ``trl_sae.generation.capture.sequence_logprobs`` runs the decoder without its
      head, gathers the valid completion positions' last hidden states and applies the head to
      ``logprob_chunk_size`` of them at a time under checkpointing (issue 12): no ``(micro_batch, R, V)``
      logits exist in the forward or the backward. What remains is one chunk's working set, **12 B per
      (chunk x V) element** (the logits, one float32 log-softmax and one float32 temporary; issue 23),
      measured in fp32 on CPU (``benchmarks/bench_logprobs_memory.py``) and the same in bf16 (estimated:
      2 B less for the logits, 2 B more for the bf16 gradient). The default chunk is chosen from ``V`` to
      stay within 64 MiB: 32 positions at V = 151,936, i.e. **57 MiB**. Plus the gathered hidden states and
      their gradient, ``micro_batch x R x h x 2 a``. Before issue 23 a fixed 256-position chunk held about
      20 B per element (~750 MiB); the full-logits path before issue 12 peaked at 8.5 B/element (bf16) of
      ``(micro_batch, R, V)``, 9.6 GiB at ``R = 7936``.
    * **Not counted:** the reference policy (``kl_coef=0``; with a KL penalty (b)/(c) use the base with
      adapters disabled, (a) needs a second full bf16 copy), the CUDA caching allocator's fragmentation
      (typically 5-15 % on top), DeepSpeed/FSDP sharding (this is one GPU holding everything), eager attention
      (its ``S x S`` scores; transformers defaults to SDPA) and the prompt dataset.
    """
    shape = QWEN3_SHAPES[model] if isinstance(model, str) else model
    if setup not in SETUPS + CHECK_SETUPS:
        raise ValueError(f"setup must be one of {SETUPS + CHECK_SETUPS}, got {setup!r}")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    response = context - prompt_length
    if response < 1 or batch < 1 or micro_batch < 1:
        raise ValueError(
            f"need context > prompt_length and positive batches, got context={context}, "
            f"prompt_length={prompt_length}, batch={batch}, micro_batch={micro_batch}"
        )
    L, h, V, S = shape.num_layers, shape.hidden_size, shape.vocab_size, context
    w = 2 if precision == "bf16" else 4  # bytes of a bf16 (or fp32) weight / gradient
    master = 4 if precision == "bf16" else 0  # fp32 master copy under mixed precision only
    adam = 8  # fp32 m and v (LoRA and value-head parameters: fp32 weight 4 + grad 4 + m, v 8 = 16 B)
    act = 4 if setup == "qlora_shared" else w

    terms: dict[str, float] = {}
    if setup == "full":
        full = shape.policy_params + shape.critic_params
        terms["weights"] = full * w
        terms["optimizer"] = full * (master + adam)
        terms["gradients"] = full * w
    elif setup == "lora":
        lora = shape.lora_params(lora_r)
        terms["weights"] = shape.policy_params * w + shape.critic_params * w
        terms["adapters"] = lora * 4
        terms["optimizer"] = lora * adam + shape.critic_params * (master + adam)
        terms["gradients"] = lora * 4 + shape.critic_params * w
    elif setup in CHECK_SETUPS:
        # bf16 base (2 B/param) + fp32 adapters: one (the policy's) and the value head for the head critic,
        # two (policy, critic) and the value head for the shared-base critic.
        adapters = 1 if setup == "lora_head" else 2
        trainable = adapters * shape.lora_params(lora_r) + h + 1
        terms["weights"] = shape.policy_params * w
        terms["adapters"] = trainable * 4
        terms["optimizer"] = trainable * adam
        terms["gradients"] = trainable * 4
    else:
        quantized = L * shape.layer_linear_params
        unquantized = shape.policy_params - quantized
        trainable = 2 * shape.lora_params(lora_r) + h + 1
        terms["weights"] = quantized * NF4_BYTES_PER_PARAM + unquantized * 4
        terms["adapters"] = trainable * 4
        terms["optimizer"] = trainable * adam
        terms["gradients"] = trainable * 4
    terms["runtime"] = runtime_overhead_gib * GIB

    # Rollout: KV cache + one decoding step's logits and the fp32 tensors derived from them.
    terms["kv_cache"] = 2 * L * shape.kv_dim * S * batch * act
    terms["rollout_logits"] = batch * V * (act + 4 + 4)
    # Value pass: no-grad, one layer's SwiGLU working set for the whole batch + the padded-SDPA bool mask.
    terms["value_pass"] = batch * S * (2 * h + 3 * shape.intermediate_size) * act + batch * S * S
    # Update: checkpoint boundaries, one layer's recompute, the shared critic's full activations, logits.
    lora_rank_in_layers = 0 if setup == "full" else lora_r
    layer_bytes = micro_batch * S * shape.layer_activation_elements(lora_rank_in_layers) * act
    critic_kept_whole = setup in ("qlora_shared", "lora_shared") and not shared_critic_checkpointed
    # The head critic reads the policy's own forward: one checkpointed model, not two.
    checkpointed_models = 1 if critic_kept_whole or setup == "lora_head" else 2
    terms["checkpoints"] = checkpointed_models * L * micro_batch * S * h * act
    terms["recompute"] = 2 * layer_bytes
    terms["critic_activations"] = L * layer_bytes if critic_kept_whole else 0.0
    chunk = logprob_chunk_size if logprob_chunk_size is not None else default_logprob_chunk_size(V)
    terms["logits"] = chunk * V * LOGPROB_CHUNK_BYTES_PER_ELEMENT + micro_batch * response * h * 2 * act
    terms["attention_mask"] = micro_batch * S * S

    persistent = terms["weights"] + terms.get("adapters", 0.0) + terms["optimizer"] + terms["runtime"]
    phases = {
        "rollout": persistent + terms["kv_cache"] + terms["rollout_logits"],
        "values": persistent + terms["value_pass"],
        "update": persistent
        + terms["gradients"]
        + terms["checkpoints"]
        + terms["recompute"]
        + terms["critic_activations"]
        + terms["logits"]
        + terms["attention_mask"],
    }
    return MemoryEstimate(
        model=shape.name,
        setup=setup,
        context=context,
        batch=batch,
        micro_batch=micro_batch,
        precision=precision,
        terms=terms,
        phases=phases,
    )


ESTIMATE_CONTEXTS = (2048, 8192)


def estimate_table(
    batch: int = 8, micro_batch: int = 1, prompt_length: int = 256, lora_r: int = 16
) -> list[dict[str, Any]]:
    """The table of docs/guides/gpu-memory.md: every Qwen3 size x context, the three set-ups in GiB."""
    rows = []
    for name in QWEN3_SHAPES:
        for context in ESTIMATE_CONTEXTS:
            estimates = {
                setup: estimate_gpu_memory(
                    name,
                    setup,
                    context,
                    batch,
                    micro_batch=micro_batch,
                    prompt_length=prompt_length,
                    lora_r=lora_r,
                )
                for setup in SETUPS
            }
            rows.append({"model": name, "context": context, "estimates": estimates})
    return rows


def print_estimate_table(
    rows: list[dict[str, Any]], batch: int, micro_batch: int, prompt_length: int
) -> None:
    print(
        f"\nESTIMATED GPU memory of one PPO+SAE step, GiB (bf16, activation checkpointing, LoRA r=16 all-linear, "
        f"rollout batch {batch}, update micro-batch {micro_batch}, prompt {prompt_length} tokens, kl_coef=0)\n"
    )
    print(
        "| model | context | (a) full + full critic | (b) LoRA + full critic | (c) QLoRA + shared | (c)/(a) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        est = row["estimates"]
        cells = [f"{est[s].total_gib:.1f} ({est[s].peak_phase})" for s in SETUPS]
        ratio = est["qlora_shared"].total_bytes / est["full"].total_bytes
        print(f"| {row['model']} | {row['context'] // 1024}k | {' | '.join(cells)} | {ratio:.2f} |")
    print(
        "\n(phase in brackets: where the peak is; rollout = KV cache, update = activations + one log-prob chunk)"
    )


# =========================================================================================================
# CPU measurement
# =========================================================================================================
#
# Why peak RSS measures what we want on CPU: every tensor the step creates lives in this process's
# anonymous memory, and torch's CPU allocator hands blocks straight to malloc/free (there is no caching
# allocator as on CUDA). With glibc told to mmap every block >= 64 KiB (_configure_malloc), a tensor's
# pages enter RSS when it is written and leave when it is freed, so RSS follows the live tensors, and the
# kernel's high-water mark (VmHWM) records their maximum exactly, including peaks too short for a sampling
# thread to catch. Each set-up runs in a fresh subprocess so none reuses another's freed heap.
#
# The baseline is the RSS after every import (torch, transformers, trl, peft, bitsandbytes, trl_sae: the
# same modules for all three set-ups), so "peak above baseline" covers the models, the optimizer states and
# everything the step allocates. Loading is excluded from the peak: after the trainer is built, weights that
# are still views of the memory-mapped checkpoint are copied into anonymous memory (_materialize_weights),
# freed heap is returned to the OS (malloc_trim), and VmHWM is reset to the current RSS (writing "5" to
# /proc/self/clear_refs). Without /proc (not Linux), ru_maxrss is used; it cannot be reset, so the load
# transient is then included (the table says which method ran).


@dataclass(frozen=True)
class BenchConfig:
    """Shape of the benchmark model and of the PPO step; identical for the three set-ups."""

    hidden_size: int = 768
    num_layers: int = 6
    num_heads: int = 12
    num_kv_heads: int = 4
    intermediate_size: int = 2304  # 3 x hidden, Qwen3-0.6B's and -8B's ratio
    vocab_size: int | None = None  # None: the character tokenizer's (100 tokens)
    prompts: int = 2
    num_generations: int = 4
    response_length: int = 64
    lora_r: int = 16
    seed: int = 0
    threads: int = 1

    @property
    def batch(self) -> int:
        return self.prompts * self.num_generations

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SMOKE_CONFIG = BenchConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    prompts=1,
    num_generations=2,
    response_length=4,
    lora_r=4,
)


@dataclass
class SetupResult:
    """One set-up's measurement (bytes)."""

    setup: str
    baseline_bytes: int
    loaded_bytes: int  # RSS after the trainer is built, above the baseline
    resident_bytes: int  # RSS between the two steps (weights + optimizer states), above the baseline
    peak_bytes: int  # highest RSS during the step, above the baseline
    weight_bytes: int  # parameters (+ 4-bit quant constants), counted from the model
    trainable_params: int
    gradient_bytes: int
    optimizer_bytes: int  # AdamW states after the step, counted from the optimizer
    prompt_length: int
    seconds: float
    method: str

    @property
    def static_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def _configure_malloc() -> None:
    """Serve every block of 64 KiB or more with its own mmap, so a freed tensor leaves RSS at once.

    glibc otherwise raises its mmap threshold each time a large block is freed (up to 32 MiB) and then
    recycles tensors through its heap, where fragmentation keeps freed memory resident: measured on the
    QLoRA set-up, RSS stayed ~550 MiB above the live tensors after the update. Setting the threshold
    explicitly (mallopt M_MMAP_THRESHOLD) switches that adaptation off. No-op where glibc is absent.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # -3 = M_MMAP_THRESHOLD


def _materialize_weights(model: Any) -> None:
    """Copy every weight that is still a view of the checkpoint file into ordinary process memory.

    transformers maps the safetensors file and keeps matching-dtype weights as zero-copy views of it; file
    pages join RSS only when first touched, and the mapping lives as long as one view does. For the 4-bit
    set-up that kept the whole float32 checkpoint resident after quantization (166 MiB of reclaimable page
    cache that the set-up does not need), while (a) and (b) would count their weights only during the step.
    Copying makes every weight anonymous memory, counted once, after loading, in all three set-ups alike.
    4-bit weights were created by quantization and are already anonymous.
    """
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if type(parameter).__name__ != "Params4bit":
                parameter.data = parameter.data.clone()
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.clone()


def _release_and_reset_peak() -> bool:
    """Free what can be freed, then make the kernel's peak counter start from the current RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap to the OS before the next baseline
    return memory.reset_peak()


def import_training_stack() -> None:
    """Import everything any set-up uses, so the baseline after imports is the same for all three."""
    import bitsandbytes  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import trl_sae  # noqa: F401


def wide_vocab_qwen3(vocab: int, hidden: int, max_positions: int, seed: int = 0, **shape: Any) -> Any:
    """A randomly initialised Qwen3 with a real-size vocabulary and a tiny body (one layer, one head unless
    ``shape`` says otherwise), its embedding tied as in Qwen3-0.6B/1.7B/4B: the (T, V) terms dominate."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    layout = {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": hidden}
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        **{**layout, **shape},
    )
    return Qwen3ForCausalLM(config)


def build_model_dir(path: str, config: BenchConfig) -> None:
    """Save a randomly initialised Qwen3 of ``config``'s shape and the char tokenizer to ``path`` (float32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_sae.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(config.seed)
    model_config = Qwen3Config(
        vocab_size=config.vocab_size or len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(model_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    with _quiet_libraries():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def bench_shape(config: BenchConfig) -> ModelShape:
    """The benchmark model as a :class:`ModelShape`, for the formula check."""
    vocab = config.vocab_size or 100  # build_char_tokenizer(): 3 specials + 97 printable characters
    return ModelShape(
        "bench",
        config.hidden_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )


def _vowel_share(prompts: list[Any], completions: list[str], completion_ids: list[Any], **kw: Any) -> list:
    # The reward's value does not change memory; a vowel share keeps the advantages non-degenerate.
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def _parameter_bytes(parameter: Any) -> int:
    """Storage of a parameter, plus a bitsandbytes 4-bit weight's quantisation constants."""
    import torch

    total = parameter.numel() * parameter.element_size()
    pending = [getattr(parameter, "quant_state", None)]
    seen: set[int] = set()
    while pending:
        state = pending.pop()
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif hasattr(value, "absmax"):  # the nested state of double quantisation
                pending.append(value)
    return total


@contextlib.contextmanager
def _quiet_libraries() -> Any:
    """Silence load reports, deprecation notes and progress bars (not what is measured), then restore them."""
    import datasets
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers_bars = transformers.utils.logging.is_progress_bar_enabled()
    datasets_bars = datasets.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if transformers_bars:
            transformers.logging.enable_progress_bar()
        if datasets_bars:
            datasets.enable_progress_bars()


def _peak_marker(baseline: int) -> Any:
    """A trainer callback that, after the first step, releases freed memory and restarts the peak counter."""
    from transformers import TrainerCallback

    class PeakMarker(TrainerCallback):
        resettable = False
        between_steps = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                self.resettable = _release_and_reset_peak()
                self.between_steps = memory.rss_bytes() - baseline

    return PeakMarker()


def measure_setup(setup: str, model_dir: str, config: BenchConfig) -> SetupResult:
    """Build the trainer of ``setup`` from ``model_dir``, run a warm-up PPO step and measure the next one.

    Call :func:`import_training_stack` first: the baseline is taken on entry. The static counts (weights,
    gradients of the trainable parameters, AdamW states) are read from the model and optimizer afterwards.
    """
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers.trainer_callback import PrinterCallback

    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer

    torch.set_num_threads(config.threads)
    _release_and_reset_peak()
    baseline = memory.rss_bytes()
    start = time.perf_counter()
    tokenizer = build_char_tokenizer()
    prompts = [f"Say vowels {i}:" for i in range(config.prompts)]
    with _quiet_libraries(), tempfile.TemporaryDirectory() as output_dir:
        args = SAEPPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=config.batch,
            gradient_accumulation_steps=1,
            num_generations=config.num_generations,
            response_length=config.response_length,
            num_ppo_epochs=1,
            num_mini_batches=1,
            max_steps=2,  # a warm-up step, then the measured one
            kl_coef=0.0,
            temperature=1.0,
            learning_rate=1e-5,
            critic_learning_rate=1e-5,
            gradient_checkpointing=True,
            load_in_4bit=setup == "qlora_shared",
            stop_token=None,  # every completion runs the full response_length: same tokens in every set-up
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            use_cpu=True,
            seed=config.seed,
        )
        peft_config = None
        if setup != "full":
            peft_config = LoraConfig(
                r=config.lora_r, lora_alpha=2 * config.lora_r, lora_dropout=0.0, target_modules="all-linear"
            )
        trainer = SAEPPOTrainer(
            model=model_dir,
            reward_funcs=_vowel_share,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            # (a) None: a critic built from the policy; (b) a separate full critic loaded from the same
            # checkpoint; (c) None with a peft_config: the shared critic adapter.
            value_model=model_dir if setup == "lora" else None,
            peft_config=peft_config,
        )
        _materialize_weights(trainer.model)
        _release_and_reset_peak()
        loaded = memory.rss_bytes() - baseline
        # The first step creates AdamW's states (after that step's backward) and runs one-time set-up
        # (thread pools, bitsandbytes' CPU weight repacking); the second is the steady state a training run
        # repeats, with the optimizer states resident through the rollout and the backward. Measure that one.
        trainer.remove_callback(PrinterCallback)  # the step's metrics would drown the table
        marker = _peak_marker(baseline)
        trainer.add_callback(marker)
        trainer.train()
        peak = memory.peak_bytes() - baseline
        resettable = marker.resettable
        seconds = time.perf_counter() - start

        wrapper = trainer.accelerator.unwrap_model(trainer.model)
        weight_bytes = gradient_bytes = trainable = 0
        for parameter in wrapper.parameters():  # parameters() yields tied weights once
            weight_bytes += _parameter_bytes(parameter)
            if parameter.requires_grad:
                trainable += parameter.numel()
                gradient_bytes += parameter.numel() * parameter.element_size()
        optimizer_bytes = sum(
            value.numel() * value.element_size()
            for state in trainer.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        prompt_length = len(tokenizer(prompts[0], add_special_tokens=False)["input_ids"])
    return SetupResult(
        setup=setup,
        baseline_bytes=baseline,
        loaded_bytes=loaded,
        resident_bytes=marker.between_steps,
        peak_bytes=peak,
        weight_bytes=weight_bytes,
        trainable_params=trainable,
        gradient_bytes=gradient_bytes,
        optimizer_bytes=optimizer_bytes,
        prompt_length=prompt_length,
        seconds=seconds,
        method="VmHWM reset after the warm-up step" if resettable else "ru_maxrss (includes loading)",
    )


def _run_worker(setup: str, model_dir: str, config: BenchConfig) -> SetupResult:
    """Measure ``setup`` in a fresh Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            setup,
            "--model-dir",
            model_dir,
            "--worker-output",
            result_path,
            "--config-json",
            json.dumps(asdict(config)),
        ]
        return SetupResult(**memory.run_worker(command, f"{setup} worker", result_file=result_path))


def run_benchmark(config: BenchConfig, in_process: bool = False) -> list[SetupResult]:
    """Measure the three set-ups on one saved model (each in its own subprocess unless ``in_process``)."""
    with tempfile.TemporaryDirectory() as model_dir:
        build_model_dir(model_dir, config)
        results = []
        for setup in SETUPS:
            if in_process:
                import_training_stack()
                results.append(measure_setup(setup, model_dir, config))
            else:
                results.append(_run_worker(setup, model_dir, config))
            print(f"  measured {setup}: peak {results[-1].peak_bytes / MIB:.0f} MiB", file=sys.stderr)
        return results


def formula_for(config: BenchConfig, result: SetupResult) -> MemoryEstimate:
    """The formula for the benchmark's own shape and batch, in float32 with no CUDA overhead."""
    return estimate_gpu_memory(
        bench_shape(config),
        result.setup,
        context=result.prompt_length + config.response_length,
        batch=config.batch,
        micro_batch=config.batch,
        prompt_length=result.prompt_length,
        lora_r=config.lora_r,
        precision="fp32",
        runtime_overhead_gib=0.0,
    )


def print_measured_table(config: BenchConfig, results: list[SetupResult], in_process: bool) -> None:
    shape = bench_shape(config)
    print(
        f"\nMEASURED on CPU (float32), one PPO step: Qwen3-shaped model, hidden {config.hidden_size}, "
        f"{config.num_layers} layers, {config.num_heads} heads ({config.num_kv_heads} KV), MLP "
        f"{config.intermediate_size}, vocab {shape.vocab_size}: {shape.policy_params / 1e6:.1f}M params; "
        f"batch {config.batch} ({config.prompts} prompts x {config.num_generations}), "
        f"response {config.response_length} tokens, LoRA r={config.lora_r}, seed {config.seed}, kl_coef=0, "
        f"activation checkpointing; {'all in one process (smoke)' if in_process else 'one subprocess each'}."
        f" Peak = highest RSS during the step above the after-import baseline ({results[0].method}).\n"
    )
    print(
        "| set-up | trainable params | weights | grads | AdamW states | static total | measured peak | "
        "peak / (a) | formula (fp32) | measured / formula |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    reference = results[0].peak_bytes
    for result in results:
        formula = formula_for(config, result)
        print(
            f"| {SETUP_LABELS[result.setup]} | {result.trainable_params / 1e6:.2f}M | "
            f"{result.weight_bytes / MIB:.0f} MiB | {result.gradient_bytes / MIB:.0f} MiB | "
            f"{result.optimizer_bytes / MIB:.0f} MiB | {result.static_bytes / MIB:.0f} MiB | "
            f"{result.peak_bytes / MIB:.0f} MiB | {result.peak_bytes / reference:.2f} | "
            f"{formula.total_bytes / MIB:.0f} MiB | {result.peak_bytes / formula.total_bytes:.2f} |"
        )
    if in_process:
        print(
            "\n(smoke: tiny shapes in one process; one-time allocations dominate, so the ratios mean nothing)"
        )
        return
    ratio = results[-1].peak_bytes / reference
    verdict = "meets" if ratio <= 1 / 3 else "MISSES"
    print(f"\n(c) / (a) measured peak = {ratio:.2f}: {verdict} the target of <= 1/3.")


# =========================================================================================================
# Command line
# =========================================================================================================


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--estimate-only", action="store_true", help="Print only the GPU estimate table.")
    parser.add_argument("--smoke", action="store_true", help="Tiny shapes, all set-ups in this process.")
    parser.add_argument("--in-process", action="store_true", help="Do not spawn a subprocess per set-up.")
    parser.add_argument("--json", help="Also write every number to this JSON file.")
    defaults = BenchConfig()
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("prompts", "num_generations", "response_length", "lora_r", "seed", "threads"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--estimate-batch", type=int, default=8, help="Rollout batch of the GPU estimate.")
    parser.add_argument("--estimate-micro-batch", type=int, default=1, help="Update micro-batch (GPU).")
    parser.add_argument("--estimate-prompt-length", type=int, default=256, help="Prompt tokens (GPU).")
    # Internal: one set-up's measurement in a fresh process.
    parser.add_argument("--worker", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.worker or (args.in_process and not args.smoke):
        # Process-wide and irreversible, so never from --smoke, which tests run inside pytest.
        _configure_malloc()
    if args.worker:
        import_training_stack()
        config = BenchConfig(**json.loads(args.config_json))
        result = measure_setup(args.worker, args.model_dir, config)
        with open(args.worker_output, "w") as handle:
            json.dump(asdict(result), handle)
        return

    output: dict[str, Any] = {}
    if not args.estimate_only:
        if args.smoke:
            config = replace(SMOKE_CONFIG, threads=args.threads)
        else:
            config = BenchConfig(
                **{name: getattr(args, name) for name in BenchConfig.__dataclass_fields__},
            )
        in_process = args.smoke or args.in_process
        results = run_benchmark(config, in_process=in_process)
        print_measured_table(config, results, in_process)
        output["config"] = asdict(config)
        output["measured"] = [
            {**asdict(r), "formula_bytes": formula_for(config, r).total_bytes} for r in results
        ]
    if not args.smoke:
        rows = estimate_table(args.estimate_batch, args.estimate_micro_batch, args.estimate_prompt_length)
        print_estimate_table(
            rows, args.estimate_batch, args.estimate_micro_batch, args.estimate_prompt_length
        )
        output["estimated"] = [
            {
                "model": row["model"],
                "context": row["context"],
                **{
                    s: {"gib": e.total_gib, "phase": e.peak_phase, "terms": e.terms}
                    for s, e in row["estimates"].items()
                },
            }
            for row in rows
        ]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(output, handle, indent=2)


if __name__ == "__main__":
    main()
