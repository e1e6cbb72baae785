"""Training from a YAML recipe: the script arguments and the steps from a recipe to a trained model.

A recipe is one YAML file read by TRL's ``TrlParser`` into two dataclasses: :class:`ScriptArguments`
(model, data, rewards, LoRA) and :class:`~trl_sae.SAEPPOConfig` (everything the trainer reads). Every
key can be overridden on the command line with ``--key value``::

    trl-sae train examples/qwen3_0.6b_qlora.yaml --learning_rate 2e-6
    accelerate launch examples/sae_ppo_math.py --config examples/qwen3_0.6b_qlora.yaml

``trl-sae train`` and ``examples/sae_ppo_math.py`` both call :func:`run_recipe`, so a recipe behaves
the same through either door.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

__all__ = [
    "RecipeError",
    "ScriptArguments",
    "build_peft_config",
    "build_trainer",
    "load_recipe_datasets",
    "parse_recipe",
    "resolve_reward_funcs",
    "run_recipe",
]


class RecipeError(ValueError):
    """A recipe or command-line value that cannot be used; the CLI prints it as one line plus its hint."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def _reward_funcs_help() -> str:
    """The ``reward_funcs`` help, naming the registry's built-ins (read from it, so a new one is listed)."""
    from trl_sae.rewards.registry import REWARD_FUNCTIONS

    return (
        f"Reward functions: names from trl_sae.rewards.REWARD_FUNCTIONS ({', '.join(REWARD_FUNCTIONS)}) or "
        "importable paths such as my_module.my_reward or my_module:my_reward."
    )


@dataclass
class ScriptArguments:
    """What a recipe trains, on what, and with which rewards (the trainer's settings live in ``SAEPPOConfig``)."""

    model_name_or_path: str = field(
        default="Qwen/Qwen3-0.6B",
        metadata={"help": "Policy to train: a Hub id, a local folder or a *.gguf file."},
    )
    value_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Critic: a Hub id, folder or *.gguf file of a one-label sequence classifier; 'shared' puts it on the "
            "policy's base as a second LoRA adapter; 'head' a value head on the policy's own forward (cheapest); "
            "unset: built from the policy's weights (shared with LoRA)."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer, if not the policy's: a Hub id, a local folder or a *.gguf file."},
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Weights dtype for from_pretrained: auto, bfloat16, float16 or float32 (transformers' default "
            "if unset). Full fine-tuning wants float32 weights with bf16: true (mixed precision): at an actor lr "
            "of 1e-6, bf16 weights would round most updates away."
        },
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel, e.g. sdpa or flash_attention_2."}
    )
    dataset_name: str = field(
        default="dapo-math-17k",
        metadata={
            "help": "Training prompts: a trl_sae.data.MATH_DATASETS name (dapo-math-17k, aime-2024, ...), a Hub "
            "id, a local folder / .jsonl / .parquet file with problem and answer columns, reasoning_gym:<task> "
            "(max_train_samples problems generated with the run's seed; pip install 'trl-sae[gym]'), or a STEM "
            "set: gpqa-diamond, scp-116k, multiple_choice:<path or Hub id> (GPQA's columns), science:<path or Hub "
            "id> (problem + answer or solution), or code: code_task (the generated offline task, max_train_samples "
            "problems from the run's seed; settings in code_task_config) or code:<source> (a code dataset: apps, "
            "taco, ..., a Hub id, or a local .json/.jsonl/.parquet file or folder; reward code_tests)."
        },
    )
    dataset_split: str | None = field(
        default=None, metadata={"help": "Split (the dataset's default if unset)."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training prompts (quick runs)."}
    )
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Held-out prompts for trainer.evaluate (same forms as dataset_name)."}
    )
    eval_dataset_split: str | None = field(default=None, metadata={"help": "Split of the eval dataset."})
    reasoning_gym_config: str | None = field(
        default=None,
        metadata={
            "help": "Settings of the reasoning-gym task named by dataset_name / eval_dataset_name "
            '(reasoning_gym:<task>), as a JSON object, e.g. \'{"min_terms": 2, "max_terms": 2}\'.'
        },
    )
    reasoning_gym_few_shot: int = field(
        default=0,
        metadata={
            "help": "Solved problems of the reasoning-gym task shown before each question (earlier chat turns), "
            "so a small model sees the <answer> format used."
        },
    )
    reasoning_gym_worked_steps: bool = field(
        default=False,
        metadata={
            "help": "The solved examples (reasoning_gym_few_shot) of a chain of + and - (chain_sum, "
            "basic_arithmetic without * / or parentheses) work it out one operation a line, so completions "
            "take several steps (several decisions for a critic to value) instead of one line."
        },
    )
    code_task_config: str | None = field(
        default=None,
        metadata={
            "help": "Settings of the generated code task (dataset_name / eval_dataset_name code_task), as a JSON "
            "object with any of families (list of names), num_tests (tests per problem), few_shot (solved "
            'problems shown before each question), e.g. \'{"families": ["affine", "count_char"], "few_shot": 1}\'.'
        },
    )
    code_sandbox: str = field(
        default="namespaces",
        metadata={
            "help": "What isolates the programs the code_tests reward runs: namespaces (the default: works with "
            "no tool installed), bwrap (bubblewrap; refused at start, naming the fix, where it cannot run) or "
            "auto (bwrap where it runs, else namespaces). See docs/guides/code.md."
        },
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N eval prompts."}
    )
    chat_template: bool = field(
        default=True, metadata={"help": "Prompts as chat messages (through the tokenizer's chat template)."}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "A system message before each prompt."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_accuracy"], metadata={"help": _reward_funcs_help()}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules that get adapters; unset means all linear layers."}
    )
    lora_layers_to_transform: list[int] | None = field(
        default=None,
        metadata={
            "help": "Layer indices whose lora_target_modules get adapters (peft's layers_to_transform), e.g. the "
            "last layers only, so backward stops early; unset means every layer. Needs lora_target_modules."
        },
    )
    dry_run: bool = field(
        default=False,
        metadata={
            "help": "Build the tokenizer, datasets, rewards, models and trainer, print a summary, do not train."
        },
    )


