"""Advantage estimators for PPO on LLM responses (pure torch, no TRL import).

Index conventions (binding, see docs/design.md), per response ``i`` of valid length ``L_i``:

* ``values[t]`` is the critic's value of the state *before* token ``t``; ``V(L_i) = 0``.
* ``rewards[t]`` is the token reward; the outcome reward sits on ``t = L_i - 1``.
* ``delta[t] = rewards[t] + gamma * V(t + 1) - V(t)``.
* ``boundaries[t]`` is True when token ``t`` opens a segment.
* SAE (paper Eq. 9-10): ``A[t] = delta[t] + gamma * lam_t * A[t + 1]`` with ``lam_t = lam`` if
  ``boundaries[t + 1]`` else ``1``; GAE is SAE with every boundary True.
* Masked positions (``t >= L_i``) get advantage 0 and never influence valid ones.

All estimators return ``(advantages, returns)`` with ``returns = advantages + values`` on valid tokens and
0 elsewhere; none whitens (whitening is the trainer's choice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from trl_sae.core._registry import declared_inputs

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ESTIMATOR_INPUTS",
    "EstimatorSpec",
    "adaptive_lambda",
    "discounted_reverse_scan",
    "gae_advantages",
    "get_advantage_estimator",
    "get_estimator_spec",
    "grpo_advantages",
    "mc_advantages",
    "register_advantage_estimator",
    "sae_advantages",
]

# Width of the blocks of the reverse scan. 8 measured fastest on 2 CPU cores for T in [1k, 32k]
# (benchmarks/bench_advantages.py); any width gives the same result.
_SCAN_BLOCK = 8


# --------------------------------------------------------------------------------------------------
# The one primitive: a first-order linear recurrence solved right to left without a loop over T.
# --------------------------------------------------------------------------------------------------
def discounted_reverse_scan(
    deltas: torch.Tensor, coefs: torch.Tensor, block: int = _SCAN_BLOCK
) -> torch.Tensor:
    """Solve ``A[t] = deltas[t] + coefs[t] * A[t + 1]`` with ``A[T] = 0`` for every row at once.

    A blocked parallel scan: each block of ``block`` positions is reduced to one affine map
    ``A[start] = a + g * A[end]`` (a loop of ``block`` steps over all blocks at once), the maps of the
    ``T / block`` block starts form the same recurrence one level down (solved recursively), and a single
    fused pass writes every position. Python iterations: ``block * log_block(T)``; work: ``O(B * T)``.
    Only products of coefficients appear, never divisions, so any ``coefs`` in [0, 1] (including 0) stay
    exact where a ``lam ** -k`` closed form would overflow.

    Args:
        deltas: ``(B, T)`` floating tensor.
        coefs: ``(B, T)`` floating tensor, the decay from ``t + 1`` back to ``t``.
        block: block width, ``>= 1`` (a tuning knob; the result does not depend on it; 1 is the plain
            sequential loop).

    Returns:
        ``(B, T)`` tensor ``A``.
    """
    batch, length = deltas.shape
    if length == 0:
        return deltas.clone()
    if int(block) < 1:
        raise ValueError(f"`block` must be a positive integer, got {block!r}.")
    block = int(block)
    if block == 1:
        # Width-1 blocks would not shrink the problem (the recursion never ends); one block spanning
        # the whole row is the plain sequential loop, which is what width 1 means.
        block = length
    pad = (-length) % block
    if pad:
        deltas = F.pad(deltas, (0, pad))
        coefs = F.pad(coefs, (0, pad))
    num_blocks = deltas.shape[1] // block
    # (B, num_blocks, block) views of contiguous time blocks. The in-block loop works on strided slices
    # [..., j] written in place through out=, which measured faster than transposing to (block, B, nb)
    # and back (three full copies).
    d = deltas.view(batch, num_blocks, block)
    c = coefs.view(batch, num_blocks, block)
    local = torch.empty_like(d)  # A within the block, as if A were 0 after the block
    carry = torch.empty_like(c)  # coefficient of the A just after the block
    local[..., block - 1] = d[..., block - 1]
    carry[..., block - 1] = c[..., block - 1]
    for j in range(block - 2, -1, -1):
        torch.addcmul(d[..., j], c[..., j], local[..., j + 1], out=local[..., j])
        torch.mul(c[..., j], carry[..., j + 1], out=carry[..., j])
    if num_blocks > 1:
        block_starts = discounted_reverse_scan(local[..., 0].contiguous(), carry[..., 0].contiguous(), block)
        after_block = F.pad(block_starts[:, 1:], (0, 1))
        local = torch.addcmul(local, carry, after_block.unsqueeze(-1))
    return local.reshape(batch, num_blocks * block)[:, :length]


# --------------------------------------------------------------------------------------------------
# Validation shared by the estimators: errors name the argument and say what to pass instead.
# --------------------------------------------------------------------------------------------------
def _check_same_shape(reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if reference.dim() != 2:
        raise ValueError(f"`{reference_name}` must have shape (B, T); got {tuple(reference.shape)}.")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(tensor.shape)} but `{reference_name}` has shape "
                f"{tuple(reference.shape)}; all per-token tensors must share one (B, T) shape."
            )


def _check_prefix_mask(mask: torch.Tensor) -> torch.Tensor:
    valid = mask.bool()
    # Reductions rather than an elementwise comparison: no (B, T) temporary in the mask's dtype. Values in
    # [0, 1] whose sum equals the count of non-zeros are all 0 or 1.
    if (
        mask.dtype != torch.bool
        and mask.numel()
        and (mask.min() < 0 or mask.max() > 1 or mask.sum() != valid.sum())
    ):
        raise ValueError("`mask` must contain only 0 and 1 (or be a bool tensor).")
    # A prefix mask never rises from 0 to 1 along a row.
    if valid.shape[1] > 1 and torch.gt(valid[:, 1:], valid[:, :-1]).any():
        rows = torch.nonzero((valid[:, 1:] & ~valid[:, :-1]).any(dim=1)).flatten().tolist()
        raise ValueError(
            f"`mask` must be a contiguous prefix of ones per row (right padding); rows {rows[:5]} have a 0 "
            "before a 1. Left-padded batches must be re-padded to the right first."
        )
    return valid


def _check_unit_interval(name: str, value: float | torch.Tensor) -> None:
    if torch.is_tensor(value):
        if value.numel() and (torch.isnan(value).any() or (value < 0).any() or (value > 1).any()):
            raise ValueError(f"`{name}` must lie in [0, 1]; got values in [{value.min()}, {value.max()}].")
    elif not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"`{name}` must be in [0, 1], got {value}.")


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    # At least float32: bf16/fp16 accumulation over thousands of tokens loses the outcome reward.
    return torch.promote_types(tensor.dtype, torch.float32) if tensor.is_floating_point() else torch.float32


def _td_errors(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta[t] = r[t] + gamma * V(t+1) - V(t)`` with ``V(L) = 0``; 0 on masked positions.

    Returns ``(deltas, values)`` with ``values`` zeroed on masked positions.
    """
    zero = torch.zeros((), dtype=dtype, device=values.device)
    # torch.where, not multiplication: padding may hold garbage (even NaN) and must not leak. Two wheres
    # suffice: masked values make V(L) = 0, and the last one clears every masked delta (rewards included).
    values = torch.where(valid, values.to(dtype), zero)
    deltas = torch.sub(rewards.to(dtype), values)
    deltas[:, :-1].add_(values[:, 1:], alpha=gamma)  # + gamma * V(t+1), in place: no shifted copy
    return torch.where(valid, deltas, zero), values


