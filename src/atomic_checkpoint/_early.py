"""Preemption signals that reach ``python -m atomic_checkpoint.launch`` while Python is
still importing this package (about half a second), before ``launch.main`` can install
its handlers: without a handler a SIGTERM then ended the launcher with status 143, which
a scheduler's "requeue on 75" does not requeue.

The package's ``__init__`` imports this module before anything else, and importing it
calls :func:`record_if_launching`, which installs a handler that only records, and only
when this process is the launcher (``python [options] -m atomic_checkpoint.launch``),
so importing the package anywhere else changes no signal handler. ``launch.main`` reads
:data:`received`. In the command line's process it makes a Ctrl-C during the import end
as a later one does: exit 130, one line. Only the standard library is imported here.
"""

from __future__ import annotations

import os
import signal
import sys

#: The signals recorded, in order of arrival; ``launch.main`` adds to the same list.
received: list[int] = []

_LAUNCHER = "atomic_checkpoint.launch"
#: Python options that take the next argument as their value.
_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def _entry(argv: list[str]) -> str | None:
    """What the interpreter command line ``argv`` (``sys.orig_argv``) runs: the module
    after ``-m``, ``script:<file name>`` for a script, None for ``-c`` or nothing."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("-m"):
            return arg[2:]
        if arg in _WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-c"):
            return None
        if not arg.startswith("-"):
            return "script:" + os.path.basename(arg)
        i += 1
    return None


def launching(argv: list[str]) -> bool:
    """Whether the interpreter command line ``argv`` (``sys.orig_argv``) runs the
    launcher module."""
    return _entry(argv) == _LAUNCHER


def command_line(argv: list[str]) -> bool:
    """Whether ``argv`` runs the command line (``python -m atomic_checkpoint``, or the
    ``atomic-checkpoint`` script)."""
    return _entry(argv) in ("atomic_checkpoint", "script:atomic-checkpoint")


def interrupted_while_importing(signum: int, frame: object) -> None:
    """The command line's SIGINT handler until ``cli.main`` runs: a Ctrl-C while the
    package is imported ends the process as a later one does (one line, exit 130), not
    with Python's traceback and status 1. Nothing has been touched yet."""
    sys.stderr.write("atomic-checkpoint: error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def record_if_launching() -> None:
    """In the launcher process only, record SIGTERM and SIGUSR1 from now on; in the
    command line's, end on SIGINT with one line (``interrupted_while_importing``)."""
    argv = list(getattr(sys, "orig_argv", ()))
    if command_line(argv) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, interrupted_while_importing)
        except ValueError:  # pragma: no cover - not the main thread
            pass
        return
    if not launching(argv):
        return
    for name in ("SIGTERM", "SIGUSR1"):
        sig = getattr(signal, name, None)
        if sig is None or signal.getsignal(sig) is not signal.SIG_DFL:
            continue  # a handler someone installed stays (and so does SIG_IGN)
        try:
            signal.signal(sig, _record)
        except ValueError:  # pragma: no cover - not the main thread
            return


def _record(signum: int, frame: object) -> None:
    received.append(signum)


record_if_launching()
