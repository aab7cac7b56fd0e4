"""Tiered checkpoints: save to a fast tier, replicate to a persistent tier in the background.

A job saves to a node-local disk or RAM disk (tier 0) at device speed with the ordinary
commit protocol, and a replicator thread copies each committed step to the persistent
tier (tier 1: S3, NFS, Lustre, ...) off the training thread, where it commits with that
tier's own strategy (rename on a filesystem, manifest-last marker on an object store)::

    tier 0 (fast, e.g. /dev/shm/run1)        tier 1 (persistent, e.g. s3://bucket/run1)
      checkpoint-300/   committed, held  ----->  (being copied: invisible until its
      checkpoint-200/   committed, held            manifest is published)
                                                 checkpoint-200/  committed
                                                 checkpoint-100/  committed

Replication of one step, on the replicator thread of the process that coordinates
tier 0 (rank 0):

1. Read tier 0's manifest of the step (committed only: a pending save has none, so it
   is never replicated) and check its files' presence and sizes.
2. Create the step's pending location on tier 1 (``.pending/...`` or the marker's
   ``attempt-<token>/``), then stream each file into it, hashing every byte as it is
   read from tier 0: a file whose bytes do not match tier 0's recorded checksum is
   never committed anywhere (a corrupt fast copy is never replicated).
3. Read each arrived file back from tier 1 and hash it again: the copy is committed
   only if what tier 1 holds matches the checksums recorded at save time. The
   manifest published on tier 1 carries those checksums; they are never recomputed
   from a copy that was not checked against them.
4. Publish the manifest on tier 1 (the commit), then run tier 1's retention.

Tier 0's retention never deletes a step that has not reached tier 1: its policy is
extended with "keep every step still waiting for replication" (``keep`` of the user's
policy plus the waiting steps). Replication resumes after a crash: on start, the steps
committed on tier 0 that tier 1 lacks (newer than tier 1's newest step) are queued
again; an attempt killed half way left only a pending location on tier 1, which tier
1's next start sweeps. While tier 1 is unreachable, saves go on at tier 0 and hold
their steps there; the replicator retries with a bounded back-off and catches up when
the link returns.

``restore()`` loads the newest step valid in some tier: from tier 0 when it holds a
copy that verifies, else from tier 1, so a wiped tier 0 restores from tier 1 without
user action.

This module supports single-process jobs (one rank per tier root); multi-rank jobs and
peer replicas across nodes are the next step (see the README).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from . import catalog
from ._faults import fault_point
from ._version import __version__
from .async_save import _lower_priority
from .coordination import Coordinator, SingleProcessCoordinator
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    LockError,
    LockHeldError,
    StorageError,
    UnsafeCheckpointError,
)
from .layout import checkpoint_name, new_attempt_token, validate_step
from .manager import RUN_FILE, CheckpointManager
from .manifest import CheckpointInfo, FileEntry, Hasher, Manifest
from .storage import open_storage
from .storage.base import Storage

__all__ = ["Tier", "TieredCheckpointInfo", "TieredCheckpointManager"]

log = logging.getLogger("atomic_checkpoint")

_CHUNK = 8 << 20
# Back-off between attempts while the persistent tier fails (unreachable, throttled):
# doubled after each failure up to the maximum, reset by a success or a new save.
_RETRY_MIN_S = 0.05


@dataclass(frozen=True)
class Tier:
    """One storage tier of a :class:`TieredCheckpointManager`.

    Args:
        root: a directory, a URL (``s3://bucket/prefix``) or a ``Storage``.
        retention: this tier's policy (``KeepLast(2)``, ``KeepLast(3) | KeepEvery(1000)``);
            None keeps everything. On tier 0 it never deletes a step that has not
            reached the persistent tier yet.
        storage_options: fsspec options for URL roots (endpoint, credentials).
        strategy: force the commit strategy (``"rename"``/``"marker"``); None chooses.
    """

    root: str | os.PathLike[str] | Storage
    _: KW_ONLY
    retention: Any = None
    storage_options: Mapping[str, Any] | None = None
    strategy: str | None = None


@dataclass(frozen=True)
class TieredCheckpointInfo(CheckpointInfo):
    """A ``CheckpointInfo`` (of the fastest tier that holds the step) and ``tiers``: the
    indexes of the tiers that hold a valid copy of it, fastest first."""

    tiers: tuple[int, ...] = ()


class _HoldUnreplicated:
    """Tier 0's retention: the user's policy, plus every step still waiting for the
    persistent tier (DESIGN invariant 10: no policy deletes the only copy of a step that
    has not been persisted). Pure over the replicator's in-memory state, read under its
    lock; called on tier 0's rotation thread."""

    def __init__(self, policy: Any, owner: TieredCheckpointManager):
        self.policy = policy
        self._owner = owner

    def __repr__(self) -> str:
        return f"{self.policy!r} (holding steps not yet replicated)"

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        kept = set(self.policy.keep(checkpoints)) if self.policy is not None else set()
        steps = {c.step for c in checkpoints}
        return frozenset(kept | (self._owner._held_steps(steps) & steps))


class _Stopped(Exception):
    """Internal: ``close()`` asked the replicator to stop mid-copy."""


class _ArrivalMismatch(CommitError):
    """The bytes tier 1 holds after a copy do not match the recorded checksums (a write
    or transfer went wrong): the attempt is discarded and retried."""


class TieredCheckpointManager:
    """Save to the first (fast) tier, replicate each committed step to the second
    (persistent) tier in the background, restore from the fastest tier with a valid copy.

    Example::

        mgr = TieredCheckpointManager([
            Tier("/dev/shm/run1", retention=KeepLast(2)),
            Tier("s3://bucket/run1", retention=KeepLast(3), storage_options=opts),
        ])
        if mgr.latest() is not None:
            state = mgr.restore()          # tier 0 if valid there, else tier 1
        mgr.save(step, state)              # returns once committed on tier 0
        mgr.close()                        # drains replication (bounded), then closes

    Args:
        tiers: exactly two tiers, fastest first.
        run_id: the run; default: the run recorded on tier 0, else on tier 1 (a wiped
            tier 0 continues the persistent tier's run), else a new one.
        on_commit: called as ``on_commit(tier_index, info)`` after each commit is
            durable on a tier: tier 0 on the saving thread, tier 1 on the replicator
            thread (an exception there is logged, never stops replication).
        timeout_s, allow_pickle, resume, takeover: as for ``CheckpointManager``
            (``resume`` and ``takeover`` apply to tier 0).
        retry_max_s: the longest wait between attempts while tier 1 fails.
        coordinator: this slice supports one process (the default).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        run_id: str | None = None,
        on_commit: Callable[[int, CheckpointInfo], None] | None = None,
        timeout_s: float = 600.0,
        allow_pickle: bool = False,
        resume: str = "auto",
        takeover: bool = False,
        retry_max_s: float = 5.0,
        coordinator: Coordinator | None = None,
    ):
        tiers = list(tiers)
        if len(tiers) != 2 or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError(
                "tiers must be two Tier(...) objects, fastest first: "
                "[Tier(local_root, ...), Tier(persistent_root, ...)]"
            )
        coord = coordinator or SingleProcessCoordinator()
        if coord.world_size != 1:
            raise ValueError(
                f"TieredCheckpointManager supports single-process jobs for now (this job has "
                f"{coord.world_size} ranks): use CheckpointManager on the persistent root, "
                "or one process per tier root"
            )
        self.tiers = tuple(tiers)
        self.on_commit = on_commit
        self.timeout_s = float(timeout_s)
        self.allow_pickle = allow_pickle
        self.retry_max_s = float(retry_max_s)
        self._cv = threading.Condition()
        self._todo: set[int] = set()  # committed on tier 0, not yet on tier 1
        self._failed: dict[int, CheckpointError] = {}  # never replicable (corrupt source)
        self._replicated: set[int] = set()
        self._reconciled = False  # tier 1 consulted: until then tier 0 holds everything
        self._fatal: BaseException | None = None
        self._last_error: BaseException | None = None
        self._stop = threading.Event()
        self._kick = False  # a new step arrived: retry at once
        self._persistent: CheckpointManager | None = None
        self._reader: CheckpointManager | None = None
        self._closed = False
        #: The tier the last ``restore`` loaded from (0 or 1) and what it loaded.
        self.last_restored: TieredCheckpointInfo | None = None

        fast, slow = tiers
        self._fast_storage = _open(fast)
        self._slow_storage = _open(slow)
        opened_slow: CheckpointError | None = None
        # Tier 0 holds no run file when its manager was opened with a run id (below):
        # then its newest checkpoint names the run.
        rid = run_id or _recorded_run_id(self._fast_storage) or _newest_run_id(self._fast_storage)
        if rid is None:
            # A fresh or wiped tier 0: the persistent tier says which run this is
            # (never a silent fresh start over its checkpoints, DESIGN invariant 6). If
            # it cannot be read, that error is raised: nobody can tell.
            rid = _recorded_run_id(self._slow_storage) or _newest_run_id(self._slow_storage)
        self.fast = CheckpointManager(
            self._fast_storage,
            retention=(
                _HoldUnreplicated(fast.retention, self) if fast.retention is not None else None
            ),
            run_id=rid,
            coordinator=coord,
            timeout_s=timeout_s,
            resume=resume,
            on_commit=self._on_fast_commit,
            allow_pickle=allow_pickle,
            takeover=takeover,
            strategy=fast.strategy,
            storage_domains="shared",
        )
        self.run_id: str = self.fast.run_id
        try:
            self._open_persistent()
        except StorageError as exc:  # unreachable: saves go on, replication retries
            opened_slow = exc
            log.warning(
                "persistent tier %s is unreachable at start (%s): saves go to %s and are "
                "held there; replication starts when it answers",
                self._slow_storage.url(""),
                exc,
                self.fast.root,
            )
        except BaseException:
            # Another live job holds tier 1, or it holds only corrupt checkpoints: a
            # decision for the user, not something to retry.
            self.fast.close()
            raise
        self._thread = threading.Thread(
            target=self._replicate_loop, name="atomic-checkpoint-replicator", daemon=True
        )
        self._thread.start()
        if opened_slow is not None:
            self._last_error = opened_slow
        # Registered after both tier managers (their run locks' own exit hooks): atexit
        # runs hooks last-in first-out, so the replicator stops before a lock goes, and
        # nothing of this manager touches tier 1 after its lock is released.
        atexit.register(_stop_at_exit, weakref.ref(self), os.getpid())

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, **kwargs: Any) -> CheckpointInfo:
        """Save ``state`` as checkpoint ``step`` on tier 0 (``CheckpointManager.save``'s
        arguments); returns once it is committed there. Replication follows in the
        background."""
        self._check_open()
        return self.fast.save(step, state, **kwargs)

    def save_async(self, step: int, state: Any, **kwargs: Any) -> Any:
        """``CheckpointManager.save_async`` on tier 0; replication starts once the
        step commits there."""
        self._check_open()
        return self.fast.save_async(step, state, **kwargs)

    def prepare_async(self, state: Any, **kwargs: Any) -> int:
        """``CheckpointManager.prepare_async`` on tier 0."""
        return self.fast.prepare_async(state, **kwargs)

    def wait(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Wait for tier 0's async save (``CheckpointManager.wait``), not for replication
        (``wait_replicated``)."""
        return self.fast.wait(timeout_s)

    def saving(self, step: int, **kwargs: Any) -> Any:
        """``CheckpointManager.saving`` on tier 0 (tier 0 must be a mounted filesystem)."""
        self._check_open()
        return self.fast.saving(step, **kwargs)

    def _on_fast_commit(self, info: CheckpointInfo) -> None:
        # Called by tier 0's manager after the commit is durable: the step is a
        # checkpoint now, never a pending location, so it may be replicated.
        with self._cv:
            self._todo.add(info.step)
            self._kick = True
            self._cv.notify_all()
        if self.on_commit is not None:
            self.on_commit(0, info)

    def _on_slow_commit(self, info: CheckpointInfo) -> None:
        if self.on_commit is None:
            return
        try:
            self.on_commit(1, info)
        except Exception as exc:  # the replicator goes on; the user learns from the log
            log.warning("on_commit(1, step %d) raised %s: %s", info.step, type(exc).__name__, exc)

    def _held_steps(self, steps: set[int]) -> set[int]:
        """The steps tier 0's retention must keep for replication."""
        with self._cv:
            if not self._reconciled:
                return set(steps)  # tier 1 not consulted yet: any of them may be missing
            return set(self._todo)

    # ------------------------------------------------------------------ replication
    def _open_persistent(self) -> None:
        """Open tier 1 (taking its run lock) and queue what tier 0 holds that tier 1
        lacks. Called at start and by the replicator after a failure."""
        slow = self.tiers[1]
        pm = CheckpointManager(
            self._slow_storage,
            retention=slow.retention,
            run_id=self.run_id,
            coordinator=SingleProcessCoordinator(),
            timeout_s=self.timeout_s,
            on_commit=self._on_slow_commit,
            allow_pickle=self.allow_pickle,
            strategy=slow.strategy,
            storage_domains="shared",
        )
        try:
            on_slow = {c.step for c in pm.checkpoints()}
            # Read from storage, not through tier 0's manager: this may run on the
            # replicator thread while the training thread saves through that manager.
            on_fast = {
                m.step
                for m in catalog.committed(self._fast_storage, run_id=self.run_id, warn=False)
            }
        except BaseException:
            pm.close()
            raise
        newest_slow = max(on_slow, default=None)
        with self._cv:
            self._persistent = pm
            # Steps at or below tier 1's newest that it lacks were replicated and then
            # dropped by its own policy (or never replicable): not queued again, since
            # tier 1 orders checkpoints by step like any root.
            missing = {s for s in on_fast - on_slow if newest_slow is None or s > newest_slow}
            self._todo = {s for s in self._todo | missing if s not in on_slow}
            self._replicated |= on_fast & on_slow
            self._reconciled = True
            self._cv.notify_all()
        if missing:
            log.info(
                "replication to %s resumes: steps %s are on %s only",
                pm.root,
                sorted(missing),
                self.fast.root,
            )

    def _replicate_loop(self) -> None:
        # Replication is never urgent next to training: the lowest CPU priority, as an
        # async save's writer thread (the copy's hashing runs here).
        _lower_priority()
        delay = _RETRY_MIN_S
        while True:
            with self._cv:
                if self._stop.is_set():
                    return
                if self._fatal is None and self._persistent is not None and not self._todo:
                    self._cv.wait()
                    continue
            if self._fatal is not None:
                self._stop.wait()
                return
            step: int | None = None
            try:
                if self._persistent is None:
                    self._open_persistent()
                with self._cv:
                    step = min(self._todo) if self._todo else None
                    self._kick = False
                if step is not None:
                    self._replicate(step)
                    with self._cv:
                        self._todo.discard(step)
                        self._replicated.add(step)
                        self._last_error = None
                        self._cv.notify_all()
                delay = _RETRY_MIN_S
            except _Stopped:
                return
            except (
                CorruptCheckpointError,
                UnsafeCheckpointError,
                CheckpointNotFoundError,
                CheckpointExistsError,
            ) as e:
                if step is None:  # opening tier 1, not a step's copy: try again later
                    delay = self._back_off(e, delay)
                    continue
                # Tier 0's copy is bad or gone, or tier 1 holds another copy of the
                # step: retrying cannot help. Released from the hold (a bad copy is not
                # a valid copy of anything; another copy is for the user to compare).
                log.error(
                    "replication of step %s to %s failed: %s; the step stays on tier 0 only",
                    step,
                    self._slow_storage.url(""),
                    e,
                )
                with self._cv:
                    self._todo.discard(step)
                    self._failed[step] = e
                    self._cv.notify_all()
            except LockError as exc:
                # Tier 1 fenced us (a lease that lapsed while the link was down): open
                # it again, which takes the lock back only if it is still this run's and
                # its holder is gone. Another live job holding it stops replication.
                self._drop_persistent()
                if isinstance(exc, LockHeldError):
                    with self._cv:
                        self._fatal = exc
                        self._cv.notify_all()
                    log.error("replication stopped: %s", exc)
                    continue
                delay = self._back_off(exc, delay)
            except Exception as exc:  # unreachable, throttled: retried with a back-off
                delay = self._back_off(exc, delay)

    def _back_off(self, exc: BaseException, delay: float) -> float:
        with self._cv:
            first = self._last_error is None
            self._last_error = exc
        (log.warning if first else log.debug)(
            "replication to %s failed (%s: %s); retrying in %.2f s, the waiting steps stay "
            "held on %s",
            self._slow_storage.url(""),
            type(exc).__name__,
            exc,
            delay,
            self.fast.root,
        )
        with self._cv:
            if not self._kick:
                self._cv.wait_for(lambda: self._kick or self._stop.is_set(), timeout=delay)
        return min(delay * 2, self.retry_max_s)

    def _drop_persistent(self) -> None:
        with self._cv:
            pm, self._persistent = self._persistent, None
        if pm is not None:
            try:
                pm.close()
            except CheckpointError as exc:
                log.debug("closing the fenced persistent manager: %s", exc)

    def _replicate(self, step: int) -> None:
        """Copy committed step ``step`` from tier 0 to tier 1 and commit it there."""
        pm = self._persistent
        if pm is None:
            raise CommitError("the persistent tier is not open")
        src_store, dst = self._fast_storage, self._slow_storage
        t0 = time.perf_counter()
        # Tier 0's manifest: the step is committed there (never a pending save), with
        # every file present at its recorded size.
        source = catalog.load_checkpoint(src_store, step)
        name = checkpoint_name(step)
        pm._finish_rotation()  # one rotation at a time on tier 1, as a save does
        try:
            there = catalog.load_checkpoint(dst, step)
        except CheckpointNotFoundError:
            there = None
        except CheckpointError:
            there = None  # a torn or foreign copy: the commit below refuses or replaces
        if there is not None:
            if _same_content(there, source):
                return  # committed by an attempt whose end we never saw (a crash)
            raise CheckpointExistsError(
                f"step {step} on {dst.url(name)} is another copy than the one on "
                f"{src_store.url(name)} (different checksums): not replaced; inspect both"
            )
        strategy = pm._strategy
        pm._check_fence()
        staged = strategy.prepare(dst, step, new_attempt_token())
        try:
            files = []
            for i, entry in enumerate(source.files):
                rel = _plain_path(entry.path)
                catalog.check_inside(src_store, name, entry.path)
                self._copy_verified(
                    f"{name}/{entry.path}", f"{staged}/{rel}", entry, source.checksum_algorithm
                )
                files.append(FileEntry(rel, entry.size_bytes, entry.checksum, entry.rank))
                if i == 0:
                    fault_point("mid_replicate", 0, step)
            for f in files:
                self._check_arrived(f"{staged}/{f.path}", f, source.checksum_algorithm, step)
            fault_point("before_replica_commit", 0, step)
            if self._stop.is_set():
                raise _Stopped()
            pm._check_fence()
            manifest = dataclasses.replace(
                source,
                run_id=pm.run_id,
                commit_seq=pm._next_seq(),
                files=tuple(files),
                strategy=strategy.name,
                library_version=__version__,
                domain_ranks=None,
                domain_count=1,
            )
            written = strategy.publish(dst, staged, manifest, rank=0, overwrite=False)
        except BaseException:
            try:
                if not strategy.is_committed(dst, step, staged):
                    strategy.discard(dst, staged)
            except CheckpointError as exc:
                log.warning(
                    "could not discard %s (the next start of the persistent tier sweeps it): %s",
                    dst.url(staged),
                    exc,
                )
            raise
        pm._after_commit(written, {"total": time.perf_counter() - t0})
        log.info("replicated %s to %s", name, dst.url(name))

    def _copy_verified(self, src: str, dst: str, entry: FileEntry, algorithm: str) -> None:
        """Stream ``src`` (tier 0) to ``dst`` (tier 1), hashing each byte read; raise
        ``CorruptCheckpointError`` (nothing committed) if it is not the saved file."""
        h = Hasher(algorithm)
        size = 0
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        w = self._slow_storage.open_write(dst, size_hint=entry.size_bytes)
        try:
            with self._fast_storage.open_read(src) as r:
                while n := r.readinto(view):
                    if self._stop.is_set():
                        raise _Stopped()
                    h.update(view[:n])
                    w.write(view[:n])
                    size += n
                    if size > entry.size_bytes:
                        break
            digest = h.hexdigest()
            if size != entry.size_bytes or digest != entry.checksum:
                raise CorruptCheckpointError(
                    f"{self._fast_storage.url(src)}: read {size} bytes with checksum {digest}, "
                    f"the manifest records {entry.size_bytes} bytes with {entry.checksum}: "
                    "tier 0's copy is corrupt and is not replicated"
                )
            w.close()
        except BaseException:
            w.abort()
            raise

    def _check_arrived(self, dst: str, entry: FileEntry, algorithm: str, step: int) -> None:
        """Read ``dst`` back from tier 1: commit only what arrived intact."""
        h = Hasher(algorithm)
        size = 0
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        with self._slow_storage.open_read(dst) as r:
            while n := r.readinto(view):
                if self._stop.is_set():
                    raise _Stopped()
                h.update(view[:n])
                size += n
        digest = h.hexdigest()
        if size != entry.size_bytes or digest != entry.checksum:
            raise _ArrivalMismatch(
                f"step {step}: {self._slow_storage.url(dst)} holds {size} bytes with checksum "
                f"{digest} after the copy, the save recorded {entry.size_bytes} bytes with "
                f"{entry.checksum}; the attempt is discarded and retried"
            )

    # ------------------------------------------------------------------ waiting
    def wait_replicated(self, step: int | None = None, timeout_s: float | None = None) -> bool:
        """Wait until ``step`` (default: every step committed so far) is committed on the
        persistent tier.

        Returns:
            True when it is; False when ``timeout_s`` passed first (it stays held on
            tier 0 and replication goes on).

        Raises:
            CorruptCheckpointError: tier 0's copy of the step (of one of the steps
                waited for) did not verify: it will never be replicated.
            CheckpointNotFoundError: ``step`` was never committed on tier 0 here.
            CheckpointError: replication stopped (e.g. another job holds the
                persistent tier's run lock).
        """
        if step is not None:
            step = validate_step(step)
        with self._cv:
            reconciled = self._reconciled
            failed_before = set(self._failed)
            if step is not None:
                limit, only = step, True
            else:
                # Every step committed so far. Before tier 1 was first reached, which of
                # tier 0's steps it lacks is unknown: tier 0's newest bounds them.
                limit, only = max(self._todo, default=-1), False
        if not reconciled and step is None:
            on_fast = catalog.committed(self._fast_storage, run_id=self.run_id, warn=False)
            limit = max([limit] + [m.step for m in on_fast])

        def waiting() -> set[int]:
            if only:
                return {limit} & self._todo
            return {s for s in self._todo if s <= limit}

        with self._cv:
            self._cv.wait_for(
                lambda: self._fatal is not None or (self._reconciled and not waiting()),
                timeout=timeout_s,
            )
            failed = sorted(
                s
                for s in self._failed.keys() - failed_before
                if s == limit or (not only and s <= limit)
            )
            if step is not None and step in self._failed:
                failed = [step]
            if failed:
                raise self._failed[failed[0]]
            if not self._reconciled or waiting():
                if self._fatal is not None:
                    raise CheckpointError(
                        f"replication to {self._slow_storage.url('')} stopped: {self._fatal}"
                    )
                return False
            known = step is None or step in self._replicated
        if not known and not self._is_on_slow(step):  # type: ignore[arg-type]
            raise CheckpointNotFoundError(
                f"step {step} was never committed on {self.fast.root}, so it is not being "
                "replicated"
            )
        return True

    def _is_on_slow(self, step: int) -> bool:
        try:
            catalog.load_checkpoint(self._slow_storage, step)
        except CheckpointError:
            return False
        return True

    def replication_backlog(self) -> list[int]:
        """The steps committed on tier 0 and not yet on the persistent tier (before the
        persistent tier was first reached: every step tier 0 holds)."""
        with self._cv:
            todo, reconciled = set(self._todo), self._reconciled
        if not reconciled:
            todo |= {
                m.step
                for m in catalog.committed(self._fast_storage, run_id=self.run_id, warn=False)
            }
        return sorted(todo)

    # ------------------------------------------------------------------ discovery
    def _slow_reader(self) -> CheckpointManager:
        # A separate read-only manager (its own storage client): restore and listing
        # never wait for, or share state with, the replicator's copy in flight.
        if self._reader is None:
            slow = self.tiers[1]
            store = (
                slow.root
                if not isinstance(slow.root, (str, os.PathLike))
                else open_storage(slow.root, slow.storage_options)
            )
            self._reader = CheckpointManager(
                store,
                read_only=True,
                run_id=self.run_id,
                coordinator=SingleProcessCoordinator(),
                timeout_s=self.timeout_s,
                allow_pickle=self.allow_pickle,
                storage_domains="shared",
            )
        return self._reader

    def _tier_lists(self) -> tuple[list[CheckpointInfo], list[CheckpointInfo] | None]:
        fast = self.fast.checkpoints()
        try:
            slow: list[CheckpointInfo] | None = self._slow_reader().checkpoints()
        except (StorageError, CommitError) as exc:
            if not fast:
                raise
            log.warning(
                "persistent tier %s cannot be listed (%s): showing tier 0 only",
                self._slow_storage.url(""),
                exc,
            )
            slow = None
        return fast, slow

    def checkpoints(self) -> list[TieredCheckpointInfo]:
        """Every step valid on some tier, ascending, each with the tiers that hold it
        (``tiers``); the info is the fastest holder's."""
        fast, slow = self._tier_lists()
        by_step: dict[int, tuple[CheckpointInfo, list[int]]] = {}
        for tier, infos in ((0, fast), (1, slow or [])):
            for info in infos:
                _first, held = by_step.setdefault(info.step, (info, []))
                held.append(tier)
        return [_tiered(info, tuple(held)) for _step, (info, held) in sorted(by_step.items())]

    def latest(self) -> TieredCheckpointInfo | None:
        """The newest step valid on some tier (presence and sizes checked, as
        ``CheckpointManager.latest``), with the tiers that hold it."""
        found = [(0, self.fast.latest())]
        try:
            found.append((1, self._slow_reader().latest()))
        except (StorageError, CommitError) as exc:
            if found[0][1] is None:
                raise
            log.warning(
                "persistent tier %s cannot be read (%s): answering from tier 0",
                self._slow_storage.url(""),
                exc,
            )
        infos = [(t, i) for t, i in found if i is not None]
        if not infos:
            return None
        newest = max(i.step for _, i in infos)
        holders = [(t, i) for t, i in infos if i.step == newest]
        return _tiered(holders[0][1], tuple(t for t, _ in holders))

    def restore(self, step: int | None = None, **kwargs: Any) -> Any:
        """Load checkpoint ``step`` (default: the newest that verifies on some tier) from
        the fastest tier whose copy verifies: tier 0, else the persistent tier.
        ``CheckpointManager.restore``'s keyword arguments apply (``into``, ``verify``...).

        A copy that fails its checksums is skipped with a warning; the next tier's copy
        of the same step is tried before any older step.

        Raises:
            CheckpointNotFoundError: no tier holds a checkpoint (of ``step``).
            CorruptCheckpointError: no copy (of ``step``) verifies.
        """
        candidates: list[tuple[int, tuple[int, ...]]]
        if step is not None:
            candidates = [(validate_step(step), (0, 1))]
        else:
            candidates = [(c.step, c.tiers) for c in reversed(self.checkpoints())]
            if not candidates:
                raise CheckpointNotFoundError(
                    f"no valid checkpoint of run {self.run_id!r} on {self.fast.root} or "
                    f"{self._slow_storage.url('')}"
                )
        skipped: list[str] = []
        missing: list[str] = []
        unreachable: StorageError | None = None
        for s, tiers in candidates:
            for tier in tiers:
                try:
                    mgr = self.fast if tier == 0 else self._slow_reader()
                    state = mgr.restore(step=s, **kwargs)
                except CheckpointNotFoundError as exc:
                    missing.append(f"tier {tier}: {exc}")
                    continue
                except CorruptCheckpointError as exc:
                    log.warning(
                        "restore: step %d on tier %d does not verify: %s; trying the next copy",
                        s,
                        tier,
                        exc,
                    )
                    skipped.append(f"step {s} on tier {tier}: {exc}")
                    continue
                except StorageError as exc:
                    if tier == 0:
                        raise  # the local tier failing is not a reason to look elsewhere
                    unreachable = exc
                    continue
                info = mgr.last_restored
                if info is not None:
                    self.last_restored = _tiered(info, (tier,))
                return state
        if skipped:
            raise CorruptCheckpointError(
                "no copy verifies: " + "; ".join(skipped) + ". `atomic-checkpoint verify` "
                "on each tier root lists every problem"
            )
        if unreachable is not None:
            raise unreachable  # "not found" would be a claim nobody could check
        raise CheckpointNotFoundError(
            f"no checkpoint step {step} of run {self.run_id!r} on any tier: " + "; ".join(missing)
        )

    # ------------------------------------------------------------------ closing
    def close(self, timeout_s: float | None = None) -> list[int]:
        """Close tier 0 (finishing its async save), drain replication for up to
        ``timeout_s`` (default: the manager's ``timeout_s``), then stop the replicator
        and close tier 1. Idempotent.

        Returns:
            The steps that did not reach the persistent tier (empty when drained). They
            stay on tier 0 and are replicated at the next start on the same tier 0.
        """
        if self._closed:
            return []
        self._closed = True
        error: BaseException | None = None
        try:
            self.fast.close()
        except BaseException as exc:  # raised below, after the replicator has stopped
            error = exc
        self._drain(self.timeout_s if timeout_s is None else timeout_s)
        with self._cv:
            self._stop.set()
            self._cv.notify_all()
        self._thread.join()
        self._drop_persistent()
        if self._reader is not None:
            self._reader.close()
        left = self.replication_backlog()
        if left:
            log.warning(
                "closed with steps %s not replicated to %s (%s); they stay on %s and "
                "are replicated when a TieredCheckpointManager opens these tiers again",
                left,
                self._slow_storage.url(""),
                self._last_error or self._fatal or "time ran out",
                self.fast.root,
            )
        if error is not None:
            raise error
        return left

    def _drain(self, timeout_s: float | None) -> None:
        with self._cv:
            self._cv.wait_for(
                lambda: (self._reconciled and not self._todo) or self._fatal is not None,
                timeout=timeout_s,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this TieredCheckpointManager is closed")

    def __enter__(self) -> TieredCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TieredCheckpointManager({self.fast.root!r} -> {self._slow_storage.url('')!r}, "
            f"run_id={self.run_id!r})"
        )


def _stop_at_exit(ref: weakref.ref[TieredCheckpointManager], pid: int) -> None:
    """Interpreter exit without ``close()``: stop the replicator (an attempt in flight is
    discarded, never half committed), bounded, without draining."""
    mgr = ref()
    if mgr is None or mgr._closed or os.getpid() != pid:
        return
    mgr._stop.set()
    with mgr._cv:
        mgr._cv.notify_all()
    mgr._thread.join(timeout=30.0)
    left = mgr.replication_backlog()
    if left:
        log.warning(
            "interpreter exit: steps %s not replicated to %s; they stay on %s and are "
            "replicated when a TieredCheckpointManager opens these tiers again",
            left,
            mgr._slow_storage.url(""),
            mgr.fast.root,
        )


def _open(tier: Tier) -> Storage:
    if isinstance(tier.root, (str, os.PathLike)):
        return open_storage(tier.root, tier.storage_options)
    return tier.root


def _recorded_run_id(storage: Storage) -> str | None:
    """The run id in a root's run file, or None (no run file, or an unreadable one: the
    manager that opens the root then says what is wrong)."""
    try:
        doc = json.loads(storage.read_bytes(RUN_FILE))
    except CheckpointNotFoundError:
        return None
    except (CheckpointError, ValueError, RecursionError):
        return None
    rid = doc.get("run_id") if isinstance(doc, dict) else None
    return rid if isinstance(rid, str) and rid else None


def _newest_run_id(storage: Storage) -> str | None:
    """The run of the newest checkpoint in a root without a run file (the persistent
    tier: its manager is opened with tier 0's run id and records none)."""
    newest = catalog.newest(storage, run_id=None, warn=False)
    return None if newest is None else newest.run_id


def _plain_path(path: str) -> str:
    """A file's path without the marker strategy's ``attempt-<token>/`` prefix: the
    destination's strategy adds its own."""
    head, sep, rest = path.partition("/")
    if sep and catalog.parse_attempt_dir(head) is not None:
        return rest
    return path


def _same_content(a: Manifest, b: Manifest) -> bool:
    def files(m: Manifest) -> set[tuple[str, int, str]]:
        return {(_plain_path(f.path), f.size_bytes, f.checksum) for f in m.files}

    return a.state_kind == b.state_kind and files(a) == files(b)


def _tiered(info: CheckpointInfo, tiers: tuple[int, ...]) -> TieredCheckpointInfo:
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(CheckpointInfo)}
    return TieredCheckpointInfo(**fields, tiers=tiers)
