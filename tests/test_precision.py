"""Mixed precision: every forward of the policy runs at the update's precision (so the first PPO ratio is 1)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import trl_sae.trainer.sae_ppo_trainer as trainer_module
from trl_sae.demo.tiny import build_tiny_qwen3

from .test_trainer import make_dataset, make_trainer


def count_output_dtypes(module: torch.nn.Module) -> Counter:
    counts: Counter = Counter()
    module.register_forward_hook(lambda _module, _inputs, output: counts.update([output.dtype]))
    return counts


def record_log_ratios(monkeypatch) -> list[torch.Tensor]:
    """|log r| on the valid tokens of every clipped_policy_loss call, in order."""
    ratios: list[torch.Tensor] = []
    original = trainer_module.clipped_policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        ratios.append((logprobs - old_logprobs)[mask].detach().abs())
        return original(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "clipped_policy_loss", recording)
    return ratios


@pytest.mark.parametrize(
    ("weights_dtype", "bf16"),
    [(torch.float32, True), (torch.bfloat16, False)],
    ids=["bf16-autocast-float32-weights", "bfloat16-weights"],
)
def test_every_policy_forward_runs_at_the_update_precision_and_the_first_ratio_is_one(
    tmp_path, tokenizer, monkeypatch, weights_dtype, bf16
):
    # Micro-batches of 4 rows in the update against a rollout forward over all 8: the old log-probs must
    # not depend on how rows are grouped. kl_coef > 0 adds the reference pass; eval_dataset the evaluation.
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        model=build_tiny_qwen3(tokenizer, seed=0).to(weights_dtype),
        max_steps=1,
        bf16=bf16,
        num_ppo_epochs=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        kl_coef=0.1,
    )
    trainer.eval_dataset = trainer._prepare_prompt_dataset(make_dataset(n=4), "eval_dataset")
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    policy_dtypes = count_output_dtypes(unwrapped.policy.model.layers[0].mlp)
    reference_dtypes = count_output_dtypes(trainer.ref_model.model.layers[0].mlp)
    critic_dtypes = count_output_dtypes(unwrapped.critic.model.layers[0].mlp)
    ratios = record_log_ratios(monkeypatch)
    trainer.train()
    trainer.evaluate()
    # generation (1 prompt + 8 new tokens), the old-log-prob recompute, 2 update micro-batches, evaluation
    assert sum(policy_dtypes.values()) >= 12
    assert policy_dtypes == Counter({torch.bfloat16: sum(policy_dtypes.values())}), policy_dtypes
    assert set(reference_dtypes) == {torch.bfloat16}, reference_dtypes
    assert set(critic_dtypes) == {torch.bfloat16}, critic_dtypes
    assert next(unwrapped.policy.parameters()).dtype == weights_dtype  # autocast, not a cast of the weights
    # The first mini-batch's ratio is exactly the one a float32 run has: 1.
    assert len(ratios) == 2
    assert ratios[0].max().item() < 1e-6, f"first |log r| max {ratios[0].max().item():.3g}"
