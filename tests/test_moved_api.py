"""Code written for 0.1.0 (issue 48): every trainer method and public import of 0.1.0 still works, or fails at
once naming its new place; none is silently ignored.

* Trainer methods: each method of the 0.1.0 ``SAEPPOTrainer`` (and of main until the parts were split out, and of
  today's, listed literally below) is still defined and called during training, or is in
  ``trl_sae._moved.MOVED_TRAINER_METHODS`` and refused when a subclass overriding it is defined. Removing a
  method from the trainer without adding it to the table fails ``test_a_trainer_method_*``.
* Parts: an override written the new way (a subclass of the part, returned from its builder) is called.
* Imports: every public name of 0.1.0's modules imports from its 0.1.0 path (old paths are aliases with a
  ``DeprecationWarning`` naming the new one) and is the object at its new place.
* The migration note: CHANGELOG.md and the docs show ``migration_table``'s text.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
from peft import LoraConfig

import trl_sae
from tests.test_trainer import make_config, make_dataset, vowel_fraction
from trl_sae import SAEPPOTrainer
from trl_sae._moved import (
    MOVED_MODULES,
    MOVED_NAMES,
    MOVED_TRAINER_METHODS,
    PARTS,
    Moved,
    MovedNameError,
    migration_table,
)
from trl_sae.demo.tiny import build_tiny_qwen3, build_tiny_qwen3_critic
from trl_sae.trainer.checkpoints.state import CheckpointState
from trl_sae.trainer.parts.rollout import Rollouts
from trl_sae.trainer.parts.update import PPOUpdate

ROOT = Path(__file__).resolve().parents[1]

# ``SAEPPOTrainer``'s namespace at the 0.1.0 release (commit 21bda63, trl_sae/trainer.py).
TRAINER_0_1_0 = [
    "__init__", "_backward_micro_batch", "_begin_training", "_build_critic", "_build_reference",
    "_checkpointed_shared_critic", "_clip_gradients", "_collate_prompts", "_compute_advantages",
    "_compute_boundaries", "_compute_values", "_critic_lora_config", "_four_bit_config", "_global_moments",
    "_load_policy", "_load_tokenizer", "_log_completions_table", "_log_step", "_name", "_paper", "_ppo_loss",
    "_prepare_prompt_dataset", "_prompt_indices", "_reference_logprobs", "_resume", "_rollout",
    "_rotate_checkpoints", "_save_checkpoint", "_save_peft_policy", "_score", "_sequence_inputs",
    "_setup_accelerator", "_setup_batch_sizes", "_setup_callbacks", "_setup_generation", "_setup_models",
    "_setup_rewards", "_sorted_checkpoints", "_tag_names", "_update", "_wrap_policy_and_critic",
    "_wrap_with_peft", "create_optimizer", "evaluate", "null_ref_context", "save_model", "train", "train_step",
]  # fmt: skip

# Methods the trainer had on main after 0.1.0, up to the commits that split out CheckpointState (6b726dc),
# PPOUpdate (e70152d) and Rollouts (3946081), that 0.1.0 did not have.
TRAINER_BEFORE_PARTS = [
    "_backward", "_check_evaluation_setup", "_check_finite_loss", "_evaluate_during_training",
    "_exchange_groups", "_flush_logs", "_handle_overlong_prompts", "_loss_masks", "_micro_batches",
    "_pad_micro_batches", "_plan_start", "_policy_logprobs", "_rlvr_knob_metrics", "_rollout_filtered",
    "_rollout_mismatch_stats", "_rollout_vllm", "_scored_rollout", "_setup_adapter_names",
    "_setup_deepspeed_batch_sizes", "_setup_deepspeed_clipping", "_setup_vllm", "_teacher_forced",
    "_vllm_weights_stale", "critic_kind",
]  # fmt: skip

# Today's namespace. A method added to the trainer is added here, so that removing it later fails the first test
# below unless it enters MOVED_TRAINER_METHODS.
TRAINER_TODAY = [
    "ROLLOUT_PREFIX_BYTES", "_LATEST_VALUE_METRICS", "_begin_training", "_build_critic", "_build_ppo_update",
    "_build_reference", "_build_rollouts", "_check_evaluation_setup", "_checkpoint_state",
    "_compute_advantages", "_compute_boundaries", "_compute_values", "_evaluate_during_training",
    "_flush_logs", "_handle_overlong_prompts", "_load_policy", "_load_tokenizer", "_log_completions_table",
    "_log_step", "_name", "_paper", "_plan_start", "_prepare_prompt_dataset", "_reference_logprobs",
    "_resume", "_rlvr_knob_metrics", "_rotate_checkpoints", "_save_checkpoint", "_save_peft_policy",
    "_sequence_inputs", "_setup_accelerator", "_setup_adapter_names", "_setup_batch_sizes", "_setup_callbacks",
    "_setup_deepspeed_batch_sizes", "_setup_deepspeed_clipping", "_setup_generation", "_setup_models",
    "_setup_prefix_sharing", "_setup_rewards", "_setup_vllm", "_shared_prefix", "_sorted_checkpoints",
    "_tag_names", "_wrap_policy_and_critic", "_wrap_with_peft", "create_optimizer", "critic_kind", "evaluate",
    "is_distributed_loading_by_transformers", "null_ref_context", "save_model", "train", "train_step",
    "value_pretraining",
]  # fmt: skip

EVER = sorted(set(TRAINER_0_1_0) | set(TRAINER_BEFORE_PARTS) | set(TRAINER_TODAY))
KEPT = [name for name in EVER if name not in MOVED_TRAINER_METHODS]


def _namespace(cls: type) -> set[str]:
    return {name for name in vars(cls) if not (name.startswith("__") and name.endswith("__"))}


def _spied(name: str) -> bool:
    """A kept name whose calls a subclass can count: a plain method, not a property or a class attribute."""
    value = vars(SAEPPOTrainer).get(name)
    return callable(value) and not isinstance(value, (property, staticmethod, classmethod, type))


# --------------------------------------------------------------------------------------------------
# Trainer methods: kept (and called) or refused, naming the new place
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", EVER)
def test_a_trainer_method_of_0_1_0_or_since_is_still_defined_or_in_the_table(name):
    assert name in vars(SAEPPOTrainer) or name in MOVED_TRAINER_METHODS, (
        f"SAEPPOTrainer.{name} is gone: add it to trl_sae._moved.MOVED_TRAINER_METHODS with its new place, so a "
        "subclass overriding it is refused instead of silently ignored."
    )


def test_the_listed_namespace_is_todays():
    """A new trainer method is listed in TRAINER_TODAY, so that its later removal is caught."""
    assert _namespace(SAEPPOTrainer) - {"__getattr__"} == set(TRAINER_TODAY)


def _new_place(moved: Moved) -> object:
    """The object ``moved.new`` names: a part's method or a dotted path."""
    head, _, rest = moved.new.partition(".")
    if head in PARTS:
        module, _, cls = PARTS[head].path.rpartition(".")
        return getattr(getattr(importlib.import_module(module), cls), rest)
    module, _, name = moved.new.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", sorted(MOVED_TRAINER_METHODS))
