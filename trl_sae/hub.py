"""Model cards and Hub pushes for models trained with :class:`~trl_sae.SAEPPOTrainer`.

A trained model is only reusable when its card says how it was trained. :func:`model_card` writes a
``README.md`` that states the advantage estimator and every setting that defines it (``p``, ``lam``,
``critic_lam``, the segmenter, ``num_generations``, the learning rates, ...), the final training
metrics read from ``trainer.state.log_history``, and how to load the weights (a merged full model, or
a LoRA adapter on its base, following ``merge_adapters``).

:func:`save_and_push` is the one call the CLI, the example script and the notebook use after training:
save (honouring ``merge_adapters``), write the card, and, when asked, upload the folder with
``huggingface_hub`` (``create_repo`` then ``upload_folder``). Nothing here touches the network unless
``push`` is true.

:func:`resolve_model_source` is the one check every entry point (trainer, recipe, CLI) runs on a model,
critic or tokenizer argument before ``from_pretrained``: a folder holding model or tokenizer files, or a
Hub id that can be fetched (the Hub answers, or the id is in the local cache); anything else fails at
once in one line instead of after retries against the Hub.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CARD_METRIC_KEYS",
    "estimator_settings",
    "final_metrics",
    "hub_unreachable",
    "model_card",
    "push_folder_to_hub",
    "resolve_model_source",
    "save_and_push",
    "write_model_card",
]

logger = logging.getLogger(__name__)

#: Training metrics shown on the card (the last logged value of each that was logged).
CARD_METRIC_KEYS: tuple[str, ...] = (
    "reward/mean",
    "reward/std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "segments/boundaries_per_completion",
    "segments/mean_length",
    "critic/explained_variance",
    "policy/approx_kl",
    "policy/entropy",
    "eval/reward/mean",
    "rollout/logprob_diff_mean",  # only with use_vllm: how far vLLM's numerics were from the trainer's
)

# The settings that define the run, grouped as the card shows them. Fields only relevant to one
# estimator or segmenter are filtered in `estimator_settings` so the card never lists dead knobs.
_ESTIMATOR_FIELDS = (
    "advantage_estimator",
    "segmentation",
    "segment_threshold",
    "segment_length",
    "entropy_threshold",
    "lam",
    "critic_lam",
    "gamma",
    "adaptive_lambda_alpha",
    "grpo_scale",
    "whiten_advantages",
)
_OPTIMISATION_FIELDS = (
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_mini_batches",
    "num_ppo_epochs",
    "learning_rate",
    "critic_learning_rate",
    "lr_scheduler_type",
    "value_warmup_steps",
    "value_head_trunk_grad_scale",
    "value_head_layer",
    "cliprange",
    "cliprange_value",
    "vf_coef",
    "kl_coef",
    "entropy_coef",
    "temperature",
    "response_length",
    "max_prompt_length",
    "max_steps",
    "seed",
)

# Listed only for runs that sampled with vLLM.
_VLLM_FIELDS = (
    "use_vllm",
    "vllm_mode",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
)

# Files a Hub repo should not receive: resumable checkpoints and staging folders stay local.
_IGNORE_PATTERNS = ["checkpoint-*", "checkpoint-*/**", "tmp-*", "tmp-*/**", "runs/**", "*.pt", "*.pth"]


def _get(args: Any, name: str) -> Any:
    return args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)


def estimator_settings(args: Any) -> dict[str, dict[str, Any]]:
    """The run's defining settings from an ``SAEPPOConfig`` (or its ``to_dict()``), in two groups.

    Only the knobs the chosen estimator and segmenter actually read are kept, as their registrations
    declare them (:class:`~trl_sae.core.advantages.EstimatorSpec`,
    :class:`~trl_sae.core.segmentation.SegmenterSpec`): ``segment_length`` only with uniform segmentation,
    ``adaptive_lambda_alpha`` only for ``adaptive_lambda``, no ``lam``/critic settings for GRPO, and so on.
    A name this process has not registered keeps every setting.

    Returns:
        ``{"estimator": {...}, "optimisation": {...}}``.
    """
    # Imported here: the registries import torch, which this module otherwise does not need.
    from trl_sae.core.advantages import ADVANTAGE_ESTIMATORS
    from trl_sae.core.segmentation import SEGMENTERS

    skip: set[str] = set()
    estimator = ADVANTAGE_ESTIMATORS.get(_get(args, "advantage_estimator"))
    if estimator is not None:
        # The estimator's own scalar settings, shown only when its signature reads them; gamma also
        # discounts the critic's returns.
        reads = estimator.reads | ({"gamma"} if estimator.needs_critic else set())
        skip |= {"lam", "gamma", "adaptive_lambda_alpha", "grpo_scale"} - reads
        if not estimator.needs_critic:
            skip |= {"critic_lam", "critic_learning_rate", "value_warmup_steps", "cliprange_value", "vf_coef"}
        if not estimator.whitens:
            skip.add("whiten_advantages")
        if not estimator.needs_boundaries:
            # Its advantages ignore the boundaries (they are still logged).
            skip |= {"segmentation", "segment_threshold", "segment_length", "entropy_threshold"}
    segmenter = SEGMENTERS.get(_get(args, "segmentation"))
    if segmenter is not None:
        skip |= {"segment_threshold", "segment_length", "entropy_threshold"} - segmenter.reads
    if not _get(args, "value_head_trunk_grad_scale"):  # only the head critic sets it
        skip.add("value_head_trunk_grad_scale")
    if _get(args, "value_head_layer") is None:  # None: the head reads the final hidden states, as by default
        skip.add("value_head_layer")
    max_steps = _get(args, "max_steps")
    if max_steps is None or max_steps <= 0:
        skip.add("max_steps")
    optimisation = {k: _get(args, k) for k in _OPTIMISATION_FIELDS if k not in skip}
    if _get(args, "use_vllm"):
        optimisation.update({k: _get(args, k) for k in _VLLM_FIELDS})
        if not _get(args, "vllm_importance_sampling_correction"):
            optimisation.pop("vllm_importance_sampling_mode")
    return {
        "estimator": {k: _get(args, k) for k in _ESTIMATOR_FIELDS if k not in skip},
        "optimisation": optimisation,
    }


def final_metrics(
    log_history: Sequence[Mapping[str, Any]], keys: Sequence[str] = CARD_METRIC_KEYS
) -> dict[str, float]:
    """The last logged finite value of each of ``keys`` in a ``trainer.state.log_history``."""
    found: dict[str, float] = {}
    for entry in log_history:
        for key in keys:
            value = entry.get(key)
            if isinstance(value, (int, float)) and math.isfinite(float(value)):
                found[key] = float(value)
    return {key: found[key] for key in keys if key in found}


def _format(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_format(v) for v in value)
    return str(value)


def _table(rows: Mapping[str, Any], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| `{key}` | {_format(value)} |" for key, value in rows.items()]
    return "\n".join(lines)


def _looks_like_hub_id(name: str | None) -> bool:
    # The Hub validates `base_model`; a local path there would only produce a warning on the page.
    return (
        bool(name) and name.count("/") == 1 and not os.path.exists(name) and not name.startswith((".", "~"))
    )


def model_card(
    args: Any,
    log_history: Sequence[Mapping[str, Any]] = (),
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    dataset_name: str | None = None,
    adapter_only: bool = False,
    extra_metrics: Mapping[str, Any] | None = None,
    description: str | None = None,
    critic: str | None = None,
) -> str:
    """The text of a model card (``README.md`` with YAML metadata) for an SAE-PPO run.

    Args:
        args: the run's ``SAEPPOConfig`` (or its ``to_dict()``).
        log_history: ``trainer.state.log_history``; the last value of each :data:`CARD_METRIC_KEYS` is shown.
        repo_id: the Hub repo (used in the loading snippet).
        base_model: the model training started from (a Hub id goes into the metadata).
        dataset_name: the training dataset (a Hub id goes into the metadata).
        adapter_only: the folder holds a LoRA adapter (``library_name: peft``) instead of a full model.
        extra_metrics: more results to show, e.g. held-out accuracy before and after training.
        description: a paragraph placed under the title.
        critic: what the critic was (e.g. "a value head on the policy's own hidden states"), shown in the
            optimisation table; None leaves it out.
    """
    import yaml

    settings = estimator_settings(args)
    if critic is not None:
        settings["optimisation"] = {"critic": critic, **settings["optimisation"]}
    estimator = settings["estimator"].get("advantage_estimator", "sae")
    metadata: dict[str, Any] = {
        "library_name": "peft" if adapter_only else "transformers",
        "tags": ["trl", "trl-sae", "ppo", "sae", "rlvr", estimator],
        "pipeline_tag": "text-generation",
    }
    if _looks_like_hub_id(base_model):
        metadata["base_model"] = base_model
    if _looks_like_hub_id(dataset_name):
        metadata["datasets"] = [dataset_name]
    name = repo_id or "this model"
    title = repo_id.split("/")[-1] if repo_id else "SAE-PPO model"

    parts = [f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---", f"# {title}"]
    parts.append(
        description
        or (
            f"Trained with PPO and the **{estimator}** advantage estimator using "
            "trl-sae (PPO with Segmental Advantage Estimation, on Hugging Face TRL)"
            + (f", starting from `{base_model}`" if base_model else "")
            + (f", on `{dataset_name}`" if dataset_name else "")
            + "."
        )
    )
    if estimator == "sae":  # a paragraph about the SAE method itself (other estimators get none)
        parts.append(
            "SAE bootstraps the critic only at segment boundaries: token `t` opens a segment when "
            + (
                f"its sampled probability is below p = {settings['estimator'].get('segment_threshold')}"
                if settings["estimator"].get("segmentation") == "probability"
                else f"the `{settings['estimator'].get('segmentation')}` segmenter says so"
            )
            + ", and the advantage recursion `A[t] = delta[t] + gamma * lam_t * A[t+1]` decays by `lam` "
            "only across boundaries (`lam_t = 1` inside a segment)."
        )
    parts.append("## Estimator\n\n" + _table(settings["estimator"], ("setting", "value")))
    parts.append("## Optimisation\n\n" + _table(settings["optimisation"], ("setting", "value")))
    metrics = dict(extra_metrics or {})
    metrics.update(final_metrics(log_history))
    if metrics:
        steps = [e.get("step") for e in log_history if "reward/mean" in e]
        caption = f" (last logged step: {steps[-1]})" if steps and steps[-1] is not None else ""
        parts.append(f"## Results{caption}\n\n" + _table(metrics, ("metric", "value")))
    if adapter_only:
        base = base_model or "<base model>"
        usage = (
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'base = AutoModelForCausalLM.from_pretrained("{base}")\n'
            f'model = PeftModel.from_pretrained(base, "{name}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")'
        )
    else:
        usage = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{name}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")'
        )
    parts.append(f"## Usage\n\n```python\n{usage}\n```")
    parts.append(
        "## Citation\n\n```bibtex\n@inproceedings{sae2026,\n  title = {Segmental Advantage Estimation: "
        "Enhancing PPO for Long-Context LLM Training},\n  year  = {2026},\n}\n```"
    )
    return "\n\n".join(parts) + "\n"


def write_model_card(output_dir: str | os.PathLike[str], card: str) -> Path:
    """Write ``card`` to ``output_dir/README.md`` and return the path."""
    path = Path(output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(card, encoding="utf-8")
    return path


def push_folder_to_hub(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload model trained with trl-sae",
) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` (checkpoints and staging folders excluded).

    Returns:
        The URL of the commit (or of the repo, for ``huggingface_hub`` versions that return none).
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        repo_type="model",
        revision=revision,
        commit_message=commit_message,
        ignore_patterns=_IGNORE_PATTERNS,
    )
    return str(getattr(commit, "commit_url", None) or commit or f"https://huggingface.co/{repo_id}")


def save_and_push(
    trainer: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    push: bool | None = None,
    repo_id: str | None = None,
    base_model: str | None = None,
    dataset_name: str | None = None,
    extra_metrics: Mapping[str, Any] | None = None,
    token: str | None = None,
    private: bool | None = None,
) -> dict[str, Any]:
    """Save the trained model (merged or adapter-only per ``merge_adapters``), write its card, maybe push.

    Args:
        trainer: a trained :class:`~trl_sae.SAEPPOTrainer`.
        output_dir: where to save; ``trainer.args.output_dir`` by default.
        push: upload to the Hub; defaults to ``trainer.args.push_to_hub``.
        repo_id: the Hub repo; defaults to ``trainer.args.hub_model_id``.
        base_model, dataset_name: recorded on the card.
        extra_metrics: more results for the card (e.g. held-out accuracy).
        token, private: passed to the Hub (``hub_token`` / ``hub_private_repo`` by default).

    Returns:
        ``{"output_dir", "card", "adapter_only", "pushed", "url"}``.
    """
    args = trainer.args
    output_dir = Path(output_dir or args.output_dir)
    push = bool(args.push_to_hub) if push is None else push
    repo_id = repo_id or args.hub_model_id
    if push and not repo_id:
        raise ValueError("Pushing to the Hub needs a repo id: set --hub_model_id (e.g. your-name/qwen3-sae).")
    trainer.save_model(str(output_dir))  # every process: it synchronises them
    if not trainer.accelerator.is_main_process:
        return {
            "output_dir": str(output_dir),
            "card": None,
            "adapter_only": None,
            "pushed": False,
            "url": None,
        }
    adapter_only = bool(getattr(trainer, "is_peft_model", False)) and not args.merge_adapters
    # hub sits below the trainer package (docs/design.md's layers): the trainer says what its critic is.
    critic = getattr(trainer, "critic_kind", None)
    card = model_card(
        args,
        trainer.state.log_history,
        repo_id=repo_id,
        base_model=base_model,
        dataset_name=dataset_name,
        adapter_only=adapter_only,
        extra_metrics=extra_metrics,
        critic=critic,
    )
    card_path = write_model_card(output_dir, card)
    # The run's full settings next to the weights, so a pushed repo can be reproduced.
    with open(output_dir / "trl_sae_config.json", "w", encoding="utf-8") as handle:
        json.dump(args.to_dict(), handle, indent=2, default=str)
    url = None
    if push:
        url = push_folder_to_hub(
            output_dir,
            repo_id,  # type: ignore[arg-type]
            token=token if token is not None else args.hub_token,
            private=private if private is not None else args.hub_private_repo,
            revision=args.hub_revision,
        )
    return {
        "output_dir": str(output_dir),
        "card": str(card_path),
        "adapter_only": adapter_only,
        "pushed": push,
        "url": url,
    }


# --------------------------------------------------------------------------------------------------
# Model sources: a local folder or a Hub id, checked before `from_pretrained` goes to the network.
# --------------------------------------------------------------------------------------------------
def resolve_model_source(
    name_or_path: str, what: str = "model", init_kwargs: Mapping[str, Any] | None = None
) -> str:
    """What to pass to ``from_pretrained`` for ``name_or_path``, or a one-line ``FileNotFoundError``.

    * an existing path (``~`` expanded) is returned as that path; a folder must hold a model, tokenizer
      or adapter file (an empty one is an error saying what it should contain);
    * anything that is not a valid Hub id (``./x``, ``/x``, ``~/x``, ``a/b/c``, ``C:\\x``) can only be
      local, so a missing one is "no such directory" at once, not 25-55 s of Hub retries or
      huggingface_hub's ``Repo id must be in the form ...``;
    * a valid Hub id (``Qwen/Qwen3-0.6B``, ``gpt2``) is returned unchanged, except that offline
      (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``) it must already be in the local cache, and
      that when the Hub does not answer one quick request (3 s at most, once per
      process) its cached copy's folder is returned, or, with none, a one-line error at once.

    Args:
        name_or_path: the argument as the user gave it.
        what: the argument's name, for the message (``"model_name_or_path"``, ``"value_model"``, ...).
        init_kwargs: the ``from_pretrained`` keyword arguments; their ``revision``, ``cache_dir`` and
            ``local_files_only`` decide where the offline cache check looks.
    """
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    init_kwargs = init_kwargs or {}
    expanded = os.path.expanduser(name_or_path)
    if os.path.exists(expanded):
        _check_model_folder(expanded, what)
        return expanded
    looks_local = name_or_path.startswith((".", "/", "~"))
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        looks_local = True
    if looks_local:
        raise FileNotFoundError(
            f"{what}: no such directory {name_or_path!r} (and it is not a Hub id of the form 'owner/name')."
        )
    if is_offline_mode() or init_kwargs.get("local_files_only"):
        try:
            snapshot_download(
                name_or_path,
                revision=init_kwargs.get("revision"),
                cache_dir=init_kwargs.get("cache_dir"),
                local_files_only=True,
            )
        except (LocalEntryNotFoundError, OSError) as error:
            reason = "HF_HUB_OFFLINE=1" if is_offline_mode() else "local_files_only=True"
            raise FileNotFoundError(
                f"{what}: no such directory {name_or_path!r}, and the Hub id {name_or_path!r} is not in the "
                f"local cache ({reason} forbids downloading it); download it while online "
                f"(`hf download {name_or_path}`) or pass a local folder."
            ) from error
        return name_or_path
    # Online mode on a machine without network would spend 25-55 s in huggingface_hub's retries before
    # from_pretrained fails: one quick request says so at once (and a cached copy is used instead).
    from huggingface_hub import constants

    unreachable = hub_unreachable(constants.ENDPOINT)
    if unreachable is None:
        return name_or_path
    try:
        cached = snapshot_download(
            name_or_path,
            revision=init_kwargs.get("revision"),
            cache_dir=init_kwargs.get("cache_dir"),
            local_files_only=True,
        )
    except (LocalEntryNotFoundError, OSError) as error:
        raise FileNotFoundError(
            f"{what}: {name_or_path!r} is not a local folder nor in the local cache, and the Hub "
            f"({constants.ENDPOINT}) cannot be reached ({unreachable}); download it where there is network "
            f"(`hf download {name_or_path} --local-dir DIR`) and pass DIR."
        ) from error
    logger.warning(
        "%s: the Hub (%s) cannot be reached (%s); using the cached copy of %r in %s.",
        what,
        constants.ENDPOINT,
        unreachable,
        name_or_path,
        cached,
    )
    return cached


# Any of these makes a folder something from_pretrained can read: a model, a tokenizer, a LoRA adapter, or
# weights in one of the formats transformers loads (GGUF included).
_MODEL_FOLDER_FILES = frozenset(
    {
        "config.json",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "vocab.json",
        "vocab.txt",
    }
)
_MODEL_FOLDER_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def _check_model_folder(path: str, what: str) -> None:
    """A one-line ``FileNotFoundError`` when the folder ``path`` holds no model or tokenizer file at all
    (from_pretrained would fail on a cut-off "Couldn't instantiate the backend tokenizer from one of:")."""
    if not os.path.isdir(path):
        return
    names = os.listdir(path)
    if any(name in _MODEL_FOLDER_FILES or name.endswith(_MODEL_FOLDER_SUFFIXES) for name in names):
        return
    found = "it is empty" if not names else f"it holds only {', '.join(sorted(names)[:3])}"
    raise FileNotFoundError(
        f"{what}: the folder {path!r} has no model or tokenizer files ({found}); it should hold a model "
        "saved with save_pretrained or `hf download` (config.json, model.safetensors, tokenizer.json / "
        "tokenizer_config.json) or a LoRA adapter (adapter_config.json)."
    )


# Seconds the one reachability request may take: a machine with network answers in well under a second.
_HUB_PROBE_TIMEOUT_S = 3.0


@functools.cache
def hub_unreachable(endpoint: str) -> str | None:
    """Why the Hub at ``endpoint`` cannot be reached (one line), or None when it answers.

    One HEAD request, once per process and endpoint, through huggingface_hub's own HTTP session, so
    ``HF_ENDPOINT`` and the proxy settings (``HTTPS_PROXY``, ``NO_PROXY``) apply as for downloads. Any
    answer, an HTTP error status included, means the network is there.
    """
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=_HUB_PROBE_TIMEOUT_S, follow_redirects=False)
    except Exception as error:  # DNS, refused, timeout, proxy: whichever transport error the client raises
        return f"{type(error).__name__}: {str(error).strip() or 'no answer'}"
    return None
