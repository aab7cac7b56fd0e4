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

Example (the README's "Preemption" section has the launcher and scheduler parts)::

    from atomic_checkpoint import preemption
    preemption.arm()                  # first lines of the script: signals are recorded
    ...                               # process group, model, data, restore
    with PreemptionGuard(mgr, grace_s=30) as guard:     # adopts a signal that came early
        for step in range(start, total_steps):
            train_step()
            if guard.should_save(step) or (step % 500 == 0 and not guard.stopping):
                mgr.save(step, state)
            if guard.stopping:
                break
    mgr.close()
    guard.exit()                      # status REQUEUE_EXIT_CODE (75) when preempted, else 0

From the first instant: a signal that arrives before the guard exists (while the
process group forms, the model is built, the first checkpoint is restored) would kill
the process on the default action. :func:`arm` (or ``ATOMIC_CHECKPOINT_ARM=1`` in the
environment, read when ``atomic_checkpoint`` is imported) installs the same recording
handler at once; the guard created later adopts what it recorded, with the time it
arrived, and its first ``should_save`` stops the job on every rank. With the grace
period known, a process still without a guard shortly before the grace period ends
exits with the requeue code on its own (:func:`arm`; under the launcher, counted from
the first signal of any worker of the node): a start-up that outlasts the grace period
ends in a requeue, not in the scheduler's SIGKILL.

The deadline: the guard knows the grace period (``grace_s=``, else
``ATOMIC_CHECKPOINT_GRACE_S``) and measures the saves it sees (``mgr.last_saved``).
When the ranks agree to stop, a save is started only if the slowest recent save, with
a margin, fits in what is left of the grace period on the rank that was signalled
first, less the end of it kept for the exit (``EXIT_RESERVE_S``); otherwise
``should_save`` returns False, ``stopping`` is True, the previous
checkpoint stays the newest, and a warning says why. A save cut by the final SIGKILL
would not be torn (the commit is atomic) but would be time spent for nothing.

The requeue code: ``guard.exit()`` ends every rank with ``guard.exit_code``,
``REQUEUE_EXIT_CODE`` (75, ``EX_TEMPFAIL``: "try again later") once the ranks stopped
for a preemption;
``python -m atomic_checkpoint.launch`` (torchrun with the same arguments) exits with it
too, whether the signal went to it, to the workers, or to both.

Call ``should_save`` in every loop that can run for long (evaluation, warm-up), with
the same number of calls on every rank: a flag that is looked at only in the main loop
is not looked at while the job evaluates.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, NoReturn, TypeVar

from ._checks import positive_seconds
from .coordination import drain_workers, gather_summary, ranks_text
from .errors import CheckpointError, StorageError
from .layout import validate_step
from .storage.posix import (
    close_quietly,
    is_dir,
    list_names,
    make_dirs,
    read_available,
    read_head,
)

__all__ = [
    "ARM_ENV",
    "DEFAULT_SIGNALS",
    "GRACE_ENV",
    "REQUEUE_EXIT_CODE",
    "PreemptionGuard",
    "arm",
    "armed",
    "dataloader_worker_init",
    "disarm",
    "grace_from_env",
    "protect_dataloaders",
    "protecting_loaders_of",
]

log = logging.getLogger("atomic_checkpoint")

#: ``with`` gives back the same object, subclass included.
_Self = TypeVar("_Self")

#: SIGTERM (SLURM, Kubernetes, most schedulers) and SIGUSR1 (SLURM ``--signal``; some
#: clusters send no SIGUSR1 at all, so SIGTERM must be handled too: submitit#1615).
DEFAULT_SIGNALS: tuple[int, ...] = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s
)

#: The exit status of a process (every rank, and ``atomic_checkpoint.launch``) that
#: stopped because it was preempted: "requeue me". 75 is ``EX_TEMPFAIL`` of
#: sysexits.h, "a temporary failure; try again later". It is not 128+SIGTERM (143): a
#: process killed by SIGTERM on the default action reports that too, and a scheduler
#: rule must tell "stopped cleanly, resume me" from "died".
REQUEUE_EXIT_CODE = 75

#: ``ATOMIC_CHECKPOINT_ARM=1``: :func:`arm` runs when ``atomic_checkpoint`` is imported
#: (``0``, ``false``, ``no``, ``off`` or empty: it does not).
ARM_ENV = "ATOMIC_CHECKPOINT_ARM"
#: ``ATOMIC_CHECKPOINT_GRACE_S=30``: the grace period, when ``grace_s`` is not given.
GRACE_ENV = "ATOMIC_CHECKPOINT_GRACE_S"
#: Set by ``python -m atomic_checkpoint.launch`` for its workers: a directory of the
#: node where each armed worker notes when its first signal came (see :func:`arm`).
SIGNALS_DIR_ENV = "ATOMIC_CHECKPOINT_SIGNALS_DIR"

#: A save is started only if ``MARGIN`` times the slowest recent save fits in the time
#: left: save durations vary (page cache, a busy filesystem), and the process still has
#: to close the manager and exit after the commit.
MARGIN = 1.25
#: How many recent saves the estimate looks at.
RECENT_SAVES = 5
#: Seconds of the grace period kept for the way out after an armed process gives up
#: waiting for its guard (at most half the grace period): the rank's exit, then the
#: launcher noticing it and exiting, on a busy node.
EXIT_RESERVE_S = 3.0


def _exit_reserve(grace_s: float) -> float:
    """The end of a ``grace_s`` grace period kept for the way out: ``EXIT_RESERVE_S``,
    at most half of it."""
    return min(EXIT_RESERVE_S, grace_s / 2)