def test_a_subclass_overriding_a_moved_trainer_method_is_refused_naming_the_new_place(name):
    moved = MOVED_TRAINER_METHODS[name]
    assert _new_place(moved) is not None  # the named place exists
    with pytest.raises(TypeError) as error:
        type("OldStyleTrainer", (SAEPPOTrainer,), {name: lambda self, *args, **kwargs: None})
    message = str(error.value)
    assert message.startswith(f"OldStyleTrainer overrides {name}, which SAEPPOTrainer no longer calls")
    assert f"  {name} -> {moved.new}" in message
    part = PARTS.get(moved.new.split(".")[0])
    if part is not None:  # how to swap the part in
        assert (
            f"subclass {part.name}, override the method there" in message and f"{part.builder}()" in message
        )
    else:
        assert moved.note in message


def test_a_mixins_override_of_a_moved_method_is_refused_too():
    class ScoreLogging:
        def _score(self, batch):
            pass

    with pytest.raises(TypeError, match=r"(?s)LoggingTrainer overrides _score, .*_score -> Rollouts\.score"):

        class LoggingTrainer(SAEPPOTrainer, ScoreLogging):
            pass


def test_every_stale_override_is_named_in_one_error():
    with pytest.raises(TypeError) as error:

        class Old(SAEPPOTrainer):
            def _rollout(self, prompt_batch):
                pass

            def _ppo_loss(self, batch, index, train_actor):
                pass

    message = str(error.value)
    assert "Old overrides _rollout, _ppo_loss," in message
    assert "_rollout -> Rollouts.sample" in message and "_ppo_loss -> PPOUpdate.loss" in message
    assert "_build_rollouts()" in message and "_build_ppo_update()" in message


