"""Two CPU processes (gloo) under `accelerate launch`: training runs and metrics are gathered across ranks."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.scenarios import in_the_ddp_launch

# Appended to every two-rank script: end the process group, then the process, skipping interpreter
# finalisation. A gloo rank can abort at exit ("terminate called without an active exception", exit -6) after
# all its work is done: objects still referenced at finalisation (these scripts keep their trainers in module
# globals) release gloo work whose tensors need the GIL while Python is being torn down
# (pytorch/pytorch#190489, #179291). Ending the group first was not enough: a ZeRO-3 rank still aborted in CI.
# The scripts write their results before this point, with files closed; the tests check those.
SKIP_FINALISATION = """
import os, sys
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""
END_PROCESS_GROUP = (
    """
import torch.distributed
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
"""
    + SKIP_FINALISATION
)

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
    used = [trainer.rollouts.prompt_indices(step) for step in range(2)]
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


def run_launch(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run an ``accelerate launch`` command; past ``timeout`` seconds kill it WITH its ranks and fail.

    ``subprocess.run(timeout=...)`` kills only the launcher, and torchrun starts each rank in a session of its
    own: ranks stuck in a collective would outlive the test (and hold its output pipes open).
    """
    import psutil

    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(process.pid)
        for child in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        stdout, stderr = process.communicate()
        pytest.fail(
            f"the launch did not finish in {timeout:.0f} s (ranks waiting in a collective?):\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


FSDP2_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "accelerate_configs" / "fsdp2.yaml"


def launch_env() -> dict[str, str]:
    """The ranks' environment: one intra-op thread each, and this checkout first on the import path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


def two_rank_command(script: Path, *script_args: str, fsdp: bool = False) -> list[str]:
    """``accelerate launch`` of ``script`` on two processes: DDP (``--multi_gpu``) or fsdp2.yaml's FSDP2.

    Both pick accelerate's torchrun launcher; the scripts' ``use_cpu=True`` makes each process a gloo CPU rank
    (accelerate's ``--cpu`` alone would start a single process).
    """
    backend = ["--config_file", str(FSDP2_CONFIG)] if fsdp else ["--multi_gpu"]
    return [
        sys.executable, "-m", "accelerate.commands.launch", *backend,
        "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port()),
        "--mixed_precision", "no", "--dynamo_backend", "no",
        str(script), *script_args,
    ]  # fmt: skip


def launch_two_ranks(
    script: Path,
    text: str,
    *script_args: str,
    fsdp: bool = False,
    timeout: float = 600,
    end_process_group: bool = True,
) -> subprocess.CompletedProcess:
    """Write ``text`` to ``script`` (ending with :data:`END_PROCESS_GROUP`, or only :data:`SKIP_FINALISATION`
    where the group holds aborted work), run it on two gloo ranks with :func:`run_launch` (a hung rank is
    killed) and check that the launch succeeded."""
    script.write_text(text + (END_PROCESS_GROUP if end_process_group else SKIP_FINALISATION))
    result = run_launch(two_rank_command(script, *script_args, fsdp=fsdp), launch_env(), timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@in_the_ddp_launch("distributed_gather")
def test_two_cpu_processes_gather_metrics(ddp_launch):
    ranks = [json.loads((ddp_launch / "distributed_gather" / f"rank{r}.json").read_text()) for r in (0, 1)]
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


SPLIT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.set_num_threads(1)
    from trl_sae.demo.tiny import build_char_tokenizer
    from trl_sae.trainer.objectives.losses import LOSS_AGG_MODES
    from tests.test_loss_aggregation import fixed_batch, split_trainer, update_delta

    rank = int(os.environ["RANK"])
    trainer = split_trainer(sys.argv[1], build_char_tokenizer(), rows=4)
    batch = fixed_batch(trainer, slice(4 * rank, 4 * rank + 4))  # this rank's half of the same 8 rollouts
    # A budget of 20 tokens makes 3 micro-batches on rank 0 and 2 on rank 1.
    splits = {"4x1": {}, "1x4": {"per_device_train_batch_size": 1}, "budget": {"max_tokens_per_microbatch": 20}}
    deltas = {
        (mode, name): update_delta(trainer, batch, loss_agg_mode=mode, **settings)
        for mode in LOSS_AGG_MODES for name, settings in splits.items()
    }
    torch.save(deltas, os.path.join(sys.argv[1], f"deltas{rank}.pt"))
    """
)


@in_the_ddp_launch("distributed_split")
def test_two_processes_update_as_one_process_on_the_whole_mini_batch(ddp_launch, tmp_path, tokenizer):
    """DDP over 2 gloo ranks x 4 rollouts (split by rows or by a token budget, a different number of
    micro-batches per rank) moves the weights as one process with the 8 rollouts in one micro-batch."""
    from tests.test_loss_aggregation import fixed_batch, relative_difference, split_trainer, update_delta
    from trl_sae.trainer.objectives.losses import LOSS_AGG_MODES

    ranks = [torch.load(ddp_launch / "distributed_split" / f"deltas{r}.pt") for r in (0, 1)]
    trainer = split_trainer(str(tmp_path / "one"), tokenizer, rows=8)
    batch = fixed_batch(trainer)
    for mode in LOSS_AGG_MODES:
        whole = update_delta(trainer, batch, loss_agg_mode=mode)
        for name in ("4x1", "1x4", "budget"):
            assert torch.equal(ranks[0][mode, name], ranks[1][mode, name])  # DDP kept the ranks together
            assert relative_difference(ranks[0][mode, name], whole) < 1e-5, (mode, name)


FEW_UNITS_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.set_num_threads(1)
    from trl_sae.demo.tiny import build_char_tokenizer
    from tests.test_distributed import few_units_deltas

    rank = int(os.environ["RANK"])
    deltas = few_units_deltas(sys.argv[1], build_char_tokenizer(), slice(4 * rank, 4 * rank + 4))
    torch.save(deltas, os.path.join(sys.argv[1], f"few{rank}.pt"))
    """
)


def few_units_deltas(output_dir: str, tokenizer, rows: slice) -> dict[str, torch.Tensor]:
    """Update deltas of loss terms counting fewer units over the 8 rows than there are processes: the
    positive NLL with one positive completion (row 1), and the policy term with every completion but row 5
    truncated under mask_truncated_completions; each under seq-mean-token-mean (one unit: one row)."""
    from tests.test_loss_aggregation import fixed_batch, split_trainer, update_delta

    trainer = split_trainer(output_dir, tokenizer, rows=len(range(8)[rows]))
    batch = fixed_batch(trainer, rows)
    batch.scores = (torch.arange(8) == 1).float()[rows]
    batch.is_truncated = (torch.arange(8) != 5)[rows]
    mode = "seq-mean-token-mean"
    return {
        "positive_nll": update_delta(trainer, batch, loss_agg_mode=mode, positive_nll_coef=1.0),
        "truncated": update_delta(trainer, batch, loss_agg_mode=mode, mask_truncated_completions=True),
    }


@in_the_ddp_launch("distributed_few_units")
def test_two_processes_weigh_a_term_with_fewer_units_than_processes_as_one_process(
    ddp_launch, tmp_path, tokenizer
):
    """A loss term counting 1 row over 2 processes (each's share of the count: 0.5) moves the weights as
    one process holding every row; raising the share to 1 halved the term after DDP's mean."""
    from tests.test_loss_aggregation import relative_difference

    ranks = [torch.load(ddp_launch / "distributed_few_units" / f"few{r}.pt") for r in (0, 1)]
    whole = few_units_deltas(str(tmp_path / "one"), tokenizer, slice(0, 8))
    for name in ("positive_nll", "truncated"):
        assert torch.equal(ranks[0][name], ranks[1][name])  # DDP kept the ranks together
        assert relative_difference(ranks[0][name], whole[name]) < 1e-5, name


WHITEN_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.set_num_threads(1)
    from trl_sae.demo.tiny import build_char_tokenizer
    from tests.test_precision import whitening_batch, whitening_trainer

    rank = int(os.environ["RANK"])
    trainer = whitening_trainer(os.path.join(sys.argv[1], f"rank{rank}"), build_char_tokenizer())
    batch = whitening_batch(trainer, slice(0, 4) if rank == 0 else slice(4, 6))  # 4 rows here, 2 there
    fields = ("token_rewards", "advantages", "returns", "mask")
    torch.save({name: getattr(batch, name) for name in fields}, os.path.join(sys.argv[1], f"whiten{rank}.pt"))
    """
)


@in_the_ddp_launch("distributed_whiten")
def test_two_processes_whiten_rewards_and_advantages_as_one_process_holding_both(
    ddp_launch, tmp_path, tokenizer
):
    """Reward and advantage whitening over 2 gloo ranks with different rows (4 and 2, of different lengths)
    gives what one process holding all 6 rows gives."""
    from tests.test_precision import whitening_batch, whitening_trainer

    ranks = [torch.load(ddp_launch / "distributed_whiten" / f"whiten{r}.pt") for r in (0, 1)]
    whole = whitening_batch(whitening_trainer(tmp_path / "one", tokenizer), slice(None))
    for name in ("token_rewards", "advantages", "returns"):
        for rank, rows in zip(ranks, (slice(0, 4), slice(4, 6))):
            width = rank["mask"].shape[1]
            torch.testing.assert_close(rank[name], getattr(whole, name)[rows, :width], rtol=1e-5, atol=1e-6)
    # The whole batch is whitened over its 21 valid tokens; each rank's own share is not (rank 1's 5 tokens
    # are not mean 0), so a per-process whitening could not have given the result above.
    advantages = whole.advantages[whole.mask]
    assert advantages.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert advantages.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert abs(ranks[1]["advantages"][ranks[1]["mask"].bool()].mean().item()) > 0.1
