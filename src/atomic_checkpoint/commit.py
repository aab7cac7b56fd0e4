"""THE commit protocol: how a save becomes a checkpoint, on every rank.

Rename strategy (POSIX filesystems; DESIGN "The save protocol")::

    before commit                                  after commit
    ROOT/                                          ROOT/
      checkpoint-100/   (previous, untouched)        checkpoint-100/
      .pending/                                      checkpoint-200/
        checkpoint-200.<attempt>/                      checkpoint.manifest.json
          rank-00000.safetensors                       rank-00000.safetensors
          rank-00001.safetensors                       rank-00001.safetensors
          checkpoint.manifest.json  (written last)   .pending/   (empty)

1. The coordinator creates ``.pending/checkpoint-<step>.<attempt>`` (a sibling of the
   final name, so the rename never crosses filesystems: FAILURE_MODES D5) and
   broadcasts its name. Every decision that drives a collective is made here, once.
2. Every rank writes only its own files there, checksumming while writing, and fsyncs
   them.
3. Ranks send their file lists (names, sizes, checksums) to the coordinator; any
   failure is shared, and every rank raises the same error.
4. The coordinator checks presence and sizes (waiting, bounded, on network
   filesystems), writes the manifest, fsyncs it and the pending directory.
5. The coordinator renames pending to ``checkpoint-<step>`` (never replacing anything)
   and fsyncs ROOT.
6. The coordinator checks its fencing token; retention runs after the commit is
   durable, off the training thread (see ``manager``).
7. The result is broadcast; every rank returns the same ``CheckpointInfo``.

Marker strategy (object stores, FUSE mounts whose rename is copy+delete): files are
written in place under ``checkpoint-<step>/`` and the manifest, created once, is the
commit. See ``MarkerStrategy``.

Three fsyncs beyond the data: the manifest, the checkpoint directory (covers the
entries of every rank's files, which sit next to the manifest), and ROOT after the
rename.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._faults import fault_point
from ._version import __version__
from .catalog import read_manifest
from .coordination import Coordinator
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    RankFailure,
)
from .layout import (
    MANIFEST_NAME,
    PENDING_DIR,
    TRASH_DIR,
    checkpoint_name,
    new_attempt_token,
    pending_name,
)
from .manifest import FileEntry, Manifest
from .storage.base import Storage

log = logging.getLogger("atomic_checkpoint")
_T = TypeVar("_T")


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the coordinator after writing."""

    files: tuple[FileEntry, ...]
    write_s: float
    fsync_s: float
    seen_sizes: Mapping[str, int] = field(default_factory=dict)


class RenameStrategy:
    """Stage in ``.pending/``, commit by one atomic directory rename."""

    name = "rename"

    def pending_location(self, step: int, attempt: str) -> str:
        return f"{PENDING_DIR}/{pending_name(step, attempt)}"

    def prepare(self, storage: Storage, step: int, attempt: str) -> str:
        pending = self.pending_location(step, attempt)
        storage.makedirs(pending)
        # The pending entry must be durable before ranks write into it, or a crash
        # could leave their files in a directory that never existed.
        storage.fsync_dir(PENDING_DIR)
        return pending

    def publish(
        self, storage: Storage, pending: str, manifest: Manifest, *, rank: int, overwrite: bool
    ) -> None:
        final = checkpoint_name(manifest.step)
        w = storage.open_write(f"{pending}/{MANIFEST_NAME}")
        try:
            w.write(manifest.to_json_bytes())
            w.close()
        except BaseException:
            w.abort()
            raise
        storage.fsync_dir(pending)
        fault_point("after_manifest", rank, manifest.step)
        try:
            storage.rename_dir(pending, final)
        except CheckpointExistsError:
            if not overwrite:
                raise
            self._replace(storage, pending, final, rank=rank, step=manifest.step)
            return
        fault_point("after_rename", rank, manifest.step)
        try:
            storage.fsync_dir("")
        except CheckpointError:
            # The rename may not survive a crash, and every rank is about to be told the
            # save failed: take it back out of the namespace so no reader builds on it.
            try:
                storage.rename_dir(final, pending)
            except CheckpointError as exc:
                log.warning(
                    "checkpoint step %d could not be un-committed after a failed "
                    "fsync of the root: %s",
                    manifest.step,
                    exc,
                )
            raise

    def _replace(self, storage: Storage, pending: str, final: str, *, rank: int, step: int) -> None:
        """Overwrite a committed step: the new one is committed before the old one goes."""
        if storage.exchange_dirs(pending, final):
            # One atomic swap (renameat2 RENAME_EXCHANGE): readers see old or new.
            fault_point("after_rename", rank, step)
            storage.fsync_dir("")
            storage.delete_tree(pending)  # now holds the old checkpoint
            return
        # No atomic exchange (sshfs, Windows): un-commit the old one by moving it out
        # of the namespace, then rename the new one in. A crash between the two renames
        # leaves step `step` absent, with both copies recoverable (old in .trash, new
        # complete in .pending).
        storage.makedirs(TRASH_DIR)
        trash = f"{TRASH_DIR}/{final}.{new_attempt_token()}"
        storage.rename_dir(final, trash)
        storage.rename_dir(pending, final)
        fault_point("after_rename", rank, step)
        storage.fsync_dir("")
        storage.delete_tree(trash)

    def discard(self, storage: Storage, pending: str) -> None:
        storage.delete_tree(pending)


