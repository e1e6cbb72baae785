"""Human-readable views of a run: a self-contained HTML report and a terminal rendering of segments.

The HTML report (one file, no network: inline CSS, curves embedded as base64 PNG) has three parts:

* a summary table (accuracy before/after, timings, hyperparameters, ...);
* completions rendered token by token, each probability segment (paper Eq. 5: a token opens a segment
  when its probability is below ``p``) on its own alternating background colour, boundary tokens
  marked, and a tooltip with each token's probability and log-probability;
* curves (reward, accuracy, ... vs step) drawn with matplotlib's Agg canvas.

``render_segments_terminal`` gives the same segment view with ANSI colours for ``trl-sae segments``.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "make_completion_record",
    "render_curves_png",
    "render_segments_html",
    "render_segments_terminal",
    "split_segments",
    "write_html_report",
]

# Alternating segment backgrounds: light enough for black text, distinct enough side by side.
_SEGMENT_COLOURS = ("#dbeafe", "#fde68a", "#d1fae5", "#fbcfe8")
# ANSI 256-colour backgrounds with the same idea (blue, yellow, green, pink) and black text.
_ANSI_BACKGROUNDS = (153, 229, 157, 218)
_ANSI_RESET = "\x1b[0m"

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #111; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table.summary { border-collapse: collapse; }
table.summary td, table.summary th { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
table.summary th { background: #f3f4f6; }
.completion { border: 1px solid #e5e7eb; border-radius: 6px; padding: 8px 12px; margin: 12px 0; }
.meta { color: #555; font-size: 0.9em; margin-bottom: 6px; }
.prompt { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; color: #374151; }
.tokens { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap;
          line-height: 1.8; word-break: break-all; }
.seg { border-radius: 3px; padding: 1px 0; }
.seg-0 { background: #dbeafe; } .seg-1 { background: #fde68a; }
.seg-2 { background: #d1fae5; } .seg-3 { background: #fbcfe8; }
.tok.boundary { border-left: 2px solid #dc2626; font-weight: bold; }
.tok.special { color: #6b7280; font-style: italic; }
.tok.decision { outline: 2px solid #111; outline-offset: -1px; text-decoration: underline; }
.reward-1 { color: #15803d; font-weight: bold; } .reward-0 { color: #b91c1c; font-weight: bold; }
.legend span { padding: 2px 6px; margin-right: 6px; border-radius: 3px; }
img.curve { max-width: 100%; border: 1px solid #eee; }
.note { color: #6b7280; font-size: 0.9em; }
"""


# --------------------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------------------
def split_segments(boundaries: Sequence[bool]) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of the segments: token 0 and every token with a boundary open one.

    ``boundaries[0]`` does not matter (the first token always opens the first segment), matching
    docs/design.md's convention.
    """
    n = len(boundaries)
    if n == 0:
        return []
    starts = [0] + [t for t in range(1, n) if bool(boundaries[t])]
    return [(start, end) for start, end in zip(starts, [*starts[1:], n])]


def _visible(token: str) -> str:
    # Make whitespace-only structure visible without changing the layout: a newline keeps its line
    # break but shows a return arrow first.
    return token.replace("\n", "↵\n")


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def _prompt_text(prompt: Any) -> str:
    """A chat prompt (list of messages) as ``role: content`` lines, or a plain string as is."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        lines = []
        for message in prompt:
            if isinstance(message, Mapping):
                lines.append(f"{message.get('role', '?')}: {message.get('content', '')}")
            else:
                lines.append(str(message))
        return "\n".join(lines)
    return str(prompt)


def render_segments_html(
    tokens: Sequence[str],
    boundaries: Sequence[bool],
    logprobs: Sequence[float] | None = None,
    special_tokens: Sequence[str] = (),
    decisions: Sequence[int] | None = None,
) -> str:
    """One ``<span class="seg">`` per segment holding one ``<span class="tok">`` per token.

    Boundary tokens (``boundaries[t]`` True) get the ``boundary`` class (a red left bar); each token's
    tooltip gives its position, probability and log-probability when ``logprobs`` is given. Token indices
    in ``decisions`` (a task's known decision tokens, e.g. :mod:`trl_sae.demo.decision_task`) get the
    ``decision`` class (outlined and underlined), so segments can be compared with them. All text is
    HTML-escaped.
    """
    if len(boundaries) != len(tokens):
        raise ValueError(f"Got {len(tokens)} tokens but {len(boundaries)} boundary flags.")
    if logprobs is not None and len(logprobs) != len(tokens):
        raise ValueError(f"Got {len(tokens)} tokens but {len(logprobs)} log-probabilities.")
    specials = set(special_tokens)
    decision_set = {int(t) for t in decisions or ()}
    parts = []
    for index, (start, end) in enumerate(split_segments(boundaries)):
        token_spans = []
        for t in range(start, end):
            classes = ["tok"]
            if bool(boundaries[t]):
                classes.append("boundary")
            if tokens[t] in specials:
                classes.append("special")
            if t in decision_set:
                classes.append("decision")
            tip = f"t={t} token={tokens[t]!r}"
            if logprobs is not None:
                lp = float(logprobs[t])
                tip += f" p={math.exp(lp):.3f} logprob={lp:.3f}"
            if bool(boundaries[t]):
                tip += " (boundary)"
            if t in decision_set:
                tip += " (decision token)"
            token_spans.append(
                f'<span class="{" ".join(classes)}" title="{html.escape(tip, quote=True)}">'
                f"{html.escape(_visible(tokens[t]), quote=False)}</span>"
            )
        parts.append(
            f'<span class="seg seg-{index % len(_SEGMENT_COLOURS)}" data-segment="{index}">'
            + "".join(token_spans)
            + "</span>"
        )
    return "".join(parts)


