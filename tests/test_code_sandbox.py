"""The hostile-program corpus: each program gets the verdict it must get, and nothing outside changes.

After every case: no process of the sandbox's uid is alive, the trainer's fake checkpoint folder is
byte-for-byte intact, and (where the case can) the parent saw the isolation it needed. The limits are small
so that the file stays fast on a loaded machine.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trl_sae.rewards.sandbox import (
    IsolationUnavailableError,
    Sandbox,
    SandboxLimits,
    find_sandbox_processes,
)

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="the full sandbox needs Linux and root (CI runs as root)",
)

LIMITS = SandboxLimits(
    cpu_seconds=1.0,
    wall_seconds=2.0,
    completion_seconds=8.0,
    memory_mb=256,
    processes=16,
    open_files=32,
    file_mb=1.0,
    tmpfs_mb=8,
)
SECRET = "hf_sandbox_test_secret_5f1c9a"


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(oct(path.stat().st_mode).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


REPOSITORY = Path(__file__).resolve().parent.parent
# The sandbox mounts a private tmpfs over these: a checkout under one of them is out of sight even with nothing
# hidden, so the tests of what permissions alone protect need a checkout elsewhere (CI's is).
PRIVATE_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm")
REPOSITORY_IN_PRIVATE_MOUNT = any(REPOSITORY.is_relative_to(mount) for mount in PRIVATE_MOUNTS)
needs_visible_repository = pytest.mark.skipif(
    REPOSITORY_IN_PRIVATE_MOUNT,
    reason=f"the checkout {REPOSITORY} lies under one of {PRIVATE_MOUNTS}, which the sandbox replaces with its "
    "own tmpfs: nothing there is visible to test permissions on; run from a checkout elsewhere",
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Fake checkpoint folders: one under /tmp, one in the repository (visible when nothing is hidden)."""
    in_tmp = tmp_path_factory.mktemp("ckpt") / "checkpoint-100"
    in_repo = REPOSITORY / f".sandbox-test-ckpt-{os.getpid()}" / "checkpoint-100"
    for folder in (in_tmp, in_repo):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(os.urandom(4096))
        (folder / "trainer_state.json").write_text('{"global_step": 100}')
        (folder / "token").write_text(SECRET)
    yield [in_tmp, in_repo]
    import shutil

    shutil.rmtree(in_repo.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(limits=LIMITS)


@pytest.fixture(scope="module")
def open_sandbox() -> Sandbox:
    """Nothing hidden: only permissions and namespaces protect the repository's files."""
    return Sandbox(limits=LIMITS, hide_paths=())


@pytest.fixture()
def intact(checkpoints: list[Path], sandbox: Sandbox):
    before = [_tree_digest(c) for c in checkpoints]
    yield
    assert find_sandbox_processes([sandbox.uid(0)]) == [], "a sandboxed process outlived its run"
    assert [_tree_digest(c) for c in checkpoints] == before, "the trainer's checkpoint changed"


def _run(sb: Sandbox, program: str, mode: str = "stdio", tests=None, **kwargs):
    result = sb.run(textwrap.dedent(program), mode, tests or [{"input": ""}], **kwargs)
    assert result.fatal is None, result.fatal
    assert result.isolation == {"namespaces": True, "uid": sb.uid(0)}
    assert result.leaked == 0, "the parent had to kill leftovers: the namespace did not"
    return result


def _status(result) -> str:
    assert len(result.records) == 1, result.records
    return result.records[0]["status"]


def _stdout(result) -> str:
    return result.records[0].get("stdout_head", "")


def test_bounded_spawner_gets_at_most_the_process_limit(sandbox: Sandbox, intact) -> None:
    # Proven first, with a bounded program, before the fork bomb below relies on it.
    result = _run(
        sandbox,
        """
        import os, time
        got = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            got += 1
        print(got)
        """,
    )
    assert _status(result) == "ok"
    assert int(_stdout(result)) == LIMITS.processes - 1  # itself plus 15 children


def test_fork_bomb(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
    )
    assert _status(result) == "timeout"


def test_infinite_loop(sandbox: Sandbox, intact) -> None:
    result = _run(sandbox, "while True:\n    pass\n")
    assert _status(result) == "timeout"


def test_busy_threads(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import threading
        started = 0
        for _ in range(100):
            try:
                threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
                started += 1
            except RuntimeError:
                break
        print(started, flush=True)
        while True:
            pass
        """,
    )
    assert _status(result) == "timeout"


def test_memory_bomb(sandbox: Sandbox, intact) -> None:
    result = _run(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n")
    assert _status(result) == "memory"
    one_shot = _run(sandbox, "x = bytearray(10 * 2**30)\n")
    assert _status(one_shot) == "memory"


def test_ten_gigabyte_write_hits_the_file_size_limit(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        block = b"0" * (1 << 20)
        with open("big.bin", "wb") as f:
            for _ in range(10 * 1024):
                f.write(block)
        """,
    )
    assert _status(result) == "file_size_limit"


def test_open_file_limit(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        handles = []
        try:
            while len(handles) < 1000:
                handles.append(open("/dev/null"))
        except OSError as e:
            print(type(e).__name__, len(handles) < 32)
        """,
    )
    assert _stdout(result).split() == ["OSError", "True"]  # EMFILE below open_files=32


def test_completion_limit_leaves_later_tests_not_run(intact) -> None:
    short = Sandbox(
        limits=SandboxLimits(cpu_seconds=1, wall_seconds=1.0, completion_seconds=1.5, memory_mb=256)
    )
    result = short.run("import time\ntime.sleep(5)\n", "stdio", [{"input": ""}] * 5)
    statuses = [r["status"] for r in result.records]
    # Each test runs into its wall limit; the completion's 1.5 s cover at most two of them.
    assert len(statuses) == 5 and statuses[0] == "timeout" and statuses[-1] == "not_run"
    assert set(statuses) == {"timeout", "not_run"} and statuses.count("timeout") <= 2


def test_filling_the_tmpfs_fails_the_program_not_the_sandbox(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import os
        if not os.path.exists("f0"):
            for i in range(20):  # 1 MiB files (the file size limit) into an 8 MiB tmpfs
                try:
                    with open(f"f{i}", "wb") as f:
                        f.write(b"0" * (1 << 20))
                except OSError as e:
                    print(e.errno)
                    break
        print(input())
        """,
        tests=[{"input": "a"}, {"input": "b" * 3_000_000}],
    )
    # The first run fills the disk its own stdout lives on; the second cannot even get its input.
    assert [r["status"] for r in result.records] == ["runtime_error", "runtime_error"]
    assert "could not prepare" in result.records[1]["stderr_tail"]


def test_huge_stdout(sandbox: Sandbox, intact) -> None:
    result = _run(sandbox, "while True:\n    print('x' * 1000)\n")
    assert _status(result) == "file_size_limit"


@pytest.mark.parametrize("which", [0, pytest.param(1, marks=needs_visible_repository)])
def test_cannot_write_or_delete_the_trainers_files(
    sandbox: Sandbox, open_sandbox: Sandbox, checkpoints: list[Path], intact, which: int
) -> None:
    # which=0: the /tmp checkpoint, hidden by the private /tmp; which=1: the repository's, visible with
    # hide_paths=() and protected by the unprivileged uid alone.
    target = checkpoints[which]
    sb = open_sandbox if which else sandbox
    result = _run(
        sb,
        f"""
        import os, shutil
        target = {str(target)!r}
        outcomes = []
        for attempt in (
            lambda: open(os.path.join(target, "model.safetensors"), "wb").write(b"pwned"),
            lambda: os.remove(os.path.join(target, "trainer_state.json")),
            lambda: shutil.rmtree(target),
            lambda: os.chmod(target, 0o777),
            lambda: open(os.path.join(target, "new_file"), "w").write("x"),
            lambda: open("/tmp/../" + target.lstrip("/") + "/x", "w"),
        ):
            try:
                attempt()
                outcomes.append("DONE")
            except OSError as e:
                outcomes.append(type(e).__name__)
        print(" ".join(outcomes))
        """,
    )
    assert _status(result) == "ok"
    assert "DONE" not in _stdout(result)
    expected = "FileNotFoundError" if which == 0 else "PermissionError"
    assert set(_stdout(result).split()) == {expected}


def test_cannot_read_the_parents_environment_or_secret_files(
    sandbox: Sandbox, checkpoints: list[Path], intact, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    home_secret = Path(os.path.expanduser("~")) / ".cache" / "huggingface"
    result = _run(
        sandbox,
        f"""
        import os, glob
        secret = {SECRET!r}
        seen = []
        if any(secret in v for v in os.environ.values()):
            seen.append("env")
        for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
            try:
                if secret.encode() in open(path, "rb").read():
                    seen.append(path)
            except OSError:
                pass
        for path in ({str(checkpoints[0] / "token")!r}, {str(checkpoints[1] / "token")!r},
                     {str(home_secret)!r} + "/token", "/etc/shadow"):
            try:
                if secret in open(path).read():
                    seen.append(path)
            except OSError:
                pass
        print("FOUND " + " ".join(seen) if seen else "NOTFOUND", sorted(os.environ))
        """,
    )
    assert _status(result) == "ok"
    assert _stdout(result).startswith("NOTFOUND"), _stdout(result)
    assert "HF_TOKEN" not in _stdout(result)


def test_no_network_not_even_loopback(sandbox: Sandbox, intact) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.0)
    port = listener.getsockname()[1]
    try:
        result = _run(
            sandbox,
            f"""
            import socket
            codes = []
            for address in (("127.0.0.1", {port}), ("192.0.2.1", 80)):
                s = socket.socket()
                s.settimeout(1.0)
                codes.append(s.connect_ex(address))
            print(*codes)
            """,
        )
        assert _status(result) == "ok"
        # Both fail at once with "network unreachable": no interface is up in the sandbox's namespace,
        # so nothing was sent anywhere (a timeout would have meant packets left).
        assert [int(c) for c in _stdout(result).split()] == [errno.ENETUNREACH, errno.ENETUNREACH]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


@needs_visible_repository
def test_host_unix_sockets_are_hidden(
    sandbox: Sandbox, open_sandbox: Sandbox, checkpoints: list[Path], intact
) -> None:
    # A world-connectable UNIX socket in the repository (the trainer's cwd, hidden by default), like a
    # database's in /run: the network namespace does not cover sockets on the file system.
    path = checkpoints[1].parent / "service.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    os.chmod(path, 0o777)
    server.listen(1)
    program = f"""
        import os, socket
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({str(path)!r})
            print("connected", end=" ")
        except OSError as e:
            print(type(e).__name__, end=" ")
        print(len(os.listdir("/run")))
        """
    try:
        assert _stdout(_run(sandbox, program)).split() == ["FileNotFoundError", "0"]
        # Nothing hidden: the socket is reachable (documented: hide_paths decides what is visible).
        assert _stdout(_run(open_sandbox, program)).split()[0] == "connected"
    finally:
        server.close()
        path.unlink()


def test_user_namespace_does_not_lift_the_process_limit(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import ctypes, os, time
        created = ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0  # CLONE_NEWUSER
        got = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            got += 1
        print(created, got)
        """,
    )
    created, got = _stdout(result).split()
    assert int(got) == LIMITS.processes - 1, created


def test_shell_runs_inside_the_sandbox_and_its_background_job_dies(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import subprocess
        out = subprocess.run(["sh", "-c", "id -u; (sleep 60 >/dev/null 2>&1 &); echo spawned"], capture_output=True, text=True)
        print(out.stdout.split())
        """,
    )
    assert _status(result) == "ok"
    assert _stdout(result).strip() == str([str(sandbox.uid(0)), "spawned"])


def test_cannot_kill_the_harness_or_other_processes(sandbox: Sandbox, intact) -> None:
    victim = subprocess.Popen(["sleep", "30"])
    try:
        result = _run(
            sandbox,
            f"""
            import os, signal
            outcomes = []
            for pid in (os.getppid(), 1, {victim.pid}, {os.getpid()}):
                try:
                    os.kill(pid, signal.SIGKILL)
                    outcomes.append("sent")
                except OSError as e:
                    outcomes.append(type(e).__name__)
            print(*outcomes, flush=True)
            try:
                os.kill(-1, signal.SIGKILL)  # every process this uid may signal: none but itself
            except ProcessLookupError:
                pass
            """,
        )
        assert _status(result) == "ok"
        # The harness is pid 1 (root): EPERM; outside pids are not visible in the pid namespace.
        outcomes = _stdout(result).split()
        assert outcomes[:2] == ["PermissionError", "PermissionError"]
        assert "sent" not in outcomes
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_exit_before_the_tests_is_not_a_pass(sandbox: Sandbox, intact) -> None:
    for program in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "raise SystemExit\n"):
        asserted = _run(
            sandbox, program + "def f(x):\n    return x\n", "assert", [{"code": "assert f(1) == 2"}]
        )
        assert _status(asserted) == "runtime_error", program
        assert "did not run to their end" in asserted.records[0]["stderr_tail"]
        called = _run(sandbox, program + "def f(x):\n    return x\n", "call", [{"args": [1]}], fn_name="f")
        assert _status(called) == "runtime_error", program
        assert "not JSON data" in called.records[0]["stderr_tail"]