def parse_recipe(
    argv: Sequence[str] | None = None, prog: str | None = None, description: str | None = None
) -> tuple[Any, Any]:
    """``(ScriptArguments, SAEPPOConfig)`` from ``--config RECIPE.yaml`` plus command-line overrides.

    A bare first argument ending in ``.yaml``/``.yml`` is taken as the recipe (``trl-sae train r.yaml``).
    """
    import argparse

    from trl import TrlParser

    from trl_sae.trainer.config import SAEPPOConfig

    args = list(argv) if argv is not None else sys.argv[1:]
    if args and not args[0].startswith("-") and args[0].endswith((".yaml", ".yml")):
        args = ["--config", *args]
    path = None
    recipe: Any = None
    if "--config" in args:
        index = args.index("--config")
        if index + 1 >= len(args):
            raise ValueError("--config needs a path to a YAML recipe.")
        path = args[index + 1]
        if not os.path.isfile(path):
            raise FileNotFoundError(f"recipe {path!r} does not exist.")
        recipe = _check_yaml(path)

    class RecipeParser(TrlParser):
        """argparse's ``error`` prints the whole usage (every TrainingArguments flag) and exits; a bad value
        is one line instead, naming where it came from."""

        def error(self, message: str) -> NoReturn:
            hint = f"`{self.prog} --help` lists every option with its type and choices."
            flag = re.match(r"argument --(\w+)(?:/--[\w-]+)?: (.*)", message, re.DOTALL)
            if flag is None:
                raise RecipeError(message, hint=hint)
            name, problem = flag.groups()
            if path is not None and f"--{name}" not in args and f"--{name.replace('_', '-')}" not in args:
                raise RecipeError(f"recipe {path}: {name}: {problem}", hint=hint)
            raise RecipeError(f"--{name}: {problem}", hint=hint)

    parser = RecipeParser(
        (ScriptArguments, SAEPPOConfig),
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # TrlParser's own message for an unknown key suggests `fail_with_unknown_args=False`, which a recipe's
    # user cannot set: name the key and the fields it is closest to instead.
    fields = sorted({action.dest for action in parser._actions} - {"help"})
    hint = f"`{parser.prog} --help` lists every field; a recipe key or --option sets the field of that name."
    if isinstance(recipe, dict):
        unknown = [str(key) for key in recipe if key != "env" and key not in fields]  # env: TrlParser's own
        if unknown:
            raise RecipeError(f"recipe {path}: {_unknown_names(unknown, fields, 'key', '')}", hint=hint)
    script_args, training_args, remaining = parser.parse_args_and_config(args, return_remaining_strings=True)
    if remaining:
        options = [s.split("=", 1)[0].lstrip("-") for s in remaining if s.startswith("--")]
        if not options:
            raise RecipeError(f"unexpected argument(s) {' '.join(remaining)}", hint=hint)
        raise RecipeError(_unknown_names(options, fields, "option", "--"), hint=hint)
    return script_args, training_args


def _unknown_names(names: Sequence[str], fields: Sequence[str], kind: str, prefix: str) -> str:
    """``unknown key 'learning_rat' (did you mean learning_rate?)``, for each name, in one line."""
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, fields, n=3)
        guess = (
            f"did you mean {' or '.join(prefix + c for c in close)}?" if close else "no field is named alike"
        )
        parts.append(f"{prefix}{name}" if prefix else repr(name))
        parts[-1] += f" ({guess})"
    return f"unknown {kind}{'s' if len(names) > 1 else ''} " + ", ".join(parts)


