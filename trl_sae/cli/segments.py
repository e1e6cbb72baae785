"""``trl-sae segments``: where probability segmentation at threshold ``p`` cuts a text, in colour and in
HTML."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trl_sae.cli.common import (
    MODEL_HELP,
    CLIError,
    HelpFormatter,
    add_common_arguments,
    load_causal_lm,
    probability,
    set_threads,
)

__all__ = ["add_parser", "cmd_segments", "segment_texts"]


def _read_completions(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.text is not None:
        return [{"prompt": args.prompt, "completion": args.text}]
    path = Path(args.file)
    if not path.is_file():
        raise CLIError(f"completion file {str(path)!r} does not exist.")
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise CLIError(f"{path}:{number}: not valid JSON ({error.msg}).") from error
            if "completion" not in row:
                raise CLIError(
                    f"{path}:{number}: each line needs a 'completion' (and optionally a 'prompt')."
                )
            rows.append({"prompt": row.get("prompt", args.prompt), "completion": row["completion"]})
        if not rows:
            raise CLIError(f"{path} has no completions.")
        return rows
    return [{"prompt": args.prompt, "completion": path.read_text(encoding="utf-8")}]


def _prompt_ids(tokenizer: Any, prompt: Any, chat: bool) -> list[int]:
    from trl_sae.generation.inputs import encode_prompt

    if prompt is None or prompt == "":
        # The first completion token needs a position that predicts it: start from a special token.
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [start if start is not None else 0]
    if chat and isinstance(prompt, str) and getattr(tokenizer, "chat_template", None):
        prompt = [{"role": "user", "content": prompt}]
    return encode_prompt(tokenizer, prompt)


def segment_texts(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    threshold: float,
    temperature: float = 1.0,
    chat: bool = True,
) -> list[dict[str, Any]]:
    """Teacher-forced log-probabilities and probability boundaries (paper Eq. 5) of each completion.

    Returns report records (``prompt``, ``completion_tokens``, ``logprobs``, ``boundaries``) for
    :func:`trl_sae.demo.report.write_html_report`.
    """
    import torch

    from trl_sae.core.segmentation import probability_boundaries
    from trl_sae.demo.report import make_completion_record
    from trl_sae.generation.capture import forward_logprobs

    device = next(model.parameters()).device
    records = []
    for row in rows:
        prompt_ids = _prompt_ids(tokenizer, row.get("prompt"), chat)
        completion_ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        if not completion_ids:
            raise CLIError("a completion is empty: nothing to segment.")
        prompt = torch.tensor([prompt_ids], device=device)
        completion = torch.tensor([completion_ids], device=device)
        with torch.no_grad():
            logprobs, _ = forward_logprobs(
                model, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion), temperature
            )
        boundaries = probability_boundaries(logprobs, torch.ones_like(completion), threshold)
        records.append(
            make_completion_record(
                tokenizer,
                completion_ids,
                logprobs[0].tolist(),
                boundaries[0].tolist(),
                prompt=row.get("prompt") or "",
            )
        )
    return records


def cmd_segments(args: argparse.Namespace) -> int:
    from trl_sae.demo.report import render_segments_terminal, split_segments, write_html_report

    if not 0.0 < args.p < 1.0:
        raise CLIError(f"-p must be in (0, 1), got {args.p}.")
    rows = _read_completions(args)
    set_threads(args.threads)
    model, tokenizer = load_causal_lm(args.model, args.device, progress=not args.no_progress)
    records = segment_texts(model, tokenizer, rows, args.p, args.temperature, chat=not args.no_chat)
    use_color = args.color or (not args.no_color and sys.stdout.isatty())
    for number, record in enumerate(records, start=1):
        tokens, boundaries = record["completion_tokens"], record["boundaries"]
        segments = split_segments(boundaries)
        print(
            f"[{number}] {len(tokens)} tokens, {len(segments)} segments at p = {args.p:g} "
            f"(mean length {len(tokens) / max(1, len(segments)):.1f})"
        )
        print(render_segments_terminal(tokens, boundaries, use_color=use_color))
        print()
    html_path = Path(args.html)
    write_html_report(
        html_path,
        title=f"Probability segmentation of {args.model} at p = {args.p:g}",
        summary={
            "model": args.model,
            "p": args.p,
            "temperature": args.temperature,
            "completions": len(records),
        },
        completions=records,
        threshold=args.p,
    )
    print(f"HTML written to {html_path}")
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``segments`` to the ``trl-sae`` subcommands (called by :func:`trl_sae.cli.app.build_parser`)."""
    segments = commands.add_parser(
        "segments",
        help="Show where probability segmentation at threshold p cuts a text.",
        formatter_class=HelpFormatter,
        description="Score a completion with the model (teacher forcing) and cut it where a token's probability\n"
        "is below p (paper Eq. 5). Segments alternate colours in the terminal (boundary tokens bold and\n"
        "underlined; '|' marks them without colour) and in the HTML file, whose tooltips show each token's\n"
        'probability. A .jsonl file holds one {"prompt": ..., "completion": ...} per line; any other file is\n'
        "one completion.",
        epilog="examples:\n  trl-sae segments --model Qwen/Qwen3-0.6B --prompt 'What is 17*23?' --text '17*23 = 391.'\n"
        "  trl-sae segments --model ./trl-sae-demo/model --file completions.jsonl -p 0.3 --html seg.html",
    )
    segments.add_argument("--model", required=True, help=MODEL_HELP)
    text = segments.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", default=None, help="The completion to segment.")
    text.add_argument("--file", default=None, help="A .jsonl of prompt/completion rows, or a text file.")
    segments.add_argument("--prompt", default=None, help="The prompt the completion answers (recommended).")
    segments.add_argument("-p", type=probability, default=0.2, help="Probability threshold p.")
    segments.add_argument(
        "--temperature", type=float, default=1.0, help="Temperature of the scored distribution."
    )
    segments.add_argument("--html", default="segments.html", help="Where to write the HTML view.")
    segments.add_argument(
        "--no-chat", action="store_true", help="Do not wrap the prompt in the chat template."
    )
    segments.add_argument(
        "--no-color", action="store_true", help="Mark boundaries with '|' instead of colours."
    )
    segments.add_argument("--color", action="store_true", help="Colours even when stdout is not a terminal.")
    add_common_arguments(segments)
    segments.set_defaults(handler=cmd_segments)