def test_always_equal_result_is_not_a_pass(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        class Anything:
            def __eq__(self, other):
                return True
        def f(x):
            return Anything()
        """,
        "call",
        [{"args": [1]}],
        fn_name="f",
    )
    assert _status(result) == "runtime_error"  # not JSON data: compared outside, it cannot pass
    assert "is not JSON serializable" in result.records[0]["stderr_tail"]


def test_forged_result_bytes_cannot_crash_the_harness(sandbox: Sandbox, intact) -> None:
    # The harness parses what the program wrote as its result: deeply nested JSON must fail the test,
    # not the harness.
    result = _run(
        sandbox,
        "import os\nos.write(3, b'[' * 200000 + b']' * 200000)\nos._exit(0)\ndef f():\n    pass\n",
        "call",
        [{"args": []}],
        fn_name="f",
    )
    assert _status(result) == "runtime_error"
    assert "not JSON data" in result.records[0]["stderr_tail"]


def test_recursive_import(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        with open("loop.py", "w") as f:
            f.write("import sys\\nsys.modules.pop('loop', None)\\nimport loop\\n")
        import loop
        """,
    )
    assert _status(result) == "runtime_error"
    assert "RecursionError" in result.records[0]["stderr_tail"]


def test_sigterm_ignoring_sleeper_is_killed(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import signal, time
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
            signal.signal(sig, signal.SIG_IGN)
        time.sleep(60)
        """,
    )
    assert _status(result) == "timeout"


def test_daemon_left_behind_is_killed_with_its_sandbox(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    time.sleep(0.05)
            os._exit(0)
        print(int(input()) * 2)
        """,
        tests=[{"input": "21"}, {"input": "4"}],
    )
    assert [r["status"] for r in result.records] == ["ok", "ok"]
    assert [r["stdout_head"].strip() for r in result.records] == ["42", "8"]