def _check_yaml(path: str) -> Any:
    """The recipe's YAML; one that is not valid YAML is one error naming the file, line and column."""
    import yaml

    with open(path, encoding="utf-8") as handle:
        try:
            return yaml.safe_load(handle)
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = error.problem or "syntax error"
            context = error.context_mark
            if error.context and context is not None and context is not mark:
                problem += f" ({error.context} started at line {context.line + 1})"
            raise RecipeError(
                f"recipe {path}: invalid YAML{where}: {problem}.",
                hint="check the indentation, the colons and the quoting on that line.",
            ) from error
        except yaml.YAMLError as error:
            raise RecipeError(f"recipe {path}: invalid YAML: {' '.join(str(error).split())}") from error


def resolve_reward_funcs(names: Sequence[str], code_sandbox: str = "namespaces") -> list[Callable[..., Any]]:
    """Reward callables from names: built-ins (``REWARD_FUNCTIONS``) or ``module.attr`` / ``module:attr`` paths.

    ``code_sandbox`` is the backend of the built-in ``code_tests`` (a recipe's ``code_sandbox``); another
    than the default needs ``code_tests`` among ``names``, so that it is never set and unused."""
    from trl_sae.code_recipe import CODE_REWARD
    from trl_sae.rewards.code import make_code_reward
    from trl_sae.rewards.registry import REWARD_FUNCTIONS
    from trl_sae.rewards.sandbox import BACKENDS, IsolationUnavailableError

    if code_sandbox not in BACKENDS:
        raise ValueError(f"code_sandbox must be one of {list(BACKENDS)}, got {code_sandbox!r}.")
    if code_sandbox != "namespaces" and CODE_REWARD not in names:
        raise ValueError(
            f"code_sandbox: {code_sandbox} chooses the sandbox of the {CODE_REWARD} reward, which "
            f"reward_funcs ({list(names)}) does not use; add it, or drop code_sandbox."
        )
    funcs = []
    for name in names:
        if name == CODE_REWARD and code_sandbox != "namespaces":
            try:
                funcs.append(make_code_reward(backend=code_sandbox))
            except IsolationUnavailableError as error:  # one line from the CLIs, as other bad settings are
                raise ValueError(f"code_sandbox: {code_sandbox}: {error}") from error
            continue
        if name in REWARD_FUNCTIONS:
            funcs.append(REWARD_FUNCTIONS[name])
            continue
        module_name, sep, attr = name.replace(":", ".").rpartition(".")
        if not sep:
            raise ValueError(
                f"unknown reward function {name!r}: use one of {sorted(REWARD_FUNCTIONS)} or an importable "
                "path like my_package.rewards.my_reward."
            )
        try:
            module = importlib.import_module(module_name)
            funcs.append(getattr(module, attr))
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cannot import reward function {name!r}: {error}") from error
    if not funcs:
        raise ValueError("no reward function: set reward_funcs (e.g. [math_accuracy]).")
    return funcs


