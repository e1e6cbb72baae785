"""The HTML report and the terminal rendering of segments."""

from __future__ import annotations

import base64
import math
import re

import pytest

from trl_sae.demo.report import (
    make_completion_record,
    render_segments_html,
    render_segments_terminal,
    split_segments,
    write_html_report,
)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_split_segments_ignores_the_first_flag():
    assert split_segments([]) == []
    assert split_segments([False, False, True, False, True]) == [(0, 2), (2, 4), (4, 5)]
    assert split_segments([True, False, True]) == split_segments([False, False, True])


def test_segments_html_escapes_and_has_one_span_per_segment():
    tokens = ["<b>", "&", '"', "x", "\n", "y"]
    boundaries = [False, False, True, False, True, False]
    logprobs = [math.log(0.9), math.log(0.8), math.log(0.1), math.log(0.7), math.log(0.05), 0.0]
    out = render_segments_html(tokens, boundaries, logprobs)
    assert out.count('<span class="seg ') == 3
    assert out.count('class="tok') == 6
    assert out.count("boundary") == 2 * 2  # class + tooltip on each boundary token
    assert "&lt;b&gt;" in out and "&amp;" in out and "<b>" not in out
    assert "p=0.100" in out and "p=0.050" in out
    assert "↵\n" in out  # newlines are shown and still break the line
    with pytest.raises(ValueError):
        render_segments_html(["a"], [True, False])


def _report_inputs():
    completions = [
        {
            "prompt": [{"role": "user", "content": "Add: 1 <2>"}],
            "completion_tokens": ["1", "+", "2", "=", "3", "\n", "A", "<script>"],
            "logprobs": [-0.1, -0.05, -2.5, -0.01, -1.9, -0.2, -0.3, -0.4],
            "boundaries": [True, False, True, False, True, False, False, False],
            "reward": 1.0,
        },
        {
            "prompt": "plain & simple",
            "completion_tokens": ["x", "y"],
            "logprobs": [-0.5, -0.5],
            "boundaries": [False, True],
            "reward": 0.0,
        },
    ]
    curves = {"reward": [(0, 0.1), (1, 0.3), (2, 0.5)], "accuracy": [(0, 0.2), (2, 0.6)]}
    summary = {
        "held-out accuracy": {"before": 0.21, "after": 0.64},
        "model <tiny>": "qwen3",
        "steps": 3,
    }
    return summary, completions, curves


def test_write_html_report_embeds_everything(tmp_path):
    summary, completions, curves = _report_inputs()
    path = write_html_report(
        tmp_path / "sub" / "report.html", "Demo <run>", summary, completions, curves, threshold=0.2
    )
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert "<title>Demo &lt;run&gt;</title>" in text
    assert "held-out accuracy / before" in text and "0.64" in text and "model &lt;tiny&gt;" in text
    # Tokens and prompts are escaped: the model's "<script>" token never becomes markup.
    assert "&lt;script&gt;" in text and "<script>" not in text
    assert "user: Add: 1 &lt;2&gt;" in text and "plain &amp; simple" in text
    # One span per segment: 3 in the first completion, 2 in the second.
    assert text.count('<span class="seg ') == 5
    assert "p = 0.2" in text
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert match is not None
    assert base64.b64decode(match.group(1)).startswith(b"\x89PNG")
    assert 'class="reward-1"' in text and 'class="reward-0"' in text


def test_write_html_report_can_write_the_png_next_to_the_html(tmp_path):
    summary, completions, curves = _report_inputs()
    path = write_html_report(tmp_path / "r.html", "t", summary, completions, curves, embed_images=False)
    png = tmp_path / "r_curves.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    assert 'src="r_curves.png"' in path.read_text()
    # Nothing but a summary is fine too.
    bare = write_html_report(tmp_path / "bare.html", "t", {"a": 1.5})
    assert "<h2>Completions</h2>" not in bare.read_text() and "1.5" in bare.read_text()


def test_render_segments_terminal_colours_and_plain_text():
    tokens = ["3", "+", "5", "=", "8", "\n", "A", "\x1b"]
    boundaries = [False, False, True, False, False, False, True, False]
    coloured = render_segments_terminal(tokens, boundaries)
    assert "\x1b[" in coloured
    stripped = ANSI.sub("", coloured)
    assert stripped == "3+5=8↵\nA␛"  # the text survives; a raw ESC from the model is neutralised
    assert "\x1b[1;4m5" in coloured  # boundary tokens are bold + underlined
    # Different segments get different backgrounds.
    backgrounds = re.findall(r"48;5;(\d+)m", coloured)
    assert len(set(backgrounds)) == 3
    plain = render_segments_terminal(tokens, boundaries, use_color=False)
    assert plain == "3+|5=8↵\n|A␛"
    assert render_segments_terminal([], []) == ""


def test_make_completion_record_round_trips_through_the_report(tmp_path, tokenizer):
    ids = tokenizer("1+2=3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    record = make_completion_record(
        tokenizer, ids, [-0.1] * len(ids), [False, False, True, False, False, False], "Add: 1 2", 1.0
    )
    assert record["completion_tokens"] == ["1", "+", "2", "=", "3", "<|im_end|>"]
    text = write_html_report(tmp_path / "x.html", "t", {}, [record]).read_text()
    assert "&lt;|im_end|&gt;" in text and 'class="tok special"' in text
