"""FSDP2 (``fully_shard``) under ``accelerate launch`` on two gloo CPU ranks, against DDP on the same seeds:
sharded generation with ranks that stop at different lengths, checkpoint, resume and the final save; ranks
with uneven work (token-budget micro-batches, eval prompts) against one process; fsdp2.yaml's CPU command.

Every launch has a timeout that kills its ranks: a rank left waiting in a collective fails the test."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.scenarios import launch_scenarios, once_per_run, selected_scenarios
from tests.test_distributed import FSDP2_CONFIG as CONFIG
from tests.test_distributed import free_port, launch_env, run_launch
from tests.test_distributed import two_rank_command as _two_rank_command

# accelerate 1.15 selects FSDP only for GPU-like distributed types; on gloo CPU ranks it falls back to
# MULTI_CPU (DDP) without a word. A launched script that runs this first selects FSDP with the plugin accelerate
# built from the launch config, so the trainer runs the code path a GPU run takes (tests/test_vllm.py too).
SELECT_FSDP_ON_CPU = """
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_original_init = AcceleratorState.__init__

def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP

AcceleratorState.__init__ = _fsdp_on_cpu
"""

SCRIPT = textwrap.dedent(
    """
    import json, os, shutil, sys
    import torch
    torch.set_num_threads(1)
    from accelerate.utils import DistributedType
    from datasets import Dataset
    from torch.distributed.fsdp import FSDPModule
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
    from trl_sae.generation import capture

    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    {select_fsdp_on_cpu}

    synced = []
    needs_synced_gpus = capture._needs_synced_gpus
    def record_synced(model):
        synced.append(needs_synced_gpus(model))
        return synced[-1]
    capture._needs_synced_gpus = record_synced

    def reward(prompts, completions, completion_ids, **columns):
        return [float(sum(map(ord, c)) % 3) for c in completions]

    def make(max_steps):
        tokenizer = build_char_tokenizer()
        extra = {}
        if mode in ("lora", "head"):
            from peft import LoraConfig
            extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              lora_dropout=0.0, init_lora_weights=False)
        if mode == "head":  # the head critic on layer 0's output, its value gradient into the sharded layer 0
            extra["value_model"] = "head"
            head = dict(value_head_layer=0, value_head_trunk_grad_scale=0.5)
        else:
            head = {}
        config = SAEPPOConfig(
            output_dir=os.path.join(out, "run"), per_device_train_batch_size=4, num_generations=2,
            response_length=6, max_steps=max_steps, learning_rate=1e-3, critic_learning_rate=1e-3,
            temperature=1.0, report_to="none", disable_tqdm=True, save_strategy="steps", save_steps=1,
            use_cpu=True, seed=0, stop_token=None, logging_steps=1, kl_coef=0.05, **head,
        )
        dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]})
        trainer = SAEPPOTrainer(model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=reward, args=config,
                                train_dataset=dataset, processing_class=tokenizer, **extra)
        if rank == 1:  # rank 1 stops after 3 tokens, rank 0 after 6: every step must stay collective
            trainer.generation_config.max_new_tokens = 3
        return trainer

    KEYS = ("loss/policy", "loss/value", "reward/mean", "values/mean", "policy/approx_kl")
    def losses(trainer):
        return [{k: e[k] for k in KEYS} for e in trainer.state.log_history if "loss/policy" in e]

    trainer = make(3)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    uninterrupted = losses(trainer)
    if mode in ("lora", "head"):  # a merged save (every rank gathers; the main one merges) and the PEFT logits
        from trl_sae.generation.capture import fsdp2_root_unsharded
        trainer.args.merge_adapters = True
        trainer.save_model(os.path.join(out, "merged"))
        trainer.args.merge_adapters = False
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        inputs = torch.tensor([[5, 6, 7, 8, 9, 10], [12, 11, 10, 9, 8, 7]])
        with fsdp2_root_unsharded(unwrapped), torch.no_grad():
            logits = unwrapped.policy(input_ids=inputs).logits
        if rank == 0:
            torch.save({"inputs": inputs, "logits": logits}, os.path.join(out, "peft_logits.pt"))
    fsdp_modules = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    if rank == 0:
        shutil.rmtree(os.path.join(out, "run", "checkpoint-3"))
    trainer.accelerator.wait_for_everyone()
    resumed = make(3)
    resumed.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"losses": uninterrupted, "resumed": losses(resumed), "synced": synced,
                   "distributed_type": str(trainer.accelerator.distributed_type),
                   "fsdp_modules": fsdp_modules}, handle)
    """
).replace("{select_fsdp_on_cpu}\n", SELECT_FSDP_ON_CPU)


def two_rank_command(script: Path, *script_args: str, fsdp: bool = True) -> list[str]:
    """:func:`tests.test_distributed.two_rank_command`, FSDP2 unless told otherwise."""
    return _two_rank_command(script, *script_args, fsdp=fsdp)


# The scenarios of this module's passing two-rank runs, in the order their launch runs them: one FSDP2 launch
# and one DDP launch instead of nine (tests/scenarios.py). The NaN run ends its update with an error on both
# ranks, caught in the script: it comes last.
FSDP_SCENARIOS = ("train_full", "train_lora", "train_head", "split", "eval", "nan")
DDP_SCENARIOS = ("train_full", "train_lora", "train_head")


def scenarios_of(item: pytest.Item) -> list[str]:
    if item.originalname == "test_fsdp2_two_cpu_ranks_match_ddp_and_resume":
        return [f"train_{item.callspec.params['mode']}"]
    return {
        "test_fsdp2_token_budget_with_uneven_micro_batches_matches_one_process": ["split"],
        "test_fsdp2_evaluate_three_prompts_on_two_ranks_matches_one_process": ["eval"],
        "test_fsdp2_a_nan_in_one_ranks_first_micro_batch_stops_both_ranks": ["nan"],
    }[item.originalname]


def run_scenarios(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    names: tuple[str, ...],
    fsdp: bool,
) -> Path:
    """Launch the selected ones of ``names`` once for the run (tests/scenarios.py: once_per_run); scenario ``x``
    writes into ``<folder>/x``."""
    scripts = {"split": SPLIT_SCRIPT, "eval": EVAL_SCRIPT, "nan": NAN_SCRIPT}
    selected = selected_scenarios(request, names, scenarios_of)

    def launch(root: Path) -> None:
        scenarios = []
        for name in selected:
            (root / name).mkdir()
            mode = [name.removeprefix("train_")] if name.startswith("train_") else []
            scenarios.append((name, scripts.get(name, SCRIPT), [root / name, *mode]))
        launch_scenarios(root / "scripts", scenarios, fsdp=fsdp, timeout=900)

    return once_per_run(tmp_path_factory, "fsdp_module_" + ("fsdp2" if fsdp else "ddp"), launch)


@pytest.fixture(scope="module")
def fsdp_runs(request, tmp_path_factory) -> Path:
    return run_scenarios(request, tmp_path_factory, FSDP_SCENARIOS, fsdp=True)


@pytest.fixture(scope="module")
def ddp_runs(request, tmp_path_factory) -> Path:
    return run_scenarios(request, tmp_path_factory, DDP_SCENARIOS, fsdp=False)


def ranks_of(folder: Path, stem: str) -> list[dict]:
    return [json.loads((folder / f"{stem}{rank}.json").read_text()) for rank in (0, 1)]


def shares_the_launches(test):
    """One FSDP2 launch runs six scenarios, one DDP launch three: the first test of the group carries them
    (pytest-timeout counts fixture set-up); one xdist_group (tests/scenarios.py)."""
    for mark in (pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("fsdp_launches")):
        test = mark(test)
    return test


@pytest.mark.parametrize("mode", ["full", "lora", "head"])
@shares_the_launches
def test_fsdp2_two_cpu_ranks_match_ddp_and_resume(fsdp_runs, ddp_runs, mode, tokenizer):
    """``head``: LoRA with the head critic on decoder layer 0 (value_head_layer=0), half its value gradient
    into the adapter."""
    fsdp = ranks_of(fsdp_runs / f"train_{mode}", "rank")
    ddp = ranks_of(ddp_runs / f"train_{mode}", "rank")
    for rank in fsdp:
        assert rank["distributed_type"] == "DistributedType.FSDP"
        assert rank["fsdp_modules"] >= 3  # the root and each decoder layer
        # generate was told to keep every rank stepping (ranks stop at 3 and at 6 tokens)
        assert rank["synced"] and all(rank["synced"])
        # resuming from checkpoint-2 redoes step 3 exactly as the uninterrupted run did
        assert rank["resumed"][-1] == pytest.approx(rank["losses"][-1], rel=1e-6, abs=1e-9)
    assert ddp[0]["distributed_type"] == "DistributedType.MULTI_CPU" and not any(ddp[0]["synced"])
    steps = fsdp[0]["losses"]
    assert len(steps) == 3 and any(step["loss/value"] != 0 for step in steps)
    # Measured here: FSDP2 vs DDP at most 5.4e-7 relative (full fine-tune: float32 reduction order), 0 (LoRA).
    for sharded, replicated in zip(steps, ddp[0]["losses"], strict=True):
        assert sharded == pytest.approx(replicated, rel=1e-5, abs=1e-7)

    final = fsdp_runs / f"train_{mode}" / "final"
    reference = ddp_runs / f"train_{mode}" / "final"
    if mode == "full":
        from transformers import AutoModelForCausalLM

        sharded_model = AutoModelForCausalLM.from_pretrained(final)
        replicated_model = AutoModelForCausalLM.from_pretrained(reference)
        for (name, a), (_, b) in zip(
            sharded_model.state_dict().items(), replicated_model.state_dict().items(), strict=True
        ):
            assert torch.allclose(a, b, atol=1e-5), name
        assert (final / "value_model" / "model.safetensors").exists()
    else:
        from peft import PeftModel

        from trl_sae.demo.tiny import build_tiny_qwen3

        sharded_model = PeftModel.from_pretrained(build_tiny_qwen3(tokenizer, seed=0), final)
        replicated_model = PeftModel.from_pretrained(build_tiny_qwen3(tokenizer, seed=0), reference)
        lora = {n: p for n, p in sharded_model.named_parameters() if "lora_" in n}
        assert lora
        for name, parameter in replicated_model.named_parameters():
            if name in lora:
                assert torch.allclose(lora[name], parameter, atol=1e-5), name
        assert (final / "value_model" / "value_head.safetensors").exists()
        if mode == "head":  # the value head trained from zero, as under DDP, and it read layer 0
            from safetensors.torch import load_file

            head = load_file(final / "value_model" / "value_head.safetensors")
            assert head["weight"].abs().sum() > 0
            # Measured here: equal to DDP's exactly (LoRA), as the losses are.
            for name, value in load_file(reference / "value_model" / "value_head.safetensors").items():
                torch.testing.assert_close(head[name], value, atol=1e-6, rtol=1e-5)
            run = fsdp_runs / f"train_{mode}" / "run"
            setup = json.loads((run / "checkpoint-3" / "model_setup.json").read_text())
            assert "decoder layer 0 of 0..1" in setup["critic"]
        # merge_adapters=True under FSDP2 used to hang (rank 0 merged DTensor shards alone); the merged save
        # loads as a plain model and computes what the trained PEFT model computes (float32: ~1e-6 apart).
        from transformers import AutoModelForCausalLM

        peft = torch.load(fsdp_runs / f"train_{mode}" / "peft_logits.pt")
        merged = AutoModelForCausalLM.from_pretrained(fsdp_runs / f"train_{mode}" / "merged")
        assert type(merged).__name__ == "Qwen3ForCausalLM"
        with torch.no_grad():
            logits = merged(input_ids=peft["inputs"]).logits
            untrained = build_tiny_qwen3(tokenizer, seed=0)(input_ids=peft["inputs"]).logits
        torch.testing.assert_close(logits, peft["logits"], atol=1e-5, rtol=1e-5)
        assert (untrained - logits).abs().max() > 1e-4  # the adapter changed the model


SPLIT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.set_num_threads(1)
    from accelerate.utils import DistributedType
    from torch.distributed.tensor import DTensor
    from trl_sae.demo.tiny import build_char_tokenizer
    from trl_sae.generation.capture import fsdp2_root_unsharded
    from trl_sae.trainer.objectives.losses import LOSS_AGG_MODES
    from tests.test_loss_aggregation import fixed_batch, split_trainer

    {select_fsdp_on_cpu}

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    trainer = split_trainer(out, build_char_tokenizer(), rows=4)
    assert trainer.accelerator.distributed_type == DistributedType.FSDP
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    with fsdp2_root_unsharded(unwrapped):  # this rank's half of the same 8 rollouts
        batch = fixed_batch(trainer, slice(4 * rank, 4 * rank + 4))
    parameters = [p for p in unwrapped.parameters() if p.requires_grad]
    micro_batches = []
    split = trainer.ppo_update.micro_batches
    trainer.ppo_update.micro_batches = lambda *a: micro_batches.append(len(split(*a))) or split(*a)

    def full(tensor):  # FSDP2 shards every parameter: each rank gathers the whole (a collective)
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def update(**settings):
        before = [p.detach().clone() for p in parameters]
        saved = {name: getattr(trainer.args, name) for name in settings}
        for name, value in settings.items():
            setattr(trainer.args, name, value)
        torch.manual_seed(0)
        stats = trainer.ppo_update.run(batch, trainer.state.global_step)
        for name, value in saved.items():
            setattr(trainer.args, name, value)
        delta = torch.cat([(full(p.detach()) - full(b)).flatten() for p, b in zip(parameters, before)])
        with torch.no_grad():
            for p, b in zip(parameters, before):
                p.copy_(b)
        return delta, {key: float(value) for key, value in stats.items()}

    # A budget of 20 tokens makes 3 micro-batches on rank 0 and 2 on rank 1.
    splits = {"4x1": {}, "budget": {"max_tokens_per_microbatch": 20}}
    results = {(mode, name): update(loss_agg_mode=mode, **settings)
               for mode in LOSS_AGG_MODES for name, settings in splits.items()}
    torch.save({"results": results, "micro_batches": micro_batches}, os.path.join(out, f"split{rank}.pt"))
    """
).replace("{select_fsdp_on_cpu}\n", SELECT_FSDP_ON_CPU)


