"""Preemption: when the scheduler says "stop", every rank saves the same step, once.

Schedulers announce a preemption or the end of a time limit with a signal (SLURM sends
SIGTERM, or SIGUSR1 ahead of time with ``--signal``; Kubernetes sends SIGTERM), then
kill the job for good after a grace period. Saving from inside the signal handler is
wrong in several ways (FAILURE_MODES E4): the handler interrupts the training step at
an arbitrary point, so the state it would save is half-updated; only the rank that got
the signal saves, while the others run into the next collective and hang until the
final SIGKILL; and a forked DataLoader worker that inherited the handler saves too.

``PreemptionGuard`` does what the invariant I20 asks for instead:

1. the handler only records that a signal arrived (one attribute store, no I/O);
2. at each step boundary every rank calls :meth:`PreemptionGuard.should_save`, which
   exchanges the flags of all ranks through the manager's coordinator (one small
   all-gather on the key-value store, not a training collective) and returns the same
   answer on every rank, True as soon as any rank was signalled;
3. the training loop then makes a normal, synchronous, atomic ``save`` and exits.

A signal that arrives during a save (or during anything else) only sets the flag: the
save finishes and commits as usual, and the next boundary decides to stop. The save
must fit into the grace period: periodic saves stay the real guarantee, the preemption
save only shortens the work lost.

Example::

    with PreemptionGuard(mgr) as guard:
        for step in range(start, total_steps):
            train_step()
            stop = guard.should_save(step)       # every rank, every step
            if stop or step % 500 == 0:
                mgr.save(step, state)
            if stop:
                break
    mgr.close()
    sys.exit(0 if guard.decided_step is None else 143)   # let the scheduler requeue

Call ``should_save`` in every loop that can run for long (evaluation, warm-up), with
the same number of calls on every rank: a flag that is looked at only in the main loop
is not looked at while the job evaluates.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

from .errors import CheckpointError
from .layout import validate_step

__all__ = ["DEFAULT_SIGNALS", "PreemptionGuard"]

log = logging.getLogger("atomic_checkpoint")

#: SIGTERM (SLURM, Kubernetes, most schedulers) and SIGUSR1 (SLURM ``--signal``; some
#: clusters send no SIGUSR1 at all, so SIGTERM must be handled too: submitit#1615).
DEFAULT_SIGNALS: tuple[int, ...] = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s
)


class PreemptionGuard:
    """Turns preemption signals into one agreed, synchronous save at a step boundary.

    Created on every rank, from the main thread, after the ``CheckpointManager``. The
    handlers it installs replace the previous ones until :meth:`close` (or the end of
    the ``with`` block) puts the previous ones back.

    Args:
        manager: the job's ``CheckpointManager``; its coordinator carries the vote.
        signals: the signals that mean "save and stop".
        timeout_s: bound on the wait for the other ranks in ``should_save``; default:
            the manager's ``timeout_s``.
        grace_s: the scheduler's grace period, if known: when the ranks decide to
            save, a warning says so if the previous save took longer than this.

    Raises:
        CheckpointError: not called from the main thread (Python delivers signals to
            the main thread only, and only it may install handlers).
    """

    def __init__(
        self,
        manager: Any,
        *,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        timeout_s: float | None = None,
        grace_s: float | None = None,
    ):
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                "PreemptionGuard must be created in the main thread: Python runs signal "
                "handlers there only, and only the main thread may install them"
            )
        self.signals: tuple[int, ...] = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("signals must name at least one signal, e.g. signal.SIGTERM")
        self._manager = manager
        self._coord = manager.coordinator
        self.timeout_s = float(manager.timeout_s if timeout_s is None else timeout_s)
        self.grace_s = grace_s
        self._pid = os.getpid()
        self._signum: int | None = None
        self._signalled_at: float | None = None
        #: The step at which the ranks agreed to save (None until they do).
        self.decided_step: int | None = None
        #: The ranks that had received a signal when the ranks agreed.
        self.requested_by: tuple[int, ...] = ()
        self._checks = 0
        self._previous: dict[int, Any] = {}
        self._closed = False
        # One bound method, kept: close() recognises its own handler by equality.
        self._handler = self._on_signal
        for s in self.signals:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handler)

    # ------------------------------------------------------------------ the handler
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes, possibly in the middle of a
        # save or a collective: it must not save, log (the logging lock may be held by
        # the code it interrupted) or raise. It records, and the interrupted code goes
        # on where it was (PEP 475: interrupted system calls are retried).
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker) inherited the handler. It is not a
            # trainer and never saves; it reacts to the signal as it did before the
            # guard existed (by default: it dies), so the signal is not swallowed.
            previous = self._previous.get(signum)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._signum is None:
            self._signum = signum
            self._signalled_at = time.monotonic()

    # ------------------------------------------------------------------ queries
    @property
    def requested(self) -> bool:
        """Whether this process has received one of the signals. Local, not collective:
        other ranks may not know yet; use ``should_save`` to decide."""
        return self._signum is not None

    @property
    def signum(self) -> int | None:
        """The first signal this process received, or None."""
        return self._signum

    def should_save(self, step: int) -> bool:
        """Whether to save now and stop, decided by all ranks together. Collective.

        Call it on every rank at the same step boundary, the same number of times.
        Every rank contributes whether it was signalled; the answer, identical on
        every rank, is True once any rank was. It stays True at later calls.

        Args:
            step: the step the loop is at (the one a save now would record); every
                rank must pass the same one.

        Returns:
            True: save ``step`` now (a normal ``mgr.save``) and stop training.

        Raises:
            CoordinationTimeoutError: some rank did not reach this boundary within
                ``timeout_s`` (it crashed, or it calls ``should_save`` fewer times).
            CheckpointError: the ranks passed different steps, or the guard is closed.
        """
        step = validate_step(step)
        if self._closed:
            raise CheckpointError("this PreemptionGuard is closed: create a new one")
        self._checks += 1
        # Read the flag once: a signal landing during the exchange counts at the next
        # boundary, on every rank alike.
        mine = self._signum
        views = self._coord.all_gather(
            f"preemption check {self._checks} at step {step}",
            (step, mine),
            timeout_s=self.timeout_s,
        )
        steps = sorted({v[0] for v in views})
        if len(steps) > 1:
            by_rank = {r: v[0] for r, v in enumerate(views)}
            raise CheckpointError(
                f"ranks called should_save() at different steps ({by_rank}): every rank "
                "must check at the same step boundary, the same number of times, or they "
                "would save different steps (or hang in different collectives)"
            )
        signalled = tuple(r for r, v in enumerate(views) if v[1] is not None)
        if self.decided_step is not None:
            return True
        if not signalled:
            return False
        self.decided_step = step
        self.requested_by = signalled
        if self._coord.rank == min(signalled):
            self._log_decision(step, signalled, views)
        return True

    def _log_decision(self, step: int, signalled: tuple[int, ...], views: list[Any]) -> None:
        names = sorted({signal.Signals(v[1]).name for v in views if v[1] is not None})
        waited = (
            f"{time.monotonic() - self._signalled_at:.2f} s after the signal"
            if self._signalled_at is not None
            else "at once"
        )
        log.warning(
            "preemption: %s received by rank(s) %s; every rank saves step %d now (%s) and stops",
            "/".join(names),
            list(signalled),
            step,
            waited,
        )
        last = getattr(self._manager, "last_saved", None)
        if last is None or self.grace_s is None:
            return
        took = last.timings_s.get("total")
        if took is not None and took > self.grace_s:
            log.warning(
                "preemption: the previous save took %.1f s, longer than the grace period "
                "of %.1f s: this save may be killed before it commits (then the job "
                "resumes from step %d, the last committed one)",
                took,
                self.grace_s,
                last.step,
            )

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Put back the handlers that were installed before. Idempotent; main thread.

        A handler that someone else installed after this guard is left in place.
        """
        if self._closed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("PreemptionGuard.close() must be called from the main thread")
        for s, previous in self._previous.items():
            if signal.getsignal(s) != self._handler:
                log.debug(
                    "preemption: the handler of %s was replaced; leaving it",
                    signal.Signals(s).name,
                )
                continue
            # None: the previous handler was not installed from Python; the default
            # action is the closest we can put back.
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._closed = True

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = "/".join(signal.Signals(s).name for s in self.signals)
        state = "closed" if self._closed else f"requested={self.requested}"
        return f"PreemptionGuard({names}, rank={self._coord.rank}, {state})"
