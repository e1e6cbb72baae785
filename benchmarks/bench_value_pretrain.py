"""What value pretraining costs (``value_pretrain_*``): its sampling in rollouts/s and seconds per critic epoch,
next to one PPO step of the same run.

Run ``python benchmarks/bench_value_pretrain.py`` (``--quick`` for a smoke run; ``--critic head`` or
``--critic shared`` for the other critics). One ``SAEPPOTrainer`` on a tiny Qwen3 pretrains its critic on
``--rollouts`` completions (``--held-out`` more held out) for ``--epochs`` epochs (no early stopping), then
takes ``--steps`` PPO steps; every number comes from that one run: the sampling and fitting seconds its
``value_pretrain.json`` records, and the PPO steps' ``timing/rollout_s`` and ``timing/update_s``. Printed as
ratios to one PPO step, which carry over to other machines better than the seconds do. No assertion on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from trl_sae.trainer.parts.value_pretrain import PRETRAIN_DIR, SUMMARY_FILE


def prompt_reward(prompts, completions, completion_ids, **columns):
    """A reward the critic can learn from the prompt: 1 for the prompts that start with 'a'."""
    return [1.0 if prompt.startswith("a") else 0.0 for prompt in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes")
    parser.add_argument("--critic", choices=["separate", "head", "shared"], default="separate")
    parser.add_argument("--rollouts", type=int, default=256, help="value_pretrain_rollouts")
    parser.add_argument("--held-out", type=int, default=64, help="value_pretrain_held_out")
    parser.add_argument("--epochs", type=int, default=3, help="value_pretrain_epochs (all run)")
    parser.add_argument("--steps", type=int, default=3, help="PPO steps after pretraining")
    parser.add_argument("--batch", type=int, default=32, help="completions per rollout batch")
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.held_out, args.epochs, args.steps = 32, 16, 2, 1
        args.batch, args.response_length = 16, 8
    torch.set_num_threads(args.threads)

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(
        tokenizer, hidden_size=args.hidden_size, num_layers=args.layers,
        max_position_embeddings=16 + args.response_length,
    )  # fmt: skip
    peft_config = None
    value_model = {"separate": None, "head": "head", "shared": None}[args.critic]
    if args.critic == "shared":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0
        )
    num_prompts = (args.rollouts + args.held_out + args.batch) // 4  # no prompt fitted twice
    dataset = Dataset.from_dict({"prompt": [f"{'ab'[i % 2]} {i}:" for i in range(num_prompts)]})
    with tempfile.TemporaryDirectory() as output_dir:
        config = SAEPPOConfig(
            output_dir=output_dir, per_device_train_batch_size=args.batch, num_generations=4,
            response_length=args.response_length, max_steps=args.steps, learning_rate=1e-4,
            critic_learning_rate=1e-3, temperature=1.0, report_to="none", disable_tqdm=True,
            save_strategy="no", use_cpu=True, seed=0, stop_token=None,
            value_pretrain_rollouts=args.rollouts, value_pretrain_held_out=args.held_out,
            value_pretrain_epochs=args.epochs, value_pretrain_patience=None,
        )  # fmt: skip
        trainer = SAEPPOTrainer(
            model=model, reward_funcs=prompt_reward, args=config, train_dataset=dataset,
            processing_class=tokenizer, value_model=value_model, peft_config=peft_config,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
        summary = json.loads((Path(output_dir) / PRETRAIN_DIR / SUMMARY_FILE).read_text())
    steps = [e for e in trainer.state.log_history if "timing/update_s" in e]
    step_s = statistics.median(e["timing/rollout_s"] + e["timing/update_s"] for e in steps)
    rollout_s = statistics.median(e["timing/rollout_s"] for e in steps)
    sampling_s, fitting_s = summary["seconds"]["sampling"], summary["seconds"]["fitting"]
    sampled = args.rollouts + args.held_out
    epoch_s = fitting_s / summary["epochs_run"]
    batches_per_epoch = args.rollouts // args.batch
    print(
        f"critic: {args.critic}; {args.rollouts} fitting + {args.held_out} held-out rollouts of "
        f"{args.response_length} tokens, {args.batch} per batch; {summary['epochs_run']} epochs; whole run {total:.1f} s"
    )
    print(f"pretraining sampling: {sampled / sampling_s:.1f} rollouts/s ({sampling_s:.2f} s)")
    ppo_rate = args.batch / rollout_s
    ratio = sampled / sampling_s / ppo_rate
    print(f"PPO step rollout:     {ppo_rate:.1f} rollouts/s (pretraining's rate / PPO's: {ratio:.2f})")
    print(
        f"critic epoch:         {epoch_s:.2f} s ({batches_per_epoch} rollout batches, held-out EV and save included)"
    )
    print(f"one PPO step:         {step_s:.2f} s (median of {len(steps)})")
    print(
        f"critic epoch / PPO step: {epoch_s / step_s:.2f}; per rollout batch fitted: {epoch_s / batches_per_epoch / step_s:.2f}"
    )
    print(
        f"held-out explained variance per epoch: {[round(v, 3) for v in summary['explained_variance_held_out']]}"
    )
    print(f"held-out R^2 per epoch (decides the kept epoch): {[round(v, 3) for v in summary['r2_held_out']]}")


if __name__ == "__main__":
    main()
