"""Evaluation during training: the mean reward and the accuracy of one completion per eval prompt.

:meth:`SAEPPOTrainer.evaluate <trl_sae.SAEPPOTrainer.evaluate>` calls :func:`evaluate_policy`, which samples
and scores with the trainer's own rollout part (:class:`~trl_sae.trainer.parts.rollout.Rollouts`: ``collate``,
``sample``, ``score``), so evaluation sees exactly the sampler and rewards that training does, at ``eval_temperature`` (0: greedy; by default the
training temperature). A tqdm bar on the main process counts the prompts done, with an ETA (``disable_tqdm``
turns it off), as transformers' evaluation loop shows one.

Several processes split the prompts, and every batch they sample is collective under FSDP2, DeepSpeed
ZeRO-3 (``generate`` with ``synced_gpus``: every forward gathers parameters) and a vLLM server (the prompts
of all processes are gathered): each process must run as many batches, of as many rows, as every other, or
the ones left waiting abort (gloo: "collective mismatch") or hang. :func:`eval_batches` pads them with
repeated prompts, and the padding is dropped before the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from trl_sae.trainer.parts.rollout import Rollouts

__all__ = ["EvalBatch", "eval_batches", "eval_sampling", "evaluate_policy", "held_out_line"]


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


@contextmanager
def eval_sampling(rollouts: Rollouts) -> Iterator[None]:
    """One completion per prompt at ``eval_temperature`` (0: greedy) inside the block, on either sampler."""
    from trl_sae.generation.capture import pure_sampling_config

    args = rollouts.args
    temperature = args.temperature if args.eval_temperature is None else args.eval_temperature
    saved = (args.num_generations, rollouts.generation_config)
    args.num_generations = 1
    config = pure_sampling_config(
        temperature or 1.0,
        args.response_length,
        rollouts.stop_token_ids,
        rollouts.processing_class.pad_token_id,
    )
    if temperature == 0:
        # Greedy: generate applies no warper, and its log-probs are the unscaled softmax.
        config.do_sample, config.top_k, config.top_p, config.min_p = False, None, None, None
        config.typical_p = config.epsilon_cutoff = config.eta_cutoff = None
    rollouts.generation_config = config
    engine = rollouts.vllm_rollout
    try:
        if engine is None:
            yield
        else:
            with engine.sampling_temperature(temperature):
                yield
    finally:
        args.num_generations, rollouts.generation_config = saved


def evaluate_policy(rollouts: Rollouts, dataset: Dataset) -> dict[str, float]:
    """``eval/reward/mean`` (the reward training uses, penalties included) and ``eval/accuracy`` (the share of
    prompts whose reward functions' weighted sum reaches 1: a verifiable reward's "correct") over ``dataset``'s
    prompts, one completion each at ``eval_temperature``, gathered from every process (the same on each).

    Args:
        rollouts: the trainer's rollout part: sampling and scoring, the config and the accelerator.
        dataset: a prepared prompt dataset (``input_ids``, ``prompt`` and the reward functions' columns).
    """
    accelerator, args = rollouts.accelerator, rollouts.args
    batches = eval_batches(
        len(dataset),
        accelerator.process_index,
        accelerator.num_processes,
        max(1, args.per_device_eval_batch_size),
    )
    scored: list[tuple[int, float, float]] = []
    # Prompts done, counted on the main process (which holds the most rows): its rows x the processes.
    bar = tqdm(
        total=len(dataset),
        desc="evaluate (prompts)",
        unit="prompt",
        disable=args.disable_tqdm or not accelerator.is_main_process,
        leave=False,
    )
    with bar, eval_sampling(rollouts):
        for number, batch_rows in enumerate(batches):
            prompts = rollouts.collate([dataset[i] for i in batch_rows.rows])
            # vLLM: evaluation batches sample from their own seed stream, never a training step's noise.
            prompts["vllm_seed_stream"] = ("eval", number)
            batch = rollouts.sample(prompts, recompute_logprobs=False)  # only the completions are read
            # Every process scores every batch, so they can agree on a reward failure (instead of the others
            # waiting for it in the next batch's collectives).
            rollouts.score(batch, synchronize=True)
            real = batch_rows.rows[: batch_rows.num_real]
            rewards = batch.scores[: batch_rows.num_real].tolist()
            task = batch.task_scores[: batch_rows.num_real].tolist()
            scored.extend(zip(real, rewards, task, strict=True))
            bar.update(min(bar.total - bar.n, batch_rows.num_real * accelerator.num_processes))
    # Processes hold different numbers of rows: gather Python lists, and sum in dataset order, so the mean is
    # the one a single process computes.
    rows = sorted(gather_object(scored))
    if not rows:
        return {"eval/reward/mean": float("nan"), "eval/accuracy": float("nan")}
    return {
        "eval/reward/mean": sum(reward for _, reward, _ in rows) / len(rows),
        "eval/accuracy": sum(task >= 1.0 for _, _, task in rows) / len(rows),
    }


def held_out_line(log_history: list[dict], temperature: float) -> str | None:
    """One line for the end of a run: the held-out accuracy and mean reward of its first and last evaluation
    (``eval_on_start`` makes the first one step 0's); None when the run never evaluated.

    Args:
        log_history: the trainer state's log, where ``evaluate()`` appends its metrics with their step.
        temperature: the evaluations' temperature (``eval_temperature``, else ``temperature``): 0 is greedy.
    """
    evaluations = [entry for entry in log_history if "eval/reward/mean" in entry]
    if not evaluations:
        return None
    how = "greedy" if temperature == 0 else f"one sample at temperature {temperature:g}"
    first, last = evaluations[0], evaluations[-1]

    def change(key: str) -> str:
        if key not in last:
            return ""
        return f"{first[key]:.4g} -> {last[key]:.4g}" if len(evaluations) > 1 else f"{last[key]:.4g}"

    metrics = "; ".join(
        f"{name} {change(key)}"
        for name, key in (("accuracy", "eval/accuracy"), ("mean reward", "eval/reward/mean"))
        if change(key)
    )
    if len(evaluations) == 1:
        return f"held-out ({how}) after step {last.get('step')}: {metrics} (eval_on_start adds the value before training)"
    return f"held-out ({how}), step {first.get('step')} -> {last.get('step')}: {metrics}"