def test_a_subclass_overriding_kept_methods_is_defined():
    class Fine(SAEPPOTrainer):
        def _compute_values(self, batch):
            super()._compute_values(batch)

        def _build_rollouts(self, cls=Rollouts):
            return super()._build_rollouts(cls)

    assert issubclass(Fine, SAEPPOTrainer)


@pytest.mark.parametrize("name", ["_score", "_update", "_four_bit_config"])
def test_calling_a_moved_method_names_where_it_is_now(name):
    trainer = SAEPPOTrainer.__new__(SAEPPOTrainer)  # attribute lookup only: no model needed
    moved = MOVED_TRAINER_METHODS[name]
    with pytest.raises(
        AttributeError, match=re.escape(f"SAEPPOTrainer.{name} moved in 0.2.0: {name} -> {moved.new}")
    ):
        getattr(trainer, name)
    with pytest.raises(AttributeError, match="'SAEPPOTrainer' object has no attribute '_no_such_method'"):
        trainer._no_such_method  # noqa: B018


def _lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _spy_trainer(calls: Counter) -> type:
    """An SAEPPOTrainer subclass counting the calls of every kept method (and calling it)."""

    def spy(name, method):
        def counted(self, *args, **kwargs):
            calls[name] += 1
            return method(self, *args, **kwargs)

        return counted

    spies = {name: spy(name, vars(SAEPPOTrainer)[name]) for name in KEPT if _spied(name)}
    return type("SpyTrainer", (SAEPPOTrainer,), spies)


def test_every_kept_trainer_method_is_called_by_init_training_evaluation_checkpoints_and_resume(
    tmp_path, tokenizer
):
    """A kept method an override of which would be ignored (never called) would have to be in the table.

    One LoRA run with a separate critic, the KL penalty, the completions table, an evaluation on start and a
    checkpoint after its step; then a second trainer resumes from it and trains one more step."""
    calls: Counter = Counter()
    spy = _spy_trainer(calls)

    def trainer(max_steps):
        return spy(
            model=build_tiny_qwen3(tokenizer, seed=0),
            reward_funcs=vowel_fraction,
            args=make_config(
                tmp_path,
                max_steps=max_steps,
                kl_coef=0.05,
                log_completions=True,
                num_completions_to_print=1,
                eval_strategy="steps",
                eval_steps=1,
                eval_on_start=True,
                per_device_eval_batch_size=4,
                save_strategy="steps",
                save_steps=1,
                logging_steps=1,
            ),
            train_dataset=make_dataset(),
            eval_dataset=make_dataset(4),
            processing_class=tokenizer,
            peft_config=_lora(),
            value_model=build_tiny_qwen3_critic(tokenizer, seed=1),
        )

    trainer(1).train()
    trainer(2).train(resume_from_checkpoint=True)
    expected = {name for name in KEPT if _spied(name)}
    assert len(expected) > 40
    assert expected - set(calls) == set()