@shares_the_launches
def test_fsdp2_token_budget_with_uneven_micro_batches_matches_one_process(fsdp_runs, tmp_path, tokenizer):
    """FSDP2 gathers parameters in every forward and backward, so ranks with 3 and 2 micro-batches used to wait
    for each other forever; the short rank now pads, and the update is still the one-process update."""
    from tests.test_loss_aggregation import fixed_batch, relative_difference, split_trainer
    from trl_sae.trainer.objectives.losses import LOSS_AGG_MODES

    # Unpadded, the ranks hang in their 3rd vs the 2nd micro-batch's collectives: the launch's timeout turns
    # that into a failure.
    ranks = [torch.load(fsdp_runs / "split" / f"split{r}.pt") for r in (0, 1)]
    assert ranks[0]["micro_batches"] == [1, 3] * len(LOSS_AGG_MODES)  # uneven: 3 micro-batches ...
    assert ranks[1]["micro_batches"] == [1, 2] * len(LOSS_AGG_MODES)  # ... against 2

    def update(trainer, batch, **settings):  # the parameters' change and the statistics; then put back
        parameters = [
            p for p in trainer.accelerator.unwrap_model(trainer.model).parameters() if p.requires_grad
        ]
        before = [p.detach().clone() for p in parameters]
        for name, value in settings.items():
            setattr(trainer.args, name, value)
        torch.manual_seed(0)
        stats = trainer.ppo_update.run(batch, trainer.state.global_step)
        stats = {key: float(value) for key, value in stats.items()}
        delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(parameters, before)])
        with torch.no_grad():
            for p, b in zip(parameters, before):
                p.copy_(b)
        return delta, stats

    whole_trainer = split_trainer(str(tmp_path / "whole"), tokenizer, rows=8)
    half_trainer = split_trainer(str(tmp_path / "half"), tokenizer, rows=4)
    for mode in LOSS_AGG_MODES:
        whole, _ = update(whole_trainer, fixed_batch(whole_trainer), loss_agg_mode=mode)
        for name in ("4x1", "budget"):
            sharded = [rank["results"][mode, name][0] for rank in ranks]
            assert torch.equal(sharded[0], sharded[1])  # every rank holds the same gathered update
            assert relative_difference(sharded[0], whole) < 1e-5, (mode, name)
        # The padding micro-batch added nothing to rank 1's statistics: they are the means over its 2 real
        # micro-batches, as one process computes them on the same 4 rows with the same budget.
        second_half = fixed_batch(half_trainer, slice(4, 8))
        _, alone = update(half_trainer, second_half, loss_agg_mode=mode, max_tokens_per_microbatch=20)
        padded = ranks[1]["results"][mode, "budget"][1]
        for key in ("policy/clipfrac", "policy/approx_kl", "policy/entropy"):
            assert padded[key] == pytest.approx(alone[key], rel=1e-4, abs=1e-6), (mode, key)


