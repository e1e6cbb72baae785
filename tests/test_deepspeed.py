"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU (``DS_ACCELERATOR=cpu``, gloo), with one process and with two doing
uneven work: train with a checkpoint every step, resume from the first checkpoint (equal to the
uninterrupted run), and a final save that ``from_pretrained`` loads with exactly the trained weights.

Each run is a subprocess: DeepSpeed initialises ``torch.distributed`` and accelerate's process-wide state,
which must not leak into the other tests.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.test_distributed import END_PROCESS_GROUP, free_port
from tests.test_settings import deepspeed_accelerator
from tests.test_trainer import make_config, make_dataset, vowel_fraction
from trl_sae import SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

SCRIPT = """
import json, os, shutil, sys
import torch
torch.set_num_threads(1)
from datasets import Dataset
from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from trl_sae.trainer.checkpoints.folders import checkpoint_problems

root, rank = sys.argv[1], int(os.environ["RANK"])
tokenizer = build_char_tokenizer()

def vowels(prompts, completions, completion_ids, **columns):
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]

def trainer(output_dir):
    config = SAEPPOConfig(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=2, response_length=6,
        gradient_accumulation_steps=2, num_mini_batches=2, max_steps=2, learning_rate=1e-2,
        critic_learning_rate=1e-2, temperature=1.0, report_to="none", disable_tqdm=True,
        save_strategy="steps", save_steps=1, seed=0, stop_token=None,
    )
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]})
    built = SAEPPOTrainer(model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=vowels, args=config,
                          train_dataset=dataset, processing_class=tokenizer)
    if rank == 1:  # uneven work: rank 1 stops after 3 tokens, rank 0 after 6
        built.generation_config.max_new_tokens = 3
    return built

def weights(t):  # a collective under ZeRO-3 (rank 0 receives the full state dict)
    state = t.accelerator.get_state_dict(t.model)
    return {k: v.detach().double().clone() for k, v in (state or {}).items()}

def rewards(t):
    return [e["reward/mean"] for e in t.state.log_history if "reward/mean" in e]

straight_dir = os.path.join(root, "straight")
first = trainer(straight_dir)
first.train()
first.save_model()
straight = weights(first)
result = {
    "engine": type(first.model).__name__,
    "zero_stage": first.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"],
    "num_processes": first.accelerator.num_processes,
    "rewards": rewards(first),
}
if rank == 0:
    result["checkpoints"] = sorted(os.listdir(straight_dir))
    result["intact"] = [checkpoint_problems(os.path.join(straight_dir, f"checkpoint-{s}")) == [] for s in (1, 2)]
    initial = build_tiny_qwen3(tokenizer, seed=0).state_dict()
    result["initial_distance"] = max((straight["policy." + k] - v.double()).abs().max().item() for k, v in initial.items())
    # The trained weights, for the test (outside DeepSpeed: from_pretrained would shard under ZeRO-3) to
    # compare with the final save.
    torch.save({k: v.float() for k, v in straight.items()}, os.path.join(root, "trained.pt"))

# Resume from checkpoint-1 in a fresh output_dir: step 2 again, from the saved engine, optimizer and RNGs.
resumed_dir = os.path.join(root, "resumed")
if rank == 0:
    os.makedirs(resumed_dir)
    shutil.copytree(os.path.join(straight_dir, "checkpoint-1"), os.path.join(resumed_dir, "checkpoint-1"))
first.accelerator.wait_for_everyone()
second = trainer(resumed_dir)
second.train(resume_from_checkpoint=True)
resumed = weights(second)
result["resumed_rewards"] = rewards(second)
if rank == 0:
    result["resumed_distance"] = max((resumed[k] - straight[k]).abs().max().item() for k in straight)
with open(os.path.join(root, f"rank{rank}.json"), "w") as handle:
    json.dump(result, handle)
"""


