"""Benchmarks of the SAE PPO trainer's rollout machinery.

Run ``python benchmarks/bench_trainer.py`` (``--quick`` for a seconds-long smoke run). Each section is a
``*_comparison`` function that returns its measurements and a ``print_*_table`` function; ``main`` runs the
sections not skipped (``--skip-memory``, ...) and prints one Markdown table per section.

Timing section: seconds per PPO step of TRL's stock ``PPOTrainer`` (TRL 1.12; left out on 1.13+, which
deleted it) against ``SAEPPOTrainer`` with the ``gae`` and ``sae`` estimators on the same tiny model and batch, as ratios measured in one run; then, without
a KL penalty (GRPO takes none), ``grpo`` against ``sae`` with each critic: a separate model or the head
critic (``value_model="head"``) on a full policy, the shared-base or the head critic on a LoRA policy.

Memory section: peak extra memory of capturing per-token log-probabilities during generation
(:func:`trl_sae.generation.capture.generate_with_logprobs`, one ``(B, V)`` step at a time) against TRL's stored-scores
approach (``generate(output_scores=True)``, stack the ``T`` scores into ``(B, T, V)``, then TRL's
``selective_log_softmax``), at Qwen3's vocabulary size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _memory as memory
from bench_memory import QWEN3_VOCAB_SIZE, wide_vocab_qwen3

MIB = 1024**2
VARIANTS = ("generate_only", "capture", "stored_scores")

# ---------------------------------------------------------------------------------------------------------
# Logprob capture memory
# ---------------------------------------------------------------------------------------------------------
#
# Method. Each variant runs in a fresh Python subprocess (so neither inherits the other's heap or
# high-water mark) that builds the same tiny Qwen3-shaped model with the full 151,936-token vocabulary
# (hidden size 64: the lm_head output is what scales with V, and it has the real shape (B, V) per step),
# warms up with a 2-token run of the same variant (thread pools, lazy allocations), then:
#   1. records the current resident set size (VmRSS) as the baseline,
#   2. resets the kernel's peak-RSS counter (writing "5" to /proc/self/clear_refs sets VmHWM to the
#      current RSS),
#   3. runs the variant for exactly T new tokens (min_new_tokens = max_new_tokens = T, so EOS cannot end
#      it early),
#   4. reads the peak (VmHWM); extra = peak - baseline.
# Extra memory therefore covers everything the variant allocates on top of the loaded model: KV cache,
# per-step logits and, for the stored-scores variant, the scores.
# The workers run with MALLOC_MMAP_THRESHOLD_=1 MiB: every block of 1 MiB or more (each (B, V) step is
# 4.6 MiB) is then its own mmap, returned to the kernel when the tensor is freed, so RSS follows the live
# tensors, as a GPU caching allocator's "allocated" counter would. With glibc's default (a threshold
# that rises after the first free), freed step blocks stay in a fragmented heap and the same runs read
# 4.8-7.0 GB for stored scores and 40-65 MiB for the capture, varying from run to run
# (--default-malloc reproduces that).
# Where /proc is unavailable (not Linux) the worker falls back to resource.getrusage's ru_maxrss, which
# cannot be reset, so the baseline is the high-water mark after warm-up (a lower bound of the extra memory). The analytic size of one float32
# (B, V) step and of the (B, T, V) stack is printed alongside for reference.


@dataclass
class MemoryResult:
    """One variant's measurement (bytes)."""

    variant: str
    baseline_bytes: int
    peak_bytes: int
    extra_bytes: int
    seconds: float
    method: str


def build_wide_vocab_model(vocab_size: int = QWEN3_VOCAB_SIZE, hidden_size: int = 64, seed: int = 0):
    """A randomly initialised Qwen3-shaped causal LM with a real-size vocabulary and a tiny body."""
    shape = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    tokens = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
    model = wide_vocab_qwen3(
        vocab_size, hidden_size, 4096, seed, **shape, head_dim=hidden_size // 4, **tokens
    )
    return model.eval()


