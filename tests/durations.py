"""The order `make test` hands tests to its pytest-xdist workers: longest first, from a table of measured seconds.

`make test` runs ``-n 2 --dist loadgroup``: each worker is sent one test at a time (at most 2 queued), in
collection order, as it finishes the last, so the order decides the balance. The longest tests take
~100 s while most take well under one: sent last, one of them keeps one worker busy while the other idles
(longest-processing-time-first keeps the two finishing within about the shortest long test of each other).

``tests/durations.json`` maps a test's id (without xdist's ``@group`` suffix) to its seconds (set-up + call +
tear-down), measured on the 2-core development machine; a test not in it counts as 0 s (20 s if marked
``slow``) and keeps its place among equals.
A stale table costs balance, never a result. Refresh it with
``python -m pytest -n 2 --dist loadgroup tests --record-durations tests/durations.json``: entries of the tests
that ran are replaced, the others kept; tests under 1 s are left out.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("durations.json")
# Shorter tests are not worth a line: at these sizes the order changes the wall time by less than a second.
MIN_RECORDED_SECONDS = 1.0
# A test marked ``slow`` (pyproject: "more than ~20 s on 2 CPU cores") that the table does not know yet.
SLOW_SECONDS = 20.0


def base_id(nodeid: str) -> str:
    """``nodeid`` without the ``@group`` suffix pytest-xdist's ``loadgroup`` adds to ``xdist_group`` tests."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[0]
    return nodeid


def load_table(path: Path = TABLE) -> dict[str, float]:
    return json.loads(path.read_text()) if path.is_file() else {}


def expected_seconds(item, table: dict[str, float]) -> float:
    """The table's seconds for ``item``; a test missing from it counts as 0 s, or as
    :data:`SLOW_SECONDS` if marked ``slow``."""
    seconds = table.get(base_id(item.nodeid))
    if seconds is not None:
        return seconds
    return SLOW_SECONDS if item.get_closest_marker("slow") is not None else 0.0


def sort_items(items: list, table: dict[str, float]) -> None:
    """Sort ``items`` (pytest's collected tests) in place into the order tests/conftest.py describes: the
    tests without a vLLM engine, then those with one (an engine in other processes first); within each, the
    longest first; ties keep the collection order.

    The tests of an ``xdist_group`` share one launch (tests/scenarios.py: once_per_run): the first of them
    carries it and goes at the place of the group's total; the others only read its files and go after every
    other test without a vLLM engine, when the launch is long done, whichever worker they land on.

    Raises:
        pytest.UsageError: a vLLM test is in an ``xdist_group`` (it would have to run before the other tests).
    """
    seconds = {item: expected_seconds(item, table) for item in items}
    first_of_group: dict[str, object] = {}
    group_seconds: dict[str, float] = defaultdict(float)
    for item in items:
        group = item.get_closest_marker("xdist_group")
        if group is not None:
            if item.get_closest_marker("vllm") is not None:
                raise pytest.UsageError(f"{item.nodeid}: a vLLM test in an xdist_group would not run last")
            first_of_group.setdefault(group.args[0], item)
            group_seconds[group.args[0]] += seconds[item]
    late = set()
    for item in items:
        group = item.get_closest_marker("xdist_group")
        if group is not None:
            if first_of_group[group.args[0]] is item:
                seconds[item] = group_seconds[group.args[0]]
            else:
                late.add(item)

    def key(item) -> tuple[bool, bool, bool, float]:
        vllm = item.get_closest_marker("vllm") is not None
        in_process = "two_processes" not in item.name and "server" not in item.name
        return vllm, item in late, vllm and in_process, -seconds[item]

    items.sort(key=key)


class DurationRecorder:
    """Sums each test's set-up, call and tear-down seconds from the reports pytest (or, under xdist, every
    worker) sends, and merges them into a table at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[base_id(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        table = load_table(self.path)
        for name, seconds in self.seconds.items():
            table.pop(name, None)
            if seconds >= MIN_RECORDED_SECONDS:
                table[name] = round(seconds, 1)
        ordered = dict(sorted(table.items(), key=lambda item: (-item[1], item[0])))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n")
