"""``python -m atomic_checkpoint.launch``: torchrun whose exit status says "requeue me".

Takes exactly torchrun's arguments and runs torchrun's own launcher in this process.
What changes is only what happens around a preemption signal:

- **Exit status.** Stock torchrun exits 1 with a ``SignalException`` traceback when its
  agent is signalled, and 1 (``ChildFailedError``) or 0 when its workers are: a
  scheduler cannot tell a preemption from a crash or from the end of training. This
  launcher exits ``REQUEUE_EXIT_CODE`` (75) when the agent was signalled, or when a
  worker exited with it (``guard.exit()``) and every other failed worker died by a
  signal (the agent's own shutdown stops them), and passes every other outcome
  through (0, or 1 for a real failure, with torchrun's report).
- **One signal starts the shutdown, a second one does not cut it short.** torchrun's
  agent raises ``SignalException`` from its handler; a second SIGTERM (SLURM signals
  the agent and the workers, Kubernetes may repeat it) would raise again inside the
  agent's wait for its workers and make it exit while they are still saving; with the
  agent gone the container or job step ends and the save is killed. Here the agent
  forwards the first signal to the workers and then waits for them (up to torchrun's
  ``--shutdown-timeout``, raised to ``ATOMIC_CHECKPOINT_GRACE_S`` when that is longer);
  later signals are only logged.
- **SIGUSR1** (SLURM ``--signal=USR1@60``) is handled and forwarded too: on stock
  torchrun it kills the agent (the default action) and the workers with it.
- **One grace period for the node.** The workers get a directory of this launch
  (``ATOMIC_CHECKPOINT_SIGNALS_DIR``) where armed workers note when their first signal
  came, so that a start-up deadline (``preemption.arm``) counts from the node's first
  signal: when the scheduler signalled one worker only and its deadline ended it at
  start-up, the SIGTERM by which the agent then stops the others comes up to a grace
  period later, and their own deadlines, counted from it, would outlast the
  scheduler's SIGKILL. Workers that already have a guard (saving, perhaps) are left
  to finish.

Workers must stop with ``guard.exit()`` (see ``preemption``). Use
``--max-restarts 0`` (the default): with restarts, torchrun restarts workers that exit
with the requeue code in place instead of stopping.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from types import FrameType
from typing import Any

from . import _early
from .preemption import GRACE_ENV, REQUEUE_EXIT_CODE, SIGNALS_DIR_ENV, grace_from_env

__all__ = ["main"]

log = logging.getLogger("atomic_checkpoint")

PROG = "python -m atomic_checkpoint.launch"


#: What a scheduler preempts with (SLURM: SIGTERM, or SIGUSR1 with --signal).
_PREEMPTION_SIGNALS = tuple(
    sig for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if sig is not None
)


def _with_sigusr1(signals: str) -> str:
    names = [s.strip() for s in signals.split(",") if s.strip()]
    if hasattr(signal, "SIGUSR1") and "SIGUSR1" not in names:
        names.append("SIGUSR1")
    return ",".join(names)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    # From the first instant: importing torch takes about a second, and a SIGTERM then
    # killed the launcher (status 143, no requeue) before any handler of torchrun's.
    # Those that came while Python imported the package (``_early``) count too.
    early = _early.received
    for sig in _PREEMPTION_SIGNALS:
        signal.signal(sig, lambda signum, frame: early.append(signum))
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing import api as mp_api
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError as exc:
        print(f"{PROG}: error: torch is needed to launch with torchrun ({exc})", file=sys.stderr)
        return 2
    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    args.signals_to_handle = _with_sigusr1(args.signals_to_handle)
    try:
        grace = grace_from_env()
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if grace is not None:
        timeout = args.shutdown_timeout
        if timeout is None:
            timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        args.shutdown_timeout = max(int(timeout), math.ceil(grace))

    if early:
        _ignore_from_now_on(args.signals_to_handle)
        _say(f"the launcher got {signal.Signals(early[0]).name} before any worker started", [])
        return REQUEUE_EXIT_CODE
    got: list[int] = []
    stock = mp_api._terminate_process_handler

    def first_signal_only(signum: int, frame: FrameType | None) -> None:
        if got:
            # The agent is already waiting for its workers to save and exit: raising
            # again would end that wait (and the agent) while they are still saving.
            got.append(signum)
            return
        got.append(signum)
        stock(signum, frame)  # raises SignalException: the agent forwards the signal

    # torchrun installs its handler by this module-level name when it starts workers.
    mp_api._terminate_process_handler = first_signal_only
    # The workers inherit the agent's environment; the directory is this launch's own.
    signals_dir = tempfile.TemporaryDirectory(
        prefix="atomic-checkpoint-signals-", ignore_cleanup_errors=True
    )
    before = os.environ.get(SIGNALS_DIR_ENV)
    os.environ[SIGNALS_DIR_ENV] = signals_dir.name
    try:
        # Until torchrun installs its handlers (as it starts the workers), a signal
        # stops the launch the same way theirs does.
        for sig in _PREEMPTION_SIGNALS:
            signal.signal(sig, first_signal_only)
        torchrun.run(args)
    except mp_api.SignalException as exc:
        _ignore_from_now_on(args.signals_to_handle)
        _say(f"the agent got {signal.Signals(got[0] if got else exc.sigval).name}", got)
        return REQUEUE_EXIT_CODE
    except ChildFailedError as exc:
        codes = sorted({f.exitcode for f in exc.failures.values()})
        # A rank that exits with the requeue code makes the agent stop the others
        # with SIGTERM at once (SIGKILL after --shutdown-timeout): they may report
        # a death by signal (a negative code) although the agreed save committed.
        if got or (
            REQUEUE_EXIT_CODE in codes and all(c == REQUEUE_EXIT_CODE or c < 0 for c in codes)
        ):
            _ignore_from_now_on(args.signals_to_handle)
            _say(f"the workers exited with {codes}", got)
            return REQUEUE_EXIT_CODE
        print(exc.format_msg(), file=sys.stderr)
        return 1
    finally:
        mp_api._terminate_process_handler = stock
        if before is None:
            os.environ.pop(SIGNALS_DIR_ENV, None)
        else:
            os.environ[SIGNALS_DIR_ENV] = before
        signals_dir.cleanup()
    return 0


def _ignore_from_now_on(signals: str) -> None:
    """The launcher is about to exit with the requeue code: a repeated signal from the
    scheduler carries no news, and during interpreter shutdown Python has put the
    default actions back, so it would turn exit status 75 into a death by SIGTERM."""
    for name in signals.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals) and sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_IGN)


def _say(what: str, got: list[Any]) -> None:
    more = (
        f" ({len(got) - 1} more signal(s) ignored while the workers saved)" if len(got) > 1 else ""
    )
    print(
        f"{PROG}: preempted: {what}{more}; exiting with {REQUEUE_EXIT_CODE} (requeue). "
        f"Grace period from {GRACE_ENV}: {os.environ.get(GRACE_ENV) or 'not set'}",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
