"""Evaluation during training: the mean reward of one sampled completion per eval prompt.

:meth:`SAEPPOTrainer.evaluate <trl_sae.SAEPPOTrainer.evaluate>` calls :func:`evaluate_policy`, which samples
and scores with the trainer's own step phases (``_collate_prompts``, ``_rollout``, ``_score``), so evaluation
sees exactly the sampling and rewards that training does.

Several processes split the prompts, and every batch they sample is collective under FSDP2, DeepSpeed
ZeRO-3 (``generate`` with ``synced_gpus``: every forward gathers parameters) and a vLLM server (the prompts
of all processes are gathered): each process must run as many batches, of as many rows, as every other, or
the ones left waiting abort (gloo: "collective mismatch") or hang. :func:`eval_batches` pads them with
repeated prompts, and the padding is dropped before the metrics.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from accelerate.utils import gather_object
from datasets import Dataset

if TYPE_CHECKING:
    from trl_sae.trainer.sae_ppo_trainer import SAEPPOTrainer

__all__ = ["EvalBatch", "eval_batches", "evaluate_policy"]


class EvalBatch(NamedTuple):
    """Dataset rows one process samples in one call; only the first ``num_real`` count (the rest is padding)."""

    rows: list[int]
    num_real: int


def eval_batches(
    num_prompts: int, process_index: int, num_processes: int, batch_size: int
) -> list[EvalBatch]:
    """The batches of eval prompts that process ``process_index`` samples.

    Process ``p`` takes rows ``p, p + num_processes, ...``. With several processes every process gets the same
    number of batches of the same size, ``min(batch_size, ceil(num_prompts / num_processes))``, the last ones
    filled with copies of one of its rows (row 0 for a process with none); one process is never padded.

    Args:
        num_prompts: the eval dataset's rows, >= 1.
        process_index: this process, ``0 <= process_index < num_processes``.
        num_processes: the number of processes.
        batch_size: rows per sampling call (``per_device_eval_batch_size``), >= 1.

    Returns:
        The batches in order; the real rows of all processes cover ``range(num_prompts)`` once.
    """
    real = list(range(process_index, num_prompts, num_processes))
    if num_processes == 1:
        chunks = [real[start : start + batch_size] for start in range(0, len(real), batch_size)]
        return [EvalBatch(chunk, len(chunk)) for chunk in chunks]
    per_process = math.ceil(num_prompts / num_processes)  # the most rows any process has
    size = min(batch_size, per_process)
    padded = real + [real[0] if real else 0] * (math.ceil(per_process / size) * size - len(real))
    return [
        EvalBatch(padded[start : start + size], max(0, min(size, len(real) - start)))
        for start in range(0, len(padded), size)
    ]


def evaluate_policy(trainer: SAEPPOTrainer, dataset: Dataset) -> dict[str, float]:
    """``{"eval/reward/mean": ...}``: the mean reward over ``dataset``'s prompts, one sample each at the training
    temperature, gathered from every process (the same value on each).

    Args:
        trainer: supplies the sampling and scoring phases, the config and the accelerator.
        dataset: a prepared prompt dataset (``input_ids``, ``prompt`` and the reward functions' columns).
    """
    accelerator = trainer.accelerator
    batches = eval_batches(
        len(dataset),
        accelerator.process_index,
        accelerator.num_processes,
        max(1, trainer.args.per_device_eval_batch_size),
    )
    scored: list[tuple[int, float]] = []
    saved_generations = trainer.args.num_generations
    trainer.args.num_generations = 1
    try:
        for number, batch_rows in enumerate(batches):
            prompts = trainer._collate_prompts([dataset[i] for i in batch_rows.rows])
            # vLLM: evaluation batches sample from their own seed stream, never a training step's noise.
            prompts["vllm_seed_stream"] = ("eval", number)
            batch = trainer._rollout(prompts, recompute_logprobs=False)  # only the completions are read
            # Every process scores every batch, so they can agree on a reward failure (instead of the others
            # waiting for it in the next batch's collectives).
            trainer._score(batch, synchronize=True)
            real = batch_rows.rows[: batch_rows.num_real]
            scored.extend(zip(real, batch.scores[: batch_rows.num_real].tolist(), strict=True))
    finally:
        trainer.args.num_generations = saved_generations
    # Processes hold different numbers of rows: gather Python lists, and sum in dataset order, so the mean is
    # the one a single process computes.
    scores = [score for _, score in sorted(gather_object(scored))]
    return {"eval/reward/mean": sum(scores) / len(scores) if scores else float("nan")}
