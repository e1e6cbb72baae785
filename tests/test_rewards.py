"""Tests for trl_sae.rewards: the protocol, compute_rewards, math_accuracy (incl. timeouts), format rewards."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trl_sae.rewards import _verify_worker as worker
from trl_sae.rewards import math as math_rewards
from trl_sae.rewards import protocol
from trl_sae.rewards.format import format_reward, make_format_reward
from trl_sae.rewards.math import make_math_accuracy, math_accuracy
from trl_sae.rewards.protocol import RewardFunction, compute_rewards, reward_func_name, validate_reward_funcs
from trl_sae.rewards.registry import REWARD_FUNCTIONS

# math-verify is the optional `math` extra: only the tests that grade answers need it.
requires_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason='needs pip install "trl-sae[math]"'
)


@pytest.fixture
def fresh_math_state():
    """Forget cached scorers, worker processes and one-time warnings around a test that alters them."""

    def reset():
        worker.cached_scorer.cache_clear()
        worker._close_process_verifiers()
        math_rewards._WARNED.clear()

    reset()
    yield
    reset()


class FakeClock:
    """``time.monotonic`` for the reward modules' deadlines and budgets: it moves only when a test says how
    long a piece of work took, so what a deadline allows is computed, not measured on a loaded machine."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def fake_clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    fake_time = SimpleNamespace(monotonic=clock.monotonic)
    monkeypatch.setattr(worker, "time", fake_time)
    monkeypatch.setattr(math_rewards, "time", fake_time)
    return clock


def run_in_thread(func, *args, **kwargs):
    """Run ``func`` in a non-main thread; return its result or re-raise its exception."""
    box = {}

    def target():
        try:
            box["result"] = func(*args, **kwargs)
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the reward call hung in the worker thread"
    if "error" in box:
        raise box["error"]
    return box["result"]


