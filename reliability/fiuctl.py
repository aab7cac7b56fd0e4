"""libfiu from inside a process, and how to start one under ``fiu-run -x``.

``fiu-run -x`` preloads libfiu and its POSIX wrappers; :func:`fiu_argv` also appends
``fiu_extra.so`` (built from ``fiu_extra.c`` by :func:`build_extra`: the directory
calls libfiu does not wrap, and a hit counter). Inside the process, :class:`Fiu` arms
points through libfiu's C API: ``fiu_enable`` takes the errno as an integer (the
Python binding would pass a pointer to a Python int instead), and needs no control
pipe, so even a persistent fault on ``write`` can be disarmed again.

Imports nothing heavy: tests run small children with it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Sequence

EXTRA_ENV = "AC_FIU_EXTRA"  # path of the fiu_extra.so preloaded into this process
EXTRA_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fiu_extra.c")

#: The failure points a campaign arms, by the operation they fail.
POINTS = {
    "write": "posix/io/rw/write",
    "fsync": "posix/io/sync/fsync",
    "rename": "posix/io/dir/rename",
    "open": "posix/io/oc/open",
    "mkdir": "posix/io/dir/mkdir",
    "unlink": "posix/io/dir/unlink",
    "read": "posix/io/rw/read",
}


def compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def build_extra(out_dir: str) -> str:
    """Compile ``fiu_extra.c`` into ``out_dir``; returns the .so path.

    Raises:
        RuntimeError: no compiler, or the build failed (its output is in the message).
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc) to build fiu_extra.so: apt-get install gcc")
    so = os.path.join(out_dir, "fiu_extra.so")
    done = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", so, EXTRA_SOURCE, "-ldl", "-lpthread"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building fiu_extra.so failed: {done.stderr.strip()}")
    return so


def fiu_argv(extra_so: str, argv: Sequence[str], *, ctrl_prefix: str) -> list[str]:
    """``argv`` under ``fiu-run -x``, with ``extra_so`` preloaded after libfiu's
    libraries (fiu-run sets LD_PRELOAD itself; a shell appends ours)."""
    from tests.testbed.fiu_tools import fiu_run_argv

    return fiu_run_argv(
        "-c",
        'LD_PRELOAD="$LD_PRELOAD $0" exec "$@"',
        extra_so,
        *argv,
        python="/bin/sh",
        ctrl_prefix=ctrl_prefix,
    )


class Fiu:
    """libfiu in this process (loaded by ``fiu-run``'s preload library)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None)
        try:
            self._enable = libc.fiu_enable
            self._disable = libc.fiu_disable
        except AttributeError:
            raise RuntimeError("libfiu is not loaded: run this process under fiu-run -x") from None
        self._enable.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint]
        self._disable.argtypes = [ctypes.c_char_p]
        extra = ctypes.CDLL(os.environ[EXTRA_ENV])
        self._hits = extra.acfiu_hits
        self._hits.argtypes = [ctypes.c_char_p]
        self._hits.restype = ctypes.c_long
        self._reset = extra.acfiu_reset

    def enable(self, point: str, code: int, *, onetime: bool) -> None:
        """Fail calls of ``point`` (a libfiu name) with errno ``code``: only the next
        one (``onetime``), or all until :meth:`disable`."""
        # FIU_ONETIME == 1: the point disables itself after failing once.
        rc = self._enable(point.encode(), 1, ctypes.c_void_p(code), 1 if onetime else 0)
        if rc != 0:
            raise RuntimeError(f"fiu_enable({point!r}) returned {rc}")

    def disable(self, point: str) -> None:
        self._disable(point.encode())  # -1 if a onetime point already fired: fine

    def hits(self, point: str) -> int:
        """Calls that ``point`` failed since the last :meth:`reset`."""
        return int(self._hits(point.encode()))

    def reset(self) -> None:
        self._reset()
