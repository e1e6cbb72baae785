"""Numerical tests of the advantage estimators against independent references.

Three references are written here from the definitions, never from the code under test:

* ``loop_reference``: the per-row reverse loop every PPO implementation uses (t from L-1 down to 0),
  in Python floats (float64), with the SAE decay ``lam_SAE(t) = lam iff boundaries[t + 1]``.
* ``boundary_form_reference``: the paper's boundary form (Appendix A, Eq. "Boundary form"), built from
  n-step advantages ``V(s_{t_k}) - V(s_t) + rewards`` summed directly, so Theorem A.1 is checked rather
  than assumed.
* ``return_to_go``: the Monte-Carlo return, for the ``lam = 1`` limit.

Index conventions are those of DESIGN.md: ``values[t]`` is the value before token ``t``, ``V(L) = 0``,
``boundaries[t]`` True means token ``t`` opens a segment, padding sits after the valid prefix.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    adaptive_lambda,
    discounted_reverse_scan,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    mc_advantages,
    register_advantage_estimator,
    sae_advantages,
)
from trl_sae.core.segmentation import uniform_boundaries

# Hypothesis: enough examples to hit ragged/empty rows and lam in {0, 1}, few enough for a fast suite.
FAST = settings(max_examples=60, deadline=None)

LAMS = [0.0, 1e-3, 0.5, 0.95, 1.0]
GAMMAS = [1.0, 0.99, 0.5, 0.0]


# --------------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------------
def _row(tensor: torch.Tensor, i: int, length: int) -> list[float]:
    return tensor[i, :length].double().tolist()


def loop_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    lengths: list[int],
    lam: float | list[float],
    gamma: float,
    boundaries: torch.Tensor | None = None,
) -> torch.Tensor:
    """TRL/verl-style reverse loop per row in float64; ``boundaries=None`` is GAE.

    ``lam`` may be a list (one decay per row, as the adaptive-lambda estimator passes).
    """
    batch, length_max = rewards.shape
    out = torch.zeros(batch, length_max, dtype=torch.float64)
    for i, length in enumerate(lengths):
        r, v = _row(rewards, i, length), _row(values, i, length)
        row_lam = lam[i] if isinstance(lam, list) else lam
        b = boundaries[i, :length].tolist() if boundaries is not None else None
        last = 0.0
        for t in range(length - 1, -1, -1):
            next_value = v[t + 1] if t + 1 < length else 0.0  # V(L) = 0
            delta = r[t] + gamma * next_value - v[t]
            # lam_SAE(t) = lam iff t + 1 opens a segment; at t = L-1 `last` is 0 so the choice is moot.
            crosses = b is None or (t + 1 < length and b[t + 1])
            last = delta + gamma * (row_lam if crosses else 1.0) * last
            out[i, t] = last
    return out


def n_step_advantage(r: list[float], v: list[float], t: int, n: int, gamma: float) -> float:
    """``A_t^(n) = sum_{i<n} gamma^i r[t+i] + gamma^n V(s_{t+n}) - V(s_t)``, with ``V(s_L) = 0``."""
    length = len(r)
    bootstrap = v[t + n] if t + n < length else 0.0
    return sum(gamma**i * r[t + i] for i in range(n)) + gamma**n * bootstrap - v[t]


def boundary_form_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    lengths: list[int],
    boundaries: torch.Tensor,
    lam: float,
    gamma: float,
) -> torch.Tensor:
    """Paper Eq. (boundary form), Appendix A, with the set ``B`` and index ``j`` spelled out.

    ``B = {s in 1..L-1 : boundaries[s]} ∪ {L}`` as an ordered sequence ``t_1 < ... < t_|B|`` (1-based);
    ``j = min{k : t_k > t}``;
    ``A_t = (1-lam) sum_{k: t < t_k < L} lam^(k-j) A_t^(t_k - t) + lam^(|B|-j) A_t^(L - t)``.
    Position 0 can never be ``> t``, so whether it is a boundary is irrelevant, as the design says.
    """
    batch, length_max = rewards.shape
    out = torch.zeros(batch, length_max, dtype=torch.float64)
    for i, length in enumerate(lengths):
        r, v = _row(rewards, i, length), _row(values, i, length)
        b = boundaries[i, :length].tolist()
        boundary_set = [s for s in range(1, length) if b[s]] + [length]
        for t in range(length):
            j = min(k for k, t_k in enumerate(boundary_set, start=1) if t_k > t)
            intermediate = sum(
                lam ** (k - j) * n_step_advantage(r, v, t, t_k - t, gamma)
                for k, t_k in enumerate(boundary_set, start=1)
                if t < t_k < length
            )
            terminal = lam ** (len(boundary_set) - j) * n_step_advantage(r, v, t, length - t, gamma)
            out[i, t] = (1 - lam) * intermediate + terminal
    return out


def return_to_go(rewards: torch.Tensor, lengths: list[int], gamma: float) -> torch.Tensor:
    """Monte-Carlo discounted return ``G_t = sum_{i >= t} gamma^(i-t) r_i`` over the valid prefix."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for i, length in enumerate(lengths):
        r = _row(rewards, i, length)
        for t in range(length):
            out[i, t] = sum(gamma ** (s - t) * r[s] for s in range(t, length))
    return out


