"""One save in flight: snapshot into reused host buffers, then write and commit in the
background, and raise a failure once, at the same call on every rank.

``CheckpointManager.save_async`` is built from the pieces of this module::

    training thread                          background thread ("atomic-checkpoint-save")
    ---------------                          -------------------------------------------
    save_async(step, state)
      wait for the previous save (raise
        its failure if not raised yet)
      plan_state(state); SnapshotPool.prepare
      AsyncSaver.submit(run) ---------------> commit protocol on a cloned coordinator
      Snapshot.copy()  <- the only time          (own store connection and key namespace,
                          training is blocked    never the training's collective stream):
    return SaveHandle                            first phase (pending location) meanwhile
    ... training mutates the state ...         write the image once copied: O_DIRECT by
                                                 DMA, hashing as it goes; fsync
                                               manifest, rename, then retention
    handle.result() <------------------------- CheckpointInfo or the failure
    next save / wait() / close() <------------ the failure, raised once, on every rank

The snapshot is the exact image of the state file (header, tensors at their file
offsets, pickle blobs) in one flat, page-aligned host buffer, allocated on the first
save (or beforehand, resident, by ``CheckpointManager.prepare_async``) and reused by
every later one: on these VMs memory that was freed and touched again can cost up to
15x a copy into already-resident memory, and a save must never allocate its state size
afresh. Being the file's image, it is written without another
copy: on local disks straight to the device with O_DIRECT, so the background write
costs almost no CPU and does not stream the state through the CPU caches that training
uses. When any source tensor lives on a GPU the buffer is pinned (page-locked), so the
device-to-host copies are DMA transfers that overlap; the snapshot waits for them
before ``save_async`` returns, so later in-place updates of the parameters cannot leak
into the checkpoint. Background saves run at the lowest CPU priority (SCHED_IDLE, per
thread, on Linux).

Outcomes are collective (DESIGN invariant 11): a failed save fails on every rank with
the same error, and the manager raises it at its next ``save``/``save_async``/
``saving``/``wait``/``close`` on every rank, whether or not ``SaveHandle.result()``
showed it to the program before (a rank that had been told could otherwise enter the
next save alone and wait ``timeout_s`` for ranks that raised instead).

Closing (``close()``, interpreter exit) lets an in-flight save finish within the
manager's ``timeout_s``; past that it asks the save to stop. A save stops at its next
chunk or fence check and discards its pending data; one already past its last fence
check is committing and cannot be interrupted. Either way ``close()`` waits until the
save has ended and reports what happened (DESIGN invariant 12): after it returns or
raises, no thread of the manager touches ROOT. Only interpreter exit bounds that last
wait (a storage call can hang forever): a save still running then dies with the process,
which keeps the run lock (it is taken over once the process is gone: a release would
touch the stuck storage); a save past its last fence check may still commit in that
moment; nothing else of it is a checkpoint, and the next start removes what it left.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ._checks import wait_seconds
from .errors import CheckpointError, SaveAbandonedError
from .manifest import CheckpointInfo
from .serialization import is_big_endian

__all__ = ["AsyncSaver", "SaveAbandonedError", "SaveHandle", "SnapshotPool"]

log = logging.getLogger("atomic_checkpoint")

# The snapshot buffer starts on a page (O_DIRECT writes go straight from it), on a huge
# page where the memory is ours to align.
_PAGE = 4096
_HUGE_PAGE = 2 << 20
# The background writer learns of copied bytes in steps of this size (see Snapshot._copy):
# by default only once the whole state is copied.
_STREAM_STEP_BYTES = 1 << 62


def lower_priority() -> None:
    """Give the calling thread only (Linux: priorities are per thread) the lowest CPU
    priority: SCHED_IDLE, else nice 19. Threads it starts inherit it."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError as exc:  # e.g. a seccomp filter: run at normal priority
        log.debug("could not lower the priority of the async save thread: %s", exc)


