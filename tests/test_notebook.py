"""The Colab notebook runs end to end in smoke mode (tiny local model, no network, Hub push skipped)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "sae_ppo_qwen3_colab.ipynb"


def test_notebook_covers_the_workflow():
    source = "\n".join(cell.source for cell in nbformat.read(NOTEBOOK, as_version=4).cells)
    for step in ("%pip install", "load_in_4bit", "LoraConfig", "SAEPPOTrainer", "evaluate_accuracy"):
        assert step in source, step
    for step in ("probability_boundaries", "notebook_login", "save_and_push", "TRL_SAE_SMOKE"):
        assert step in source, step


def test_notebook_executes_in_smoke_mode(tmp_path, monkeypatch):
    pytest.importorskip("ipykernel")
    from nbclient import NotebookClient

    # The kernel inherits this environment: smoke mode, offline, one thread per BLAS pool.
    monkeypatch.setenv("TRL_SAE_SMOKE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
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
