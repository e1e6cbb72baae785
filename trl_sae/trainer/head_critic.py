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
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from trl_sae.generation.capture import logprobs_from_hidden_states, output_head_split
from trl_sae.trainer.critic import PolicyAndCritic, base_model, sub_state_dict

__all__ = ["HeadCritic", "ValueCapture", "scale_gradient"]

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
    """

    def __init__(self, policy: nn.Module, trunk_grad_scale: float = 0.0) -> None:
        super().__init__(policy, critic=None)
        split = output_head_split(policy)
        if isinstance(split, str):
            raise ValueError(
                f"value_model='head' reads the hidden states the policy's output head reads, but {split}; "
                "use value_model=None (a separate critic) or 'shared' with a peft_config."
            )
        base = base_model(policy)
        self.trunk_grad_scale = float(trunk_grad_scale)
        self.value_head = nn.Linear(base.config.hidden_size, 1, bias=True)
        nn.init.zeros_(self.value_head.weight)  # the first values are 0 rather than noise
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(base.parameters()).device)

    @property
    def has_critic(self) -> bool:
        return True

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.value_head.parameters())

    def _decoder(self) -> nn.Module:
        return output_head_split(self.policy)[0]

    def _completion_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        num_completion_tokens: int,
    ) -> torch.Tensor:
        """``(B, T, H)`` final hidden states before each of the last ``T`` tokens."""
        hidden = self._decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        steps = num_completion_tokens
        return hidden[:, hidden.shape[1] - steps - 1 : hidden.shape[1] - 1]

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
            states = self._completion_states(input_ids, attention_mask, position_ids, num_completion_tokens)
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
        states = self._completion_states(input_ids, attention_mask, position_ids, steps)
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
        return (logprobs, entropies), self.head_values(states)

    @contextmanager
    def capture_values(self) -> Iterator[ValueCapture]:
        """Apply the value head to every decoder output inside the block (see :class:`ValueCapture`)."""
        capture = ValueCapture()

        def record(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            with torch.no_grad():
                capture.calls.append(self.head_values(output.last_hidden_state))

        handle = self._decoder().register_forward_hook(record, with_kwargs=True)
        try:
            yield capture
        finally:
            handle.remove()

    def save_critic(self, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """``value_head.safetensors`` in ``path`` (the trunk is the policy, saved beside it); ``state_dict``
        (this wrapper's keys, e.g. gathered from FSDP shards) replaces the module's own weights."""
        from safetensors.torch import save_file

        head = sub_state_dict(state_dict, "value_head.") or self.value_head.state_dict()
        os.makedirs(path, exist_ok=True)
        save_file(
            {key: value.detach().cpu().contiguous() for key, value in head.items()},
            os.path.join(path, VALUE_HEAD_FILE),
            metadata={"critic": "value head on the policy's final hidden states (value_model='head')"},
        )
