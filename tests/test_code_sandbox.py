"""The hostile-program corpus: each program gets the verdict it must get, and nothing outside changes.

After every case: no process of the sandbox's uid is alive, no launcher or harness outlived its run, the
trainer's fake checkpoint folder is byte-for-byte intact, and (where the case can) the parent saw the isolation
it needed. Every case runs under both backends, the launcher's own namespaces and bubblewrap (skipped, with the
reason, where ``bwrap`` is not installed). The limits are small so that the file stays fast on a loaded machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
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

BWRAP = shutil.which("bwrap")
needs_bwrap = pytest.mark.skipif(
    BWRAP is None, reason="bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap"
)
BACKENDS = ["namespaces", pytest.param("bwrap", marks=needs_bwrap)]

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


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def sandbox(backend: str) -> Sandbox:
    return Sandbox(limits=LIMITS, backend=backend)


@pytest.fixture(scope="module")
def open_sandbox(backend: str) -> Sandbox:
    """Nothing hidden: only permissions and namespaces (and under bwrap, the bare file system) protect the
    repository's files."""
    return Sandbox(limits=LIMITS, hide_paths=(), backend=backend)


_PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(scope="module")
def subreaper():
    """This process adopts orphans while the module runs, so that a launcher or harness that outlived its run
    (bwrap's pid 1 has a session of its own) shows up as a child of this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    yield
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _surviving_launchers() -> list[int]:
    """Live children of this process running a sandbox launcher (reaping the dead ones)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if int(fields[1]) != os.getpid() or b"launcher.py" not in cmdline:
            continue
        if fields[0] in (b"Z", b"X"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)
        else:
            alive.append(int(entry))
    return alive


@pytest.fixture()
def intact(checkpoints: list[Path], subreaper):
    before = [_tree_digest(c) for c in checkpoints]
    yield
    assert find_sandbox_processes([Sandbox().uid(0)]) == [], "a sandboxed process outlived its run"
    assert _surviving_launchers() == [], "a sandbox's launcher or harness outlived its run"
    assert [_tree_digest(c) for c in checkpoints] == before, "the trainer's checkpoint changed"


def _isolation(sb: Sandbox) -> dict:
    expected = {"namespaces": True, "uid": sb.uid(0)}
    if sb.resolved_backend == "bwrap":
        expected["backend"] = "bwrap"
    return expected


def _run(sb: Sandbox, program: str, mode: str = "stdio", tests=None, **kwargs):
    result = sb.run(textwrap.dedent(program), mode, tests or [{"input": ""}], **kwargs)
    assert result.fatal is None, result.fatal
    assert result.isolation == _isolation(sb)
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


