"""Preemption signals that reach ``python -m atomic_checkpoint.launch`` while Python is
still importing this package (about half a second), before ``launch.main`` can install
its handlers: without a handler a SIGTERM then ended the launcher with status 143, which
a scheduler's "requeue on 75" does not requeue.

The package's ``__init__`` imports this module before anything else, and importing it
calls :func:`record_if_launching`, which installs a handler that only records, and only
when this process is the launcher (``python [options] -m atomic_checkpoint.launch``),
so importing the package anywhere else changes no signal handler. ``launch.main``
reads :data:`received`. Only the standard library is imported here.
"""

from __future__ import annotations

import signal
import sys

#: The signals recorded, in order of arrival; ``launch.main`` adds to the same list.
received: list[int] = []

_LAUNCHER = "atomic_checkpoint.launch"
#: Python options that take the next argument as their value.
_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def launching(argv: list[str]) -> bool:
    """Whether the interpreter command line ``argv`` (``sys.orig_argv``) runs the
    launcher module."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1 : i + 2] == [_LAUNCHER]
        if arg.startswith("-m"):
            return arg[2:] == _LAUNCHER
        if arg in _WITH_VALUE:
            i += 2
            continue
        if not arg.startswith("-") or arg.startswith("-c"):
            return False  # a script, a command, or a module other than the launcher
        i += 1
    return False


def record_if_launching() -> None:
    """In the launcher process only, record SIGTERM and SIGUSR1 from now on."""
    if not launching(list(getattr(sys, "orig_argv", ()))):
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
