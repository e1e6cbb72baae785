"""One command that turns the GPU claims into measurements: PPO + SAE steps of Qwen3-shaped models on one GPU.

For each case (model x set-up x completion length) it runs a few ``SAEPPOTrainer`` steps (bf16, LoRA r=16 on
every linear layer, activation checkpointing, ``kl_coef=0``, 1 prompt x 2 completions, update micro-batch 1)
and records the peak GPU memory (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``), seconds per
step split into rollout and update (the trainer's ``timing/rollout_s`` and ``timing/update_s``), completion
tokens per second of the rollout, the largest gap between the log-probs captured while sampling and their
teacher-forced recompute (the trainer recomputes them under bf16), and the ratio of the peak to
``estimate_gpu_memory`` of ``bench_memory.py`` (the formula behind docs/guides/gpu-memory.md) for that case.

Set-ups: ``lora_head`` (bf16 base, LoRA policy, ``value_model="head"``), ``lora_shared`` (bf16 base, the
shared-base critic) and ``qlora_shared`` (NF4 base via ``load_in_4bit``, shared-base critic; run only where
bitsandbytes quantizes on CUDA). Models: ``Qwen3Config`` JSONs in ``benchmarks/gpu_configs/`` with random
weights (memory and time do not depend on the values; nothing is downloaded). The tokenizer is the project's
character tokenizer; the model keeps Qwen3's 151,936-token vocabulary, since the vocabulary sets the
embedding, the log-prob head and the sampler's memory, and the ids beyond the tokenizer's decode to nothing
(rewards here are length-based). ``stop_token=None`` makes every completion run to ``response_length``.

A global time budget (``--budget-s``, 480 s) is enforced: a case that cannot start in time, or whose
predicted time (from the model's last measured tokens per second) exceeds what is left, is recorded as
"skipped: time budget"; a running case stops after the step in which the budget runs out. A case that
fails (OOM included) records its error and the run goes on. Writes ``gpu_check.json`` and ``gpu_check.md``
into ``--out`` and exits 0.

Usage::

    python benchmarks/gpu_check.py --out /tmp/gpu               # on a CUDA machine (docs/guides/gpu-memory.md)
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/tiny   # the same code on tiny shapes (CPU)
    python benchmarks/gpu_check.py --estimate-only              # the estimate of every case (instant)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _memory as memory
from bench_memory import GIB, ModelShape, estimate_gpu_memory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_configs")
MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")
SETUPS = ("lora_head", "lora_shared", "qlora_shared")
LENGTHS = (1024, 4096, 8192)
# Tiny mode: the same code on a two-layer body (CPU, seconds).
TINY_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
}
TINY_LENGTHS = (8, 16)
PROMPT = "Say vowels:"
NUM_GENERATIONS = 2
LORA_R = 16
# bf16 has an 8-bit mantissa: one rounding is ~4e-3 relative; a log-prob summed over a 151,936-way
# log-softmax in a different kernel order (cached decoding vs one full forward) differs by up to ~0.1 nats.
LOGPROB_TOLERANCE = 0.1
TABLE_COLUMNS = (
    "model",
    "setup",
    "completion tokens",
    "status",
    "steps",
    "peak alloc GiB",
    "peak reserved GiB",
    "estimate GiB",
    "peak / estimate",
    "rollout s/step",
    "update s/step",
    "tokens/s",
    "max logprob gap",
)


@dataclass
class Case:
    """One measurement: a model config, a set-up and a completion length, and what it gave."""

    model: str
    setup: str
    completion_tokens: int
    status: str = "pending"  # ok | failed | not run: ... | skipped: time budget
    error: str | None = None
    steps: int = 0
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    estimate_gib: float | None = None
    estimate_phase: str | None = None
    peak_over_estimate: float | None = None
    rollout_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    logprob_max_abs_diff: float | None = None
    logprob_mean_abs_diff: float | None = None
    logprobs_match: bool | None = None
    seconds: float | None = None


def load_config(model: str, tiny: bool) -> Any:
    """The ``Qwen3Config`` of ``model`` (a JSON in gpu_configs/), or the tiny shape."""
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(**TINY_CONFIG)
    with open(os.path.join(CONFIG_DIR, f"{model}.json")) as handle:
        return Qwen3Config(**json.load(handle))


def model_shape(name: str, config: Any) -> ModelShape:
    return ModelShape(
        name,
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        vocab_size=config.vocab_size,
        tie_word_embeddings=config.tie_word_embeddings,
    )


def qlora_unavailable(device: str) -> str | None:
    """Why QLoRA cannot run here (None when bitsandbytes quantizes a tensor on CUDA)."""
    if device != "cuda":
        return "not run: QLoRA is measured on CUDA only"
    try:
        import bitsandbytes.functional as bnb_functional
        import torch

        bnb_functional.quantize_4bit(
            torch.randn(64, 64, device="cuda", dtype=torch.bfloat16), quant_type="nf4"
        )
    except Exception as error:  # ImportError, or a build without its CUDA library
        return f"not run: bitsandbytes 4-bit on CUDA unavailable ({type(error).__name__}: {_one_line(error)})"
    return None


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


def environment(device: str) -> dict[str, Any]:
    """What the machine has: Python, the GPU, and the versions of every library the check may use."""
    import torch

    versions = {}
    names = (
        "torch",
        "transformers",
        "trl",
        "peft",
        "accelerate",
        "datasets",
        "huggingface_hub",
        "tokenizers",
    )
    for name in (*names, "safetensors", "bitsandbytes", "vllm"):
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as error:
            versions[name] = f"missing ({type(error).__name__})"
    info: dict[str, Any] = {"python": platform.python_version(), "versions": versions, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / GIB, 1)
        info["cuda"] = torch.version.cuda
    return info


def _length_reward(prompts: list[Any], completions: list[str], completion_ids: list[Any], **kw: Any) -> list:
    # Rewards do not change memory or time; this one varies so advantages are not all zero.
    return [float(len(ids) % 3) for ids in completion_ids]


class _BudgetStop:
    """A trainer callback that ends training after the step in which the global time budget runs out."""

    def __init__(self, deadline: float) -> None:
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if time.monotonic() > outer.deadline:
                    control.should_training_stop = True

        self.deadline = deadline
        self.callback = Callback()


def _watch_rollouts(trainer: Any, case: Case, tokens: list[int], diffs: list[tuple[float, float]]) -> None:
    """Record each rollout's completion tokens and the captured-vs-teacher-forced log-prob gap."""
    rollouts = trainer.rollouts
    sample = rollouts.sample

    def watched(prompt_batch: dict[str, Any], recompute_logprobs: bool = True) -> Any:
        batch = sample(prompt_batch, recompute_logprobs)
        mask = batch.completion_mask.bool()
        tokens.append(int(mask.sum()))
        if batch.sampler_logprobs is not None and mask.any():
            gap = (batch.sampler_logprobs.float() - batch.logprobs.float()).abs()[mask]
            diffs.append((float(gap.max()), float(gap.mean())))
        return batch

    rollouts.sample = watched


