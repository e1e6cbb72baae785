"""The advantage estimator and SAE's segmentation (paper Section 4)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_sae.core.advantages import EstimatorSpec, get_estimator_spec

__all__ = ["EstimatorConfig"]


@dataclass
class EstimatorConfig:
    """The advantage estimator and SAE's segmentation (paper Section 4). Mixed into :class:`~trl_sae.SAEPPOConfig`, whose docstring documents each field."""

    # SAE and estimator settings.
    advantage_estimator: str = field(
        default="sae",
        metadata={"help": "Advantage estimator: sae, gae, mc, adaptive_lambda, grpo or a registered one."},
    )
    segmentation: str = field(
        default="probability",
        metadata={"help": "Segmenter for SAE: probability, uniform, newline, entropy or a registered one."},
    )
    segment_threshold: float = field(default=0.2, metadata={"help": "SAE's p: boundary where prob < p."})
    segment_length: int = field(default=200, metadata={"help": "M for uniform segmentation."})
    entropy_threshold: float = field(
        default=1.0, metadata={"help": "Nats above which a token opens a segment."}
    )
    adaptive_lambda_alpha: float = field(default=0.2, metadata={"help": "VAPO alpha for adaptive_lambda."})
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Whiten advantages (unless the estimator declares whitens=False)."}
    )
    grpo_scale: str = field(default="std", metadata={"help": "GRPO scaling: std or none."})

    @property
    def estimator_spec(self) -> EstimatorSpec:
        """The registered :class:`~trl_sae.core.advantages.EstimatorSpec` of ``advantage_estimator``."""
        return get_estimator_spec(self.advantage_estimator)

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a learned value function (declared at its registration)."""
        return self.estimator_spec.needs_critic