def deepspeed_environment(stage: int) -> dict[str, str]:
    """What ``accelerate launch --use_deepspeed --zero_stage N`` sets, on DeepSpeed's CPU accelerator."""
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_MIXED_PRECISION": "no",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.mark.parametrize(
    "zero_optimization",
    [{"stage": 3}, {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}],
)
def test_zero3_without_16bit_weights_on_save_stops_the_trainer_before_the_model_loads(
    tmp_path, monkeypatch, zero_optimization
):
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": zero_optimization})
    trainer_module = importlib.import_module("trl_sae.trainer.sae_ppo_trainer")
    monkeypatch.setattr(trainer_module, "build_accelerator", lambda args: deepspeed_accelerator(plugin, 1))

    def build() -> SAEPPOTrainer:
        return SAEPPOTrainer(
            model=str(tmp_path / "no-such-model"),  # checked after DeepSpeed's settings
            reward_funcs=vowel_fraction,
            args=make_config(tmp_path, per_device_train_batch_size=4),
            train_dataset=make_dataset(),
        )

    with pytest.raises(
        ValueError,
        match=r"stage3_gather_16bit_weights_on_model_save is true; set `zero3_save_16bit_model: true`",
    ):
        build()
    zero_optimization["stage3_gather_16bit_weights_on_model_save"] = True
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": zero_optimization})
    with pytest.raises(Exception) as error:  # the DeepSpeed check passes; the missing model fails next
        build()
    assert "no-such-model" in str(error.value)


@pytest.mark.slow  # 30 s with one process, 70 s with two (2 CPU cores)
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("stage", "processes"), [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_deepspeed_trains_checkpoints_resumes_and_saves_a_loadable_model(tmp_path, stage, processes):
    pytest.importorskip("deepspeed")
    script = tmp_path / "deepspeed_run.py"
    script.write_text(SCRIPT + END_PROCESS_GROUP)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(
        command, env=deepspeed_environment(stage), capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(processes)]
    result = ranks[0]
    for each in ranks:
        assert each["engine"] == "DeepSpeedEngine" and each["zero_stage"] == stage
        assert each["num_processes"] == processes
        assert each["rewards"] == result["rewards"]  # logged metrics are gathered over the ranks
        assert each["resumed_rewards"] == pytest.approx(result["rewards"])
    assert {"checkpoint-1", "checkpoint-2", "model.safetensors", "value_model"} <= set(result["checkpoints"])
    assert result["intact"] == [True, True]
    assert result["initial_distance"] > 1e-3  # training moved the weights
    assert result["resumed_distance"] < 1e-6  # resuming from checkpoint-1 redid step 2 exactly
    # The final save loads with from_pretrained and holds exactly the trained policy and critic.
    trained = torch.load(tmp_path / "trained.pt")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "straight")
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "straight" / "value_model")
    saved = {"policy." + k: v for k, v in policy.state_dict().items()}
    saved.update({"critic." + k: v for k, v in critic.state_dict().items()})
    assert set(saved) == set(trained)
    for name, weight in trained.items():
        torch.testing.assert_close(saved[name], weight, atol=0, rtol=0, msg=name)


# ZeRO-3 with every weight partitioned (persistence threshold 0: without it the tiny model's weights all stay
# whole on every rank and no forward gathers anything), the output head applied 2 positions at a time, and rank
# 1's completions 3 tokens long against rank 0's 6: the ranks have different numbers of head chunks in the
# rollout's reference pass (LoRA: the base with the adapter off), the update's forward and its backward.
PARTITIONED_ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
}

CHUNKED_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
from datasets import Dataset
from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from trl_sae.generation import capture

root, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
tokenizer = build_char_tokenizer()
head_calls = []
head_chunk = capture._head_chunk_logprobs
def count_head_calls(states, *args):
    head_calls.append(states.shape[0])
    return head_chunk(states, *args)
capture._head_chunk_logprobs = count_head_calls

def vowels(prompts, completions, completion_ids, **columns):
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in completions]

extra = {}
if mode == "lora":
    from peft import LoraConfig
    extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                      init_lora_weights=False)
    extra["value_model"] = "head"  # the head critic: partitioned like the policy, saved gathered
config = SAEPPOConfig(
    output_dir=os.path.join(root, "run"), per_device_train_batch_size=4, num_generations=2, response_length=6,
    max_steps=1, learning_rate=1e-2, critic_learning_rate=1e-2, temperature=1.0, report_to="none",
    disable_tqdm=True, save_strategy="no", seed=0, stop_token=None, logprob_chunk_size=2,
    kl_coef=0.05 if mode == "lora" else 0.0,  # full fine-tuning: TRL refuses a reference copy under ZeRO-3
    merge_adapters=mode == "lora", value_head_trunk_grad_scale=0.5 if mode == "lora" else 0.0,
)
dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]})
trainer = SAEPPOTrainer(model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=vowels, args=config,
                        train_dataset=dataset, processing_class=tokenizer, **extra)
if rank == 1:  # rank 1 stops after 3 tokens, rank 0 after 6
    trainer.generation_config.max_new_tokens = 3