def test_setuid_binaries_cannot_regain_privileges(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox, "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0])\n"
    )
    assert _stdout(result).strip() == "1"


def test_isolation_required_but_unavailable_is_a_clear_error() -> None:
    with pytest.raises(IsolationUnavailableError, match="require_isolation=False"):
        Sandbox(limits=LIMITS, namespaces=False).run("print(1)", "stdio", [{"input": ""}])


def test_a_failed_isolation_set_up_is_an_error_not_a_zero_score() -> None:
    class BrokenMounts(Sandbox):
        def _job(self, *args, **kwargs):
            job = super()._job(*args, **kwargs)
            job["tmpfs_bytes"] = -1  # the /tmp mount is refused (EINVAL) before the program runs
            return job

    with pytest.raises(IsolationUnavailableError, match="isolation set-up failed: OSError"):
        BrokenMounts(limits=LIMITS).run("print(1)", "stdio", [{"input": ""}])
    assert find_sandbox_processes([Sandbox().uid(0)]) == []


def test_weak_mode_still_drops_privileges_and_blocks_sockets(intact) -> None:
    weak = Sandbox(limits=LIMITS, namespaces=False, require_isolation=False)
    result = weak.run(
        textwrap.dedent(
            """
            import os, socket
            blocked = []
            for attempt in (socket.socket, os.fork, lambda: os.kill(os.getppid(), 9)):
                try:
                    attempt()
                except PermissionError:
                    blocked.append("blocked")
            print(*blocked, os.getuid())
            """
        ),
        "stdio",
        [{"input": ""}],
    )
    assert result.isolation == {"namespaces": False, "uid": weak.uid(0)}
    assert result.records[0]["stdout_head"].split() == ["blocked"] * 3 + [str(weak.uid(0))]
    assert find_sandbox_processes([weak.uid(0)]) == []


def test_two_processes_sandboxes_never_share_a_uid_nor_sweep_each_others_programs(sandbox: Sandbox) -> None:
    """Two processes of one machine (two test workers, two training jobs, DDP ranks without LOCAL_RANK) took
    the same uids: one's sweep for leftovers found the other's running program, counted it as its own leak
    and killed it (seen as 5 sandbox tests failing when two pytest workers ran them at once)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    verdict = context.Queue()

    def long_program() -> None:
        result = sandbox.run("import time\ntime.sleep(1.5)\nprint('done')\n", "stdio", [{"input": ""}])
        verdict.put((result.records[0]["status"], result.leaked, sandbox.uid(0)))

    child = context.Process(target=long_program)
    child.start()
    time.sleep(0.5)  # the child's program is running
    quick = _run(sandbox, "print(int(input()) + 1)", tests=[{"input": "1", "output": "2"}])
    assert _status(quick) == "ok"
    status, leaked, child_uid = verdict.get(timeout=60)
    child.join(timeout=60)
    assert (status, leaked) == ("ok", 0)
    assert child_uid != sandbox.uid(0)