def render_segments_terminal(
    tokens: Sequence[str],
    boundaries: Sequence[bool],
    use_color: bool = True,
    marker: str = "|",
) -> str:
    """A completion with its segments in alternating ANSI background colours.

    Boundary tokens are also bold and underlined. With ``use_color=False`` (a pipe, a log file) segments
    are separated by ``marker`` instead, so the segmentation survives in plain text.
    """
    if len(boundaries) != len(tokens):
        raise ValueError(f"Got {len(tokens)} tokens but {len(boundaries)} boundary flags.")
    out = []
    for index, (start, end) in enumerate(split_segments(boundaries)):
        # Never emit a raw ESC from model output into the user's terminal.
        texts = [_visible(tok).replace("\x1b", "␛") for tok in tokens[start:end]]
        if not use_color:
            out.append((marker if index > 0 else "") + "".join(texts))
            continue
        background = f"\x1b[30;48;5;{_ANSI_BACKGROUNDS[index % len(_ANSI_BACKGROUNDS)]}m"
        # Only a segment's first token can be a boundary; style it bold + underlined, then switch those
        # two attributes off (22;24) and keep the background for the rest of the segment.
        head = f"\x1b[1;4m{texts[0]}\x1b[22;24m" if bool(boundaries[start]) else texts[0]
        text = head + "".join(texts[1:])
        # A newline inside a coloured run would paint the rest of the terminal line: close the colour
        # before each line break and reopen it after.
        out.append("\n".join(f"{background}{line}{_ANSI_RESET}" if line else "" for line in text.split("\n")))
    return "".join(out)


def make_completion_record(
    tokenizer: Any,
    completion_ids: Sequence[int],
    logprobs: Sequence[float],
    boundaries: Sequence[bool],
    prompt: Any = "",
    reward: float | None = None,
    decisions: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A ``completions`` entry for ``write_html_report`` from token ids (decoded one token at a time).

    ``decisions``: token indices of the task's known decision tokens, marked in the report (optional).
    """
    ids = [int(i) for i in completion_ids]
    record = {
        "prompt": prompt,
        "completion_tokens": [tokenizer.decode([i]) for i in ids],
        "logprobs": [float(x) for x in logprobs][: len(ids)],
        "boundaries": [bool(b) for b in boundaries][: len(ids)],
        "reward": reward,
    }
    if decisions is not None:
        record["decisions"] = [int(t) for t in decisions if 0 <= int(t) < len(ids)]
    return record


# --------------------------------------------------------------------------------------------------
# Curves
# --------------------------------------------------------------------------------------------------
def render_curves_png(curves: Mapping[str, Sequence[tuple[float, float]]], ncols: int = 2) -> bytes:
    """All curves as one PNG, one panel per curve (value vs step).

    Uses matplotlib's object API with an Agg canvas rather than ``pyplot``, so it never switches the
    caller's global backend (a notebook keeps its inline backend).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [name for name, points in curves.items() if len(points) > 0]
    if not names:
        raise ValueError("No curve has any points to plot.")
    ncols = max(1, min(ncols, len(names)))
    nrows = math.ceil(len(names) / ncols)
    figure = Figure(figsize=(5.0 * ncols, 3.2 * nrows), dpi=100)
    FigureCanvasAgg(figure)
    for index, name in enumerate(names):
        axes = figure.add_subplot(nrows, ncols, index + 1)
        steps = [float(p[0]) for p in curves[name]]
        values = [float(p[1]) for p in curves[name]]
        axes.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.5)
        axes.set_title(name)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------