EVAL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    {select_fsdp_on_cpu}

    out = sys.argv[1]
    rank = int(os.environ["RANK"])

    def prompt_value(prompts, completions, completion_ids, value, **columns):
        return value  # the eval prompts' own column: the same whichever process samples them

    tokenizer = build_char_tokenizer()
    config = SAEPPOConfig(
        output_dir=out, per_device_train_batch_size=4, num_generations=2, response_length=6, report_to="none",
        disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, stop_token=None,
        per_device_eval_batch_size=1, local_rollout_forward_batch_size=1,
    )
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=prompt_value, args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(8)], "value": [0.0] * 8}),
        eval_dataset=Dataset.from_dict({"prompt": ["A:", "B:", "C:"], "value": [0.0, 1.0, 5.0]}),
        processing_class=tokenizer,
    )
    if rank == 1:  # rank 1 stops after 3 tokens, rank 0 after 6
        trainer.generation_config.max_new_tokens = 3
    metrics = {}
    for size in (1, 2):  # 1: 2 calls on rank 0 against 1 on rank 1; 2: 2 rows against 1, 1 row per call
        trainer.args.per_device_eval_batch_size = size
        metrics[size] = trainer.evaluate()
    with open(os.path.join(out, f"eval{rank}.json"), "w") as handle:
        json.dump({"metrics": metrics, "distributed_type": str(trainer.accelerator.distributed_type)}, handle)
    """
).replace("{select_fsdp_on_cpu}\n", SELECT_FSDP_ON_CPU)


@shares_the_launches
def test_fsdp2_evaluate_three_prompts_on_two_ranks_matches_one_process(fsdp_runs, tmp_path, tokenizer):
    """Under FSDP2 every generate call is collective: rank 0 (prompts 0 and 2) and rank 1 (prompt 1) used to make
    different numbers of calls and abort with gloo's collective mismatch; rank 1 now pads, and drops the pad."""
    from datasets import Dataset

    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_tiny_qwen3

    ranks = ranks_of(fsdp_runs / "eval", "eval")

    def prompt_value(prompts, completions, completion_ids, value, **columns):
        return value

    config = SAEPPOConfig(
        output_dir=str(tmp_path / "one"), per_device_train_batch_size=4, num_generations=2, response_length=6,
        report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, stop_token=None,
    )  # fmt: skip
    one_process = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=prompt_value, args=config,
        train_dataset=Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(8)], "value": [0.0] * 8}),
        eval_dataset=Dataset.from_dict({"prompt": ["A:", "B:", "C:"], "value": [0.0, 1.0, 5.0]}),
        processing_class=tokenizer,
    )  # fmt: skip
    expected = one_process.evaluate()
    # (0 + 1 + 5) / 3; a counted pad of prompt 1 would give 1.75. Accuracy: rewards >= 1, prompts 1 and 2 of 3.
    assert expected == {"eval/reward/mean": 2.0, "eval/accuracy": pytest.approx(2 / 3)}
    for rank in ranks:
        assert rank["distributed_type"] == "DistributedType.FSDP"
        assert rank["metrics"] == {"1": expected, "2": expected}


