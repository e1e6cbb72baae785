"""The rollout part (:class:`trl_sae.trainer.parts.rollout.Rollouts`) is a seam: a trainer subclass swaps it through
``_build_rollouts``, and training and evaluation both sample and score through the swapped part."""

from __future__ import annotations

import pytest
import torch

from tests.test_trainer import make_config, make_dataset, vowel_fraction
from trl_sae import SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.trainer.parts.rollout import Rollouts

BONUS = 0.25


class BonusRollouts(Rollouts):
    """Adds BONUS to every completion's score (what a trainer subclass's ``_score`` override used to do)."""

    def score(self, batch, synchronize=False):
        super().score(batch, synchronize)
        batch.scores = batch.scores + BONUS
        self.scored = [*getattr(self, "scored", []), batch]


class BonusTrainer(SAEPPOTrainer):
    def _build_rollouts(self, cls=BonusRollouts):
        return super()._build_rollouts(cls)


def test_a_trainer_subclass_swaps_the_rollout_part_for_training_and_evaluation(tmp_path, tokenizer):
    trainer = BonusTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, max_steps=1),
        train_dataset=make_dataset(),
        eval_dataset=make_dataset(4),
        processing_class=tokenizer,
    )
    assert type(trainer.rollouts) is BonusRollouts
    trainer.rollouts.weights_stale = False
    trainer.train()
    (log,) = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    (step_batch,) = trainer.rollouts.scored
    # The logged reward is the part's score (bonus included); the per-function mean is the plain reward.
    assert log["reward/mean"] == pytest.approx(log["reward/vowel_fraction/mean"] + BONUS, abs=1e-6)
    assert step_batch.scores.tolist() == pytest.approx((step_batch.task_scores + BONUS).tolist(), abs=1e-6)
    # The update marked the policy's new weights for the sampler (mark_weights_stale).
    assert trainer.rollouts.weights_stale

    metrics = trainer.evaluate()
    eval_batch = trainer.rollouts.scored[-1]
    assert len(trainer.rollouts.scored) == 2 and len(eval_batch.completions) == 4  # one per eval prompt
    expected = torch.tensor(vowel_fraction(None, eval_batch.completions, None)).mean().item() + BONUS
    assert metrics["eval/reward/mean"] == pytest.approx(expected, abs=1e-6)
