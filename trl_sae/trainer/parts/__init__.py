"""The parts of a PPO step a subclass swaps whole: :class:`~.rollout.Rollouts` (prompts -> a scored
:class:`~trl_sae.trainer.rollout_batch.RolloutBatch`) and :class:`~.update.PPOUpdate` (the batch -> optimizer steps), with
evaluation (:mod:`.evaluation`, sampling through the rollout part) and the step's metrics (:mod:`.metrics`)."""

# A namespace for its modules: import names from them (the modules above), so none is exported twice.
__all__: list[str] = []