def _select(dataset: Any, limit: int | None) -> Any:
    return dataset.select(range(min(limit, len(dataset)))) if limit is not None else dataset


def load_recipe_datasets(script_args: ScriptArguments, seed: int = 0) -> tuple[Any, Any]:
    """``(train, eval or None)`` as ``prompt`` + ``answer`` datasets (see :func:`trl_sae.load_math_dataset`),
    reasoning-gym tasks (:func:`trl_sae.gym.load_reasoning_gym`) for ``reasoning_gym:<task>`` names, or STEM
    sets (:func:`trl_sae.stem.load_stem_dataset`: ``gpqa-diamond``, ``scp-116k``, ``multiple_choice:<source>``,
    ``science:<source>``).

    A reasoning-gym training set is ``max_train_samples`` problems generated with ``seed``; its held-out
    set ``max_eval_samples`` problems from ``seed + HELD_OUT_SEED_OFFSET``, without any question of the
    training set.
    """
    import json

    from trl_sae.data import load_math_dataset
    from trl_sae.gym import HELD_OUT_SEED_OFFSET, load_reasoning_gym, parse_gym_name
    from trl_sae.stem import load_stem_dataset, parse_stem_name

    code = _load_code_datasets(script_args, seed)
    if code is not None:
        return code
    train_task = parse_gym_name(script_args.dataset_name)
    eval_task = parse_gym_name(script_args.eval_dataset_name) if script_args.eval_dataset_name else None
    gym_config: dict[str, Any] = {}
    for name in ("reasoning_gym_few_shot", "reasoning_gym_worked_steps"):
        if train_task is None and eval_task is None and getattr(script_args, name):
            raise ValueError(
                f"{name} is set but no dataset is a reasoning-gym task; name one as "
                f"dataset_name: reasoning_gym:<task>, or drop {name}."
            )
    if script_args.reasoning_gym_worked_steps and not script_args.reasoning_gym_few_shot:
        raise ValueError(
            "reasoning_gym_worked_steps shapes the solved examples, but reasoning_gym_few_shot is 0; set "
            "reasoning_gym_few_shot: 2 (say), or drop reasoning_gym_worked_steps."
        )
    if script_args.reasoning_gym_config:
        if train_task is None and eval_task is None:
            raise ValueError(
                "reasoning_gym_config is set but no dataset is a reasoning-gym task; name one as "
                "dataset_name: reasoning_gym:<task>, or drop reasoning_gym_config."
            )
        try:
            gym_config = json.loads(script_args.reasoning_gym_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"reasoning_gym_config: not a JSON object ({error}).") from error
        if not isinstance(gym_config, dict):
            raise ValueError("reasoning_gym_config: must be a JSON object, e.g. '{\"max_terms\": 2}'.")

    def load_gym(task: str, prefix: str, seed: int, exclude: Any) -> Any:
        # prefix: "" for the training set, "eval_" for the held-out one (their fields' names)
        split_field = f"{prefix}dataset_split"
        size_field = f"max_{prefix or 'train_'}samples"
        if getattr(script_args, split_field) is not None:
            raise ValueError(
                f"{split_field}: a reasoning-gym task has no splits; drop it (seeds separate sets)."
            )
        size = getattr(script_args, size_field)
        if size is None:
            raise ValueError(f"{size_field}: set how many {task} problems to generate.")
        return load_reasoning_gym(
            task,
            size=size,
            seed=seed,
            config=gym_config,
            chat=script_args.chat_template,
            system_prompt=script_args.system_prompt,
            exclude_questions=exclude,
            few_shot=script_args.reasoning_gym_few_shot,
            worked_steps=script_args.reasoning_gym_worked_steps,
        )

    def load(name: str, split: str | None, limit: int | None) -> Any:
        if parse_stem_name(name) is not None:
            dataset, _ = load_stem_dataset(
                name, split=split, chat=script_args.chat_template, system_prompt=script_args.system_prompt
            )
        else:
            dataset = load_math_dataset(
                name, split=split, chat=script_args.chat_template, system_prompt=script_args.system_prompt
            )
        return _select(dataset, limit)

    if train_task is not None:
        train = load_gym(train_task, "", seed, ())
    else:
        train = load(script_args.dataset_name, script_args.dataset_split, script_args.max_train_samples)
    evaluation = None
    if eval_task is not None:
        seen = set(train["question"]) if "question" in train.column_names else set()
        evaluation = load_gym(eval_task, "eval_", seed + HELD_OUT_SEED_OFFSET, seen)
    elif script_args.eval_dataset_name:
        evaluation = load(
            script_args.eval_dataset_name, script_args.eval_dataset_split, script_args.max_eval_samples
        )
    return train, evaluation


