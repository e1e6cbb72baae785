"""Why the critic learns nothing on the long-horizon walk task (issue 22, part 1).

The long-horizon sweep (``long_horizon.py``) ended with critic explained variance ~0 for every estimator,
even after a value warm-up. On the walk task a failed walk is visible in its own text (a door equal to the
room one stands in), so a working critic must at least learn that the value after the first violation is 0.
This script separates "the critic cannot represent it" from "the trainer's update starves it":

1. **Rollouts**: ``--train-rollouts`` + ``--test-rollouts`` completions sampled from the warm start (the
   trainer's own ``rollouts.sample`` and ``rollouts.score``, at the rollout temperature) with their outcomes, and for each
   completion the token index of its first violation (parsed from the text: a door equal to the current
   room).
2. **Ceiling**: a task-aware predictor fitted on the training rollouts: 0 after the first violation, else
   the empirical success rate given the number of decisions still ahead. The explained variance a critic
   that has learned the rule could reach.
3. **Offline regression** on the Monte-Carlo returns (``critic_lam = 1``, ``gamma = 1``: the trainer's
   returns), many epochs, for: the critic exactly as the trainer builds it (policy backbone copy, zero score
   head, float32, the clipped value loss with old values refreshed each epoch, AdamW, the critic group's
   gradient clipping), a linear probe (ridge) on the frozen warm-start hidden states, and a randomly
   initialised critic of the same shape.
4. **Online**: the trainer's own ``_compute_values`` / ``_compute_advantages`` / ``ppo_update`` (critic only,
   as a value warm-up) over the same training rollouts, in batches of one PPO step, with one setting changed
   at a time; explained variance on the held-out rollouts after the pass.

Explained variance is reported over every valid held-out token, and separately on the tokens before
(value not yet able to know) and after (value should be 0) the first violation.

Outputs (``--output-dir``, default ``benchmarks/results/critic_diagnosis/``): ``results.json``,
``critic_diagnosis.png``, ``command.txt``. ``--smoke`` runs every stage on tiny sizes in seconds (not a
result).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import long_horizon as lh
import torch

_SCRIPT = "benchmarks/critic_diagnosis.py"
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results" / "critic_diagnosis"
STAGES = ("probe", "offline", "offline-ceiling", "offline-position", "online")


@dataclass
class DiagnosisSettings:
    """What the diagnosis runs; saved with the results."""

    task: lh.Settings = field(default_factory=lh.Settings)
    filler_length: int = 8
    train_rollouts: int = 1024
    test_rollouts: int = 512
    rollout_batch: int = 64  # completions per trainer step (the sweep's 8 prompts x 8 generations)
    offline_epochs: int = 12
    offline_batch: int = 32  # completions per optimizer step
    offline_learning_rates: tuple[float, ...] = (1e-5, 3e-4, 3e-3)
    offline_train_limit: int | None = None  # fit offline on only the first K training rollouts (more epochs)
    probe_ridge: float = 1e-3
    # Online variants: trainer settings changed one at a time from the long-horizon sweep's
    # (critic lr 3e-3, 2 PPO epochs x 2 mini-batches); "config default" is SAEPPOConfig's own.
    online_variants: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "sweep (lr 3e-3, 2x2, clip 0.2, vf 0.1)": {},
            "config defaults (lr 1e-5, 4 epochs x 1)": {
                "critic_learning_rate": 1e-5,
                "num_ppo_epochs": 4,
                "num_mini_batches": 1,
            },
            "cliprange_value 1e6 (no value clip)": {"cliprange_value": 1e6},
            "critic lr 3e-4": {"critic_learning_rate": 3e-4},
            "max_grad_norm 0 (no clipping)": {"max_grad_norm": 0.0},
        }
    )
    seed: int = 0


def smoke_settings() -> DiagnosisSettings:
    """Every stage on tiny sizes (the long-horizon smoke model). Not a result."""
    task = lh.smoke_settings()
    return DiagnosisSettings(
        task=task,
        filler_length=task.filler_lengths[0],
        train_rollouts=8,
        test_rollouts=8,
        rollout_batch=4,
        offline_epochs=2,
        offline_batch=4,
        offline_learning_rates=(3e-3,),
        online_variants={"sweep": {}, "no value clip": {"cliprange_value": 1e6}},
    )


# --------------------------------------------------------------------------------------------------
# Rollouts
# --------------------------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """Sampled completions of the warm start. Shapes: ``N`` completions, ``P`` prompt, ``T`` completion."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T)
    scores: torch.Tensor  # (N,) outcome
    first_violation: torch.Tensor  # (N,) token index of the first door equal to the current room, -1 if none
    remaining: torch.Tensor  # (N, T) decisions at or after position t (the ones the value cannot know yet)

    @property
    def mask(self) -> torch.Tensor:
        return self.completion_mask.bool()

    def returns(self) -> torch.Tensor:
        """``(N, T)`` Monte-Carlo returns (gamma = 1, outcome at the last token): the score on every valid token."""
        return self.scores[:, None] * self.completion_mask.float()

    def after_violation(self) -> torch.Tensor:
        """``(N, T)`` bool: the value of position t reads the violating door (t > first violation)."""
        positions = torch.arange(self.completion_ids.shape[1])[None]
        return self.mask & (self.first_violation[:, None] >= 0) & (positions > self.first_violation[:, None])

    def select(self, rows: torch.Tensor | slice) -> Rollouts:
        return Rollouts(*(getattr(self, name)[rows] for name in self.__dataclass_fields__))


