"""Shared fixtures: a tiny Qwen3 and a character tokenizer, built locally (never downloaded)."""

from __future__ import annotations

import gc
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.durations import DurationRecorder, load_table, sort_items
from tests.torch_extensions import use_venv_extensions_dir
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3, build_tiny_qwen3_critic

# DeepSpeed's JIT-built ops in this virtualenv, where `make install-deepspeed-ops` builds them, not in the
# ~/.cache folder every virtualenv shares (a stale lock there hangs the DeepSpeed tests); subprocesses inherit it.
use_venv_extensions_dir()

# A colocated vLLM engine starts a one-process torch.distributed group on MASTER_PORT and keeps it for the
# life of the test process. Unset, TRL takes 29500 if it is free when it looks, and binds it seconds later:
# two pytest-xdist workers starting their first engines together (both reach the vLLM tests, which run last,
# at about the same time) both took it, and the second failed with EADDRINUSE. Each worker gets its own.
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("MASTER_PORT"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as _sock:
        _sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(_sock.getsockname()[1])

# Tiny models are dispatch-bound: one intra-op thread avoids OpenMP spin contention on the 2-core CI
# machine (measured ~100x faster for a tiny-Qwen3 generate when another process loads the CPU).
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="merge each test's seconds into PATH (tests/durations.json: the order make test sends tests in)",
    )


def pytest_configure(config):
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) writes it
        config.pluginmanager.register(DurationRecorder(Path(path)), "record-durations")


def pytest_collection_modifyitems(config, items):
    # A colocated vLLM engine initialises torch.distributed (one process) and keeps it for the life of the
    # test process, which would change what later tests see; those tests run after all the others.
    # Among those, the ones that start engines in other processes (two ranks, a server) go first: colocated
    # engines grow this process's memory, which is not handed back to the machine between tests.
    # Within each part, the longest first (tests/durations.py: `make test`'s --dist loadgroup sends each worker
    # its next test as it finishes one, in this order, so the ~100 s tests start early, not one at the end).
    # Every worker sorts the same way, so in each worker too the vLLM tests come last. The tests of an
    # xdist_group share a launch: the first goes early, the others after the rest (tests/durations.py).
    sort_items(items, load_table())


@pytest.fixture(autouse=True)
def _close_vllm_engines(request):
    """Shut down every vLLM engine a test left open (each holds a KV cache of VLLM_CPU_KVCACHE_SPACE GiB)."""
    yield
    if (
        request.node.get_closest_marker("vllm") is None
        or "trl_sae.generation.vllm_backend" not in sys.modules
    ):
        return
    from trl_sae.generation.vllm_backend import VLLMRollout

    gc.collect()
    for engine in [obj for obj in gc.get_objects() if isinstance(obj, VLLMRollout)]:
        engine.close()
    gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # A colocated vLLM engine left this process's (one-rank, gloo) process group up. End it while the
    # interpreter is whole: gloo work released during finalisation can abort the process (exit -6) after
    # every test passed (pytorch/pytorch#190489), which would turn a green run red.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # The "nanobind: leaked ..." report triton's extension prints at exit after a vLLM engine ran is dropped
    # by trl_sae itself (trl_sae._quiet), in this process as in a user's; the rest of stderr stays.


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def ddp_launch(request, tmp_path_factory) -> Path:
    """The folder of the session's one DDP launch of the selected ``ddp_scenario`` tests (tests/scenarios.py)."""
    from tests.scenarios import run_ddp_launch

    return run_ddp_launch(request, tmp_path_factory)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return build_tiny_qwen3(tokenizer, seed=0)


@pytest.fixture
def tiny_critic(tokenizer):
    return build_tiny_qwen3_critic(tokenizer, seed=1)