class _Record:
    """The first signal a process received: what a handler stores, nothing else."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() when it arrived

    def on_signal(self, signum: int, previous: dict[int, Any]) -> None:
        # Runs in the main thread between two bytecodes, possibly in the middle of a
        # save or a collective: it must not save, log (the logging lock may be held by
        # the code it interrupted) or raise. It records, and the interrupted code goes
        # on where it was (PEP 475: interrupted system calls are retried).
        if os.getpid() != self.pid:
            # A forked child (a DataLoader worker) inherited the handler. It is not a
            # trainer and never saves; it reacts to the signal as it did before the
            # handler existed (by default: it dies), so the signal is not swallowed.
            before = previous.get(signum)
            signal.signal(signum, before if before is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:
            self.signum = signum
            self.at = time.monotonic()


class _Armed:
    def __init__(self, signals: tuple[int, ...]):
        self.signals = signals
        self.record = _Record()
        self.previous: dict[int, Any] = {}
        self.handler = self._on_signal  # one bound method: disarm() recognises it
        #: Set by the first guard of the process: from then on the guard decides.
        self.adopted = False
        #: The pipe of ``signal.set_wakeup_fd`` (read end, write end), or None.
        self.wakeup: tuple[int, int] | None = None

    def watch_wakeup(self) -> None:
        """Have Python's C-level handler write each signal's number to a pipe at once.
        A Python handler runs only once the main thread is back between two bytecodes,
        and a main thread inside a long C call (``init_process_group`` waiting for a
        slower rank) never got there: the start-up deadline, which reads the record,
        never learnt of the signal. Not if another wakeup fd is set (asyncio's)."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            before = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            before = None
        if before != -1:
            if before is not None:
                signal.set_wakeup_fd(before)  # someone else's: theirs
            close_quietly(r)
            close_quietly(w)
            return
        self.wakeup = (r, w)

    def read_wakeup(self) -> None:
        """Record a signal the wakeup pipe saw (the deadline's thread)."""
        if self.wakeup is None:
            return
        for signum in read_available(self.wakeup[0], 512):
            if signum in self.signals and self.record.signum is None:
                self.record.signum, self.record.at = signum, time.monotonic()

    def stop_wakeup(self) -> None:
        """Put the wakeup fd back as it was, if it is still ours (main thread)."""
        if self.wakeup is None:
            return
        r, w = self.wakeup
        self.wakeup = None
        try:
            current = signal.set_wakeup_fd(-1)
            if current != w:
                signal.set_wakeup_fd(current)  # replaced since (asyncio): leave it
        except (ValueError, OSError):
            pass
        close_quietly(r)
        close_quietly(w)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.record.on_signal(signum, self.previous)


_armed: _Armed | None = None


def _forget_wakeup_in_child() -> None:
    """A forked child (a DataLoader worker) shares the wakeup pipe: a signal it gets
    would read, in the parent, as the parent's own. The child's C handler stops
    writing there (its fork-time thread is its main thread)."""
    state = _armed
    if state is not None and state.wakeup is not None:
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        state.wakeup = None  # its copies of the two fds are closed when it exits


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_wakeup_in_child)


def _catchable(signals: Iterable[int]) -> tuple[signal.Signals, ...]:
    """``signals`` as ``signal.Signals``, or ``ValueError`` before any handler is
    installed: one that cannot be caught (SIGKILL) failed half way, leaving the handler
    of the ones before it installed and nothing to remove it."""
    try:
        wanted = tuple(signal.Signals(s) for s in signals)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"signals must be signal numbers such as signal.SIGTERM, got {signals!r:.60}: {exc}"
        ) from None
    if not wanted:
        raise ValueError("signals must name at least one signal, e.g. signal.SIGTERM")
    uncatchable = {getattr(signal, n, None) for n in ("SIGKILL", "SIGSTOP")} - {None}
    bad = [s.name for s in wanted if s in uncatchable]
    if bad:
        raise ValueError(
            f"{', '.join(bad)} cannot be caught (the kernel ends or stops the process "
            "without running a handler): preemption signals are e.g. SIGTERM and SIGUSR1"
        )
    return wanted


def _install(signals: Iterable[int], handler: Any) -> dict[int, Any]:
    """Install ``handler`` for every signal, or for none: the previous handlers back if
    one cannot be installed. Returns the previous handlers."""
    previous: dict[int, Any] = {}
    try:
        for s in signals:
            previous[s] = signal.getsignal(s)
            signal.signal(s, handler)
    except BaseException:
        for s, before in previous.items():
            signal.signal(s, before if before is not None else signal.SIG_DFL)
        raise
    return previous


def _seconds_or_none(name: str, value: Any) -> float | None:
    """``value`` as a positive, finite number of seconds (``_checks.positive_seconds``);
    None stays None."""
    return None if value is None else positive_seconds(name, value)


def arm(signals: Iterable[int] = DEFAULT_SIGNALS, *, grace_s: float | None = None) -> None:
    """Record preemption signals from now on, before any guard, manager or process
    group exists; the first :class:`PreemptionGuard` of the process adopts the record.

    Call it in the first lines of the training script, in the main thread (or set
    ``ATOMIC_CHECKPOINT_ARM=1`` in the training processes' environment: it arms every
    process that imports the library with it set, so give it to the trainers, not to a
    job whose other subprocesses import it too). A multiprocessing child started by
    spawn or forkserver that runs these first lines again as it imports the main module
    is not armed by them (it is no trainer); one whose target calls ``arm()`` is. Until a guard
    exists, a signal only sets the record: the start-up goes on, and the guard's first
    ``should_save`` stops every rank (and saves, when a save fits in the grace
    period). Idempotent; :func:`disarm` undoes it.

    The start-up deadline: with the grace period known (``grace_s``, else
    ``ATOMIC_CHECKPOINT_GRACE_S``), a process that got a signal and still has no guard
    ``EXIT_RESERVE_S`` (at most half the grace period) before the grace period ends
    exits at once with ``REQUEUE_EXIT_CODE``, from a watcher thread (``os._exit``: the
    main thread may be inside an import or a C call for seconds; the watcher learns of
    the signal through ``signal.set_wakeup_fd``, written by Python's C-level handler at
    once, when no other wakeup fd is set). Nothing was trained
    since the start, so nothing is lost; the scheduler's SIGKILL would have ended it a
    moment later with no exit status to requeue on. Importing a framework, building a
    model and forming the process group can take longer than a 10 s grace period on a
    busy node. Without a known grace period there is no deadline: a process that never
    creates a guard then ignores SIGTERM until the scheduler's SIGKILL.

    Under ``python -m atomic_checkpoint.launch`` the deadline counts from the first
    signal of any worker of the node (within one grace period before this one's): when
    only one worker was signalled and its deadline ended it, the launcher stops the
    others with a SIGTERM that comes up to a grace period later, and a deadline counted
    from that later signal would outlast the scheduler's SIGKILL. Each armed worker notes
    the time of its first signal in the launcher's directory (``SIGNALS_DIR_ENV``; the
    monotonic clock is the node's); a worker with a guard is not affected (it may be
    saving, and the guard decides).

    Raises:
        CheckpointError: not called from the main thread.
        ValueError: no signals, or a grace period that is not a positive number.
    """
    global _armed
    if threading.current_thread() is not threading.main_thread():
        raise CheckpointError(
            "preemption.arm() must be called in the main thread: Python runs signal "
            "handlers there only, and only the main thread may install them"
        )
    wanted = _catchable(signals)
    grace = _seconds_or_none("grace_s", grace_s)
    grace = grace if grace is not None else grace_from_env()
    if _importing_main_for_a_child():
        # The first lines of train.py, run again by a multiprocessing child started by
        # spawn or forkserver (a DataLoader or Pool worker) as it imports the main
        # module: not a trainer. Armed, it ignored SIGTERM, and Process.terminate() and
        # Pool.terminate() hung. A child whose target calls arm() (torch's mp.spawn
        # trainers) is armed.
        log.debug("arm(): not in a multiprocessing child importing the main module")
        return
    if _armed is not None and _armed.record.pid == os.getpid():
        if set(wanted) <= set(_armed.signals):
            return
        disarm()
    state = _Armed(wanted)
    state.previous.update(_install(wanted, state.handler))
    _armed = state
    if grace is not None:
        state.watch_wakeup()
        threading.Thread(
            target=_startup_deadline,
            args=(state, grace),
            name="atomic-checkpoint-startup-deadline",
            daemon=True,
        ).start()


