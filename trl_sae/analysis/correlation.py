"""Advantage quality: correlation of each estimator with a Monte-Carlo ground-truth advantage ``A*``.

This is the analysis of the paper's Section 5.3.2 ("Correlation with an Approximate Ground-Truth
Advantage", Figure 4):

1. Sample trajectories from the policy at a temperature (:func:`trl_sae.generation.capture.generate_with_logprobs`,
   which also gives each sampled token's log-probability, hence the probability boundaries).
2. Pick random spans ``[t, t + m]`` whose two ends are segment starts (see :func:`pick_spans`).
3. From each end state ``s_t`` (prompt + ``completion[:t]``) run ``K`` Monte-Carlo continuations to the
   end with the same policy and temperature, score them with the verifiable reward, and average:
   ``V*(s_t)`` (:func:`monte_carlo_values`). ``A* = V*(s_{t+m}) - V*(s_t)`` is assigned to every token of
   the span (tokens ``t .. t+m-1``, the actions that move ``s_t`` to ``s_{t+m}``).
4. For the same tokens compute every estimator's advantage from a critic (GAE over a lambda grid, SAE
   over a ``p`` grid, VAPO's adaptive lambda) with the outcome reward on the last valid token.
5. Report the Pearson correlation of each estimator with ``A*`` over all span tokens, with a bootstrap
   confidence interval that resamples spans, not tokens (:func:`pearson_with_bootstrap`): the tokens of
   one span share one ``A*``, so resampling tokens would pretend to have far more independent data.

Index conventions follow docs/design.md: completion position ``t`` is the ``t``-th generated token, the
state *before* it is ``s_t``, ``values[t] = V(s_t)``, and ``s_L`` (after the last valid token) is terminal.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from trl_sae._moved import moved_names_getattr
from trl_sae.analysis.monte_carlo import monte_carlo_values
from trl_sae.analysis.sampling import (
    RewardFunc,
    as_rows,
    eval_mode,
    sample_completions,
    sampling_generation_config,
    score_completions,
    seeded,
)
from trl_sae.analysis.spans import pick_spans
from trl_sae.analysis.stats import pearson_with_bootstrap
from trl_sae.core.advantages import adaptive_lambda, gae_advantages, sae_advantages
from trl_sae.core.segmentation import probability_boundaries
from trl_sae.generation.inputs import left_pad, model_device, right_pad

__all__ = [
    "DEFAULT_LAM_GRID",
    "DEFAULT_P_GRID",
    "CorrelationResult",
    "CorrelationRow",
    "SpanRecord",
    "correlate_advantages",
    "critic_value_fn",
    "estimator_advantages",
]
# 0.1.0's names that moved to stats, spans and monte_carlo still import from here (trl_sae/_moved.py).
__getattr__ = moved_names_getattr(__name__)

# The grids of the paper's Figure 4: GAE as a function of lambda (right panel) and SAE for the p values
# of its threshold ablation.
DEFAULT_LAM_GRID: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)
DEFAULT_P_GRID: tuple[float, ...] = (0.05, 0.2, 0.5, 0.9)

ValueFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Critic values and the estimators under comparison
# --------------------------------------------------------------------------------------------------
def critic_value_fn(critic_model: torch.nn.Module) -> ValueFn:
    """Adapt a one-label sequence-classification critic into a ``value_fn``.

    As TRL's PPO does: run the critic's backbone on ``prompt + completion`` and apply its ``score`` head to
    every hidden state; the value of ``s_t`` (before completion token ``t``) is the head at position
    ``P - 1 + t``, the last position the state contains.

    Args:
        critic_model: e.g. ``Qwen3ForSequenceClassification`` with ``num_labels=1`` (a backbone under
            ``base_model_prefix`` and a ``score`` linear head).

    Returns:
        ``value_fn(sequences (B, P+T), attention_mask (B, P+T), prompt_length P) -> values (B, T)`` float32.
    """
    prefix = getattr(critic_model, "base_model_prefix", "model")
    backbone = getattr(critic_model, prefix, None)
    head = getattr(critic_model, "score", None)
    if backbone is None or head is None:
        raise ValueError(
            f"{type(critic_model).__name__} has no `{prefix}` backbone and `score` head; pass your own "
            "`value_fn(sequences, attention_mask, prompt_length) -> (B, T)` instead."
        )

    def value_fn(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        # Left-padded prompts: positions count valid tokens only, as during generation.
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp_min(0)
        with eval_mode(critic_model):
            hidden = backbone(
                input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
            scores = head(hidden).squeeze(-1).float()  # (B, P+T)
        return scores[:, prompt_length - 1 : -1]

    return value_fn


def _fmt(value: float) -> str:
    return f"{value:g}"


def estimator_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    lam_grid: Sequence[float] = DEFAULT_LAM_GRID,
    p_grid: Sequence[float] = DEFAULT_P_GRID,
    sae_lam: float = 0.95,
    adaptive_lambda_alpha: float = 0.2,
    gamma: float = 1.0,
) -> dict[tuple[str, str], torch.Tensor]:
    """Every compared estimator's advantages on one batch.

    Args:
        rewards: ``(B, T)`` token rewards (outcome reward on the last valid token).
        values: ``(B, T)`` critic values of the state before each token.
        mask: ``(B, T)`` 1 on valid tokens (right padding).
        logprobs: ``(B, T)`` rollout log-probabilities of the sampled tokens (for SAE's boundaries).
        lam_grid: GAE lambdas.
        p_grid: SAE probability thresholds.
        sae_lam: SAE's lambda.
        adaptive_lambda_alpha: VAPO's alpha in ``lam = 1 - 1 / (alpha * L)``.
        gamma: discount.

    Returns:
        ``{(estimator, setting): (B, T) advantages}``, ordered GAE, SAE, adaptive lambda.
    """
    out: dict[tuple[str, str], torch.Tensor] = {}
    for lam in lam_grid:
        out[("gae", f"lam={_fmt(lam)}")] = gae_advantages(rewards, values, mask, lam=float(lam), gamma=gamma)[
            0
        ]
    for p in p_grid:
        boundaries = probability_boundaries(logprobs, mask, threshold=float(p))
        out[("sae", f"p={_fmt(p)}, lam={_fmt(sae_lam)}")] = sae_advantages(
            rewards, values, mask, boundaries, lam=float(sae_lam), gamma=gamma
        )[0]
    lam_adaptive = adaptive_lambda(mask.bool().sum(dim=1), alpha=adaptive_lambda_alpha)
    out[("adaptive_lambda", f"alpha={_fmt(adaptive_lambda_alpha)}")] = gae_advantages(
        rewards, values, mask, lam=lam_adaptive, gamma=gamma
    )[0]
    return out


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclass
class CorrelationRow:
    """One estimator's correlation with ``A*``."""

    estimator: str
    setting: str
    pearson: float
    ci_low: float
    ci_high: float
    n_tokens: int
    n_spans: int

    @property
    def label(self) -> str:
        return f"{self.estimator}({self.setting})"


@dataclass
class SpanRecord:
    """One analysed span: tokens ``start .. end-1`` of trajectory ``trajectory``, ``A* = v_end - v_start``."""

    trajectory: int
    start: int
    end: int
    v_start: float
    v_end: float

    @property
    def a_star(self) -> float:
        return self.v_end - self.v_start


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


@dataclass
class CorrelationResult:
    """Output of :func:`correlate_advantages`.

    Attributes:
        rows: one :class:`CorrelationRow` per estimator setting, in the order GAE (lambda grid), SAE
            (p grid), adaptive lambda.
        a_star: ``(N,)`` ``A*`` of every span token.
        estimates: ``{row label: (N,) advantages}`` aligned with ``a_star``.
        span_ids: ``(N,)`` index into ``spans`` of each token (the bootstrap's groups).
        spans: the analysed spans.
        trajectory_rewards: ``(num_trajectories,)`` outcome reward of each sampled trajectory (NaN = None).
        config: the run's settings.
    """

    rows: list[CorrelationRow]
    a_star: np.ndarray
    estimates: dict[str, np.ndarray]
    span_ids: np.ndarray
    spans: list[SpanRecord]
    trajectory_rewards: np.ndarray
    config: dict[str, Any] = field(default_factory=dict)

    def row(self, estimator: str, setting: str | None = None) -> CorrelationRow:
        """The row of ``estimator`` (and ``setting``, needed when the estimator has several)."""
        matches = [r for r in self.rows if r.estimator == estimator and setting in (None, r.setting)]
        if len(matches) != 1:
            options = [r.label for r in self.rows if r.estimator == estimator]
            raise KeyError(
                f"{estimator!r} setting {setting!r} matches {len(matches)} rows; options: {options}"
            )
        return matches[0]

    def to_dict(self, include_arrays: bool = False) -> dict[str, Any]:
        """Rows and config (and, optionally, the per-token arrays) as plain Python, NaN as ``None``."""
        out: dict[str, Any] = {
            "rows": [asdict(r) for r in self.rows],
            "n_tokens": int(self.a_star.shape[0]),
            "n_spans": len(self.spans),
            "config": self.config,
        }
        if include_arrays:
            out["a_star"] = self.a_star
            out["estimates"] = self.estimates
            out["span_ids"] = self.span_ids
            out["spans"] = [asdict(s) for s in self.spans]
            out["trajectory_rewards"] = self.trajectory_rewards
        return _jsonable(out)

    def to_json(self, path: str | None = None, include_arrays: bool = False, indent: int = 2) -> str:
        """JSON text of :meth:`to_dict`; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(include_arrays=include_arrays), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        return text

    def to_markdown(self) -> str:
        """A Markdown table, one row per estimator setting."""
        level = self.config.get("confidence", 0.95)
        lines = [
            f"| estimator | setting | Pearson r | {100 * level:g}% CI | tokens | spans |",
            "|---|---|---:|---|---:|---:|",
        ]
        for r in self.rows:
            ci = "n/a" if math.isnan(r.ci_low) else f"[{r.ci_low:.3f}, {r.ci_high:.3f}]"
            pearson = "n/a" if math.isnan(r.pearson) else f"{r.pearson:.3f}"
            lines.append(f"| {r.estimator} | {r.setting} | {pearson} | {ci} | {r.n_tokens} | {r.n_spans} |")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The analysis
# --------------------------------------------------------------------------------------------------
def correlate_advantages(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts_dataset: Any,
    reward_func: RewardFunc,
    value_fn: ValueFn,
    num_trajectories: int = 64,
    num_spans_per_trajectory: int = 4,
    num_continuations: int = 32,
    temperature: float = 1.0,
    max_new_tokens: int = 512,
    p_grid: Sequence[float] = DEFAULT_P_GRID,
    lam_grid: Sequence[float] = DEFAULT_LAM_GRID,
    sae_lam: float = 0.95,
    seed: int = 0,
    batch_size: int = 32,
    *,
    span_p: float = 0.2,
    adaptive_lambda_alpha: float = 0.2,
    num_bootstrap: int = 1000,
    confidence: float = 0.95,
    reuse_prefix_cache: bool = True,
    show_progress: bool = True,
) -> CorrelationResult:
    """Correlation of GAE / SAE / adaptive-lambda advantages with a Monte-Carlo ``A*`` (paper Section 5.3.2).

    Args:
        policy: causal LM whose advantages are analysed (also the continuation policy).
        tokenizer: its tokenizer; prompts are left padded.
        prompts_dataset: a ``datasets.Dataset`` or list of rows with a ``"prompt"`` column (string or chat
            messages) plus the columns the reward function reads, or a plain list of prompts. Trajectory
            ``j`` uses row ``j % len(rows)``.
        reward_func: TRL-style verifiable reward, ``f(prompts, completions, completion_ids, **columns)
            -> list[float | None]``. ``None`` means "no reward": such trajectories are skipped and such
            continuations leave the Monte-Carlo mean.
        value_fn: ``value_fn(sequences (B, P+T), attention_mask (B, P+T), P) -> (B, T)`` critic values of
            the state before each completion token (see :func:`critic_value_fn`).
        num_trajectories: trajectories sampled.
        num_spans_per_trajectory: spans drawn per trajectory (see :func:`pick_spans`).
        num_continuations: ``K`` Monte-Carlo continuations per span end (32 in the paper).
        temperature: sampling temperature of the trajectories and the continuations.
        max_new_tokens: the rollout horizon; a continuation from ``s_t`` may generate
            ``max_new_tokens - t`` tokens.
        p_grid: SAE thresholds compared.
        lam_grid: GAE lambdas compared.
        sae_lam: SAE's lambda.
        seed: seeds the sampling (torch, restored afterwards), the span draw and the bootstrap.
        batch_size: rows per ``generate`` / critic call.
        span_p: threshold of the probability boundaries that delimit spans.
        adaptive_lambda_alpha: VAPO's alpha for the adaptive-lambda baseline.
        num_bootstrap: bootstrap resamples of spans for the confidence intervals.
        confidence: level of the intervals.
        reuse_prefix_cache: share each span end's prefilled KV cache among its ``K`` continuations.
        show_progress: tqdm bars.

    Returns:
        :class:`CorrelationResult`.
    """
    if num_trajectories < 1 or num_spans_per_trajectory < 1:
        raise ValueError("`num_trajectories` and `num_spans_per_trajectory` must be >= 1.")
    rows = as_rows(prompts_dataset)
    config = sampling_generation_config(policy, tokenizer, temperature, max_new_tokens)
    device = model_device(policy)
    run_config = {
        "num_trajectories": num_trajectories,
        "num_spans_per_trajectory": num_spans_per_trajectory,
        "num_continuations": num_continuations,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "p_grid": list(p_grid),
        "lam_grid": list(lam_grid),
        "sae_lam": sae_lam,
        "span_p": span_p,
        "adaptive_lambda_alpha": adaptive_lambda_alpha,
        "seed": seed,
        "num_bootstrap": num_bootstrap,
        "confidence": confidence,
        "reuse_prefix_cache": reuse_prefix_cache,
    }

    with seeded(seed, device), eval_mode(policy), torch.inference_mode():
        samples = sample_completions(
            policy, tokenizer, rows, num_trajectories, config, batch_size, show_progress
        )
        # 1. Outcome reward of each trajectory: the reward on its last token and V*(s_L).
        outcome = np.concatenate(
            [
                score_completions(
                    reward_func,
                    tokenizer,
                    samples.rows[i : i + batch_size],
                    [c.tolist() for c in samples.completion_ids[i : i + batch_size]],
                )
                for i in range(0, num_trajectories, batch_size)
            ]
        )

        # 2. Spans, drawn trajectory by trajectory from one seeded generator.
        rng = np.random.default_rng(seed)
        spans: list[tuple[int, int, int]] = []
        for i, completion in enumerate(samples.completion_ids):
            length = len(completion)
            if length == 0 or math.isnan(outcome[i]):
                continue
            logprobs = samples.logprobs[i].unsqueeze(0)
            boundaries = probability_boundaries(logprobs, torch.ones_like(logprobs), threshold=span_p)[0]
            spans.extend((i, a, b) for a, b in pick_spans(boundaries, length, num_spans_per_trajectory, rng))

        # 3. V* of every distinct span end; s_L is terminal and worth the outcome reward itself.
        state_keys = sorted(
            {(i, t) for i, a, b in spans for t in (a, b) if t < len(samples.completion_ids[i])}
        )
        mc = monte_carlo_values(
            policy,
            tokenizer,
            rows=[samples.rows[i] for i, _ in state_keys],
            prompt_ids=[samples.prompt_ids[i] for i, _ in state_keys],
            prefix_ids=[samples.completion_ids[i][:t].tolist() for i, t in state_keys],
            budgets=[max_new_tokens - t for _, t in state_keys],
            reward_func=reward_func,
            num_continuations=num_continuations,
            temperature=temperature,
            batch_size=batch_size,
            reuse_prefix_cache=reuse_prefix_cache,
            show_progress=show_progress,
        )
        v_star = {key: float(v) for key, v in zip(state_keys, mc.values)}
        for i, completion in enumerate(samples.completion_ids):
            v_star[(i, len(completion))] = float(outcome[i])
        records = [
            SpanRecord(i, a, b, v_star[(i, a)], v_star[(i, b)])
            for i, a, b in spans
            if not (math.isnan(v_star[(i, a)]) or math.isnan(v_star[(i, b)]))
        ]
        if len(records) < len(spans):
            warnings.warn(
                f"{len(spans) - len(records)} spans dropped: every continuation of an end state had a None reward.",
                stacklevel=2,
            )

        # 4. Every estimator's advantages on the trajectories that have spans, batch by batch.
        spans_of: dict[int, list[int]] = {}
        for k, record in enumerate(records):
            spans_of.setdefault(record.trajectory, []).append(k)
        trajectories = sorted(spans_of)
        token_chunks: dict[str, list[np.ndarray]] = {}
        a_star_chunks: list[np.ndarray] = []
        span_id_chunks: list[np.ndarray] = []
        labels: list[tuple[str, str]] = []
        for start in range(0, len(trajectories), batch_size):
            batch = trajectories[start : start + batch_size]
            prompt_ids, prompt_mask = left_pad(
                [samples.prompt_ids[i] for i in batch], config.pad_token_id, device
            )
            completion_ids = right_pad(
                [samples.completion_ids[i] for i in batch], config.pad_token_id, torch.long
            )
            logprobs = right_pad([samples.logprobs[i] for i in batch], 0.0, torch.float32)
            lengths = torch.tensor([len(samples.completion_ids[i]) for i in batch])
            mask = (torch.arange(completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
            sequences = torch.cat([prompt_ids, completion_ids.to(device)], dim=1)
            attention_mask = torch.cat([prompt_mask, mask.to(device)], dim=1)
            values = value_fn(sequences, attention_mask, prompt_ids.shape[1])
            if tuple(values.shape) != tuple(mask.shape):
                raise ValueError(
                    f"`value_fn` returned shape {tuple(values.shape)}; expected (B, T) = {tuple(mask.shape)}."
                )
            values = values.detach().float().cpu()
            rewards = torch.zeros(mask.shape, dtype=torch.float32)
            rewards[torch.arange(len(batch)), lengths - 1] = torch.tensor(
                [outcome[i] for i in batch], dtype=torch.float32
            )
            advantages = estimator_advantages(
                rewards, values, mask, logprobs, lam_grid, p_grid, sae_lam, adaptive_lambda_alpha
            )
            labels = list(advantages)
            for b, i in enumerate(batch):
                for k in spans_of[i]:
                    record = records[k]
                    width = record.end - record.start
                    a_star_chunks.append(np.full(width, record.a_star))
                    span_id_chunks.append(np.full(width, k, dtype=np.int64))
                    for key, adv in advantages.items():
                        token_chunks.setdefault(f"{key[0]}({key[1]})", []).append(
                            adv[b, record.start : record.end].double().numpy()
                        )

    if not records:
        raise RuntimeError("No span could be analysed (no trajectory with a non-None reward and a valid V*).")
    a_star = np.concatenate(a_star_chunks)
    span_ids = np.concatenate(span_id_chunks)
    estimates = {label: np.concatenate(chunks) for label, chunks in token_chunks.items()}

    # 5. Pearson r with A* and a span-level bootstrap (same seed: every estimator sees the same resamples).
    table = []
    for estimator, setting in labels:
        stats = pearson_with_bootstrap(
            estimates[f"{estimator}({setting})"], a_star, span_ids, num_bootstrap, seed, confidence
        )
        table.append(
            CorrelationRow(estimator, setting, *stats, n_tokens=int(a_star.shape[0]), n_spans=len(records))
        )
    return CorrelationResult(
        rows=table,
        a_star=a_star,
        estimates=estimates,
        span_ids=span_ids,
        spans=records,
        trajectory_rewards=outcome,
        config=run_config,
    )
