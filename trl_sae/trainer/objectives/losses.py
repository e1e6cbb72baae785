"""The PPO loss terms as plain tensor functions, each beside the equation it implements (as CleanRL's
``ppo.py`` does); :meth:`trl_sae.trainer.parts.update.PPOUpdate.loss` adds them up.

References: "the paper" is the SAE paper (Segmental Advantage Estimation, 2026; equation numbers as in its
text); "PPO" is Schulman et al. 2017, *Proximal Policy Optimization Algorithms* (arXiv:1707.06347).

Shapes: ``B`` completions, ``T`` completion tokens; ``mask`` is ``(B, T)`` bool, True on valid tokens
(index conventions in docs/design.md). The policy, value and entropy terms take ``loss_agg_mode`` (see
:func:`aggregate_loss`): by default the mean over the valid tokens of the rows given, as TRL's PPO; the
trainer passes the ``denominator`` of the whole mini-batch (across processes) so that the micro-batch terms
add up to the mini-batch's loss however it is split. Pure torch: no TRL or transformers import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trl_sae.trainer.config.rlvr import LOSS_AGG_MODES
from trl_sae.trainer.config.vllm import IMPORTANCE_SAMPLING_MODES

__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "clip_fractions",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_bonus",
    "importance_sampling_weights",
    "kl_penalty",
    "loss_units",
    "masked_mean",
    "masked_whiten",
    "positive_nll_loss",
    "process_denominator",
]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the True entries of ``mask`` (0 when there are none).

    Args:
        values: ``(B, T)``.
        mask: ``(B, T)`` bool (or 0/1).

    Returns:
        A scalar tensor.
    """
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def _check_mode(loss_agg_mode: str, norm_length: int | None) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}.")
    if loss_agg_mode == "seq-mean-token-sum-norm" and norm_length is None:
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs norm_length (e.g. response_length).")