def test_completion_limit_leaves_later_tests_not_run(backend: str, intact) -> None:
    short = Sandbox(
        limits=SandboxLimits(cpu_seconds=1, wall_seconds=1.0, completion_seconds=1.5, memory_mb=256),
        backend=backend,
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
    # hide_paths=() and protected by the unprivileged uid alone (under bwrap: not in the sandbox at all).
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
    expected = "FileNotFoundError" if which == 0 or sb.backend == "bwrap" else "PermissionError"
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
        # Both fail at once: no interface but loopback, so nothing was sent anywhere (a timeout would have
        # meant packets left). The namespaces backend leaves loopback down ("network unreachable"); bwrap
        # brings the sandbox's own loopback up, on which nothing listens ("connection refused"): either
        # way the host's listener is out of reach.
        loopback = errno.ECONNREFUSED if sandbox.backend == "bwrap" else errno.ENETUNREACH
        assert [int(c) for c in _stdout(result).split()] == [loopback, errno.ENETUNREACH]
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
        print(len(os.listdir("/run")) if os.path.isdir("/run") else "absent")
        """
    try:
        # /run is an empty hidden folder under the namespaces backend, and not there at all under bwrap.
        run = "absent" if sandbox.backend == "bwrap" else "0"
        assert _stdout(_run(sandbox, program)).split() == ["FileNotFoundError", run]
        # Nothing hidden: the socket is reachable (documented: hide_paths decides what is visible), except
        # under bwrap, whose file system holds none of the repository.
        reached = "FileNotFoundError" if sandbox.backend == "bwrap" else "connected"
        assert _stdout(_run(open_sandbox, program)).split()[0] == reached
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


def test_a_failed_isolation_set_up_is_an_error_not_a_zero_score(backend: str, subreaper) -> None:
    class BrokenMounts(Sandbox):
        def _job(self, *args, **kwargs):
            job = super()._job(*args, **kwargs)
            job[
                "tmpfs_bytes"
            ] = -1  # the /tmp mount is refused (EINVAL; bwrap: bad --size) before the program runs
            return job

    if backend == "bwrap":
        match = "the bwrap code sandbox could not be set up: the sandbox launcher failed: bwrap: .*Use backend='namespaces'"
    else:
        match = "isolation set-up failed: OSError"
    with pytest.raises(IsolationUnavailableError, match=match):
        BrokenMounts(limits=LIMITS, backend=backend).run("print(1)", "stdio", [{"input": ""}])
    assert find_sandbox_processes([Sandbox().uid(0)]) == []
    assert _surviving_launchers() == []


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


def test_program_sees_only_its_own_processes_and_holds_no_capabilities(sandbox: Sandbox, intact) -> None:
    result = _run(
        sandbox,
        """
        import os
        def caps(pid):
            return {l.split(":")[0]: int(l.split()[1], 16) for l in open(f"/proc/{pid}/status") if l.startswith("Cap")}
        mine = caps("self")
        print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()) == [1, os.getpid()],
              mine["CapInh"], mine["CapPrm"], mine["CapEff"], mine["CapAmb"], caps(1)["CapEff"])
        """,
    )
    visible, inheritable, permitted, effective, ambient, harness = _stdout(result).split()
    assert visible == "True"  # the harness (pid 1) and itself: no host process
    assert (inheritable, permitted, effective, ambient) == ("0", "0", "0", "0")
    if sandbox.backend == "bwrap":
        # The harness keeps setuid, setgid, kill, chown and dac_override only (bits 6, 7, 5, 0, 1).
        assert int(harness) == (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)


@needs_bwrap
def test_bwrap_file_system_holds_only_what_python_needs(checkpoints: list[Path], intact) -> None:
    # Nothing hidden: the bare root alone keeps the parent's files out of sight.
    sb = Sandbox(limits=LIMITS, backend="bwrap", hide_paths=(), head_chars=4000)
    hf_cache = Path(os.path.expanduser("~/.cache/huggingface"))
    secrets = [REPOSITORY / "pyproject.toml", checkpoints[1] / "token", hf_cache, Path("/home"), Path("/run")]
    secrets += [Path(p) for p in ("/var", "/etc/passwd", "/etc/shadow", "/root/.bash_history", "/sys")]
    result = _run(
        sb,
        f"""
        import json, os
        def attempt(action, path):
            try:
                action(path)
                return "DONE"
            except OSError as e:
                return type(e).__name__
        read = lambda p: os.listdir(p) if os.path.isdir(p) else open(p).read()
        write = lambda p: open(p, "a").close()
        print(json.dumps({{
            "top": sorted(os.listdir("/")),
            "etc": sorted(os.listdir("/etc")),
            "read": [attempt(read, p) for p in {[str(p) for p in secrets]!r}],
            "write": [attempt(write, p) for p in ("/x", "/usr/x", "/etc/x", "/sandbox/launcher.py")],
        }}))
        """,
    )
    seen = json.loads(_stdout(result))
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "sbin", "tmp", "usr"}
    # The interpreter's folders are bound at their own paths, so their top folder shows (here /root and /work,
    # holding nothing but the path down to the interpreter and the virtual environment).
    interpreter = {Path(p).parts[1] for p in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable))}
    assert set(seen["top"]) <= system | interpreter, seen["top"]
    assert set(seen["etc"]) <= {"ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives"}
    assert seen["read"] == ["FileNotFoundError"] * len(secrets), seen["read"]
    assert set(seen["write"]) <= {"PermissionError", "OSError"}, seen["write"]  # read-only root and binds


@needs_bwrap
def test_bwrap_honours_hide_paths_inside_what_it_binds(intact) -> None:
    sb = Sandbox(limits=LIMITS, backend="bwrap", hide_paths=("/usr/share", "/etc"))
    result = _run(sb, "import os\nprint(os.listdir('/usr/share'), os.path.exists('/etc/ld.so.cache'))\n")
    assert _stdout(result).split() == ["[]", "False"]


def test_stopping_a_run_early_leaves_no_launcher_or_harness(sandbox: Sandbox, intact) -> None:
    # The trainer stops after the first test (all-or-nothing scoring) while the second one sleeps: it kills the
    # launcher (under bwrap: bwrap, whose pid 1 has a session of its own and must die with it).
    result = sandbox.run(
        "import time\nif input() == 'sleep':\n    time.sleep(30)\nprint(1)\n",
        "stdio",
        [{"input": "go"}, {"input": "sleep"}],
        on_record=lambda record: False,
    )
    assert result.stopped_early and len(result.records) == 1 and result.leaked == 0
