"""Who this process is, as other processes on the same host can check (pure, no
package imports): the host name, the boot and pid namespace a pid belongs to, and
whether a recorded pid is provably gone.

A pid means something only on the same host, in the same boot and the same pid
namespace (containers reuse small pids; a reboot reuses all of them). Both the run lock
(``lock.py``) and the temporary files the storages write (``storage/temps.py``) decide
"its writer is gone" with these rules, and never guess when they do not apply. And how
this process's end is hooked when it is a multiprocessing child (``on_child_exit``),
for the run locks and the async saves alike.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["HOST_ENV", "boot_id", "current_host", "pid_gone", "pid_namespace", "writer_tag"]

#: Environment variable that overrides the host name recorded in and compared with the
#: lock (all processes of a test machine share one host name; containers may too).
HOST_ENV = "ATOMIC_CHECKPOINT_HOST"

_IS_WINDOWS = os.name == "nt"


def current_host() -> str:
    """The host name this process records in the lock (``$ATOMIC_CHECKPOINT_HOST``
    overrides ``socket.gethostname()``)."""
    return os.environ.get(HOST_ENV, "").strip() or socket.gethostname()


def read_text(path: str) -> str | None:
    """The stripped ASCII content of a small file such as ``/proc/<pid>/stat``, or None."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of ``pid`` from /proc, or None."""
    text = read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the
    # last ')'. Field 3 is the state, field 22 the start time.
    fields = text.rsplit(")", 1)[1].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> str | None:
    return read_text("/proc/sys/kernel/random/boot_id")


def writer_tag() -> str:
    """Ten hex digits naming (host, boot, pid namespace): two processes with the same
    tag can judge each other's pids. Not cached: tests and containers change the
    host name override at run time."""
    ident = f"{current_host()}\0{boot_id() or ''}\0{pid_namespace() or ''}"
    return hashlib.blake2b(ident.encode("utf-8", "surrogateescape"), digest_size=5).hexdigest()


def pid_gone(pid: int) -> bool:
    """True only when ``pid`` provably no longer runs (this host, boot and namespace
    are assumed: check ``writer_tag`` first). A pid that exists, even reused by another
    process, counts as running: callers fall back on age for those."""
    if _IS_WINDOWS or pid <= 0:
        return False  # Windows: os.kill(pid, 0) would send CTRL_C_EVENT, not probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # EPERM: exists, owned by another user
    stat = proc_stat(pid)
    return stat is not None and stat[0] in ("Z", "X")


def on_child_exit(fn: Callable[..., None], *args: Any, priority: int) -> None:
    """Run ``fn(*args)`` when this process, a ``multiprocessing`` child, ends: its
    atexit hooks do not run when it was started by fork or forkserver. Higher
    ``priority`` first. Nothing in a process that is no such child."""
    import multiprocessing
    import multiprocessing.util

    if multiprocessing.parent_process() is not None:
        multiprocessing.util.Finalize(None, fn, args=args, exitpriority=priority)
