"""benchmarks/gpu_check.py on tiny shapes on CPU: the same code path as on a GPU, its JSON and its table."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_check


def test_budget_and_failures_are_recorded_and_the_run_goes_on(tmp_path):
    cases = gpu_check.plan_cases(["qwen3-0.6b"], ["lora_head", "lora_shared", "qlora_shared"], [8, 16])
    assert [(c.completion_tokens, c.setup) for c in cases][:3] == [
        (8, "lora_head"),
        (8, "lora_shared"),
        (8, "qlora_shared"),
    ]
    calls = []

    def runner(case, device, tiny, steps, deadline):
        calls.append(case.setup)
        if case.setup == "lora_head" and case.completion_tokens == 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nsecond line")
        if case.setup == "lora_shared" and case.completion_tokens == 8:
            raise ValueError("bad shape")
        case.steps = steps
        case.rollout_s, case.update_s = [4.0], [4.0]  # 1 x 2 x 8 tokens in 8 s: 2 tok/s; 16 tokens: 16 s

    snapshots = []
    done = gpu_check.run_all(
        cases,
        "cpu",
        True,
        1,
        budget_s=60.0,
        runner=runner,
        after_each=lambda c: snapshots.append([x.status for x in c]),
    )
    # Written after each case that ran: the first snapshot has the failure and the cases still pending.
    assert snapshots[0] == ["failed"] + ["pending"] * 5
    assert len(snapshots) == 4
    statuses = {(c.setup, c.completion_tokens): (c.status, c.error) for c in done}
    assert statuses[("lora_head", 8)] == (
        "failed",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
    )
    assert statuses[("lora_shared", 8)] == ("failed", "ValueError: bad shape")
    assert statuses[("qlora_shared", 8)][0] == "not run: QLoRA is measured on CUDA only"
    # Both failures ran and the later cases were still reached; no rate was measured, so 16 tokens ran too.
    assert calls == ["lora_head", "lora_shared", "lora_head", "lora_shared"]
    assert statuses[("lora_head", 16)] == ("ok", None)

    late = gpu_check.plan_cases(["qwen3-0.6b"], ["lora_head"], [8, 4096])
    late_calls = []

    def slow_runner(case, device, tiny, steps, deadline):
        late_calls.append(case.completion_tokens)
        case.steps = steps
        case.rollout_s, case.update_s = [1.0], [0.6]  # 16 tokens in 1.6 s: 10 tok/s; 4096 x 2: 819 s > 60 s

    gpu_check.run_all(late, "cpu", True, 1, budget_s=60.0, runner=slow_runner)
    assert late_calls == [8]
    assert [c.status for c in late] == ["ok", "skipped: time budget"]


def test_tiny_cpu_run_writes_json_and_table(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--tiny", "--out", str(out), "--lengths", "8", "--steps", "2"]
    argv += ["--setups", "lora_head", "qlora_shared"]
    assert gpu_check.main(argv) == 0
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["device"] == "cpu" and result["tiny"] is True
    assert set(result["versions"]) >= {"torch", "transformers", "trl", "peft", "bitsandbytes"}
    ran, qlora = result["cases"]
    assert (ran["setup"], ran["completion_tokens"], ran["status"], ran["error"]) == (
        "lora_head",
        8,
        "ok",
        None,
    )
    assert ran["steps"] == 2 and len(ran["rollout_s"]) == 2 and len(ran["update_s"]) == 2
    assert all(s > 0 for s in ran["rollout_s"] + ran["update_s"])
    assert ran["tokens_per_s"] > 0
    # bf16 on CPU: the captured log-probs differ from the teacher-forced ones, a little.
    assert 0 < ran["logprob_max_abs_diff"] <= gpu_check.LOGPROB_TOLERANCE and ran["logprobs_match"] is True
    assert ran["estimate_gib"] > 0 and ran["estimate_phase"] in ("rollout", "values", "update")
    assert ran["peak_over_estimate"] == pytest.approx(ran["peak_allocated_gib"] / ran["estimate_gib"])
    assert (
        qlora["status"].startswith("not run:") and qlora["steps"] == 0 and qlora["peak_allocated_gib"] is None
    )

    lines = (out / "gpu_check.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == list(gpu_check.TABLE_COLUMNS)
    rows = [line for line in lines[header + 2 :] if line.startswith("|")]
    assert len(rows) == 2
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert all(len(row) == len(gpu_check.TABLE_COLUMNS) for row in cells)
    assert cells[0][:5] == ["qwen3-0.6b", "lora_head", "8", "ok", "2"]
    assert cells[1][3].startswith("not run:")


def test_shipped_configs_have_the_published_qwen3_dims():
    expected = {  # hidden, layers, heads, intermediate; kv heads 8, head_dim 128, vocab 151,936, tied
        "qwen3-0.6b": (1024, 28, 16, 3072),
        "qwen3-1.7b": (2048, 28, 16, 6144),
        "qwen3-4b": (2560, 36, 32, 9728),
    }
    for name, dims in expected.items():
        config = gpu_check.load_config(name, tiny=False)
        got = (
            config.hidden_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.intermediate_size,
        )
        assert got == dims
        assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (8, 128, 151_936)
        assert config.tie_word_embeddings is True
        shape = gpu_check.model_shape(name, config)
        assert shape.num_heads * shape.head_dim == {1024: 2048, 2048: 2048, 2560: 4096}[config.hidden_size]


def test_estimates_of_the_check_setups_order_as_their_memory_does():
    from bench_memory import estimate_gpu_memory

    head, shared, qlora = (
        estimate_gpu_memory("Qwen3-1.7B", setup, 4096, 2, prompt_length=11)
        for setup in ("lora_head", "lora_shared", "qlora_shared")
    )
    # The shared critic adds a second adapter and a second checkpointed pass over the same base.
    assert shared.terms["adapters"] == pytest.approx(
        head.terms["adapters"] + head.terms["adapters"] - 4 * (2048 + 1)
    )
    assert shared.terms["checkpoints"] == pytest.approx(2 * head.terms["checkpoints"])
    assert head.terms["weights"] == shared.terms["weights"] > qlora.terms["weights"]
    with pytest.raises(ValueError, match="setup must be one of"):
        estimate_gpu_memory("Qwen3-1.7B", "lora_critic", 4096)


def test_estimate_only_prints_one_row_per_model_and_setup(capsys):
    assert (
        gpu_check.main(["--estimate-only", "--models", "qwen3-0.6b", "qwen3-4b", "--lengths", "1024", "8192"])
        == 0
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| qwen3-")]
    assert len(rows) == 2 * len(gpu_check.SETUPS)
    # A longer completion never needs less memory.
    for row in rows:
        short, long = (float(cell.split()[0]) for cell in row.strip("|").split("|")[2:4])
        assert 0 < short < long


def test_the_guide_shows_the_estimates_the_check_computes():
    # One source: the guide's table is estimate_rows' output, so a change to the formula must update it.
    guide = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs/guides/gpu-memory.md"
    )
    with open(guide) as handle:
        text = handle.read()
    table = gpu_check.estimate_rows(list(gpu_check.MODELS), list(gpu_check.SETUPS), list(gpu_check.LENGTHS))
    assert table in text
