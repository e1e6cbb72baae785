"""``trl-sae``: the command-line front door.

Commands (``trl-sae COMMAND --help`` for each one's options and an example):

* ``demo``       offline end-to-end run: tiny Qwen3, synthetic arithmetic, SFT warm start, PPO with SAE,
                 accuracy before/after and an HTML report (no network, a few minutes on a laptop CPU);
* ``train``      PPO with SAE from a YAML recipe (TRL's ``TrlParser``), e.g. ``examples/*.yaml``;
* ``eval``       avg@k and pass@k of a model on math test sets, graded by math-verify;
* ``segments``   where probability segmentation at threshold ``p`` cuts a text, in colour and in HTML;
* ``correlate``  correlation of GAE / SAE advantages with a Monte-Carlo ``A*`` (paper Section 5.3.2);
* ``segstats``   segment length and boundary count as functions of ``p`` (the paper's appendix figure);
* ``docs``       the Markdown table of ``SAEPPOConfig``'s own fields (docs/reference/config.md and its
                 freshness check).

Heavy libraries are imported inside the commands, so ``trl-sae --help`` answers at once. A user error
(a missing file, a bad model path, an unreachable dataset) ends in one ``error:`` line, not a
traceback; ``TRL_SAE_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from trl_sae.cli import correlate, demo, docs, segments, segstats, train
from trl_sae.cli import eval as evaluate
from trl_sae.cli.common import PROG, CLIError, first_line

__all__ = ["build_parser", "main"]

# The commands in the order `trl-sae --help` lists them; each module adds its own subparser.
COMMANDS = (demo, train, evaluate, segments, correlate, segstats, docs)


def build_parser() -> argparse.ArgumentParser:
    """The ``trl-sae`` parser with every subcommand (``train`` only lists its help; TrlParser parses it)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="PPO with Segmental Advantage Estimation (SAE) on Hugging Face TRL.",
        epilog="examples:\n  trl-sae demo\n  trl-sae train examples/qwen3_0.6b_qlora.yaml\n"
        "  trl-sae eval --model ./out --datasets aime-2024 -k 16 --temperature 0.6\n"
        "  trl-sae segments --model Qwen/Qwen3-0.6B --text 'Two plus two is four.'\n\n"
        "`trl-sae COMMAND --help` explains each command.",
    )
    from trl_sae import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------
def _hint_for(error: BaseException) -> str | None:
    """What to do next for errors that commonly come from a recipe meeting the wrong machine."""
    text = str(error)
    if type(error).__name__ == "DatasetUnavailableError":
        return (
            "offline? download the dataset elsewhere (`hf download <id> --repo-type dataset --local-dir DIR`) "
            "and pass DIR as dataset_name / eval_dataset_name."
        )
    if "bf16" in text and ("gpu" in text.lower() or "support" in text):
        return (
            "the recipe asks for bf16 mixed precision (bf16: true), which needs a GPU with bf16: the recipes in "
            "examples/*.yaml are GPU recipes, examples/real_model/smollm2_135m_gym_lora.yaml is the one sized for "
            "a CPU. To run this one here anyway, add --bf16 false (and --use_cpu true for CPU only)."
        )
    return None


def _run(command: str, call: Callable[[], int]) -> int:
    try:
        return call()
    except KeyboardInterrupt:
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as error:
        if os.environ.get("TRL_SAE_DEBUG"):
            raise
        hint = getattr(error, "hint", None) or _hint_for(error)
        message = first_line(str(error)) or type(error).__name__
        if not isinstance(error, (CLIError, ValueError, OSError, ImportError, TypeError)):
            message = f"{type(error).__name__}: {message}"
        print(f"{PROG} {command}: error: {message}", file=sys.stderr)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        elif not isinstance(error, (CLIError, FileNotFoundError)):
            print("(set TRL_SAE_DEBUG=1 to see the traceback)", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trl-sae`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if argv and argv[0] == "train":
        return _run("train", lambda: train.cmd_train(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return _run(args.command, lambda: args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