def _run_variant(variant: str, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int):
    """Generate exactly ``new_tokens`` tokens and return the (B, T) log-probabilities of the sampled tokens."""
    from transformers import GenerationConfig

    # top_k=0, top_p=1.0: the PPO setting, the full distribution in both variants.
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        eos_token_id=1,
    )
    if variant == "capture":
        from trl_sae.generation.capture import generate_with_logprobs

        return generate_with_logprobs(model, prompt_ids, prompt_mask, config).logprobs
    if variant == "stored_scores":
        from trl.trainer.utils import selective_log_softmax

        # TRL 1.12 PPOTrainer rollout: generate(..., output_scores=True), torch.stack(scores, 1), then
        # selective_log_softmax. TRL's batch_generation also pads the stacked logits into a new tensor
        # (a third copy) before this, so this baseline is a lower bound for TRL.
        with torch.no_grad():
            config.return_dict_in_generate = True  # what TRL passes as generate() keywords
            config.output_scores = True
            output = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
            )
            logits = torch.stack(output.scores, 1)
            completion = output.sequences[:, prompt_ids.shape[1] :]
            del output
            logprobs = selective_log_softmax(logits, completion)
            del logits
        return logprobs
    if variant == "generate_only":
        # The floor: the same generation with no logprobs at all (KV cache and per-step logits only).
        with torch.no_grad():
            sequences = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
            )
        return torch.zeros(sequences.shape[0], sequences.shape[1] - prompt_ids.shape[1])
    raise ValueError(f"unknown variant {variant!r}")


def memory_worker(
    variant: str, vocab_size: int, seq_len: int, batch_size: int, prompt_len: int
) -> MemoryResult:
    """Body of one measurement subprocess (see the method comment above)."""
    torch.set_num_threads(1)  # memory does not depend on it; avoids oversubscribing shared CPUs
    model = build_wide_vocab_model(vocab_size)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, vocab_size, (batch_size, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1::2, : prompt_len // 2] = 0  # ragged, left-padded prompts as in a real batch
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    _run_variant(variant, model, prompt_ids, prompt_mask, 2)

    if memory.reset_peak() and (baseline := memory.status_bytes("VmRSS")) is not None:
        method = "VmHWM - VmRSS (clear_refs)"
    else:
        baseline, method = memory.ru_maxrss_bytes(), "ru_maxrss"
    start = time.perf_counter()
    logprobs = _run_variant(variant, model, prompt_ids, prompt_mask, seq_len)
    seconds = time.perf_counter() - start
    peak = memory.status_bytes("VmHWM") if method.startswith("VmHWM") else memory.ru_maxrss_bytes()
    assert logprobs.shape == (batch_size, seq_len), logprobs.shape
    return MemoryResult(variant, baseline, peak, max(peak - baseline, 0), seconds, method)


def capture_memory_comparison(
    vocab_size: int = QWEN3_VOCAB_SIZE,
    seq_len: int = 512,
    batch_size: int = 8,
    prompt_len: int = 16,
    default_malloc: bool = False,
) -> dict[str, object]:
    """Peak extra memory of in-generation logprob capture vs stored scores, each in a fresh subprocess.

    Returns a dict with one :class:`MemoryResult` (as a dict) per variant (``generate_only``: plain
    ``generate``, the floor; ``capture``; ``stored_scores``), the shape and the ratio
    ``stored_scores.extra / capture.extra``.
    """
    env = dict(os.environ)
    if not default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MIB)
    malloc = "glibc default" if default_malloc else f"MALLOC_MMAP_THRESHOLD_={env['MALLOC_MMAP_THRESHOLD_']}"
    results = {}
    for variant in VARIANTS:
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--memory-worker",
            variant,
            f"--vocab-size={vocab_size}",
            f"--seq-len={seq_len}",
            f"--batch-size={batch_size}",
            f"--prompt-len={prompt_len}",
        ]
        results[variant] = memory.run_worker(command, f"memory worker {variant}", env=env)
    ratio = results["stored_scores"]["extra_bytes"] / max(results["capture"]["extra_bytes"], 1)
    return {
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "malloc": malloc,
        "step_bytes": batch_size * vocab_size * 4,
        "stacked_bytes": batch_size * seq_len * vocab_size * 4,
        **results,
        "ratio": ratio,
    }


