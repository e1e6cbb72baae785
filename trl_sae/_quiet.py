"""Two messages from other libraries that would fill a user's terminal, each silenced at its source.

Installed when :mod:`trl_sae` is imported; stdlib only, so the import stays cheap. Each filter matches one
message and nothing else from its library:

* bitsandbytes logs ``Failed to load CPU gemm_4bit_forward from kernels-community`` when it is imported on a
  CPU with AVX512-BF16 and the optional ``kernels`` package is not there (or the Hub is offline): every
  command that imports peft or transformers' quantizers. Its 4-bit CPU path still works without it.
* nanobind prints ~60 lines of ``nanobind: leaked ...`` at interpreter exit for objects that triton's
  ``libtriton`` (imported by vLLM and torch's compiler) still holds. nanobind's documented switch,
  ``nb::set_leak_warnings(false)``, must be called from the extension's C++ code, and triton binds it to
  nothing reachable from Python (the symbol is local to ``libtriton.so``); triton itself points stderr at
  ``/dev/null`` at exit in its own workers (``triton/_compile_warmup_pool.py``). Here, when triton has been
  loaded, stderr is passed at exit through a small filter process that drops only nanobind's report and
  keeps everything else, e.g. an error printed while the interpreter shuts down. The simpler designs each
  lose something: pointing stderr at ``/dev/null`` at exit (triton's way) also drops those shutdown errors;
  flipping ``print_leak_warnings`` in nanobind's internals (a capsule in ``builtins``) through ``ctypes``
  writes into a private struct whose layout changes with each nanobind ABI version; ``os._exit`` skips
  the finalisation (buffered files, other atexit handlers) a user's program relies on. The report is
  printed from C during finalisation, after every Python hook, so no in-process filter can see it.

(transformers' ``Both `min_new_tokens` and `min_length` seem to have been set`` warning was a third one
until :func:`trl_sae.generation.capture.pure_sampling_config` stopped setting ``min_length``.)
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

__all__ = ["install"]

# bitsandbytes/backends/cpu/ops.py: `logger = logging.getLogger(__name__)`.
BITSANDBYTES_LOGGER = "bitsandbytes.backends.cpu.ops"
BITSANDBYTES_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"
# The nanobind extension whose leak report shows up after vLLM runs.
NANOBIND_MODULE = "triton._C.libtriton"

# Runs in the filter process: copies stdin to stdout except nanobind's leak report, which is a
# "nanobind: ..." line, " - leaked ..." lines under it and a closing "See https://nanobind..." line.
_NANOBIND_FILTER = """
import sys
inside = False
for line in sys.stdin.buffer:
    if line.startswith(b"nanobind: ") or (inside and line.startswith(b" - ")):
        inside = True
        continue
    if inside and line.startswith(b"See https://nanobind.readthedocs.io/"):
        continue
    inside = False
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
"""


class _DropMessage(logging.Filter):
    """Drop the records of one logger whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _drop_nanobind_leak_report() -> None:
    """At exit, if triton's nanobind extension is loaded, route stderr through :data:`_NANOBIND_FILTER`."""
    if NANOBIND_MODULE not in sys.modules:
        return
    import subprocess

    try:
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        stderr = os.dup(2)
        # The filter writes to the real stderr and ends when this process has exited and so closed the
        # pipe's last write end.
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _NANOBIND_FILTER], stdin=read_end, stdout=stderr)
        os.dup2(write_end, 2)
        for fd in (read_end, write_end, stderr):
            os.close(fd)
    except (OSError, ValueError):  # no stderr to redirect, or no process to start: leave stderr as it is
        return


_installed = False


def install() -> None:
    """Install the two filters (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger(BITSANDBYTES_LOGGER).addFilter(_DropMessage(BITSANDBYTES_MESSAGE))
    # Registered at import, so it runs after the atexit handlers registered later (vLLM's, torch's): last.
    atexit.register(_drop_nanobind_leak_report)
