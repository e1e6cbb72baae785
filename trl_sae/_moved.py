"""What moved since 0.1.0 and where it is now: one table, read by everything that keeps an old spelling honest.

* :data:`MOVED_MODULES`: an old module path keeps importing (``import trl_sae.advantages``): a finder on
  ``sys.meta_path`` (:func:`install`, run by ``import trl_sae``) makes it a thin alias of the new module, whose
  names it reads on access, with a ``DeprecationWarning`` naming the new path.
* :data:`MOVED_NAMES`: a public name that left its 0.1.0 module keeps working from the old spelling
  (``from trl_sae.value import load_critic``), warning with the new place; a name whose entry has no new place
  fails at import with the note. An old module still on disk hands its moved names over with
  ``__getattr__ = moved_names_getattr(__name__)``.
* :data:`MOVED_TRAINER_METHODS`: an ``SAEPPOTrainer`` method the trainer no longer calls (it moved into a part,
  :data:`PARTS`, or became a function). A subclass overriding one would be silently ignored, so
  :func:`refuse_moved_overrides` (``SAEPPOTrainer.__init_subclass__``) refuses it when the class is defined,
  naming the new place and how to swap the part in; :func:`moved_attribute_error` names it when code calls it.

To record a move: one entry here (old -> new), nothing else. :func:`migration_table` renders the table for
the CHANGELOG and the docs (``tests/test_moved_api.py`` checks that they show it). Only the standard library
is imported: the package's ``__init__`` installs the finder before anything heavy loads.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MOVED_MODULES",
    "MOVED_NAMES",
    "MOVED_TRAINER_METHODS",
    "PARTS",
    "Moved",
    "MovedNameError",
    "Part",
    "install",
    "migration_table",
    "moved_attribute_error",
    "moved_names_getattr",
    "refuse_moved_overrides",
]


@dataclass(frozen=True)
class Moved:
    """Where something is now.

    Attributes:
        new: ``"<Part>.<method>"`` for a trainer method that moved into a part of :data:`PARTS`, else a dotted
            path (``trl_sae.trainer.critics.build.load_critic``); empty when it was removed without a replacement.
        note: what to do beyond using the new place (for a trainer method: which trainer method to override).
    """

    new: str
    note: str = ""


@dataclass(frozen=True)
class Part:
    """A part of the trainer that a subclass swaps whole.

    Attributes:
        path: the part's class, dotted.
        attribute: the trainer's attribute holding the instance (``trainer.rollouts``).
        builder: the trainer method that builds it, which a subclass overrides to return its own subclass.
        example: that override, in one line.
    """

    path: str
    attribute: str
    builder: str
    example: str

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[1]

    @property
    def swap(self) -> str:
        return (
            f"subclass {self.name}, override the method there and return the subclass from the trainer's "
            f"{self.builder}() ({self.example})"
        )


PARTS: dict[str, Part] = {
    "Rollouts": Part(
        "trl_sae.trainer.parts.rollout.Rollouts",
        "rollouts",
        "_build_rollouts",
        "def _build_rollouts(self, cls=MyRollouts): return super()._build_rollouts(cls)",
    ),
    "PPOUpdate": Part(
        "trl_sae.trainer.parts.update.PPOUpdate",
        "ppo_update",
        "_build_ppo_update",
        "def _build_ppo_update(self): return MyUpdate(self.accelerator, self.model, self.optimizer, self.args)",
    ),
}

# 0.1.0's module paths (and two that main had between 0.1.0 and 0.2.0) -> the module that holds their names.
MOVED_MODULES: dict[str, str] = {
    "trl_sae.advantages": "trl_sae.core.advantages",
    "trl_sae.segmentation": "trl_sae.core.segmentation",
    "trl_sae.rollout": "trl_sae.generation.capture",
    "trl_sae.config": "trl_sae.trainer.config",
    "trl_sae.value": "trl_sae.trainer.critics.policy_and_critic",
    "trl_sae.tasks": "trl_sae.demo.tasks",
    "trl_sae.tiny": "trl_sae.demo.tiny",
    "trl_sae.warmstart": "trl_sae.demo.warmstart",
    "trl_sae.report": "trl_sae.demo.report",
    "trl_sae.checkpointing": "trl_sae.trainer.checkpoints.folders",
    "trl_sae.rewards.core": "trl_sae.rewards",
    # The flat trainer/ of 0.2.0's development (issue 49 gave it sub-packages by job).
    "trl_sae.trainer.checkpointing": "trl_sae.trainer.checkpoints.folders",
    "trl_sae.trainer.checkpoint_state": "trl_sae.trainer.checkpoints.state",
    "trl_sae.trainer.critic": "trl_sae.trainer.critics.policy_and_critic",
    "trl_sae.trainer.head_critic": "trl_sae.trainer.critics.head",
    "trl_sae.trainer.shared_prefix": "trl_sae.trainer.critics.shared_prefix",
    "trl_sae.trainer.models": "trl_sae.trainer.setup.models",
    "trl_sae.trainer.setup_utils": "trl_sae.trainer.setup.distributed",
    "trl_sae.trainer.precision": "trl_sae.trainer.setup.precision",
    "trl_sae.trainer.vllm_setup": "trl_sae.trainer.setup.vllm",
    "trl_sae.trainer.rollout": "trl_sae.trainer.parts.rollout",
    "trl_sae.trainer.update": "trl_sae.trainer.parts.update",
    "trl_sae.trainer.evaluation": "trl_sae.trainer.parts.evaluation",
    "trl_sae.trainer.metrics": "trl_sae.trainer.parts.metrics",
    "trl_sae.trainer.losses": "trl_sae.trainer.objectives.losses",
    "trl_sae.trainer.shaping": "trl_sae.trainer.objectives.shaping",
    "trl_sae.trainer.dynamic_sampling": "trl_sae.trainer.objectives.dynamic_sampling",
}

# Public names of 0.1.0 whose module (old or aliased) no longer defines them: "old.module.name" -> new place.
MOVED_NAMES: dict[str, Moved] = {
    "trl_sae.config.SEGMENTATIONS": Moved(
        "trl_sae.core.segmentation.SEGMENTERS",
        "the segmenter registry, name -> `SegmenterSpec`: `in` and iteration give the names, as the tuple "
        "did, and include registered segmenters",
    ),
    "trl_sae.value.build_critic_from_policy": Moved("trl_sae.trainer.critics.build.build_critic_from_policy"),
    "trl_sae.value.load_critic": Moved("trl_sae.trainer.critics.build.load_critic"),
    "trl_sae.analysis.correlation.BootstrapPearson": Moved("trl_sae.analysis.stats.BootstrapPearson"),
    "trl_sae.analysis.correlation.MonteCarloValues": Moved("trl_sae.analysis.monte_carlo.MonteCarloValues"),
    "trl_sae.analysis.correlation.segment_anchors": Moved("trl_sae.analysis.spans.segment_anchors"),
    "trl_sae.value.merge_adapter_into_full_model": Moved(
        "trl_sae.trainer.setup.adapters.merge_adapter_into_full_model"
    ),
    "trl_sae.value.SharedBaseCritic": Moved("trl_sae.trainer.critics.policy_and_critic.SharedBaseCritic"),
    # Names of the flat trainer/ modules that went to another module than the rest of theirs.
    "trl_sae.trainer.critic.adapter_merge_problem": Moved(
        "trl_sae.trainer.setup.adapters.adapter_merge_problem"
    ),
    "trl_sae.trainer.critic.adapter_parameters": Moved("trl_sae.trainer.setup.adapters.adapter_parameters"),
    "trl_sae.trainer.critic.base_model": Moved("trl_sae.trainer.setup.adapters.base_model"),
    "trl_sae.trainer.critic.merge_adapter_into_full_model": Moved(
        "trl_sae.trainer.setup.adapters.merge_adapter_into_full_model"
    ),
    "trl_sae.trainer.critic.merged_adapter_weights": Moved(
        "trl_sae.trainer.setup.adapters.merged_adapter_weights"
    ),
    "trl_sae.trainer.critic.sub_state_dict": Moved("trl_sae.trainer.setup.adapters.sub_state_dict"),
    "trl_sae.trainer.models.build_critic_from_policy": Moved(
        "trl_sae.trainer.critics.build.build_critic_from_policy"
    ),
    "trl_sae.trainer.models.critic_lora_config": Moved("trl_sae.trainer.critics.build.critic_lora_config"),
    "trl_sae.trainer.models.check_model_arguments": Moved(
        "trl_sae.trainer.critics.build.check_model_arguments"
    ),
    "trl_sae.trainer.models.load_critic": Moved("trl_sae.trainer.critics.build.load_critic"),
    "trl_sae.trainer.models.uses_head_critic": Moved("trl_sae.trainer.critics.build.uses_head_critic"),
    "trl_sae.trainer.models.uses_shared_critic": Moved("trl_sae.trainer.critics.build.uses_shared_critic"),
    "trl_sae.trainer.models.wrap_policy_and_critic": Moved(
        "trl_sae.trainer.critics.build.wrap_policy_and_critic"
    ),
    "trl_sae.trainer.setup_utils.check_evaluation_setup": Moved(
        "trl_sae.trainer.setup.prompts.check_evaluation_setup"
    ),
    "trl_sae.trainer.setup_utils.deepspeed_cpu_backend": Moved(
        "trl_sae.trainer.config.deepspeed_cpu_backend"
    ),
    "trl_sae.trainer.setup_utils.handle_overlong_prompts": Moved(
        "trl_sae.trainer.setup.prompts.handle_overlong_prompts"
    ),
    "trl_sae.trainer.setup_utils.optimizer_param_groups": Moved(
        "trl_sae.trainer.setup.optimizer.optimizer_param_groups"
    ),
    "trl_sae.trainer.setup_utils.tokenize_prompt_dataset": Moved(
        "trl_sae.trainer.setup.prompts.tokenize_prompt_dataset"
    ),
    # Between 0.1.0 and 0.2.0 the refusal covered only the update part and lived in update.py.
    "trl_sae.trainer.update.MOVED_TRAINER_METHODS": Moved(
        "", "the table is `trl_sae._moved.MOVED_TRAINER_METHODS` (trainer method -> `Moved(new, note)`)"
    ),
    "trl_sae.trainer.update.refuse_moved_trainer_overrides": Moved(
        "",
        "`SAEPPOTrainer` subclasses are checked by `trl_sae._moved.refuse_moved_overrides(cls, SAEPPOTrainer)`",
    ),
}

# SAEPPOTrainer methods of 0.1.0 (and of main until the parts were split out) that the trainer no longer calls.
# A method still on the trainer and still called is not here; the two marked "still returns" are kept for
# callers, but an override would reach only part of what it used to, so overriding them is refused too.
MOVED_TRAINER_METHODS: dict[str, Moved] = {
    # The rollout part (trainer/parts/rollout.py).
    "_prompt_indices": Moved("Rollouts.prompt_indices"),
    "_collate_prompts": Moved("Rollouts.collate"),
    "_rollout": Moved("Rollouts.sample"),
    "_rollout_vllm": Moved("Rollouts._sample_vllm"),
    "_policy_logprobs": Moved("Rollouts.teacher_forced"),
    "_teacher_forced": Moved("Rollouts.teacher_forced"),
    "_rollout_mismatch_stats": Moved("Rollouts._mismatch_stats"),
    "_score": Moved("Rollouts.score"),
    "_scored_rollout": Moved("Rollouts._scored"),
    "_rollout_filtered": Moved("Rollouts.collect"),
    "_exchange_groups": Moved("Rollouts._exchange_groups"),
    "_vllm_weights_stale": Moved("Rollouts.mark_weights_stale", "the flag is the part's `weights_stale`"),
    # The update part (trainer/parts/update.py).
    "_update": Moved("PPOUpdate.run"),
    "_ppo_loss": Moved("PPOUpdate.loss"),
    "_loss_masks": Moved("PPOUpdate.loss_masks"),
    "_micro_batches": Moved("PPOUpdate.micro_batches"),
    "_pad_micro_batches": Moved("PPOUpdate._pad_micro_batches"),
    "_backward_micro_batch": Moved("PPOUpdate._backward_micro_batch"),
    "_backward": Moved("PPOUpdate._backward"),
    "_check_finite_loss": Moved("PPOUpdate._check_finite_loss"),
    "_checkpointed_shared_critic": Moved("PPOUpdate.checkpointed_shared_critic"),
    "_clip_gradients": Moved("PPOUpdate._clip_gradients"),
    # Functions now, called by the trainer's set-up, phases or checkpoints.
    "_four_bit_config": Moved(
        "trl_sae.trainer.setup.models.four_bit_config",
        "override `_load_policy` to load the policy another way",
    ),
    "_critic_lora_config": Moved(
        "trl_sae.trainer.critics.build.critic_lora_config",
        "override `_wrap_policy_and_critic` to give the shared-base critic another adapter",
    ),
    "_global_moments": Moved(
        "trl_sae.trainer.objectives.losses.masked_whiten",
        "whitening takes its moments over every process (`all_reduce_sum`); override `_compute_advantages`",
    ),
    "_sorted_checkpoints": Moved(
        "trl_sae.trainer.checkpoints.folders.sorted_checkpoints",
        "rotation and resume list the checkpoints with it; override `_rotate_checkpoints` or `_plan_start` "
        "(`SAEPPOTrainer._sorted_checkpoints` still returns the list)",
    ),
    "_sequence_inputs": Moved(
        "trl_sae.generation.inputs.sequence_inputs",
        "the rollout, update and value passes each build their inputs with it; override "
        "`Rollouts.teacher_forced`, `PPOUpdate._micro_batch_inputs` and `_compute_values` "
        "(`SAEPPOTrainer._sequence_inputs` still returns the inputs)",
    ),
}


def _part_of(moved: Moved) -> Part | None:
    return PARTS.get(moved.new.split(".", 1)[0])


def _describe(old: str, moved: Moved) -> str:
    """``old -> new (note)``, the one spelling every message and the migration table use."""
    new = moved.new or "removed"
    return f"{old} -> {new}" + (f" ({moved.note})" if moved.note else "")


# --------------------------------------------------------------------------------------------------
# Trainer methods
# --------------------------------------------------------------------------------------------------
def refuse_moved_overrides(cls: type, base: type, moved: Mapping[str, Moved] = MOVED_TRAINER_METHODS) -> None:
    """Raise ``TypeError`` when ``cls`` (a subclass of ``base``) defines a method of ``moved``.

    Every class of ``cls``'s MRO that ``base`` does not already have counts, so a mixin's override is refused
    like the subclass's own. The message names each stale method's new place and how to swap its part in.
    """
    own = set(base.__mro__)
    stale = [name for name in moved if any(name in vars(k) for k in cls.__mro__ if k not in own)]
    if not stale:
        return
    lines = [f"  {_describe(name, moved[name])}" for name in stale]
    parts = [part for part in PARTS.values() if any(_part_of(moved[name]) is part for name in stale)]
    swaps = [f"  {part.name}: {part.swap}." for part in parts]
    raise TypeError(
        f"{cls.__name__} overrides {', '.join(stale)}, which {base.__name__} no longer calls (0.2.0 moved them into "
        "the trainer's parts or into functions), so the override would be silently ignored. Each one's new place:\n"
        + "\n".join(lines)
        + ("\nTo override a part's method:\n" + "\n".join(swaps) if swaps else "")
    )


def moved_attribute_error(obj: object, name: str) -> AttributeError:
    """The ``AttributeError`` for ``obj.name`` (a missing attribute): for a moved trainer method, naming where
    it is now and how to call it."""
    owner = type(obj).__name__
    moved = MOVED_TRAINER_METHODS.get(name)
    if moved is None:
        return AttributeError(f"{owner!r} object has no attribute {name!r}", name=name, obj=obj)
    part = _part_of(moved)
    call = f"; call it as trainer.{part.attribute}.{moved.new.split('.', 1)[1]}(...)" if part else ""
    return AttributeError(
        f"{owner}.{name} moved in 0.2.0: {_describe(name, moved)}{call}.", name=name, obj=obj
    )


# --------------------------------------------------------------------------------------------------
# Module paths and names
# --------------------------------------------------------------------------------------------------
class MovedNameError(ImportError):
    """A 0.1.0 name that was removed: the message says what to use instead."""


def _warn(old: str, new: str) -> None:
    # stacklevel 3: past this helper and its caller; the import system's own frames are skipped by warnings.
    warnings.warn(f"{old} moved to {new} in 0.2.0; import it from there.", DeprecationWarning, stacklevel=3)


def _resolve(dotted: str) -> Any:
    """The object at ``dotted`` (a module, or a name of a module)."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as error:
        if error.name != dotted:  # a module it imports is missing: that is the error to see
            raise
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _moved_name(module: str, name: str) -> Any:
    """``module.name`` through :data:`MOVED_NAMES` (warning), or raise ``AttributeError`` when not listed."""
    moved = MOVED_NAMES.get(f"{module}.{name}")
    if moved is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if not moved.new:
        raise MovedNameError(f"{module}.{name} was removed in 0.2.0: {moved.note}", name=module)
    warnings.warn(
        f"{module}.{name} moved to {moved.new} in 0.2.0" + (f" ({moved.note})" if moved.note else "") + ".",
        DeprecationWarning,
        stacklevel=3,
    )
    return _resolve(moved.new)