def documented_cpu_command() -> list[str]:
    """The CPU command in fsdp2.yaml's comment, word for word."""
    lines = CONFIG.read_text().splitlines()
    start = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("#   accelerate launch") and "--num_processes 2" in line
    )
    text = " ".join(line.lstrip("#").strip().rstrip("\\") for line in lines[start : start + 2])
    return shlex.split(text)


def test_warns_when_an_fsdp_launch_does_not_shard():
    from trl_sae.trainer.setup.distributed import unsharded_fsdp_launch_warning

    script = ["examples/sae_ppo_math.py", "--config", "recipe.yaml", "--use_cpu", "true"]
    # accelerate's --cpu: one process, however many were asked for
    message = unsharded_fsdp_launch_warning(1, "DistributedType.NO", ["--config_file", str(CONFIG), "--cpu", "--num_processes", "2", *script])  # fmt: skip
    assert "ONE process" in message and "--cpu" in message
    assert f"--config_file {CONFIG} --num_processes 2 your_script.py ... --use_cpu true" in message
    # an FSDP config on one process for another reason
    message = unsharded_fsdp_launch_warning(1, "DistributedType.NO", ["--config_file", str(CONFIG), "--num_processes", "1", *script])  # fmt: skip
    assert "ONE process (the launch asked for one process)" in message
    # 2 CPU processes that accelerate runs as DDP
    message = unsharded_fsdp_launch_warning(2, "DistributedType.MULTI_CPU", ["--config_file", str(CONFIG), "--num_processes", "2", *script])  # fmt: skip
    assert "as MULTI_CPU" in message
    # sharding as asked, no FSDP asked, or not launched by accelerate: nothing to say
    assert (
        unsharded_fsdp_launch_warning(2, "DistributedType.FSDP", ["--config_file", str(CONFIG), *script])
        is None
    )
    multi_gpu = CONFIG.parent / "multi_gpu.yaml"
    assert unsharded_fsdp_launch_warning(1, "DistributedType.NO", ["--config_file", str(multi_gpu), "--cpu", *script]) is None  # fmt: skip
    assert unsharded_fsdp_launch_warning(1, "DistributedType.NO", None) is None