def _importing_main_for_a_child() -> bool:
    """Whether this call runs inside multiprocessing's import of the main module in a
    child it starts by spawn or forkserver (``multiprocessing.spawn``'s fix-up)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name.startswith("_fixup_main_from") and code.co_filename.endswith(
            os.path.join("multiprocessing", "spawn.py")
        ):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _startup_deadline(state: _Armed, grace_s: float) -> None:
    """Exit with the requeue code if a signal came and no guard took it over in time
    (see :func:`arm`). Polls: a signal handler must not start threads or wake locks."""
    reserve = _exit_reserve(grace_s)
    shared = os.environ.get(SIGNALS_DIR_ENV, "").strip() or None
    noted = False
    while _armed is state and not state.adopted:
        state.read_wakeup()
        at = state.record.at
        if at is not None:
            if shared is not None and not noted:
                noted = _note_signal(shared, at, state.record.signum)
            first, signum = _first_signal(shared, at, state.record.signum, grace_s)
            now = time.monotonic()
            if now - first >= grace_s - reserve:
                name = signal.Signals(signum or signal.SIGTERM).name
                where = (
                    ""
                    if first == at
                    else " at another worker of this node (this one got its own signal "
                    f"{now - at:.1f} s ago: the grace period counts from the first)"
                )
                # os.write, not logging: the main thread may hold the logging lock.
                os.write(
                    2,
                    f"atomic_checkpoint.preemption: {name} arrived {now - first:.1f} s ago"
                    f"{where} and no PreemptionGuard has taken it over (the job is still "
                    f"starting); exiting with {REQUEUE_EXIT_CODE} (requeue) before the "
                    f"{grace_s:g} s grace period ends. Nothing was trained since the "
                    "start.\n".encode(),
                )
                os._exit(REQUEUE_EXIT_CODE)
        time.sleep(0.05)


def _note_signal(shared: str, at: float, signum: int | None) -> bool:
    """Note in the launcher's directory ``shared`` that this process got ``signum`` at
    monotonic time ``at``: the name of an empty directory, made by one ``mkdir(2)``, so a
    reader never sees half of it. False if it could not be made (the deadline then counts
    from this process's own signals only, as it does when the launcher is gone)."""
    if not is_dir(shared):  # not made again after the launcher removed it
        return False
    try:
        make_dirs(f"{shared}/{at:.6f}-{signum or 0}-{os.getpid()}")
    except StorageError:
        return False
    return True


def _first_signal(
    shared: str | None, at: float, signum: int | None, grace_s: float
) -> tuple[float, int | None]:
    """The earliest signal noted on this node (time, signal) that is at most a grace
    period older than this process's own at ``at``: an older one belongs to an earlier
    preemption that the job outlived."""
    first = (at, signum)
    for name in list_names(shared) if shared is not None else ():
        try:
            when, sig, pid = name.rsplit("-", 2)
            noted = (float(when), int(sig) or None)
            if int(pid) == os.getpid():
                continue  # this process's own note, rounded
        except ValueError:
            continue
        if at - grace_s < noted[0] < first[0]:
            first = noted
    return first


def disarm() -> None:
    """Put back the handlers :func:`arm` replaced (those still its own) and forget
    what it recorded. Main thread."""
    global _armed
    state, _armed = _armed, None
    if state is None or state.record.pid != os.getpid():
        return
    state.stop_wakeup()
    for s, previous in state.previous.items():
        if signal.getsignal(s) == state.handler:
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)


def armed() -> tuple[int | None, float | None] | None:
    """``(signum, monotonic time)`` of the first signal recorded since :func:`arm`
    (``(None, None)`` if none came yet), or None when this process is not armed."""
    if _armed is None or _armed.record.pid != os.getpid():
        return None
    return _armed.record.signum, _armed.record.at


