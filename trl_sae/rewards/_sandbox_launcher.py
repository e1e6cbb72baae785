"""The sandbox's child side: sets up isolation, then runs a program against its tests, one fork per test.

The trainer (:mod:`trl_sae.rewards.sandbox`) starts this file as a script, ``python -I -S -B <this file>``,
in a new session with an empty environment, and writes the job (program, test inputs, limits) to its
stdin; it never receives expected outputs. Standard library only, no ``trl_sae`` import: the file runs
on its own, by path.

The process tree, as root with namespaces (the default)::

    launcher (outer namespaces, root)      waits for the harness, kills it at the hard deadline
      harness (pid 1 of new pid/net/mount/ipc/uts namespaces, root)
        test child (one per test, its own process group, an unprivileged slot uid, rlimits)
          ... whatever the program starts (all of it dies when the harness exits: pid namespace)

The harness writes one JSON line per finished test to its stdout (a pipe to the trainer). A test child
gets fresh files as stdin/stdout/stderr and nothing else; it drops privileges before any of the
program's code runs, so it cannot signal, trace or read the (root) harness. Without namespaces (not
root, or ``namespaces: false``) the launcher itself is the harness; see docs/guides/code.md for what that
mode does not protect against.
"""

import sys

# This file's folder (trl_sae/rewards, which has a math.py) must not shadow the standard library (Python
# < 3.11 puts it first even under -I; 3.11+ does not).
if sys.path and sys.path[0] and sys.path[0] == __file__.rpartition("/")[0]:
    del sys.path[0]

import builtins
import contextlib
import ctypes
import hashlib
import io
import json
import os
import resource
import select
import signal
import tempfile
import time
import traceback

# Run by path by the sandbox; trl_sae.rewards.code imports the two output-comparison helpers.
__all__ = ["canonical_json", "main", "normalize_output"]