def build_trainer(case: Case, config: Any, device: str, steps: int, work_dir: str, callbacks: list) -> Any:
    """An ``SAEPPOTrainer`` for ``case``: a random bf16 model (a saved copy for QLoRA), LoRA on every linear."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import Qwen3ForCausalLM

    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config.max_position_embeddings = max(config.max_position_embeddings, case.completion_tokens + 64)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    quantized = case.setup == "qlora_shared"
    if quantized:  # load_in_4bit quantizes while loading, so the model goes through a saved copy
        path = os.path.join(work_dir, "model")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        model = path
    args = SAEPPOConfig(
        output_dir=os.path.join(work_dir, "out"),
        per_device_train_batch_size=1,  # update micro-batches of one completion ...
        gradient_accumulation_steps=NUM_GENERATIONS,  # ... one mini-batch of the prompt's completions
        num_generations=NUM_GENERATIONS,
        response_length=case.completion_tokens,
        stop_token=None,  # random weights rarely stop: every completion runs the full length
        num_ppo_epochs=1,
        num_mini_batches=1,
        max_steps=steps,
        kl_coef=0.0,
        temperature=1.0,
        learning_rate=1e-5,
        critic_learning_rate=1e-5,
        bf16=True,
        activation_checkpointing=True,
        load_in_4bit=quantized,
        model_init_kwargs={"dtype": torch.bfloat16} if quantized else None,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=device == "cpu",
        seed=0,
    )
    return SAEPPOTrainer(
        model=model,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 4}),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0, target_modules="all-linear"
        ),
        value_model="head" if case.setup == "lora_head" else None,  # None: the shared-base critic
        callbacks=callbacks,
    )


def run_case(case: Case, device: str, tiny: bool, steps: int, deadline: float) -> None:
    """Run ``case``'s steps and fill in its measurements; raises what the trainer raises."""
    import torch
    from transformers.trainer_callback import PrinterCallback

    config = load_config(case.model, tiny)
    tokens: list[int] = []
    diffs: list[tuple[float, float]] = []
    on_cuda = device == "cuda"
    with tempfile.TemporaryDirectory() as work_dir:
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            memory.reset_peak()
        baseline = memory.rss_bytes()
        trainer = build_trainer(case, config, device, steps, work_dir, [_BudgetStop(deadline).callback])
        try:
            trainer.remove_callback(PrinterCallback)
            _watch_rollouts(trainer, case, tokens, diffs)
            trainer.train()
            logs = [entry for entry in trainer.state.log_history if "timing/rollout_s" in entry]
        finally:
            del trainer
        if on_cuda:
            case.peak_allocated_gib = torch.cuda.max_memory_allocated() / GIB
            case.peak_reserved_gib = torch.cuda.max_memory_reserved() / GIB
        else:  # CPU: the process's peak resident memory above what it held before the trainer
            case.peak_allocated_gib = (memory.peak_bytes() - baseline) / GIB
    case.steps = len(logs)
    case.rollout_s = [round(float(entry["timing/rollout_s"]), 3) for entry in logs]
    case.update_s = [round(float(entry["timing/update_s"]), 3) for entry in logs]
    rollout_total = sum(case.rollout_s)
    if rollout_total > 0 and tokens:
        case.tokens_per_s = sum(tokens[: len(logs)]) / rollout_total
    if diffs:
        case.logprob_max_abs_diff = max(d[0] for d in diffs)
        case.logprob_mean_abs_diff = sum(d[1] for d in diffs) / len(diffs)
        case.logprobs_match = case.logprob_max_abs_diff <= LOGPROB_TOLERANCE
    prompt_tokens = len(PROMPT)  # the character tokenizer: one token per character, no template
    estimate = estimate_gpu_memory(
        model_shape(case.model, config),
        case.setup,
        prompt_tokens + case.completion_tokens,
        NUM_GENERATIONS,
        micro_batch=1,
        prompt_length=prompt_tokens,
        lora_r=LORA_R,
        precision="bf16",
        runtime_overhead_gib=0.5 if on_cuda else 0.0,
    )
    case.estimate_gib = estimate.total_gib
    case.estimate_phase = estimate.peak_phase
    if case.peak_allocated_gib and case.estimate_gib:
        case.peak_over_estimate = case.peak_allocated_gib / case.estimate_gib


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def plan_cases(models: list[str], setups: list[str], lengths: list[int]) -> list[Case]:
    """Every case, cheapest first (decoding time grows with tokens x layers), so a budget cut drops the dearest."""
    order = {name: index for index, name in enumerate(MODELS)}
    cases = [Case(m, s, n) for n in lengths for m in models for s in setups]
    return sorted(cases, key=lambda c: (c.completion_tokens, order.get(c.model, 0), setups.index(c.setup)))


