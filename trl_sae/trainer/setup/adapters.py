"""PEFT plumbing the trainer shares: unwrapping a peft model, an adapter's weights, and merging a LoRA policy
into a full model (for saving, and for vLLM's weight updates)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel

__all__ = [
    "adapter_merge_problem",
    "adapter_parameters",
    "base_model",
    "merge_adapter_into_full_model",
    "merged_adapter_weights",
    "reference_adapter",
    "sub_state_dict",
]


def base_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def sub_state_dict(state_dict: dict[str, torch.Tensor] | None, prefix: str) -> dict[str, torch.Tensor] | None:
    """The entries of ``state_dict`` under ``prefix``, with the prefix removed (None stays None)."""
    if state_dict is None:
        return None
    return {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}


def _full_precision(parameter: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """A parameter of ``module`` in float32, dequantizing bitsandbytes 4-bit (and 8-bit) weights with PEFT's
    ``dequantize_bnb_weight`` (an 8-bit weight's scales live on its module's ``state``)."""
    from peft.utils.integrations import dequantize_bnb_weight, get_bnb_param_type

    if get_bnb_param_type(parameter) == "4bit" and getattr(
        parameter.quant_state, "packing_format_for_cpu", False
    ):
        return _dequantize_cpu_packed_4bit(parameter)
    if get_bnb_param_type(parameter):
        return dequantize_bnb_weight(parameter, state=getattr(module, "state", None)).float()
    # copy=True: .float() on a float32 tensor returns the same storage, and adding deltas to it would
    # silently change the trained model.
    return parameter.detach().to(torch.float32, copy=True)


def _dequantize_cpu_packed_4bit(parameter: torch.Tensor) -> torch.Tensor:
    """A 4-bit weight that bitsandbytes repacked for its CPU kernel, in float32, leaving it as it is.

    On a CPU with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad (a rollout, a recompute)
    repacks the weight in place into a kernel layout with a transposed bf16 ``absmax``; the ordinary
    dequantization then reads garbage (measured: relative error 1.44 instead of 4-bit's 0.09). bitsandbytes'
    own inverse is used on a copy of the state, keeping the exact absmax the kernel computes with.
    """
    import copy

    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse, dequantize_4bit

    state = copy.copy(parameter.quant_state)  # the inverse reassigns fields of the state it is given
    absmax = state.absmax.T.reshape(-1).float()
    state.original_nested = False  # do not re-quantize absmax: keep the values the kernel uses
    data, state = _convert_weight_packed_for_cpu_inverse(parameter.data, state)
    state.absmax, state.nested, state.dtype = absmax, False, torch.float32
    return dequantize_4bit(data, state).float()


def _adapter_weight_dicts(module: nn.Module) -> Iterator[nn.ModuleDict | nn.ParameterDict]:
    """The per-adapter containers of a PEFT layer: ``{adapter name: weights}`` for every attribute the layer
    declares as holding adapter weights (``adapter_layer_names`` and ``other_param_names`` of a tuner
    layer, ``modules_to_save`` of a ``ModulesToSaveWrapper``), as PEFT itself walks them."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, BaseTunerLayer):
        names = (*module.adapter_layer_names, *module.other_param_names)
    elif isinstance(module, ModulesToSaveWrapper):
        names = ("modules_to_save",)
    else:
        return
    for name in names:
        container = getattr(module, name, None)
        if isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
            yield container


def _holds_adapter(module: nn.Module, adapter: str) -> bool:
    """Whether the PEFT layer ``module`` has weights of ``adapter``."""
    return any(adapter in container for container in _adapter_weight_dicts(module))


def adapter_parameters(model: nn.Module, adapter: str | None = None) -> list[nn.Parameter]:
    """The weights PEFT adds to ``model`` for ``adapter`` (every adapter when None), in
    ``model.parameters()`` order.

    Read from PEFT's layers (see :func:`_adapter_weight_dicts`), the containers ``PeftModel.set_requires_grad``
    switches, rather than matched on parameter names: tuner-layer weights (e.g. LoRA's A and B) and the
    adapter's ``modules_to_save`` copies, which train with it.
    """
    owned: set[int] = set()
    for module in model.modules():
        for container in _adapter_weight_dicts(module):
            for key, entry in container.items():
                if adapter is None or key == adapter:
                    # a Tensor where a functional_call stands in for a Parameter
                    entries = [entry] if isinstance(entry, torch.Tensor) else entry.parameters()
                    owned.update(id(parameter) for parameter in entries)
    return [parameter for parameter in model.parameters() if id(parameter) in owned]


def adapter_merge_problem(policy: nn.Module, adapter: str) -> str | None:
    """Why ``policy``'s ``adapter`` cannot be merged exactly into a plain model, or None when it can.

    :func:`merged_adapter_weights` merges LoRA adapters (any rank and alpha, ``use_rslora``,
    ``rank_pattern``, ``fan_in_fan_out``, ``use_dora``, ``lora_bias``, ``modules_to_save``, weight
    initialisations) on layers with a ``weight``, and ``target_parameters`` on such a ``weight``. Anything
    else would be dropped or merged wrongly, so it is named here, with the option behind it and its fix,
    for the trainer to refuse at ``__init__``.
    """
    from peft import PeftType

    config = policy.peft_config[adapter]
    if config.peft_type != PeftType.LORA:
        return (
            f"peft_config is {type(config).__name__} (peft_type {config.peft_type.value}) and only LoRA "
            "adapters can be merged into a full model; use a peft.LoraConfig"
        )
    if getattr(config, "layer_replication", None):
        return "peft_config.layer_replication adds layers a plain model does not have; drop layer_replication"
    base = policy.get_base_model()
    owners: dict[int, list[str]] = {}  # module names holding each parameter: a tied weight has two
    for module_name, module in base.named_modules(remove_duplicate=False):
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(module_name)
    for name, module in base.named_modules():
        problem = _modules_to_save_problem(name, module, adapter, owners) or _lora_layer_problem(
            name, module, adapter, owners
        )
        if problem is not None:
            return problem
    return None


def _modules_to_save_problem(
    name: str, module: nn.Module, adapter: str, owners: dict[int, list[str]]
) -> str | None:
    """A ``modules_to_save`` copy of a tied weight: the PEFT model uses it in one place, a merged model in
    both."""
    from peft.utils import ModulesToSaveWrapper

    if not isinstance(module, ModulesToSaveWrapper) or adapter not in module.modules_to_save:
        return None
    for parameter in module.original_module.parameters():
        others = [
            owner for owner in owners[id(parameter)] if owner != name and not owner.startswith(f"{name}.")
        ]
        if others:
            return (
                f"{name} (modules_to_save) has a weight tied to {others[0]}'s, which would take the trained copy "
                "in a merged model; remove it from peft_config.modules_to_save"
            )
    return None


def _lora_layer_problem(
    name: str, module: nn.Module, adapter: str, owners: dict[int, list[str]]
) -> str | None:
    """Why the PEFT layer ``module`` (``name``) cannot merge ``adapter`` into its base ``weight``."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not isinstance(module, BaseTunerLayer):
        return None
    if not _holds_adapter(module, adapter):
        return None
    kind = type(module).__name__
    # target_parameters (a ParamWrapper) merges like a layer on a plain `weight`, not on an MoE expert stack
    plain_weight = (
        getattr(module, "parameter_name", "weight") == "weight" and getattr(module, "num_experts", 1) == 1
    )
    if not (isinstance(module, LoraLayer) and hasattr(module.get_base_layer(), "weight") and plain_weight):
        option = {"ParamWrapper": "target_parameters", "TrainableTokensLayer": "trainable_token_indices"}
        return (
            f"{name} ({kind}) has adapter weights that cannot be merged into a plain weight; remove it from "
            f"peft_config.{option.get(kind, 'target_modules')}"
        )
    variant = module.lora_variant.get(adapter)
    if variant is not None and not isinstance(variant, DoraLinearVariant):  # DoRA of Linear and Embedding
        option = next(  # the layer's registry: {(config fields,): variant class}
            (
                "/".join(fields)
                for fields, variant_class in getattr(module, "lora_variants", {}).items()
                if variant_class is not None and type(variant) is variant_class
            ),
            type(variant).__name__,
        )
        return (
            f"the LoRA variant set by peft_config.{option} on {name} ({type(variant).__name__}) has no exact "
            "merge here; unset it (plain LoRA and use_dora are supported)"
        )
    base_layer = module.get_base_layer()
    if module.lora_bias.get(adapter) and getattr(base_layer, "bias", None) is None:
        return (
            f"peft_config.lora_bias=True on {name}, which has no bias for the merged model to hold; set "
            "lora_bias=False or target only layers with a bias"
        )
    others = [owner for owner in owners.get(id(base_layer.weight), []) if owner != f"{name}.base_layer"]
    if others:
        return (
            f"{name}'s weight is tied to {others[0]}'s, so a merged model would apply the adapter to both; "
            "remove it from peft_config.target_modules (or untie the weights)"
        )
    return None


def _merged_lora_weight(layer: nn.Module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
    """``layer``'s float32 base ``weight`` (a copy, updated in place) with ``adapter`` merged in.

    Plain LoRA adds PEFT's ``get_delta_weight`` (scaling, rsLoRA and ``fan_in_fan_out`` included). DoRA
    rescales each output row (column under ``fan_in_fan_out``) of ``W + dW`` by ``m / ||W + dW||``, as
    PEFT's ``DoraLinearVariant.merge_safe`` does, with PEFT's own norm; ``merge_safe`` itself is not called
    because it re-reads (and dequantizes) the layer's stored weight and caches the norm on the layer.
    """
    from peft.utils.other import transpose

    delta = layer.get_delta_weight(adapter).detach().to(weight.device, torch.float32)
    if layer.lora_variant.get(adapter) is None:
        return weight.add_(delta)
    dora = layer.lora_magnitude_vector[adapter]
    flip = dora.fan_in_fan_out  # True for embeddings: their rows are the input ids
    with torch.no_grad():
        norm = dora.get_weight_norm(weight, transpose(delta, flip), scaling=1)
    magnitude = dora.weight.detach().to(weight.device, torch.float32)
    return weight.add_(delta).mul_(transpose((magnitude / norm).view(-1, 1), flip))


def merged_adapter_weights(policy: nn.Module, adapter: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of ``policy``'s base model with ``adapter`` merged in, one float32 tensor at a time.

    Names are the plain model's checkpoint names (PEFT's ``.base_layer`` and ``.original_module`` levels
    removed). Each LoRA layer yields its (dequantized) base weight with ``adapter`` merged in (see
    :func:`_merged_lora_weight`) and, with ``lora_bias``, its base bias plus the adapter's scaled bias; a
    ``modules_to_save`` layer yields ``adapter``'s trained copy; weights of other adapters (a shared-base
    critic's) are never included. Tied weights come once. Nothing in ``policy`` is modified: the merge works
    on float32 copies rather than on the (possibly 4-bit) base, which would re-quantize them.

    Raises:
        ValueError: ``adapter`` cannot be merged exactly (see :func:`adapter_merge_problem`).
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    problem = adapter_merge_problem(policy, adapter)
    if problem is not None:
        raise ValueError(f"Cannot merge adapter {adapter!r} into a full model: {problem}.")
    base = policy.get_base_model()
    lora_weight_of: dict[int, nn.Module] = {}
    lora_bias_of: dict[int, nn.Module] = {}
    trained_copy: dict[int, tuple[torch.Tensor, nn.Module]] = {}
    for module in base.modules():
        # `_holds_adapter`, not `adapter in lora_A`: an Embedding keeps its factors in `lora_embedding_A/B`
        if isinstance(module, LoraLayer) and _holds_adapter(module, adapter):
            lora_weight_of[id(module.get_base_layer().weight)] = module
            if module.lora_bias.get(adapter):
                lora_bias_of[id(module.get_base_layer().bias)] = module
        if isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save:
            copy_module = module.modules_to_save[adapter]
            for (_, original), (_, trained) in zip(
                module.original_module.named_parameters(), copy_module.named_parameters(), strict=True
            ):
                trained_copy[id(original)] = (trained, copy_module)
    skip = {id(parameter) for parameter in adapter_parameters(base)}  # grows: a tied weight is taken once
    for module_name, module in base.named_modules():
        for name, parameter in module.named_parameters(prefix=module_name, recurse=False):
            if id(parameter) in skip:
                continue
            skip.add(id(parameter))
            source, owner = trained_copy.get(id(parameter), (parameter, module))
            weight = _full_precision(source, owner)
            if id(parameter) in lora_weight_of:
                weight = _merged_lora_weight(lora_weight_of[id(parameter)], adapter, weight)
            elif id(parameter) in lora_bias_of:
                layer = lora_bias_of[id(parameter)]
                lora_bias = layer.lora_B[adapter].bias.detach().to(weight.device, torch.float32)
                weight += lora_bias * layer.scaling[adapter]
            # PEFT keeps the layer it wraps as `<name>.base_layer` (LoRA) or `<name>.original_module`
            # (modules_to_save); the plain model has it at `<name>`.
            yield name.replace(".base_layer.", ".").replace(".original_module.", "."), weight


class _MergeCall(nn.Module):
    """``forward()`` merges ``policy``'s ``adapter``: what :func:`torch.func.functional_call` runs with the
    policy's parameters replaced (see :func:`merge_adapter_into_full_model`)."""

    def __init__(self, policy: nn.Module, adapter: str) -> None:
        super().__init__()
        self.policy = policy
        self.adapter = adapter

    def forward(self) -> dict[str, torch.Tensor]:
        return dict(merged_adapter_weights(self.policy, self.adapter))


def merge_adapter_into_full_model(
    policy: nn.Module, adapter: str, state_dict: dict[str, torch.Tensor] | None = None
) -> PreTrainedModel:
    """A new full-precision model: the (dequantized) base weights plus ``adapter``'s deltas.

    The trained policy is left untouched, so training can go on after a merged save. Deltas are added to
    dequantized float32 weights rather than merged into 4-bit ones, which would re-quantize them and lose
    most of the update. The result has no quantization config and loads with plain ``from_pretrained``.

    ``state_dict`` (the policy's own keys, e.g. the full weights gathered from ZeRO-3 or FSDP2 shards, whose
    local parameters are empty partitions or ``DTensor`` shards) stands in for the policy's parameters during
    the merge, through :func:`torch.func.functional_call`; the policy's module structure (its LoRA layers)
    tells what to merge. No collective runs, so the main process alone can call it.
    """
    from transformers import AutoModelForCausalLM

    base = policy.get_base_model()
    if state_dict is None:
        state = dict(merged_adapter_weights(policy, adapter))
    else:
        call = _MergeCall(policy, adapter)
        # One name per tied weight (named_parameters' default); functional_call ties the others to it.
        names = {name for name, _ in call.named_parameters()}
        weights = {f"policy.{key}": value for key, value in state_dict.items() if f"policy.{key}" in names}
        missing = sorted(names - set(weights))
        if missing:
            raise RuntimeError(f"The gathered state dict has no weights for {missing[:5]}; cannot merge.")
        state = torch.func.functional_call(call, weights, (), tie_weights=True, strict=False)
    config = copy.deepcopy(base.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    merged = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = merged.load_state_dict(state, strict=False)
    tied = set(getattr(merged, "_tied_weights_keys", None) or [])
    if unexpected or [key for key in missing if key not in tied and "lm_head" not in key]:
        raise RuntimeError(
            f"Merging the adapter left weights unmatched: missing {missing}, unexpected {unexpected}."
        )
    merged.tie_weights()
    merged.generation_config = copy.deepcopy(base.generation_config)
    return merged.eval()  # as from_pretrained returns it: from_config leaves dropout on


@contextmanager
def reference_adapter(policy: nn.Module, ref_adapter_name: str | None) -> Iterator[None]:
    """Inside, the peft ``policy`` is the KL reference: its base with every adapter disabled, or the frozen
    adapter ``ref_adapter_name``; afterwards the trained adapter is active again and exactly the parameters
    that required grad before do again (``set_adapter`` changes which adapters require grad)."""
    if ref_adapter_name is None:
        with policy.disable_adapter():
            yield
        return
    active = policy.active_adapter
    trainable = [(p, p.requires_grad) for p in policy.parameters()]
    policy.set_adapter(ref_adapter_name)
    try:
        yield
    finally:
        policy.set_adapter(active)
        for parameter, requires_grad in trainable:
            parameter.requires_grad_(requires_grad)
