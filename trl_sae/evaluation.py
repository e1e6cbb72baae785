"""Held-out accuracy of a causal LM under a verifiable reward (greedy or sampled, avg@k and pass@k), and the
exact paired test of two evaluations of the same problems (:func:`mcnemar_exact`).

Plain ``model.generate`` on purpose: evaluation must not depend on the RL stack's rollout code, so it
can also check that code, and it runs on any ``transformers`` causal LM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from trl_sae.generation.inputs import encode_prompt, eval_mode, left_pad, model_device, model_stop_token_ids

__all__ = ["evaluate_accuracy", "generate_completions", "mcnemar_exact"]

RewardFunc = Callable[..., list[float]]


def _default_max_new_tokens(tokenizer: Any, dataset: Any, completion_column: str) -> int:
    # Room for the longest reference completion plus slack, so a correct answer is never cut off while
    # a rambling model is stopped early (CPU time matters in the demo).
    if completion_column in dataset.column_names:
        longest = max(
            len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in dataset[completion_column]
        )
        return longest + 16
    return 128


@torch.no_grad()
def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: list[Any],
    max_new_tokens: int,
    temperature: float = 0.0,
    num_samples: int = 1,
    batch_size: int = 64,
    progress: bool = False,
) -> tuple[list[str], list[list[int]]]:
    """Generate ``num_samples`` completions per prompt, batched with left padding.

    Generation stops at every EOS of the model (:func:`~trl_sae.generation.inputs.model_stop_token_ids`:
    its ``generation_config`` ids and the tokenizer's), as the trainer's rollouts do.

    Returns ``(texts, token_ids)`` in prompt-major order (the samples of prompt 0 first); ``token_ids``
    are the generated ids up to and including the first EOS (padding removed), ``texts`` decode them
    without special tokens.
    """
    if temperature < 0:
        raise ValueError(f"`temperature` must be >= 0, got {temperature}.")
    greedy = temperature == 0.0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = model_stop_token_ids(model, tokenizer)
    device = model_device(model)
    # Every sample is its own row, so batches are always full-sized and `num_samples` needs no
    # num_return_sequences bookkeeping.
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    rows = [ids for ids in encoded for _ in range(num_samples)]

    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "pad_token_id": pad_id,
        # A lone id goes as an int and none as None, so a single-EOS model's call is what it was.
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None),
    }
    if greedy:
        kwargs["do_sample"] = False
    else:
        # Sample from the model's full distribution: the checkpoint's generation config may carry
        # top_k/top_p filters that would make "temperature 1.0" accuracy something else.
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    texts: list[str] = []
    token_ids: list[list[int]] = []
    starts = range(0, len(rows), batch_size)
    # Every submodule back in its own mode afterwards (eval_mode), so evaluating never changes training.
    with eval_mode(model):
        for start in tqdm(starts, desc="evaluate", disable=not progress, leave=False):
            input_ids, attention_mask = left_pad(rows[start : start + batch_size], pad_id, device)
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            for generated in output[:, input_ids.shape[1] :].tolist():
                ids = _up_to_stop(generated, pad_id, stop_ids)
                token_ids.append(ids)
                texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts, token_ids


def _up_to_stop(generated: list[int], pad_id: int, stop_ids: list[int]) -> list[int]:
    """The generated ids up to and including the first stop id, or up to the first padding."""
    ids = []
    for token in generated:
        if token == pad_id and token not in stop_ids:
            break
        ids.append(token)
        if token in stop_ids:
            break
    return ids


def evaluate_accuracy(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_func: RewardFunc,
    num_samples: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    seed: int = 0,
    success_threshold: float = 1.0,
    prompt_column: str = "prompt",
    completion_column: str = "solution",
    progress: bool = False,
    return_samples: bool = False,
) -> dict[str, Any]:
    """Accuracy of ``model`` on ``dataset`` under ``reward_func``.

    A sample counts as correct when its reward is ``>= success_threshold`` (1.0 for a binary verifiable
    reward). Greedy decoding (``temperature == 0``) is deterministic, so it generates once per prompt
    whatever ``num_samples`` says and reports that as every sample.

    Args:
        model: a ``transformers`` causal LM.
        tokenizer: its tokenizer; chat prompts go through its chat template with the generation prompt.
        dataset: a ``datasets.Dataset`` with ``prompt_column`` plus whatever columns ``reward_func`` reads
            (they are passed as keyword lists, as TRL does).
        reward_func: TRL-style ``reward_func(prompts, completions, completion_ids, **columns)``.
        num_samples: samples per prompt ``k``.
        temperature: 0 for greedy, else the sampling temperature (no top-k / top-p filtering).
        max_new_tokens: generation budget; defaults to the longest reference completion + 16 tokens.
        batch_size: rows (prompt x sample) per ``generate`` call.
        seed: seeds sampling, on a forked RNG (the caller's torch RNG state is left as it was).
        success_threshold: reward at or above which a sample is correct.
        prompt_column: the prompt column.
        completion_column: the reference-completion column, only used for the default ``max_new_tokens``.
        progress: show a tqdm bar over batches.
        return_samples: also return every sample (prompt, completion, reward).

    Returns:
        ``accuracy`` (avg@k: fraction of all samples correct), ``pass_at_k`` (fraction of prompts with at
        least one correct sample among ``k``), ``mean_reward``, ``num_prompts``, ``num_samples`` (k),
        ``temperature``, ``mean_completion_tokens``, ``truncated_fraction`` (samples that hit
        ``max_new_tokens`` without EOS), ``per_problem`` (each problem's share of correct samples, in
        dataset order: 0 or 1 with one sample, what :func:`mcnemar_exact` pairs), and ``samples`` if asked.
    """
    if num_samples < 1:
        raise ValueError(f"`num_samples` must be >= 1, got {num_samples}.")
    num_prompts = len(dataset)
    if num_prompts == 0:
        raise ValueError("The evaluation dataset is empty.")
    if max_new_tokens is None:
        max_new_tokens = _default_max_new_tokens(tokenizer, dataset, completion_column)
    greedy = temperature == 0.0
    generated_per_prompt = 1 if greedy else num_samples

    prompts = list(dataset[prompt_column])
    # Seed on a forked RNG: sampled evaluations are reproducible, and a caller that evaluates in the
    # middle of training (e.g. between PPO steps) keeps its own random stream.
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        texts, ids = generate_completions(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            num_samples=generated_per_prompt,
            batch_size=batch_size,
            progress=progress,
        )
    # Greedy: one generation stands for all k samples.
    repeat = num_samples // generated_per_prompt
    texts = [t for t in texts for _ in range(repeat)]
    ids = [i for i in ids for _ in range(repeat)]

    # Hand completions to the reward in the shape TRL would: chat messages for chat prompts.
    chat = not isinstance(prompts[0], str)
    completions: list[Any] = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    sample_prompts = [p for p in prompts for _ in range(num_samples)]
    columns = {
        name: [value for value in dataset[name] for _ in range(num_samples)]
        for name in dataset.column_names
        if name != prompt_column
    }
    rewards = [
        float(r)
        for r in reward_func(prompts=sample_prompts, completions=completions, completion_ids=ids, **columns)
    ]
    if len(rewards) != len(texts):
        raise ValueError(f"reward_func returned {len(rewards)} rewards for {len(texts)} completions.")

    correct = torch.tensor([r >= success_threshold for r in rewards], dtype=torch.float32)
    per_prompt = correct.view(num_prompts, num_samples)
    stop_ids = model_stop_token_ids(model, tokenizer)
    truncated = [len(i) >= max_new_tokens and (not i or i[-1] not in stop_ids) for i in ids]
    result: dict[str, Any] = {
        "accuracy": float(correct.mean()),
        "pass_at_k": float(per_prompt.max(dim=1).values.mean()),
        "mean_reward": float(sum(rewards) / len(rewards)),
        "num_prompts": num_prompts,
        "num_samples": num_samples,
        "temperature": float(temperature),
        "mean_completion_tokens": float(sum(len(i) for i in ids) / len(ids)),
        "truncated_fraction": float(sum(truncated) / len(truncated)),
        "per_problem": per_prompt.mean(dim=1).tolist(),
    }
    if return_samples:
        result["samples"] = [
            {"prompt": p, "completion": t, "reward": r} for p, t, r in zip(sample_prompts, texts, rewards)
        ]
    return result


def mcnemar_exact(before: Sequence[bool], after: Sequence[bool]) -> dict[str, Any]:
    """Exact McNemar test of two evaluations of the same problems: is ``after`` more often right than ``before``?

    Only the discordant problems carry information: ``b`` right before and wrong after, ``c`` wrong before and
    right after. Under "no change" each of the ``b + c`` is equally likely either way, so ``c`` is
    Binomial(b + c, 1/2) and the p-value is scipy's exact two-sided binomial test of it (1.0 when there is no
    discordant problem).

    Args:
        before, after: per-problem correctness, one entry per problem, in the same order (length n >= 1).

    Returns:
        ``{"difference": (c - b) / n, "b": b, "c": c, "p_value": p, "n": n}``; ``difference`` is the paired
        accuracy gain, ``after``'s accuracy minus ``before``'s.
    """
    from scipy import stats

    if len(before) != len(after) or not before:
        raise ValueError(
            f"mcnemar_exact: before and after must score the same n >= 1 problems, got {len(before)} and "
            f"{len(after)}"
        )
    b = sum(1 for old, new in zip(before, after, strict=True) if old and not new)
    c = sum(1 for old, new in zip(before, after, strict=True) if new and not old)
    p_value = float(stats.binomtest(c, b + c, 0.5).pvalue) if b + c else 1.0
    return {"difference": (c - b) / len(before), "b": b, "c": c, "p_value": p_value, "n": len(before)}