def _load_code_datasets(script_args: ScriptArguments, seed: int) -> tuple[Any, Any] | None:
    """``(train, eval or None)`` when ``dataset_name`` is a code dataset (:mod:`trl_sae.code_recipe`), else
    None. The held-out set leaves out every training problem; a generated one comes from
    ``seed + HELD_OUT_SEED_OFFSET``."""
    from trl_sae.code_recipe import (
        CODE_TASK_NAME,
        load_code_source,
        load_code_task,
        parse_code_name,
        parse_code_task_config,
    )
    from trl_sae.gym import HELD_OUT_SEED_OFFSET

    train_kind = parse_code_name(script_args.dataset_name)
    eval_kind = parse_code_name(script_args.eval_dataset_name)
    uses_task = CODE_TASK_NAME in (script_args.dataset_name, script_args.eval_dataset_name)
    if script_args.code_task_config and not uses_task:
        raise ValueError(
            "code_task_config is set but no dataset is code_task; name it as dataset_name: code_task, or drop "
            "code_task_config."
        )
    if train_kind is None:
        if eval_kind is not None:
            raise ValueError(
                f"eval_dataset_name: {script_args.eval_dataset_name!r} is a code dataset but dataset_name "
                f"{script_args.dataset_name!r} is not; train and evaluate on code datasets together."
            )
        return None
    if eval_kind is None and script_args.eval_dataset_name:
        raise ValueError(
            f"eval_dataset_name: {script_args.eval_dataset_name!r} is not a code dataset but dataset_name is; "
            "name a code dataset (code_task or code:<source>)."
        )
    for name in ("reasoning_gym_config", "reasoning_gym_few_shot", "reasoning_gym_worked_steps"):
        if getattr(script_args, name):
            raise ValueError(f"{name} applies to reasoning_gym:<task> datasets, not code datasets; drop it.")
    if "math_accuracy" in script_args.reward_funcs:
        raise ValueError(
            "reward_funcs: math_accuracy cannot grade code (no answer column); set reward_funcs: [code_tests]."
        )
    config = parse_code_task_config(script_args.code_task_config)
    chat, system_prompt = script_args.chat_template, script_args.system_prompt

    def load(kind: tuple[str, str | None], prefix: str, seed: int, exclude: Any) -> Any:
        # prefix: "" for the training set, "eval_" for the held-out one (their fields' names)
        split_field, size_field = f"{prefix}dataset_split", f"max_{prefix or 'train_'}samples"
        split, size = getattr(script_args, split_field), getattr(script_args, size_field)
        if kind[0] == "task":
            if split is not None:
                raise ValueError(f"{split_field}: code_task has no splits; drop it (seeds separate sets).")
            if size is None:
                raise ValueError(f"{size_field}: set how many code_task problems to generate.")
            return load_code_task(
                size, seed, config, chat=chat, system_prompt=system_prompt, exclude_questions=exclude
            )
        dataset = load_code_source(
            kind[1] or "", split, chat=chat, system_prompt=system_prompt, exclude_questions=exclude
        )
        return _select(dataset, size)

    train = load(train_kind, "", seed, ())
    evaluation = None
    if eval_kind is not None:
        evaluation = load(eval_kind, "eval_", seed + HELD_OUT_SEED_OFFSET, set(train["question"]))
    return train, evaluation


