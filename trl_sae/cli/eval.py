"""``trl-sae eval``: avg@k and pass@k of a model on math test sets, graded by math-verify."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trl_sae.cli.common import (
    CLIError,
    _add_common,
    _first_line,
    _Formatter,
    _positive_int,
    _print_table,
    _set_threads,
    _write_json,
    load_causal_lm,
)

__all__ = ["DEFAULT_EVAL_DATASETS", "add_parser", "cmd_eval"]

DEFAULT_EVAL_DATASETS = ("aime-2024", "aime-2025", "amc", "beyond-aime")


def cmd_eval(args: argparse.Namespace) -> int:
    from trl_sae.data import DatasetUnavailableError, load_math_dataset
    from trl_sae.evaluation import evaluate_accuracy
    from trl_sae.recipe import resolve_reward_funcs

    _set_threads(args.threads)
    reward_func = resolve_reward_funcs([args.reward])[0]
    datasets = {}
    for name in args.datasets:
        try:
            dataset = load_math_dataset(name, split=args.split, chat=not args.no_chat)
        except DatasetUnavailableError as error:
            raise CLIError(
                _first_line(str(error)),
                hint="offline? download the dataset elsewhere (`hf download <id> --repo-type dataset "
                "--local-dir DIR`) and pass DIR to --datasets.",
            ) from error
        except FileNotFoundError as error:
            raise CLIError(f"dataset {name!r}: {_first_line(str(error))}") from error
        if args.limit is not None:
            dataset = dataset.select(range(min(args.limit, len(dataset))))
        datasets[name] = dataset
    model, tokenizer = load_causal_lm(args.model, args.device, args.dtype, not args.no_progress)
    results: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for name, dataset in datasets.items():
        print(f"evaluating {args.model} on {name} ({len(dataset)} problems x {args.num_samples} samples)")
        result = evaluate_accuracy(
            model,
            tokenizer,
            dataset,
            reward_func,
            num_samples=args.num_samples,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            seed=args.seed,
            progress=not args.no_progress,
            return_samples=args.save_samples,
        )
        if args.save_samples:
            samples[name] = result.pop("samples")
        results[name] = result
    k = args.num_samples
    _print_table(
        f"{args.model}: accuracy (avg@{k}) and pass@{k}, temperature {args.temperature:g}",
        ["dataset", "problems", f"avg@{k}", f"pass@{k}", "mean tokens", "truncated"],
        [
            [
                n,
                r["num_prompts"],
                r["accuracy"],
                r["pass_at_k"],
                r["mean_completion_tokens"],
                r["truncated_fraction"],
            ]
            for n, r in results.items()
        ],
    )
    payload = {"model": args.model, "num_samples": k, "temperature": args.temperature, "results": results}
    if args.output:
        _write_json(Path(args.output), payload)
        print(f"results written to {args.output}")
        if args.save_samples:
            sample_path = Path(args.output).with_suffix(".samples.json")
            _write_json(sample_path, samples)
            print(f"samples written to {sample_path}")
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``eval`` to the ``trl-sae`` subcommands (called by :func:`trl_sae.cli.app.build_parser`)."""
    evaluate = commands.add_parser(
        "eval",
        help="avg@k and pass@k of a model on math test sets (math-verify).",
        formatter_class=_Formatter,
        description="Sample k completions per problem and grade them with math-verify: avg@k is the share of\n"
        "correct samples, pass@k the share of problems with at least one. temperature 0 is greedy (k is then\n"
        "a single generation). Prints a table and, with --output, writes JSON.",
        epilog="examples:\n  trl-sae eval --model ./trl-sae-output --datasets aime-2024 amc -k 16 --temperature 0.6 "
        "--output eval.json\n  trl-sae eval --model Qwen/Qwen3-0.6B --datasets ./aime_2024 --limit 10",
    )
    evaluate.add_argument(
        "--model",
        required=True,
        help="A Hub id, a local folder (full model or LoRA adapter) or a *.gguf file.",
    )
    evaluate.add_argument(
        "--datasets",
        nargs="+",
        default=list(DEFAULT_EVAL_DATASETS),
        help="Math dataset names or local paths.",
    )
    evaluate.add_argument("--split", default=None, help="Dataset split (each dataset's default if unset).")
    evaluate.add_argument("-k", "--num-samples", type=_positive_int, default=1, help="Samples per problem.")
    evaluate.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding.")
    evaluate.add_argument(
        "--max-new-tokens", type=_positive_int, default=2048, help="Generation budget per sample."
    )
    evaluate.add_argument("--batch-size", type=_positive_int, default=32, help="Sequences per generate call.")
    evaluate.add_argument(
        "--limit", type=_positive_int, default=None, help="Evaluate only the first N problems."
    )
    evaluate.add_argument("--reward", default="math_accuracy", help="Grader: a reward name or import path.")
    evaluate.add_argument(
        "--no-chat", action="store_true", help="Plain-text prompts instead of the chat template."
    )
    evaluate.add_argument("--dtype", default=None, help="Model dtype (e.g. bfloat16).")
    evaluate.add_argument("--seed", type=int, default=0, help="Sampling seed.")
    evaluate.add_argument("--output", default=None, help="Write the results as JSON here.")
    evaluate.add_argument(
        "--save-samples",
        action="store_true",
        help="Also write every sample next to --output (.samples.json).",
    )
    _add_common(evaluate)
    evaluate.set_defaults(handler=cmd_eval)
