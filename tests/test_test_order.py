"""The order `make test` sends tests to its workers (tests/durations.py), and the table it reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.durations import TABLE, DurationRecorder, base_id, sort_items


class FakeItem:
    """What sort_items reads of a pytest item: its id, name and markers."""

    def __init__(self, nodeid: str, *marks: SimpleNamespace) -> None:
        self.nodeid = nodeid
        self.name = nodeid.rsplit("::", 1)[-1]
        self.marks = {mark.name: mark for mark in marks}

    def get_closest_marker(self, name: str):
        return self.marks.get(name)

    def __repr__(self) -> str:
        return self.name


def mark(name: str, *args) -> SimpleNamespace:
    return SimpleNamespace(name=name, args=args)


def names(items) -> list[str]:
    return [item.name for item in items]


def test_longest_first_vllm_last_engines_in_other_processes_first_among_those():
    items = [
        FakeItem("t.py::short"),
        FakeItem("t.py::vllm_colocated_long", mark("vllm")),
        FakeItem("t.py::unknown"),
        FakeItem("t.py::long"),
        FakeItem("t.py::test_two_processes_vllm", mark("vllm")),
        FakeItem("t.py::vllm_colocated_short", mark("vllm")),
        FakeItem("t.py::middle"),
        FakeItem("t.py::unknown_slow", mark("slow")),
    ]
    table = {"t.py::short": 1.0, "t.py::long": 90.0, "t.py::middle": 10.0, "t.py::vllm_colocated_long": 50.0}
    table |= {"t.py::test_two_processes_vllm": 5.0, "t.py::vllm_colocated_short": 2.0}
    sort_items(items, table)
    # A slow test the table lacks counts as 20 s; an unmarked one as 0 s, after the measured ones.
    assert names(items) == [
        "long",
        "unknown_slow",
        "middle",
        "short",
        "unknown",
        "test_two_processes_vllm",
        "vllm_colocated_long",
        "vllm_colocated_short",
    ]


def test_a_groups_first_test_goes_at_the_place_of_its_total_the_others_after_the_rest():
    group = mark("xdist_group", "launch")
    items = [
        FakeItem("t.py::a", group),
        FakeItem("t.py::alone"),
        FakeItem("t.py::b", group),
        FakeItem("t.py::c", group),
        FakeItem("t.py::quick"),
        FakeItem("t.py::engine", mark("vllm")),
    ]
    # a, b and c: 40 s together, more than the 31 s test alone though each is shorter; b and c only read what
    # a's launch wrote: after every other test, before the vLLM tests
    table = {"t.py::a": 30.0, "t.py::b": 5.0, "t.py::c": 5.0, "t.py::alone": 31.0, "t.py::quick": 1.0}
    sort_items(items, table)
    assert names(items) == ["a", "alone", "quick", "b", "c", "engine"]
    sort_items(items, {**table, "t.py::a": 10.0})
    assert names(items) == ["alone", "a", "quick", "b", "c", "engine"]


def test_a_vllm_test_in_a_group_is_refused():
    items = [FakeItem("t.py::engine", mark("vllm"), mark("xdist_group", "launch"))]
    with pytest.raises(pytest.UsageError, match=r"t.py::engine: a vLLM test in an xdist_group"):
        sort_items(items, {})


def test_the_table_is_keyed_without_xdists_group_suffix():
    assert base_id("t.py::a@launch") == "t.py::a"
    assert base_id("t.py::a[x@y]") == "t.py::a[x@y]"  # an @ inside the parameters is the test's own
    assert base_id("t.py::a[x@y]@launch") == "t.py::a[x@y]"


def test_recording_sums_each_tests_phases_and_merges_into_the_table(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"t.py::kept": 7.0, "t.py::again": 50.0, "t.py::now_fast": 3.0}))
    recorder = DurationRecorder(path)
    for nodeid, duration in [
        ("t.py::again@launch", 0.5),
        ("t.py::again@launch", 20.0),
        ("t.py::again@launch", 0.25),
        ("t.py::new", 2.0),
        ("t.py::now_fast", 0.2),
        ("t.py::tiny", 0.1),
    ]:
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))
    recorder.pytest_sessionfinish(None)
    # measured again: replaced; not run: kept; under a second: left out; longest first
    assert list(json.loads(path.read_text()).items()) == [
        ("t.py::again", 20.8),
        ("t.py::kept", 7.0),
        ("t.py::new", 2.0),
    ]


def test_the_committed_table_names_collected_tests_longest_first(request):
    table = json.loads(TABLE.read_text())
    assert list(table.values()) == sorted(table.values(), reverse=True)
    assert all(seconds >= 1.0 for seconds in table.values())
    # Every entry names a module of this suite (refresh the table when tests move: a stale entry orders nothing).
    modules = {name.split("::", 1)[0] for name in table}
    assert all((request.config.rootpath / module).is_file() for module in modules)