def build_peft_config(script_args: ScriptArguments) -> Any:
    """A ``peft.LoraConfig`` from the LoRA settings, or None without ``use_peft``."""
    if not script_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=script_args.lora_dropout,
        target_modules=script_args.lora_target_modules or "all-linear",
        layers_to_transform=script_args.lora_layers_to_transform,
        task_type="CAUSAL_LM",
    )


def _check_layers_to_transform(script_args: ScriptArguments) -> None:
    """``lora_layers_to_transform`` only with ``use_peft`` and named target modules (peft refuses it with
    ``all-linear``), and as distinct non-negative layer indices."""
    layers = script_args.lora_layers_to_transform
    if not script_args.use_peft:
        raise ValueError("lora_layers_to_transform chooses LoRA layers: set use_peft: true, or drop it.")
    if not script_args.lora_target_modules:
        raise ValueError(
            "lora_layers_to_transform needs lora_target_modules (peft applies it to named modules only), e.g. "
            "lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]."
        )
    if not layers or any(layer < 0 for layer in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"lora_layers_to_transform must be distinct layer indices >= 0, got {layers}.")


def build_trainer(
    script_args: ScriptArguments, training_args: Any, callbacks: list[Any] | None = None
) -> tuple[Any, Any, Any]:
    """Tokenizer, datasets, rewards, LoRA and the trainer, from a parsed recipe.

    Returns:
        ``(trainer, train_dataset, eval_dataset)``.
    """
    from trl_sae.gguf import resolve_pretrained, tokenizer_from_pretrained
    from trl_sae.trainer.checkpoints.folders import check_fresh_start, parse_resume_flag
    from trl_sae.trainer.sae_ppo_trainer import SAEPPOTrainer

    if script_args.lora_layers_to_transform is not None:
        _check_layers_to_transform(script_args)
    # Before any model or dataset loads: an unknown reward, or a bwrap sandbox that cannot run here, is one
    # line at once.
    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, script_args.code_sandbox)
    if training_args.load_in_4bit and not script_args.use_peft:
        raise ValueError(
            "load_in_4bit=true (QLoRA) trains adapters on a frozen 4-bit base: set use_peft: true."
        )
    init_kwargs = dict(training_args.model_init_kwargs or {})
    if script_args.dtype:
        init_kwargs.setdefault("dtype", script_args.dtype)
    if script_args.attn_implementation:
        init_kwargs.setdefault("attn_implementation", script_args.attn_implementation)
    training_args.model_init_kwargs = init_kwargs or None

    # Every model argument is checked before anything loads: a missing folder (or, offline, an uncached Hub
    # id) is one line at once rather than a Hub lookup after the datasets are built.
    # A *.gguf path resolves to its folder plus gguf_file; the trainer is given the file itself again.
    model_source, model_kwargs = resolve_pretrained(
        script_args.model_name_or_path, "model_name_or_path", init_kwargs
    )
    model_path = model_source
    if model_kwargs.get("gguf_file") and not init_kwargs.get("gguf_file"):
        model_path = os.path.join(model_source, model_kwargs["gguf_file"])
    value_path = script_args.value_model_name_or_path
    if value_path and value_path not in ("shared", "head"):
        value_source, value_kwargs = resolve_pretrained(value_path, "value_model_name_or_path", init_kwargs)
        value_path = value_source
        if value_kwargs.get("gguf_file") and not init_kwargs.get("gguf_file"):
            value_path = os.path.join(value_source, value_kwargs["gguf_file"])
    tokenizer_source, tokenizer_kwargs = model_source, model_kwargs
    if script_args.tokenizer_name_or_path:
        # model_init_kwargs' gguf_file names the model's file, not the tokenizer's
        tokenizer_source, tokenizer_kwargs = resolve_pretrained(
            script_args.tokenizer_name_or_path,
            "tokenizer_name_or_path",
            {k: v for k, v in init_kwargs.items() if k != "gguf_file"},
        )
    if not script_args.dry_run and parse_resume_flag(training_args.resume_from_checkpoint) is None:
        # The trainer refuses this too, at train(); say it before loading the models.
        check_fresh_start(training_args.output_dir, training_args.overwrite_output_dir)
    tokenizer = tokenizer_from_pretrained(tokenizer_source, tokenizer_kwargs, padding_side="left")
    train_dataset, eval_dataset = load_recipe_datasets(script_args, seed=training_args.seed)
    trainer = SAEPPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        value_model=value_path,
        peft_config=build_peft_config(script_args),
        eval_dataset=eval_dataset,
        callbacks=callbacks,
    )
    return trainer, train_dataset, eval_dataset