def violation_and_decisions(
    tokenizer: Any, prompt: str, completion_ids: Sequence[int]
) -> tuple[int, list[int]]:
    """The token index of the first violation (-1 if none) and every decision's token index.

    The walk starts in the prompt's room; each decision's door becomes the current room (the reward's rule).
    """
    from trl_sae.demo.decision_task import decision_token_positions

    start = prompt.split(" from ")[1].split()[0]
    decisions = decision_token_positions(tokenizer, completion_ids)
    room, first = start, -1
    for position in decisions:
        door = tokenizer.decode([int(completion_ids[position])])
        if door == room and first < 0:
            first = position
        room = door
    return first, decisions


def prompt_text(prompt: Any) -> str:
    """The user's request of a chat or plain prompt."""
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def collect_rollouts(trainer: Any, num: int) -> Rollouts:
    """``num`` completions sampled by the trainer's own rollout (one trainer step's prompts per call)."""
    from trl_sae.generation.inputs import left_pad

    tokenizer = trainer.processing_class
    parts: list[Any] = []
    step = 0
    while sum(len(batch.completions) for batch in parts) < num:
        rows = [trainer.train_dataset[i] for i in trainer.rollouts.prompt_indices(step)]
        batch = trainer.rollouts.sample(trainer.rollouts.collate(rows))
        trainer.rollouts.score(batch)
        parts.append(batch)
        step += 1
    prompt_rows: list[torch.Tensor] = []
    completion_ids: list[torch.Tensor] = []
    remaining: list[torch.Tensor] = []
    scores: list[float] = []
    first: list[int] = []
    for batch in parts:
        for i in range(len(batch.completions)):
            prompt_rows.append(batch.prompt_ids[i][batch.prompt_mask[i].bool()])
            length = int(batch.completion_mask[i].sum())
            ids = batch.completion_ids[i, :length]
            completion_ids.append(ids)
            scores.append(float(batch.scores[i]))
            violation, decisions = violation_and_decisions(
                tokenizer, prompt_text(batch.prompts[i]), ids.tolist()
            )
            first.append(violation)
            positions = torch.arange(length)
            remaining.append((torch.tensor(decisions)[None] >= positions[:, None]).sum(dim=1))
    prompt_ids, prompt_mask = left_pad([p.tolist() for p in prompt_rows[:num]], tokenizer.pad_token_id)
    width = max(len(ids) for ids in completion_ids[:num])

    def right_pad(rows: list[torch.Tensor], fill: int) -> torch.Tensor:
        return torch.stack([torch.cat([r, r.new_full((width - len(r),), fill)]) for r in rows])

    completion_ids_t = right_pad(completion_ids[:num], tokenizer.pad_token_id)
    completion_mask_t = right_pad([torch.ones_like(r) for r in completion_ids[:num]], 0)
    return Rollouts(
        prompt_ids,
        prompt_mask,
        completion_ids_t,
        completion_mask_t,
        torch.tensor(scores[:num]),
        torch.tensor(first[:num]),
        right_pad(remaining[:num], 0),
    )