def run_all(
    cases: list[Case],
    device: str,
    tiny: bool,
    steps: int,
    budget_s: float,
    runner: Callable[[Case, str, bool, int, float], None] = run_case,
    after_each: Callable[[list[Case]], None] | None = None,
) -> list[Case]:
    """Run the cases in order within ``budget_s`` seconds; every case ends with a status, none stops the run.

    A case is skipped when the budget is spent, or when its model's last finished case predicts (by its
    completion tokens per second of whole steps, rollout + update) that it would not end in time.
    ``after_each`` gets the cases after every one that ran (the results are written as they come, so an
    outer ``timeout`` still leaves them)."""
    started = time.monotonic()
    deadline = started + budget_s
    rates: dict[str, float] = {}  # completion tokens per second of whole steps, per model, last finished case
    qlora_reason = qlora_unavailable(device) if any(c.setup == "qlora_shared" for c in cases) else None
    for case in cases:
        left = deadline - time.monotonic()
        if case.setup == "qlora_shared" and qlora_reason:
            case.status = qlora_reason
            continue
        predicted = (
            steps * NUM_GENERATIONS * case.completion_tokens / rates[case.model] if case.model in rates else 0
        )
        if left <= 0 or predicted > left:
            case.status = "skipped: time budget"
            continue
        print(f"[gpu_check] {case.model} {case.setup} {case.completion_tokens} tokens ...", flush=True)
        case_start = time.monotonic()
        try:
            runner(case, device, tiny, steps, deadline)
            case.status = "ok" if case.steps == steps else f"ok: {case.steps} of {steps} steps (time budget)"
            step_s = sum(case.rollout_s) + sum(case.update_s)
            if case.steps and step_s > 0:
                rates[case.model] = case.steps * NUM_GENERATIONS * case.completion_tokens / step_s
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            case.status = "failed"
            case.error = f"{type(error).__name__}: {_one_line(error)}"
            traceback.print_exc()
            if device == "cuda":  # how far it got (an OOM's peak)
                import torch

                case.peak_allocated_gib = torch.cuda.max_memory_allocated() / GIB
                case.peak_reserved_gib = torch.cuda.max_memory_reserved() / GIB
        finally:
            case.seconds = round(time.monotonic() - case_start, 1)
            _free(device)
        print(f"[gpu_check]   {case.status} {case.error or ''} ({case.seconds} s)", flush=True)
        if after_each is not None:
            after_each(cases)
    return cases


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(cases: list[Case]) -> str:
    """One row per case, the columns of :data:`TABLE_COLUMNS`."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for c in cases:
        status = c.status if c.error is None else f"{c.status}: {c.error}"
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        row = [
            c.model,
            c.setup,
            f"{c.completion_tokens:,}",
            status.replace("|", "/"),
            str(c.steps),
            _cell(c.peak_allocated_gib),
            _cell(c.peak_reserved_gib),
            _cell(c.estimate_gib),
            _cell(c.peak_over_estimate),
            _cell(mean(c.rollout_s)),
            _cell(mean(c.update_s)),
            _cell(c.tokens_per_s, 0),
            _cell(c.logprob_max_abs_diff, 4),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def estimate_rows(models: list[str], setups: list[str], lengths: list[int], tiny: bool = False) -> str:
    """The estimate of every case, as the markdown table docs/guides/gpu-memory.md shows (GiB, bf16)."""
    lines = ["| ESTIMATED | setup | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |"]
    lines.append("|---|---|" + "---:|" * len(lengths))
    for model in models:
        config = load_config(model, tiny)
        for setup in setups:
            cells = []
            for n in lengths:
                estimate = estimate_gpu_memory(
                    model_shape(model, config),
                    setup,
                    len(PROMPT) + n,
                    NUM_GENERATIONS,
                    micro_batch=1,
                    prompt_length=len(PROMPT),
                    lora_r=LORA_R,
                )
                cells.append(f"{estimate.total_gib:.1f} ({estimate.peak_phase})")
            lines.append(f"| {model} | {setup} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(out: str, info: dict[str, Any], cases: list[Case]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as handle:
        json.dump({**info, "cases": [asdict(c) for c in cases]}, handle, indent=2)
    with open(os.path.join(out, "gpu_check.md"), "w") as handle:
        handle.write(f"# GPU check ({info.get('gpu', info['device'])})\n\n")
        handle.write(f"Versions: {json.dumps(info['versions'])}\n\n")
        handle.write(markdown_table(cases))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (the test's mode)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--lengths", nargs="+", type=int, help="completion tokens (default 1024 4096 8192)")
    parser.add_argument("--steps", type=int, default=2, help="PPO steps per case")
    parser.add_argument(
        "--estimate-only", action="store_true", help="print the estimates of the cases, run none"
    )
    parser.add_argument("--budget-s", type=float, default=480.0, help="global time budget in seconds")
    args = parser.parse_args(argv)
    if args.out is None and not args.estimate_only:
        parser.error("--out is required: the folder for gpu_check.json and gpu_check.md")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.lengths is None:
        args.lengths = list(TINY_LENGTHS if args.tiny else LENGTHS)
    if any(n < 1 for n in args.lengths):
        parser.error(f"--lengths must be positive token counts, got {args.lengths}")
    if args.tiny:
        args.models = args.models[:1]  # every model is the same tiny shape
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.estimate_only:
        print(estimate_rows(args.models, args.setups, args.lengths, args.tiny))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; use --device cpu --tiny for the CPU path", file=sys.stderr)
        return 2
    info = environment(args.device)
    info.update(tiny=args.tiny, steps=args.steps, budget_s=args.budget_s, logprob_tolerance=LOGPROB_TOLERANCE)
    print(json.dumps(info), flush=True)
    cases = plan_cases(args.models, args.setups, args.lengths)
    write_results(args.out, info, cases)  # every case "pending" until it has run
    run_all(
        cases,
        args.device,
        args.tiny,
        args.steps,
        args.budget_s,
        after_each=lambda done: write_results(args.out, info, done),
    )
    write_results(args.out, info, cases)
    print(markdown_table(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
