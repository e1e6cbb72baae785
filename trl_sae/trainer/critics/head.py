"""The head critic (``value_model="head"``): a value head on the policy's own forward.

A ``Linear(hidden, 1)`` reads the policy's final hidden states, the ones its output head reads, as the
value heads of classic RLHF did. The PPO update runs one forward and one backward per micro-batch: the
decoder's hidden states give both the log-probs (through the LM head, chunk by chunk) and the values
(through the value head). Whether the value loss reaches the trunk is ``value_head_trunk_grad_scale``:
0 (default) detaches the hidden states for the value head, 1 passes its gradient on in full, between
scales it (:func:`scale_gradient`). ``values[:, t]`` is read at the position before completion token
``t`` (the state ``s_t`` of docs/design.md), as every critic here.

The rollout's old values cost no pass of their own (:class:`ValueCapture`): a forward hook on the decoder
applies the value head to what a pass that already runs computes, the teacher-forced log-prob recompute
when it runs (mixed precision, vLLM), otherwise each decoding step of ``generate`` (whose last position is
the state before the token it samples).

``value_head_layer=k`` (:class:`HeadCritic`'s ``layer``) moves the head down the trunk: it reads decoder
layer ``k``'s output (a forward hook on that layer, in the same single pass; no ``output_hidden_states``,
which would keep every layer's output alive during the rollout's no-grad passes), RMS-normalised without a
gain (:func:`rms_normalise`). The value gradient then reaches layers ``0..k`` only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from trl_sae.generation.capture import logprobs_from_hidden_states, output_head_split
from trl_sae.trainer.critics.policy_and_critic import PolicyAndCritic
from trl_sae.trainer.setup.adapters import base_model, sub_state_dict

__all__ = ["HeadCritic", "ValueCapture", "decoder_layers", "rms_normalise", "scale_gradient"]

VALUE_HEAD_FILE = "value_head.safetensors"


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_gradient(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """``tensor`` in the forward; its gradient times ``scale`` in the backward (0: detached, 1: unchanged)."""
    if scale == 0:
        return tensor.detach()  # no backward through the trunk at all, not a backward of zeros
    if scale == 1:
        return tensor
    return _ScaledGradient.apply(tensor, scale)


def rms_normalise(states: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``states / rms(states)`` over the last dimension, in float32: an intermediate layer's residual stream
    on the scale the final hidden states have.

    A parameter-free normalisation rather than the model's own final norm: the head is linear, so a
    per-channel gain such as the final norm's would be absorbed into its weights (no loss of expressiveness);
    that gain was fitted to the last layer's stream, not layer ``k``'s; and it feeds the LM head, so the value
    loss would move it (full fine-tuning with ``value_head_trunk_grad_scale > 0``) and with it the policy's
    output. Without it the value gradient reaches exactly the layers up to ``k``. Normalising at all matters:
    the residual stream's scale grows with depth (SmolLM2-135M, measured: median per-token RMS 1.7 after layer
    0, 5.8 after layer 10, 33 after layer 29), so one head learning rate would suit one layer only.
    """
    states = states.float()
    return states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + eps)


def decoder_layers(decoder: nn.Module) -> nn.ModuleList | None:
    """The decoder's list of layers (``decoder.layers`` in transformers' decoder-only models, ``h`` in GPT-2's):
    its child ``ModuleList`` with ``config.num_hidden_layers`` modules; None when there is none."""
    count = getattr(getattr(decoder, "config", None), "num_hidden_layers", None)
    found = [c for c in decoder.children() if isinstance(c, nn.ModuleList) and len(c) == count]
    return found[0] if len(found) == 1 else None


def _layer_output(output: Any) -> torch.Tensor:
    """A decoder layer's hidden states (transformers 5 returns the tensor; older versions a tuple)."""
    return output[0] if isinstance(output, tuple) else output


