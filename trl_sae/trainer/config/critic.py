"""The critic: its returns, learning rate, critic-only warm-up, the head critic's layer and gradient share, saving."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CriticConfig"]


@dataclass
class CriticConfig:
    """The critic: its returns, learning rate, critic-only warm-up, the head critic's layer and gradient share, saving. Mixed into :class:`~trl_sae.SAEPPOConfig`, whose docstring documents each field."""

    critic_lam: float = field(default=1.0, metadata={"help": "Lambda of the critic's GAE returns."})
    critic_learning_rate: float = field(default=1e-5, metadata={"help": "Critic learning rate."})
    value_warmup_steps: int = field(default=0, metadata={"help": "Critic-only steps before the actor moves."})
    value_head_trunk_grad_scale: float = field(
        default=0.0,
        metadata={
            "help": "Head critic (value_model='head'): share of the value gradient reaching the trunk."
        },
    )
    value_head_layer: int | None = field(
        default=None,
        metadata={
            "help": "Head critic (value_model='head'): decoder layer the value head reads; None: the final one."
        },
    )
    save_value_model: bool = field(default=True, metadata={"help": "Save the critic next to the policy."})

    def _validate_value_head_layer(self, fail: Any) -> None:
        layer = self.value_head_layer
        if layer is None:
            return
        if isinstance(layer, bool) or not isinstance(layer, int):
            fail(
                "value_head_layer",
                f"must be an int (a decoder layer, negative from the last) or None (the final hidden states), got "
                f"{layer!r}.",
            )
