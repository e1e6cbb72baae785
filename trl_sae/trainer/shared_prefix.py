"""The decoder layers no adapter touches, computed once for every adapter of a shared-base critic.

A :class:`~trl_sae.trainer.critic.SharedBaseCritic` runs the policy's base several times on the same
sequences: with the policy adapter, with the critic adapter and, for a KL penalty, with none. The decoder
layers before the first one that holds weights of any adapter compute exactly the same in all of these
passes (LoRA on the last 10 of 30 layers: the first 20), so inside :meth:`PrefixSharing.scope` the first
pass of the base records the output of those layers and every later pass on equal inputs replays it
instead of recomputing them. Nothing that trains is skipped: the replayed layers hold no trainable weight,
and their output takes no gradient.

:meth:`PrefixSharing.of` finds the layers (``<backbone>.layers``, the transformers decoder layout) and
checks once, on a two-row input, that a replayed pass gives the full pass's hidden states; a model whose
layers read anything besides the previous layer's output (or whose adapters sit before the layers, e.g. on
the embeddings) gets no sharing, and computes as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["PrefixSharing", "unadapted_prefix_layers"]

_KEYS = ("input_ids", "attention_mask", "position_ids")


def _backbone_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """The transformer body under any peft wrapper and its decoder layers, or None for another layout."""
    from trl_sae.trainer.critic import base_model

    base = base_model(model)
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(backbone, nn.Module) or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    return backbone, layers


def unadapted_prefix_layers(model: nn.Module) -> int:
    """How many decoder layers of the peft ``model`` come before the first holding any adapter's weights
    (0 when an adapter sits on anything computed before them, or when the layers cannot be found)."""
    found = _backbone_layers(model)
    if found is None:
        return 0
    from trl_sae.trainer.critic import adapter_parameters

    backbone, layers = found
    adapted = {id(parameter) for parameter in adapter_parameters(backbone)}  # every adapter's
    if adapted - {id(parameter) for parameter in layers.parameters()}:
        return 0  # e.g. LoRA or modules_to_save on the embeddings or the final norm
    for index, layer in enumerate(layers):
        if any(id(parameter) in adapted for parameter in layer.parameters()):
            return index
    return len(layers)


class PrefixSharing:
    """Records, then replays, the output of the first ``count`` decoder ``layers`` of ``backbone``.

    Use :meth:`of` to build one (None where nothing can be shared) and :meth:`scope` around the passes that
    share their inputs.
    """

    def __init__(self, backbone: nn.Module, layers: nn.ModuleList, count: int) -> None:
        self.backbone, self.layers, self.count = backbone, layers, count
        self._active = False
        self._max_recorded, self._max_bytes, self._grad_passes = 1, None, True
        self._recorded: list[tuple[tuple[torch.Tensor, ...], Any]] = []  # (inputs, the shared layers' output)
        self._undo: list[Any] = []  # what the current backbone call changed, undone when it returns

    @classmethod
    def of(cls, model: nn.Module) -> PrefixSharing | None:
        """Sharing for the peft ``model``'s unadapted layers, or None when there are none or a replayed pass
        would not reproduce the full pass (checked once here, on two short rows)."""
        count = unadapted_prefix_layers(model)
        found = _backbone_layers(model)
        if count == 0 or found is None:
            return None
        sharing = cls(*found, count)
        return sharing if sharing._replay_is_exact() else None

    @contextmanager
    def scope(
        self, max_recorded: int = 1, max_bytes: int | None = None, grad_passes: bool = True
    ) -> Iterator[None]:
        """Inside, a full pass of the backbone (``use_cache=False``: no cached generation step) records the
        shared layers' output, and a later pass whose ``input_ids``, ``attention_mask`` and ``position_ids``
        equal a recorded pass's replays it. What is recorded (one layer's hidden states of those inputs) is
        kept until the scope ends, the latest ``max_recorded`` passes' (e.g. the rollout's chunks) and at most
        ``max_bytes`` of them (None: no limit); a pass whose recording was dropped computes in full. With
        ``grad_passes`` False, passes run with grad enabled neither record nor replay (under gradient
        checkpointing, whose backward recomputes the layers)."""
        if self._active:  # nested: the outer scope already shares
            yield
            return
        self._max_recorded, self._max_bytes, self._grad_passes = max(max_recorded, 1), max_bytes, grad_passes
        handles = [
            self.backbone.register_forward_pre_hook(self._before, with_kwargs=True),
            self.backbone.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._recorded = []
            self._restore()
            for handle in handles:
                handle.remove()

    def _inputs(self, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...] | None:
        values = tuple(kwargs.get(key) for key in _KEYS)
        full_pass = kwargs.get("use_cache") is False and kwargs.get("past_key_values") is None
        if not self._grad_passes and torch.is_grad_enabled():
            return None
        if args or not full_pass or not all(isinstance(value, torch.Tensor) for value in values):
            return (
                None  # a call this scope cannot key (e.g. inputs_embeds, a decoding step): computed in full
            )
        return values

    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        inputs = self._inputs(args, kwargs)
        if inputs is None:
            return
        output = next((output for key, output in self._recorded if _same_inputs(key, inputs)), None)
        if output is None:
            self._undo.append(self.layers[self.count - 1].register_forward_hook(self._record_hook(inputs)))
        else:
            self._replace_forwards(output)

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        self._restore()

    def _record_hook(self, inputs: tuple[torch.Tensor, ...]):
        def record(module: nn.Module, args: tuple, output: Any) -> None:
            recorded = [*self._recorded, (inputs, output)][-self._max_recorded :]
            while recorded and self._max_bytes is not None and _bytes(recorded) > self._max_bytes:
                recorded.pop(0)
            self._recorded = recorded

        return record

    def _replace_forwards(self, output: Any) -> None:
        """Every shared layer returns ``output`` (the last one's recorded output) without computing."""

        def replay(*args: Any, **kwargs: Any) -> Any:
            return output

        for layer in self.layers[: self.count]:
            own = layer.__dict__.get("forward")  # an instance forward (e.g. accelerate's hooks) is put back
            layer.forward = replay
            self._undo.append((layer, own))

    def _restore(self) -> None:
        while self._undo:
            item = self._undo.pop()
            if isinstance(item, tuple):
                layer, own = item
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own
            else:
                item.remove()

    @torch.no_grad()
    def _replay_is_exact(self) -> bool:
        """Whether a replayed pass gives the full pass's last hidden state on two short rows (one left-padded),
        in eval mode and with the random state left as it was."""
        parameter = next(self.backbone.parameters())
        vocab = int(getattr(self.backbone.config, "vocab_size", 2) or 2)
        input_ids = torch.arange(2 * 6, device=parameter.device).view(2, 6) % vocab
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, :2] = 0
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        training = self.backbone.training
        self.backbone.eval()
        devices = [parameter.device] if parameter.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                full = self.backbone(**inputs, use_cache=False).last_hidden_state
                with self.scope():
                    self.backbone(**inputs, use_cache=False)  # records
                    replayed = self.backbone(**inputs, use_cache=False).last_hidden_state
        finally:
            self.backbone.train(training)
        valid = attention_mask.bool()
        return torch.allclose(full[valid].float(), replayed[valid].float(), rtol=1e-3, atol=1e-4)


def _bytes(recorded: list[tuple[tuple[torch.Tensor, ...], Any]]) -> int:
    """Memory of the recorded layer outputs (a tensor, or a tuple whose first entry is the hidden states)."""
    outputs = [output[0] if isinstance(output, tuple) else output for _, output in recorded]
    return sum(output.numel() * output.element_size() for output in outputs)


def _same_inputs(recorded: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> bool:
    return all(
        a is b or (a.shape == b.shape and a.device == b.device and torch.equal(a, b))
        for a, b in zip(recorded, inputs)
    )
