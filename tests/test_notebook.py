"""The Colab notebook runs end to end in smoke mode (tiny local model, no network, Hub push skipped)."""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "sae_ppo_qwen3_colab.ipynb"


def test_notebook_covers_the_workflow():
    source = "\n".join(cell.source for cell in nbformat.read(NOTEBOOK, as_version=4).cells)
    for step in ("TRL_SAE_SOURCE", "load_in_4bit", "LoraConfig", "SAEPPOTrainer", "evaluate_accuracy"):
        assert step in source, step
    for step in ("probability_boundaries", "notebook_login", "save_and_push", "TRL_SAE_SMOKE"):
        assert step in source, step


def _run_install_cell(monkeypatch, smoke: bool, source: str | None) -> tuple[str, dict]:
    """Execute the notebook's first code cell (the install cell) here; its stdout and namespace."""
    if smoke:
        monkeypatch.setenv("TRL_SAE_SMOKE", "1")
    else:
        monkeypatch.delenv("TRL_SAE_SMOKE", raising=False)
    if source is None:
        monkeypatch.delenv("TRL_SAE_SOURCE", raising=False)
    else:
        monkeypatch.setenv("TRL_SAE_SOURCE", source)
    cell = next(c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
    namespace: dict = {}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(cell.source, "install-cell", "exec"), namespace)
    return stdout.getvalue(), namespace


def test_install_cell_prints_the_command_it_would_run(tmp_path, monkeypatch):
    wheel = tmp_path / "trl_sae-0.1.0-py3-none-any.whl"
    out, namespace = _run_install_cell(monkeypatch, smoke=True, source=str(wheel))
    line = next(line for line in out.splitlines() if line.startswith("would run: "))
    command = shlex.split(line.removeprefix("would run: "))
    assert command == [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        f"trl-sae[math,quantization,plots] @ file://{wheel}",
    ]
    # No torch, index URL or --upgrade in the command: Colab's CUDA torch satisfies torch>=2.6 and stays.
    install = namespace["install_command"]
    assert install("git+https://example.invalid/trl-sae.git")[-1] == (
        "trl-sae[math,quantization,plots] @ git+https://example.invalid/trl-sae.git"
    )
    assert install("trl-sae")[-1] == "trl-sae[math,quantization,plots]"


def test_install_cell_without_a_source_says_what_to_set(monkeypatch):
    out, _ = _run_install_cell(monkeypatch, smoke=True, source=None)
    assert "would run: nothing, TRL_SAE_SOURCE is not set" in out
    # A real run with no source stops before running pip, naming the variable to set.
    with pytest.raises(ValueError, match="Set TRL_SAE_SOURCE at the top of this cell"):
        _run_install_cell(monkeypatch, smoke=False, source=None)


def test_notebook_executes_in_smoke_mode(tmp_path, monkeypatch):
    pytest.importorskip("ipykernel")
    from nbclient import NotebookClient

    # The kernel inherits this environment: smoke mode, offline, one thread per BLAS pool.
    monkeypatch.setenv("TRL_SAE_SMOKE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TRL_SAE_SOURCE", "git+https://example.invalid/trl-sae.git")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = "\n".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert "smoke mode" in outputs
    assert (
        "-m pip install -q 'trl-sae[math,quantization,plots] @ git+https://example.invalid/trl-sae.git'"
        in outputs
    )
    assert "AIME 2024: avg@2" in outputs
    assert "segments, reward" in outputs
    # The model card was written (the push itself is skipped in smoke mode).
    assert "'pushed': False" in outputs and "advantage_estimator" in outputs
    html = [
        output["data"]["text/html"]
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "text/html" in output.get("data", {})
    ]
    assert any('class="seg seg-0"' in page and "boundary" in page for page in html)  # the segment picture