def _next_valid(valid: torch.Tensor) -> torch.Tensor:
    """``valid[:, t + 1]`` with False past the end: the recursion stops at the last valid token."""
    return F.pad(valid[:, 1:], (0, 1), value=False)


# --------------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------------
def sae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    boundaries: torch.Tensor,
    lam: float,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segmental Advantage Estimation.

    Paper Eq. 9-10 (equivalently the boundary form Eq. 8, Theorem A.1):
    ``A[t] = delta[t] + gamma * lam_SAE(t) * A[t+1]``, ``lam_SAE(t) = lam if boundaries[t+1] else 1``,
    ``A[L-1] = delta[L-1]``.

    Args:
        rewards: ``(B, T)`` token rewards (outcome reward on the last valid token).
        values: ``(B, T)`` critic values of the state before each token.
        mask: ``(B, T)`` 1 on valid tokens, a contiguous prefix of each row.
        boundaries: ``(B, T)`` bool, True where a token opens a segment (``boundaries[:, 0]`` is ignored).
        lam: decay applied only when crossing into a new segment, in [0, 1].
        gamma: discount in [0, 1]; 1.0 in RLVR.

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` in at least float32, 0 on masked positions.
    """
    _check_same_shape("rewards", rewards, values=values, mask=mask, boundaries=boundaries)
    _check_unit_interval("lam", lam)
    _check_unit_interval("gamma", gamma)
    if torch.is_tensor(lam):
        raise ValueError("`lam` must be a float for SAE; per-row decays are a GAE option (gae_advantages).")
    valid = _check_prefix_mask(mask)
    dtype = _compute_dtype(rewards)
    deltas, values = _td_errors(rewards, values, valid, gamma, dtype)
    crosses_boundary = _next_valid(boundaries.bool())
    # Eq. 10: decay gamma * lam across a segment boundary, gamma inside a segment, 0 after the last token.
    coefs = torch.where(
        crosses_boundary,
        torch.tensor(gamma * float(lam), dtype=dtype, device=deltas.device),
        torch.tensor(float(gamma), dtype=dtype, device=deltas.device),
    ).mul_(_next_valid(valid))
    advantages = discounted_reverse_scan(deltas, coefs)
    return advantages, advantages + values  # both are exactly 0 on masked positions


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    lam: float | torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation, paper Eq. 4: ``A[t] = sum_l (gamma * lam)^l delta[t + l]``.

    Args:
        rewards: ``(B, T)`` token rewards.
        values: ``(B, T)`` critic values of the state before each token.
        mask: ``(B, T)`` 1 on valid tokens, a contiguous prefix of each row.
        lam: a float in [0, 1], or a ``(B,)`` tensor of per-response decays (e.g. VAPO's adaptive lambda).
        gamma: discount in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, 0 on masked positions.
    """
    _check_same_shape("rewards", rewards, values=values, mask=mask)
    _check_unit_interval("lam", lam)
    _check_unit_interval("gamma", gamma)
    valid = _check_prefix_mask(mask)
    dtype = _compute_dtype(rewards)
    deltas, values = _td_errors(rewards, values, valid, gamma, dtype)
    if torch.is_tensor(lam):
        if lam.shape != (rewards.shape[0],):
            raise ValueError(
                f"`lam` as a tensor must have shape (B,) = ({rewards.shape[0]},); got {tuple(lam.shape)}."
            )
        decay = (gamma * lam.to(device=values.device, dtype=dtype)).unsqueeze(1)
    else:
        decay = gamma * float(lam)
    # gamma * lam before every valid next token, 0 after the last one (the recursion stops there).
    coefs = _next_valid(valid).to(dtype).mul_(decay)
    advantages = discounted_reverse_scan(deltas, coefs)
    return advantages, advantages + values  # both are exactly 0 on masked positions


def mc_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte-Carlo advantage: discounted return-to-go minus value (GAE and SAE at ``lam = 1``).

    Args and returns as :func:`gae_advantages`.
    """
    return gae_advantages(rewards, values, mask, lam=1.0, gamma=gamma)


def adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.2) -> torch.Tensor:
    """VAPO's length-adaptive decay ``lam = 1 - 1 / (alpha * length)``, clamped to [0, 1].

    Args:
        lengths: ``(B,)`` response lengths in tokens.
        alpha: the VAPO coefficient (0.2 in VAPO and in the SAE paper's baseline), ``> 0``.

    Returns:
        ``(B,)`` float32 tensor of per-response ``lam``.
    """
    if not float(alpha) > 0:
        raise ValueError(f"`alpha` must be > 0, got {alpha}.")
    lengths = torch.as_tensor(lengths).float()
    if lengths.dim() != 1:
        raise ValueError(f"`lengths` must have shape (B,); got {tuple(lengths.shape)}.")
    with torch.no_grad():
        lam = 1.0 - 1.0 / (float(alpha) * lengths.clamp_min(1e-12))
    return lam.clamp(0.0, 1.0)


def grpo_advantages(
    scores: torch.Tensor, num_generations: int, scale: Literal["std", "none"] = "std", eps: float = 1e-4
) -> torch.Tensor:
    """GRPO's group-relative outcome advantage: ``(score - group mean) / (group std + eps)``.

    Consecutive blocks of ``num_generations`` rows are the samples of one prompt.

    Args:
        scores: ``(B,)`` outcome rewards, ``B`` a multiple of ``num_generations``.
        num_generations: samples per prompt (the group size).
        scale: ``"std"`` divides by the group's (unbiased) standard deviation, ``"none"`` only centres
            (Dr. GRPO).
        eps: added to the standard deviation.

    Returns:
        ``(B,)`` advantages (float32 at least).
    """
    if scores.dim() != 1:
        raise ValueError(f"`scores` must have shape (B,); got {tuple(scores.shape)}.")
    if int(num_generations) < 1 or scores.shape[0] % int(num_generations):
        raise ValueError(
            f"`num_generations` ({num_generations}) must be >= 1 and divide the batch ({scores.shape[0]})."
        )
    if scale not in ("std", "none"):
        raise ValueError(f"`scale` must be 'std' or 'none', got {scale!r}.")
    grouped = scores.to(_compute_dtype(scores)).view(-1, int(num_generations))
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "std" and num_generations > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


# --------------------------------------------------------------------------------------------------
# Registry: one keyword signature for every estimator, and its capabilities declared beside it, so a
# trainer switches by name and asks the spec (critic? whitening?) instead of comparing names.
# --------------------------------------------------------------------------------------------------
AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

#: The keyword arguments every registered estimator is called with (it ignores those it does not use).
ESTIMATOR_INPUTS: tuple[str, ...] = (
    "rewards",
    "values",
    "mask",
    "boundaries",
    "scores",
    "lam",
    "gamma",
    "num_generations",
    "adaptive_lambda_alpha",
    "grpo_scale",
)


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered advantage estimator and the capabilities the trainer asks about instead of its name.

    Calling the spec calls ``fn``. Declared at registration (:func:`register_advantage_estimator`).

    Attributes:
        name: the registry key, the value of ``SAEPPOConfig.advantage_estimator``.
        fn: the estimator, called with the keyword arguments :data:`ESTIMATOR_INPUTS`.
        needs_critic: the trainer builds and trains a value model; without one, ``values`` is all zeros and
            ``value_warmup_steps`` or a ``value_model`` are refused.
        whitens: ``whiten_advantages`` applies to its advantages (False when they are already normalised,
            as GRPO's are per group).
        needs_boundaries: its advantages depend on the segmenter's ``boundaries``, so the segmentation
            settings define the run (boundaries are computed and logged for every estimator).
        token_rewards: it reads the token ``rewards``, so a KL penalty (``kl_coef``) and ``whiten_rewards``
            reach it; False refuses both settings rather than ignoring them.
        min_generations: the smallest ``num_generations`` it is meaningful with (2 for an estimator that
            compares the samples of one prompt).
        reads: the inputs it names as keyword parameters (from its signature); the model card lists only
            the settings it reads.
    """

    name: str
    fn: AdvantageEstimator
    needs_critic: bool = True
    whitens: bool = True
    needs_boundaries: bool = False
    token_rewards: bool = True
    min_generations: int = 1
    reads: frozenset[str] = frozenset()

    def __call__(self, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(**inputs)


ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_advantage_estimator(
    name: str,
    fn: AdvantageEstimator | None = None,
    *,
    needs_critic: bool = True,
    whitens: bool = True,
    needs_boundaries: bool = False,
    token_rewards: bool = True,
    min_generations: int = 1,
) -> Any:
    """Add an estimator to :data:`ADVANTAGE_ESTIMATORS`, with its capabilities (see :class:`EstimatorSpec`).

    Use as ``register_advantage_estimator("name", fn, needs_critic=False)`` or as a decorator,
    ``@register_advantage_estimator("name")``; both return ``fn`` unchanged. Register before building the
    ``SAEPPOConfig`` that names it (the config validates the name and the capabilities).

    The estimator is called with keyword arguments only, every one of :data:`ESTIMATOR_INPUTS`, and must take
    ``**kwargs`` for those it ignores:

    * ``rewards``: ``(B, T)`` token rewards (outcome score on the last valid token, minus any KL penalty);
    * ``values``: ``(B, T)`` critic values of the state before each token (zeros without a critic);
    * ``mask``: ``(B, T)`` bool, True on valid tokens, a contiguous prefix of each row;
    * ``boundaries``: ``(B, T)`` bool, True where a token opens a segment (from the configured segmenter);
    * ``scores``: ``(B,)`` outcome rewards, consecutive blocks of ``num_generations`` rows per prompt;
    * ``lam``, ``gamma``, ``num_generations``, ``adaptive_lambda_alpha``, ``grpo_scale``: the
      ``SAEPPOConfig`` settings of the same names.

    It returns ``(advantages, returns)``, each ``(B, T)`` and 0 on masked positions.

    Raises:
        ValueError: ``name`` is already registered.
        TypeError: ``fn`` takes no ``**kwargs`` or requires an argument it is never given.
    """

    def register(fn: AdvantageEstimator) -> AdvantageEstimator:
        if not isinstance(name, str) or not name:
            raise ValueError(f"An advantage estimator's name must be a non-empty string, got {name!r}.")
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"An advantage estimator named {name!r} is already registered; pick another name "
                f"(registered: {sorted(ADVANTAGE_ESTIMATORS)})."
            )
        if (
            isinstance(min_generations, bool)
            or int(min_generations) != min_generations
            or min_generations < 1
        ):
            raise ValueError(f"`min_generations` must be a positive integer, got {min_generations!r}.")
        reads = declared_inputs("advantage estimator", name, fn, ESTIMATOR_INPUTS)
        ADVANTAGE_ESTIMATORS[name] = EstimatorSpec(
            name=name,
            fn=fn,
            needs_critic=bool(needs_critic),
            whitens=bool(whitens),
            needs_boundaries=bool(needs_boundaries),
            token_rewards=bool(token_rewards),
            min_generations=int(min_generations),
            reads=reads,
        )
        return fn

    return register if fn is None else register(fn)


def get_estimator_spec(name: str) -> EstimatorSpec:
    """The registered :class:`EstimatorSpec` called ``name``; a ``ValueError`` listing the names if none is."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)} (register "
            "your own with trl_sae.register_advantage_estimator)."
        ) from None


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look an estimator function up by name (``"sae"``, ``"gae"``, ``"mc"``, ``"adaptive_lambda"``,
    ``"grpo"`` or a registered one); :func:`get_estimator_spec` also gives its capabilities."""
    return get_estimator_spec(name).fn


@register_advantage_estimator("sae", needs_boundaries=True)
def _sae_estimator(*, rewards, values, mask, boundaries, lam, gamma=1.0, **_):
    if boundaries is None:
        raise ValueError("The 'sae' estimator needs `boundaries` (see trl_sae.core.segmentation).")
    return sae_advantages(rewards, values, mask, boundaries, lam=lam, gamma=gamma)


@register_advantage_estimator("gae")
def _gae_estimator(*, rewards, values, mask, lam, gamma=1.0, **_):
    return gae_advantages(rewards, values, mask, lam=lam, gamma=gamma)


@register_advantage_estimator("mc")
def _mc_estimator(*, rewards, values, mask, gamma=1.0, **_):
    return mc_advantages(rewards, values, mask, gamma=gamma)


@register_advantage_estimator("adaptive_lambda")
def _adaptive_lambda_estimator(*, rewards, values, mask, gamma=1.0, adaptive_lambda_alpha=0.2, **_):
    lengths = mask.bool().sum(dim=1)
    return gae_advantages(
        rewards, values, mask, lam=adaptive_lambda(lengths, adaptive_lambda_alpha), gamma=gamma
    )


@register_advantage_estimator(
    "grpo", needs_critic=False, whitens=False, token_rewards=False, min_generations=2
)
def _grpo_estimator(*, values, mask, scores, num_generations, grpo_scale="std", **_):
    """Every valid token of a response gets its group-normalised outcome advantage; no critic."""
    valid = mask.bool()
    per_response = grpo_advantages(scores, num_generations, scale=grpo_scale)
    advantages = torch.where(valid, per_response.unsqueeze(1), torch.zeros((), dtype=per_response.dtype))
    values = torch.where(valid, values.to(advantages.dtype), torch.zeros((), dtype=advantages.dtype))
    return advantages, advantages + values
