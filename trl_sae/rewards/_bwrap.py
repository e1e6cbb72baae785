"""The code sandbox's bubblewrap backend: the ``bwrap`` command line that runs the launcher, and its checks.

With ``Sandbox(backend="bwrap")`` the launcher (:mod:`trl_sae.rewards._sandbox_launcher`) does not build its
namespaces and mounts itself: bubblewrap does, and the launcher starts inside them as pid 1, as root with five
capabilities only (setuid, setgid, kill, chown, dac_override: what the harness needs to start each test under
its own unprivileged uid and to kill what a test leaves). The test children, the limits and the verdicts are
the launcher's, unchanged. What differs is the file system: instead of the host's with some folders hidden,
the program sees an empty read-only root with only ``/usr``, the interpreter's folders, a few files of
``/etc``, a fresh ``/proc`` and ``/dev``, and private size-limited tmpfs mounts on ``/tmp`` and ``/dev/shm``.

Standard library only.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BACKENDS",
    "BWRAP_CAPABILITIES",
    "BWRAP_ETC_FILES",
    "LAUNCHER_PATH",
    "bwrap_argv",
    "bwrap_unusable",
    "find_bwrap",
    "read_child_pid",
]

BACKENDS = ("namespaces", "bwrap", "auto")

# Where the launcher script appears inside the sandbox (its own folder, the package, stays out of sight).
LAUNCHER_PATH = "/sandbox/launcher.py"

# The harness's capabilities (bwrap drops every other one; the test children lose these at their uid change).
BWRAP_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE")

# Of /etc, only what the dynamic loader and the time functions read; no passwd, hosts or ssl files.
BWRAP_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)

# Top-level folders that merged-/usr systems make links into /usr (bound as links, or read-only when real).
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _parents(path: str, made: set[str], argv: list[str]) -> None:
    """Create the folders above a mount point as 0755: bwrap would make them 0700 (root's alone), and the
    program, under its own uid, could not reach what is bound below them."""
    parts = path.strip("/").split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        folder = "/" + "/".join(parts[:depth])
        if folder not in made and folder != "/usr" and not folder.startswith("/usr/"):
            argv += ["--perms", "0755", "--dir", folder]
            made.add(folder)


def find_bwrap(bwrap: str) -> str | None:
    """The executable ``bwrap`` names (a path, or a name looked up on PATH), or None."""
    if os.sep in bwrap:
        return bwrap if os.path.isfile(bwrap) and os.access(bwrap, os.X_OK) else None
    return shutil.which(bwrap)


def bwrap_argv(
    bwrap: str,
    python: str,
    launcher: str,
    job: dict[str, Any],
    *,
    info_fd: int | None = None,
    command: Sequence[str] | None = None,
) -> list[str]:
    """The command line running ``launcher`` (or ``command``) with ``python`` under bubblewrap for ``job``."""
    argv = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    # pid 1 is the harness itself (no bwrap reaper): its exit takes every process of the sandbox with it, and
    # bwrap and its child die with the trainer (or with bwrap, when the trainer kills it).
    argv += ["--as-pid-1", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    argv += ["--clearenv"]
    for key, value in job["env"].items():
        argv += ["--setenv", key, value]
    hidden = sorted({os.path.realpath(p) for p in job["hide_paths"] if os.path.isdir(p)} - {"/"})
    # Never the host's root as a whole (an interpreter installed with prefix "/"): the trial then fails, loudly.
    keep = sorted({os.path.realpath(p) for p in job["keep_paths"] if os.path.isdir(p)} - {"/"})
    argv += ["--ro-bind", "/usr", "/usr"]
    bound = ["/usr"]
    made: set[str] = set()
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path) and not any(_under(path, h) for h in hidden):
            argv += ["--ro-bind", path, path]
            bound.append(path)
    for path in BWRAP_ETC_FILES:
        if os.path.exists(path) and not any(_under(path, h) for h in hidden):
            _parents(path, made, argv)
            argv += ["--ro-bind", path, path]
            bound.append(path)
    for (
        path
    ) in keep:  # the interpreter's folders: bound even inside a hidden path, as the namespaces backend does
        if not any(_under(path, b) for b in bound):
            _parents(path, made, argv)
            argv += ["--ro-bind", path, path]
            bound.append(path)
    # A hidden path inside a bound folder (/usr/share, ...): an empty tmpfs, with the interpreter's folders
    # bound back inside. One inside the interpreter's own folders stays visible (hiding it would break Python).
    for path in hidden:
        if not any(_under(path, b) and path != b for b in bound) or any(_under(path, k) for k in keep):
            continue
        argv += ["--perms", "0755", "--size", "65536", "--tmpfs", path]
        parts = path.strip("/").split("/")
        inside = {"/" + "/".join(parts[:depth]) for depth in range(1, len(parts) + 1)}  # it and its parents
        for inner in keep:
            if _under(inner, path) and inner != path:
                _parents(inner, inside, argv)
                argv += ["--ro-bind", inner, inner]
        argv += ["--remount-ro", path]
    _parents(LAUNCHER_PATH, made, argv)
    argv += ["--ro-bind", launcher, LAUNCHER_PATH]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(int(job["tmpfs_bytes"])), "--tmpfs", "/tmp"]
    argv += ["--perms", "1777", "--size", str(1 << 20), "--tmpfs", "/dev/shm"]
    argv += ["--remount-ro", "/"]
    argv += ["--cap-drop", "ALL"]
    for cap in BWRAP_CAPABILITIES:
        argv += ["--cap-add", cap]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    argv += ["--chdir", "/", "--"]
    argv += list(command) if command is not None else [python, "-I", "-S", "-B", LAUNCHER_PATH]
    return argv


@functools.lru_cache(maxsize=8)
def bwrap_unusable(bwrap: str, python: str, launcher: str, keep_paths: tuple[str, ...]) -> str | None:
    """Why the bwrap backend cannot run here (one clause), or None when a trial sandbox ran as it must.

    ``keep_paths`` are the interpreter's folders (bound read-only). Cached: one trial per process.
    """
    found = find_bwrap(bwrap)
    if found is None:
        return f"bubblewrap's `{bwrap}` was not found" + ("" if os.sep in bwrap else " on PATH")
    if os.geteuid() != 0:
        return (
            "the trainer is not root (the backend runs bwrap as root, so that every sandbox gets an "
            "unprivileged uid of its own)"
        )
    job = {
        "env": {"PATH": "/usr/bin:/bin"},
        "keep_paths": list(keep_paths),
        "hide_paths": [],
        "tmpfs_bytes": 1 << 20,
    }
    # The trial checks what the harness relies on: pid 1 of its own namespace, root with the capabilities
    # above, and no network interface up.
    check = (
        "import os, socket\n"
        "assert os.getpid() == 1 and os.geteuid() == 0, 'not pid 1 / root'\n"
        "assert socket.socket().connect_ex(('127.0.0.1', 9)) != 0, 'loopback reachable'\n"
        "assert os.access('" + LAUNCHER_PATH + "', os.R_OK), 'launcher not visible'\n"
    )
    argv = bwrap_argv(found, python, launcher, job, command=[python, "-I", "-S", "-c", check])
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`{found}` could not be run ({error})"
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"a trial sandbox failed ({lines[-1][:300] if lines else f'exit status {done.returncode}'})"
    return None


def read_child_pid(fd: int) -> int | None:
    """The sandbox's pid 1 as the host sees it, from bwrap's ``--info-fd`` pipe (None if it never started)."""
    import json
    import select

    data = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        pid = json.loads(data).get("child-pid")
    except (ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and pid > 0 else None
