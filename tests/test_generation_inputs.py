"""Tests of trl_sae.generation.inputs, the one place prompts are encoded, padded and stopped."""

from __future__ import annotations

import torch

from trl_sae.generation.inputs import left_pad, right_pad, sequence_inputs


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