# --------------------------------------------------------------------------------------------------
# Parts: an override written the new way is called
# --------------------------------------------------------------------------------------------------
# Part methods (new places of moved trainer methods) that a plain CPU step does not run, and why.
NOT_IN_A_PLAIN_STEP = {
    "Rollouts._sample_vllm": "use_vllm",
    "Rollouts._mismatch_stats": "use_vllm",
    "Rollouts._exchange_groups": "filter_groups on more than one process",
}


def _recording(part: type, calls: Counter) -> type:
    """A subclass of ``part`` that counts the calls of each method a moved trainer method now lives in."""
    names = {
        m.new.split(".", 1)[1] for m in MOVED_TRAINER_METHODS.values() if m.new.split(".")[0] == part.__name__
    }

    def record(name):
        def recorded(self, *args, **kwargs):
            calls[f"{part.__name__}.{name}"] += 1
            return getattr(super(cls, self), name)(*args, **kwargs)

        return recorded

    cls = type(f"Recording{part.__name__}", (part,), {name: record(name) for name in names})
    return cls


def _swapped_trainer(tmp_path, tokenizer, calls: Counter, **overrides) -> SAEPPOTrainer:
    rollouts, update = _recording(Rollouts, calls), _recording(PPOUpdate, calls)

    class NewStyleTrainer(SAEPPOTrainer):
        def _build_rollouts(self, cls=rollouts):
            return super()._build_rollouts(cls)

        def _build_ppo_update(self):
            return update(self.accelerator, self.model, self.optimizer, self.args)

        def _checkpoint_state(self):
            calls["_checkpoint_state"] += 1
            return super()._checkpoint_state()

    return NewStyleTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, **overrides),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("part", ["Rollouts", "PPOUpdate"])
def test_an_override_of_a_parts_method_written_the_new_way_is_called_in_a_step(tmp_path, tokenizer, part):
    """Each method of the part that took over a 0.1.0 trainer method, overridden in a subclass of the part returned
    from the trainer's builder, is called in one training step (the KL penalty on: its reference pass is
    Rollouts.teacher_forced)."""
    calls: Counter = Counter()
    trainer = _swapped_trainer(tmp_path, tokenizer, calls, max_steps=1, kl_coef=0.05)
    assert type(getattr(trainer, PARTS[part].attribute)).__name__ == f"Recording{part}"
    trainer.train()
    expected = {m.new for m in MOVED_TRAINER_METHODS.values() if m.new.split(".")[0] == part}
    assert expected - set(NOT_IN_A_PLAIN_STEP) - set(calls) == set()
    assert all(calls[name] >= 1 for name in expected - set(NOT_IN_A_PLAIN_STEP))