def _summary_rows(summary: Mapping[str, Any]) -> str:
    rows = []
    for key, value in summary.items():
        if isinstance(value, Mapping):
            # e.g. {"accuracy": {"before": 0.2, "after": 0.5}} -> one row per inner key.
            for inner_key, inner_value in value.items():
                rows.append((f"{key} / {inner_key}", inner_value))
        else:
            rows.append((str(key), value))
    return "\n".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_format_value(v))}</td></tr>" for k, v in rows
    )


def write_html_report(
    path: str | Path,
    title: str,
    summary: Mapping[str, Any],
    completions: Sequence[Mapping[str, Any]] = (),
    curves: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    threshold: float | None = None,
    embed_images: bool = True,
    special_tokens: Sequence[str] = ("<|im_end|>", "<|endoftext|>", "<|im_start|>"),
) -> Path:
    """Write a self-contained HTML report and return its path.

    Args:
        path: the ``.html`` file to write (parent folders are created).
        title: page title and heading.
        summary: name -> value rows (a value that is itself a dict becomes one row per key).
        completions: dicts with ``prompt`` (text or chat messages), ``completion_tokens`` (list of token
            strings), ``logprobs`` (list of floats, optional), ``boundaries`` (list of bools) and
            ``reward`` (optional float) and ``decisions`` (optional token indices of known decision
            tokens, outlined; the completion's header then gives the boundaries' precision and recall
            against them).
        curves: name -> ``[(step, value), ...]``; drawn as PNG panels. Skipped, with a note in the page,
            when matplotlib is not installed.
        threshold: the probability threshold ``p`` that produced the boundaries, shown in the legend.
        embed_images: embed the PNG as base64 (one portable file) if True, else write ``<stem>_curves.png``
            next to the HTML and link it.
        special_tokens: tokens shown greyed out (e.g. the end-of-turn token).

    Returns:
        The path of the HTML file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    esc = html.escape
    body = [f"<h1>{esc(title)}</h1>"]

    body.append("<h2>Summary</h2>")
    body.append(f'<table class="summary">\n{_summary_rows(summary)}\n</table>')

    if curves:
        body.append("<h2>Curves</h2>")
        try:
            png = render_curves_png(curves)
        except ImportError:
            body.append('<p class="note">matplotlib is not installed; curves were not drawn.</p>')
        except ValueError:
            body.append('<p class="note">No curve has any points.</p>')
        else:
            if embed_images:
                source = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            else:
                png_path = path.with_name(f"{path.stem}_curves.png")
                png_path.write_bytes(png)
                source = png_path.name
            body.append(f'<img class="curve" alt="training curves" src="{esc(source, quote=True)}">')

    if completions:
        body.append("<h2>Completions</h2>")
        rule = (
            f"a token opens a new segment when its probability is below p = {threshold:g}"
            if threshold is not None
            else "a token with a red bar opens a new segment"
        )
        legend = "".join(
            f'<span style="background:{colour}">segment {i + 1}</span>'
            for i, colour in enumerate(_SEGMENT_COLOURS[:2])
        )
        body.append(
            f'<p class="legend">Segments alternate colours ({esc(rule)}); boundary tokens have a red bar; '
            f"hover a token for its probability. {legend}</p>"
        )
        if any(record.get("decisions") is not None for record in completions):
            body.append(
                '<p class="legend">Outlined, underlined tokens are the task\'s true decision tokens: '
                '<span class="tok decision">x</span></p>'
            )
        for number, record in enumerate(completions):
            tokens = [str(t) for t in record["completion_tokens"]]
            boundaries = [bool(b) for b in record.get("boundaries") or [False] * len(tokens)]
            logprobs = record.get("logprobs")
            reward = record.get("reward")
            num_segments = len(split_segments(boundaries))
            meta = [f"#{number + 1}", f"{len(tokens)} tokens", f"{num_segments} segments"]
            decisions = record.get("decisions")
            if decisions is not None:
                marked = {t for t, flag in enumerate(boundaries) if flag}
                hits = len(marked & set(decisions))
                meta.append(
                    f"{len(decisions)} decision tokens, {hits} of them boundaries "
                    f"({hits}/{len(marked)} boundaries on decisions)"
                )
            reward_html = ""
            if reward is not None:
                css = "reward-1" if float(reward) > 0 else "reward-0"
                reward_html = f' · reward <span class="{css}">{esc(_format_value(float(reward)))}</span>'
            body.append(
                '<div class="completion">'
                f'<div class="meta">{esc(" · ".join(meta))}{reward_html}</div>'
                f'<div class="prompt">{esc(_prompt_text(record.get("prompt", "")))}</div>'
                f'<div class="tokens">{render_segments_html(tokens, boundaries, logprobs, special_tokens, decisions)}'
                "</div></div>"
            )

    document = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
    path.write_text(document, encoding="utf-8")
    return path