# --------------------------------------------------------------------------------------------------
# Explained variance
# --------------------------------------------------------------------------------------------------
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the tokens in ``mask`` (population variances, as the trainer's metric)."""
    r, v = returns[mask].double(), values[mask].double()
    if r.numel() == 0 or r.var(unbiased=False) < 1e-12:
        return math.nan
    return float(1.0 - (r - v).var(unbiased=False) / r.var(unbiased=False))


def ev_report(values: torch.Tensor, rollouts: Rollouts) -> dict[str, float]:
    """Explained variance over all valid tokens, before and after the first violation, and the mean value
    after it (0 for a critic that knows the rule)."""
    mask, after = rollouts.mask, rollouts.after_violation()
    returns = rollouts.returns()
    return {
        "ev_all": explained_variance(values, returns, mask),
        "ev_before_violation": explained_variance(values, returns, mask & ~after),
        "mean_value_after_violation": float(values[after].mean()) if after.any() else math.nan,
        "mean_value_success": float(values[mask & (rollouts.scores[:, None] > 0)].mean()),
        "mse_all": float(((values - returns)[mask] ** 2).mean()),
    }


def ceiling_values(train: Rollouts, test: Rollouts) -> torch.Tensor:
    """``(N, T)`` the task-aware predictor: 0 after the first violation, else the training rollouts' success
    rate among positions with as many decisions still ahead (and no violation yet)."""
    rate: dict[int, float] = {}
    before = train.mask & ~train.after_violation()
    for k in train.remaining[before].unique().tolist():
        chosen = before & (train.remaining == k)
        rate[k] = float(train.returns()[chosen].mean())
    fallback = float(train.scores.mean())
    values = test.remaining.clone().float().apply_(lambda k: rate.get(int(k), fallback))
    return torch.where(test.after_violation() | ~test.mask, torch.zeros(()), values)


# --------------------------------------------------------------------------------------------------
# Offline fits
# --------------------------------------------------------------------------------------------------
def over_completions(forward: Any, rollouts: Rollouts, batch: int = 64) -> torch.Tensor:
    """``forward(**sequence_inputs, num_completion_tokens=T)`` over the rollouts in batches, without gradients,
    concatenated along the first dimension."""
    from trl_sae.generation.inputs import sequence_inputs

    out = []
    with torch.no_grad():
        for start in range(0, len(rollouts.scores), batch):
            part = rollouts.select(slice(start, start + batch))
            inputs = sequence_inputs(
                part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask
            )
            out.append(forward(**inputs, num_completion_tokens=part.completion_ids.shape[1]))
    return torch.cat(out)


def critic_values(module: Any, rollouts: Rollouts, batch: int = 64) -> torch.Tensor:
    """``(N, T)`` values of ``module`` (a ``PolicyAndCritic``) on the rollouts, 0 on padding."""
    values = over_completions(module.critic_values, rollouts, batch)
    return torch.where(rollouts.mask, values, torch.zeros(()))


def fit_critic_offline(
    module: Any,
    train: Rollouts,
    test: Rollouts,
    learning_rate: float,
    epochs: int,
    batch: int,
    cliprange_value: float = 0.2,
    vf_coef: float = 0.1,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    targets: torch.Tensor | None = None,
    test_targets: torch.Tensor | None = None,
) -> list[dict[str, float]]:
    """Regression of ``module``'s critic on the Monte-Carlo returns with the trainer's loss and clipping.

    The clipped value loss (:func:`~trl_sae.trainer.objectives.losses.clipped_value_loss`, token-mean) with the old
    values refreshed at each epoch (as PPO refreshes them at each rollout), AdamW at ``learning_rate``
    (weight decay 0, the trainer's default), the critic parameters' norm clipped at ``max_grad_norm``.
    ``targets``: ``(N, T)`` regression targets instead of the Monte-Carlo returns (e.g. the noise-free
    ceiling values, to separate "cannot represent it" from "too noisy a signal"); the held-out report is
    always against the returns, plus ``ev_vs_targets`` against ``test_targets`` when given. Returns the
    held-out report after each epoch (epoch 0: before training).
    """

    def report(epoch: int) -> dict[str, float]:
        values = critic_values(module, test)
        entry = {"epoch": epoch, **ev_report(values, test)}
        if test_targets is not None:
            entry["ev_vs_targets"] = explained_variance(values, test_targets, test.mask)
        return entry

    from trl_sae.generation.inputs import sequence_inputs
    from trl_sae.trainer.objectives.losses import clipped_value_loss

    params = module.critic_parameters()
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    history = [report(0)]
    returns = train.returns() if targets is None else targets
    for epoch in range(1, epochs + 1):
        old_values = critic_values(module, train)
        for rows in torch.randperm(len(train.scores), generator=generator).split(batch):
            part = train.select(rows)
            width = int(part.completion_mask.sum(dim=1).max())
            inputs = sequence_inputs(
                part.prompt_ids,
                part.prompt_mask,
                part.completion_ids[:, :width],
                part.completion_mask[:, :width],
            )
            values = module.critic_values(**inputs, num_completion_tokens=width)
            loss = vf_coef * clipped_value_loss(
                values, old_values[rows, :width], returns[rows, :width], part.mask[:, :width], cliprange_value
            )
            optimizer.zero_grad()
            loss.backward()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
        history.append(report(epoch))
        print(f"    epoch {epoch}: {json.dumps(history[-1])}", flush=True)
    return history


def hidden_states(policy: Any, rollouts: Rollouts, batch: int = 64) -> torch.Tensor:
    """``(N, T, H)`` frozen last hidden states before each completion token (the critic's reading positions)."""
    from trl_sae.trainer.critics.policy_and_critic import _completion_states

    return over_completions(partial(_completion_states, policy), rollouts, batch)


def linear_probe(policy: Any, train: Rollouts, test: Rollouts, ridge: float) -> dict[str, float]:
    """Ridge regression of the returns on the frozen hidden states (with a bias), scored on ``test``."""
    features = hidden_states(policy, train)[train.mask].double()
    design = torch.cat([features, torch.ones(len(features), 1, dtype=features.dtype)], dim=1)
    target = train.returns()[train.mask].double()
    gram = design.T @ design + ridge * len(design) * torch.eye(design.shape[1], dtype=design.dtype)
    weights = torch.linalg.solve(gram, design.T @ target)
    test_states = hidden_states(policy, test).double()
    values = torch.cat([test_states, torch.ones(*test_states.shape[:2], 1, dtype=test_states.dtype)], dim=2)
    predicted = torch.where(test.mask, (values @ weights).float(), torch.zeros(()))
    train_pred = (design @ weights).float()
    return {
        **ev_report(predicted, test),
        "ev_train": explained_variance(train_pred, target.float(), torch.ones_like(target, dtype=torch.bool)),
    }


def layer_probes(policy: Any, train: Rollouts, test: Rollouts, ridge: float) -> list[dict[str, float]]:
    """Per layer of the frozen policy (0: embeddings), ridge regression of the noise-free ceiling values on
    the residual stream before each completion token: does any layer already carry "a door equalled its
    room"? Reports the held-out EV against the ceiling values (how much of the learnable part it holds)."""
    from trl_sae.generation.inputs import sequence_inputs

    def states(rollouts: Rollouts) -> list[torch.Tensor]:
        inputs = sequence_inputs(
            rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids, rollouts.completion_mask
        )
        width = rollouts.completion_ids.shape[1]
        layers: list[list[torch.Tensor]] = []
        with torch.no_grad():
            for start in range(0, len(rollouts.scores), 64):
                part = {key: value[start : start + 64] for key, value in inputs.items()}
                hidden = policy.model(**part, output_hidden_states=True, use_cache=False).hidden_states
                mask = rollouts.mask[start : start + 64]
                for index, layer in enumerate(hidden):
                    if len(layers) <= index:
                        layers.append([])
                    layers[index].append(layer[:, -width - 1 : -1][mask].double())
        return [torch.cat(chunks) for chunks in layers]

    train_target = ceiling_values(train, train)[train.mask].double()
    test_target = ceiling_values(train, test)[test.mask].double()
    report = []
    for index, (x, x_test) in enumerate(zip(states(train), states(test))):
        design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        gram = design.T @ design + ridge * len(design) * torch.eye(design.shape[1], dtype=design.dtype)
        weights = torch.linalg.solve(gram, design.T @ train_target)
        predicted = torch.cat([x_test, torch.ones(len(x_test), 1, dtype=x.dtype)], dim=1) @ weights
        everything = torch.ones_like(test_target, dtype=torch.bool)
        report.append(
            {"layer": index, "ev_vs_ceiling_targets": explained_variance(predicted, test_target, everything)}
        )
    return report


# --------------------------------------------------------------------------------------------------
# Online: the trainer's own update
# --------------------------------------------------------------------------------------------------
def build_trainer(
    warm_dir: Path, splits: Any, tokenizer: Any, settings: DiagnosisSettings, **overrides: Any
) -> Any:
    """An ``SAEPPOTrainer`` on the warm start with the long-horizon sweep's settings (SAE), critic only."""
    from transformers import AutoModelForCausalLM

    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.decision_task import walk_reward

    task = settings.task
    fields: dict[str, Any] = {
        "output_dir": tempfile.mkdtemp(prefix="critic_diagnosis_"),
        "per_device_train_batch_size": settings.rollout_batch,
        "num_generations": task.num_generations,
        "max_steps": 10**6,
        "value_warmup_steps": 10**6 - 1,  # critic only: the actor never moves
        "response_length": task.response_length(settings.filler_length),
        "temperature": task.temperature,
        "learning_rate": task.learning_rate,
        "critic_learning_rate": task.critic_learning_rate,
        "lr_scheduler_type": "constant",
        "num_ppo_epochs": task.num_ppo_epochs,
        "num_mini_batches": task.num_mini_batches,
        "segment_threshold": task.segment_threshold,
        "lam": task.lam,
        "seed": settings.seed,
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "use_cpu": True,
    }
    fields.update(overrides)
    trainer = SAEPPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(warm_dir),
        reward_funcs=walk_reward,
        args=SAEPPOConfig(**fields),
        train_dataset=splits["train"].remove_columns(["solution", "solution_is_correct"]),
        processing_class=tokenizer,
    )
    return trainer