def print_memory_table(result: dict[str, object]) -> None:
    capture, stored, floor = result["capture"], result["stored_scores"], result["generate_only"]
    print(
        f"### Logprob capture memory: V={result['vocab_size']}, T={result['seq_len']}, B={result['batch_size']}, "
        f"float32; one (B, V) step = {result['step_bytes'] / MIB:.1f} MiB, (B, T, V) stack = "
        f"{result['stacked_bytes'] / MIB:.0f} MiB; method: {capture['method']}, fresh process per variant, "
        f"{result['malloc']}"
    )
    print()
    print("| variant | peak extra RSS (MiB) | wall time (s), indicative only |")
    print("|---|---|---|")
    print(
        f"| stored scores (TRL: output_scores + stack + selective_log_softmax) | {stored['extra_bytes'] / MIB:,.1f} "
        f"| {stored['seconds']:.1f} |"
    )
    print(
        f"| capture (`generate_with_logprobs`) | {capture['extra_bytes'] / MIB:,.1f} | {capture['seconds']:.1f} |"
    )
    print(
        f"| plain `generate`, no logprobs (floor) | {floor['extra_bytes'] / MIB:,.1f} | {floor['seconds']:.1f} |"
    )
    print(f"| **stored / capture** | **{result['ratio']:.0f}x** | |")
    print()


# ---------------------------------------------------------------------------------------------------------
# Seconds per PPO step: TRL's stock PPOTrainer vs SAEPPOTrainer (gae) vs SAEPPOTrainer (sae)
# ---------------------------------------------------------------------------------------------------------
#
# Method. The three trainers get the same tiny Qwen3 policy, the same critic and reward-model weights (one-
# label sequence classifiers), the same prompts, batch, response length and PPO settings (1 epoch, 1
# mini-batch, kl_coef 0.05 so both run a reference pass, no stop token so every completion has exactly T
# tokens). Stock TRL only has train(), so each variant's time is a whole train() call of `steps` steps
# divided by `steps`; the variants run round-robin `repeats` times and the fastest repeat counts (the
# machine is shared: the minimum is the least disturbed run). One intra-op thread, as the tiny model is
# dispatch-bound.


def _timing_setup(seq_len: int, batch_size: int, seed: int = 0):
    from datasets import Dataset

    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3, build_tiny_qwen3_critic

    tokenizer = build_char_tokenizer()
    prompts = [f"Prompt number {i}:" for i in range(4 * batch_size)]
    ids = [tokenizer(p)["input_ids"] for p in prompts]

    def fresh_models():
        policy = build_tiny_qwen3(tokenizer, hidden_size=128, num_layers=2, seed=seed)
        critic = build_tiny_qwen3_critic(tokenizer, hidden_size=128, num_layers=2, seed=seed + 1)
        reward = build_tiny_qwen3_critic(tokenizer, hidden_size=128, num_layers=2, seed=seed + 2)
        return policy, critic, reward

    return tokenizer, Dataset.from_dict({"input_ids": ids}), fresh_models


def _time_stock_trl(
    tokenizer, dataset, fresh_models, steps: int, seq_len: int, batch_size: int, out: str
) -> tuple[float, None]:
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    policy, critic, reward = fresh_models()
    config = PPOConfig(
        output_dir=out, per_device_train_batch_size=batch_size, total_episodes=steps * batch_size,
        num_ppo_epochs=1, num_mini_batches=1, response_length=seq_len, stop_token=None, kl_coef=0.05,
        temperature=1.0, local_rollout_forward_batch_size=batch_size, num_sample_generations=0,
        use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1,
        gradient_checkpointing=False, seed=0,
    )  # fmt: skip
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
        train_dataset=dataset, value_model=critic, eval_dataset=dataset,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    return (time.perf_counter() - start) / steps, None


