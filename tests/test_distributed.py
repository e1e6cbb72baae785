"""Two CPU processes (gloo) under `accelerate launch`: training runs and metrics are gathered across ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    rank = int(os.environ["RANK"])

    def rank_reward(prompts, completions, completion_ids, **columns):
        # rank 0 scores 1, rank 1 scores 0: only a gathered mean can be 0.5
        return [1.0 if rank == 0 else 0.0] * len(completions)

    tokenizer = build_char_tokenizer()
    config = SAEPPOConfig(
        output_dir=sys.argv[1], per_device_train_batch_size=4, num_generations=2, response_length=6,
        max_steps=2, learning_rate=1e-3, critic_learning_rate=1e-3, temperature=1.0, report_to="none",
        disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, stop_token=None,
    )
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]})
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0), reward_funcs=rank_reward, args=config,
        train_dataset=dataset, processing_class=tokenizer,
    )
    trainer.train()
    used = [trainer._prompt_indices(step) for step in range(2)]
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    checksum = float(sum(p.double().sum() for p in policy.parameters()))
    logs = [e for e in trainer.state.log_history if "reward/mean" in e]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump({"logs": logs, "prompts": used, "world": trainer.accelerator.num_processes,
                   "checksum": checksum}, handle)
    """
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(600)
def test_two_cpu_processes_gather_metrics(tmp_path):
    script = tmp_path / "train_two_ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        # --multi_gpu selects accelerate's torchrun launcher; the config's use_cpu=True then makes each
        # process a gloo CPU rank (accelerate's --cpu alone would start a single process).
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port()),
        "--mixed_precision", "no", "--dynamo_backend", "no",
        str(script), str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    for r in ranks:
        assert len(r["logs"]) == 2
        assert all(entry["reward/mean"] == pytest.approx(0.5) for entry in r["logs"])
        assert all(entry["episode"] == 8 * (i + 1) for i, entry in enumerate(r["logs"]))
    # every rank logs the same gathered numbers
    for key in ("reward/mean", "completions/mean_length", "advantages/std", "loss/policy", "values/mean"):
        assert [e[key] for e in ranks[0]["logs"]] == pytest.approx([e[key] for e in ranks[1]["logs"]]), key
    # the ranks draw disjoint prompts at each step, and DDP keeps their weights identical
    for step in range(2):
        assert not set(ranks[0]["prompts"][step]) & set(ranks[1]["prompts"][step])
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-9)