def online_update(trainer: Any, train: Rollouts, test: Rollouts, batch: int) -> list[dict[str, float]]:
    """The trainer's critic-only steps over ``train`` in batches of ``batch`` completions (values, returns,
    ``ppo_update.run``); the held-out report after each step (step 0: before)."""
    from trl_sae.trainer.rollout_batch import RolloutBatch

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    history = [{"step": 0, **ev_report(critic_values(unwrapped, test), test)}]
    for step, start in enumerate(range(0, len(train.scores), batch), start=1):
        part = train.select(slice(start, start + batch))
        width = int(part.completion_mask.sum(dim=1).max())
        rollout = RolloutBatch(
            prompts=[""] * len(part.scores),
            columns={},
            prompt_ids=part.prompt_ids,
            prompt_mask=part.prompt_mask,
            completion_ids=part.completion_ids[:, :width],
            completion_mask=part.completion_mask[:, :width],
            logprobs=torch.zeros(len(part.scores), width),
            entropies=torch.zeros(len(part.scores), width),
            is_truncated=torch.zeros(len(part.scores), dtype=torch.bool),
            scores=part.scores,
        )
        trainer._compute_values(rollout)
        trainer._compute_boundaries(rollout)
        trainer._compute_advantages(rollout)
        stats = trainer.ppo_update.run(rollout, trainer.state.global_step)
        trainer.state.global_step += 1
        report = {"step": step, **ev_report(critic_values(unwrapped, test), test)}
        report["loss_value"] = float(stats.get("loss/value", torch.tensor(math.nan)))
        history.append(report)
    return history