def loss_units(
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    masked_rows_only: bool = False,
) -> torch.Tensor:
    """The denominator :func:`aggregate_loss` divides by, counted on ``mask`` alone.

    ``"token-mean"``: the number of valid tokens; ``"seq-mean-token-mean"``: the number of rows with at least
    one valid token; ``"seq-mean-token-sum-norm"``: the number of rows times ``norm_length``. These counts add
    over disjoint sets of rows, so the count of a mini-batch is the sum of its micro-batches' (and processes').

    Args:
        mask: ``(B, T)`` bool (or 0/1).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        norm_length: the constant of ``"seq-mean-token-sum-norm"``.
        masked_rows_only: ``"seq-mean-token-sum-norm"`` counts only the rows with a valid token, for a loss
            over a subset of the completions (the positive-example NLL: VAPO normalises over the positive
            set). Otherwise every row counts, as TRL's ``dr_grpo`` divides by the batch size whatever
            ``mask_truncated_completions`` masks. The other modes count the same either way.

    Returns:
        A float scalar tensor.
    """
    _check_mode(loss_agg_mode, norm_length)
    mask = mask.float()
    if loss_agg_mode == "token-mean":
        return mask.sum()
    rows_with_tokens = (mask.sum(dim=1) > 0).float().sum()
    if loss_agg_mode == "seq-mean-token-mean":
        return rows_with_tokens
    rows = rows_with_tokens if masked_rows_only else torch.tensor(float(mask.shape[0]), device=mask.device)
    return rows * norm_length


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce per-token loss terms to one scalar (the modes named as in verl's ``agg_loss``).

    * ``"token-mean"``: sum over every valid token / number of valid tokens (long completions weigh more).
    * ``"seq-mean-token-mean"``: each row's mean over its valid tokens, then the mean over rows (every
      completion weighs the same, as the original GRPO).
    * ``"seq-mean-token-sum-norm"``: each row's sum over its valid tokens divided by the constant
      ``norm_length``, then the mean over rows: ``sum / (rows x norm_length)``, exactly TRL GRPO's
      ``loss_type="dr_grpo"`` (``sum / (batch size x max_completion_length)``; Dr. GRPO, arXiv:2503.20783:
      no length bias). verl's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``) of the same name divides
      the sum by its ``loss_scale_factor`` only (default: the padded width), not by the rows: its loss and
      gradient are ``rows`` times these, which also changes what a given ``max_grad_norm`` clips.

    Each is ``sum of the units' terms / denominator``; ``denominator`` defaults to :func:`loss_units` of
    ``mask``. Passing the count of a whole mini-batch instead makes the results of its micro-batches add up
    to the mini-batch's aggregate.

    Args:
        values: ``(B, T)`` per-token terms.
        mask: ``(B, T)`` bool (or 0/1).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        norm_length: the constant of ``"seq-mean-token-sum-norm"``.
        denominator: overrides the count of units (0 counts as 1; a fraction, a process's share of a count
            over several processes, is used as it is).

    Returns:
        A scalar tensor.
    """
    _check_mode(loss_agg_mode, norm_length)
    mask = mask.to(values.dtype)
    token_sums = (values * mask).sum(dim=1)
    if loss_agg_mode == "seq-mean-token-mean":
        total = (token_sums / mask.sum(dim=1).clamp_min(1.0)).sum()
    else:  # token-mean: all tokens' sum; sum-norm: the rows' sums, divided by rows x norm_length below
        total = token_sums.sum()
    if denominator is None:
        denominator = loss_units(mask, loss_agg_mode, norm_length)
    denominator = torch.as_tensor(denominator, dtype=values.dtype, device=values.device)
    # Only an empty count is raised (to 1), not a fraction: a process's share of a count over several
    # processes (:func:`process_denominator`) is below 1 when the count is below the number of processes.
    return total / torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def process_denominator(global_units: torch.Tensor, num_processes: int) -> torch.Tensor:
    """Each process's denominator for a loss term: the term's count over all processes (an empty count
    counts as 1) divided by their number.

    DDP averages the processes' gradients, so dividing each process's sum by this share makes the mean the
    sum over all processes divided by the whole count, what one process holding every row computes. The
    count is clamped, not the share: a count of 1 on 2 processes is a share of 0.5 each (raised to 1, the
    term would come out halved).

    Args:
        global_units: the :func:`loss_units` summed over the processes (any shape, one count per entry).
        num_processes: the number of processes DDP averages over.

    Returns:
        ``global_units``' shape, float.
    """
    return global_units.float().clamp_min(1.0) / num_processes


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    shift_mean: bool = True,
    unbiased: bool = False,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Whitening over the valid tokens: ``(x - mean) / sqrt(var + eps)``, 0 on the others.

    With ``all_reduce_sum`` the mean and variance are those of every process's valid tokens together
    (verl whitens its whole batch so): one all-reduce of ``(sum, sum of squares, count)``, in float64 so
    that the one-pass variance does not cancel. The result then does not depend on how the rows are
    split between processes. Without it, this process's tokens only (TRL's ``masked_whiten``).

    Args:
        values: ``(B, T)``.
        mask: ``(B, T)`` bool (or 0/1).
        eps: added to the variance.
        shift_mean: False adds the mean back (TRL's reward whitening: rescaled, not centred).
        unbiased: the sample variance (``n - 1``; TRL's reward whitening) instead of the population one.
        all_reduce_sum: sums a ``(3,)`` float64 tensor over processes (e.g. ``accelerator.reduce(t,
            "sum")``); None: no communication.

    Returns:
        ``(B, T)``, in ``values``' dtype.
    """
    mask = mask.bool()
    valid = torch.where(mask, values, torch.zeros_like(values)).double()
    moments = torch.stack([valid.sum(), (valid**2).sum(), mask.sum().double()])
    if all_reduce_sum is not None:
        moments = all_reduce_sum(moments)
    total, total_squares, count = moments.unbind()
    mean = total / count.clamp_min(1.0)
    variance = (total_squares / count.clamp_min(1.0) - mean**2).clamp_min(0.0)
    if unbiased:
        variance = variance * count / (count - 1.0).clamp_min(1.0)
    whitened = (values.double() - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened.to(values.dtype), torch.zeros_like(values))


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    denominator: torch.Tensor | float | None = None,
    importance_weights: torch.Tensor | None = None,
    cliprange_high: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped surrogate, negated to be minimised.

    Paper Eq. 1 (PPO Eq. 7, L^CLIP):
        L(theta) = E[ min( r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t ) ],  r_t = pi_theta(a_t|s_t) / pi_old(a_t|s_t)
    written as ``max(-r A, -clip(r) A)`` and aggregated by :func:`aggregate_loss`. With ``cliprange_high``
    the upper bound is ``1 + eps_high`` (DAPO's clip-higher, arXiv:2503.14476; TRL's ``epsilon_high``):
    ``clip(r_t, 1 - eps, 1 + eps_high)``, which lets low-probability tokens with a positive advantage grow
    further before the clip stops their gradient.

    Args:
        logprobs: ``(B, T)`` log pi_theta of the sampled tokens (with gradient).
        old_logprobs: ``(B, T)`` log pi_old from the rollout.
        advantages: ``(B, T)`` A_t.
        mask: ``(B, T)`` bool.
        cliprange: eps.
        loss_agg_mode, norm_length, denominator: as :func:`aggregate_loss`.
        importance_weights: ``(B, T)`` or ``(B, 1)`` weights of each term (no gradient), the vLLM
            correction of :func:`importance_sampling_weights`; None: 1.
        cliprange_high: eps_high; None: ``cliprange`` (symmetric clipping).
        token_mask: ``(B, T)`` bool, the tokens whose terms count (``top_entropy_quantile``'s high-entropy
            tokens): the others add 0 but stay in the denominator, as in TRL's GRPO; None: every valid token.

    Returns:
        ``(loss, clipfrac, approx_kl)`` scalars: the loss; the fraction of valid tokens where the clipped
        term is the one taken; and ``0.5 * E[(log r)^2]``, an estimate of KL(pi_old || pi_theta). The last
        two carry no gradient.
    """
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    upper = cliprange if cliprange_high is None else cliprange_high
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + upper)
    per_token = torch.maximum(unclipped, clipped)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    if token_mask is not None:
        per_token = per_token * token_mask.to(per_token.dtype)
    loss = aggregate_loss(per_token, mask, loss_agg_mode, norm_length, denominator)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
        approx_kl = 0.5 * masked_mean(log_ratio**2, mask)
    return loss, clipfrac, approx_kl


def clip_fractions(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where :func:`clipped_policy_loss` takes the clipped term, split by bound (TRL GRPO's
    ``clip_ratio/low_mean`` and ``clip_ratio/high_mean``).

    Low: ``r_t < 1 - eps`` with ``A_t < 0``; high: ``r_t > 1 + eps_high`` with ``A_t > 0``. The two are
    disjoint and add up to :func:`clipped_policy_loss`'s ``clipfrac``.

    Args:
        logprobs, old_logprobs, advantages: ``(B, T)``, as :func:`clipped_policy_loss`.
        mask: ``(B, T)`` bool.
        cliprange, cliprange_high: eps and eps_high (None: eps).

    Returns:
        ``(low, high)`` scalars without gradient: fractions of the valid tokens.
    """
    upper = cliprange if cliprange_high is None else cliprange_high
    with torch.no_grad():
        ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs)).exp()
        low = (ratio < 1.0 - cliprange) & (advantages < 0)
        high = (ratio > 1.0 + upper) & (advantages > 0)
        return masked_mean(low.float(), mask), masked_mean(high.float(), mask)


