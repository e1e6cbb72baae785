"""``trl-sae correlate``: correlation of GAE / SAE advantages with a Monte-Carlo ``A*`` (paper Section
5.3.2)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from trl_sae.cli.common import (
    MODEL_HELP,
    CLIError,
    HelpFormatter,
    add_common_arguments,
    add_prompt_source,
    first_line,
    load_causal_lm,
    load_prompts,
    open_unit_floats,
    positive_int,
    print_table,
    resolve_device,
    set_threads,
    unit_floats,
)

__all__ = ["add_parser", "cmd_correlate"]


def _load_value_model(path: str, device: str) -> Any:
    from transformers import AutoModelForSequenceClassification

    from trl_sae.gguf import from_pretrained_dense, resolve_pretrained

    source, kwargs = resolve_pretrained(path, "--value-model")  # messages name `path`, the file as given

    if os.path.isfile(os.path.join(os.path.expanduser(source), "value_head.safetensors")):
        raise CLIError(
            f"{path!r} is a shared-base critic (a LoRA adapter plus value head); correlate needs a standalone "
            "critic (a one-label sequence classifier), e.g. one trained with a separate value model."
        )
    try:
        critic = from_pretrained_dense(AutoModelForSequenceClassification, source, num_labels=1, **kwargs)
    except (OSError, ValueError) as error:
        raise CLIError(f"cannot load value model {path!r}: {first_line(str(error))}") from error
    return critic.to(device).eval()


def cmd_correlate(args: argparse.Namespace) -> int:
    from trl_sae.analysis import correlate_advantages, critic_value_fn, plot_correlations

    set_threads(args.threads)
    value_path = args.value_model or os.path.join(args.model, "value_model")
    if not args.value_model and not os.path.isdir(os.path.expanduser(value_path)):
        raise CLIError(
            f"no critic: {args.model!r} has no value_model/ folder; pass --value-model PATH (a one-label "
            "sequence classifier, e.g. the value_model/ that SAEPPOTrainer saves)."
        )
    dataset, reward_func = load_prompts(args.dataset, args.task, args.split, args.limit, args.seed)
    model, tokenizer = load_causal_lm(args.model, args.device, progress=not args.no_progress)
    critic = _load_value_model(value_path, resolve_device(args.device))
    result = correlate_advantages(
        model,
        tokenizer,
        dataset,
        reward_func,
        critic_value_fn(critic),
        num_trajectories=args.num_trajectories,
        num_spans_per_trajectory=args.num_spans,
        num_continuations=args.num_continuations,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        p_grid=args.p_grid,
        lam_grid=args.lam_grid,
        seed=args.seed,
        batch_size=args.batch_size,
        num_bootstrap=args.num_bootstrap,
        show_progress=not args.no_progress,
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.to_json(str(out / "correlation.json"))
    (out / "correlation.md").write_text(result.to_markdown() + "\n", encoding="utf-8")
    figure = None
    try:
        figure = plot_correlations(result, out / "correlation.png")
    except ImportError:
        print("matplotlib is not installed (pip install 'trl-sae[plots]'): no figure.")
    print_table(
        "Pearson correlation of advantages with Monte-Carlo A*",
        ["estimator", "setting", "pearson", "ci_low", "ci_high", "tokens"],
        [[r.estimator, r.setting, r.pearson, r.ci_low, r.ci_high, r.n_tokens] for r in result.rows],
    )
    print(
        f"written: {out / 'correlation.json'}, {out / 'correlation.md'}" + (f", {figure}" if figure else "")
    )
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``correlate`` to the ``trl-sae`` subcommands (called by :func:`trl_sae.cli.app.build_parser`)."""
    correlate = commands.add_parser(
        "correlate",
        help="Correlation of GAE/SAE/adaptive-lambda advantages with Monte-Carlo A* (paper 5.3.2).",
        formatter_class=HelpFormatter,
        description="Sample trajectories, estimate the true advantage A* of spans between segment boundaries by\n"
        "Monte-Carlo continuations, and report each estimator's Pearson correlation with it (bootstrap CIs).\n"
        "Needs the policy and its critic. Writes correlation.json, correlation.md and correlation.png.",
        epilog="examples:\n  trl-sae correlate --model ./trl-sae-demo/model --task running-sum --num-trajectories 16\n"
        "  trl-sae correlate --model ./out --value-model ./out/value_model --dataset ./dapo_subset.jsonl",
    )
    correlate.add_argument("--model", required=True, help=f"The policy. {MODEL_HELP}")
    correlate.add_argument(
        "--value-model",
        default=None,
        help="The critic: a one-label sequence classifier, as a Hub id, a local folder or a *.gguf file "
        "(default: MODEL/value_model).",
    )
    add_prompt_source(correlate)
    correlate.add_argument("--num-trajectories", type=positive_int, default=64)
    correlate.add_argument("--num-spans", type=positive_int, default=4, help="Spans drawn per trajectory.")
    correlate.add_argument(
        "--num-continuations", type=positive_int, default=32, help="Monte-Carlo continuations (K)."
    )
    correlate.add_argument("--num-bootstrap", type=positive_int, default=1000)
    correlate.add_argument("--temperature", type=float, default=1.0)
    correlate.add_argument("--max-new-tokens", type=positive_int, default=512)
    correlate.add_argument("--batch-size", type=positive_int, default=32)
    correlate.add_argument(
        "--p-grid", type=open_unit_floats, default=[0.1, 0.2, 0.3, 0.5], help="SAE thresholds."
    )
    correlate.add_argument(
        "--lam-grid", type=unit_floats, default=[0.0, 0.5, 0.9, 0.95, 0.99, 1.0], help="GAE lambdas."
    )
    correlate.add_argument("--output-dir", default="trl-sae-correlation")
    add_common_arguments(correlate)
    correlate.set_defaults(handler=cmd_correlate)