# --------------------------------------------------------------------------------------------------
# math_accuracy: grading.
# --------------------------------------------------------------------------------------------------
MATH_CASES = [
    # (completion, gold answer, expected)
    (r"The sum is \boxed{34}.", "34", 1.0),
    (r"so \boxed{35}", "34", 0.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac12}", "1/2", 1.0),
    (r"\boxed{0.4}", r"\frac{1}{2}", 0.0),
    (r"\boxed{1+x^2}", "x^2+1", 1.0),
    (r"\boxed{x^2-1}", "x^2+1", 0.0),
    (r"\boxed{2^{1/2}}", r"\sqrt{2}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),
    (r"\boxed{2\pi}", r"2\pi", 1.0),
    (r"\boxed{2}", r"2\pi", 0.0),
    (r"\boxed{10^{10}}", "10000000000", 1.0),
    (r"\boxed{142}", 142.0, 1.0),  # AMC stores answers as floats
    (r"\boxed{x = 34}", "34", 1.0),
    # Several boxed answers read as a set (math-verify's rule): hedging is not rewarded.
    (r"It is \boxed{12}, or maybe \boxed{34}", "34", 0.0),
    ("The final answer is $34$.", "34", 1.0),
    ("<think>maybe 12? no, 34</think>The answer is \\boxed{34}", "34", 1.0),
    ("I computed 34 somewhere along the way but never concluded.", "34", 0.0),  # no final answer
    ("I don't know.", "34", 0.0),
    ("", "34", 0.0),
    (r"\boxed{34}", None, None),  # no gold answer
    (r"\boxed{34}", "", None),
    (r"\boxed{34}", float("nan"), None),
]


@requires_math_verify
def test_math_accuracy_table():
    completions = [c for c, _, _ in MATH_CASES]
    golds = [g for _, g, _ in MATH_CASES]
    scores = math_accuracy(["p"] * len(completions), completions, [[0]] * len(completions), answer=golds)
    mismatches = [
        (c, g, s, e)
        for (c, g, e), s in zip(MATH_CASES, scores)
        if s != e or (s is not None and type(s) is not float)
    ]
    assert not mismatches, mismatches


@requires_math_verify
def test_math_accuracy_unparseable_gold_is_none():
    # A gold answer math-verify extracts nothing from is "not applicable", not a wrong answer.
    assert math_accuracy(["p"], [r"\boxed{1}"], [[1]], answer=["$$"]) == [None]


@requires_math_verify
def test_math_accuracy_conversational_completions_and_extra_columns():
    completions = [
        [{"role": "assistant", "content": r"\boxed{7}"}],
        [{"role": "assistant", "content": [{"type": "text", "text": r"\boxed{8}"}]}],
        {"role": "assistant", "content": [{"type": "text", "text": r"\boxed{7}"}]},
        [],
    ]
    scores = math_accuracy(["p"] * 4, completions, None, answer=["7"] * 4, level=["a", "b", "c", "d"])
    assert scores == [1.0, 0.0, 1.0, 0.0]


def test_math_accuracy_column_errors():
    with pytest.raises(ValueError, match=r"column named 'answer'.*solution"):
        math_accuracy(["p"], [r"\boxed{1}"], [[1]], solution=["1"])
    with pytest.raises(ValueError, match="'answer' has 2 values for 1 completions"):
        math_accuracy(["p"], [r"\boxed{1}"], [[1]], answer=["1", "2"])
    with pytest.raises(ValueError, match="expected text or a list of chat messages"):
        math_accuracy(["p"], [42], [[1]], answer=["1"])


@requires_math_verify
def test_make_math_accuracy_options():
    acc = make_math_accuracy(answer_column="solution", name="acc", timeout_seconds=None)
    assert reward_func_name(acc) == "acc"
    assert isinstance(acc, RewardFunction)
    assert acc(["p", "p"], [r"\boxed{3}", r"\boxed{4}"], None, solution=["3", "3"]) == [1.0, 0.0]
    assert "answer_column='solution'" in repr(acc)
    with pytest.raises(ValueError, match="timeout_seconds"):
        make_math_accuracy(timeout_seconds=0)
    with pytest.raises(ValueError, match="backend"):
        make_math_accuracy(backend="threads")


@requires_math_verify
def test_math_accuracy_scores_a_batch_of_ordinary_answers():
    completions = [rf"Adding up, the total is \boxed{{{i}}}" for i in range(64)]
    golds = [str(i if i % 2 else i + 1) for i in range(64)]
    math_accuracy(["p"], completions[:1], None, answer=golds[:1])  # warm up math-verify's imports
    scores = math_accuracy(["p"] * 64, completions, None, answer=golds)
    assert scores == [float(i % 2) for i in range(64)]  # speed: benchmarks/bench_math_reward.py


def test_math_accuracy_import_error_names_the_extra(fresh_math_state, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError, match=re.escape('pip install "trl-sae[math]"')):
        make_math_accuracy(timeout_seconds=None)(["p"], [r"\boxed{1}"], None, answer=["1"])


# --------------------------------------------------------------------------------------------------
# math_accuracy: timeouts, in the main thread (SIGALRM) and elsewhere (worker process).
# --------------------------------------------------------------------------------------------------
_SLEPT_THROUGH: list[bool] = []  # a verify call that was not cut short appends here, 30 s later


def _sleeping_verify(*args, **kwargs):
    time.sleep(30)
    _SLEPT_THROUGH.append(True)
    return True


@requires_math_verify
def test_timeout_in_main_thread_scores_zero_and_warns_once(fresh_math_state, monkeypatch):
    import math_verify

    monkeypatch.setattr(math_verify, "verify", _sleeping_verify)
    _SLEPT_THROUGH.clear()
    acc = make_math_accuracy(timeout_seconds=0.3, backend="signal")
    with pytest.warns(RuntimeWarning, match="longer than 0.3s"):
        scores = acc(["p", "p"], [r"\boxed{1}", r"\boxed{2}"], None, answer=["1", "1"])
    assert scores == [0.0, 0.0]
    assert _SLEPT_THROUGH == []  # both calls were interrupted, not waited for
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the warning is one-time
        assert acc(["p"], [r"\boxed{1}"], None, answer=["1"]) == [0.0]


@requires_math_verify
@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="SIGALRM timers are POSIX-only")
def test_timeout_in_main_thread_preserves_an_outer_alarm(fresh_math_state, monkeypatch):
    import math_verify

    # Each verify call takes 7 s on the reward module's clock (and sleeps until its real item timer).
    clock = fake_clock(monkeypatch)

    def slow_verify(*args, **kwargs):
        clock.now += 7.0
        return _sleeping_verify(*args, **kwargs)

    monkeypatch.setattr(math_verify, "verify", slow_verify)
    fired = []

    def outer_handler(signum, frame):
        fired.append(signum)

    # Every ITIMER_REAL setting: (delay asked, delay it replaced).
    calls: list[tuple[float, float]] = []
    setitimer = signal.setitimer

    def recording_setitimer(which, seconds, interval=0.0):
        before = setitimer(which, seconds, interval)
        if which == signal.ITIMER_REAL:
            calls.append((seconds, before[0]))
        return before

    previous = signal.signal(signal.SIGALRM, outer_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 3600.0)
        monkeypatch.setattr(signal, "setitimer", recording_setitimer)
        with pytest.warns(RuntimeWarning):
            acc = make_math_accuracy(timeout_seconds=0.2, backend="signal")
            assert acc(["p"], [r"\boxed{1}"], None, answer=["1"]) == [0.0]
        monkeypatch.setattr(signal, "setitimer", setitimer)
        # The one pass (a 0.2 s cap is its own first-pass budget) paused the outer timer and re-armed it
        # with what it had left: what the pause found, less the 7 s its verify call took.
        paused = [before for seconds, before in calls if seconds == 0 and before > 60.0]
        rearmed = [seconds for seconds, _ in calls if seconds > 60.0]
        assert len(paused) == len(rearmed) == 1
        assert rearmed[0] == pytest.approx(paused[0] - 7.0, abs=1e-9)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0.0 < remaining <= rearmed[-1]  # still armed, and with no more than it was given
        assert signal.getsignal(signal.SIGALRM) is outer_handler
        assert fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@requires_math_verify