def positive_nll_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """VAPO's positive-example language-model loss (arXiv:2504.05118, "positive example LM loss"), imitating completions
    whose reward clears a threshold; the trainer adds ``positive_nll_coef`` times it to the loss.

        L_NLL(theta) = -1 / sum_{o_i in T} |o_i| * sum_{o_i in T} sum_t log pi_theta(a_t | s_t)

    over the set ``T`` of positive completions (the ``"token-mean"`` form; other modes aggregate as
    :func:`aggregate_loss`, over ``T`` too: ``"seq-mean-token-sum-norm"`` divides by ``|T| x norm_length``,
    not by every row of the batch).

    Args:
        logprobs: ``(B, T)`` log pi_theta of the sampled tokens (with gradient).
        mask: ``(B, T)`` bool, the tokens of the positive completions.
        loss_agg_mode, norm_length, denominator: as :func:`aggregate_loss` (``denominator``: the count of the
            positive completions' units, ``loss_units(..., masked_rows_only=True)``, not of the whole
            mini-batch).

    Returns:
        A scalar tensor.
    """
    if denominator is None:
        denominator = loss_units(mask, loss_agg_mode, norm_length, masked_rows_only=True)
    return aggregate_loss(-logprobs, mask, loss_agg_mode, norm_length, denominator)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The critic's squared error with the value clipping of OpenAI baselines' PPO2 (as TRL and CleanRL).

    PPO Eq. 9's L^VF = (V_theta(s_t) - V_t^targ)^2, here
        0.5 * E[ max( (V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2 ) ]
    with R the critic's GAE(critic_lam) returns.

    Args:
        values: ``(B, T)`` V_theta(s_t) (with gradient).
        old_values: ``(B, T)`` V_old(s_t) from the rollout.
        returns: ``(B, T)`` targets R_t.
        mask: ``(B, T)`` bool.
        cliprange_value: eps_v.
        loss_agg_mode, norm_length, denominator: as :func:`aggregate_loss` (E[.] above).

    Returns:
        A scalar tensor.
    """
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    squared = torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return 0.5 * aggregate_loss(squared, mask, loss_agg_mode, norm_length, denominator)


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Mean token entropy, PPO Eq. 9's S[pi_theta](s_t); the loss subtracts ``entropy_coef`` times it.

    (The paper trains without it: "We do not apply a KL or entropy loss".)

    Args:
        entropy: ``(B, T)`` entropy of pi_theta(. | s_t).
        mask: ``(B, T)`` bool.
        loss_agg_mode, norm_length, denominator: as :func:`aggregate_loss`.

    Returns:
        A scalar tensor.
    """
    return aggregate_loss(entropy, mask, loss_agg_mode, norm_length, denominator)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) at the sampled tokens, which PPO for LLMs subtracts from the
    token rewards (r_t - beta * KL_t; PPO Eq. 8 puts the same KL in the objective instead).

    With log rho = log pi_ref(a_t|s_t) - log pi(a_t|s_t) (Schulman, "Approximating KL Divergence", 2020):
        k1 = -log rho                   (unbiased, can be negative)
        k3 = (rho - 1) - log rho        (unbiased, never negative)
    (The paper trains without it: kl_coef = 0.)

    Args:
        logprobs: ``(B, T)`` log pi of the sampled tokens (the rollout's).
        ref_logprobs: ``(B, T)`` log pi_ref of the same tokens.
        estimator: ``"k1"`` or ``"k3"``.

    Returns:
        ``(B, T)``; the caller masks padding.
    """
    if estimator not in ("k1", "k3"):
        raise ValueError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}.")
    log_ratio = ref_logprobs - logprobs
    return -log_ratio if estimator == "k1" else log_ratio.exp() - 1 - log_ratio


# TRL's GRPOConfig.vllm_importance_sampling_mode values: per token or per completion, clipped or masked.


def importance_sampling_weights(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Truncated / masked importance weights for samples drawn by another engine (vLLM), as TRL's GRPO.

    The rollout was sampled from ``pi_vllm`` while PPO's ratio is taken against ``pi_old``, the trainer's
    own forward on the same weights. The per-token ratio ``rho_t = pi_old(a_t|s_t) / pi_vllm(a_t|s_t)``
    (truncated importance sampling, Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training") re-weights each policy-loss term:

    - ``token_*``: ``rho_t`` per token; ``sequence_*``: ``prod_t rho_t`` over the completion, one weight for
      all its tokens;
    - ``*_truncate``: clipped into ``[clip_min, clip_max]``; ``*_mask``: 0 outside that range.

    Args:
        logprobs: ``(B, T)`` the trainer's recomputed log-probs (``pi_old``).
        sampling_logprobs: ``(B, T)`` the sampler's log-probs (``pi_vllm``).
        mask: ``(B, T)`` bool, valid tokens.
        mode: ``token_truncate``, ``token_mask``, ``sequence_truncate`` or ``sequence_mask``.
        clip_min, clip_max: the bounds (None: unbounded on that side).

    Returns:
        ``(B, T)`` weights (the sequence modes broadcast one value per row), 0 on masked positions.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}.")
    diff = torch.where(mask, logprobs - sampling_logprobs, torch.zeros_like(logprobs))
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=1, keepdim=True).expand_as(logprobs)
    ratio = diff.exp()
    if mode.endswith("_truncate") and (clip_min is not None or clip_max is not None):
        ratio = ratio.clamp(min=clip_min, max=clip_max)
    elif mode.endswith("_mask"):
        low = -torch.inf if clip_min is None else clip_min
        high = torch.inf if clip_max is None else clip_max
        ratio = torch.where((ratio < low) | (ratio > high), torch.zeros_like(ratio), ratio)
    return torch.where(mask, ratio, torch.zeros_like(ratio))
