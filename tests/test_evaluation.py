"""Evaluation's split of the eval prompts over processes (trl_sae/trainer/parts/evaluation.py); the 2-rank FSDP2 run
that needs it is in tests/test_fsdp.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trl_sae.trainer.parts.evaluation import eval_batches


@given(
    num_prompts=st.integers(1, 60), num_processes=st.integers(1, 8), batch_size=st.integers(1, 9)
)  # fmt: skip
def test_every_process_samples_the_same_batches_and_the_real_rows_cover_the_dataset_once(
    num_prompts, num_processes, batch_size
):
    per_process = [eval_batches(num_prompts, p, num_processes, batch_size) for p in range(num_processes)]
    real = sorted(row for batches in per_process for b in batches for row in b.rows[: b.num_real])
    assert real == list(range(num_prompts))
    for batches in per_process:
        assert all(0 <= row < num_prompts for b in batches for row in b.rows)
        assert all(1 <= len(b.rows) <= batch_size and 0 <= b.num_real <= len(b.rows) for b in batches)
        # real rows come first: once a batch has padding, the ones after it are all padding
        counts = [b.num_real for b in batches]
        assert counts == sorted(counts, reverse=True)
    if num_processes == 1:  # nothing to agree with: never padded
        assert all(b.num_real == len(b.rows) for b in per_process[0])
    else:  # collective sampling: the same number of calls, each with as many rows, on every process
        shapes = {tuple(len(b.rows) for b in batches) for batches in per_process}
        assert len(shapes) == 1
        # and no call more than the process with the most prompts needs
        most = -(-num_prompts // num_processes)
        assert len(per_process[0]) == -(-most // batch_size)


def test_three_prompts_on_two_processes_one_at_a_time():
    # the brief's case: process 1 has one prompt, so it samples a copy of it as a second batch
    assert eval_batches(3, 0, 2, 1) == [([0], 1), ([2], 1)]
    assert eval_batches(3, 1, 2, 1) == [([1], 1), ([1], 0)]
    # two at a time: one call each, process 1's second row is padding
    assert eval_batches(3, 1, 2, 2) == [([1, 1], 1)]
    # fewer prompts than processes: the empty process samples row 0 and keeps none
    assert eval_batches(1, 1, 2, 4) == [([0], 0)]