# Modules competitive programs commonly import: loaded once here (as root, before forking), so a test
# child starts with them (faster), and they work even where the interpreter's own folder is not readable
# by the unprivileged uid.
_PRELOAD = (
    "array",
    "bisect",
    "collections",
    "copy",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
    "dataclasses",
    "enum",
    "socket",  # so that a program's network attempt meets the sandbox, not an unreadable stdlib folder
)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _emit(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    while data:
        try:
            data = data[os.write(fd, data) :]
        except InterruptedError:
            continue


# --------------------------------------------------------------------------------------------------
# Isolation set-up (root).
# --------------------------------------------------------------------------------------------------
def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _setup_mounts(job: dict) -> str:
    """In the new mount namespace: a fresh /proc, private tmpfs over /tmp, /var/tmp, /dev/shm, hidden paths."""
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    size = int(job["tmpfs_bytes"])
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},mode=1777")
    for path in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1048576,mode=1777")
    keep = sorted({os.path.realpath(p) for p in job["keep_paths"] if os.path.isdir(p)})
    hidden: list[str] = []
    for path in sorted({os.path.realpath(p) for p in job["hide_paths"] if os.path.isdir(p)}):
        if path in ("/", "/proc", "/tmp") or any(_under(path, h) for h in hidden):
            continue
        if any(_under(path, k) for k in keep):
            continue  # inside the interpreter's own tree: hiding it would break Python
        inner = [k for k in keep if _under(k, path) and k != path]
        fds = [os.open(k, os.O_PATH | os.O_DIRECTORY) for k in inner]
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=65536,mode=0755")
        for k, fd in zip(inner, fds):
            os.makedirs(k, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", k, None, _MS_BIND | _MS_REC)
            _mount(None, k, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
            os.close(fd)
        _mount(None, path, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=65536,mode=0755")
        hidden.append(path)
    workdir = "/tmp/sandbox"
    os.mkdir(workdir, 0o700)
    return workdir


# --------------------------------------------------------------------------------------------------
# The test child (runs the program; never returns).
# --------------------------------------------------------------------------------------------------
_AUDIT_DENY = (
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "os.kill",
    "os.killpg",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "subprocess.Popen",
    "ctypes.dlopen",
    "pty.spawn",
)


def _deny_hook(event: str, args: tuple) -> None:
    if event in _AUDIT_DENY:
        raise PermissionError(f"sandbox: {event} is not allowed")


def _fresh_stream(fd: int, mode: str) -> io.TextIOWrapper:
    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors="replace", line_buffering=(fd == 2))


def _child(job: dict, code, test: dict, fds: tuple, workdir: str, nonce: str | None, drop: bool) -> None:
    status = 1
    try:
        os.setpgid(0, 0)
        in_fd, out_fd, err_fd, res_fd = fds
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        low = 3
        if res_fd is not None:
            os.dup2(res_fd, 3)
            low = 4
        os.closerange(low, 65536)
        limits = job["limits"]
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        cpu = max(1, int(limits["cpu_seconds"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
        if drop:
            # Counted per uid: meaningful only for the sandbox's own slot uid (and never enforced for root).
            nproc = int(limits["processes"])
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.chdir(workdir)
        if drop:
            os.setgroups([])
            os.setgid(job["gid"])
            os.setuid(job["uid"])
            if os.getuid() != job["uid"] or os.geteuid() != job["uid"]:
                os._exit(125)
        # setuid binaries (su, mount, ...) must not give a program back the root it was just stripped of.
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.environ.clear()
        os.environ.update(job["env"])
        os.environ["HOME"] = os.environ["TMPDIR"] = workdir
        sys.stdin = sys.__stdin__ = _fresh_stream(0, "r")
        sys.stdout = sys.__stdout__ = _fresh_stream(1, "w")
        sys.stderr = sys.__stderr__ = _fresh_stream(2, "w")
        sys.argv = ["main.py"]
        sys.path.insert(0, workdir)
        if job["audit"]:
            sys.addaudithook(_deny_hook)
        namespace = {"__name__": "__main__", "__builtins__": builtins, "__file__": "main.py"}
        try:
            exec(code, namespace)
            mode = job["mode"]
            if mode == "call":
                target = _find_callable(namespace, job["fn_name"])
                result = target(*test["args"])
                sys.stdout.flush()
                os.write(3, json.dumps(result).encode())
            elif mode == "assert":
                exec(compile(test["code"], "test.py", "exec"), namespace)
                sys.stdout.flush()
                os.write(3, nonce.encode())
            status = 0
        except SystemExit as exit_:
            code_ = exit_.code
            if code_ is None:
                status = 0
            elif isinstance(code_, int):
                status = code_ & 0xFF
            else:
                print(code_, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                status = status or 1
    except BaseException:
        status = 124  # the harness's own set-up failed in the child
    os._exit(status)


def _find_callable(namespace: dict, fn_name: str):
    target = namespace.get(fn_name)
    if callable(target):
        return target
    solution = namespace.get("Solution")  # LeetCode-style: class Solution: def fn_name(self, ...)
    if isinstance(solution, type) and callable(getattr(solution, fn_name, None)):
        return getattr(solution(), fn_name)
    raise NameError(f"the program defines no function {fn_name!r}")


# --------------------------------------------------------------------------------------------------
# The harness: one forked child per test.
# --------------------------------------------------------------------------------------------------
def _tmpfile(workdir: str, data: bytes = b"") -> int:
    try:
        fd = os.open(workdir, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(dir=workdir)
        os.unlink(path)
    view = memoryview(data)
    while view:  # a short write (a full tmpfs) must not pass for the whole input; the next one raises
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_head(fd: int, limit: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, min(1 << 20, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def normalize_output(text: str) -> str:
    """Whitespace-tolerant form of program output: each line's words joined by one space, outer blank lines dropped."""
    # Split on "\n" only: "\r" (Windows line ends) and tabs are whitespace inside a line.
    lines = [" ".join(line.split()) for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines)


def canonical_json(value) -> str:
    """JSON text for comparing call results: integral floats as ints, tuples as lists, sorted keys."""

    def fix(v):
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
            return int(v)
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            return {str(k): fix(x) for k, x in v.items()}
        return v

    return json.dumps(fix(value), sort_keys=True, separators=(",", ":"))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


def _wait(pid: int, timeout: float) -> tuple[bool, int, object]:
    """Wait for ``pid`` at most ``timeout`` s: (timed_out, wait status, rusage); a timed-out child is killed."""
    timed_out = False
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    end = time.monotonic() + max(0.0, timeout)
    if pidfd is not None:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
        os.close(pidfd)
        timed_out = not ready
    else:
        delay = 0.001
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                return False, status, usage
            if time.monotonic() >= end:
                timed_out = True
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
    if timed_out:
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            with contextlib.suppress(ProcessLookupError):
                kill()
    _, status, usage = os.wait4(pid, 0)
    return timed_out, status, usage


def _sweep(job: dict, namespaced: bool, drop: bool) -> None:
    """Kill what a test left behind before the next test starts."""
    if namespaced:
        # The harness is pid 1 of the namespace: kill(-1) reaches every other process in it, i.e. exactly
        # the program's leftovers, which pid 1 then reaps (it inherits every orphan).
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                return
            try:
                while True:
                    os.waitpid(-1, 0)
            except ChildProcessError:
                return
    if drop:
        # Every process of the slot uid (unique to this sandbox): a forked killer with that uid.
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(job["gid"])
                os.setuid(job["uid"])
                for _ in range(3):
                    try:
                        os.kill(-1, signal.SIGKILL)
                    except ProcessLookupError:
                        break
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    else:
        _kill_descendants()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break


def _kill_descendants() -> None:
    """Kill this process's children (orphans re-parent to it: it is a child subreaper) until none are left."""
    me = os.getpid()
    for _ in range(50):
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2 :].split()
            if int(fields[1]) == me:
                children.append(int(entry))
        if not children:
            return
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _classify(timed_out: bool, status: int, usage, stderr: str, cpu_limit: float) -> str:
    if timed_out:
        return "timeout"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        cpu = usage.ru_utime + usage.ru_stime
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cpu_limit * 0.95):
            return "timeout"
        if sig == signal.SIGXFSZ:
            return "file_size_limit"
        return "runtime_error"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory"
    return "runtime_error"


def _harness(job: dict, out: int, workdir: str, namespaced: bool, drop: bool) -> None:
    deadline = time.monotonic() + float(job["completion_seconds"])
    if job["site"]:
        import site

        site.main()
    for name in _PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    if drop:
        os.chown(workdir, job["uid"], job["gid"])
    try:
        code = compile(job["program"], "main.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as error:
        _emit(out, {"fatal_program": f"{type(error).__name__}: {error}"[:500]})
        return
    limits = job["limits"]
    head_bytes = int(job["head_bytes"])
    for index, test in enumerate(job["tests"]):
        left = deadline - time.monotonic()
        if left <= 0:
            _emit(out, {"test": index, "status": "not_run"})
            continue
        try:
            in_fd = _tmpfile(workdir, test.get("input", "").encode("utf-8", "replace"))
            out_fd, err_fd = _tmpfile(workdir), _tmpfile(workdir)
            res_fd = _tmpfile(workdir) if job["mode"] in ("call", "assert") else None
        except OSError as error:  # e.g. an earlier test filled the tmpfs: this test fails, not the harness
            why = f"the sandbox could not prepare this test ({os.strerror(error.errno or 0)}): full tmpfs?"
            _emit(out, {"test": index, "status": "runtime_error", "stderr_tail": why})
            continue
        nonce = os.urandom(16).hex() if job["mode"] == "assert" else None
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(job, code, test, (in_fd, out_fd, err_fd, res_fd), workdir, nonce, drop)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        timed_out, status, usage = _wait(pid, min(float(limits["wall_seconds"]), left))
        wall = time.monotonic() - start
        _sweep(job, namespaced, drop)
        stderr = _read_head(err_fd, 4096).decode("utf-8", "replace")
        verdict = _classify(timed_out, status, usage, stderr, float(limits["cpu_seconds"]))
        record = {
            "test": index,
            "status": verdict,
            "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "cpu": round(usage.ru_utime + usage.ru_stime, 4),
            "wall": round(wall, 4),
            "stderr_tail": stderr[-300:],
        }
        if verdict == "ok":
            stdout = _read_head(out_fd, int(limits["file_bytes"])).decode("utf-8", "replace")
            record["stdout_head"] = stdout[:head_bytes]
            if job["mode"] == "stdio":
                record["digest"] = _digest(normalize_output(stdout))
            elif job["mode"] == "call":
                raw = _read_head(res_fd, int(limits["file_bytes"])).decode("utf-8", "replace")
                try:
                    value = json.loads(raw)
                    record["digest"] = _digest(canonical_json(value))
                    record["digest_wrapped"] = _digest(canonical_json([value]))
                    record["result_head"] = raw[:head_bytes]
                except (ValueError, RecursionError, MemoryError):  # the program controls these bytes
                    record["status"] = "runtime_error"
                    record["stderr_tail"] = "the function returned a value that is not JSON data"
            else:
                marker = _read_head(res_fd, 64).decode("ascii", "replace")
                if marker != nonce:
                    record["status"] = "runtime_error"
                    record["stderr_tail"] = "the tests did not run to their end (exited early?)"
        for fd in (in_fd, out_fd, err_fd, res_fd):
            if fd is not None:
                os.close(fd)
        _emit(out, record)


# --------------------------------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------------------------------
def _fatal(out: int, message: str) -> None:
    _emit(out, {"fatal": message[:800], "setup": True})
    os._exit(3)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _clear_inheritable_capabilities() -> None:
    """bwrap hands the harness its capabilities as inheritable and ambient ones too (to survive its exec of
    Python); the inheritable set would outlive a test child's uid change, so it goes (the ambient set with it)."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    for part in data:
        part.inheritable = 0
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _bwrapped(job: dict, out: int, drop: bool) -> None:
    """Under bubblewrap, which built the namespaces and the mounts: this process is their pid 1, the harness."""
    if os.getpid() != 1 or not drop:
        _fatal(
            out, f"bwrap did not start the harness as pid 1 with root (pid {os.getpid()}, uid {os.geteuid()})"
        )
    workdir = "/tmp/sandbox"
    try:
        _clear_inheritable_capabilities()
        os.mkdir(workdir, 0o700)
    except OSError as error:
        _fatal(out, f"isolation set-up failed: {type(error).__name__}: {error}")
    _emit(out, {"isolation": {"namespaces": True, "uid": job["uid"], "backend": "bwrap"}})
    _harness_as_pid1(job, out, workdir, drop=True)


def _harness_as_pid1(job: dict, out: int, workdir: str, drop: bool) -> None:
    """Run the harness as the namespace's pid 1, report a failure of its own, and exit: pid 1's exit makes the
    kernel kill everything left in the namespace."""
    code = 0
    try:
        _harness(job, out, workdir, namespaced=True, drop=drop)
    except BaseException as error:  # reported; the completion scores 0, the training goes on
        with contextlib.suppress(OSError):
            _emit(out, {"fatal": f"the harness failed: {type(error).__name__}: {error}"[:800]})
        code = 3
    os._exit(code)


def main() -> None:
    out = 1
    raw = sys.stdin.buffer.read()
    job = json.loads(raw)
    del raw
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    is_root = os.geteuid() == 0
    drop = bool(job["drop_privileges"]) and is_root
    if job.get("backend") == "bwrap":
        _bwrapped(job, out, drop)
    namespaced = False
    if job["namespaces"] and is_root:
        try:
            _check(
                _libc.unshare(_CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS),
                "unshare",
            )
            # Mounts made below must not propagate back to the host's namespace.
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
            namespaced = True
        except OSError as error:
            if job["require_isolation"]:
                _fatal(out, f"cannot create namespaces ({error}); the sandbox needs root with CAP_SYS_ADMIN")
    if job["require_isolation"] and not (namespaced and drop):
        why = "not running as root" if not is_root else "namespaces or privilege drop switched off"
        _fatal(out, f"full isolation unavailable ({why})")
    _emit(out, {"isolation": {"namespaces": namespaced, "uid": job["uid"] if drop else os.getuid()}})
    if not namespaced:
        job["audit"] = True
        workdir = tempfile.mkdtemp(prefix="trl-sae-sandbox-")
        try:
            _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            _harness(job, out, workdir, namespaced=False, drop=drop)
        finally:
            _sweep(job, False, drop)
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        os._exit(0)
    hard = float(job["completion_seconds"]) + 2.0
    pid = os.fork()
    if pid == 0:
        try:
            workdir = _setup_mounts(job)
        except BaseException as error:  # before any of the program's code: the trainer raises it
            with contextlib.suppress(OSError):
                _emit(
                    out,
                    {
                        "fatal": f"isolation set-up failed: {type(error).__name__}: {error}"[:800],
                        "setup": True,
                    },
                )
            os._exit(3)
        _harness_as_pid1(job, out, workdir, drop=drop)
    timed_out, status, _ = _wait(pid, hard)
    os._exit(3 if timed_out else (os.WEXITSTATUS(status) if os.WIFEXITED(status) else 4))


if __name__ == "__main__":
    main()
