"""``trl-sae train``: PPO with SAE from a YAML recipe (TRL's ``TrlParser``), e.g. ``examples/*.yaml``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from trl_sae.cli.common import PROG, print_table

__all__ = ["TRAIN_DESCRIPTION", "add_parser", "cmd_train"]

TRAIN_DESCRIPTION = """\
Train a policy with PPO and Segmental Advantage Estimation from a YAML recipe.

The recipe holds ScriptArguments (model, dataset, reward functions, LoRA) and SAEPPOConfig fields
(every transformers TrainingArguments / TRL PPOConfig option plus the SAE ones); any key can be
overridden on the command line as --key value. After training the model is saved to output_dir with a
model card stating the estimator and its settings, and pushed with --push_to_hub --hub_model_id.
--dry_run builds everything (tokenizer, datasets, rewards, models, trainer) and stops before training.
A fresh run into an output_dir holding checkpoint-* folders stops at once: continue it with
--resume_from_checkpoint true (or a checkpoint folder), or start over with --overwrite_output_dir true.

examples:
  trl-sae train examples/qwen3_0.6b_qlora.yaml
  trl-sae train examples/qwen3_0.6b_qlora.yaml --max_steps 50 --segment_threshold 0.3
  trl-sae train examples/baselines/gae.yaml --dry_run
  trl-sae train examples/qwen3_0.6b_qlora.yaml --resume_from_checkpoint true   # newest intact checkpoint
  accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml \\
      -m trl_sae.cli.app train examples/qwen3_4b_lora.yaml
"""


def cmd_train(argv: Sequence[str]) -> int:
    from trl_sae.recipe import parse_recipe, run_recipe

    script_args, training_args = parse_recipe(argv, prog=f"{PROG} train", description=TRAIN_DESCRIPTION)
    summary = run_recipe(script_args, training_args)
    if summary.get("dry_run"):
        print_table("dry run: built, not trained", ["setting", "value"], sorted(summary.items()))
    else:
        print_table("training finished", ["result", "value"], sorted(summary.items()))
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``train`` to the ``trl-sae`` subcommands (called by :func:`trl_sae.cli.app.build_parser`)."""
    # Listed here for `trl-sae --help`; `main` hands its arguments to TrlParser (see cmd_train).
    commands.add_parser(
        "train",
        help="PPO + SAE from a YAML recipe (TrlParser: every SAEPPOConfig field, overridable).",
        add_help=False,
    )
