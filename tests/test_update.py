"""The update part (:class:`~trl_sae.trainer.parts.update.PPOUpdate`) as a trainer subclass swaps it: its loss
reaches the weights. (An override of a trainer method that moved into it is refused: tests/test_moved_api.py.)"""

from __future__ import annotations

import torch

from tests.test_loss_aggregation import fixed_batch, split_trainer, update_delta
from trl_sae import SAEPPOTrainer
from trl_sae.trainer.parts.update import PPOUpdate

TILT = 0.25


class TiltedUpdate(PPOUpdate):
    """The PPO update plus ``TILT x sum(final norm weight)`` in every micro-batch's loss."""

    def loss(self, batch, index, train_actor, with_critic=True, denominator=None):
        loss, stats = super().loss(batch, index, train_actor, with_critic, denominator)
        tilt = TILT * self.accelerator.unwrap_model(self.model).policy.model.norm.weight.sum()
        return loss + tilt, {**stats, "loss/tilt": tilt.detach()}


class TiltedTrainer(SAEPPOTrainer):
    def _build_ppo_update(self) -> PPOUpdate:
        return TiltedUpdate(self.accelerator, self.model, self.optimizer, self.args)


def test_a_trainer_subclass_swaps_in_an_update_part_whose_extra_loss_term_moves_the_weights(
    tmp_path, tokenizer
):
    plain = split_trainer(str(tmp_path / "plain"), tokenizer, rows=8)
    tilted = split_trainer(str(tmp_path / "tilted"), tokenizer, rows=8, cls=TiltedTrainer)
    assert type(tilted.ppo_update) is TiltedUpdate
    norm = tilted.accelerator.unwrap_model(tilted.model).policy.model.norm.weight
    is_norm = torch.cat(
        [
            torch.full((p.numel(),), p is norm)
            for p in tilted.accelerator.unwrap_model(tilted.model).parameters()
            if p.requires_grad
        ]
    )
    extra = update_delta(tilted, fixed_batch(tilted)) - update_delta(plain, fixed_batch(plain))
    # One micro-batch, SGD at lr 1 without clipping: the term's gradient is TILT on each entry of the norm
    # weight and 0 elsewhere, so only the norm weight moves further, by -TILT.
    assert int(is_norm.sum()) == norm.numel() > 0
    torch.testing.assert_close(extra[is_norm], torch.full((norm.numel(),), -TILT), atol=1e-5, rtol=0)
    torch.testing.assert_close(extra[~is_norm], torch.zeros(int((~is_norm).sum())), atol=1e-6, rtol=0)
