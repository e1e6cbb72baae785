"""Tests of trl_sae.generation.inputs, the one place prompts are encoded, padded and stopped: the
evaluation stops at every EOS of the model, as the trainer does."""

from __future__ import annotations

import torch
from datasets import Dataset

from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.evaluation import evaluate_accuracy, generate_completions
from trl_sae.generation.inputs import (
    encode_prompt,
    left_pad,
    model_stop_token_ids,
    right_pad,
    sequence_inputs,
)

PROMPT = "Same prompt:"


def peaked_qwen3(tokenizer) -> tuple[torch.nn.Module, int]:
    """A tiny Qwen3 whose logits are scaled x1000 (sampling is greedy in effect) and the id it emits first
    after ``PROMPT`` (never the tokenizer's EOS)."""
    model = build_tiny_qwen3(tokenizer, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(1000.0)
        logits = model(input_ids=torch.tensor([encode_prompt(tokenizer, PROMPT)])).logits[0, -1]
        logits[tokenizer.eos_token_id] = -float("inf")
    return model, int(logits.argmax())


def test_padding_and_sequence_inputs_by_hand():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    completions = right_pad([torch.tensor([3, 4]), torch.tensor([9])], 0)
    assert completions.tolist() == [[3, 4], [9, 0]]
    assert right_pad([[], []], -100).tolist() == [[-100], [-100]]  # at least one column
    inputs = sequence_inputs(ids, mask, completions, torch.tensor([[1, 1], [1, 0]]))
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 3, 4], [0, 0, 8, 9, 0]]
    # Positions count valid tokens only: the left padding does not shift the second row.
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 1]]


def test_evaluation_stops_at_every_eos_the_model_declares(tokenizer):
    # Before: evaluation passed only the tokenizer's EOS to generate, so a model whose generation_config
    # lists a second EOS (Qwen3 instruct: <|im_end|> and <|endoftext|>) ran on to max_new_tokens.
    model, first = peaked_qwen3(tokenizer)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    assert model_stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id, first]
    texts, ids = generate_completions(model, tokenizer, [PROMPT, PROMPT], max_new_tokens=8)
    assert ids == [[first], [first]]
    assert texts == [tokenizer.decode([first])] * 2

    def reward(prompts, completions, completion_ids, **columns):
        return [1.0] * len(completions)

    result = evaluate_accuracy(
        model, tokenizer, Dataset.from_dict({"prompt": [PROMPT]}), reward, max_new_tokens=8
    )
    assert result["mean_completion_tokens"] == 1.0
    assert result["truncated_fraction"] == 0.0
