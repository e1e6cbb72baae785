"""Value pretraining (VC-PPO, trl_sae/trainer/parts/value_pretrain.py): the critic fitted alone before PPO.

Each test runs the pretraining phase alone through ``trainer._begin_training`` (what ``train()`` runs before
its first step) on the tiny Qwen3, unless it is about the PPO steps after it.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_sae import SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.trainer.parts import value_pretrain
from trl_sae.trainer.parts.rollout import Rollouts
from trl_sae.trainer.parts.update import PPOUpdate
from trl_sae.trainer.parts.value_pretrain import (
    PRETRAIN_DIR,
    SUMMARY_FILE,
    ValuePretraining,
    critic_state,
    pretrain_prompts,
)

from .test_distributed import launch_two_ranks
from .test_trainer import make_config


def prompt_reward(prompts, completions, completion_ids, **columns):
    """A reward the critic can predict from the prompt alone: 1 for the prompts that start with 'a'."""
    return [1.0 if prompt.startswith("a") else 0.0 for prompt in prompts]


def toy_dataset(n: int = 32) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{'ab'[i % 2]} {i}:" for i in range(n)]})


PRETRAIN = dict(
    value_pretrain_rollouts=32,
    value_pretrain_held_out=16,
    value_pretrain_epochs=3,
    value_pretrain_patience=None,
    value_pretrain_learning_rate=1e-2,
    response_length=4,
    max_steps=1,
)


# Every value_pretrain_* setting at its default: no pretraining.
OFF = dict(
    value_pretrain_rollouts=0,
    value_pretrain_held_out=0,
    value_pretrain_epochs=10,
    value_pretrain_patience=3,
    value_pretrain_learning_rate=None,
)


def make(tmp_path, tokenizer, value_model=None, peft_config=None, model=None, **overrides):
    settings = {**PRETRAIN, **overrides}
    return SAEPPOTrainer(
        model=model if model is not None else build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=prompt_reward,
        args=make_config(tmp_path, **settings),
        train_dataset=toy_dataset(),
        processing_class=tokenizer,
        value_model=value_model,
        peft_config=peft_config,
    )


def wrapper_of(trainer):
    return trainer.accelerator.unwrap_model(trainer.model)


def critic_copy(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in critic_state(wrapper_of(trainer)).items()}


def folder_of(trainer) -> Path:
    return Path(trainer.args.output_dir) / PRETRAIN_DIR


def summary_of(trainer) -> dict:
    return json.loads((folder_of(trainer) / SUMMARY_FILE).read_text())


def record_fitted_prompts(monkeypatch, tokenizer) -> list[str]:
    """The prompt of every row a loss micro-batch sees, in order."""
    seen: list[str] = []
    original = PPOUpdate.loss

    def loss(self, batch, index, *args, **kwargs):
        ids = batch.prompt_ids[index]
        mask = batch.prompt_mask[index].bool()
        seen.extend(tokenizer.decode(row[keep]) for row, keep in zip(ids, mask))
        return original(self, batch, index, *args, **kwargs)

    monkeypatch.setattr(PPOUpdate, "loss", loss)
    return seen


CRITICS = {
    "separate": dict(),
    "head, a middle layer, trunk gradient on": dict(
        value_model="head", value_head_layer=0, value_head_trunk_grad_scale=0.5
    ),
    "shared-base (LoRA)": dict(peft_config="lora"),
}


@pytest.mark.parametrize("critic", list(CRITICS))
def test_pretraining_moves_only_the_critic_and_never_fits_held_out_rollouts(
    tmp_path, tokenizer, monkeypatch, critic
):
    settings = dict(CRITICS[critic])
    if settings.pop("peft_config", None):
        settings["peft_config"] = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = make(tmp_path, tokenizer, **settings)
    wrapper = wrapper_of(trainer)
    critic_names = set(critic_state(wrapper))
    before = {name: p.detach().clone() for name, p in wrapper.named_parameters()}
    seen = record_fitted_prompts(monkeypatch, tokenizer)
    trainer._begin_training(None)

    moved = {name for name, p in wrapper.named_parameters() if not torch.equal(before[name], p.detach())}
    assert moved and moved <= critic_names, moved - critic_names  # no policy weight moved, bit for bit
    assert trainer.optimizer.state == {} or all(
        p not in trainer.optimizer.state for p in wrapper.critic_parameters()
    )  # PPO's AdamW starts afresh on the critic
    # Every loss micro-batch saw fitting rows only: 32 per epoch, 3 epochs, none from a held-out prompt.
    assert len(seen) == 32 * 3
    held, _ = pretrain_prompts(32, 16 // 4, 2, seed=0)
    held_prompts = {toy_dataset()[i]["prompt"] for i in held.tolist()}
    assert len(held_prompts) == 4
    assert not held_prompts & set(seen)
    assert len(set(seen)) >= 4


def test_pretraining_runs_a_subclass_s_own_step_phases(tmp_path, tokenizer):
    """``trainer.value_pretraining()`` values and rewards rollouts with the trainer's step-phase methods, so a
    subclass that overrides one (here: advantages that count their calls) pretrains through its override."""
    calls = {"values": 0, "advantages": 0}

    class Counting(SAEPPOTrainer):
        def _compute_values(self, batch):
            calls["values"] += 1
            super()._compute_values(batch)

        def _compute_advantages(self, batch):
            calls["advantages"] += 1
            super()._compute_advantages(batch)

    trainer = Counting(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=prompt_reward,
        args=make_config(tmp_path, **{**PRETRAIN, "value_pretrain_epochs": 1}),
        train_dataset=toy_dataset(),
        processing_class=tokenizer,
    )
    pretraining = trainer.value_pretraining()
    assert isinstance(pretraining, ValuePretraining)
    fit, held = pretraining.rollouts(resume=False)
    assert (len(fit.scores), len(held.scores)) == (32, 16)
    # the fitting and the held-out rollouts' returns came through the override
    assert calls["advantages"] >= 2
    assert calls["values"] >= 2
    sampled = dict(calls)
    trainer._begin_training(True)  # what train() runs first: continues from the saved rollouts, fits an epoch
    assert calls == sampled  # the rollouts were not sampled twice
    assert summary_of(trainer)["epochs_run"] == 1


def test_held_out_explained_variance_rises_on_a_learnable_reward_and_the_best_epoch_is_kept(
    tmp_path, tokenizer
):
    trainer = make(tmp_path, tokenizer, value_pretrain_rollouts=64, value_pretrain_epochs=4)
    trainer._begin_training(None)
    summary = summary_of(trainer)
    history = summary["explained_variance_held_out"]
    assert len(history) == 5 and history[0] == 0.0  # the zero-initialised value head explains nothing
    # Measured: 0.96 after one epoch, >= 0.85 after each; the reward is a function of the prompt.
    assert max(history) > history[0] + 0.6
    r2 = summary["r2_held_out"]
    assert len(r2) == 5 and r2[0] < 0  # values all 0: the returns' mean is missed too
    assert summary["best_epoch"] == max(range(5), key=r2.__getitem__)
    assert all(r <= ev + 1e-9 for r, ev in zip(r2, history))  # R^2 also counts the values' offset
    logged = [e for e in trainer.state.log_history if "value_pretrain/explained_variance_held_out" in e]
    assert [e["value_pretrain/explained_variance_held_out"] for e in logged] == history
    assert [e["value_pretrain/r2_held_out"] for e in logged] == r2
    assert [e["value_pretrain/epoch"] for e in logged] == [0, 1, 2, 3, 4]
    assert all(e["value_pretrain/loss"] > 0 for e in logged[1:])
    # The critic that was kept is the one published, and it is the best epoch's: its held-out EV is the best.
    saved = value_pretrain.load_file(str(folder_of(trainer) / "critic.safetensors"))
    current = critic_copy(trainer)
    assert all(torch.equal(saved[name], current[name]) for name in current)


def test_early_stopping_stops_after_patience_epochs_without_improvement(tmp_path, tokenizer):
    trainer = make(
        tmp_path,
        tokenizer,
        value_pretrain_rollouts=64,
        value_pretrain_epochs=12,
        value_pretrain_patience=2,
        value_pretrain_min_delta=0.05,
    )
    trainer._begin_training(None)
    summary = summary_of(trainer)
    history = summary["r2_held_out"]
    # The rule replayed on the logged history: the best so far, and the epochs since it rose by > 0.05.
    best, stop = 0, None
    for epoch in range(1, len(history)):
        if history[epoch] > history[best] + 0.05:
            best = epoch
        if epoch - best >= 2:
            stop = epoch
            break
    assert stop is not None and stop < 12, history  # it plateaued (EV near 1 on this reward)
    assert summary["epochs_run"] == stop == len(history) - 1
    assert summary["best_epoch"] == best and summary["stopped_early"]


def test_the_progress_bar_moves_once_per_optimizer_step_and_names_the_epoch(tmp_path, tokenizer, monkeypatch):
    bars = []

    class RecordingBar:
        def __init__(self, total=None, initial=0, **kwargs):
            self.total, self.n, self.desc, self.moves, self.postfixes = (
                total,
                initial,
                kwargs.get("desc"),
                [],
                [],
            )
            bars.append(self)

        def update(self, count=1):
            self.n += count
            self.moves.append(self.n)

        def set_postfix(self, **values):
            self.postfixes.append(values)

        def close(self):
            pass

    monkeypatch.setattr(value_pretrain, "tqdm", RecordingBar)
    trainer = make(tmp_path, tokenizer, value_pretrain_rollouts=64, value_pretrain_epochs=3)
    trainer._begin_training(None)
    bar = next(b for b in bars if b.desc == "value pretraining")
    per_epoch = -(-64 // trainer.args.local_mini_batch_size)
    assert per_epoch > 1  # several optimizer steps an epoch, so the bar moves within one
    assert (
        bar.total == 3 * per_epoch and bar.moves == list(range(1, 3 * per_epoch + 1)) and bar.n == bar.total
    )
    assert [p["epoch"] for p in bar.postfixes] == [0, 1, 2, 3]
    history = summary_of(trainer)["explained_variance_held_out"]
    assert [p["ev_held_out"] for p in bar.postfixes] == [f"{ev:.4f}" for ev in history]


def test_the_epoch_kept_is_the_best_by_r2_not_by_explained_variance(tmp_path, tokenizer, monkeypatch):
    """A critic whose values are all shifted ranks the states as well (same explained variance) but values them
    wrongly: from epoch 2 on every held-out value is measured 0.5 too high, so epoch 1 must be kept."""
    original = value_pretrain.ValuePretraining.held_out_values
    calls = []

    def shifted(self, batch):
        calls.append(None)
        values = original(self, batch)
        return values + 0.5 if len(calls) >= 2 else values  # call 1 is epoch 1's (epoch 0 uses the rollout's)

    monkeypatch.setattr(value_pretrain.ValuePretraining, "held_out_values", shifted)
    trainer = make(
        tmp_path, tokenizer, value_pretrain_rollouts=64, value_pretrain_epochs=3, value_pretrain_patience=None
    )
    trainer._begin_training(None)
    summary = summary_of(trainer)
    ev, r2 = summary["explained_variance_held_out"], summary["r2_held_out"]
    assert len(calls) == 3 and min(ev[1:]) > 0.6  # every epoch ranks the states well
    assert max(ev[2:]) > ev[1] - 0.2 and max(r2[2:]) < r2[1] - 0.2  # the offset costs R^2 alone
    assert summary["best_epoch"] == 1


class Interrupt(Exception):
    pass


def test_an_interrupted_pretraining_resumed_reaches_the_same_critic(tmp_path, tokenizer, monkeypatch):
    whole = make(tmp_path / "whole", tokenizer, value_pretrain_epochs=4)
    whole._begin_training(None)
    expected = critic_copy(whole)

    original = ValuePretraining._log

    def stop_after_epoch_two(self, epoch, ev, r2, loss):
        original(self, epoch, ev, r2, loss)
        if epoch == 2:
            raise Interrupt

    monkeypatch.setattr(ValuePretraining, "_log", stop_after_epoch_two)
    first = make(tmp_path / "cut", tokenizer, value_pretrain_epochs=4)
    with pytest.raises(Interrupt):
        first._begin_training(None)
    monkeypatch.setattr(ValuePretraining, "_log", original)
    folder = folder_of(first)
    assert (folder / "progress-epoch-2").is_dir() and not (folder / SUMMARY_FILE).exists()
    # A progress file from before held-out R^2 decided the kept epoch is refused, not resumed on EV alone.
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "cut", old)
    progress_file = old / folder.relative_to(tmp_path / "cut") / "progress-epoch-2" / "progress.json"
    saved = json.loads(progress_file.read_text())
    del saved["r2"]
    progress_file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="kept epochs by explained variance"):
        make(old, tokenizer, value_pretrain_epochs=4)._begin_training(True)

    sampled = []
    monkeypatch.setattr(Rollouts, "sample", lambda self, *a, **k: sampled.append(1))
    resumed = make(tmp_path / "cut", tokenizer, value_pretrain_epochs=4)
    resumed._begin_training(True)
    assert not sampled  # the rollouts were read back, not sampled again
    got = critic_copy(resumed)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert (
        summary_of(resumed)["explained_variance_held_out"] == summary_of(whole)["explained_variance_held_out"]
    )
    assert summary_of(resumed)["r2_held_out"] == summary_of(whole)["r2_held_out"]
    # A finished pretraining that is resumed again (the PPO run stopped before its first checkpoint) loads it.
    again = make(tmp_path / "cut", tokenizer, value_pretrain_epochs=4)
    again._begin_training(True)
    assert all(torch.equal(critic_copy(again)[name], expected[name]) for name in expected)
    # A fresh run into the same output_dir refuses to write over it.
    with pytest.raises(ValueError, match="holds an earlier value pretraining"):
        make(tmp_path / "cut", tokenizer, value_pretrain_epochs=4)._begin_training(None)


def test_value_pretrain_path_loads_the_critic_without_sampling(tmp_path, tokenizer, monkeypatch):
    source = make(tmp_path / "source", tokenizer, value_model="head", value_head_layer=1)
    source._begin_training(None)
    expected = critic_copy(source)
    path = str(folder_of(source))

    calls = []
    monkeypatch.setattr(Rollouts, "sample", lambda self, *a, **k: calls.append(1))
    off = dict(OFF, value_pretrain_path=path)
    loaded = make(tmp_path / "loaded", tokenizer, value_model="head", value_head_layer=1, **off)
    assert not all(torch.equal(p, expected[n]) for n, p in critic_copy(loaded).items())
    loaded._begin_training(None)
    assert not calls
    got = critic_copy(loaded)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # Another critic (another layer, a separate critic) is refused when the trainer is built.
    with pytest.raises(
        ValueError,
        match=r"^SAEPPOConfig\.value_pretrain_path: .*another critic .*value_head_layer=1.* -> .*value_head_layer=0",
    ):
        make(tmp_path / "other", tokenizer, value_model="head", value_head_layer=0, **off)
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.value_pretrain_path: .*another critic"):
        make(tmp_path / "other", tokenizer, **off)


def test_the_ppo_steps_after_pretraining_draw_the_prompts_and_samples_of_a_run_without_it(
    tmp_path, tokenizer, monkeypatch
):
    drawn: dict[str, list] = {"with": [], "without": []}
    current = {"run": "with"}
    original = Rollouts.collect

    def collect(self, step):
        batch, metrics = original(self, step)
        drawn[current["run"]].append((list(batch.prompts), batch.completion_ids.clone()))
        return batch, metrics

    monkeypatch.setattr(Rollouts, "collect", collect)
    make(tmp_path / "with", tokenizer, max_steps=2).train()
    current["run"] = "without"
    plain = {k: v for k, v in PRETRAIN.items() if not k.startswith("value_pretrain")}
    SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=prompt_reward,
        args=make_config(tmp_path / "without", **{**plain, "max_steps": 2}),
        train_dataset=toy_dataset(),
        processing_class=tokenizer,
    ).train()
    assert [p for p, _ in drawn["with"]] == [p for p, _ in drawn["without"]]
    # The policy is the same until the first update, so the first step's samples are the same too.
    assert torch.equal(drawn["with"][0][1], drawn["without"][0][1])


def test_with_vllm_pretraining_samples_on_a_seed_stream_of_its_own(tmp_path, tokenizer, monkeypatch):
    # The engine is a stand-in that samples with transformers (tests/test_settings.py); here what matters is
    # that pretraining samples through it, on seeds the PPO steps never use, and leaves theirs unchanged.
    from .test_settings import StandInEngine

    seeds: list[int] = []

    class RecordingEngine(StandInEngine):
        def generate(self, prompt_ids, prompt_mask, num_generations, seed):
            seeds.append(seed)
            return super().generate(prompt_ids, prompt_mask, num_generations, seed)

    monkeypatch.setattr("trl_sae.trainer.setup.vllm.is_vllm_available", lambda: True)
    monkeypatch.setattr("trl_sae.trainer.setup.vllm.VLLMRollout", RecordingEngine)
    make(tmp_path / "with", tokenizer, use_vllm=True, max_steps=2).train()
    with_pretraining, seeds[:] = list(seeds), []
    make(tmp_path / "without", tokenizer, use_vllm=True, max_steps=2, **OFF).train()
    # 2 held-out and 4 fitting rollout batches, then the 2 PPO steps' (as a run without pretraining samples).
    assert len(with_pretraining) == 6 + 2 and with_pretraining[6:] == seeds
    assert len(set(with_pretraining)) == 8


def test_ppo_after_pretraining_is_ppo_from_the_loaded_critic(tmp_path, tokenizer):
    # Pretraining drops its AdamW state and forks the RNG: the PPO steps after it are, bit for bit, those of a
    # run that loads its critic with value_pretrain_path.
    pretrained = make(tmp_path / "pretrained", tokenizer, max_steps=2)
    pretrained.train()
    path = str(folder_of(pretrained))
    loaded = make(tmp_path / "loaded", tokenizer, max_steps=2, **OFF, value_pretrain_path=path)
    loaded.train()
    for (name, a), (_, b) in zip(
        wrapper_of(pretrained).named_parameters(), wrapper_of(loaded).named_parameters()
    ):
        assert torch.equal(a, b), name
    losses = [
        [e["loss/value"] for e in t.state.log_history if "loss/value" in e] for t in (pretrained, loaded)
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def test_bad_value_pretraining_settings_are_refused_naming_the_argument(tmp_path, tokenizer):
    refused = {
        "value_pretrain_rollouts": dict(value_pretrain_rollouts=12),  # not a multiple of 8
        "value_pretrain_held_out": dict(value_pretrain_held_out=0),
        "value_pretrain_epochs": dict(value_pretrain_epochs=0),
        "value_pretrain_patience": dict(value_pretrain_patience=0),
        "value_pretrain_learning_rate": dict(value_pretrain_learning_rate=0.0),
        "value_pretrain_min_delta": dict(value_pretrain_min_delta=-0.1),
    }
    for name, settings in refused.items():
        with pytest.raises(ValueError, match=rf"^SAEPPOConfig\.{name}: "):
            make_config(tmp_path, **{**PRETRAIN, **settings})
    with pytest.raises(
        ValueError, match=r"^SAEPPOConfig\.value_pretrain_rollouts: .*'grpo' trains no critic"
    ):
        make_config(tmp_path, **PRETRAIN, advantage_estimator="grpo")
    with pytest.raises(
        ValueError, match=r"^SAEPPOConfig\.value_pretrain_epochs: is set but value_pretrain_rollouts=0"
    ):
        make_config(tmp_path, value_pretrain_epochs=5)
    with pytest.raises(  # a pretraining recipe pointed at a finished critic: the message says what to drop
        ValueError, match=r"^SAEPPOConfig\.value_pretrain_held_out: is set but value_pretrain_path loads a"
    ):
        make_config(tmp_path, value_pretrain_held_out=16, value_pretrain_path=str(tmp_path))
    with pytest.raises(
        ValueError, match=r"^SAEPPOConfig\.value_pretrain_path: .*set value_pretrain_rollouts=0"
    ):
        make_config(tmp_path, **PRETRAIN, value_pretrain_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"^SAEPPOConfig\.value_pretrain_path: .* is not a folder"):
        make_config(tmp_path, value_pretrain_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"^SAEPPOConfig\.value_pretrain_path: .*holds no finished value"):
        make(tmp_path, tokenizer, **OFF, value_pretrain_path=str(tmp_path))
    # What needs the trainer: held-out prompts leaving too few to fit on (32 prompts, 4 completions each).
    with pytest.raises(ValueError, match=r"^SAEPPOConfig\.value_pretrain_held_out: 128 completions take 32"):
        make(tmp_path, tokenizer, value_pretrain_held_out=128)
    with pytest.raises(ValueError, match=r"SAEPPOConfig\.ddp_find_unused_parameters=False .*value_pretrain"):
        make(tmp_path, tokenizer, ddp_find_unused_parameters=False)


def test_qlora_shared_critic_pretrains_on_a_frozen_4bit_base(tmp_path, tokenizer):
    # o_proj adapted: on a CPU where bitsandbytes repacks 4-bit weights on their first inference-mode forward
    # (the rollout), its later forwards go through `gemv_4bit`, which has no autograd kernel: no gradient
    # reaches the input of a 4-bit linear (torch warns), so adapters on q_proj/v_proj alone never train, in PPO
    # steps as in pretraining; an adapted o_proj carries the gradient through its LoRA branch.
    pytest.importorskip("bitsandbytes")
    model_dir = tmp_path / "tiny"
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(model_dir)
    trainer = make(
        tmp_path,
        tokenizer,
        model=str(model_dir),
        load_in_4bit=True,
        peft_config=LoraConfig(r=2, target_modules=["q_proj", "o_proj"], lora_dropout=0.0),
    )
    wrapper = wrapper_of(trainer)
    assert wrapper.policy.get_base_model().is_loaded_in_4bit
    trainable = {n: p.detach().clone() for n, p in wrapper.named_parameters() if p.requires_grad}
    trainer._begin_training(None)
    critic = set(critic_state(wrapper))
    moved = {n for n, p in wrapper.named_parameters() if n in trainable and not torch.equal(trainable[n], p)}
    assert moved and moved <= critic and any(".critic." in n for n in moved)
    assert summary_of(trainer)["epochs_run"] == 3


TWO_RANKS = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
    from trl_sae.trainer.parts.value_pretrain import ValuePretraining, critic_state

    rank = int(os.environ["RANK"])
    seen = []

    def prompt_reward(prompts, completions, completion_ids, **columns):
        seen.extend(prompts)
        return [1.0 if p.startswith("a") else 0.0 for p in prompts]

    tokenizer = build_char_tokenizer()

    def build(name):
        config = SAEPPOConfig(
            output_dir=os.path.join(sys.argv[1], name), per_device_train_batch_size=4, num_generations=2,
            response_length=4, max_steps=1, learning_rate=1e-3, critic_learning_rate=1e-3, temperature=1.0,
            report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, stop_token=None,
            value_pretrain_rollouts=16, value_pretrain_held_out=8, value_pretrain_epochs=2,
            value_pretrain_patience=None, value_pretrain_learning_rate=1e-2,
        )
        dataset = Dataset.from_dict({"prompt": [f"{'ab'[i % 2]} {i}:" for i in range(16)]})
        return SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=prompt_reward, args=config,
            train_dataset=dataset, processing_class=tokenizer,
        )

    def digest(trainer):
        state = critic_state(trainer.accelerator.unwrap_model(trainer.model))
        return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in state.values())).hexdigest()

    whole = build("whole")
    whole._begin_training(None)
    history = [e["value_pretrain/explained_variance_held_out"] for e in whole.state.log_history
               if "value_pretrain/explained_variance_held_out" in e]
    scored = list(seen)

    class Stop(Exception):
        pass

    log = ValuePretraining._log

    def stop_after_epoch_one(self, epoch, ev, r2, loss):
        log(self, epoch, ev, r2, loss)
        if epoch == 1:
            raise Stop

    ValuePretraining._log = stop_after_epoch_one
    try:
        build("cut")._begin_training(None)
    except Stop:
        pass
    ValuePretraining._log = log
    resumed = build("cut")
    resumed._begin_training(True)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump({"prompts": scored, "critic": digest(whole), "resumed": digest(resumed), "history": history},
                  handle)
    """
)


@pytest.mark.slow  # two processes under accelerate launch
@pytest.mark.timeout(600)
def test_two_ranks_pretrain_on_their_own_rollouts_agree_and_resume(tmp_path):
    launch_two_ranks(tmp_path / "pretrain_two_ranks.py", TWO_RANKS, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Each rank scored its own half: 4 held-out and 8 fitting completions (2 per prompt), no prompt shared.
    assert all(len(r["prompts"]) == 12 for r in ranks)
    assert not set(ranks[0]["prompts"]) & set(ranks[1]["prompts"])
    # The processes agree: the same gathered explained variance, and the same critic, bit for bit.
    assert ranks[0]["history"] == ranks[1]["history"] and len(ranks[0]["history"]) == 3
    assert ranks[0]["critic"] == ranks[1]["critic"]
    # Interrupted after epoch 1 and resumed on both ranks: the critic of the uninterrupted run.
    assert ranks[0]["resumed"] == ranks[0]["critic"] == ranks[1]["resumed"]
    summary = json.loads((tmp_path / "whole" / PRETRAIN_DIR / SUMMARY_FILE).read_text())
    assert summary["rollouts"] == {"fit": 16, "held_out": 8, "processes": 2}