class ValueCapture:
    """The value head applied to every output of the policy's decoder while :meth:`HeadCritic.capture_values`
    is open: one ``(B, S)`` tensor per decoder call (``S`` positions: the whole sequence of a teacher-forced
    pass or a generation's prefill, 1 for each cached decoding step)."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def per_step(self, steps: int) -> torch.Tensor:
        """``(B, steps)`` values of one ``generate`` call: the last position of each decoder call is the state
        before the token that step samples (calls beyond ``steps``, a deferred stop check's, are dropped)."""
        if steps == 0:
            return self.calls[0][:, :0]
        if any(call.shape[1] != 1 for call in self.calls[1:steps]):
            # A chunked prefill (generation_config.prefill_chunk_size) would shift every value by the number of
            # chunks - 1; generate_with_logprobs prefills in one call, another generate loop may not.
            raise ValueError(
                "The head critic's values were captured from a generate that did not prefill the prompt in one "
                "decoder call (prefill_chunk_size set?); sample with generate_with_logprobs, which prefills in one."
            )
        return torch.stack([call[:, -1] for call in self.calls[:steps]], dim=1)

    def teacher_forced(self, num_completion_tokens: int) -> torch.Tensor:
        """``(B, T)`` values of teacher-forced passes over ``[prompt | completion]`` rows (one call per chunk
        of rows, in row order): position ``P - 1 + t`` holds the state before completion token ``t``."""
        steps = num_completion_tokens
        return torch.cat([call[:, call.shape[1] - steps - 1 : call.shape[1] - 1] for call in self.calls])


class HeadCritic(PolicyAndCritic):
    """The policy with a scalar value head on its own hidden states (``value_model="head"``).

    Args:
        policy: the causal LM (a ``PeftModel`` or a plain model); its decoder and output head must be
            separable (:func:`~trl_sae.generation.capture.output_head_split`).
        trunk_grad_scale: how much of the value loss's gradient reaches the trunk (0: none, 1: all).
        layer: ``SAEPPOConfig.value_head_layer``: None reads the final hidden states (after the model's final
            norm, what its output head reads); an int ``k`` reads decoder layer ``k``'s output (negative: from
            the last, as Python indexes), RMS-normalised (:func:`rms_normalise`). Stored as the non-negative
            index.
    """

    def __init__(self, policy: nn.Module, trunk_grad_scale: float = 0.0, layer: int | None = None) -> None:
        super().__init__(policy, critic=None)
        split = output_head_split(policy)
        if isinstance(split, str):
            raise ValueError(
                f"value_model='head' reads the hidden states the policy's output head reads, but {split}; "
                "use value_model=None (a separate critic) or 'shared' with a peft_config."
            )
        base = base_model(policy)
        self.trunk_grad_scale = float(trunk_grad_scale)
        self.layer = self._resolve_layer(layer)
        self.norm_eps = float(getattr(base.config, "rms_norm_eps", None) or 1e-6)
        self.value_head = nn.Linear(base.config.hidden_size, 1, bias=True)
        nn.init.zeros_(self.value_head.weight)  # the first values are 0 rather than noise
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(base.parameters()).device)

    def _resolve_layer(self, layer: int | None) -> int | None:
        """``layer`` as a non-negative index into the decoder's layers, refused when it names none."""
        if layer is None:
            return None
        layers = decoder_layers(self._decoder())
        if layers is None:
            raise ValueError(
                f"SAEPPOConfig.value_head_layer={layer} reads a decoder layer's output, but "
                f"{type(self._decoder()).__name__} has no list of layers to hook; leave value_head_layer=None "
                "(the final hidden states)."
            )
        count = len(layers)
        if not -count <= layer < count:
            raise ValueError(
                f"SAEPPOConfig.value_head_layer={layer} is out of range: the policy has {count} decoder layers; "
                f"pass an int in [{-count}, {count - 1}] (negative counts from the last) or None (the final "
                "hidden states)."
            )
        return layer % count

    @property
    def kind(self) -> str:
        """The critic in words, as a checkpoint's model set-up (compared on resume) and the Hub card state it."""
        if self.layer is None:
            return "a value head on the policy's own hidden states (value_model='head')"
        count = len(decoder_layers(self._decoder()))
        return (
            f"a value head on the policy's decoder layer {self.layer} of 0..{count - 1} "
            f"(value_model='head', value_head_layer={self.layer})"
        )

    @property
    def has_critic(self) -> bool:
        return True

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.value_head.parameters())

    def _decoder(self) -> nn.Module:
        return output_head_split(self.policy)[0]

    @contextmanager
    def _on_value_states(self, callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
        """Call ``callback`` with the ``(B, S, H)`` states the value head reads, once per decoder call inside
        the block: the decoder's output, or the (normalised) output of decoder layer ``self.layer``.

        The hook lives only for the block, so no other pass feeds it. transformers checkpoints a layer's
        ``forward``, not its ``__call__``: under activation checkpointing (reentrant or not) the hook still sees
        the layer's output inside the autograd graph, and the backward's recompute does not call it."""
        if self.layer is None:
            module = self._decoder()

            def hook(module: nn.Module, args: Any, output: Any) -> None:
                callback(output.last_hidden_state)
        else:
            module = decoder_layers(self._decoder())[self.layer]

            def hook(module: nn.Module, args: Any, output: Any) -> None:
                callback(rms_normalise(_layer_output(output), self.norm_eps))

        handle = module.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def _completion_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, H)`` final hidden states, and the states the value head reads, before each of the last
        ``T`` tokens, from one decoder pass."""
        found: list[torch.Tensor] = []
        with self._on_value_states(found.append):
            hidden = self._decoder()(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        window = slice(hidden.shape[1] - num_completion_tokens - 1, hidden.shape[1] - 1)
        return hidden[:, window], found[0][:, window]

    def head_values(self, states: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` hidden states -> ``(...)`` float32 values, the trunk's share of the gradient scaled."""
        states = scale_gradient(states, self.trunk_grad_scale)
        return self.value_head(states.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def critic_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> torch.Tensor:
        """Values without log-probs: a critic-only (``value_warmup_steps``) step, or a rollout whose values
        were not captured. The trunk runs without gradient: such steps train the value head only."""
        with torch.no_grad():
            _, states = self._completion_states(
                input_ids, attention_mask, position_ids, num_completion_tokens
            )
        return self.head_values(states)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
        with_policy: bool = True,
        with_critic: bool = True,
        temperature: float = 1.0,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """As :meth:`PolicyAndCritic.forward`; with both the policy and the critic, one decoder pass gives
        the log-probs, entropies and values."""
        steps = num_completion_tokens
        if not (with_policy and with_critic) or steps == 0:
            return super().forward(
                input_ids, attention_mask, position_ids, steps, with_policy, with_critic, temperature
            )
        states, value_states = self._completion_states(input_ids, attention_mask, position_ids, steps)
        head = output_head_split(self.policy)[1]
        logprobs, entropies = logprobs_from_hidden_states(
            states,
            head,
            input_ids[:, input_ids.shape[1] - steps :],
            attention_mask[:, attention_mask.shape[1] - steps :],
            temperature,
            True,
            self.logprob_chunk_size,
        )
        return (logprobs, entropies), self.head_values(value_states)

    @contextmanager
    def capture_values(self) -> Iterator[ValueCapture]:
        """Apply the value head to every decoder output inside the block (see :class:`ValueCapture`)."""
        capture = ValueCapture()

        def record(states: torch.Tensor) -> None:
            with torch.no_grad():
                capture.calls.append(self.head_values(states))

        with self._on_value_states(record):
            yield capture

    def save_critic(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """``value_head.safetensors`` in ``path`` (the trunk is the policy, saved beside it); ``state_dict``
        (this wrapper's keys, e.g. gathered from FSDP shards) replaces the module's own weights."""
        from safetensors.torch import save_file

        head = sub_state_dict(state_dict, "value_head.") or self.value_head.state_dict()
        os.makedirs(path, exist_ok=True)
        save_file(
            {key: value.detach().cpu().contiguous() for key, value in head.items()},
            os.path.join(path, VALUE_HEAD_FILE),
            metadata={
                "critic": self.kind,
                "value_head_layer": "final hidden states" if self.layer is None else str(self.layer),
            },
        )