def test_real_pathological_answer_times_out_in_main_thread(fresh_math_state):
    # sympy evaluates 9^(9^(9^9)) for minutes; math-verify alone would not stop it outside the main thread.
    acc = make_math_accuracy(timeout_seconds=1.0, backend="signal")
    # The warning is the timeout's own (a wrong answer scores 0.0 without one), so sympy was stopped.
    with pytest.warns(RuntimeWarning, match="took longer than 1.0s and it scored 0.0"):
        scores = acc(["p", "p"], [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{34}"], None, answer=["34", "34"])
    assert scores == [0.0, 1.0]


def _sleeping_worker_command(config_json):
    # The worker is a separate interpreter, so the patch goes into its start-up code.
    # An hour: a worker that is waited for instead of killed outlives run_in_thread's join, which then fails.
    patch = "import time, math_verify\nmath_verify.verify = lambda *a, **k: time.sleep(3600)\n"
    return [sys.executable, "-c", patch + worker._WORKER_BOOTSTRAP, worker.__file__, config_json]


@requires_math_verify
def test_timeout_outside_main_thread_uses_worker_process(fresh_math_state, monkeypatch):
    monkeypatch.setattr(worker, "_worker_command", _sleeping_worker_command)
    acc = make_math_accuracy(timeout_seconds=0.5)
    with pytest.warns(RuntimeWarning, match="longer than 0.5s"):
        scores = run_in_thread(acc, ["p", "p"], [r"\boxed{1}", "nothing"], None, answer=["1", "1"])
    # Item 1 overran (worker killed: the call returned at all); item 2 has no final answer, so it is 0.0
    # before any verify call.
    assert scores == [0.0, 0.0]


@requires_math_verify
def test_real_pathological_answer_times_out_in_a_thread_and_worker_recovers(fresh_math_state):
    acc = make_math_accuracy(timeout_seconds=1.0)
    completions = [r"\boxed{34}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{34}", r"\boxed{\frac{1}{2}}"]
    with pytest.warns(RuntimeWarning, match="took longer than 1.0s and it scored 0.0"):
        scores = run_in_thread(acc, ["p"] * 4, completions, None, answer=["34", "34", "34", "0.5"])
    assert scores == [1.0, 0.0, 1.0, 1.0]  # the items after the stopped one were scored by a fresh worker


@requires_math_verify
def test_worker_process_matches_in_process_results(fresh_math_state):
    completions = [c for c, _, _ in MATH_CASES]
    golds = [g for _, g, _ in MATH_CASES]
    in_process = make_math_accuracy(timeout_seconds=None)(None, completions, None, answer=golds)
    in_worker = run_in_thread(make_math_accuracy(timeout_seconds=10.0), None, completions, None, answer=golds)
    assert in_worker == in_process


@requires_math_verify
def test_worker_crash_scores_zero_and_restarts(fresh_math_state, monkeypatch):
    def crashing_worker_command(config_json):
        patch = "import os, math_verify\nmath_verify.verify = lambda *a, **k: os._exit(3)\n"
        return [sys.executable, "-c", patch + worker._WORKER_BOOTSTRAP, worker.__file__, config_json]

    monkeypatch.setattr(worker, "_worker_command", crashing_worker_command)
    with pytest.warns(RuntimeWarning, match="worker died"):
        scores = make_math_accuracy(backend="process")(
            None, [r"\boxed{1}", r"\boxed{1}"], None, answer=["1", "1"]
        )
    assert scores == [0.0, 0.0]


@pytest.mark.parametrize(
    ("worker_code", "error", "message"),
    [
        ("import sys; sys.exit(3)", RuntimeError, "worker failed to start: it exited during start-up"),
        (
            "import sys; sys.modules['math_verify'] = None\n" + worker._WORKER_BOOTSTRAP,
            ImportError,
            re.escape('pip install "trl-sae[math]"'),
        ),
    ],
)
def test_worker_start_failures_are_reported(fresh_math_state, monkeypatch, worker_code, error, message):
    monkeypatch.setattr(
        worker,
        "_worker_command",
        lambda config: [sys.executable, "-c", worker_code, worker.__file__, config],
    )
    with pytest.raises(error, match=message):
        make_math_accuracy(backend="process")(None, [r"\boxed{1}"], None, answer=["1"])


@requires_math_verify
def test_process_backend_in_main_thread_and_signal_backend_refused_in_thread(fresh_math_state):
    assert make_math_accuracy(backend="process")(None, [r"\boxed{2}"], None, answer=["2"]) == [1.0]
    with pytest.raises(RuntimeError, match="backend='signal' needs the main thread"):
        run_in_thread(make_math_accuracy(backend="signal"), None, [r"\boxed{2}"], None, answer=["2"])


# --------------------------------------------------------------------------------------------------
# format rewards.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"\boxed{2}", 1.0),
        (r"Reasoning... so the answer is \boxed{\frac{1}{2}}.", 1.0),
        (r"<think>try \boxed{1}? no</think> Final: \boxed{2}", 1.0),  # boxes inside reasoning do not count
        (r"\boxed{\{1, 2\}}", 1.0),  # escaped braces are content
        (r"\boxed {7}", 1.0),
        (r"\boxed{1} or \boxed{2}", 0.0),
        (r"<think>\boxed{2}", 0.0),  # reasoning never closed: no final answer
        (r"<think>done</think> the answer is 2", 0.0),
        (r"\boxed{2", 0.0),
        (r"\boxed{}", 0.0),
        (r"\boxed{  }", 0.0),
        (r"\boxed{\boxed{2}}", 0.0),
        ("2", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(["p"], [completion], [[1]]) == [expected]


def test_format_reward_conversational():
    assert format_reward(None, [[{"role": "assistant", "content": r"\boxed{1}"}]]) == [1.0]


def test_make_format_reward():
    think = make_format_reward(r"^<think>.+</think>\s*\S", name="think_format")
    assert reward_func_name(think) == "think_format"
    assert think(None, ["<think>a\nb</think> 4", "4", "<think></think>4"]) == [1.0, 0.0, 0.0]
    compiled = make_format_reward(re.compile(r"ANSWER \d+$"))
    assert reward_func_name(compiled) == "format_reward"
    assert compiled(None, ["ANSWER 17", "ANSWER x"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        make_format_reward("(unclosed")


# --------------------------------------------------------------------------------------------------
# names and validation.
# --------------------------------------------------------------------------------------------------
class ConstantReward:
    def __init__(self, value):
        self.value = value

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        return [self.value] * len(completions)


def constant(prompts, completions, completion_ids, value=1.0, **kwargs):
    return [value] * len(completions)


def test_reward_func_name():
    assert reward_func_name(math_accuracy) == "math_accuracy"
    assert reward_func_name(functools.partial(constant, value=2.0)) == "constant"
    assert reward_func_name(functools.partial(functools.partial(constant), value=2.0)) == "constant"
    assert reward_func_name(ConstantReward(1.0)) == "ConstantReward"
    assert reward_func_name(lambda *a, **k: []) == "<lambda>"


def test_validate_reward_funcs_names_weights_and_builtins():
    funcs, names, weights = validate_reward_funcs(math_accuracy)
    assert funcs == [math_accuracy] and names == ["math_accuracy"]
    assert weights.dtype == torch.float32 and weights.tolist() == [1.0]

    same = [constant, functools.partial(constant, value=2.0), ConstantReward(1.0), ConstantReward(2.0)]
    _, names, _ = validate_reward_funcs(same, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert names == ["constant", "constant_2", "ConstantReward", "ConstantReward_2"]
    # A suffix never collides with a name already in the list.
    named = functools.partial(constant)
    renamed = make_format_reward("x", name="constant_2")
    assert validate_reward_funcs([constant, named, renamed])[1] == ["constant", "constant_3", "constant_2"]

    funcs, names, weights = validate_reward_funcs(["math_accuracy", "format_reward"], [1.0, 0.5])
    assert funcs == [REWARD_FUNCTIONS["math_accuracy"], format_reward]
    assert weights.tolist() == [1.0, 0.5]
    assert validate_reward_funcs(constant, 3)[2].tolist() == [3.0]


@pytest.mark.parametrize(
    ("funcs", "weights", "message"),
    [
        (None, None, "`reward_funcs` is None"),
        ([], None, "`reward_funcs` is empty"),
        (42, None, "`reward_funcs` must be a callable or a list"),
        ([constant, "accuracy"], None, r"`reward_funcs\[1\]` is 'accuracy'.*known names"),
        ([constant, 3.0], None, r"`reward_funcs\[1\]` is a float.*not a callable"),
        ([constant, constant], [1.0], r"`reward_weights` has 1 entries but there are 2 `reward_funcs`"),
        ([constant], [1.0, 2.0], r"`reward_weights` has 2 entries but there are 1"),
        ([constant], "1.0", "`reward_weights` must be a list of numbers"),
        ([constant], [float("nan")], r"`reward_weights\[0\]`.*finite"),
        ([constant], ["1"], r"`reward_weights\[0\]`.*finite"),
    ],
)
def test_validate_reward_funcs_errors(funcs, weights, message):
    with pytest.raises(ValueError, match=message):
        validate_reward_funcs(funcs, weights)


# --------------------------------------------------------------------------------------------------
# compute_rewards.
# --------------------------------------------------------------------------------------------------
PROMPTS = ["a", "b", "c"]
COMPLETIONS = [r"\boxed{1}", r"\boxed{2}", "none"]
IDS = [[1], [2, 3], []]


@requires_math_verify
def test_compute_rewards_weights_and_per_function():
    total, per_function = compute_rewards(
        [math_accuracy, format_reward, functools.partial(constant, value=-1.0)],
        [2.0, 0.5, 0.1],
        PROMPTS,
        COMPLETIONS,
        IDS,
        {"answer": ["1", "3", "3"]},
    )
    assert list(per_function) == ["math_accuracy", "format_reward", "constant"]
    assert per_function["math_accuracy"].tolist() == [1.0, 0.0, 0.0]
    assert per_function["format_reward"].tolist() == [1.0, 1.0, 0.0]
    assert per_function["constant"].tolist() == [-1.0, -1.0, -1.0]
    assert total.dtype == torch.float32 and total.shape == (3,)
    torch.testing.assert_close(total, torch.tensor([2.0 + 0.5 - 0.1, 0.5 - 0.1, -0.1]))


def test_compute_rewards_none_counts_as_zero_and_columns_reach_functions():
    seen = {}

    def partial_reward(prompts, completions, completion_ids, difficulty, **kwargs):
        seen.update(prompts=prompts, completion_ids=completion_ids, difficulty=difficulty, kwargs=kwargs)
        return [None if d == "skip" else 1.0 for d in difficulty]

    total, per_function = compute_rewards(
        partial_reward,
        None,
        PROMPTS,
        COMPLETIONS,
        IDS,
        {"difficulty": ["easy", "skip", "hard"], "answer": [1, 2, 3]},
    )
    assert per_function["partial_reward"].tolist() == [1.0, 0.0, 1.0]
    assert total.tolist() == [1.0, 0.0, 1.0]
    assert seen["prompts"] == PROMPTS and seen["completion_ids"] == IDS
    assert seen["kwargs"] == {"answer": [1, 2, 3]}


def test_compute_rewards_accepts_tensor_numpy_bool_and_int_outputs():
    funcs = [
        lambda prompts, completions, completion_ids, **k: torch.tensor([0.5, 1.0, 2.0]),
        lambda prompts, completions, completion_ids, **k: np.array([1, 2, 3], dtype=np.int64),
        lambda prompts, completions, completion_ids, **k: (True, False, np.float32(0.25)),
    ]
    total, per_function = compute_rewards(funcs, None, PROMPTS, COMPLETIONS, IDS)
    assert list(per_function) == ["<lambda>", "<lambda>_2", "<lambda>_3"]
    torch.testing.assert_close(total, torch.tensor([2.5, 3.0, 5.25]))


def test_compute_rewards_empty_batch():
    total, per_function = compute_rewards([constant], None, [], [], [], {"answer": []})
    assert total.shape == (0,) and per_function["constant"].shape == (0,)


def _returning(value):
    def math_accuracy(prompts, completions, completion_ids, **kwargs):
        return value

    return math_accuracy


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ([1.0, 0.0], "reward function 'math_accuracy' returned 2 values for 3 completions"),
        ([1.0, 0.0, 1.0, 1.0], "returned 4 values for 3 completions"),
        ([1.0, "1.0", 0.0], r"returned a non-numeric value '1.0' \(str\) at index 1"),
        ([1.0, 0.0, [1.0]], r"non-numeric value \[1.0\] \(list\) at index 2"),
        ([math.nan, 0.0, 1.0], "returned nan at index 0; rewards must be finite"),
        ([0.0, math.inf, 1.0], "returned inf at index 1"),
        ([0.0, 1.0, -math.inf], "returned -inf at index 2"),
        (torch.tensor([0.0, float("nan"), 1.0]), "returned nan at index 1"),
        (1.0, "returned a float; it must return a list of 3 floats"),
        (None, "returned a NoneType"),
        ({"a": 1}, "returned a dict"),
    ],
)
def test_compute_rewards_rejects_bad_outputs(output, message):
    with pytest.raises(ValueError, match=message):
        compute_rewards([constant, _returning(output)], None, PROMPTS, COMPLETIONS, IDS)


def test_compute_rewards_batch_errors():
    with pytest.raises(ValueError, match="`completions` has 2 entries for 3 `prompts`"):
        compute_rewards([constant], None, PROMPTS, COMPLETIONS[:2], IDS)
    with pytest.raises(ValueError, match="`completion_ids` has 1 entries for 3 `prompts`"):
        compute_rewards([constant], None, PROMPTS, COMPLETIONS, IDS[:1])
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 3 prompts"):
        compute_rewards([constant], None, PROMPTS, COMPLETIONS, IDS, {"answer": ["1", "2"]})
    with pytest.raises(ValueError, match="column 'completions' clashes"):
        compute_rewards([constant], None, PROMPTS, COMPLETIONS, IDS, {"completions": [1, 2, 3]})
    with pytest.raises(ValueError, match="`reward_weights` has 2 entries"):
        compute_rewards([constant], [1.0, 1.0], PROMPTS, COMPLETIONS, IDS)


def test_compute_rewards_names_the_function_that_raised():
    def broken(prompts, completions, completion_ids, **kwargs):
        raise KeyError("boom")

    with pytest.raises(protocol.RewardFunctionError) as info:
        compute_rewards([constant, broken], None, PROMPTS, COMPLETIONS, IDS)
    # One line that names the function (what the CLI prints), the original error kept as the cause.
    assert str(info.value) == "reward function 'broken' raised KeyError: 'boom'"
    assert type(info.value.__cause__) is KeyError and info.value.__cause__.args == ("boom",)


def test_cli_prints_the_name_of_the_reward_function_that_raised(capsys):
    from trl_sae.cli.app import _run

    def broken(prompts, completions, completion_ids, **kwargs):
        raise KeyError("boom")

    assert _run("train", lambda: compute_rewards([broken], None, PROMPTS, COMPLETIONS, IDS)) == 1
    assert (
        "error: RewardFunctionError: reward function 'broken' raised KeyError: 'boom'"
        in capsys.readouterr().err
    )


# --------------------------------------------------------------------------------------------------
# compute_rewards: the per-call timeout.
# --------------------------------------------------------------------------------------------------
def test_compute_rewards_timeout_names_the_function_and_abandons_the_call(monkeypatch):
    release = threading.Event()
    finished = threading.Event()

    def hangs(prompts, completions, completion_ids, **kwargs):
        release.wait()
        finished.set()
        return [1.0] * len(completions)

    # Every wait on an event, with its limit and whether the event was set within it (a thread's start
    # waits too, with no limit).
    waits: list[tuple[float | None, bool]] = []

    class RecordedEvent(threading.Event):
        def wait(self, timeout=None):
            ended = super().wait(timeout)
            waits.append((timeout, ended))
            return ended

    monkeypatch.setattr(protocol.threading, "Event", RecordedEvent)
    try:
        with pytest.raises(protocol.RewardTimeoutError) as info:
            compute_rewards([constant, hangs], None, PROMPTS, COMPLETIONS, IDS, timeout=0.5)
        # `constant` ended within its wait; for `hangs` the caller waited the whole timeout, the call not
        # ended ...
        assert [wait for wait in waits if wait[0] is not None] == [(0.5, True), (0.5, False)]
        assert not finished.is_set()  # ... and not for the call, which is still blocked
        message = str(info.value)
        assert "reward function 'hangs' did not return within reward_timeout=0.5s" in message
        assert "abandoned, still running, in daemon thread 'trl-sae-reward-hangs'" in message
        stuck = [t for t in threading.enumerate() if t.name == "trl-sae-reward-hangs"]
        assert len(stuck) == 1 and stuck[0].daemon and stuck[0].is_alive()
    finally:
        release.set()
    assert finished.wait(5.0)  # the abandoned call ran on and returned; its result went nowhere


def test_compute_rewards_timeout_keeps_results_and_errors_of_calls_in_time():
    total, _ = compute_rewards([constant], [2.0], PROMPTS, COMPLETIONS, IDS, timeout=5.0)
    assert total.tolist() == [2.0, 2.0, 2.0]

    def broken(prompts, completions, completion_ids, **kwargs):
        raise KeyError("answer")

    with pytest.raises(
        protocol.RewardFunctionError, match="reward function 'broken' raised KeyError"
    ) as info:
        compute_rewards([broken], None, PROMPTS, COMPLETIONS, IDS, timeout=5.0)
    if sys.version_info >= (3, 11):
        assert any("ran in a worker thread" in note for note in info.value.__cause__.__notes__)
    with pytest.raises(ValueError, match="`timeout` must be a positive number"):
        compute_rewards([constant], None, PROMPTS, COMPLETIONS, IDS, timeout=0)


def test_compute_rewards_rejects_rewards_that_overflow_float32():
    with pytest.raises(ValueError, match=r"returned 1e\+39 at index 1, which overflows float32"):
        compute_rewards([_returning([0.0, 1e39, 0.0])], None, PROMPTS, COMPLETIONS, IDS)
    with pytest.raises(
        ValueError, match=r"weighted sum of rewards is inf at index 0 .*math_accuracy=3e\+38 x 10"
    ):
        compute_rewards([_returning([3e38, 0.0, 0.0])], [10.0], PROMPTS, COMPLETIONS, IDS)


# --------------------------------------------------------------------------------------------------
# math_accuracy: a pool of worker processes verifies a batch in parallel.
# --------------------------------------------------------------------------------------------------
PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"  # sympy evaluates this for minutes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pool_of(acc) -> worker._VerifierPool:
    return worker.process_pool(json.dumps(dict(sorted(acc.scorer_config.items())), sort_keys=True))


def _record_retry_budgets(monkeypatch) -> list[tuple[float, float, float, int]]:
    """Record every item budget handed out under a batch deadline: ``(deadline, asked, seconds, thread)``.

    What the two-pass scoring promises, checked without a stopwatch (a shared machine's load decides how
    long things take): the retried items share one deadline, and a worker (a thread of the pool, or the
    main thread under SIGALRM) is handed budgets that add up to at most one cap when each item it is
    handed runs to its timer. ``asked`` is when the budget was asked for; a budget <= 0 is an item the
    deadline left unstarted.
    """
    budgets: list[tuple[float, float, float, int]] = []
    item_budget = worker._item_budget

    def recording_item_budget(timeout_seconds, deadline):
        asked = worker.time.monotonic()  # the module's clock: a test's fake one when it has set one
        seconds = item_budget(timeout_seconds, deadline)
        if deadline is not None:
            budgets.append((deadline, asked, seconds, threading.get_ident()))
        return seconds

    monkeypatch.setattr(worker, "_item_budget", recording_item_budget)
    return budgets


def _budgets_per_worker(budgets, cap: float, retried: int) -> dict[int, float]:
    """Check one shared deadline with no budget past it or over ``cap``; the started budgets per worker."""
    # Each retried item asks once; a worker replaced at the deadline may leave some not taken before it.
    assert 1 <= len(budgets) <= retried, budgets
    assert len({deadline for deadline, *_ in budgets}) == 1, budgets
    per_worker: dict[int, float] = {}
    for deadline, asked, seconds, thread in budgets:
        assert seconds <= cap and asked + seconds <= deadline, (deadline, asked, seconds)
        if seconds > 0:
            per_worker[thread] = per_worker.get(thread, 0.0) + seconds
    return per_worker


@requires_math_verify
def test_pool_verifies_pathological_answers_in_parallel(fresh_math_state, monkeypatch):
    acc = make_math_accuracy(timeout_seconds=1.0, num_workers=4)
    assert acc(None, [r"\boxed{1}"] * 4, None, answer=["1"] * 4) == [1.0] * 4  # start the 4 workers
    pids = [verifier._proc.pid for verifier in _pool_of(acc)._verifiers]
    assert len(set(pids)) == 4

    # What the pool does, not how long it takes (a shared machine's load decides that): every batch it is
    # given, and every request a worker serves, with how many requests were in flight at once.
    batches, requests = [], []
    lock, in_flight = threading.Lock(), [0]
    score, score_many = worker._ProcessVerifier.score, worker._VerifierPool.score_many

    def recording_score(self, gold, completion, timeout_seconds):
        with lock:
            in_flight[0] += 1
            request = {"pid": self._proc.pid, "completion": completion, "timeout": timeout_seconds}
            request["concurrent"] = in_flight[0]
            requests.append(request)
        try:
            request["result"] = score(self, gold, completion, timeout_seconds)
            return request["result"]
        finally:
            with lock:
                in_flight[0] -= 1

    def recording_score_many(self, items, timeout_seconds, num_workers, deadline=None):
        batches.append({"items": list(items), "timeout": timeout_seconds, "deadline": deadline})
        return score_many(self, items, timeout_seconds, num_workers, deadline)

    monkeypatch.setattr(worker._ProcessVerifier, "score", recording_score)
    monkeypatch.setattr(worker._VerifierPool, "score_many", recording_score_many)

    normal = [(r"\boxed{34}", "34", 1.0), (r"\boxed{35}", "34", 0.0), (r"\boxed{\frac{1}{2}}", "0.5", 1.0)]
    normal += [(r"so \boxed{0.5}", r"\frac12", 1.0)]
    completions, golds, expected = [], [], []
    for k, (completion, gold, right) in enumerate(normal):  # pathological, normal, pathological, ...
        completions += [PATHOLOGICAL, completion] if k < 3 else [completion]
        golds += ["34", gold] if k < 3 else [gold]
        expected += [0.0, right] if k < 3 else [right]
    with pytest.warns(RuntimeWarning, match="longer than 1.0s"):
        scores = acc(None, completions, None, answer=golds)
    assert scores == expected == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]

    # Two passes: all 7 items with the short first-pass budget and no deadline, then only the 3 overruns,
    # with the full cap under one shared deadline (one cap for the three, not one each after another).
    first, retry = batches
    assert len(first["items"]) == 7 and first["timeout"] == worker.first_pass_seconds(1.0) == 0.25
    assert first["deadline"] is None
    assert [c for _, c in retry["items"]] == [PATHOLOGICAL] * 3
    assert retry["timeout"] == 1.0 and retry["deadline"] is not None
    retried = requests[7:]
    assert len(requests) == 10 and all(r["completion"] == PATHOLOGICAL for r in retried)
    # Each retried item's budget is the cap cut to what was left of the shared deadline, never more.
    assert all(0 < r["timeout"] <= 1.0 for r in retried)
    # In parallel: the three retries went to three different workers and were all in flight at once.
    assert len({r["pid"] for r in retried}) == 3
    assert max(r["concurrent"] for r in retried) == 3
    # Each worker interrupted its pathological item itself (its own timer answered, `TIMEOUT`), so none was
    # killed and restarted.
    assert all(r["result"] is worker.TIMEOUT for r in retried)
    assert [verifier._proc.pid for verifier in _pool_of(acc)._verifiers] == pids
    worker._close_process_verifiers()
    assert not any(_alive(pid) for pid in pids)  # closing kills every worker


@requires_math_verify
def test_batch_overruns_share_one_deadline_and_normal_items_are_unaffected(fresh_math_state, monkeypatch):
    """Eight pathological answers on two workers cost about one cap together, not ceil(8 / 2) = 4 caps."""
    # A 4 s cap gives the workers' own timers 0.9 s of grace before the parent kills one: at 2 s (0.5 s of
    # grace) a loaded machine (load 5 on 2 cores) answered late once and the worker was replaced.
    cap = 4.0
    acc = make_math_accuracy(timeout_seconds=cap, num_workers=2)
    assert acc(None, [r"\boxed{1}"] * 2, None, answer=["1"] * 2) == [1.0, 1.0]  # start both workers
    pids = [verifier._proc.pid for verifier in _pool_of(acc)._verifiers]
    normal = [(r"\boxed{34}", "34", 1.0), (r"\boxed{35}", "34", 0.0), (r"\boxed{\frac{1}{2}}", "0.5", 1.0)]
    completions, golds, expected = [], [], []
    for k in range(12):  # pathological answers interleaved with ordinary ones, from the first item on
        if k % 3 != 2:
            completions.append(PATHOLOGICAL), golds.append("34"), expected.append(0.0)
        completion, gold, score = normal[k % 3]
        completions.append(completion), golds.append(gold), expected.append(score)
    assert completions.count(PATHOLOGICAL) == 8
    budgets = _record_retry_budgets(monkeypatch)
    with pytest.warns(RuntimeWarning, match=f"longer than {cap}s"):
        scores = acc(None, completions, None, answer=golds)
    assert scores == expected
    # The eight overruns were retried under one deadline. A worker waits out every budget it is handed (its
    # pathological item ends only at its timer), so the budgets one worker is handed add up to at most one
    # cap: ~1.6 s of first pass plus one 4 s deadline, not the ceil(8 / 2) x 4 = 16 s of a batch whose every
    # item gets its own cap.
    per_worker = _budgets_per_worker(budgets, cap, retried=8)
    assert len(per_worker) == 2 and all(0 < total <= cap for total in per_worker.values()), per_worker
    assert worker.first_pass_seconds(cap) == 0.4
    # The overruns were interrupted by the workers' own timers, not by killing the workers. On a loaded machine
    # one timer can answer after the kill grace and that worker is (rightly) replaced: one must have kept its own.
    kept = [
        verifier._proc is not None and verifier._proc.pid == pid
        for verifier, pid in zip(_pool_of(acc)._verifiers, pids)
    ]
    assert any(kept), kept


@requires_math_verify
def test_signal_backend_overruns_share_one_deadline(fresh_math_state, monkeypatch):
    cap = 2.0
    acc = make_math_accuracy(timeout_seconds=cap, backend="signal")
    completions = [PATHOLOGICAL, r"\boxed{34}"] * 4
    acc(None, [r"\boxed{1}"], None, answer=["1"])  # math-verify's imports
    budgets = _record_retry_budgets(monkeypatch)
    with pytest.warns(RuntimeWarning, match=f"longer than {cap}s"):
        scores = acc(None, completions, None, answer=["34"] * 8)
    assert scores == [0.0, 1.0] * 4
    # One after another in this thread, each pathological item running to its timer: their budgets add up
    # to at most one cap (each item's own cap, one after another, was 4 x 2 s).
    per_worker = _budgets_per_worker(budgets, cap, retried=4)
    assert list(per_worker) == [threading.get_ident()] and 0 < per_worker[threading.get_ident()] <= cap


def _slow_or_sleeping_worker_command(config_json):
    # Answers containing 7 verify in 0.6 s (over the first pass, within the cap); all others sleep for
    # 30 s, interruptibly, like sympy on a huge power: the worker's own timer ends them.
    patch = (
        "import time, math_verify\n"
        "real_verify = math_verify.verify\n"
        "def verify(gold, predicted, **k):\n"
        "    if '7' in str(predicted):\n"
        "        time.sleep(0.6)\n"
        "        return real_verify(gold, predicted, **k)\n"
        "    time.sleep(30)\n"
        "math_verify.verify = verify\n"
    )
    return [sys.executable, "-c", patch + worker._WORKER_BOOTSTRAP, worker.__file__, config_json]


@requires_math_verify
def test_batch_deadline_scores_a_slow_answer_and_ends_the_overruns(fresh_math_state, monkeypatch):
    """One worker: a slow but fine answer is retried and scored; four overruns end at one deadline."""
    monkeypatch.setattr(worker, "_worker_command", _slow_or_sleeping_worker_command)
    cap = 1.0
    acc = make_math_accuracy(timeout_seconds=cap, backend="process", num_workers=1)
    assert acc(None, ["no answer"], None, answer=["1"]) == [0.0]  # starts the worker
    pid = _pool_of(acc)._verifiers[0]._proc.pid
    # The deadline's clock moves by what each request took in the worker: the slow answer's 0.6 s when it is
    # scored, an overrun's whole budget (it ends at its timer). Every request the worker serves is counted.
    clock = fake_clock(monkeypatch)
    requests: list[tuple[str, float]] = []
    score = worker._ProcessVerifier.score

    def timed_score(self, gold, completion, timeout_seconds):
        result = score(self, gold, completion, timeout_seconds)
        requests.append((completion, timeout_seconds))
        clock.now += 0.6 if result is not worker.TIMEOUT else timeout_seconds
        return result

    monkeypatch.setattr(worker._ProcessVerifier, "score", timed_score)
    completions = [r"\boxed{7}"] + [rf"\boxed{{{k}}}" for k in range(1, 6)]
    budgets = _record_retry_budgets(monkeypatch)
    with pytest.warns(RuntimeWarning, match=f"longer than {cap}s"):
        scores = acc(None, completions, None, answer=["7", "1", "2", "3", "4", "5"])
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # the slow answer is right; the others time out
    # All six overran the 0.25 s first pass and were retried under one 1 s deadline: the slow answer first
    # (scored, in 0.6 s), then one overrun in the 0.4 s it left, and the four after the deadline not started
    # at all. Each overrun getting the cap would have taken 5 x 1 s + 0.6 s.
    _budgets_per_worker(budgets, cap, retried=6)
    assert [seconds for *_, seconds, _ in budgets] == pytest.approx([1.0, 0.4, 0.0, 0.0, 0.0, 0.0], abs=1e-9)
    assert requests[:6] == [(c, 0.25) for c in completions]  # the first pass
    assert [c for c, _ in requests[6:]] == [r"\boxed{7}", r"\boxed{1}"]  # the retries the worker served
    assert _pool_of(acc)._verifiers[0]._proc.pid == pid  # interrupted by its own timer: no restart
    worker._close_process_verifiers()


def _stuck_in_c_worker_command(config_json):
    # A hang the worker's own SIGALRM timer cannot interrupt, as inside C code that never returns.
    patch = (
        "import signal, time, math_verify\n"
        "def stuck(*a, **k):\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "    time.sleep(30)\n"
        "math_verify.verify = stuck\n"
    )
    return [sys.executable, "-c", patch + worker._WORKER_BOOTSTRAP, worker.__file__, config_json]


@requires_math_verify
@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
def test_pool_kills_and_replaces_a_worker_its_timer_cannot_reach(fresh_math_state, monkeypatch):
    monkeypatch.setattr(worker, "_worker_command", _stuck_in_c_worker_command)
    acc = make_math_accuracy(timeout_seconds=0.5, num_workers=2)
    assert acc(None, ["no answer"] * 2, None, answer=["1"] * 2) == [0.0, 0.0]  # starts both workers
    pool = _pool_of(acc)
    pids = [verifier._proc.pid for verifier in pool._verifiers]
    with pytest.warns(RuntimeWarning, match="longer than 0.5s"):
        assert acc(None, [r"\boxed{1}"] * 2, None, answer=["1"] * 2) == [0.0, 0.0]
    assert not any(_alive(pid) for pid in pids)  # killed and reaped
    deadline = time.monotonic() + 30
    while not all(v.running for v in pool._verifiers) and time.monotonic() < deadline:
        time.sleep(0.05)  # replaced in the background, ahead of the next batch
    new_pids = [verifier._proc.pid for verifier in pool._verifiers]
    assert all(v.running for v in pool._verifiers) and not set(new_pids) & set(pids)
    worker._close_process_verifiers()
    assert not any(_alive(pid) for pid in new_pids)


def test_default_pool_size_follows_the_cpus_and_the_local_processes(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert worker.default_num_workers() == 12
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert worker.default_num_workers() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    assert worker.default_num_workers() == 16
    with pytest.raises(ValueError, match="`num_workers` must be a positive integer"):
        make_math_accuracy(num_workers=0)


@requires_math_verify
@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="POSIX timers")
def test_orphaned_worker_kills_itself():
    # A worker spinning where its SIGALRM cannot reach, whose parent never kills it (the trainer died
    # with SIGKILL), ends itself after 2 x timeout + 1 s of CPU time.
    patch = (
        "import signal, math_verify\n"
        "def spin(*a, **k):\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "    while True:\n"
        "        pass\n"
        "math_verify.verify = spin\n"
    )
    config = json.dumps({"float_rounding": 6, "numeric_precision": 15, "strict": True})
    command = [sys.executable, "-c", patch + worker._WORKER_BOOTSTRAP, worker.__file__, config]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        proc.stdin.write(json.dumps({"gold": "1", "completion": r"\boxed{1}", "timeout": 0.2}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == -signal.SIGPROF  # 1.4 s of CPU; spinning forever without it
    finally:
        proc.kill()
        proc.wait()