# --------------------------------------------------------------------------------------------------
# Random ragged batches
# --------------------------------------------------------------------------------------------------
def make_batch(
    seed: int,
    batch: int,
    length_max: int,
    dtype: torch.dtype = torch.float64,
    boundary_rate: float = 0.3,
    lengths: list[int] | None = None,
) -> dict:
    """Ragged batch with deliberate garbage in the padding (it must never matter)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(0, length_max + 1, (batch,), generator=g).tolist()
        # Always include an empty, a one-token and a full row: the edges of the recursion.
        lengths[: min(3, batch)] = [0, 1, length_max][: min(3, batch)]
    positions = torch.arange(length_max)
    mask = (positions.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    rewards = 0.1 * torch.randn(batch, length_max, generator=g, dtype=torch.float64)  # KL-like terms
    for i, length in enumerate(lengths):
        if length:
            rewards[i, length - 1] += float(torch.randint(0, 2, (1,), generator=g))  # outcome reward
    values = torch.rand(batch, length_max, generator=g, dtype=torch.float64)
    boundaries = torch.rand(batch, length_max, generator=g) < boundary_rate
    # Padding garbage: a bug that lets padding leak shows up as NaN or a huge number.
    pad = mask == 0
    rewards = rewards.masked_fill(pad, float("nan")).to(dtype)
    values = values.masked_fill(pad, 1e30).to(dtype)
    boundaries = boundaries | pad
    return {"rewards": rewards, "values": values, "mask": mask, "boundaries": boundaries, "lengths": lengths}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def valid_of(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool()


# --------------------------------------------------------------------------------------------------
# Agreement with the reverse-loop reference
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lam", LAMS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_sae_and_gae_match_loop_reference_float64(lam: float, gamma: float) -> None:
    data = make_batch(seed=int(lam * 1000 + gamma * 10), batch=7, length_max=45)
    args = (data["rewards"], data["values"], data["mask"])
    lengths = data["lengths"]

    sae, sae_returns = sae_advantages(*args, data["boundaries"], lam=lam, gamma=gamma)
    gae, gae_returns = gae_advantages(*args, lam=lam, gamma=gamma)

    assert sae.dtype == gae.dtype == torch.float64
    expected_sae = loop_reference(data["rewards"], data["values"], lengths, lam, gamma, data["boundaries"])
    expected_gae = loop_reference(data["rewards"], data["values"], lengths, lam, gamma)
    assert_close(sae, expected_sae, atol=1e-12, rtol=1e-12)
    assert_close(gae, expected_gae, atol=1e-12, rtol=1e-12)
    valid = valid_of(data["mask"])
    zero = torch.zeros((), dtype=torch.float64)
    for advantages, returns in ((sae, sae_returns), (gae, gae_returns)):
        expected_returns = torch.where(valid, advantages + data["values"], zero)
        assert torch.equal(returns, expected_returns)


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_float32_matches_float64_reference(lam: float) -> None:
    data = make_batch(seed=3, batch=6, length_max=300, dtype=torch.float32)
    args = (data["rewards"], data["values"], data["mask"])
    sae, _ = sae_advantages(*args, data["boundaries"], lam=lam, gamma=0.99)
    gae, _ = gae_advantages(*args, lam=lam, gamma=0.99)
    assert sae.dtype == gae.dtype == torch.float32
    # The reference runs on the same float32-rounded inputs; what is left is float32 accumulation.
    expected = loop_reference(data["rewards"], data["values"], data["lengths"], lam, 0.99, data["boundaries"])
    assert_close(sae, expected, atol=2e-5, rtol=1e-5)
    assert_close(gae, loop_reference(*args[:2], data["lengths"], lam, 0.99), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_computed_in_float32(half: torch.dtype) -> None:
    # A long response with the outcome reward at the end: accumulated in bf16, adding the ~2000
    # per-token deltas would round away most of the signal (bf16 has 8 bits of mantissa).
    length = 2048
    data = make_batch(seed=5, batch=3, length_max=length, lengths=[length, 1000, 7], dtype=half)
    args = (data["rewards"], data["values"], data["mask"])
    sae, sae_returns = sae_advantages(*args, data["boundaries"], lam=0.95)
    gae, _ = gae_advantages(*args, lam=1.0)
    assert sae.dtype == sae_returns.dtype == gae.dtype == torch.float32
    expected_sae = loop_reference(
        data["rewards"], data["values"], data["lengths"], 0.95, 1.0, data["boundaries"]
    )
    assert_close(sae, expected_sae, atol=1e-4, rtol=1e-5)
    assert_close(gae, loop_reference(*args[:2], data["lengths"], 1.0, 1.0), atol=1e-4, rtol=1e-5)
    # Returns add the (half-precision) values in float32, not in half precision.
    valid = valid_of(data["mask"])
    assert_close(sae_returns[valid], (expected_sae + data["values"].double())[valid], atol=1e-4)


def test_gae_per_row_lambda_tensor_matches_reference() -> None:
    data = make_batch(seed=11, batch=5, length_max=40)
    lams = [0.0, 0.3, 0.9, 1.0, 0.5]
    # float64 decays: a float32 tensor would round 0.3 before the estimator sees it.
    lam = torch.tensor(lams, dtype=torch.float64)
    gae, _ = gae_advantages(data["rewards"], data["values"], data["mask"], lam=lam, gamma=0.9)
    expected = loop_reference(data["rewards"], data["values"], data["lengths"], lams, 0.9)
    assert_close(gae, expected, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------------------------------
# Theorem A.1: the boundary form equals the recursion
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lam", LAMS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_sae_equals_paper_boundary_form(lam: float, gamma: float) -> None:
    data = make_batch(seed=17, batch=6, length_max=30, boundary_rate=0.25)
    sae, _ = sae_advantages(
        data["rewards"], data["values"], data["mask"], data["boundaries"], lam=lam, gamma=gamma
    )
    expected = boundary_form_reference(
        data["rewards"], data["values"], data["lengths"], data["boundaries"], lam, gamma
    )
    assert_close(sae, expected, atol=1e-11, rtol=1e-11)


def test_boundary_form_hand_worked_example() -> None:
    # L = 5, boundaries at 2 and 4, lam = 0.5, gamma = 1: B = {2, 4, 5}.
    # t = 0: j = 1, A = 0.5 * (A^(2) + 0.5 A^(4)) + 0.5^2 A^(5).
    values = torch.tensor([[0.1, 0.2, 0.4, 0.3, 0.6]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    boundaries = torch.tensor([[False, False, True, False, True]])
    a2, a4, a5 = 0.4 - 0.1, 0.6 - 0.1, 1.0 - 0.1
    expected_a0 = 0.5 * (a2 + 0.5 * a4) + 0.25 * a5
    sae, _ = sae_advantages(rewards, values, torch.ones(1, 5), boundaries, lam=0.5)
    assert sae[0, 0].item() == pytest.approx(expected_a0, abs=1e-14)
    # t = 4 is in the last segment: the Monte-Carlo advantage 1.0 - 0.6.
    assert sae[0, 4].item() == pytest.approx(0.4, abs=1e-14)


@st.composite
def ragged_batches(draw: st.DrawFn) -> dict:
    batch = draw(st.integers(1, 4))
    length_max = draw(st.integers(1, 16))
    lengths = draw(st.lists(st.integers(0, length_max), min_size=batch, max_size=batch))
    floats = st.floats(-5.0, 5.0, allow_nan=False, width=64)
    cells = batch * length_max
    rewards = torch.tensor(draw(st.lists(floats, min_size=cells, max_size=cells)), dtype=torch.float64)
    values = torch.tensor(draw(st.lists(floats, min_size=cells, max_size=cells)), dtype=torch.float64)
    boundaries = torch.tensor(draw(st.lists(st.booleans(), min_size=cells, max_size=cells)))
    mask = (torch.arange(length_max).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    return {
        "rewards": rewards.view(batch, length_max),
        "values": values.view(batch, length_max),
        "boundaries": boundaries.view(batch, length_max),
        "mask": mask,
        "lengths": lengths,
    }


lams = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))
gammas = st.one_of(st.just(1.0), st.floats(0.0, 1.0))


@FAST
@given(data=ragged_batches(), lam=lams, gamma=gammas)
def test_property_sae_matches_loop_and_boundary_form(data: dict, lam: float, gamma: float) -> None:
    sae, returns = sae_advantages(
        data["rewards"], data["values"], data["mask"], data["boundaries"], lam=lam, gamma=gamma
    )
    args = (data["rewards"], data["values"], data["lengths"])
    assert_close(sae, loop_reference(*args, lam, gamma, data["boundaries"]), atol=1e-9, rtol=1e-9)
    assert_close(sae, boundary_form_reference(*args, data["boundaries"], lam, gamma), atol=1e-9, rtol=1e-9)
    valid = valid_of(data["mask"])
    assert torch.equal(returns[valid], (sae + data["values"])[valid])
    assert not sae[~valid].any() and not returns[~valid].any()


@FAST
@given(data=ragged_batches(), lam=lams, gamma=gammas)
def test_property_gae_is_sae_with_every_boundary(data: dict, lam: float, gamma: float) -> None:
    args = (data["rewards"], data["values"], data["mask"])
    gae, gae_returns = gae_advantages(*args, lam=lam, gamma=gamma)
    every = torch.ones_like(data["boundaries"])
    sae, sae_returns = sae_advantages(*args, every, lam=lam, gamma=gamma)
    assert_close(gae, loop_reference(data["rewards"], data["values"], data["lengths"], lam, gamma), atol=1e-9)
    assert_close(sae, gae, atol=1e-12, rtol=1e-12)
    assert_close(sae_returns, gae_returns, atol=1e-12, rtol=1e-12)
    # boundaries[:, 0] never matters (only boundaries[t + 1] enters lam_SAE(t)).
    flipped = data["boundaries"].clone()
    flipped[:, 0] = ~flipped[:, 0]
    a, _ = sae_advantages(*args, data["boundaries"], lam=lam, gamma=gamma)
    b, _ = sae_advantages(*args, flipped, lam=lam, gamma=gamma)
    assert torch.equal(a, b)


@FAST
@given(data=ragged_batches(), gamma=gammas)
def test_property_lam_one_is_monte_carlo(data: dict, gamma: float) -> None:
    args = (data["rewards"], data["values"], data["mask"])
    valid = valid_of(data["mask"])
    expected = torch.where(
        valid,
        return_to_go(data["rewards"], data["lengths"], gamma) - data["values"],
        torch.tensor(0.0).double(),
    )
    sae, _ = sae_advantages(*args, data["boundaries"], lam=1.0, gamma=gamma)
    gae, _ = gae_advantages(*args, lam=1.0, gamma=gamma)
    mc, mc_returns = mc_advantages(*args, gamma=gamma)
    for advantages in (sae, gae, mc):
        assert_close(advantages, expected, atol=1e-9, rtol=1e-9)
    # The critic target at lam = 1 is the return-to-go itself.
    assert_close(mc_returns[valid], return_to_go(data["rewards"], data["lengths"], gamma)[valid], atol=1e-9)


@FAST
@given(data=ragged_batches(), lam=lams, gamma=gammas, seed=st.integers(0, 2**16))
def test_property_padding_never_leaks(data: dict, lam: float, gamma: float, seed: int) -> None:
    args = (data["mask"],)
    clean = {k: data[k].clone() for k in ("rewards", "values", "boundaries")}
    pad = ~valid_of(data["mask"])
    clean["rewards"][pad] = 0.0
    clean["values"][pad] = 0.0
    clean["boundaries"][pad] = False
    g = torch.Generator().manual_seed(seed)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 3.0])
    pick = torch.randint(0, len(garbage), data["rewards"].shape, generator=g)
    dirty_rewards = torch.where(pad, garbage[pick].double(), clean["rewards"])
    dirty_values = torch.where(pad, garbage[pick.flip(-1)].double(), clean["values"])
    dirty_boundaries = torch.where(pad, torch.rand(pad.shape, generator=g) < 0.5, clean["boundaries"])

    results = {
        "clean": (
            sae_advantages(
                clean["rewards"], clean["values"], *args, clean["boundaries"], lam=lam, gamma=gamma
            ),
            gae_advantages(clean["rewards"], clean["values"], *args, lam=lam, gamma=gamma),
        ),
        "dirty": (
            sae_advantages(dirty_rewards, dirty_values, *args, dirty_boundaries, lam=lam, gamma=gamma),
            gae_advantages(dirty_rewards, dirty_values, *args, lam=lam, gamma=gamma),
        ),
    }
    for (clean_adv, clean_ret), (dirty_adv, dirty_ret) in zip(*results.values()):
        # Bit-for-bit: padding must not even perturb rounding.
        assert torch.equal(clean_adv, dirty_adv)
        assert torch.equal(clean_ret, dirty_ret)
        assert torch.isfinite(dirty_adv).all() and torch.isfinite(dirty_ret).all()
        assert (dirty_adv[pad] == 0).all() and (dirty_ret[pad] == 0).all()


# --------------------------------------------------------------------------------------------------
# Theorem 4.1 (Appendix B): bias of A_0 under uniform segmentation
# --------------------------------------------------------------------------------------------------
def bias_bound(alpha: float, beta: float, horizon: int, segment: int, lam: float) -> float:
    """``alpha e^(T/beta) [1 + (1-lam) / (e^(M/beta) - lam)]``, the right-hand side of Theorem 4.1."""
    return alpha * math.exp(horizon / beta) * (1 + (1 - lam) / (math.exp(segment / beta) - lam))


def error_envelope(alpha: float, beta: float, horizon: int) -> torch.Tensor:
    """``alpha e^((T-t)/beta)`` for t = 0..T-1, the assumed bound on |eps(s_t)| (eps(s_T) = 0 via V(T) = 0)."""
    t = torch.arange(horizon, dtype=torch.float64)
    return alpha * torch.exp((horizon - t) / beta)


def measured_bias(eps: torch.Tensor, segment: int, lam: float, seed: int = 0) -> float:
    """``A_0^SAE(V* + eps) - A_0^SAE(V*)`` with outcome-only rewards and uniform boundaries."""
    horizon = eps.shape[0]
    g = torch.Generator().manual_seed(seed)
    v_star = torch.rand(1, horizon, generator=g, dtype=torch.float64)  # any V*: the bias is linear in eps
    rewards = torch.zeros(1, horizon, dtype=torch.float64)
    rewards[0, -1] = 1.0  # outcome reward on the last token
    mask = torch.ones(1, horizon)
    boundaries = uniform_boundaries(mask, segment_length=segment)
    noisy, _ = sae_advantages(rewards, v_star + eps.unsqueeze(0), mask, boundaries, lam=lam)
    exact, _ = sae_advantages(rewards, v_star, mask, boundaries, lam=lam)
    return (noisy[0, 0] - exact[0, 0]).item()


def telescoped_bias(eps: torch.Tensor, segment: int, lam: float) -> float:
    """Appendix B, after telescoping: ``-eps(s_0) + sum_{k=1}^{n-1} lam^(k-1) (1-lam) eps(s_kM)``."""
    n = eps.shape[0] // segment
    return -eps[0].item() + sum(lam ** (k - 1) * (1 - lam) * eps[k * segment].item() for k in range(1, n))


def worst_case_eps(alpha: float, beta: float, horizon: int, segment: int, seed: int) -> torch.Tensor:
    """Signs that make every telescoped term add up: eps(s_0) at -bound, eps(s_kM) at +bound.

    Within-segment errors telescope away, so they get random signs at the bound to prove it.
    """
    envelope = error_envelope(alpha, beta, horizon)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (horizon,), generator=g).double() * 2 - 1
    signs[::segment] = 1.0
    signs[0] = -1.0
    return signs * envelope


HORIZON = 60  # divisible by 1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60
DIVISORS = [m for m in range(1, HORIZON + 1) if HORIZON % m == 0]


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.9, 0.95, 1.0])
@pytest.mark.parametrize("beta", [15.0, 60.0, 200.0])
def test_theorem_4_1_worst_case_signs(lam: float, beta: float) -> None:
    alpha = 0.01
    for segment in DIVISORS:
        eps = worst_case_eps(alpha, beta, HORIZON, segment, seed=segment)
        bias = measured_bias(eps, segment, lam)
        # The code's bias is exactly the appendix's telescoped sum ...
        assert bias == pytest.approx(telescoped_bias(eps, segment, lam), rel=1e-10, abs=1e-12)
        # ... which the geometric series bounds from above.
        assert abs(bias) <= bias_bound(alpha, beta, HORIZON, segment, lam) * (1 + 1e-12)
        # Every telescoped term is at its maximum, so the bias is the finite series itself.
        n = HORIZON // segment
        series = sum(lam ** (k - 1) * math.exp(-k * segment / beta) for k in range(1, n))
        assert bias == pytest.approx(alpha * math.exp(HORIZON / beta) * (1 + (1 - lam) * series), rel=1e-10)
        # Flipping every sign flips the bias.
        assert measured_bias(-eps, segment, lam) == pytest.approx(-bias, rel=1e-10)


def test_theorem_4_1_bound_shrinks_with_segment_length() -> None:
    alpha, beta = 0.01, 30.0
    for lam in (0.0, 0.5, 0.95):
        bounds = [bias_bound(alpha, beta, HORIZON, m, lam) for m in DIVISORS]
        assert all(a > b for a, b in itertools.pairwise(bounds)), bounds
        worst = [measured_bias(worst_case_eps(alpha, beta, HORIZON, m, 0), m, lam) for m in DIVISORS]
        # The attained worst case shrinks too, and GAE (M = 1) is the worst of all.
        assert all(a > b for a, b in itertools.pairwise(worst)), worst
        assert worst[0] == max(worst)
    # lam = 1 is Monte-Carlo: only eps(s_0) survives, whatever the segmentation.
    assert bias_bound(alpha, beta, HORIZON, 1, 1.0) == pytest.approx(alpha * math.exp(HORIZON / beta))


@FAST
@given(
    n=st.integers(1, 12),
    segment=st.integers(1, 12),
    beta=st.floats(2.0, 500.0),
    alpha=st.floats(1e-4, 1.0),
    lam=lams,
    seed=st.integers(0, 2**16),
)
def test_property_theorem_4_1_random_errors(
    n: int, segment: int, beta: float, alpha: float, lam: float, seed: int
) -> None:
    horizon = n * segment
    g = torch.Generator().manual_seed(seed)
    # Random signs and magnitudes anywhere inside the assumed envelope |eps(s_t)| <= alpha e^((T-t)/beta).
    scale = torch.rand(horizon, generator=g, dtype=torch.float64) * 2 - 1
    eps = scale * error_envelope(alpha, beta, horizon)
    bias = measured_bias(eps, segment, lam, seed)
    magnitude = alpha * math.exp(horizon / beta)
    assert bias == pytest.approx(telescoped_bias(eps, segment, lam), rel=1e-9, abs=1e-12 * magnitude)
    assert abs(bias) <= bias_bound(alpha, beta, horizon, segment, lam) * (1 + 1e-9)


# --------------------------------------------------------------------------------------------------
# Stability on very long responses
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_row() -> dict:
    length = 32768
    g = torch.Generator().manual_seed(123)
    rewards = -0.001 * torch.rand(1, length, generator=g, dtype=torch.float64)  # KL penalty per token
    rewards[0, -1] += 1.0
    values = torch.rand(1, length, generator=g, dtype=torch.float64)
    boundaries = torch.rand(1, length, generator=g) < 0.2
    return {"rewards": rewards, "values": values, "boundaries": boundaries, "lengths": [length]}


@pytest.mark.parametrize("lam", LAMS)
def test_long_response_is_stable(long_row: dict, lam: float) -> None:
    rewards, values, boundaries = long_row["rewards"], long_row["values"], long_row["boundaries"]
    mask = torch.ones_like(rewards)
    expected_sae = loop_reference(rewards, values, long_row["lengths"], lam, 1.0, boundaries)
    expected_gae = loop_reference(rewards, values, long_row["lengths"], lam, 1.0)
    # Measured: float64 within 1e-13, float32 within 6e-6 (lam = 1 sums 32768 deltas); the tolerances
    # leave 10x headroom, far below the error of a float32-rounded lam or a bf16 accumulation.
    for dtype, atol in ((torch.float64, 1e-11), (torch.float32, 5e-5)):
        sae, _ = sae_advantages(rewards.to(dtype), values.to(dtype), mask, boundaries, lam=lam)
        gae, _ = gae_advantages(rewards.to(dtype), values.to(dtype), mask, lam=lam)
        assert torch.isfinite(sae).all() and torch.isfinite(gae).all()
        assert_close(sae, expected_sae, atol=atol, rtol=1e-6)
        assert_close(gae, expected_gae, atol=atol, rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# The scan primitive
# --------------------------------------------------------------------------------------------------
def scan_reference(deltas: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(deltas, dtype=torch.float64)
    following = torch.zeros(deltas.shape[0], dtype=torch.float64)
    for t in range(deltas.shape[1] - 1, -1, -1):
        following = deltas[:, t].double() + coefs[:, t].double() * following
        out[:, t] = following
    return out


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 63, 64, 65, 100, 513])
def test_scan_is_independent_of_block(length: int) -> None:
    g = torch.Generator().manual_seed(length)
    deltas = torch.randn(3, length, generator=g, dtype=torch.float64)
    coefs = torch.rand(3, length, generator=g, dtype=torch.float64)
    coefs[0, :: max(1, length // 5)] = 0.0  # exact zeros (lam = 0 crossings) must cut the sum
    coefs[1] = 1.0  # no decay at all: the plain suffix sum
    expected = scan_reference(deltas, coefs)
    for block in (1, 2, 3, 8, 64):
        assert_close(discounted_reverse_scan(deltas, coefs, block=block), expected, atol=1e-11, rtol=1e-11)
    # With unit coefficients the scan is a reverse cumulative sum.
    assert_close(expected[1], deltas[1].flip(0).cumsum(0).flip(0), atol=1e-11)


@FAST
@given(
    length=st.integers(0, 200),
    block=st.sampled_from([1, 2, 3, 5, 8, 64]),
    seed=st.integers(0, 2**16),
)
def test_property_scan_any_block(length: int, block: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    deltas = torch.randn(2, length, generator=g, dtype=torch.float64)
    coefs = torch.rand(2, length, generator=g, dtype=torch.float64)
    result = discounted_reverse_scan(deltas, coefs, block=block)
    assert result.shape == (2, length)
    assert_close(result, scan_reference(deltas, coefs), atol=1e-11, rtol=1e-11)


def test_scan_rejects_nonpositive_block() -> None:
    with pytest.raises(ValueError, match="`block`"):
        discounted_reverse_scan(torch.zeros(1, 4), torch.zeros(1, 4), block=0)


# --------------------------------------------------------------------------------------------------
# Validation: errors name the argument
# --------------------------------------------------------------------------------------------------
def _inputs(batch: int = 2, length: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(batch, length),
        torch.zeros(batch, length),
        torch.ones(batch, length),
        torch.zeros(batch, length, dtype=torch.bool),
    )


@pytest.mark.parametrize("bad", ["values", "mask", "boundaries"])
def test_shape_mismatch_names_the_argument(bad: str) -> None:
    rewards, values, mask, boundaries = _inputs()
    tensors = {"values": values, "mask": mask, "boundaries": boundaries}
    tensors[bad] = tensors[bad][:, :-1]
    with pytest.raises(ValueError, match=f"`{bad}`"):
        sae_advantages(rewards, tensors["values"], tensors["mask"], tensors["boundaries"], lam=0.5)
    if bad != "boundaries":
        with pytest.raises(ValueError, match=f"`{bad}`"):
            gae_advantages(rewards, tensors["values"], tensors["mask"], lam=0.5)


def test_rewards_must_be_two_dimensional() -> None:
    with pytest.raises(ValueError, match="`rewards`"):
        gae_advantages(torch.zeros(5), torch.zeros(5), torch.ones(5), lam=0.5)


@pytest.mark.parametrize("name", ["lam", "gamma"])
@pytest.mark.parametrize("value", [-0.1, 1.0001, float("nan"), 2.0])
def test_out_of_range_lam_and_gamma(name: str, value: float) -> None:
    rewards, values, mask, boundaries = _inputs()
    kwargs = {"lam": 0.5, "gamma": 1.0, name: value}
    with pytest.raises(ValueError, match=f"`{name}`"):
        sae_advantages(rewards, values, mask, boundaries, **kwargs)
    with pytest.raises(ValueError, match=f"`{name}`"):
        gae_advantages(rewards, values, mask, **kwargs)
    if name == "gamma":
        with pytest.raises(ValueError, match="`gamma`"):
            mc_advantages(rewards, values, mask, gamma=value)


def test_lambda_tensor_validation() -> None:
    rewards, values, mask, boundaries = _inputs(batch=2)
    with pytest.raises(ValueError, match="`lam`"):
        gae_advantages(rewards, values, mask, lam=torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="`lam`"):
        gae_advantages(rewards, values, mask, lam=torch.tensor([0.5, 0.5, 0.5]))
    with pytest.raises(ValueError, match="`lam`"):
        sae_advantages(rewards, values, mask, boundaries, lam=torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize(
    ("mask_row", "hint"),
    [
        ([1, 0, 1, 1, 0], "prefix"),  # a hole
        ([0, 0, 1, 1, 1], "prefix"),  # left padding
        ([1, 2, 1, 0, 0], "0 and 1"),
        ([1.0, 0.5, 0.0, 0.0, 0.0], "0 and 1"),
        ([1.0, float("nan"), 0.0, 0.0, 0.0], "0 and 1"),
    ],
)
def test_bad_masks_are_rejected(mask_row: list[float], hint: str) -> None:
    rewards, values, _, boundaries = _inputs(batch=2)
    mask = torch.tensor([[1, 1, 1, 0, 0], mask_row], dtype=torch.float32)
    for call in (
        lambda: sae_advantages(rewards, values, mask, boundaries, lam=0.5),
        lambda: gae_advantages(rewards, values, mask, lam=0.5),
    ):
        with pytest.raises(ValueError, match="`mask`") as info:
            call()
        assert hint in str(info.value)


def test_bool_and_integer_masks_are_accepted_and_equivalent() -> None:
    data = make_batch(seed=2, batch=4, length_max=12)
    results = [
        sae_advantages(data["rewards"], data["values"], m, data["boundaries"], lam=0.7)[0]
        for m in (data["mask"], data["mask"].bool(), data["mask"].float())
    ]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# --------------------------------------------------------------------------------------------------
# Registry, adaptive lambda, GRPO
# --------------------------------------------------------------------------------------------------
def _registry_kwargs(data: dict, scores: torch.Tensor) -> dict:
    return {
        "rewards": data["rewards"],
        "values": data["values"],
        "mask": data["mask"],
        "boundaries": data["boundaries"],
        "scores": scores,
        "lam": 0.9,
        "gamma": 1.0,
        "num_generations": 2,
        "adaptive_lambda_alpha": 0.2,
    }


def test_registry_dispatches_to_each_estimator() -> None:
    data = make_batch(seed=8, batch=4, length_max=40, lengths=[40, 25, 6, 0])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    kwargs = _registry_kwargs(data, scores)
    args = (data["rewards"], data["values"], data["mask"])
    assert {"sae", "gae", "mc", "adaptive_lambda", "grpo"} <= set(ADVANTAGE_ESTIMATORS)

    expected = {
        "sae": sae_advantages(*args, data["boundaries"], lam=0.9),
        "gae": gae_advantages(*args, lam=0.9),
        "mc": mc_advantages(*args),
        # lengths 40, 25, 6, 0 -> 1 - 1/(0.2 L) = 0.875, 0.8, 1/6, clamped 0.
        "adaptive_lambda": gae_advantages(*args, lam=torch.tensor([0.875, 0.8, 1 / 6, 0.0])),
    }
    for name, (adv, ret) in expected.items():
        got_adv, got_ret = get_advantage_estimator(name)(**kwargs)
        assert_close(got_adv, adv, atol=1e-6)
        assert_close(got_ret, ret, atol=1e-6)

    # GRPO: the group-normalised outcome on every valid token, nothing on padding.
    adv, ret = get_advantage_estimator("grpo")(**kwargs)
    per_response = grpo_advantages(scores, num_generations=2)
    valid = valid_of(data["mask"])
    for i in range(4):
        assert (adv[i][valid[i]] == per_response[i]).all()
        assert (adv[i][~valid[i]] == 0).all()
    # float32 scores make float32 returns, so the float64 values are rounded: hence the tolerance.
    assert_close(ret[valid], (adv + data["values"])[valid], atol=1e-6)


def test_registry_sae_needs_boundaries() -> None:
    data = make_batch(seed=8, batch=2, length_max=5)
    kwargs = _registry_kwargs(data, torch.zeros(2)) | {"boundaries": None}
    with pytest.raises(ValueError, match="`boundaries`"):
        get_advantage_estimator("sae")(**kwargs)


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names") as info:
        get_advantage_estimator("gea")
    for name in ("sae", "gae", "mc", "adaptive_lambda", "grpo"):
        assert repr(name) in str(info.value)


def test_register_new_estimator_and_reject_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gae")(lambda **_: None)
    try:

        @register_advantage_estimator("zero_test_only")
        def _zero(*, rewards, **_):
            return torch.zeros_like(rewards), torch.zeros_like(rewards)

        assert get_advantage_estimator("zero_test_only") is _zero
    finally:
        ADVANTAGE_ESTIMATORS.pop("zero_test_only", None)


def test_adaptive_lambda_values() -> None:
    lengths = torch.tensor([0, 1, 5, 10, 20, 100, 1000])
    # VAPO: lam = 1 - 1/(0.2 L); negative values (L < 5) clamp to 0.
    expected = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.75, 0.95, 0.995])
    got = adaptive_lambda(lengths)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(adaptive_lambda(lengths, alpha=0.1)[-1], torch.tensor(0.99))
    assert ((got >= 0) & (got <= 1)).all()
    # Monotone in length: longer responses bootstrap less.
    assert (got[1:] >= got[:-1]).all()


@pytest.mark.parametrize("alpha", [0.0, -0.2, float("nan")])
def test_adaptive_lambda_rejects_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="`alpha`"):
        adaptive_lambda(torch.tensor([10]), alpha=alpha)


def test_adaptive_lambda_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="`lengths`"):
        adaptive_lambda(torch.ones(2, 3))


def test_grpo_std_and_none() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(12, generator=g, dtype=torch.float64) * 3
    adv = grpo_advantages(scores, num_generations=4).view(3, 4)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
    # Unit (unbiased) std up to the eps added to the denominator.
    torch.testing.assert_close(adv.std(dim=1), torch.ones(3, dtype=torch.float64), atol=1e-3, rtol=0)
    expected = (scores.view(3, 4) - scores.view(3, 4).mean(1, keepdim=True)) / (
        scores.view(3, 4).std(1, keepdim=True) + 1e-4
    )
    torch.testing.assert_close(adv, expected)

    centred = grpo_advantages(scores, num_generations=4, scale="none").view(3, 4)
    torch.testing.assert_close(centred, scores.view(3, 4) - scores.view(3, 4).mean(1, keepdim=True))

    # A group where every sample scored the same carries no signal (and no division by zero).
    same = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), num_generations=2)
    assert torch.isfinite(same).all() and (same[:2] == 0).all()
    # One sample per prompt: nothing to compare with, so zero.
    assert (grpo_advantages(torch.tensor([0.3, 0.9]), num_generations=1) == 0).all()
    # Low precision scores are computed in float32.
    assert grpo_advantages(scores.to(torch.bfloat16), num_generations=4).dtype == torch.float32


@pytest.mark.parametrize("num_generations", [0, -2, 5])
def test_grpo_rejects_bad_group_size(num_generations: int) -> None:
    with pytest.raises(ValueError, match="`num_generations`"):
        grpo_advantages(torch.zeros(12), num_generations=num_generations)


def test_grpo_rejects_bad_scores_and_scale() -> None:
    with pytest.raises(ValueError, match="`scores`"):
        grpo_advantages(torch.zeros(4, 2), num_generations=2)
    with pytest.raises(ValueError, match="`scale`"):
        grpo_advantages(torch.zeros(4), num_generations=2, scale="mad")  # type: ignore[arg-type]