def cached_rollouts(warm_dir: Path, splits: Any, tokenizer: Any, settings: DiagnosisSettings) -> Rollouts:
    """The warm start's rollouts, sampled once per (warm start, count, batch, seed) and kept next to it, so
    the offline and online stages can run as separate processes on the same data."""
    num = settings.train_rollouts + settings.test_rollouts
    path = warm_dir / f"diagnosis_rollouts-n{num}-b{settings.rollout_batch}-seed{settings.seed}.pt"
    if path.exists():
        return Rollouts(**torch.load(path))
    sampler = build_trainer(warm_dir, splits, tokenizer, settings)
    rollouts = collect_rollouts(sampler, num)
    torch.save({name: getattr(rollouts, name) for name in Rollouts.__dataclass_fields__}, path)
    return rollouts


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------
def run(settings: DiagnosisSettings, warm_root: Path, stages: Sequence[str]) -> dict[str, Any]:
    """Every stage in ``stages`` (rollouts and the ceiling always run); returns the results."""
    from transformers import AutoModelForCausalLM

    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
    from trl_sae.trainer.critics.build import build_critic_from_policy
    from trl_sae.trainer.critics.policy_and_critic import PolicyAndCritic

    torch.manual_seed(settings.seed)
    task, f = settings.task, settings.filler_length
    tokenizer = build_char_tokenizer()
    splits = lh.make_splits(task, f)
    warm_dir, warm = lh.build_warm_start(task, f, splits, tokenizer, warm_root)
    print(f"warm start {warm_dir} (reused: {warm['reused']})", flush=True)
    results: dict[str, Any] = {"warm_start": str(warm_dir)}

    start = time.perf_counter()
    rollouts = cached_rollouts(warm_dir, splits, tokenizer, settings)
    train = rollouts.select(slice(0, settings.train_rollouts))
    test = rollouts.select(slice(settings.train_rollouts, None))
    offline_train = train.select(slice(0, settings.offline_train_limit))
    after = test.after_violation()
    results["rollouts"] = {
        "train": settings.train_rollouts,
        "test": settings.test_rollouts,
        "success_rate": float(rollouts.scores.mean()),
        "violated_share": float((rollouts.first_violation >= 0).float().mean()),
        "failed_without_violation_share": float(
            ((rollouts.first_violation < 0) & (rollouts.scores == 0)).float().mean()
        ),
        "test_tokens": int(test.mask.sum()),
        "test_tokens_after_violation_share": float(after.sum() / test.mask.sum()),
        "seconds": time.perf_counter() - start,
    }
    print(f"rollouts: {json.dumps(results['rollouts'])}", flush=True)
    results["ceiling"] = ev_report(ceiling_values(train, test), test)
    results["constant_train_mean"] = ev_report(
        torch.where(test.mask, train.scores.mean(), torch.zeros(())), test
    )
    print(f"ceiling: {json.dumps(results['ceiling'])}", flush=True)

    if "probe" in stages:
        policy = AutoModelForCausalLM.from_pretrained(warm_dir)
        results["linear_probe"] = linear_probe(policy, train, test, settings.probe_ridge)
        print(f"linear probe: {json.dumps(results['linear_probe'])}", flush=True)
        results["layer_probes"] = layer_probes(policy, train, test, settings.probe_ridge)
        print(f"layer probes (ceiling targets): {json.dumps(results['layer_probes'])}", flush=True)

    def fit(name: str, module: Any, lr: float, **targets: Any) -> None:
        """One offline fit of ``module``'s critic, kept under ``results["offline"][name]`` with its wall time."""
        print(f"offline, {name}", flush=True)
        t0 = time.perf_counter()
        epochs, batch = settings.offline_epochs, settings.offline_batch
        history = fit_critic_offline(
            module, offline_train, test, lr, epochs, batch, seed=settings.seed, **targets
        )
        results.setdefault("offline", {})[name] = {"history": history, "seconds": time.perf_counter() - t0}

    def warm_critic() -> Any:
        policy = AutoModelForCausalLM.from_pretrained(warm_dir)
        return PolicyAndCritic(policy, build_critic_from_policy(policy))

    lr = max(settings.offline_learning_rates)
    if "offline" in stages:
        for each_lr in settings.offline_learning_rates:
            fit(f"warm critic lr {each_lr:g}", warm_critic(), each_lr)
        fresh = build_tiny_qwen3(
            tokenizer,
            hidden_size=task.hidden_size,
            num_layers=task.num_layers,
            num_heads=task.num_heads,
            seed=1,
        )
        fit(f"fresh critic lr {lr:g}", PolicyAndCritic(fresh, build_critic_from_policy(fresh)), lr)

    if "offline-ceiling" in stages:
        # The same warm-start critic regressed on the noise-free ceiling values of the training rollouts: if
        # it learns these but not the 0/1 returns, the returns are too noisy a signal at this sample size.
        ceiling = {
            "targets": ceiling_values(train, offline_train),
            "test_targets": ceiling_values(train, test),
        }
        fit(f"warm critic lr {lr:g}, ceiling targets", warm_critic(), lr, **ceiling)

    if "offline-position" in stages:
        # Control: the same critic and loop on a target the frozen policy already holds (the share of decisions
        # still ahead, linearly decodable from its hidden states): the fitting machinery itself works if this
        # is learned.
        def position(rollouts: Rollouts) -> torch.Tensor:
            return rollouts.remaining.float() / task.num_decisions * rollouts.completion_mask

        control = {"targets": position(offline_train), "test_targets": position(test)}
        fit(f"warm critic lr {lr:g}, position control target", warm_critic(), lr, **control)

    if "online" in stages:
        results["online"] = {}
        for name, overrides in settings.online_variants.items():
            t0 = time.perf_counter()
            trainer = build_trainer(warm_dir, splits, tokenizer, settings, **overrides)
            history = online_update(trainer, train, test, settings.rollout_batch)
            results["online"][name] = {
                "overrides": overrides,
                "history": history,
                "seconds": time.perf_counter() - t0,
            }
            print(f"online [{name}]: {json.dumps(history[-1])}", flush=True)
    return results


