"""The PPO update does not depend on how a mini-batch is split (micro-batches, token budget, processes).

One fixed :class:`RolloutBatch` with ragged prompt and completion lengths; each split must move the weights
exactly as one 8-row micro-batch does, to float32 rounding, in every ``loss_agg_mode``. Plain SGD without
clipping, so that a wrong loss scale (not only a wrong direction) shows in the parameters.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.generation.capture import forward_logprobs
from trl_sae.trainer.objectives.losses import LOSS_AGG_MODES
from trl_sae.trainer.rollout_batch import RolloutBatch
from trl_sae.trainer.sae_ppo_trainer import token_budget_micro_batches

PROMPT_LENGTHS = [3, 6, 4, 2, 5, 3, 6, 4]
COMPLETION_LENGTHS = [12, 1, 2, 12, 3, 1, 2, 5]  # most short, a few at response_length


def split_trainer(output_dir: str, tokenizer, rows: int, cls: type = SAEPPOTrainer) -> SAEPPOTrainer:
    """A ``cls`` trainer whose one mini-batch is ``rows`` completions on each process, with SGD and no
    clipping."""
    config = SAEPPOConfig(
        output_dir=output_dir, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=2, response_length=12, num_ppo_epochs=1, num_mini_batches=1, max_grad_norm=0.0,
        entropy_coef=0.01, vf_coef=0.5, report_to="none", disable_tqdm=True, save_strategy="no",
        use_cpu=True, seed=0, stop_token=None,
    )  # fmt: skip
    trainer = cls(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=lambda prompts, completions, completion_ids, **kw: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]}),
        processing_class=tokenizer,
    )
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    trainer.optimizer.optimizer = torch.optim.SGD(
        [p for p in unwrapped.parameters() if p.requires_grad], lr=1.0
    )
    return trainer


def fixed_batch(trainer: SAEPPOTrainer, rows: slice = slice(None)) -> RolloutBatch:
    """The same 8 rollouts on every process (``rows`` picks this process's share)."""
    generator = torch.Generator().manual_seed(1)
    num, prompt_width, width = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), 12
    prompt_mask = torch.tensor([[0] * (prompt_width - n) + [1] * n for n in PROMPT_LENGTHS])
    completion_mask = torch.tensor([[1] * n + [0] * (width - n) for n in COMPLETION_LENGTHS])
    pad = trainer.processing_class.pad_token_id
    prompt_ids = torch.where(
        prompt_mask.bool(), torch.randint(5, 40, (num, prompt_width), generator=generator), pad
    )
    completion_ids = torch.where(
        completion_mask.bool(), torch.randint(5, 40, (num, width), generator=generator), pad
    )
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    with torch.no_grad():
        logprobs, _ = forward_logprobs(
            policy, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0
        )
    valid = completion_mask.bool()

    def noise(scale: float) -> torch.Tensor:
        return torch.where(valid, scale * torch.randn(num, width, generator=generator), torch.zeros(()))

    batch = RolloutBatch(
        prompts=[""] * num, columns={}, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=completion_ids, completion_mask=completion_mask,
        logprobs=torch.where(valid, logprobs, torch.zeros(())) + noise(0.05),
        entropies=torch.zeros(num, width), is_truncated=torch.zeros(num, dtype=torch.bool),
    )  # fmt: skip
    batch.advantages, batch.values, batch.returns = noise(1.0), noise(0.1), noise(1.0)
    fields = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "entropies")
    for name in (*fields, "is_truncated", "advantages", "values", "returns"):
        setattr(batch, name, getattr(batch, name)[rows])
    return batch


def update_delta(trainer: SAEPPOTrainer, batch: RolloutBatch, **settings) -> torch.Tensor:
    """All trainable parameters' change from one ``ppo_update.run`` with ``settings`` (then put back)."""
    parameters = [p for p in trainer.accelerator.unwrap_model(trainer.model).parameters() if p.requires_grad]
    before = [p.detach().clone() for p in parameters]
    saved = {name: getattr(trainer.args, name) for name in settings}
    for name, value in settings.items():
        setattr(trainer.args, name, value)
    torch.manual_seed(0)
    try:
        trainer.ppo_update.run(batch, trainer.state.global_step)
    finally:
        for name, value in saved.items():
            setattr(trainer.args, name, value)
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(parameters, before)])
    with torch.no_grad():
        for p, b in zip(parameters, before):
            p.copy_(b)
    return delta


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_token_budget_groups_rows_by_length():
    prompts = torch.tensor(PROMPT_LENGTHS)
    completions = torch.tensor(COMPLETION_LENGTHS)
    groups = token_budget_micro_batches(prompts, completions, max_tokens=30)
    assert sorted(torch.cat(groups).tolist()) == list(range(8))
    for group in groups:
        cost = len(group) * int(prompts[group].max() + completions[group].max())
        assert cost <= 30 or len(group) == 1
    # longest completions first: 2 x (3 + 12) = 30 fits; a third row would cost 3 x (4 + 12) = 48, and so on
    assert [g.tolist() for g in groups] == [[0, 3], [7, 4], [6, 2, 1], [5]]
    # a budget below one row still makes progress: every row alone
    assert len(token_budget_micro_batches(prompts, completions, max_tokens=1)) == 8


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_update_is_the_same_however_the_mini_batch_is_split(tmp_path, tokenizer, mode):
    trainer = split_trainer(str(tmp_path), tokenizer, rows=8)
    batch = fixed_batch(trainer)
    whole = update_delta(trainer, batch, loss_agg_mode=mode)
    assert whole.abs().max() > 1e-3  # the update moves the weights
    rows = update_delta(trainer, batch, loss_agg_mode=mode, per_device_train_batch_size=1)
    budget = update_delta(trainer, batch, loss_agg_mode=mode, max_tokens_per_microbatch=40)
    assert relative_difference(rows, whole) < 1e-5
    assert relative_difference(budget, whole) < 1e-5
    # and the modes differ from one another on this ragged batch
    if mode != "token-mean":
        assert relative_difference(update_delta(trainer, batch), whole) > 1e-2


def test_one_optimizer_step_per_mini_batch(tmp_path, tokenizer, monkeypatch):
    # 8 rollouts in 2 mini-batches of 4, each split by a token budget into a different number of
    # micro-batches: 2 optimizer steps, whatever the micro-batch count (accelerate's gradient accumulation
    # would count gradient_accumulation_steps micro-batches instead).
    trainer = split_trainer(str(tmp_path), tokenizer, rows=8)
    batch = fixed_batch(trainer)
    steps = []
    sgd = trainer.optimizer.optimizer
    monkeypatch.setattr(sgd, "step", lambda *a, **kw: steps.append(1) or torch.optim.SGD.step(sgd, *a, **kw))
    monkeypatch.setattr(trainer.args, "local_mini_batch_size", 4)
    update_delta(trainer, batch, max_tokens_per_microbatch=20)
    assert len(steps) == 2
    update_delta(trainer, batch, per_device_train_batch_size=1)
    assert len(steps) == 4