trainer.train()
trainer.save_model(os.path.join(root, "final"))
# The trained policy's logits on fixed inputs (a collective forward under ZeRO-3) for the test to compare with
# the saved model's.
policy = trainer.accelerator.unwrap_model(trainer.model).policy
inputs = torch.tensor([tokenizer.encode("Prompt 3: abc"), tokenizer.encode("Prompt 9: xyz")])
with torch.no_grad():
    logits = policy(input_ids=inputs).logits
result = {"head_calls": head_calls, "stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
          "kind": type(policy).__name__}
if rank == 0:
    torch.save({"inputs": inputs, "logits": logits}, os.path.join(root, "logits.pt"))
with open(os.path.join(root, f"rank{rank}.json"), "w") as handle:
    json.dump(result, handle)
"""


ZERO3_MODES = ("full", "lora")


@pytest.fixture(scope="module")
def zero3_runs(request, tmp_path_factory) -> Path:
    """The chunked ZeRO-3 script's selected modes, one after the other in one 2-process launch for the run
    (same DeepSpeed config and stage: tests/scenarios.py); mode ``m`` writes into ``zero3_runs / m``."""
    pytest.importorskip("deepspeed")
    from tests.scenarios import once_per_run, selected_scenarios, write_scenarios
    from tests.test_distributed import run_launch

    modes = selected_scenarios(request, ZERO3_MODES, lambda item: [item.callspec.params["mode"]])

    def launch(root: Path) -> None:
        for mode in modes:
            (root / mode).mkdir()
        ds_config = root / "zero3.json"
        ds_config.write_text(json.dumps(PARTITIONED_ZERO3))
        scripts = [(mode, CHUNKED_SCRIPT, [root / mode, mode]) for mode in modes]
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            *write_scenarios(root / "scripts", scripts),
        ]  # fmt: skip
        env = {**deepspeed_environment(3), "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_config)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
        run = run_launch(command, env, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]

    return once_per_run(tmp_path_factory, "zero3_launch", launch)


# One 2-process ZeRO-3 launch runs both modes: ~60-90 s on 2 shared cores, carried by the first test (pytest-timeout
# counts fixture set-up); one xdist_group (tests/scenarios.py).
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("zero3_launch")
@pytest.mark.parametrize("mode", ZERO3_MODES)
def test_zero3_partitioned_head_chunks_and_merged_lora_save(zero3_runs, mode):
    """Under ZeRO-3 every call of the partitioned output head gathers its weight. Rank 1's 3-token completions
    need fewer chunks of 2 positions than rank 0's 6-token ones: the ranks used to issue different numbers of
    gathers (gloo: collective mismatch after minutes; the timeout turns a hang into a failure). Now they agree
    on the count and pad. With LoRA, ``merge_adapters=True`` used to merge rank 0's empty partitions; the merged
    save now loads with from_pretrained and gives the trained PEFT model's logits. The LoRA run's critic is the
    head critic (``value_model="head"``, half the value gradient to the trunk): it trains under ZeRO-3 and its
    head is saved whole."""
    tmp_path = zero3_runs / mode  # this mode's folder of the shared launch
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["stage"] for r in ranks] == [3, 3]
    # Both ranks called the head equally often; rank 1's extra calls are its padding (1 position each).
    assert len(ranks[0]["head_calls"]) == len(ranks[1]["head_calls"])
    assert sum(ranks[0]["head_calls"]) > sum(ranks[1]["head_calls"])
    assert 1 in ranks[1]["head_calls"] and max(ranks[0]["head_calls"]) == 2
    saved = torch.load(tmp_path / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert type(model).__name__ == "Qwen3ForCausalLM"  # a plain model: the adapter merged in
    with torch.no_grad():
        logits = model(input_ids=saved["inputs"]).logits
    # float32 throughout; merged weights vs base + B A x scaling differ by rounding only (measured ~1e-6)
    torch.testing.assert_close(logits, saved["logits"], atol=1e-5, rtol=1e-5)
    if mode == "lora":
        assert ranks[0]["kind"].startswith("PeftModel")
        head = load_file(str(tmp_path / "final" / "value_model" / "value_head.safetensors"))
        assert head["weight"].shape == (1, model.config.hidden_size)  # gathered, not rank 0's empty partition
        assert head["weight"].abs().sum() > 0  # trained from its zero initialisation
        initial = build_tiny_qwen3(build_char_tokenizer(), seed=0)
        with torch.no_grad():
            assert (initial(input_ids=saved["inputs"]).logits - logits).abs().max() > 1e-3  # it trained