def _nan(value: Any) -> Any:
    """``value`` with JSON nulls back as NaN (the inverse of ``common.finite``, for plotting)."""
    if value is None:
        return math.nan
    if isinstance(value, dict):
        return {key: _nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_nan(item) for item in value]
    return value


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out explained variance per epoch (offline) and per step (online), with the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (key, xkey, title)
        for key, xkey, title in (
            ("offline", "epoch", "offline regression (epochs over the training rollouts)"),
            ("online", "step", "trainer's _update, critic only (steps of 64 completions)"),
        )
        if results.get(key)
    ] or [("offline", "epoch", "nothing fitted")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 1, 4.5), squeeze=False)
    for ax, (key, xkey, title) in zip(axes[0], panels):
        for name, entry in results.get(key, {}).items():
            history = entry["history"]
            # A fit on another target (the position control) is drawn against that target, dashed.
            own = any(h.get("ev_vs_targets") is not None for h in history[1:]) and "control" in name
            ys = [h.get("ev_vs_targets") if own else h["ev_all"] for h in history]
            ys = [math.nan if y is None else y for y in ys]
            label = f"{name} (EV vs its own target)" if own else name
            ax.plot([h[xkey] for h in history], ys, marker="o", ms=3, ls="--" if own else "-", label=label)
        ax.axhline(results["ceiling"]["ev_all"], color="k", ls="--", lw=1, label="task-aware ceiling")
        if "linear_probe" in results:
            ax.axhline(results["linear_probe"]["ev_all"], color="grey", ls=":", lw=1, label="linear probe")
        ax.axhline(0.0, color="k", lw=0.5)
        ax.set_xlabel(xkey)
        ax.set_ylabel("held-out explained variance")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def combine(directories: Sequence[Path], output_dir: Path) -> dict[str, Any]:
    """One ``results.json`` and plot from the stages' output directories (run separately on the same cached
    rollouts): their offline and online fits side by side, the ceiling and probes from the first that has them."""
    merged: dict[str, Any] = {"offline": {}, "online": {}, "stages": {}}
    for directory in directories:
        part = json.loads((directory / "results.json").read_text())
        merged["stages"][directory.name] = part["command"]
        for key in ("offline", "online"):
            merged[key].update(part.get(key, {}))
        for key in (
            "rollouts",
            "ceiling",
            "constant_train_mean",
            "linear_probe",
            "layer_probes",
            "warm_start",
        ):
            if key in part and key not in merged:
                merged[key] = part[key]
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(merged, indent=2) + "\n")
    plot(_nan(merged), output_dir / "critic_diagnosis.png")
    return merged


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every stage on tiny sizes (not a result)")
    parser.add_argument("--filler-length", type=int, default=8)
    parser.add_argument("--train-rollouts", type=int, default=None)
    parser.add_argument("--test-rollouts", type=int, default=None)
    parser.add_argument("--offline-epochs", type=int, default=None)
    parser.add_argument("--offline-learning-rates", type=float, nargs="+", default=None)
    parser.add_argument("--offline-train-limit", type=int, default=None)
    parser.add_argument("--offline-batch", type=int, default=None)
    parser.add_argument(
        "--stages",
        nargs="+",
        default=list(STAGES),
        choices=STAGES,
    )
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument(
        "--warm-start-dir", type=Path, default=Path.home() / ".cache" / "trl-sae" / "long_horizon"
    )
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="merge these stage output directories into --output-dir (results.json + plot); runs nothing",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine, args.output_dir)
    settings = smoke_settings() if args.smoke else DiagnosisSettings(filler_length=args.filler_length)
    for name in (
        "train_rollouts",
        "test_rollouts",
        "offline_epochs",
        "offline_learning_rates",
        "offline_train_limit",
        "offline_batch",
    ):
        if getattr(args, name) is not None:
            settings = replace(
                settings,
                **{name: tuple(getattr(args, name)) if name.endswith("rates") else getattr(args, name)},
            )
    command = common.command_line(argv, _SCRIPT)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "command.txt").write_text(command + "\n")
    start = time.perf_counter()
    with common.quiet_libraries(), common.torch_threads(args.num_threads):
        results = run(settings, args.warm_start_dir, args.stages)
    results["settings"] = json.loads(json.dumps(asdict(settings), default=str))
    results["command"] = command
    results["environment"] = common.environment()
    results["seconds"] = time.perf_counter() - start
    (args.output_dir / "results.json").write_text(json.dumps(common.finite(results), indent=2) + "\n")
    plot(results, args.output_dir / "critic_diagnosis.png")
    print(f"wrote {args.output_dir} in {results['seconds']:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