class SaveHandle:
    """The future of one ``save_async``: ``done()``, ``result()``.

    ``result()`` may be called any number of times, on any rank (it raises the same
    error each time). Independently of it, the manager raises a failure once, at its
    next ``save``/``save_async``/``saving``/``wait``/``close``, on every rank: those
    calls are collective, so whether one rank looked at its handle must not decide
    whether that rank enters the next save while the others raise.

    Attributes:
        step: the step being saved.
        blocked_s: how long ``save_async`` blocked the caller (wait for the previous
            save, plan, snapshot copy).
        started_monotonic: ``time.monotonic()`` when the background write started.
    """

    def __init__(self, step: int):
        self.step = step
        self.started_monotonic = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self._raised_by_manager = False
        self.blocked_s = 0.0

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle(step={self.step}, {state})"

    def done(self) -> bool:
        """True once the save committed or failed. Never blocks."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait until the checkpoint is committed and durable; return it.

        Args:
            timeout: seconds to wait; None waits for as long as the save runs (each of
                its waits on other ranks is bounded by the manager's ``timeout_s``).

        Raises:
            TimeoutError: the save is still running after ``timeout`` seconds (it goes
                on; call again).
            CheckpointError: the save failed (the same error on every rank); the
                previous checkpoints are intact.
            TypeError, ValueError: the save's metrics or metadata could not be recorded
                (as ``save`` raises them); nothing was written.
        """
        timeout = wait_seconds("timeout", timeout)
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"async save of step {self.step} still running after {timeout:g} s"
                if timeout is not None
                else f"async save of step {self.step} still running"
            )
        with self._lock:
            if self._error is not None:
                raise self._error
        if self._info is None:  # pragma: no cover - _finish always sets one of them
            raise CheckpointError(f"async save of step {self.step} ended without a result")
        return self._info

    def _finish(self, info: CheckpointInfo | None, error: BaseException | None) -> None:
        with self._lock:
            self._info, self._error = info, error
        self._done.set()

    def _mark_raised(self) -> None:
        """Its failure reached the caller already (an interrupt during ``save_async``
        itself): not raised again by the next call."""
        with self._lock:
            self._raised_by_manager = True

    def _take_error(self) -> BaseException | None:
        """The failure, if the manager has not raised it yet; marks it raised."""
        with self._lock:
            if self._error is None or self._raised_by_manager:
                return None
            self._raised_by_manager = True
            return self._error