def moved_names_getattr(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``module`` that hands over its :data:`MOVED_NAMES`."""

    def __getattr__(name: str) -> Any:
        return _moved_name(module, name)

    return __getattr__


class _AliasLoader(importlib.abc.Loader):
    """Makes an old module path an empty module that reads every name from its new module on access."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name, f"Moved to {self.new} in 0.2.0: an alias kept for old imports.")

    def exec_module(self, module: types.ModuleType) -> None:
        old, new = module.__name__, self.new
        target = importlib.import_module(new)
        _warn(old, new)

        def __getattr__(name: str) -> Any:
            if f"{old}.{name}" in MOVED_NAMES:
                return _moved_name(old, name)
            if name.startswith("__") and name != "__all__":  # the alias's own (no __path__, __file__)
                raise AttributeError(f"module {old!r} has no attribute {name!r}")
            try:
                return getattr(target, name)
            except AttributeError:
                raise AttributeError(f"module {old!r} (now {new!r}) has no attribute {name!r}") from None

        def __dir__() -> list[str]:
            moved = {key.rsplit(".", 1)[1] for key in MOVED_NAMES if key.rsplit(".", 1)[0] == old}
            return sorted(set(dir(target)) | moved)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__dir__ = __dir__  # type: ignore[method-assign]


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MOVED_MODULES`; last on ``sys.meta_path``, so a real module at an
    old path would always win."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder of old module paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())


# --------------------------------------------------------------------------------------------------
# The migration note
# --------------------------------------------------------------------------------------------------
def migration_table(kind: str) -> str:
    """The markdown table of one kind of move (``"methods"`` or ``"imports"``), as the CHANGELOG and the docs
    show it."""
    if kind == "methods":
        rows = ["| `SAEPPOTrainer` method before 0.2.0 | now | to change it |", "|---|---|---|"]
        for name, moved in MOVED_TRAINER_METHODS.items():
            part = _part_of(moved)
            how = f"subclass `{part.name}`, return it from `{part.builder}()`" if part else moved.note
            if part and moved.note:
                how += f" ({moved.note})"
            rows.append(f"| `{name}` | `{moved.new}` | {how} |")
    elif kind == "imports":
        rows = ["| import before 0.2.0 | now |", "|---|---|"]
        rows += [f"| `{old}` | `{new}` |" for old, new in MOVED_MODULES.items()]
        for old, moved in MOVED_NAMES.items():
            now = (
                f"`{moved.new}`" + (f" ({moved.note})" if moved.note else "")
                if moved.new
                else f"removed: {moved.note}"
            )
            rows.append(f"| `{old}` | {now} |")
    else:
        raise ValueError(f"kind must be 'methods' or 'imports', got {kind!r}.")
    return "\n".join(rows) + "\n"