def _summary(
    trainer: Any, script_args: ScriptArguments, train_dataset: Any, eval_dataset: Any
) -> dict[str, Any]:
    args = trainer.args
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    trainable = sum(p.numel() for p in unwrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in unwrapped.parameters())
    return {
        "model": script_args.model_name_or_path,
        "critic": type(unwrapped).__name__ if args.uses_critic else f"none ({args.advantage_estimator})",
        "peft": bool(trainer.is_peft_model),
        "load_in_4bit": bool(args.load_in_4bit),
        "train_prompts": len(train_dataset),
        "eval_prompts": len(eval_dataset) if eval_dataset is not None else 0,
        "reward_funcs": list(trainer.reward_func_names),
        "advantage_estimator": args.advantage_estimator,
        "segmentation": args.segmentation,
        "segment_threshold": args.segment_threshold,
        "num_generations": args.num_generations,
        "completions_per_step": args.batch_size,
        "steps": args.num_total_batches,
        "trainable_parameters": trainable,
        "total_parameters": total,
    }


def run_recipe(
    script_args: ScriptArguments, training_args: Any, callbacks: list[Any] | None = None
) -> dict[str, Any]:
    """Build the trainer from a recipe and, unless ``dry_run``, train, evaluate, save, card and push.

    ``push_to_hub`` is handled after training by :func:`trl_sae.hub.save_and_push` (one upload with the
    SAE model card) rather than by the trainer at every save, so building the trainer never needs the
    network.

    Returns:
        A summary of the run (and, after training, its final metrics and where it was saved).
    """
    push = bool(training_args.push_to_hub)
    if push and not training_args.hub_model_id:
        raise ValueError("push_to_hub needs hub_model_id (e.g. --hub_model_id your-name/qwen3-0.6b-sae).")
    training_args.push_to_hub = False
    trainer, train_dataset, eval_dataset = build_trainer(script_args, training_args, callbacks)
    summary = _summary(trainer, script_args, train_dataset, eval_dataset)
    if script_args.dry_run:
        summary["dry_run"] = True
        return summary
    # A folder, or "true" for the newest intact checkpoint in output_dir (the trainer verifies it).
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    extra: dict[str, Any] = {}
    held_out = None
    if eval_dataset is not None:
        from trl_sae.trainer.parts.evaluation import held_out_line

        extra.update(trainer.evaluate())
        held_out = held_out_line(trainer.state.log_history, _eval_temperature(training_args))
    from trl_sae.hub import final_metrics, save_and_push

    saved = save_and_push(
        trainer,
        push=push,
        repo_id=training_args.hub_model_id,
        base_model=script_args.model_name_or_path,
        dataset_name=script_args.dataset_name,
        extra_metrics=extra,
    )
    summary.update(final_metrics(trainer.state.log_history))
    summary.update(extra)
    summary.update(saved)
    if held_out is not None:
        summary["held_out"] = held_out
        if trainer.accelerator.is_main_process:
            print(held_out)  # the run's result in one line, after the progress bars and saving
    end_distributed_run(trainer)
    return summary


def _eval_temperature(training_args: Any) -> float:
    if training_args.eval_temperature is None:
        return training_args.temperature
    return training_args.eval_temperature


def end_distributed_run(trainer: Any) -> None:
    """Tear the process group down at the end of a multi-process run, while every rank is still alive.

    A gloo (CPU) rank that leaves with its group up can abort at interpreter exit ("terminate called without
    an active exception", exit -6) after all its work is done (pytorch/pytorch#190489), and the launcher then
    reports the run as failed. One process keeps its group: a colocated vLLM engine initialised it and keeps
    using it, so a later engine in the same process (a notebook, a test) needs it alive.
    """
    if trainer.accelerator.num_processes > 1:
        trainer.accelerator.end_training()