@dataclass
class SaveContext:
    """Everything a save needs, fixed for the life of a manager."""

    storage: Storage
    coord: Coordinator
    run_id: str
    timeout_s: float
    strategy: RenameStrategy
    fence: Callable[[], None] = lambda: None
    next_commit_seq: Callable[[], int] = lambda: 0
    visibility_timeout_s: float = 30.0

    @property
    def is_coordinator(self) -> bool:
        return self.coord.rank == 0


def _failure(exc: BaseException, rank: int, phase: str) -> RankFailure:
    return RankFailure(rank, phase, type(exc).__name__, str(exc) or repr(exc))


class _Aborted(Exception):
    """Internal: a phase failed somewhere; carries the error to raise on this rank."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def run_phase(ctx: SaveContext, step: int, phase: str, fn: Callable[[], _T] | None) -> list[_T]:
    """Run ``fn`` on this rank (None: nothing to do here), then share the outcome.

    Returns every rank's result, indexed by rank. If any rank failed, every rank raises
    the same ``DistributedCheckpointError`` (with one rank, the original error).
    """
    value: Any = None
    error: BaseException | None = None
    if fn is not None:
        try:
            value = fn()
        except Exception as exc:  # every failure is shared, never swallowed
            error = exc
    if ctx.coord.world_size == 1:
        if error is not None:
            raise _Aborted(error)
        return [value]
    payload = (value, None if error is None else _failure(error, ctx.coord.rank, phase))
    try:
        what = f"save step {step}: {phase}" if step >= 0 else phase
        outcomes = ctx.coord.all_gather(what, payload, timeout_s=ctx.timeout_s)
    except CoordinationTimeoutError as exc:
        raise _Aborted(exc) from exc
    failures = [f for _, f in outcomes if f is not None]
    if failures:
        if len(failures) == 1 and failures[0].error_type == "CheckpointExistsError":
            raise _Aborted(CheckpointExistsError(failures[0].message))
        raise _Aborted(DistributedCheckpointError(failures, step=step))
    return [v for v, _ in outcomes]


def save(
    ctx: SaveContext,
    step: int,
    write_rank_files: Callable[[str], RankReport],
    *,
    state_kind: str,
    metrics: Mapping[str, float],
    metadata: Mapping[str, Any],
    overwrite: bool,
    check_input: Callable[[], None] | None = None,
) -> tuple[Manifest, dict[str, float]]:
    """Run the seven steps. Called by every rank with its own ``write_rank_files``.

    ``write_rank_files(pending)`` writes this rank's files under ``pending`` (a storage
    path), fsyncs them, and reports them. ``check_input()`` runs on every rank in the
    first phase, so bad input on one rank fails every rank before anything is written.

    Returns:
        The committed manifest and the per-phase timings, identical on every rank.

    Raises:
        CheckpointExistsError: ``step`` is committed and ``overwrite`` is False.
        DistributedCheckpointError: a rank failed (several ranks).
        CoordinationTimeoutError: a rank did not arrive in time.
        CheckpointError: the failing rank's error (one rank).
    """
    storage, coord = ctx.storage, ctx.coord
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pending: str | None = None
    committed: Any = None
    try:
        # 1. prepare: one decision, broadcast.
        def prepare() -> str | None:
            if check_input is not None:
                check_input()
            if not ctx.is_coordinator:
                return None
            nonlocal pending
            ctx.fence()
            if not overwrite:
                _check_not_committed(storage, step)
            attempt = new_attempt_token()
            # Known before it exists, so a failure on any rank discards it.
            pending = ctx.strategy.pending_location(step, attempt)
            return ctx.strategy.prepare(storage, step, attempt)

        pending = run_phase(ctx, step, "prepare", prepare)[0]
        if pending is None:  # the coordinator either returned it or raised
            raise CommitError(f"step {step}: the coordinator sent no pending location")
        staged: str = pending
        timings["prepare"] = time.perf_counter() - t0

        # 2-3. write, then gather file lists.
        t = time.perf_counter()

        def write() -> RankReport:
            fault_point("before_write", coord.rank, step)
            report = write_rank_files(staged)
            fault_point("after_write", coord.rank, step)
            return report

        reports = run_phase(ctx, step, "write", write)
        timings["write"] = max(r.write_s for r in reports)
        timings["fsync"] = max(r.fsync_s for r in reports)
        timings["gather"] = time.perf_counter() - t - timings["write"] - timings["fsync"]

        # 4-5. the coordinator commits.
        t = time.perf_counter()

        def commit() -> Manifest:
            files = _merge(reports)
            _await_files(storage, staged, files, ctx.visibility_timeout_s)
            ctx.fence()
            manifest = Manifest(
                step=step,
                run_id=ctx.run_id,
                commit_seq=ctx.next_commit_seq(),
                world_size=coord.world_size,
                files=files,
                state_kind=state_kind,
                metrics=dict(metrics),
                metadata=dict(metadata),
                strategy=ctx.strategy.name,
                library_version=__version__,
            )
            ctx.strategy.publish(storage, staged, manifest, rank=coord.rank, overwrite=overwrite)
            fault_point("during_broadcast", coord.rank, step)
            return manifest

        def await_result() -> None:
            fault_point("during_broadcast", coord.rank, step)

        committed = run_phase(ctx, step, "commit", commit if ctx.is_coordinator else await_result)[
            0
        ]
        timings["commit"] = time.perf_counter() - t
    except _Aborted as aborted:
        if pending is not None and ctx.is_coordinator and not _is_committed(ctx, step, pending):
            _discard(ctx, pending, step)
        raise aborted.error from None
    except BaseException:
        # KeyboardInterrupt/SystemExit on the coordinator: leave no half-written pending
        # data behind if we can help it; the next start sweeps whatever remains.
        if pending is not None and ctx.is_coordinator:
            _discard(ctx, pending, step)
        raise
    if not ctx.is_coordinator and not storage.capabilities.coherent:
        _await_committed(storage, step, ctx.visibility_timeout_s)
    timings["total"] = time.perf_counter() - t0
    return committed, timings


def _is_committed(ctx: SaveContext, step: int, pending: str) -> bool:
    """After a failure: did our own commit land anyway (e.g. the coordinator renamed,
    then a peer timed out)? Then the pending name no longer exists and nothing is
    discarded."""
    return not ctx.storage.is_dir(pending)


def _check_not_committed(storage: Storage, step: int) -> None:
    name = checkpoint_name(step)
    try:
        read_manifest(storage, name)
    except CheckpointNotFoundError:
        if storage.is_dir(name) and storage.listdir(name):
            raise CommitError(
                f"{storage.url(name)} exists but is not a committed checkpoint (no manifest): "
                "it was not written by atomic-checkpoint, or by an incomplete in-place save. "
                "Move it away, or pass overwrite=True to replace it"
            ) from None
        return
    except CorruptCheckpointError:
        pass
    raise CheckpointExistsError(
        f"checkpoint step {step} is already committed at {storage.url(name)}; pass "
        "overwrite=True to replace it atomically, or save under a new step"
    )


def _merge(reports: Sequence[RankReport]) -> tuple[FileEntry, ...]:
    seen: dict[str, FileEntry] = {}
    for r in reports:
        for f in r.files:
            other = seen.get(f.path)
            if other is not None and (other.size_bytes, other.checksum) != (
                f.size_bytes,
                f.checksum,
            ):
                raise CommitError(
                    f"ranks {other.rank} and {f.rank} both wrote {f.path!r} with different "
                    "content; each rank must write only its own files"
                )
            seen.setdefault(f.path, f)
    return tuple(sorted(seen.values(), key=lambda f: f.path))


def _await_files(
    storage: Storage, pending: str, files: Sequence[FileEntry], timeout_s: float
) -> None:
    """Wait until every reported file is visible here with its reported size.

    Network filesystems can show another client's new file late, or with a stale size
    (even 0 on sshfs), so we poll with a bound instead of failing at the first stat.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        wrong = []
        for f in files:
            size = storage.size(f"{pending}/{f.path}")
            if size != f.size_bytes:
                wrong.append((f, size))
        if not wrong:
            return
        if time.monotonic() >= deadline:
            f, size = wrong[0]
            raise CommitError(
                f"{len(wrong)} file(s) written by the ranks are not visible to the "
                f"coordinator after {timeout_s:g} s, e.g. {f.path!r} from rank {f.rank}: "
                f"expected {f.size_bytes} bytes, seen {size}"
            )
        storage.refresh(pending)
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _await_committed(storage: Storage, step: int, timeout_s: float) -> None:
    """Non-coordinators on a network filesystem: wait until the commit is visible."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            read_manifest(storage, checkpoint_name(step))
            return
        except CheckpointNotFoundError:
            if time.monotonic() >= deadline:
                raise CommitError(
                    f"checkpoint step {step} was committed but is not visible from this rank "
                    f"after {timeout_s:g} s: {storage.url(checkpoint_name(step))}"
                ) from None
        storage.refresh("")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _discard(ctx: SaveContext, pending: str, step: int) -> None:
    try:
        ctx.strategy.discard(ctx.storage, pending)
    except CheckpointError as exc:
        # Best effort: the next start's sweep removes it. Say what was left.
        log.warning(
            "could not remove pending data of step %d at %s: %s (the next start will remove it)",
            step,
            ctx.storage.url(pending),
            exc,
        )