def dataloader_worker_init(worker_id: int = 0, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
    """A DataLoader ``worker_init_fn`` (or a line of yours): the worker goes on through
    the scheduler's preemption signals, so that its trainer can save and exit first.

    Schedulers that signal every process of a job (SLURM signals each process of the
    job step; ``kill -TERM -<pgid>``) reach the DataLoader's worker processes too. torch
    gives each worker its own SIGTERM handler, under which the worker exits whoever sent
    the signal, and the trainer then raises ``RuntimeError: DataLoader worker ... killed
    by signal`` (from its SIGCHLD handler, at any point) before a guard can save.

    Here the worker takes the signals on a thread of its own (``sigwaitinfo``, which
    says who sent each one): from its trainer (the loader shutting it down), it exits at
    once, as torch's handler does; from anyone else, it goes on, and exits with its
    trainer (or at the scheduler's final SIGKILL)::

        loader = DataLoader(data, num_workers=4, worker_init_fn=preemption.dataloader_worker_init)

    With a ``worker_init_fn`` of your own, call ``preemption.dataloader_worker_init()``
    at its start. At the trainer's exit, workers that do not leave on its SIGTERM
    within half a second are killed (a scheduler's SIGTERM can swallow the trainer's:
    standard signals do not queue); :func:`protect_dataloaders` and
    ``PreemptionGuard`` arrange that in the trainer. Loaders protected by
    :func:`protect_dataloaders` also start their workers (by fork, spawn or forkserver)
    with these signals blocked, so one that comes before this init has run waits for it;
    used alone as a ``worker_init_fn``, a signal in the worker's first moments (torch's
    handler still in place) ends it as before. Runs in the worker process; a no-op in any
    other process, and where the platform has no ``sigwaitinfo`` (Windows, macOS).
    """
    del worker_id  # the signature torch calls it with
    worker = sys.modules.get("torch.utils.data._utils.worker")
    if worker is None or worker.get_worker_info() is None:
        return  # not a DataLoader worker: the trainer keeps its own handlers
    wait = getattr(signal, "sigwaitinfo", None)
    if wait is None or threading.current_thread() is not threading.main_thread():
        return
    wanted = set(signals)
    # Blocked in this thread before any other exists (the loader's threads and ours
    # inherit the mask), so only the waiting thread ever takes these signals.
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    trainer = _trainer_pid()

    def take() -> None:
        while True:
            info = wait(wanted)
            if info.si_pid == trainer:
                os._exit(0)  # the loader stops its worker: as torch's own handler

    threading.Thread(target=take, name="atomic-checkpoint-worker-signals", daemon=True).start()


def _trainer_pid() -> int:
    """In a DataLoader worker: the pid of the process that started it (its loader's).
    Not always the parent: a ``forkserver`` worker (Python 3.14's default start method
    on Linux) is the fork server's child, while multiprocessing records the process
    that asked for it."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


#: How long the reaper waits for DataLoader workers to leave on SIGTERM at exit before
#: it kills them.
REAP_WAIT_S = 0.5
_reaper_registered = False


def _register_worker_reaper() -> None:
    """In the trainer (idempotent): :func:`_reap_loader_workers` at interpreter exit."""
    global _reaper_registered
    if _reaper_registered:
        return
    import atexit
    import multiprocessing.util  # noqa: F401 - its exit handler is registered first

    # atexit runs handlers last-registered first: this one runs before multiprocessing's,
    # which SIGTERMs daemonic children and then joins them without a bound.
    atexit.register(_reap_loader_workers)
    _reaper_registered = True


def _reap_loader_workers() -> None:
    """At the trainer's exit: stop its protected DataLoader workers, and kill those that
    do not go within :data:`REAP_WAIT_S`.

    A protected worker (:func:`dataloader_worker_init`) exits on its trainer's SIGTERM
    and goes on through anyone else's. Standard signals do not queue: when the
    scheduler's SIGTERM is still pending in the worker (not yet taken by its waiting
    thread) as the trainer's arrives, the two merge into one that says it came from the
    scheduler, and the worker goes on. Python's own exit handler SIGTERMs daemonic
    children and joins them without a bound: the trainer would hang at exit until the
    scheduler's SIGKILL, losing its requeue exit status. Only daemonic children whose
    main thread blocks SIGTERM (what ``dataloader_worker_init`` does) are touched;
    others are left to Python's handler.
    """
    import multiprocessing

    try:
        workers = [
            p
            for p in multiprocessing.active_children()
            if p.daemon and p.pid is not None and _blocks_sigterm(p.pid)
        ]
        for p in workers:
            p.terminate()
        deadline = time.monotonic() + REAP_WAIT_S
        for p in workers:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in workers:
            if p.is_alive():
                log.debug("DataLoader worker %s did not leave on SIGTERM: killed", p.pid)
                p.kill()
                p.join(5.0)
    except Exception as exc:  # at exit: never in the way of the exit status
        log.debug("stopping the DataLoader workers at exit: %s", exc)


def _blocks_sigterm(pid: int) -> bool:
    """Whether process ``pid``'s main thread blocks SIGTERM (Linux: ``SigBlk`` of
    ``/proc/<pid>/status``; False where that cannot be read)."""
    try:
        status = read_head(f"/proc/{pid}/status", 4096)
    except StorageError:
        return False
    for line in (status or b"").splitlines():
        if line.startswith(b"SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


class _WorkerInit:
    """A DataLoader's ``worker_init_fn``: :func:`dataloader_worker_init`, then the
    loader's own (``inner``). A class, not a closure, so that loaders whose workers
    start by ``spawn`` or ``forkserver`` can pickle it."""

    def __init__(self, inner: Callable[[int], object] | None, signals: tuple[int, ...]):
        self.inner = inner
        self.signals = signals

    def __call__(self, worker_id: int) -> None:
        dataloader_worker_init(worker_id, self.signals)
        if self.inner is not None:
            self.inner(worker_id)


def protect_dataloaders(loaders: object, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
    """Install :func:`dataloader_worker_init` in front of the ``worker_init_fn`` of each
    DataLoader in ``loaders`` (a loader, or lists, tuples and dicts of them, as
    Lightning's combined loaders hold them); anything else is left alone.

    The integrations call it on every loader the framework builds (HF Trainer's
    ``get_*_dataloader``, Lightning's ``Strategy.process_dataloader``); call it yourself
    on loaders of your own, before iterating them: workers that already run keep the
    handlers they started with. Idempotent; the loader's own ``worker_init_fn`` still
    runs, after ours.
    """
    if isinstance(loaders, dict):
        for value in loaders.values():
            protect_dataloaders(value, signals)
        return
    if isinstance(loaders, (list, tuple)):
        for value in loaders:
            protect_dataloaders(value, signals)
        return
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is None or not isinstance(loaders, torch_data.DataLoader):
        return
    inner = vars(loaders).get("base_dataloader")
    if inner is not None:
        # Accelerate's prepared loaders (DataLoaderShard and the like) pass for a
        # DataLoader but iterate the one they wrap; an attribute set on the wrapper
        # would never reach its workers.
        protect_dataloaders(inner, signals)
        return
    current = loaders.worker_init_fn
    _register_worker_reaper()
    if isinstance(current, _WorkerInit):
        return
    if current is dataloader_worker_init:
        current = None  # given ours directly: wrapped alone, so its workers start blocked
    loaders.worker_init_fn = _WorkerInit(current, tuple(signals))
    own = vars(loaders).get("_get_iterator")
    if hasattr(signal, "sigwaitinfo") and hasattr(type(loaders), "_get_iterator"):
        loaders._get_iterator = _StartingBlocked(loaders, own)


class _StartingBlocked:
    """A protected DataLoader's ``_get_iterator`` (set on the instance): torch's, with
    the preemption signals blocked in the calling thread while it starts the workers.

    A child inherits its parent's signal mask across fork and exec, so every thread of
    a worker is born with them blocked, the native thread that ``import torch`` starts
    included: a spawned or forkserver worker has it before its ``worker_init_fn`` runs,
    and a process-directed signal goes to any thread that does not block it, where
    torch's handler would end the worker. The signals stay pending until the worker's
    init starts the thread that takes them and tells who sent each, so one that comes
    in the worker's first moments is no longer lost either. Workers of a fork server
    that was already running (started outside a protected loader) keep the server's
    mask. A class, not a closure, so the loader still pickles and copies."""

    def __init__(self, loader: Any, own: Callable[[], Any] | None):
        self.loader = loader
        self.own = own  # what the instance held under the name before, if anything

    def __call__(self) -> Any:
        start = self.own or (lambda: type(self.loader)._get_iterator(self.loader))
        init = self.loader.worker_init_fn
        if not isinstance(init, _WorkerInit) or not self.loader.num_workers:
            return start()  # the protection was taken off: nothing would take the signals
        _start_resource_tracker(self.loader.multiprocessing_context)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, init.signals)
        try:
            return start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Protecting:
    """A method that builds DataLoaders, then :func:`protect_dataloaders` on what it
    returns; ``own`` is what the instance held under that name before, if anything."""

    def __init__(self, method: Callable[..., Any], own: Any):
        self.method = method
        self.own = own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loaders = self.method(*args, **kwargs)
        protect_dataloaders(loaders)
        return loaders


def _start_resource_tracker(context: Any) -> None:
    """Start multiprocessing's resource tracker now if the workers will need it (spawn
    and forkserver): starting it unblocks SIGINT and SIGTERM in the calling thread, which
    would undo :class:`_StartingBlocked` halfway through. The loader's context, or the
    default one, which torch fixes at this point all the same."""
    import multiprocessing
    from multiprocessing import resource_tracker

    method = (context or multiprocessing.get_context()).get_start_method()
    if method != "fork":
        resource_tracker.ensure_running()


def protecting_loaders_of(obj: object, name: str) -> Callable[[], None]:
    """Wrap ``obj.<name>``, a method that builds or hands over DataLoaders, on this
    instance so that every loader it returns goes through :func:`protect_dataloaders`;
    returns the function that undoes it (the instance then holds what it held before).
    The integrations use it on the framework's own hooks (HF Trainer's
    ``get_train_dataloader``, Lightning's ``Strategy.process_dataloader``). Wrapping
    twice is a no-op whose undo does nothing."""
    method = getattr(obj, name)
    if isinstance(method, _Protecting):
        return lambda: None
    own = vars(obj).get(name)
    setattr(obj, name, _Protecting(method, own))

    def undo() -> None:
        if isinstance(vars(obj).get(name), _Protecting):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)

    return undo


def grace_from_env() -> float | None:
    text = os.environ.get(GRACE_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{GRACE_ENV}={text!r} is not a number of seconds (e.g. {GRACE_ENV}=30)"
        ) from None
    if not 0 < value < math.inf:
        # inf (or nan) made the guard's time left inf, which close(timeout_s=) refuses:
        # the job that followed the README's close(timeout_s=guard.time_left_s) died.
        raise ValueError(
            f"{GRACE_ENV}={text!r} must be a positive, finite number of seconds (unset "
            "it when the grace period is unknown)"
        )
    return value


class PreemptionGuard:
    """Turns preemption signals into one agreed, synchronous save at a step boundary.

    Created on every rank, from the main thread, after the ``CheckpointManager``. The
    handlers it installs replace the previous ones until :meth:`close` (or the end of
    the ``with`` block) puts the previous ones back. A signal recorded by :func:`arm`
    before the guard existed counts as received by the guard.

    Args:
        manager: the job's ``CheckpointManager`` (or ``TieredCheckpointManager``); its
            coordinator carries the vote.
        signals: the signals that mean "save and stop".
        timeout_s: bound on the wait for the other ranks in ``should_save``; default:
            the manager's ``timeout_s``.
        grace_s: the scheduler's grace period (seconds from the signal to the
            SIGKILL); default: ``ATOMIC_CHECKPOINT_GRACE_S``, else unknown. When
            known, a preemption save is started only if recent saves say it fits.

    Raises:
        CheckpointError: not called from the main thread (Python delivers signals to
            the main thread only, and only it may install handlers).
        ValueError: no signals, or a grace period that is not a positive number.
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
        self.signals: tuple[int, ...] = _catchable(signals)
        grace_s = _seconds_or_none("grace_s", grace_s)
        timeout_s = _seconds_or_none("timeout_s", timeout_s)
        if getattr(manager, "coordinator", None) is None:
            raise TypeError(
                f"PreemptionGuard needs the job's CheckpointManager, got "
                f"{type(manager).__name__} {manager!r:.60}"
            )
        # Workers given dataloader_worker_init directly are stopped at exit too.
        _register_worker_reaper()
        self._manager = manager
        self._coord = manager.coordinator
        self.timeout_s = float(manager.timeout_s if timeout_s is None else timeout_s)
        self.grace_s: float | None = grace_s if grace_s is not None else grace_from_env()
        self._record = _Record()
        #: The step at which the ranks agreed to stop (None until they do).
        self.decided_step: int | None = None
        #: The ranks that had received a signal when the ranks agreed.
        self.requested_by: tuple[int, ...] = ()
        #: Why the agreed stop saves nothing (the save would not fit), else None.
        self.skipped_save: str | None = None
        #: Once the ranks stopped: whether the work they said comes before the save at
        #: that step (``should_save(work_s=)``, an evaluation, say) fits in the grace
        #: period with the save, the same on every rank. False: skip it.
        self.work_fits = False
        #: Why that work is skipped, else None (no work was announced, or it fits).
        self.skipped_work: str | None = None
        self._work: float | None = None  # the largest work_s announced when they stopped
        self._save_now = False
        #: Once the ranks stopped: (the least time left of any rank, when it was known).
        self._agreed_left: tuple[float, float] | None = None
        self._checks = 0
        self._recent: list[float] = []  # durations of the last saves seen, seconds
        self._seen_save: Any = None
        self._previous: dict[int, Any] = {}
        self._closed = False
        # One bound method, kept: close() recognises its own handler by equality.
        self._handler = self._on_signal
        self._previous.update(_install(self.signals, self._handler))
        # After the handlers are in place, so that no signal falls between the two.
        if armed() is not None and _armed is not None:
            _armed.adopted = True  # the start-up deadline stops watching: we decide
            _armed.read_wakeup()  # a signal its thread had not read yet
            _armed.stop_wakeup()
        early = armed()
        if early is not None and early[0] is not None and self._record.signum is None:
            self._record.signum, self._record.at = early
        self._note_save()

    # ------------------------------------------------------------------ the handler
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._record.on_signal(signum, self._previous)

    # ------------------------------------------------------------------ queries
    @property
    def requested(self) -> bool:
        """Whether this process has received one of the signals. Local, not collective:
        other ranks may not know yet; use ``should_save`` to decide."""
        return self._record.signum is not None

    @property
    def signum(self) -> int | None:
        """The first signal this process received, or None."""
        return self._record.signum

    @property
    def stopping(self) -> bool:
        """Whether the ranks agreed to stop (at ``decided_step``), with a save or
        without one (``skipped_save`` says why). The same on every rank."""
        return self.decided_step is not None

    @property
    def exit_code(self) -> int:
        """The process's exit status: ``REQUEUE_EXIT_CODE`` once the ranks stopped
        for a preemption, else 0 (the loop ran to its end)."""
        return REQUEUE_EXIT_CODE if self.stopping else 0

    def exit(self) -> NoReturn:
        """End the process with :attr:`exit_code` (``raise SystemExit``), after the
        manager is closed. When preempted, further preemption signals are ignored
        from here on: the launcher stops the remaining ranks with SIGTERM as soon as
        one rank has exited, and during interpreter shutdown Python has already put
        the default action back, so such a signal would turn a clean requeue exit
        into a death by SIGTERM (exit status -15). When preempted with the grace
        period known, a round of a save left running by ``close(timeout_s=)`` that
        still waits for other ranks when two thirds of the exit reserve are left ends
        the process with ``os._exit`` (logged; ``atexit`` handlers do not run): the
        interpreter's exit would wait for it past the grace period."""
        code = self.exit_code
        if code == REQUEUE_EXIT_CODE and threading.current_thread() is threading.main_thread():
            for s in self.signals:
                signal.signal(s, signal.SIG_IGN)
        left = self._grace_left()
        # A save that close(timeout_s=) left running may hold a round that waits for
        # the other ranks: the interpreter's exit would wait for it (then tear the
        # store client down inside it), past the grace period. Within what is left of
        # it, less most of the exit reserve (for the launcher), it ends; else this ends
        # now.
        if (
            code == REQUEUE_EXIT_CODE
            and left is not None
            and not drain_workers(max(0.0, left - self._reserve * 2 / 3))
        ):
            log.warning(
                "preemption: exiting with %d now, leaving a save still waiting for "
                "other ranks (the grace period ends in %.1f s); the next start "
                "removes what it leaves",
                code,
                max(0.0, left),
            )
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
        raise SystemExit(code)

    @property
    def save_estimate_s(self) -> float | None:
        """The slowest of the recent saves this guard saw, seconds (None: none yet)."""
        return max(self._recent) if self._recent else None

    def _note_save(self) -> None:
        last = getattr(self._manager, "last_saved", None)
        if last is None or last is self._seen_save:
            return
        self._seen_save = last
        took = getattr(last, "timings_s", {}).get("total")
        if took is not None:
            self._recent = [*self._recent, float(took)][-RECENT_SAVES:]

    def _needed_s(self) -> float | None:
        """How long a save started now would take to commit on this rank: the slowest
        recent save, plus what is left of an async save still in flight (the save waits
        for it first). None: no save seen yet."""
        estimate = self.save_estimate_s
        if estimate is None:
            return None
        running = getattr(self._manager, "async_in_flight", None)
        if running is None:
            return estimate
        return estimate + max(0.0, estimate - (time.monotonic() - running.started_monotonic))

    def _time_left(self) -> float | None:
        if self.grace_s is None or self._record.at is None:
            return None
        return self.grace_s - (time.monotonic() - self._record.at)

    @property
    def _reserve(self) -> float:
        """The end of the grace period kept for the way out (``EXIT_RESERVE_S``, at most
        half of it): a preemption save is started only if it ends before, or the
        process outlived the grace period and lost the requeue exit code to SIGKILL."""
        return 0.0 if self.grace_s is None else _exit_reserve(self.grace_s)

    @property
    def time_left_s(self) -> float | None:
        """Seconds left of the grace period since this process's first signal, less the
        way out (``EXIT_RESERVE_S``, at most half the grace period: this rank's exit,
        then the launcher's, on a busy node); at least 0. None: no signal yet, or the
        grace period is unknown. Local to this rank. For what comes after the save,
        e.g. a tiered manager's ``close(timeout_s=guard.time_left_s)`` replicating the
        preemption save: the process still exits with ``REQUEUE_EXIT_CODE`` before the
        scheduler's SIGKILL (without the reserve, a close that used all of it left the
        job killed with 137)."""
        left = self._grace_left()
        return None if left is None else max(0.0, left - self._reserve)

    def _grace_left(self) -> float | None:
        """Seconds left of the grace period (None: no signal, or it is unknown). Once
        the ranks stopped: the least time left of any rank (the one signalled first),
        the same on every rank. A rank that got no signal had None, and a collective
        close(timeout_s=time_left_s) with None on some ranks and a bound on others
        never ended within the grace period."""
        if self.grace_s is None:
            return None
        if self._agreed_left is not None:
            agreed, at = self._agreed_left
            return agreed - (time.monotonic() - at)
        return self._time_left()

    def should_save(self, step: int, *, work_s: float | None = None) -> bool:
        """Whether to save now and stop, decided by all ranks together. Collective.

        Call it on every rank at the same step boundary, the same number of times.
        Every rank contributes whether it was signalled; once any rank was, the ranks
        stop (``stopping`` becomes True, for good) and the answer, identical on every
        rank, is True: save ``step`` now. It is False at that boundary when the grace
        period is known and the recent saves say the save would not commit in time
        (``skipped_save`` says why, and a warning): stop without saving, the previous
        checkpoint stays the newest. Later calls give the same answer.

        Work the loop would do at this step before the save (an evaluation whose
        metric the checkpoint should record, say) is announced with ``work_s``: when
        the ranks stop here, ``work_fits`` says, the same on every rank, whether that
        work and the save both fit in the grace period (``MARGIN`` x the slowest
        announced work plus the slowest recent save, less the exit reserve). Do it only
        then; otherwise skip it (``skipped_work`` says why): the save comes first.

        Args:
            step: the step the loop is at (the one a save now would record); every
                rank must pass the same one.
            work_s: how long that work takes on this rank, measured (e.g. the slowest
                recent evaluation); None: no such work at this step, or its duration
                is unknown (it is not kept). The ranks may pass different values; the
                largest counts.

        Returns:
            True: save ``step`` now (a normal ``mgr.save``) and stop training.

        Raises:
            CoordinationTimeoutError: some rank did not reach this boundary within
                ``timeout_s`` (it crashed, or it calls ``should_save`` fewer times).
            CollectiveMismatchError: some rank made another call of the library here
                (it went on to a save or to ``close()``: it calls ``should_save`` fewer
                times), said at once.
            CheckpointError: the ranks passed different steps, or the guard is closed.
        """
        step = validate_step(step)
        if work_s is not None and work_s != 0:
            work_s = positive_seconds("work_s", work_s)
        if self._closed:
            raise CheckpointError("this PreemptionGuard is closed: create a new one")
        self._checks += 1
        self._note_save()
        # Read the flag once: a signal landing during the exchange counts at the next
        # boundary, on every rank alike.
        mine = self._record.signum
        # Rank 0 collects every rank's view and sends every rank one summary: O(N)
        # bytes per check, not every view to every rank (this runs at every boundary).
        check = gather_summary(
            self._coord,
            f"preemption check {self._checks} at step {step}",
            (
                step,
                mine,
                self._time_left() if mine is not None else None,
                self._needed_s(),
                self.save_estimate_s,
                work_s,
            ),
            _check_summary,
            timeout_s=self.timeout_s,
        )
        if check["by_rank"] is not None:
            raise CheckpointError(
                f"ranks called should_save() at different steps ({check['by_rank']}): every "
                "rank must check at the same step boundary, the same number of times, or "
                "they would save different steps (or hang in different collectives)"
            )
        if self.decided_step is not None:
            return self._save_now
        signalled: tuple[int, ...] = check["signalled"]
        if not signalled:
            return False
        self.decided_step = step
        self.requested_by = signalled
        # Every rank decides the same from the same summary: the least time left (the
        # rank signalled first) against the slowest recent save.
        left, estimate = check["left"], check["estimate"]
        if left is not None:
            self._agreed_left = (left, time.monotonic())
        if left is not None and estimate is not None and estimate * MARGIN > left - self._reserve:
            slowest = check["slowest"] or estimate
            busy = (
                ""
                if estimate <= slowest
                else (f", after the async save in flight ({estimate - slowest:.2f} s more)")
            )
            self.skipped_save = (
                f"a save would take {estimate:.2f} s (the slowest of the recent saves took "
                f"{slowest:.2f} s{busy}) and {left:.2f} s are left of the {self.grace_s:g} s "
                f"grace period (a save is started only if {MARGIN:g} x its expected time fits "
                f"in it, less the {self._reserve:g} s kept for the exit)"
            )
        elif left is not None and left <= 0:
            self.skipped_save = f"the {self.grace_s:g} s grace period is already over"
        self._save_now = self.skipped_save is None
        self._decide_work(check["work"], left, estimate)
        if self._coord.rank == min(signalled):
            self._log_decision(step, signalled, check["signals"], left, estimate)
        if self._save_now:
            # With the grace period known, the wait for the async save in flight keeps
            # within it: a save stuck in a storage call held this rank here while the
            # others timed out, and the job was killed instead of requeued.
            running = self._report_failed_async(step, None if left is None else self.time_left_s)
            if left is not None:
                self._check_again_after_waiting(step, check["slowest"], running)
        return self._save_now

    def _decide_work(self, work: float | None, left: float | None, estimate: float | None) -> None:
        """Whether the announced work (``work_s``, the largest of any rank) and the save
        both fit in what is left of the grace period: the same on every rank, from the
        same agreed figures. Unknown durations or grace period: the work is skipped
        (the save is what the grace period is for)."""
        self._work = work
        self.work_fits, self.skipped_work = False, None
        if work is None:
            return
        if not self._save_now:
            self.skipped_work = "no save is made at this stop"
        elif left is None:
            self.skipped_work = f"the grace period is unknown (pass grace_s= or set {GRACE_ENV})"
        elif estimate is None:
            self.skipped_work = "no save was measured yet: the save's duration is unknown"
        elif (work + estimate) * MARGIN > left - self._reserve:
            self.skipped_work = (
                f"it takes {work:.2f} s and the save {estimate:.2f} s; {left:.2f} s are left "
                f"of the {self.grace_s:g} s grace period ({MARGIN:g} x both must fit in it, "
                f"less the {self._reserve:g} s kept for the exit)"
            )
        else:
            self.work_fits = True

    def _check_again_after_waiting(self, step: int, slowest: float | None, running: bool) -> None:
        """The save starts only once the async save in flight and the retention of the
        last save have ended (``_report_failed_async`` waited for both, within the
        grace period): either can take longer than the estimate said, so the ranks
        decide again, together, from the time left now and whether some rank's async
        save is still running (stuck in storage); a save that no longer fits, or would
        queue behind a stuck one, is not started."""
        left, stuck = gather_summary(
            self._coord,
            f"preemption check {self._checks} at step {step}: again",
            (self._time_left(), running),
            _least_left_and_running,
            timeout_s=self.timeout_s,
        )
        if left is None:
            return
        self._agreed_left = (left, time.monotonic())
        if self.work_fits and not stuck and self._work is not None and slowest is not None:
            # The wait used some of the window: keep the work only if both still fit.
            self._decide_work(self._work, left, slowest)
        if stuck:
            self.skipped_save = (
                f"the async save in flight on rank(s) {stuck} had not ended within the "
                f"{self.grace_s:g} s grace period (its storage is slow or not answering); "
                "a save now would queue behind it"
            )
        elif slowest is None or slowest * MARGIN <= left - self._reserve:
            return
        else:
            self.skipped_save = (
                f"a save would take {slowest:.2f} s (the slowest of the recent saves) and "
                f"only {max(left, 0.0):.2f} s are left of the {self.grace_s:g} s grace period "
                f"once the async save in flight and the last save's retention had ended (a "
                f"save is started only if {MARGIN:g} x its expected time fits in it, less "
                f"the {self._reserve:g} s kept for the exit)"
            )
        self._save_now = False
        if self._work is not None:
            self.work_fits, self.skipped_work = False, "no save is made at this stop"
        if self._coord.rank == min(self.requested_by):
            log.warning(
                "preemption: stopping at step %d WITHOUT saving: %s", step, self.skipped_save
            )

    def _report_failed_async(self, step: int, within_s: float | None) -> bool:
        """Finish the async save in flight and report its failure here, logged: raised
        by ``mgr.save(step)`` (the first call after it), it would cost the save the
        grace period is for, and the job would exit 1 instead of being requeued. Every
        rank gets the failure alike, so every rank goes on to the save. Waits up to
        ``within_s`` (None: as long as it runs); returns whether it is still running."""
        wait = getattr(self._manager, "wait", None)
        if wait is None:
            return False
        try:
            wait(timeout_s=within_s)
        except Exception as exc:  # any failure of that save: it is reported, not raised
            if isinstance(exc, TimeoutError) and not isinstance(exc, CheckpointError):
                # wait()'s own bound, not the save's failure (a rank that timed out).
                log.error(
                    "preemption: the async save before step %d (or its retention) has not "
                    "ended within the grace period; the preemption save is not started",
                    step,
                )
                return True
            log.error(
                "preemption: the async save before step %d failed (%s); the preemption "
                "save of step %d goes ahead",
                step,
                exc,
                step,
            )
        return False

    def _log_decision(
        self,
        step: int,
        signalled: tuple[int, ...],
        signums: list[int],
        left: float | None,
        estimate: float | None,
    ) -> None:
        names = sorted({signal.Signals(s).name for s in signums})
        waited = (
            f"{time.monotonic() - self._record.at:.2f} s after the signal"
            if self._record.at is not None
            else "at once"
        )
        last = getattr(self._manager, "last_saved", None)
        previous = f"step {last.step}" if last is not None else "the newest committed step"
        running = getattr(self._manager, "async_in_flight", None)
        if running is not None:  # it still commits (close() waits for it)
            previous += f", or step {running.step} once its async save in flight commits"
        if self.skipped_save is not None:
            log.warning(
                "preemption: %s received by rank(s) %s; every rank stops at step %d (%s) "
                "WITHOUT saving: %s. The previous checkpoint (%s) stays the newest and "
                "intact; the job resumes from it",
                "/".join(names),
                list(signalled),
                step,
                waited,
                self.skipped_save,
                previous,
            )
            return
        if left is None:
            fits = (
                "grace period unknown (pass grace_s= or set ATOMIC_CHECKPOINT_GRACE_S)"
                if self.grace_s is None
                else "no save measured yet: its duration is unknown"
            )
        elif estimate is None:
            fits = f"{left:.1f} s of the grace period left; no save measured yet"
        else:
            fits = f"{left:.1f} s of the grace period left, a save takes <= {estimate:.2f} s"
        work = ""
        if self.work_fits:
            work = f"; the {self._work:.2f} s of work announced before the save fits: it runs first"
        elif self.skipped_work is not None:
            work = f"; the work announced before the save is skipped: {self.skipped_work}"
        log.warning(
            "preemption: %s received by rank(s) %s; every rank saves step %d now (%s; %s%s) "
            "and stops",
            "/".join(names),
            list(signalled),
            step,
            waited,
            fits,
            work,
        )

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Put back the handlers that were installed before. Idempotent; main thread.

        A handler that someone else installed after this guard is left in place. Once
        preempted (a signal came, or the ranks stopped), the guard's handler stays
        instead, recording and otherwise ignoring further signals (``arm()``'s handler,
        if it was the one before, is put back: it only records too): the launcher stops
        the other ranks with SIGTERM as soon as one has exited, and a rank still closing
        its manager (retention, an upload, the run lock's release) died of it (-15),
        leaving its lock behind.
        """
        if self._closed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("PreemptionGuard.close() must be called from the main thread")
        preempted = self.requested or self.stopping
        armed = _armed.handler if _armed is not None else None
        for s, previous in self._previous.items():
            if signal.getsignal(s) != self._handler:
                log.debug(
                    "preemption: the handler of %s was replaced; leaving it",
                    signal.Signals(s).name,
                )
                continue
            if preempted and (armed is None or previous != armed):
                # The guard's handler stays: it only records (a forked child re-raises
                # with the handler before it). Not SIG_IGN, which every process started
                # from here on would inherit across exec.
                continue
            # None: the previous handler was not installed from Python; the default
            # action is the closest we can put back.
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._closed = True

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = "/".join(signal.Signals(s).name for s in self.signals)
        state = "closed" if self._closed else f"requested={self.requested}"
        return f"PreemptionGuard({names}, rank={self._coord.rank}, {state})"


if os.environ.get(ARM_ENV, "").strip().lower() not in ("", "0", "false", "no", "off"):
    # At import, as early as the training script can do anything: an import from
    # another thread cannot install handlers; then arm() must be called explicitly.
    if threading.current_thread() is threading.main_thread():
        arm()
    else:
        log.warning(
            "%s is set but atomic_checkpoint was first imported outside the main thread: "
            "signals are not armed; call atomic_checkpoint.preemption.arm() in the main "
            "thread",
            ARM_ENV,
        )


def _least_left_and_running(views: list[tuple[float | None, bool]]) -> tuple[float | None, str]:
    """The second check, on rank 0: the least time left of any rank, and the ranks
    whose async save is still running ("" if none; the first 8 named)."""
    left = min((v for v, _ in views if v is not None), default=None)
    running = [r for r, (_, busy) in enumerate(views) if busy]
    return left, (ranks_text(running, 8) if running else "")


def _check_summary(
    views: list[tuple[int, int | None, float | None, float | None, float | None, float | None]],
) -> dict[str, Any]:
    """What every rank needs of the ranks' views at a preemption check (each rank's
    step, signal, time left, time a save started now would take, slowest recent save,
    work announced before the save), computed once: the steps by rank if they differ
    (an error), the ranks signalled and their signals, the least time left, the longest
    save time, the slowest save and the longest work."""
    steps = {v[0] for v in views}
    lefts = [v[2] for v in views if v[2] is not None]
    estimates = [v[3] for v in views if v[3] is not None]
    slowest = [v[4] for v in views if v[4] is not None]
    work = [v[5] for v in views if v[5] is not None]
    return {
        "work": max(work) if work else None,
        "slowest": max(slowest) if slowest else None,
        "by_rank": {r: v[0] for r, v in enumerate(views)} if len(steps) > 1 else None,
        "signalled": tuple(r for r, v in enumerate(views) if v[1] is not None),
        "signals": sorted({v[1] for v in views if v[1] is not None}),
        "left": min(lefts) if lefts else None,
        "estimate": max(estimates) if estimates else None,
    }
