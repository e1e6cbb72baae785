"""Other libraries' terminal noise is dropped at its source, one message each, and nothing else is
(trl_sae._quiet): bitsandbytes' gemm_4bit_forward warning, nanobind's leak report at exit after vLLM (triton)
ran; transformers' min_new_tokens warning at every generate call is not caused in the first place."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_sae import _quiet
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.generation.capture import generate_with_logprobs, pure_sampling_config
from trl_sae.generation.inputs import encode_prompt


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _recording(logger: logging.Logger) -> _Records:
    handler = _Records()
    logger.addHandler(handler)
    return handler


def test_generation_does_not_warn_about_min_new_tokens_at_every_call(tokenizer, monkeypatch):
    """pure_sampling_config set min_length=0 besides min_new_tokens=0, and transformers warned at every
    generate call that both were set; a trl_sae filter dropped the message. Now it is never emitted: no filter
    on the logger here, and none left in trl_sae."""
    model = build_tiny_qwen3(tokenizer, seed=0)
    ids = torch.tensor([tokenizer.encode("12+3=")])
    config = pure_sampling_config(1.0, 3, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    assert config.min_new_tokens == 0 and config.min_length is None
    logger = logging.getLogger("transformers.generation.utils")
    monkeypatch.setattr(logger, "filters", [])
    records = _recording(logging.getLogger("transformers"))
    try:
        generate_with_logprobs(model, ids, torch.ones_like(ids), config)
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not [m for m in records.messages if "min_new_tokens" in m or "min_length" in m]


def test_a_checkpoints_min_length_forces_no_minimum(tokenizer):
    """min_new_tokens=0 alone neutralises a checkpoint's min_length: generate derives min_length from it."""
    from tests.test_generation_inputs import PROMPT, peaked_qwen3

    model, first = peaked_qwen3(tokenizer)
    model.generation_config.min_length = 50
    ids = torch.tensor([encode_prompt(tokenizer, PROMPT)])
    config = pure_sampling_config(1.0, 8, [first], tokenizer.pad_token_id)
    out = generate_with_logprobs(model, ids, torch.ones_like(ids), config)
    assert out.completion_ids[0].tolist()[:1] == [first] and int(out.completion_mask[0].sum()) == 1


def test_bitsandbytes_gemm_4bit_forward_warning_is_dropped_and_only_it():
    spec = importlib.util.find_spec("bitsandbytes")  # finds the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("bitsandbytes is not installed")
    # The warning comes from a CPU with AVX512-BF16 only; the filter matches what the installed version says.
    source = (Path(spec.origin).parent / "backends" / "cpu" / "ops.py").read_text()
    assert "logger = logging.getLogger(__name__)" in source and _quiet.BITSANDBYTES_MESSAGE in source
    logger = logging.getLogger(_quiet.BITSANDBYTES_LOGGER)
    records = _recording(logger)
    try:
        logger.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
            "`pip install kernels` and the kernels >= 0.11.1",
            ModuleNotFoundError("No module named 'kernels'"),
        )
        logger.warning("some other bitsandbytes warning")
        assert records.messages == ["some other bitsandbytes warning"]
    finally:
        logger.removeHandler(records)


# A leak report as vLLM's run leaves it (abridged), printed by an atexit handler that runs after trl_sae's.
_EXIT_SCRIPT = """
import atexit, os, sys
REPORT = (
    b'nanobind: leaked 4 instances!\\n'
    b' - leaked instance 0x7fb494d6d968 of type "triton._C.libtriton.ir.attribute"\\n'
    b'nanobind: leaked 64 types!\\n'
    b' - leaked type "triton._C.libtriton.ir.location"\\n'
    b' - ... skipped remainder\\n'
    b'nanobind: this is likely caused by a reference counting issue in the binding code.\\n'
    b'See https://nanobind.readthedocs.io/en/latest/refleaks.html\\n'
    b'an error while shutting down\\n'
)
atexit.register(os.write, 2, REPORT)
import trl_sae
if sys.argv[1] == "triton":
    import triton._C.libtriton
sys.stderr.write("the run's own last line\\n")
"""


@pytest.mark.parametrize("loaded", ["triton", "nothing"])
def test_nanobind_leak_report_at_exit_is_dropped_after_triton_and_the_rest_kept(loaded):
    if loaded == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (vLLM brings it)")
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, loaded], capture_output=True, text=True, timeout=300, check=True
    )
    lines = done.stderr.splitlines()
    assert lines[0] == "the run's own last line" and lines[-1] == "an error while shutting down"
    if loaded == "triton":
        assert lines == ["the run's own last line", "an error while shutting down"]
    else:  # no nanobind extension loaded: stderr is left alone
        assert len(lines) == 9 and lines[1] == "nanobind: leaked 4 instances!"
