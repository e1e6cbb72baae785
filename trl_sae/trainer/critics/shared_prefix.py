"""The decoder layers no adapter touches, computed once for every adapter of a shared-base critic.

A :class:`~trl_sae.trainer.critics.policy_and_critic.SharedBaseCritic` runs the policy's base several times on the same
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

``generate`` computes those layers too, for every position (the prefill, then one per decoding step), before
the rollout's value pass runs on the sampled rows: :meth:`PrefixSharing.generation` records them and
:meth:`GenerationStates.seed` hands the scope what the full pass on those rows would have recorded, so the
value pass (and the reference pass) replays it. That one agrees with the full pass to rounding only (cached
decoding steps), so the shared-base critic has a switch for it of its own
(``SharedBaseCritic.reuse_generation_prefix``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from trl_sae.generation.inputs import eval_mode

__all__ = ["GenerationStates", "PrefixSharing", "unadapted_prefix_layers"]

_KEYS = ("input_ids", "attention_mask", "position_ids")


def _backbone_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """The transformer body under any peft wrapper and its decoder layers, or None for another layout."""
    from trl_sae.trainer.setup.adapters import base_model

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
    from trl_sae.trainer.setup.adapters import adapter_parameters

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
        self._generation_bytes = 0  # held by GenerationStates not yet seeded, counted against max_bytes
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
            self._generation_bytes = 0
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
            self._keep(inputs, output)

        return record

    def _keep(self, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        """Keep ``output`` for later passes on ``inputs``: the latest ``max_recorded``, within ``max_bytes``."""
        recorded = [*self._recorded, (inputs, output)][-self._max_recorded :]
        while recorded and self._max_bytes is not None and _bytes(recorded) > self._max_bytes:
            recorded.pop(0)
        self._recorded = recorded

    @property
    def active(self) -> bool:
        """Whether a :meth:`scope` is open (only then is anything recorded or replayed)."""
        return self._active

    def seed(self, inputs: Mapping[str, torch.Tensor], output: torch.Tensor) -> bool:
        """Keep ``output``, the shared layers' output for the full pass on ``inputs`` (its ``input_ids``,
        ``attention_mask`` and ``position_ids``) computed some other way, e.g. by ``generate``
        (:meth:`generation`), as if that pass had run and recorded it: a later pass on equal inputs replays
        it, any other computes in full. Within the scope's ``max_recorded``/``max_bytes``, like a recording;
        outside a scope nothing is kept (returns False)."""
        if not self._active:
            return False
        self._keep(tuple(inputs[key] for key in _KEYS), output)
        return True

    @contextmanager
    def generation(self) -> Iterator[GenerationStates]:
        """Inside, every call of the last shared layer (``generate``'s prefill and decoding steps) is recorded
        for :meth:`GenerationStates.seed`."""
        states = GenerationStates(self)
        handles = [
            self.backbone.register_forward_pre_hook(states._fed, with_kwargs=True),
            self.layers[self.count - 1].register_forward_hook(states._record),
        ]
        try:
            yield states
        finally:
            for handle in handles:
                handle.remove()

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
        devices = [parameter.device] if parameter.device.type == "cuda" else []
        with eval_mode(self.backbone), torch.random.fork_rng(devices=devices):
            full = self.backbone(**inputs, use_cache=False).last_hidden_state
            with self.scope():
                self.backbone(**inputs, use_cache=False)  # records
                replayed = self.backbone(**inputs, use_cache=False).last_hidden_state
        valid = attention_mask.bool()
        return torch.allclose(full[valid].float(), replayed[valid].float(), rtol=1e-3, atol=1e-4)


class GenerationStates:
    """The last shared layer's output at every decoder call of one ``generate`` (the prefill's ``(B, P, H)``,
    then ``(B, 1, H)`` per decoding step) with the ids, positions and mask each call was fed; :meth:`seed`
    assembles them into what the full pass on the ``[prompt | completion]`` rows would record.

    Why that stands for the full pass: the layers are causal, and position ``j`` of a decoding step attends,
    through the cache, to the same tokens at the same positions under the same mask as position ``j`` of the
    full pass, so its output is the full pass's up to rounding (cached decoding vs one forward: a few
    1e-7 in float32, the agreement float32 rollouts already rely on for the sampler's log-probs, see
    :func:`~trl_sae.trainer.setup.precision.needs_teacher_forced_old_logprobs`). Two kinds of positions differ, and
    no value is read after either: the critic reads position ``P - 1 + t`` for completion tokens ``t`` with
    mask 1 only (``_completion_states``; the others are zeroed), i.e. positions up to ``P + L - 2`` for a row
    of ``L`` tokens, which only attend to positions up to there.

    * ``P + T - 1`` and on: ``generate`` samples the last token without feeding it; filled with zeros (finite,
      so the adapted layers above give finite numbers there too).
    * after a row's EOS (from ``P + L``): ``generate`` fed pad tokens there with mask 1, the full pass has mask 0
      (and whatever token the trainer put there); only later positions, never read, see them.

    :meth:`seed` checks this on the inputs themselves: every position before a row's last valid one (its EOS
    or last token, at ``P + L - 1``) must have been fed with the full pass's id, mask and position id, else it
    seeds nothing and the pass computes in full.
    """

    def __init__(self, sharing: PrefixSharing) -> None:
        self.sharing = sharing
        self.calls: list[torch.Tensor] = []  # the shared layers' output, (B, S, H) per decoder call
        self.ids: list[torch.Tensor] = []  # (B, S) fed ids per call
        self.positions: list[torch.Tensor] = []  # (B, S) fed position ids per call
        self.mask: torch.Tensor | None = None  # the last call's (B, P + calls - 1) attention mask
        self.usable = True
        self._bytes = 0

    def _fed(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.usable:
            return
        ids, mask, positions = (kwargs.get(key) for key in _KEYS)
        if mask is None and isinstance(ids, torch.Tensor):  # generate drops a mask of ones (no padding)
            mask = ids.new_ones(ids.shape[0], sum(fed.shape[1] for fed in self.ids) + ids.shape[1])
        if args or not all(
            isinstance(value, torch.Tensor) and value.dim() == 2 for value in (ids, mask, positions)
        ):
            self._drop()  # e.g. inputs_embeds or a 4D mask: nothing to check the rows against
            return
        self.ids.append(ids)
        self.mask = mask
        self.positions.append(positions)

    def _record(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.usable:
            return
        if not isinstance(output, torch.Tensor) or len(self.calls) >= len(self.ids):
            self._drop()  # a layer returning a tuple (older transformers) or a call the backbone did not see
            return
        self.calls.append(output.detach())
        size = output.numel() * output.element_size()
        self._bytes += size
        self.sharing._generation_bytes += size
        limit = self.sharing._max_bytes
        if limit is not None and _bytes(self.sharing._recorded) + self.sharing._generation_bytes > limit:
            self._drop()  # would be dropped when seeded anyway: free it now

    def _drop(self) -> None:
        self.usable = False
        self.sharing._generation_bytes -= self._bytes
        self._bytes = 0
        self.calls, self.ids, self.positions, self.mask = [], [], [], None

    def seed(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Seed the sharing with the ``(B, P + T, H)`` output of the full pass on ``inputs`` (the
        ``[left-padded prompt | completion]`` rows this ``generate`` sampled, at the batch's width ``T``), if
        every position a value reads was fed with those inputs (see the class docstring); True if seeded."""
        seeded = self.usable and bool(self.calls) and self._matches(inputs)
        states = self._assembled(inputs["input_ids"].shape[1]) if seeded else None
        self._drop()
        return seeded and self.sharing.seed(inputs, states)

    def _assembled(self, width: int) -> torch.Tensor:
        states = torch.cat(self.calls, dim=1)[:, :width]
        return nn.functional.pad(states, (0, 0, 0, width - states.shape[1]))  # never-fed positions: 0

    def _matches(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``generate`` fed every position before each row's last valid one (all that a read position
        attends to) with the full pass's id, mask and position id."""
        ids, mask, positions = (inputs[key] for key in _KEYS)
        if any(call.shape[1] != 1 for call in self.ids[1:]) or self.ids[0].shape[0] != ids.shape[0]:
            return False  # not a prefill then one position per step, or other rows
        fed_ids, fed_positions, fed_mask = torch.cat(self.ids, 1), torch.cat(self.positions, 1), self.mask
        index = torch.arange(ids.shape[1], device=ids.device)
        last_valid = torch.where(mask.bool(), index, -1).amax(dim=1, keepdim=True)
        needed = index < last_valid
        fed = min(fed_ids.shape[1], fed_mask.shape[1], ids.shape[1])
        if needed[:, fed:].any():
            return False  # a position some value reads, or attends to, that generate never computed
        valid = mask[:, :fed].bool()
        same = (fed_ids[:, :fed] == ids[:, :fed]) & (fed_mask[:, :fed].long() == mask[:, :fed].long())
        same &= (fed_positions[:, :fed] == positions[:, :fed]) | ~valid  # a masked position's id is moot
        return bool(same[needed[:, :fed]].all())


def _bytes(recorded: list[tuple[tuple[torch.Tensor, ...], Any]]) -> int:
    """Memory of the recorded layer outputs (a tensor, or a tuple whose first entry is the hidden states)."""
    outputs = [output[0] if isinstance(output, tuple) else output for _, output in recorded]
    return sum(output.numel() * output.element_size() for output in outputs)


def _same_inputs(recorded: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> bool:
    return all(
        a is b or (a.shape == b.shape and a.device == b.device and torch.equal(a, b))
        for a, b in zip(recorded, inputs)
    )