def _time_sae_trainer(
    estimator: str,
    tokenizer,
    dataset,
    fresh_models,
    steps: int,
    seq_len: int,
    batch_size: int,
    out: str,
    critic_kind: str | None = "separate",
    lora: bool = False,
    kl_coef: float = 0.05,
) -> tuple[float, float]:
    """Seconds per step of ``SAEPPOTrainer``; ``critic_kind``: "separate" (a second model, as stock TRL),
    "shared" (a second LoRA adapter on the policy's base, needs ``lora``), "head" (a value head on the
    policy's own forward) or None (GRPO)."""
    from peft import LoraConfig

    from trl_sae import SAEPPOConfig, SAEPPOTrainer

    policy, critic, reward = fresh_models()
    config = SAEPPOConfig(
        output_dir=out, advantage_estimator=estimator, per_device_train_batch_size=batch_size,
        num_generations=2, max_steps=steps, num_ppo_epochs=1, num_mini_batches=1, response_length=seq_len,
        stop_token=None, kl_coef=kl_coef, temperature=1.0, local_rollout_forward_batch_size=batch_size,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    value_model = {"separate": critic, "shared": "shared", "head": "head", None: None}[critic_kind]
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0) if lora else None
    )
    trainer = SAEPPOTrainer(
        model=policy, reward_model=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        value_model=value_model, peft_config=peft_config,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - start) / steps
    # the update alone (the trainer's own timing/update_s), where the critics differ: generation dominates
    # the whole step on this tiny model and is what a loaded machine disturbs most
    updates = [e["timing/update_s"] for e in trainer.state.log_history if "timing/update_s" in e]
    return seconds, sorted(updates)[len(updates) // 2]


STOCK_TRL = "TRL PPOTrainer (stock GAE)"


def stock_trl_ppo_available() -> bool:
    """Whether the installed TRL still has its stock PPO trainer (``trl.experimental.ppo``: TRL 1.12; 1.13
    deleted it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("trl.experimental.ppo") is not None
    except ModuleNotFoundError:  # no trl.experimental at all
        return False


def step_time_comparison(steps: int = 6, seq_len: int = 64, batch_size: int = 8, repeats: int = 3) -> dict:
    """Seconds per step of stock TRL PPO (where the installed TRL has it) and SAEPPOTrainer with each critic;
    best of `repeats`."""
    import tempfile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer, dataset, fresh_models = _timing_setup(seq_len, batch_size)
    runners = {}
    if stock_trl_ppo_available():
        runners[STOCK_TRL] = lambda out: _time_stock_trl(
            tokenizer, dataset, fresh_models, steps, seq_len, batch_size, out
        )
    runners |= {
        "SAEPPOTrainer (gae)": lambda out: _time_sae_trainer(
            "gae", tokenizer, dataset, fresh_models, steps, seq_len, batch_size, out
        ),
        "SAEPPOTrainer (sae)": lambda out: _time_sae_trainer(
            "sae", tokenizer, dataset, fresh_models, steps, seq_len, batch_size, out
        ),
    }
    # The critics against GRPO, which takes no KL penalty: kl_coef=0 for all of these (no reference pass).
    for lora, kinds in ((False, (None, "separate", "head")), (True, (None, "shared", "head"))):
        for kind in kinds:
            name = f"{'LoRA ' if lora else ''}kl 0: {'grpo' if kind is None else f'sae, {kind} critic'}"
            runners[name] = lambda out, kind=kind, lora=lora: _time_sae_trainer(
                "grpo" if kind is None else "sae", tokenizer, dataset, fresh_models, steps, seq_len,
                batch_size, out, kind, lora=lora, kl_coef=0.0,
            )  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runners}
    try:
        with tempfile.TemporaryDirectory() as out:
            for _ in range(repeats):
                for name, run in runners.items():
                    times[name].append(run(out))
    finally:
        torch.set_num_threads(threads)
    best = {name: min(step for step, _ in values) for name, values in times.items()}
    update = {
        name: min(u for _, u in values) if values[0][1] is not None else None
        for name, values in times.items()
    }
    return {
        "steps": steps,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "repeats": repeats,
        "all": times,
        "best": best,
        "update": update,
    }


def print_step_time_table(result: dict) -> None:
    best = result["best"]
    stock = best.get(STOCK_TRL)
    gae = best["SAEPPOTrainer (gae)"]
    print(
        f"### Seconds per PPO step (B={result['batch_size']}, T={result['seq_len']}, {result['steps']} steps, "
        f"best of {result['repeats']})"
    )
    print()
    update = result["update"]
    print(
        "| trainer | s/step | vs stock TRL | vs SAEPPOTrainer (gae) | vs grpo (same policy, kl 0) "
        "| update s/step | update vs grpo |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, seconds in best.items():
        grpo_name = "LoRA kl 0: grpo" if name.startswith("LoRA") else "kl 0: grpo"
        versus = update_versus = "-"
        if "kl 0" in name and grpo_name in best:
            versus = f"{seconds / best[grpo_name]:.2f}x"
            update_versus = f"{update[name] / update[grpo_name]:.2f}x"
        own = "-" if update[name] is None else f"{update[name]:.3f}"
        versus_stock = "-" if stock is None else f"{seconds / stock:.2f}x"
        print(
            f"| {name} | {seconds:.3f} | {versus_stock} | {seconds / gae:.3f}x | {versus} | {own} "
            f"| {update_versus} |"
        )
    if stock is None:
        print()
        print("(no stock TRL row: the installed TRL has no trl.experimental.ppo, which TRL 1.13 deleted)")
    print()


# ---------------------------------------------------------------------------------------------------------
# Seconds per step: trl-sae `grpo` against `sae` with the shared-base critic (LoRA), prefix sharing off and on
# ---------------------------------------------------------------------------------------------------------
#
# Method. The issue-21 real-model settings on a tiny model: a tiny Qwen3 (hidden 256, 12 layers) with LoRA
# (r 8, every linear layer) on its last third of layers, as SmolLM2's 10 of 30; 4 prompts x 4 completions of
# exactly `seq_len` tokens, one epoch of 2 mini-batches, micro-batches of 8, kl_coef 0, float32. `grpo` has
# no critic; `sae` trains the shared-base critic (a second adapter + value head on the policy's base), with
# `SharedBaseCritic.share_prefix` off (every pass computes every layer, as before issue 32), on without
# `reuse_generation_prefix` (the unadapted layers once per set of passes on the same rows, `generate`'s
# apart) and on with it (the default: the rollout's value pass replays them from `generate` too). Each arm is a whole `train()` of `steps` steps;
# the arms run round-robin `repeats` times and the fastest repeat counts. Reported per step: wall seconds,
# CPU seconds of the process (one intra-op thread; less disturbed than wall time by a shared machine), and
# the trainer's own `timing/rollout_s` (sampling) and `timing/update_s` (the PPO update); the value pass
# and the advantages are the rest. FLOPs per step (torch's FlopCounterMode over one more step of each arm:
# matmuls and attention, forward and backward, generation included) do not depend on the machine's load.

SHARED_CRITIC_ARMS = {  # name: (estimator, (share_prefix, reuse_generation_prefix) or None: no critic)
    "trl-sae grpo (no critic)": ("grpo", None),
    "trl-sae sae, shared critic, sharing off": ("sae", (False, False)),
    "trl-sae sae, shared critic, sharing on, generate not reused": ("sae", (True, False)),
    "trl-sae sae, shared critic, sharing on": ("sae", (True, True)),
}


def _time_shared_critic_arm(
    estimator: str,
    share: tuple[bool, bool] | None,
    steps: int,
    seq_len: int,
    layers: int,
    out: str,
    flops: bool = False,
) -> dict[str, float]:
    from datasets import Dataset
    from peft import LoraConfig

    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    tokenizer = build_char_tokenizer()
    prompts = [f"Question {i}: what is {i} plus {2 * i}? Think, then answer in one line." for i in range(16)]
    dataset = Dataset.from_dict({"prompt": prompts})
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=list(range(layers - layers // 3, layers)),
    )  # fmt: skip
    config = SAEPPOConfig(
        output_dir=out, advantage_estimator=estimator, per_device_train_batch_size=8, num_generations=4,
        gradient_accumulation_steps=2, num_mini_batches=2, num_ppo_epochs=1, response_length=seq_len,
        stop_token=None, max_steps=steps, learning_rate=1e-3, critic_learning_rate=1e-3, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, hidden_size=256, num_layers=layers, seed=0),
        reward_funcs=lambda completions, **_: [text.count("1") / 4 for text in completions],
        args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
    )  # fmt: skip
    if share is not None:
        critic = trainer.accelerator.unwrap_model(trainer.model)
        critic.share_prefix, critic.reuse_generation_prefix = share
    if flops:  # counted apart from the timed runs: the counter's dispatch slows every op down
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            trainer.train()
        return {"flops": counter.get_total_flops() / steps}
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    logs = [entry for entry in trainer.state.log_history if "timing/update_s" in entry]
    return {
        "wall": wall / steps,
        "cpu": cpu / steps,
        "rollout": sum(entry["timing/rollout_s"] for entry in logs) / len(logs),
        "update": sum(entry["timing/update_s"] for entry in logs) / len(logs),
    }


def shared_critic_comparison(steps: int = 3, seq_len: int = 24, layers: int = 12, repeats: int = 3) -> dict:
    """Per-step seconds of the :data:`SHARED_CRITIC_ARMS`, each the fastest of ``repeats`` runs (by CPU time)."""
    import tempfile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SHARED_CRITIC_ARMS}
    try:
        with tempfile.TemporaryDirectory() as out:
            for _ in range(repeats):
                for name, (estimator, share) in SHARED_CRITIC_ARMS.items():
                    runs[name].append(_time_shared_critic_arm(estimator, share, steps, seq_len, layers, out))
            best = {name: min(values, key=lambda run: run["cpu"]) for name, values in runs.items()}
            for name, (estimator, share) in SHARED_CRITIC_ARMS.items():  # one step: each does the same work
                best[name].update(
                    _time_shared_critic_arm(estimator, share, 1, seq_len, layers, out, flops=True)
                )
    finally:
        torch.set_num_threads(threads)
    return {
        "steps": steps,
        "seq_len": seq_len,
        "layers": layers,
        "repeats": repeats,
        "all": runs,
        "best": best,
    }


def print_shared_critic_table(result: dict) -> None:
    best = result["best"]
    grpo = best["trl-sae grpo (no critic)"]
    print(
        f"### Shared-base critic vs grpo: tiny Qwen3 (hidden 256, {result['layers']} layers, LoRA on the last "
        f"{result['layers'] // 3}), 4 x 4 completions of {result['seq_len']} tokens, {result['steps']} steps, "
        f"fastest of {result['repeats']} by CPU time"
    )
    print()
    print(
        "| arm | GFLOP/step | FLOPs vs grpo | wall s/step | CPU s/step | CPU vs grpo | rollout s "
        "| values + advantages s | update s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, run in best.items():
        rest = run["wall"] - run["rollout"] - run["update"]
        print(
            f"| {name} | {run['flops'] / 1e9:.2f} | {run['flops'] / grpo['flops']:.2f}x | {run['wall']:.3f} | "
            f"{run['cpu']:.3f} | {run['cpu'] / grpo['cpu']:.2f}x | {run['rollout']:.3f} | {rest:.3f} | "
            f"{run['update']:.3f} |"
        )
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=64, B=4 (about a minute), for a smoke run")
    parser.add_argument("--skip-memory", action="store_true", help="skip the logprob capture memory section")
    parser.add_argument("--skip-timing", action="store_true", help="skip the seconds-per-step section")
    parser.add_argument(
        "--skip-shared-critic", action="store_true", help="skip the shared-critic vs grpo step-time section"
    )
    parser.add_argument("--timing-steps", type=int, default=None, help="PPO steps per timed run (default 6)")
    parser.add_argument("--timing-repeats", type=int, default=None, help="timed runs per trainer (default 3)")
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB_SIZE)
    parser.add_argument("--seq-len", type=int, default=None, help="new tokens per rollout (default 512)")
    parser.add_argument("--batch-size", type=int, default=None, help="rollout batch (default 8)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="memory: keep glibc's dynamic mmap threshold (see comment)",
    )
    parser.add_argument("--json", action="store_true", help="also print each section's raw results as JSON")
    parser.add_argument("--memory-worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    seq_len = args.seq_len or (64 if args.quick else 512)
    batch_size = args.batch_size or (4 if args.quick else 8)
    if args.memory_worker:
        result = memory_worker(args.memory_worker, args.vocab_size, seq_len, batch_size, args.prompt_len)
        print(json.dumps(asdict(result)))
        return

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {platform.system()}")
    print()
    if not args.skip_timing:
        timing = step_time_comparison(
            steps=args.timing_steps or (2 if args.quick else 6),
            seq_len=32 if args.quick else 64,
            batch_size=4 if args.quick else 8,
            repeats=args.timing_repeats or (1 if args.quick else 3),
        )
        print_step_time_table(timing)
        if args.json:
            print(json.dumps(timing, indent=2))
    if not args.skip_shared_critic:
        shared = shared_critic_comparison(
            steps=args.timing_steps or (1 if args.quick else 3),
            seq_len=8 if args.quick else 24,
            layers=6 if args.quick else 12,
            repeats=args.timing_repeats or (1 if args.quick else 3),
        )
        print_shared_critic_table(shared)
        if args.json:
            print(json.dumps(shared, indent=2))
    if not args.skip_memory:
        result = capture_memory_comparison(
            args.vocab_size, seq_len, batch_size, args.prompt_len, default_malloc=args.default_malloc
        )
        print_memory_table(result)
        if args.json:
            print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