def test_an_override_of_the_checkpoint_state_builder_is_used_to_save_and_to_resume(tmp_path, tokenizer):
    calls: Counter = Counter()
    trainer = _swapped_trainer(tmp_path, tokenizer, calls, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    assert calls["_checkpoint_state"] == 1 and os.path.isdir(tmp_path / "out" / "checkpoint-1")
    resumed = _swapped_trainer(tmp_path, tokenizer, calls, max_steps=1)
    resumed.train(resume_from_checkpoint=True)
    assert calls["_checkpoint_state"] == 2 and resumed.state.global_step == 1
    assert isinstance(resumed._checkpoint_state(), CheckpointState)


# --------------------------------------------------------------------------------------------------
# Imports of 0.1.0
# --------------------------------------------------------------------------------------------------
# Every module's __all__ at the 0.1.0 release (21bda63), and the package's own exports.
API_0_1_0: dict[str, list[str]] = {
    "trl_sae": [
        "ADVANTAGE_ESTIMATORS", "RolloutBatch", "RolloutOutput", "SAEPPOConfig", "SAEPPOTrainer",
        "adaptive_lambda", "compute_rewards", "discounted_reverse_scan", "entropy_boundaries", "format_reward",
        "forward_logprobs", "gae_advantages", "generate_with_logprobs", "get_advantage_estimator",
        "grpo_advantages", "load_math_dataset", "logprobs_from_logits", "math_accuracy", "mc_advantages",
        "probability_boundaries", "register_advantage_estimator", "sae_advantages", "segment_lengths",
        "token_boundaries", "uniform_boundaries",
    ],
    "trl_sae.advantages": [
        "ADVANTAGE_ESTIMATORS", "adaptive_lambda", "discounted_reverse_scan", "gae_advantages",
        "get_advantage_estimator", "grpo_advantages", "mc_advantages", "register_advantage_estimator",
        "sae_advantages",
    ],
    "trl_sae.analysis": [
        "DEFAULT_LAM_GRID", "DEFAULT_P_GRID", "DEFAULT_SEGSTATS_P_GRID", "BootstrapPearson", "CorrelationResult",
        "CorrelationRow", "MonteCarloValues", "SegmentStatsRow", "SpanRecord", "correlate_advantages",
        "critic_value_fn", "estimator_advantages", "monte_carlo_values", "pearson_with_bootstrap", "pick_spans",
        "plot_correlations", "plot_segment_stats", "sampling_generation_config", "segment_anchors",
        "segment_stats_from_logprobs", "segment_stats_vs_threshold",
    ],
    "trl_sae.analysis.correlation": [
        "DEFAULT_LAM_GRID", "DEFAULT_P_GRID", "BootstrapPearson", "CorrelationResult", "CorrelationRow",
        "MonteCarloValues", "SpanRecord", "correlate_advantages", "critic_value_fn", "estimator_advantages",
        "monte_carlo_values", "pearson_with_bootstrap", "pick_spans", "sampling_generation_config",
        "segment_anchors",
    ],
    "trl_sae.analysis.plots": ["plot_correlations", "plot_segment_stats"],
    "trl_sae.analysis.segstats": [
        "DEFAULT_SEGSTATS_P_GRID", "SegmentStatsRow", "segment_stats_from_logprobs", "segment_stats_vs_threshold",
    ],
    "trl_sae.cli": ["CLIError", "build_parser", "config_table", "main"],
    "trl_sae.config": ["SEGMENTATIONS", "SAEPPOConfig"],
    "trl_sae.data": [
        "DEFAULT_INSTRUCTION", "MATH_DATASETS", "DatasetUnavailableError", "MathDatasetSpec", "load_math_dataset",
        "prepare_prompt_dataset",
    ],
    "trl_sae.demo": ["DemoConfig", "run_demo"],
    "trl_sae.evaluation": ["evaluate_accuracy", "generate_completions"],
    "trl_sae.hub": [
        "CARD_METRIC_KEYS", "estimator_settings", "final_metrics", "model_card", "push_folder_to_hub",
        "save_and_push", "write_model_card",
    ],
    "trl_sae.recipe": [
        "ScriptArguments", "build_peft_config", "build_trainer", "load_recipe_datasets", "parse_recipe",
        "resolve_reward_funcs", "run_recipe",
    ],
    "trl_sae.report": [
        "make_completion_record", "render_curves_png", "render_segments_html", "render_segments_terminal",
        "split_segments", "write_html_report",
    ],
    "trl_sae.rewards": [
        "REWARD_FUNCTIONS", "RewardFunction", "compute_rewards", "format_reward", "make_format_reward",
        "make_math_accuracy", "math_accuracy", "reward_func_name", "validate_reward_funcs",
    ],
    "trl_sae.rollout": ["RolloutOutput", "forward_logprobs", "generate_with_logprobs", "logprobs_from_logits"],
    "trl_sae.segmentation": [
        "entropy_boundaries", "probability_boundaries", "segment_lengths", "token_boundaries", "uniform_boundaries",
    ],
    "trl_sae.tasks": [
        "ANSWER_PREFIX", "DEMO_DEFAULTS", "TASK_VARIANTS", "DemoDefaults", "completion_text", "extract_answer",
        "format_prompt", "format_solution", "make_running_sum_dataset", "make_running_sum_splits",
        "running_sum_reward",
    ],
    "trl_sae.tiny": ["CHAT_TEMPLATE", "build_char_tokenizer", "build_tiny_qwen3", "build_tiny_qwen3_critic"],
    "trl_sae.trainer": ["RolloutBatch", "SAEPPOTrainer"],
    "trl_sae.value": ["PolicyAndCritic", "build_critic_from_policy", "load_critic"],
    "trl_sae.warmstart": [
        "DemoSetup", "encode_prompt", "prepare_demo", "sft_loss", "sft_warm_start", "tokenize_sft_examples",
    ],
}  # fmt: skip


def _current(old_module: str, name: str) -> object:
    """Where ``old_module.name`` of 0.1.0 is now."""
    moved = MOVED_NAMES.get(f"{old_module}.{name}")
    if moved is not None:
        return _new_place(moved)
    return getattr(importlib.import_module(MOVED_MODULES.get(old_module, old_module)), name)


@pytest.mark.parametrize("module", sorted(API_0_1_0))
def test_every_public_name_of_0_1_0_imports_from_its_old_path_as_the_object_at_its_new_place(module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module(module)
        values = {name: getattr(old, name) for name in API_0_1_0[module]}
    assert {name: value is _current(module, name) for name, value in values.items()} == dict.fromkeys(
        values, True
    )
    moved = {
        str(w.message) for w in caught if w.category is DeprecationWarning and "in 0.2.0" in str(w.message)
    }
    expected = {f"{module}.{name}" for name in values if f"{module}.{name}" in MOVED_NAMES}
    assert {m.split(" moved to ")[0] for m in moved if m.split(" moved to ")[0] in expected} == expected


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_an_alias_that_warns_with_its_new_place(old):
    new = MOVED_MODULES[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new} in 0.2.0")) as caught:
        __import__(old)  # as an import statement does (importlib.import_module's own frame would be blamed)
    alias = sys.modules[old]
    assert caught[0].filename == __file__  # attributed to the importing code, not to the import system
    target = importlib.import_module(new)
    assert alias.__name__ == old and not hasattr(alias, "__path__") and not hasattr(alias, "__file__")
    assert alias.__all__ == target.__all__
    name = target.__all__[0]
    assert getattr(alias, name) is getattr(target, name) and name in dir(alias)
    with pytest.raises(
        AttributeError, match=re.escape(f"module {old!r} (now {new!r}) has no attribute 'nope'")
    ):
        alias.nope  # noqa: B018
    # No real module sits at the old path (the finder comes last on sys.meta_path: a real one would win).
    relative = Path(*old.split(".")[1:])
    assert not (
        trl_sae.__path__ and any((Path(p) / relative).with_suffix(".py").exists() for p in trl_sae.__path__)
    )
    assert not any((Path(p) / relative).is_dir() for p in trl_sae.__path__)


def test_an_old_module_path_imports_first_thing_in_a_fresh_interpreter():
    """``from trl_sae.advantages import *`` and a pickle naming 0.1.0's ``trl_sae.config.SAEPPOConfig`` work
    before anything else of the package is imported."""
    code = (
        "import pickle, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n    from trl_sae.advantages import *\nexcept DeprecationWarning as w:\n    print(w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from trl_sae.advantages import *\n"
        "cls = pickle.loads(b'ctrl_sae.config\\nSAEPPOConfig\\n.')\n"
        "print(gae_advantages.__module__, cls.__module__, cls.__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-2:] == [
        "trl_sae.advantages moved to trl_sae.core.advantages in 0.2.0; import it from there.",
        "trl_sae.core.advantages trl_sae.trainer.config.sae_ppo_config SAEPPOConfig",
    ]


def test_a_pickled_0_1_0_config_class_loads():
    with pytest.warns(DeprecationWarning, match="trl_sae.config moved to trl_sae.trainer.config"):
        sys.modules.pop("trl_sae.config", None)
        cls = pickle.loads(b"ctrl_sae.config\nSAEPPOConfig\n.")
    assert cls is trl_sae.SAEPPOConfig


def test_segmentations_is_now_the_segmenter_registry():
    with pytest.warns(DeprecationWarning, match="trl_sae.config.SEGMENTATIONS moved to"):
        from trl_sae.config import SEGMENTATIONS
    assert set(SEGMENTATIONS) == {"probability", "uniform", "newline", "entropy"}  # 0.1.0's tuple
    assert "probability" in SEGMENTATIONS and "nope" not in SEGMENTATIONS


def test_a_removed_name_fails_at_import_with_what_to_do(monkeypatch):
    monkeypatch.setitem(MOVED_NAMES, "trl_sae.config.OLD_KNOB", Moved("", "set `new_knob` instead"))
    with pytest.raises(
        MovedNameError, match=r"trl_sae.config.OLD_KNOB was removed in 0.2.0: set `new_knob` instead"
    ):
        from trl_sae.config import OLD_KNOB  # noqa: F401
    with pytest.raises(ImportError, match="cannot import name 'NEVER'"):
        from trl_sae.config import NEVER  # noqa: F401


def test_every_new_place_in_the_table_exists():
    for new in MOVED_MODULES.values():
        importlib.import_module(new)
    for moved in [*MOVED_NAMES.values(), *MOVED_TRAINER_METHODS.values()]:
        assert _new_place(moved) is not None if moved.new else moved.note  # a removal says what to do


def test_the_update_modules_refusal_names_that_left_it_name_the_table():
    for name in ("MOVED_TRAINER_METHODS", "refuse_moved_trainer_overrides"):
        with pytest.raises(
            MovedNameError, match=f"trl_sae.trainer.update.{name} was removed in 0.2.0: .*trl_sae._moved"
        ):
            exec(f"from trl_sae.trainer.update import {name}")


# --------------------------------------------------------------------------------------------------
# The migration note shows the table
# --------------------------------------------------------------------------------------------------
def _unreleased() -> str:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]


@pytest.mark.parametrize(
    ("page", "kind"),
    [
        ("CHANGELOG.md", "methods"),
        ("CHANGELOG.md", "imports"),
        ("docs/guides/phases.md", "methods"),
        ("docs/guides/layout.md", "imports"),
    ],
)
def test_the_migration_note_shows_the_table(page, kind):
    text = _unreleased() if page == "CHANGELOG.md" else (ROOT / page).read_text(encoding="utf-8")
    table = migration_table(kind)
    assert table in text, (
        f"{page} does not show the current table of moves ({kind}); paste the output of "
        f'python -c "from trl_sae._moved import migration_table; print(migration_table({kind!r}))"'
    )


def test_the_migration_table_has_a_row_per_entry():
    methods, imports = migration_table("methods"), migration_table("imports")
    assert len(methods.splitlines()) == 2 + len(MOVED_TRAINER_METHODS)
    assert len(imports.splitlines()) == 2 + len(MOVED_MODULES) + len(MOVED_NAMES)
    assert (
        "| `_score` | `Rollouts.score` | subclass `Rollouts`, return it from `_build_rollouts()` |" in methods
    )
    assert "| `trl_sae.advantages` | `trl_sae.core.advantages` |" in imports


def test_a_config_class_pickled_before_config_became_a_package_loads():
    """Checkpoints of 0.2.0's development pickled ``trl_sae.trainer.config.SAEPPOConfig`` (a module then, a
    package now): the package exports it, so they load."""
    assert pickle.loads(b"ctrl_sae.trainer.config\nSAEPPOConfig\n.") is trl_sae.SAEPPOConfig
