"""``trl-sae segstats``: segment length and boundary count as functions of ``p`` (the paper's appendix
figure)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trl_sae.cli.common import (
    MODEL_HELP,
    HelpFormatter,
    add_common_arguments,
    add_prompt_source,
    load_causal_lm,
    load_prompts,
    open_unit_floats,
    positive_int,
    print_table,
    set_threads,
    write_json,
)

__all__ = ["add_parser", "cmd_segstats"]


def cmd_segstats(args: argparse.Namespace) -> int:
    from trl_sae.analysis import plot_segment_stats, segment_stats_vs_threshold

    set_threads(args.threads)
    dataset, _ = load_prompts(args.dataset, args.task, args.split, args.limit, args.seed)
    model, tokenizer = load_causal_lm(args.model, args.device, progress=not args.no_progress)
    rows = segment_stats_vs_threshold(
        model,
        tokenizer,
        dataset,
        p_grid=args.p_grid,
        num_samples=args.num_samples,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        show_progress=not args.no_progress,
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "segstats.json", {"model": args.model, "rows": [r.to_dict() for r in rows]})
    lines = [
        "| p | mean segment length | boundaries / completion | mean completion length |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.p:g} | {r.mean_segment_length:.2f} | {r.boundaries_per_completion:.2f} | {r.mean_completion_length:.1f} |"
        for r in rows
    ]
    (out / "segstats.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    figure = None
    try:
        figure = plot_segment_stats(rows, out / "segstats.png")
    except ImportError:
        print("matplotlib is not installed (pip install 'trl-sae[plots]'): no figure.")
    print_table(
        f"segment statistics vs p ({rows[0].num_completions} completions)",
        ["p", "mean segment length", "boundaries / completion", "mean completion length"],
        [[r.p, r.mean_segment_length, r.boundaries_per_completion, r.mean_completion_length] for r in rows],
    )
    print(f"written: {out / 'segstats.json'}, {out / 'segstats.md'}" + (f", {figure}" if figure else ""))
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``segstats`` to the ``trl-sae`` subcommands (called by :func:`trl_sae.cli.app.build_parser`)."""
    segstats = commands.add_parser(
        "segstats",
        help="Segment length and boundaries per completion as functions of p.",
        formatter_class=HelpFormatter,
        description="Sample completions once and tabulate, for every threshold p, the mean segment length and the\n"
        "boundaries per completion (the paper's appendix figure). Writes segstats.json, .md and .png.",
        epilog="examples:\n  trl-sae segstats --model Qwen/Qwen3-0.6B --dataset aime-2024 --num-samples 64\n"
        "  trl-sae segstats --model ./trl-sae-demo/model --task running-sum --p-grid 0.05,0.1,0.2,0.5",
    )
    segstats.add_argument("--model", required=True, help=MODEL_HELP)
    add_prompt_source(segstats)
    segstats.add_argument(
        "--p-grid", type=open_unit_floats, default=[0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9], help="Thresholds."
    )
    segstats.add_argument("--num-samples", type=positive_int, default=64)
    segstats.add_argument("--temperature", type=float, default=1.0)
    segstats.add_argument("--max-new-tokens", type=positive_int, default=512)
    segstats.add_argument("--batch-size", type=positive_int, default=32)
    segstats.add_argument("--output-dir", default="trl-sae-segstats")
    add_common_arguments(segstats)
    segstats.set_defaults(handler=cmd_segstats)
