"""benchmarks/sae_critic_dial.py (issue 50's registered secondary outcomes) on run files written here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sae_critic_dial.py"
sys.path.insert(0, str(SCRIPT.parent))
_spec = importlib.util.spec_from_file_location("sae_critic_dial_bench", SCRIPT)
dial = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dial)


def write_run(folder: Path, arm: str, seed: int, base: float, final: float, ev: list[float | None]) -> None:
    runs = folder / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    data = {
        "arm": arm,
        "settings": {"seed": seed},
        "curve": [{"step": 0, "accuracy": base}, {"step": 24, "accuracy": final}],
        "diagnostics": {"step": list(range(1, len(ev) + 1)), "explained_variance": ev},
    }
    (runs / f"{arm.replace(':', '-')}-seed{seed}.json").write_text(json.dumps(data))


@pytest.fixture
def sweeps(tmp_path):
    low, middle = tmp_path / "low", tmp_path / "middle"
    # low end: SAE - GAE = +6, +2 points (seeds 10, 11); seed 12 has SAE only
    write_run(low, "sae:sae", 10, 0.50, 0.66, [0.0] * 24)
    write_run(low, "sae:gae", 10, 0.50, 0.60, [0.0] * 24)
    write_run(low, "sae:sae", 11, 0.40, 0.50, [0.1] * 24)
    write_run(low, "sae:gae", 11, 0.40, 0.48, [0.1] * 24)
    write_run(low, "sae:sae", 12, 0.40, 0.50, [0.1] * 24)
    # middle: SAE - GAE = +1, -1 points; GRPO (no critic: no EV) is not a dial arm
    write_run(middle, "sae:sae", 10, 0.50, 0.61, [0.12] * 4 + [0.2] * 20)
    write_run(middle, "sae:gae", 10, 0.50, 0.60, [0.12] * 4 + [0.3] * 20)
    write_run(middle, "sae:sae", 11, 0.40, 0.47, [0.4] * 4 + [None] * 20)
    write_run(middle, "sae:gae", 11, 0.40, 0.48, [0.0] * 24)
    write_run(middle, "sae:grpo", 10, 0.50, 0.70, [None] * 24)
    return low, middle


def test_the_dial_is_sae_minus_gae_per_seed_at_each_end_and_their_difference(sweeps):
    low, middle = (dial.load_runs(folder) for folder in sweeps)
    lines = dial.dial_lines(low, middle)
    assert lines[0].startswith("| SAE - GAE | seeds | mean | 95% bootstrap | seed 10 | seed 11 |")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert rows["low (not pretrained)"].startswith(
        "| low (not pretrained) | 2 | +4.0 | [+2.0, +6.0] | +6.0 | +2.0 |"
    )
    assert rows["middle (pretrained)"].startswith(
        "| middle (pretrained) | 2 | +0.0 | [-1.0, +1.0] | +1.0 | -1.0 |"
    )
    assert rows["low minus middle"].startswith("| low minus middle | 2 | +4.0 | [+3.0, +5.0] | +5.0 | +3.0 |")


def test_explained_variance_is_averaged_in_windows_then_over_runs(sweeps):
    low, middle = (dial.load_runs(folder) for folder in sweeps)
    lines = dial.ev_window_lines({"low": low, "middle": middle})
    rows = {tuple(line.split(" | ")[:2]): line for line in lines[2:]}
    assert ("| middle", "sae:grpo") not in rows  # no critic
    sae = rows[("| middle", "sae:sae")].split(" | ")
    assert sae[2] == "2" and sae[3] == "0.260 (0.12 to 0.40)"  # steps 1-4: runs at 0.12 and 0.4
    assert sae[4] == "0.200 (0.20 to 0.20)"  # steps 5-8: seed 11 logged none
    gae = rows[("| middle", "sae:gae")].split(" | ")
    assert gae[3] == "0.060 (0.00 to 0.12)" and gae[4] == "0.150 (0.00 to 0.30)"
    assert rows[("| low", "sae:sae")].split(" | ")[2] == "3"


def test_the_page_is_written_and_a_folder_without_runs_is_refused(sweeps, tmp_path, capsys):
    low, middle = sweeps
    out = tmp_path / "dial.md"
    assert dial.main(["--low", str(low), "--middle", str(middle), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("(5 runs)") == 2 and "low minus middle" in text
    with pytest.raises(SystemExit):
        dial.main(["--low", str(tmp_path / "nothing"), "--middle", str(middle)])
    assert "--low" in capsys.readouterr().err
