"""trl_sae.trainer.trl_base: SAEPPOConfig / SAEPPOTrainer stand on TRL's PPO classes where TRL has them (1.12) and
on trl-sae's own bases where it does not (TRL >= 1.13 deleted trl.experimental.ppo), with the same settings,
the same config reference and the same training behaviour either way."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.test_trainer import make_trainer
from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.cli.docs import config_table
from trl_sae.trainer import trl_base

ROOT = Path(__file__).resolve().parents[1]
needs_trl_ppo = pytest.mark.skipif(not trl_base.TRL_HAS_PPO, reason="TRL >= 1.13 has no trl.experimental.ppo")


def fields_and_defaults(cls: type) -> list[tuple[str, object]]:
    return [
        (f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        for f in dataclasses.fields(cls)
    ]


@needs_trl_ppo
def test_on_trl_1_12_the_classes_are_trls_subclasses():
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    assert issubclass(SAEPPOTrainer, PPOTrainer) and issubclass(SAEPPOConfig, PPOConfig)


@needs_trl_ppo
def test_our_ppo_fields_are_trl_1_12s_ppoconfig_fields_in_order_with_their_defaults():
    from trl.experimental.ppo import PPOConfig
    from trl.experimental.ppo.ppo_trainer import OnlineTrainerState

    ours = fields_and_defaults(trl_base.PPOFieldsConfig)
    assert len(ours) > 100  # TrainingArguments' fields are there too
    assert ours == fields_and_defaults(PPOConfig)
    assert fields_and_defaults(trl_base.EpisodeTrainerState) == fields_and_defaults(OnlineTrainerState)
    # and they behave alike after __post_init__ (TRL's base turns bf16=None into "not fp16")
    mine = trl_base.PPOFieldsConfig(output_dir="x", use_cpu=True, fp16=False)
    trls = PPOConfig(output_dir="x", use_cpu=True, fp16=False)
    assert (mine.bf16, mine.logging_steps, mine.learning_rate) == (trls.bf16, trls.logging_steps, 3e-6)
    assert mine.bf16 is True


# Run in a fresh interpreter where `import trl.experimental.ppo` fails as on TRL >= 1.13 (on TRL 1.16 it fails
# anyway): the table `trl-sae docs` writes, the classes' bases, and one short training run with a checkpoint.
WITHOUT_TRL_PPO = textwrap.dedent(
    """
    import json, sys
    sys.modules["trl.experimental.ppo"] = None  # ImportError, as TRL 1.13+ gives
    sys.path.insert(0, {root!r})
    import torch
    from tests.test_trainer import make_config, make_dataset, vowel_fraction
    from trl_sae import SAEPPOTrainer
    from trl_sae.cli.docs import config_table
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
    from trl_sae.trainer import trl_base
    from pathlib import Path

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = make_config(Path({tmp!r}), max_steps=2, save_strategy="steps", save_steps=2)
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=vowel_fraction, args=config,
        train_dataset=make_dataset(), processing_class=tokenizer,
    )
    trainer.train()
    print(json.dumps({{
        "has_ppo": trl_base.TRL_HAS_PPO,
        "mro": [c.__module__ + "." + c.__name__ for c in type(trainer).__mro__],
        "config_mro": [c.__module__ + "." + c.__name__ for c in type(config).__mro__],
        "table": config_table(),
        "episode": trainer.state.episode,
        "steps": trainer.state.global_step,
        "rewards": [e["reward/mean"] for e in trainer.state.log_history if "reward/mean" in e],
    }}))
    """
)


def run_without_trl_ppo(tmp_path: Path) -> dict:
    script = WITHOUT_TRL_PPO.format(root=str(ROOT), tmp=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_trl_ppo_the_trainer_stands_on_our_bases_and_trains(tmp_path, tokenizer):
    out = run_without_trl_ppo(tmp_path / "without")
    assert out["has_ppo"] is False
    assert not any(name.startswith("trl.experimental") for name in out["mro"] + out["config_mro"])
    assert out["mro"][1:4] == [
        "trl_sae.trainer.trl_base.PPOBaseTrainer",
        "trl.trainer.base_trainer._BaseTrainer",
        "transformers.trainer.Trainer",
    ]
    assert "trl_sae.trainer.trl_base.PPOFieldsConfig" in out["config_mro"]
    # the same config reference as this interpreter's (TRL's PPOConfig on TRL 1.12)
    assert out["table"] == config_table()
    # 2 steps of 8 completions; the episode counter is our trainer state's, saved in the checkpoint
    assert (out["steps"], out["episode"]) == (2, 16)
    saved = json.loads((tmp_path / "without" / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert (saved["global_step"], saved["episode"]) == (2, 16)
    # the same run in this interpreter (on TRL 1.12: TRL's PPOTrainer as the base) logs the same rewards
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path / "with", tokenizer, max_steps=2)
    trainer.train()
    rewards = [e["reward/mean"] for e in trainer.state.log_history if "reward/mean" in e]
    assert len(rewards) == 2 and 0.0 < rewards[0] < 1.0
    assert out["rewards"] == rewards