class AsyncSaver:
    """Runs at most one save in the background.

    Only the training thread calls ``submit``, ``wait`` and ``close``; each background
    save runs in its own daemon thread (so a hung storage call cannot keep the
    interpreter from exiting once the exit hook gave up on it).
    """

    # Once its snapshot is copied, a background save drops to the lowest CPU priority
    # (SCHED_IDLE, else nice 19; per thread on Linux, inherited by threads it starts
    # later): on a machine with few cores the training loop keeps its CPU and the save
    # takes what is left; a thread that waits for the save (result(), wait()) leaves it
    # all. While the training thread copies, the save runs at normal priority so its
    # writes keep pace with the copy. Measured at 1 GiB, the training-step slowdown
    # during the write: 1.01 idle, 1.03 to 1.07 niced, noisy.
    lower_priority = True

    def __init__(self) -> None:
        self.cancel = threading.Event()  # set: the running save stops and fails
        self._handle: SaveHandle | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        # Guards _handle/_thread: a wait() from another thread (a monitor polling
        # mgr.wait(timeout_s=0)) cleared the handle of a save submitted meanwhile, and
        # the next save_async reused the snapshot buffers under its running write.
        self._state = threading.Lock()

    @property
    def owner_pid(self) -> int:
        """The process that created this saver (a forked child must not finish or close
        its parent's saves)."""
        return self._pid

    @property
    def running(self) -> SaveHandle | None:
        """The save still in progress, if any (a finished one is None)."""
        handle = self._handle
        return handle if handle is not None and not handle.done() else None

    def submit(self, step: int, fn: Callable[[], CheckpointInfo]) -> SaveHandle:
        """Start ``fn`` (write + commit of ``step``) in the background.

        The caller has waited for the previous save (``wait``) before snapshotting.
        """
        with self._state:
            running = self._handle is not None and not self._handle.done()
        if running:
            raise CheckpointError(  # pragma: no cover - the manager waits first
                f"an async save of step {self._handle.step if self._handle else '?'} is "
                "still running; wait() for it first"
            )
        handle = SaveHandle(step)
        self.cancel.clear()

        def run() -> None:
            info: CheckpointInfo | None = None
            error: BaseException | None = None
            try:
                info = fn()
            except BaseException as exc:  # reported once, by the handle or the manager
                error = exc
            handle._finish(info, error)

        thread = threading.Thread(target=run, name="atomic-checkpoint-save", daemon=True)
        with self._state:  # published together, started: what a waiter joins has run
            self._handle, self._thread = handle, thread
            thread.start()
        return handle

    def on_save_thread(self) -> bool:
        """Whether the caller is the running save's own thread (its ``on_commit``
        callback, or ``saving_async``'s write function)."""
        return self._thread is not None and self._thread is threading.current_thread()

    def mark_raised(self) -> None:
        """The latest save's failure reached its caller already (``SaveHandle``)."""
        if self._handle is not None:
            self._handle._mark_raised()

    def demote(self) -> None:
        """Called by the running save, on its own thread, once its snapshot is copied."""
        if self.lower_priority:
            lower_priority()

    def join(self, timeout_s: float | None) -> bool:
        """Wait for the running save; True if it has ended."""
        handle = self._handle
        if handle is None:
            return True
        return handle._done.wait(timeout_s)

    @property
    def is_running(self) -> bool:
        """True while a save of this process has not ended (it may still touch ROOT)."""
        handle = self._handle
        return handle is not None and os.getpid() == self._pid and not handle.done()

    def wait(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Wait for the in-flight save; raise its failure if the manager has not raised
        it yet (whether or not ``SaveHandle.result()`` showed it).

        Returns:
            The committed checkpoint; None if no save was in flight, or if its failure
            was raised by an earlier call.

        Raises:
            TimeoutError: still running after ``timeout_s``.
            CheckpointError: the save failed (raised once).
        """
        with self._state:
            handle, thread = self._handle, self._thread
        if handle is None:
            return None
        if not handle._done.wait(timeout_s):
            raise TimeoutError(
                f"async save of step {handle.step} still running after {timeout_s:g} s"
            )
        if thread is not None:
            thread.join()
        with self._state:
            if self._handle is handle:  # not a save submitted since by another thread
                self._handle, self._thread = None, None
        error = handle._take_error()
        if error is not None:
            raise error
        return handle._info

    # While close() waits for a save that was asked to stop, it says so this often.
    _STILL_WAITING_LOG_S = 60.0

    def finish_or_abandon(
        self, timeout_s: float, why: str, *, stop_bound_s: float | None = None
    ) -> BaseException | None:
        """At close or exit: let the running save finish within ``timeout_s``; past
        that, ask it to stop, then wait until it has ended. Logs what happened.

        A save asked to stop fails at its next chunk or fence check and discards its
        pending data; one already past its last fence check is committing, cannot be
        interrupted, and commits. Either way the outcome returned is the true one: its
        failure (if the manager has not raised it yet), or None when it committed.

        Args:
            timeout_s: how long the save may take to finish normally.
            why: for the log ("close()", "interpreter exit").
            stop_bound_s: how long to wait, once asked to stop, for the save to end;
                None waits as long as it runs (``close()``: nothing of the manager may
                touch ROOT after it). Only at interpreter exit is it bounded: a save
                still inside a storage call after it is left running (logged;
                ``is_running`` stays True, so the caller keeps the run lock).
        """
        handle = self._handle
        if handle is None:
            return None
        if os.getpid() != self._pid:  # a forked child: the thread does not exist here
            self._handle = None
            return None
        t = time.monotonic()
        if not handle.done():
            log.info("%s: waiting for the in-flight async save of step %d", why, handle.step)
        asked_to_stop = False
        if not self.join(timeout_s):
            asked_to_stop = True
            # The write stops at its next chunk and the coordinator refuses to commit at
            # its next fence check; a save already past that check is renaming or
            # fsyncing its commit, which no one can take back: wait for its end either way.
            self.cancel.set()
            log.warning(
                "%s: the in-flight async save of step %d is still running after %.1f s; "
                "asked it to stop, and waiting until it has ended (if it is already "
                "committing, it commits)",
                why,
                handle.step,
                time.monotonic() - t,
            )
            if not self._join_stopping(handle, why, stop_bound_s):
                log.error(
                    "%s: abandoned the in-flight async save of step %d after %.1f s, but it "
                    "is still running (inside a storage call): it is not a checkpoint unless "
                    "it was already committing. It ends with this process; the run lock "
                    "stays with it (releasing it would touch the stuck storage, and another "
                    "job could take ROOT under the save) and is taken over once the process "
                    "is gone; the next start removes whatever it left.",
                    why,
                    handle.step,
                    time.monotonic() - t,
                )
                return None
        try:
            info = self.wait(0)
        except BaseException as exc:
            if asked_to_stop:
                log.warning(
                    "%s: abandoned the in-flight async save of step %d after %.1f s: it is "
                    "NOT a checkpoint (%s); its pending data is never discoverable and is "
                    "removed now or at the next start. The previous checkpoints are intact.",
                    why,
                    handle.step,
                    time.monotonic() - t,
                    exc,
                )
            else:
                log.error(
                    "%s: the in-flight async save of step %d failed: %s",
                    why,
                    handle.step,
                    exc,
                )
            return exc
        if info is not None:
            log.info(
                "%s: finished the in-flight async save of step %d (committed at %s, "
                "waited %.3f s%s)",
                why,
                handle.step,
                info.path,
                time.monotonic() - t,
                "; it was already committing when asked to stop" if asked_to_stop else "",
            )
        return None

    def _join_stopping(self, handle: SaveHandle, why: str, bound_s: float | None) -> bool:
        """Wait for a save that was asked to stop; True once it has ended, False when
        ``bound_s`` ran out first."""
        t = time.monotonic()
        while True:
            left = None if bound_s is None else bound_s - (time.monotonic() - t)
            if left is not None and left <= 0:
                return handle.done()
            step_s = self._STILL_WAITING_LOG_S if left is None else min(left, 60.0)
            if handle._done.wait(step_s):
                return True
            if left is None:
                log.warning(
                    "%s: still waiting for the async save of step %d to end (%.0f s since it "
                    "was asked to stop): it is inside a storage call that has not returned",
                    why,
                    handle.step,
                    time.monotonic() - t,
                )


class _CopyProgress:
    """How much of a snapshot's image is copied; the background writer waits on it, so
    it can write the first tensors while the training thread still copies the rest."""

    def __init__(self, ready_bytes: int, cancel: threading.Event | None):
        self._cond = threading.Condition()
        self._ready = ready_bytes  # the image is complete up to this offset
        self._error: BaseException | None = None
        self._waiting = False
        self._cancel = cancel

    @property
    def ready_bytes(self) -> int:
        return self._ready

    def advance(self, ready_bytes: int) -> None:
        with self._cond:
            self._ready = ready_bytes
            if self._waiting:
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait_ready(self, upto: int, timeout_s: float = 600.0) -> None:
        """Block until the image is complete up to offset ``upto`` (the writer calls)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ready < upto:
                if self._error is not None:
                    raise CheckpointError(
                        f"the snapshot copy failed: {type(self._error).__name__}: {self._error}"
                    ) from self._error
                if self._cancel is not None and self._cancel.is_set():
                    raise SaveAbandonedError("the async save was abandoned during its snapshot")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointError(
                        f"the snapshot copy did not reach byte {upto} within {timeout_s:g} s"
                    )
                self._waiting = True
                self._cond.wait(min(left, 1.0))
                self._waiting = False


class Snapshot:
    """One state's snapshot: the file's exact image in the pool's buffer.

    The header and pickle blobs are placed when the snapshot is prepared; ``copy()``
    fills in the tensors, in file order, on the training thread. The background writer
    reads ``image`` (page-aligned, zero-padded to a whole page) chunk by chunk after
    ``wait_ready``: it writes it straight to the file (O_DIRECT where the filesystem
    takes it, no copy at all), hashing as it goes. Until ``copy()`` returns, the source
    state must not change.

    Attributes:
        image: the file's bytes (``total_size_bytes`` of them, then zeros to a page).
        total_size_bytes: the file's size.
        copy_s: how long ``copy()`` took.
    """

    def __init__(
        self,
        image: memoryview,
        total_size_bytes: int,
        copies: list[tuple[Any, Any, int]],
        progress: _CopyProgress,
    ):
        self.image = image
        self.total_size_bytes = total_size_bytes
        self._copies = copies  # (source, destination view, image offset where it ends)
        self._progress = progress
        self.copy_s = 0.0

    def wait_ready(self, upto: int) -> None:
        """Block until ``image[:upto]`` holds its final bytes."""
        self._progress.wait_ready(min(upto, self.total_size_bytes))

    def is_complete(self) -> bool:
        """True once every byte of the image is copied."""
        return self._progress.ready_bytes >= self.total_size_bytes

    def fail(self, error: BaseException) -> None:
        """The copy will not happen (the caller was interrupted before or during it):
        the writer fails at once instead of waiting for bytes that never come."""
        self._progress.fail(error)

    def copy(self) -> None:
        """Copy every source tensor into the image; blocks until all bytes are copied
        (device-to-host copies included). On failure the writer fails with it."""
        t = time.perf_counter()
        try:
            self._copy()
        except BaseException as exc:
            self._progress.fail(exc)
            raise
        finally:
            self.copy_s = time.perf_counter() - t

    def _copy(self) -> None:
        torch = sys.modules.get("torch")
        progress = self._progress
        # The writer is told in steps of _STREAM_STEP_BYTES, by default only at the end:
        # each wake-up of the writer (and the writes it starts) takes CPU and memory
        # bandwidth from this copy, which uses every core, and training waits for the
        # copy. Measured at 1 GiB with one write in flight while copying (time blocked /
        # plain copy, then time until durable / sync save; benchmarks/run.py --focus io,
        # 5 rounds, flat and train shapes): in 256 MiB steps 1.93 and 1.43, then 0.88
        # and 0.90; told at the end 1.03 and 1.27, then 0.92 and 0.94. The writes that
        # overlapped the copy saved little time until durable and cost the training
        # thread much. Streaming stays available (smaller steps) for tests.
        told = 0
        if torch is None:
            for src, dst, end in self._copies:
                _numpy_copy(dst, src)
                if end - told >= _STREAM_STEP_BYTES:
                    progress.advance(end)
                    told = end
            progress.advance(self.total_size_bytes)
            return
        devices = set()
        with torch.no_grad():
            for src, dst, end in self._copies:
                if not isinstance(src, torch.Tensor):
                    _numpy_copy(dst, src)
                elif src.is_cpu:  # (an attribute: src.device builds an object, 0.4 us)
                    dst.copy_(src.detach())
                else:
                    devices.add(src.device)
                    # Into pinned memory this is an asynchronous DMA; they all overlap
                    # and the synchronize below waits for them at once.
                    dst.copy_(src.detach(), non_blocking=True)
                # Device copies are ready only after the synchronize.
                if not devices and end - told >= _STREAM_STEP_BYTES:
                    progress.advance(end)
                    told = end
        for dev in devices:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            else:
                getattr(torch, dev.type).synchronize()
        progress.advance(self.total_size_bytes)


def _numpy_copy(dst: Any, src: Any) -> None:
    import numpy as np

    # "equiv": the same dtype, but for the byte order (a big-endian source is swapped).
    np.copyto(dst, src, casting="equiv")


class SnapshotPool:
    """Host memory that async saves copy their state into, allocated once and reused.

    One flat, page-aligned byte buffer holds the image of the state file (header,
    tensors at their file offsets, pickle blobs). It grows only when a state needs more
    bytes than it holds (for example when the optimizer creates its state after the
    first step); it never shrinks while the manager lives. Only the training thread
    calls ``prepare``, and only when no save is writing from the buffer.
    """

    def __init__(self) -> None:
        self._torch_buf: Any = None  # torch uint8 tensor over the aligned buffer
        self._np_buf: Any = None  # numpy uint8 view of the same memory
        self._keep: Any = None  # the allocation the aligned buffer is cut from
        self._pinned = False
        self.allocations = 0  # how many times memory was (re)allocated
        # The last prepare's destination views, by (offset, dtype, shape): a training
        # job saves the same layout again and again, and cutting a view costs three
        # tensor operations per leaf on the training thread (~10 us; 6 ms at 624 leaves).
        self._views: dict[tuple[int, Any, Any], tuple[Any, int]] = {}

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._np_buf is None else int(self._np_buf.nbytes)

    @property
    def data_ptr(self) -> int:
        """Address of the buffer (0 before the first snapshot)."""
        return 0 if self._np_buf is None else int(self._np_buf.ctypes.data)

    def release(self) -> None:
        """Drop the buffer (at close). Views still held by a running write keep their
        memory alive until that write ends."""
        self._torch_buf = self._np_buf = self._keep = None
        self._views = {}

    def _ensure(self, nbytes: int, *, use_torch: bool, pin: bool) -> None:
        have = self.capacity_bytes
        if (
            have >= nbytes
            and (self._torch_buf is not None or not use_torch)
            and (self._pinned or not pin)
        ):
            return
        self.release()  # free the old buffer before allocating the new one
        if pin:
            import torch

            # Page-locked memory for device-to-host DMA (cudaHostAlloc: page-aligned).
            raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=True)
            skip = -raw.data_ptr() % _PAGE
            self._keep = raw
            self._torch_buf = raw[skip : skip + nbytes]
            self._np_buf = self._torch_buf.numpy()
        else:
            import numpy as np

            # numpy's allocation asks the kernel for transparent huge pages; cut on a
            # huge-page boundary, the copy into it and the O_DIRECT writes from it are
            # faster than from torch.empty's memory (measured at 1 GiB: 0.067 against
            # 0.073 s, 0.29 against 0.33 s).
            raw_np = np.empty(nbytes + _HUGE_PAGE, dtype=np.uint8)
            skip = -raw_np.ctypes.data % _HUGE_PAGE
            self._keep = raw_np
            self._np_buf = raw_np[skip : skip + nbytes]
            if use_torch:
                import torch

                self._torch_buf = torch.from_numpy(self._np_buf)
        self._pinned = pin
        self.allocations += 1
        log.debug("snapshot buffer: %d bytes (pinned=%s)", nbytes, pin)

    @staticmethod
    def _needs(plan: Any) -> tuple[int, bool, bool]:
        """(capacity in bytes, torch tensors present, any on a GPU) for ``plan``."""
        torch = sys.modules.get("torch")
        use_torch = False
        on_gpu = False
        for _name, src in plan.tensors():
            if torch is not None and isinstance(src, torch.Tensor):
                use_torch = True
                on_gpu = on_gpu or src.is_cuda
        capacity = -(-max(plan.total_size_bytes, 1) // _PAGE) * _PAGE
        return capacity, use_torch, on_gpu

    def reserve(self, plan: Any) -> int:
        """Allocate the buffer for ``plan`` now and make every page of it resident, so
        that the first snapshot copies at the speed of later ones (see the module
        docstring: untouched memory costs a page fault per page, and on VMs far more).
        Returns the buffer's size in bytes. Only when no save writes from the buffer.
        """
        capacity, use_torch, on_gpu = self._needs(plan)
        before = self.allocations
        self._ensure(capacity, use_torch=use_torch, pin=on_gpu)
        if self.allocations != before and not self._pinned:
            # One write per 4 KiB page faults each page in (pinned memory already is);
            # with transparent huge pages, one fault per 2 MiB.
            self._np_buf[::_PAGE] = 0
        return self.capacity_bytes

    def prepare(self, plan: Any, *, cancel: threading.Event | None = None) -> Snapshot:
        """Lay out ``plan``'s file image in the buffer (growing it if needed), with its
        header and pickle blobs in place; copy no tensor yet.

        Args:
            plan: a ``serialization.StatePlan``.
            cancel: when set, a writer waiting for the copy gives up.
        """
        items = plan.tensors()
        header, offsets, blobs = plan.image_layout()
        total = plan.total_size_bytes
        torch = sys.modules.get("torch")
        capacity, use_torch, on_gpu = self._needs(plan)
        self._ensure(capacity, use_torch=use_torch, pin=on_gpu)
        flat = self._np_buf
        flat[: len(header)] = memoryview(header)
        for off, blob in blobs:
            flat[off : off + len(blob)] = memoryview(blob)
        flat[total:capacity] = 0  # the padded last page is written, then cut
        copies = []
        views, self._views = self._views, {}
        for (_name, src), off in zip(items, offsets, strict=True):
            if torch is not None and isinstance(src, torch.Tensor):
                key = (off, src.dtype, src.shape)
                view = views.get(key)
                if view is None:
                    nbytes = src.numel() * src.element_size()
                    cut = self._torch_buf[off : off + nbytes]
                    view = (cut.view(src.dtype).view(src.shape), nbytes)
                dst, nbytes = self._views[key] = view
            else:
                nbytes = int(src.nbytes)
                # The file holds arrays little-endian (as the sync save converts them):
                # a big-endian array is copied into a little-endian view, byte-swapped.
                dtype = src.dtype.newbyteorder("<") if is_big_endian(src.dtype) else src.dtype
                dst = flat[off : off + nbytes].view(dtype).reshape(src.shape)
            copies.append((src, dst, off + nbytes))
        # Until the first tensor is copied, the image is complete up to it.
        ready = offsets[0] if offsets else total
        image = memoryview(flat[:capacity]).cast("B")
        return Snapshot(image, total, copies, _CopyProgress(ready, cancel))


# -- interpreter exit ----------------------------------------------------------------

_exit_lock = threading.Lock()
_exit_managers: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_registered: int | None = None  # the process that registered the hook


def register_exit(manager: Any) -> None:
    """Have ``manager._close_at_exit()`` run at interpreter exit (held weakly).

    Registered after ``logging`` was imported, so it runs before logging's own exit
    hook (atexit runs handlers last-in, first-out) and its lines appear; and after the
    run locks' exit hook (``lock._release_at_exit``, at the process's first
    acquisition), so every in-flight save ends before any lock is released. In a
    ``multiprocessing`` child started by fork or forkserver (no atexit hooks run
    there) a finalizer runs it, before the locks' (its priority is higher)."""
    global _exit_registered
    from ._process import on_child_exit

    with _exit_lock:
        _exit_managers.add(manager)
        if _exit_registered != os.getpid():
            atexit.register(_at_exit)
            on_child_exit(_at_exit, priority=20)
            _exit_registered = os.getpid()


def _at_exit() -> None:
    with _exit_lock:
        managers = list(_exit_managers)
    for mgr in managers:
        try:
            mgr._close_at_exit()
        except Exception as exc:  # at exit there is no caller left to raise to
            log.error("closing %r at exit failed: %s", mgr, exc)