@pytest.mark.slow  # two launches of the example script (2 processes, then 1): 64-110 s on 2 shared cores
@pytest.mark.timeout(600)
def test_the_documented_cpu_command_runs_two_fsdp2_processes(tmp_path, tokenizer):
    """fsdp2.yaml's CPU command trains on 2 processes (FSDP2, with accelerate's CPU choice switched as in the other
    tests here); the `--cpu` variant runs one process, and the trainer says so."""
    from tests.test_examples import offline_overrides
    from trl_sae.demo.tiny import build_tiny_qwen3

    tiny = tmp_path / "tiny"
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(tiny)
    tokenizer.save_pretrained(tiny)
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(16)))  # fmt: skip
    small = [
        "--max_steps", "1", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--num_generations", "2", "--response_length", "4", "--value_warmup_steps", "0", "--max_eval_samples", "3",
        "--activation_checkpointing", "false", "--log_completions", "false", "--save_strategy", "no",
        "--dtype", "float32", "--logging_steps", "1",
    ]  # fmt: skip
    # Every process of the launch (launcher and ranks) imports sitecustomize: accelerate then picks FSDP on CPU.
    patch = tmp_path / "select_fsdp"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(SELECT_FSDP_ON_CPU)
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join([str(patch), env["PYTHONPATH"]])

    def run(command: list[str], name: str) -> subprocess.CompletedProcess:
        assert command[:2] == ["accelerate", "launch"]
        port = ["--main_process_port", str(free_port())]  # other test runs may hold accelerate's default port
        full = [sys.executable, "-m", "accelerate.commands.launch", *port, *command[2:]]
        full += [*offline_overrides(tmp_path / name, tiny, problems), *small]
        result = run_launch(full, env, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    documented = documented_cpu_command()
    assert "--cpu" not in documented and documented[-2:] == ["--use_cpu", "true"]
    two = run(documented, "two")
    # 4 completions per process and step: 8 means two processes trained the step
    assert "'episode': 8" in two.stdout, two.stdout[-2000:]
    assert "asks for FSDP" not in two.stderr  # they ran FSDP2, as asked

    # The obvious variant, accelerate's --cpu: one process, and the warning tells what to run instead
    one = run([*documented[:2], "--cpu", *documented[2:]], "one")
    assert "'episode': 4" in one.stdout, one.stdout[-2000:]
    assert "asks for FSDP but this run has ONE process" in one.stderr
    assert "--num_processes 2 your_script.py ... --use_cpu true" in one.stderr


NAN_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from trl_sae.demo.tiny import build_char_tokenizer
    from trl_sae.generation.capture import fsdp2_root_unsharded
    from tests.test_loss_aggregation import fixed_batch, split_trainer

    {select_fsdp_on_cpu}

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    trainer = split_trainer(out, build_char_tokenizer(), rows=4)
    trainer.args.max_tokens_per_microbatch = 20  # 3 micro-batches on rank 0, 2 on rank 1
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    with fsdp2_root_unsharded(unwrapped):
        batch = fixed_batch(trainer, slice(4 * rank, 4 * rank + 4))
    loss_of = trainer.ppo_update.loss
    calls = []

    def nan_on_rank_0s_first_micro_batch(*args, **kwargs):
        loss, stats = loss_of(*args, **kwargs)
        calls.append(1)
        if rank == 0 and len(calls) == 1:
            loss = loss * float("nan")
        return loss, stats

    trainer.ppo_update.loss = nan_on_rank_0s_first_micro_batch
    try:
        trainer.ppo_update.run(batch, trainer.state.global_step)
        outcome = "trained"
    except FloatingPointError as error:
        outcome = str(error)
    with open(os.path.join(out, f"nan{rank}.json"), "w") as handle:
        json.dump({"outcome": outcome, "calls": len(calls)}, handle)
    """
).replace("{select_fsdp_on_cpu}\n", SELECT_FSDP_ON_CPU)


@shares_the_launches
def test_fsdp2_a_nan_in_one_ranks_first_micro_batch_stops_both_ranks(fsdp_runs):
    """Rank 0's first of 3 micro-batches has a NaN loss. It used to skip that backward, whose FSDP2 parameter
    all-gathers rank 1 was running, and the ranks waited for each other; now both raise at the mini-batch's
    last micro-batch, before any optimizer step."""
    ranks = ranks_of(fsdp_runs / "nan", "nan")
    assert ranks[0]["outcome"].startswith("non-finite loss") and "on process 0" in ranks[0]["outcome"]
    assert ranks[1]["outcome"].startswith("non-finite loss") and "on another process" in ranks[1]["outcome"]
    assert [r["calls"] for r in ranks] == [3, 3]  # rank 1's 2 micro-batches and 1 padding, as rank 0's 3


def test_fsdp1_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """FSDP1 (accelerate's default fsdp_version) would clip per-rank local norms, never clip its root unit's
    flat parameter (embeddings, head, value head) and save ungathered shards: refused in one line at __init__."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from tests.test_trainer import make_config, make_dataset, vowel_fraction
    from trl_sae import SAEPPOTrainer
    from trl_sae.trainer.setup import distributed as setup_utils
    from trl_sae.trainer.setup.distributed import check_fsdp_version

    message = r"supports FSDP2 only .*fsdp_version: 1.*set `fsdp_version: 2`.*examples/accelerate_configs/fsdp2.yaml"
    with pytest.raises(ValueError, match=message):
        check_fsdp_version(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))
    check_fsdp_version(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True))
    check_fsdp_version(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, is_fsdp2=False))

    class Fsdp1Accelerator(Accelerator):  # what an FSDP1 launch builds (accelerate picks FSDP on GPUs only)
        distributed_type = DistributedType.FSDP
        is_fsdp2 = False

    monkeypatch.setattr(setup_utils, "Accelerator", Fsdp1Accelerator)
    with pytest.raises(ValueError, match=message):
        SAEPPOTrainer(
            model=str(tmp_path / "no-such-model"),  # the check comes first
            reward_funcs=vowel_fraction,
            args=make_config(tmp_path, per_device_train_batch_size=4),
            train_dataset=make_dataset(),
        )
