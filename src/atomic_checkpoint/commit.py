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

The steps, as three calls every rank makes in order (the manager writes its files
between the first two)::

    pending = begin(ctx, step, overwrite=..., problem=...)       # step 1
    written = attempt("write", lambda: write(pending.location))  # step 2, this rank
    done = finish(ctx, pending, written, commit_seq=..., ...)    # steps 3-7
    # on an interruption between them: abort(ctx, pending)

1. ``begin``: the domain leader checks its fencing token and whether the step is
   taken, creates ``.pending/checkpoint-<step>.<attempt>`` (a sibling of the final
   name, so the rename never crosses filesystems: FAILURE_MODES D5), and every rank
   learns its name. Every decision that drives a collective is made here, once.
2. Every rank writes only its own files there, checksumming while writing, and fsyncs
   them (``rankfiles``).
3. ``finish``: every rank sends its step and file list (names, sizes, checksums) or
   its failure to the leader, which answers every rank with one summary: any failure
   or differing step is shared, and every rank raises the same error.
4. The leader checks presence and sizes (waiting, bounded, on network filesystems),
   writes the manifest, fsyncs it and the pending directory.
5. The leader renames pending to ``checkpoint-<step>`` (never replacing anything) and
   fsyncs ROOT.
6. Before it writes the manifest, the leader checks its fencing token again (and an
   async save's cancel flag): a job that lost the run lock never commits. Retention
   runs after the commit is durable, off the training thread (see ``manager``).
7. The result is published; every rank returns the same ``Committed``.

With one storage domain each round goes through the leader (``_decide``: one key that
every rank reads; ``coordination.gather_routed``: the leader reads every report and
answers one summary), O(N) store requests and bytes for N ranks. With several domains
the first leader collects every round, sends each leader its members' reports and
each rank its own leader's answer, and answers everyone one summary (whether the step
exists in every domain; the steps every domain holds): O(N) too. Nothing here calls back into the
manager: what it decides (the input check, the commit number, the lock to check) comes
in as values, and what it needs afterwards (each domain's committed steps) goes out in
``Committed``.

Three fsyncs beyond the data: the manifest, the checkpoint directory (covers the
entries of every rank's files, which sit next to the manifest), and ROOT after the
rename.

The storage work of steps 1 and 4-5, and of a failure's clean-up, is the commit strategy's
(``strategies``): the rename strategy drawn above, or the marker strategy (object
stores, FUSE mounts whose rename is copy+delete), which writes in place under
``checkpoint-<step>/`` and commits by creating the manifest once. Overwrites and what
each strategy leaves after a crash are described there.

What the steps call below this module: ``catalog.step_taken`` (step 1: is the step
taken, and by what), ``rankfiles`` (step 2, and ``merge_reports`` for the manifest),
``storage.visibility`` (network filesystems: the bounded waits for another client's
change), ``coordination`` (the rounds) and the strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from . import errors
from ._faults import fault_point
from ._version import __version__
from .catalog import await_readable, exists_error, failed_validation, read_manifest, step_taken
from .catalog import committed as committed_manifests
from .coordination import (
    Coordinator,
    gather_routed,
    rank_failure,
    run_on_leaders,
    shared_error,
)
from .domains import Domain
from .layout import checkpoint_name, new_attempt_token
from .manifest import FileEntry, Manifest, SharedManifest
from .rankfiles import RankReport, merge_reports, report_files
from .storage import visibility
from .storage.base import Storage, full_storage_error
from .strategies import CommitStrategy

log = logging.getLogger("atomic_checkpoint")
_T = TypeVar("_T")


@dataclass(frozen=True)
class SaveContext:
    """Everything a save needs, fixed for the life of a manager."""

    storage: Storage
    coord: Coordinator
    run_id: str
    timeout_s: float
    strategy: CommitStrategy
    visibility_timeout_s: float = 30.0
    domain: Domain | None = None
    #: The run lock (``lock.RunLock``): the domain leader checks it before it creates
    #: the pending location and right before it commits, so a job that lost the lock
    #: commits nothing (DESIGN invariant 7). None: no lock (other ranks, read-only).
    lock: Any = None
    #: Set when an async save is abandoned (``close()`` past ``timeout_s``): checked
    #: with the lock, so an abandoned save is never committed.
    cancel: threading.Event | None = None

    @property
    def leader(self) -> int:
        """The rank that commits for this rank's storage domain."""
        return 0 if self.domain is None else self.domain.leader

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that commits, rotates and cleans this storage domain."""
        return self.coord.rank == self.leader

    @property
    def members(self) -> tuple[int, ...]:
        if self.domain is None:
            return tuple(range(self.coord.world_size))
        return self.domain.members

    @property
    def leaders(self) -> tuple[int, ...]:
        return (0,) if self.domain is None else self.domain.leaders


@dataclass
class Pending:
    """One save on one rank between ``begin`` and ``finish``: where to write."""

    step: int
    #: Where this rank writes its files: a storage path under ROOT, the same on every
    #: rank of a storage domain.
    location: str
    #: False when this rank must not write: it was asked another step than its
    #: leader, or something failed here already (``finish`` shares it).
    writes: bool
    #: Whether the commit replaces a committed copy (``overwrite``, or the remains of a
    #: save committed in some storage domains only).
    replace: bool
    #: This rank's failure before its write: ``(phase, error)``, shared by ``finish``.
    problem: tuple[str, Exception] | None
    started: float
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    #: On the leader: the location it created, until it is committed or removed.
    owned: str | None = None
    committed: bool = False
    #: What this rank passed as ``overwrite``: every rank must pass the same.
    overwrite: bool = False


@dataclass(frozen=True)
class Failed:
    """What a rank's write produced instead of a ``RankReport``: shared by ``finish``."""

    phase: str
    error: Exception


@dataclass(frozen=True)
class Committed:
    """The outcome of ``finish``, identical on every rank of a storage domain."""

    #: The committed manifest (on other ranks than the leader: a ``SharedManifest``,
    #: the same manifest without its file list).
    manifest: Manifest
    #: Seconds per step: prepare, write, fsync, gather, commit, publish, total.
    timings: dict[str, float]
    #: Several storage domains, on a domain leader: (the steps committed in every
    #: domain, this domain's committed steps) after this commit, each as
    #: ``[(step, metrics, created_unix)]`` (retention decides from them); else None.
    domain_views: tuple[list[Any], list[Any]] | None = None


def begin(
    ctx: SaveContext, step: int, *, overwrite: bool = False, problem: Exception | None = None
) -> Pending:
    """Step 1, collective: the domain leader checks the fence and whether ``step`` is
    taken, creates the pending location, and every rank learns where to write.

    ``problem`` is this rank's bad input, found before anything is written (an
    unsupported object in the state): it fails the save on every rank. A leader's
    problem stops it before it creates anything; another rank's travels with its
    write report (``finish``), so this step costs one key per rank.

    Raises, on every rank alike: ``CheckpointExistsError`` (``step`` is committed and
    ``overwrite`` is False), ``FencedError`` (this job lost the run lock),
    ``CoordinationTimeoutError`` (the leader did not answer), or the shared error of a
    failed leader (``DistributedCheckpointError``; with one rank, its own error).
    """
    pending = Pending(step, "", False, overwrite, None, time.perf_counter(), overwrite=overwrite)
    mine = problem if ctx.is_coordinator else None

    def prepare() -> tuple[int, str, bool, bool]:
        if mine is not None:
            raise mine
        attempt = new_attempt_token()
        # Known before it exists, so a failure from here on discards it.
        pending.owned = ctx.strategy.pending_location(step, attempt)
        _fence(ctx, step)
        exists = step_taken(
            ctx.storage,
            step,
            overwrite=overwrite,
            run_id=ctx.run_id,
            renames=not ctx.strategy.writes_in_place,
        )
        replace = overwrite
        if exists and not overwrite and len(ctx.leaders) == 1:
            torn = failed_validation(ctx.storage, step)
            if torn is None:
                raise exists_error(ctx.storage, step)
            log.warning("saving step %d replaces it: %s (a resume skips it)", step, torn)
            replace = True
        return step, ctx.strategy.prepare(ctx.storage, step, attempt), exists, replace

    with _aborting(ctx, pending):
        decided, exists_everywhere = _decide(
            ctx, pending, "prepare", prepare, combine=lambda got: all(d[2] for d in got)
        )
    leader_step, pending.location, exists, leader_overwrite = decided
    # The leader's overwrite decides here, so every rank takes the same way; a rank
    # that passed another one fails the save on every rank in ``finish``. (A rank that
    # raised here alone left its leader waiting for its report until timeout_s.)
    if exists_everywhere and not leader_overwrite:
        # Committed in every domain (several domains: each leader only said so).
        abort(ctx, pending)
        raise exists_error(ctx.storage, step)
    # Committed in some domains only: the leftover of a save that failed half way (a
    # node died between the domains' commits). It never counted as a checkpoint; it is
    # replaced.
    pending.replace = overwrite or exists
    if problem is not None and not ctx.is_coordinator:
        pending.problem = ("prepare", problem)
    elif leader_step == step:
        try:
            fault_point("before_write", ctx.coord.rank, step)
            if not ctx.is_coordinator and not ctx.storage.capabilities.coherent:
                visibility.await_dir(ctx.storage, pending.location, ctx.visibility_timeout_s)
            pending.writes = True
        except Exception as exc:  # shared by finish, never swallowed
            pending.problem = ("write", exc)
    pending.timings["prepare"] = time.perf_counter() - pending.started
    return pending


def attempt(
    phase: str,
    write: Callable[[], RankReport],
    *,
    ctx: SaveContext | None = None,
    pending: Pending | None = None,
) -> RankReport | Failed:
    """Step 2 on one rank: ``write()`` this rank's files into ``Pending.location``
    (fsync'd, with their checksums), or what failed, for ``finish`` to share. With
    ``ctx`` and ``pending``, a write that found no pending location says why that is."""
    try:
        return write()
    except Exception as exc:  # every failure is shared, never swallowed
        if ctx is not None and pending is not None:
            exc = _unseen_location(ctx, pending, exc)
            exc = full_storage_error(ctx.storage, exc) or exc
        return Failed(phase, exc)


def _unseen_location(ctx: SaveContext, pending: Pending, exc: Exception) -> Exception:
    """``exc``, or, when this rank (not its domain's leader) does not see the pending
    location its leader created, an error that says so: the ranks' roots are not one
    storage (each rank passed its own directory, or node-local disks on one host name
    were taken for a shared one). It read "create ... failed: No such file or
    directory", which said nothing of why."""
    if getattr(exc, "errno", None) != errno.ENOENT or ctx.coord.rank == ctx.leader:
        return exc
    try:
        if ctx.storage.is_dir(pending.location):
            return exc
    except errors.CheckpointError:
        return exc
    return errors.StorageError(
        f"{exc}. Rank {ctx.coord.rank} does not see {ctx.storage.url(pending.location)}, "
        f"which its storage domain's leader (rank {ctx.leader}) created: the ranks do not "
        "share one ROOT. Pass the same ROOT on every rank; for node-local disks, give "
        "each node its own host name (ATOMIC_CHECKPOINT_HOST) or pass "
        "storage_domains='per-host' (the README's storage table)",
        errno=errno.ENOENT,
        path=ctx.storage.url(pending.location),
    )


def finish(
    ctx: SaveContext,
    pending: Pending,
    written: RankReport | Failed | None,
    *,
    commit_seq: int = 0,
    state_kind: str,
    metrics: Mapping[str, float],
    metadata: Mapping[str, Any],
    scan: bool = False,
) -> Committed:
    """Steps 3-7, collective: every rank reports what it wrote (``written``: its
    report, its failure, or None if it wrote nothing); the leader checks that every
    file is visible with its size, writes the manifest, commits with the strategy and
    fsyncs; every rank returns the same outcome.

    ``scan``: files written by arbitrary code (``saving()``, DCP), which neither
    checksum nor fsync: the leader lists, checksums and fsyncs what is under the
    pending location (``rankfiles.report_files``) once EVERY rank has written (scanning
    when only its own writes are done would miss files others still write).
    ``commit_seq`` numbers the commit in the manifest (the caller's counter).

    On any failure the leader removes the pending location (unless it is committed)
    and every rank raises the same error.
    """
    storage, rank, step = ctx.storage, ctx.coord.rank, pending.step
    t = time.perf_counter()
    with _aborting(ctx, pending):
        if pending.writes and not isinstance(written, Failed):
            fault_point("after_write", rank, step)
        # 3. every rank's step and report, gathered on the leader; every rank gets
        # one summary (failures, differing steps), so that every rank names the same
        # failed or missing ranks within ``timeout_s``.
        failed = pending.problem
        if failed is None and isinstance(written, Failed):
            failed = (written.phase, written.error)
        report = written if pending.writes and isinstance(written, RankReport) else None
        call = (step, state_kind, pending.overwrite)
        sent: tuple[int, tuple[int, str, bool], RankReport | None] = (ctx.leader, call, report)

        _, (calls, write_s, fsync_s), reports = gather_routed(
            ctx.coord,
            _key(step, "write"),
            "write",
            lambda: sent,
            _write_summary,
            _reports_by_leader,
            dst=ctx.leaders[0],
            routed=ctx.is_coordinator,
            timeout_s=ctx.timeout_s,
            step=step,
            failed=failed,
        )
        if calls is not None:
            check_same_call(calls)
        timings = pending.timings
        timings["write"], timings["fsync"] = write_s, fsync_s
        timings["gather"] = time.perf_counter() - t  # this rank wrote before finish began

        # 4-6. the leader commits; 7. every rank gets the outcome.
        t = time.perf_counter()

        def commit() -> tuple[Manifest, Any, float]:
            done = _commit_on_leader(
                ctx,
                pending,
                [r for r in reports or () if r is not None],
                scan,
                commit_seq,
                state_kind,
                metrics,
                metadata,
            )
            pending.committed = True
            return done

        def settle(timeout: errors.CoordinationTimeoutError) -> Any:
            if ctx.is_coordinator:
                raise _committed_anyway(ctx, step, timeout) if pending.committed else timeout
            return _settle_outcome(ctx, step, pending.location, report, timeout)

        (manifest, view, timings["publish"]), common = _decide(
            ctx,
            pending,
            "commit",
            commit,
            share=lambda done: (SharedManifest.of(done[0]), done[1], done[2]),
            combine=lambda done: steps_everywhere([d[1] for d in done]) if len(done) > 1 else None,
            settle=settle,
        )
    views = (common, view) if len(ctx.leaders) > 1 and ctx.is_coordinator else None
    timings["commit"] = time.perf_counter() - t
    if not ctx.is_coordinator and not storage.capabilities.coherent:
        await_readable(storage, step, ctx.visibility_timeout_s)
    timings["total"] = time.perf_counter() - pending.started
    return Committed(manifest, timings, views)


def abort(ctx: SaveContext, pending: Pending) -> None:
    """On the leader: remove the pending location unless it was committed after all
    (a peer timed out after the rename). Idempotent; a no-op on other ranks. Best
    effort: what stays is removed by the next start's sweep."""
    location, pending.owned = pending.owned, None
    if location is None or pending.committed:
        return
    if not ctx.strategy.is_committed(ctx.storage, pending.step, location):
        _discard(ctx, location, pending.step)


# ---------------------------------------------------------------- the exchanges


@contextlib.contextmanager
def _aborting(ctx: SaveContext, pending: Pending) -> Iterator[None]:
    """On any failure inside (the one shared error, or an interruption): ``abort``,
    then raise it."""
    try:
        yield
    except BaseException as exc:
        if pending.committed and len(ctx.leaders) > 1 and _failed_everywhere(exc):
            _uncommit_domain(ctx, pending)
        abort(ctx, pending)
        raise


def _failed_everywhere(exc: BaseException) -> bool:
    """An error the ranks agreed on; not a timeout (some rank may have been told the
    save committed)."""
    return isinstance(exc, errors.CheckpointError) and not isinstance(
        exc, errors.CoordinationTimeoutError | errors.SaveAbandonedError
    )


def _uncommit_domain(ctx: SaveContext, pending: Pending) -> None:
    """A leader whose domain committed a step another domain failed: take it back, so
    that no reader of this domain (a node's uploader, ``verify``) takes a failed step."""
    where = ctx.storage.url(checkpoint_name(pending.step))
    try:
        fence = ctx.lock.check if ctx.lock is not None else None
        ctx.strategy.retire(ctx.storage, pending.step, rank=ctx.coord.rank, fence=fence)
        log.warning("step %d failed in another domain: %s taken back", pending.step, where)
    except errors.CheckpointError as exc:
        log.warning("step %d failed elsewhere; %s stays, uncounted: %s", pending.step, where, exc)


def _fence(ctx: SaveContext, step: int) -> None:
    if ctx.cancel is not None and ctx.cancel.is_set():
        raise errors.SaveAbandonedError(
            f"the async save of step {step} was abandoned; it is not committed"
        )
    if ctx.lock is not None:
        ctx.lock.check()


def _key(step: int, phase: str) -> str:
    """A round's name in errors and timeouts: the step and the protocol's step."""
    return f"save step {step}: {phase}"


def _through_leader(ctx: SaveContext) -> bool:
    """Whether a save's rounds go through its one leader rather than all-gathers:
    several ranks, one storage domain, a coordinator that can publish and gather.
    Each rank then reads one key per round instead of one per rank."""
    coord = ctx.coord
    return coord.world_size > 1 and len(ctx.leaders) == 1 and hasattr(coord, "publish")


def _decide(
    ctx: SaveContext,
    pending: Pending,
    phase: str,
    fn: Callable[[], _T],
    *,
    share: Callable[[_T], Any] = lambda result: result,
    combine: Callable[[list[_T]], Any] = lambda results: None,
    settle: Callable[[errors.CoordinationTimeoutError], Any] | None = None,
) -> tuple[_T, Any]:
    """Run ``fn`` on the domain leader(s), or every rank raises the same error. Returns
    this rank's leader's result (``share(result)`` on the other ranks: what they may
    receive) and ``combine`` of every leader's result, in the order of ``ctx.leaders``
    (computed once, the same on every rank).

    Through one leader (``_through_leader``), the leader publishes one key that every
    rank reads; a leader that failed removes what it created before it publishes the
    failure, so no rank returns while its pending data still exists. The commit's
    result reaches the others without its file list (``SharedManifest``): N ranks
    reading N entries each would put O(N^2) bytes through the store. ``settle`` decides
    what a timeout means (the commit may have happened). With several domains, the
    first leader collects every rank's outcome, answers every rank ``combine`` and
    sends each rank its own leader's shared result alone
    (``coordination.run_on_leaders``): O(N) bytes, as with one domain.
    """
    step, rank = pending.step, ctx.coord.rank
    if not _through_leader(ctx):
        return run_on_leaders(
            ctx.coord,
            _key(step, phase),
            phase,
            fn,
            leader=ctx.leader,
            leaders=ctx.leaders,
            timeout_s=ctx.timeout_s,
            step=step,
            pick=lambda result, _want: share(result),
            combine=combine,
            elsewhere=(
                (lambda: fault_point("during_broadcast", rank, step)) if phase == "commit" else None
            ),
        )
    # On the wire: ("ok", share(result), combine([result])) or ("error", the shared error).
    mine: Any = None
    verdict: Any = None
    if ctx.is_coordinator:
        try:
            mine = fn()
            verdict = ("ok", share(mine), combine([mine]))
        except Exception as exc:  # shared, never swallowed
            abort(ctx, pending)
            verdict = ("error", shared_error([rank_failure(exc, rank, phase)], step))
    elif phase == "commit":
        fault_point("during_broadcast", rank, step)
    publish: Callable[..., Any] = ctx.coord.publish  # type: ignore[attr-defined]
    try:
        verdict = publish(_key(step, phase), verdict, src=ctx.leader, timeout_s=ctx.timeout_s)
    except errors.CoordinationTimeoutError as exc:
        if settle is None:
            raise
        verdict = settle(exc)
    if verdict[0] == "error":
        raise verdict[1]
    return (mine if ctx.is_coordinator else verdict[1]), verdict[2]


def check_same_call(calls: Sequence[tuple[int, str, bool]]) -> None:
    """Abort the save on every rank unless every rank passed the same step, the same
    ``replicated`` (the state kind) and the same ``overwrite``: ``(step, kind,
    overwrite)`` by rank."""
    steps = [c[0] for c in calls]
    if len(set(steps)) > 1:
        by_rank = dict(enumerate(steps))
        raise errors.CommitError(
            f"the ranks were asked to save different steps ({by_rank}, by rank): every "
            "rank must save the same step (save(), saving() and the integrations' saves "
            "alike). Nothing was committed; compute "
            "the step once (e.g. on rank 0) and use it on every rank"
        )
    for what, index, shown in (
        ("replicated", 1, lambda kind: kind == "replicated"),
        ("overwrite", 2, bool),
    ):
        values = [c[index] for c in calls]
        if len(set(values)) > 1:
            by_rank = {r: shown(v) for r, v in enumerate(values)}
            raise errors.CommitError(
                f"the ranks passed different {what}= to the save of step {steps[0]} "
                f"({by_rank}, by rank): every rank must pass the same. Nothing was "
                "committed; the checkpoints already committed are unchanged"
            )


def _commit_on_leader(
    ctx: SaveContext,
    pending: Pending,
    reports: Sequence[RankReport],
    scan: bool,
    commit_seq: int,
    state_kind: str,
    metrics: Mapping[str, float],
    metadata: Mapping[str, Any],
) -> tuple[Manifest, Any, float]:
    """Steps 4-6 on the domain leader. Returns the manifest as written, the domain's
    committed steps (several domains only) and the time it took."""
    storage, staged, step = ctx.storage, pending.location, pending.step
    tc = time.perf_counter()
    scanned = [report_files(storage, staged, ctx.coord.rank)] if scan else []
    files = merge_reports(list(reports) + scanned)
    fence = functools.partial(_fence, ctx, step)
    _await_files(storage, staged, files, ctx.visibility_timeout_s, fence)
    fence()  # first: a job that lost the lock may have lost its files with it
    if not files and state_kind == "files" and len(ctx.leaders) == 1:
        # Committed, it would be the newest checkpoint, and retention would delete the
        # real ones for it (a save_pretrained() into another directory is enough).
        raise errors.CommitError(
            f"checkpoint step {step} holds no file: the saving() block wrote nothing "
            f"under {storage.url(staged)} (did it write to another directory?); nothing "
            "was committed and the previous checkpoints are intact"
        )
    manifest = Manifest(
        step=step,
        run_id=ctx.run_id,
        commit_seq=commit_seq,
        world_size=ctx.coord.world_size,
        files=files,
        domain_ranks=None if len(ctx.leaders) == 1 else ctx.members,
        domain_count=len(ctx.leaders),
        state_kind=state_kind,
        metrics=dict(metrics),
        metadata=dict(metadata),
        strategy=ctx.strategy.name,
        library_version=__version__,
    )
    # The manifest as written: the marker strategy lists files under their attempt.
    try:
        manifest = ctx.strategy.publish(
            storage, staged, manifest, rank=ctx.coord.rank, overwrite=pending.replace
        )
    except errors.CheckpointError as exc:
        # Its pending data gone between the fence above and the rename: another job
        # that took ROOT over swept it. Said as that (FencedError), not as a missing
        # path that a training loop would take for a step rotated away.
        if (
            isinstance(exc, errors.CheckpointNotFoundError)
            or getattr(exc, "errno", 0) == errno.ENOENT
        ):
            fence()
        raise
    if ctx.strategy.writes_in_place and ctx.lock is not None:
        # The commit is a request (a PUT), which a stalled network can hold past a
        # takeover, whose start swept this attempt's files: that save is not reported
        # committed (the new holder's next save of the step replaces the manifest).
        # The lock only: an async save asked to stop now has committed all the same.
        try:
            ctx.lock.check()
        except errors.FencedError as exc:
            raise errors.FencedError(
                f"{exc}. The manifest of step {step} landed after that (a request held in "
                "flight), with its files swept: it is listed as corrupt until the job "
                "holding ROOT saves that step again"
            ) from exc
    view = None
    if len(ctx.leaders) > 1:
        view = [
            (m.step, dict(m.metrics), m.created_unix)
            for m in committed_manifests(storage, run_id=ctx.run_id, warn=False)
        ]
    fault_point("during_broadcast", ctx.coord.rank, step)
    return manifest, view, time.perf_counter() - tc


def _write_summary(
    written: list[tuple[int, tuple[int, str, bool], RankReport | None]],
) -> tuple[Any, float, float]:
    """What every rank needs of the write round's reports (only the leaders get them):
    every rank's call ``(step, kind, overwrite)`` if they differ (else None), the
    slowest write and fsync."""
    calls = [w[1] for w in written]
    reports = [r for _, _, r in written if r is not None]
    return (
        calls if len(set(calls)) > 1 else None,
        max((r.write_s for r in reports), default=0.0),
        max((r.fsync_s for r in reports), default=0.0),
    )


def _reports_by_leader(
    written: list[tuple[int, tuple[int, str, bool], RankReport | None]],
) -> dict[int, list[RankReport | None]]:
    """The write round's reports, each domain's to its leader, in rank order."""
    out: dict[int, list[RankReport | None]] = {}
    for leader, _, report in written:
        out.setdefault(leader, []).append(report)
    return out


def steps_everywhere(
    views: Sequence[Sequence[tuple[int, dict[str, float], float]]],
) -> list[tuple[int, dict[str, float], float]]:
    """Several domains: of each domain's committed steps (``(step, metrics,
    created_unix)``), those committed in every domain, with domain 0's metrics and times
    (so every leader decides retention alike)."""
    common = set.intersection(*({s for s, _, _ in v} for v in views))
    return [entry for entry in views[0] if entry[0] in common]


def _settle_outcome(
    ctx: SaveContext,
    step: int,
    staged: str,
    mine: RankReport | None,
    timeout: errors.CoordinationTimeoutError,
) -> Any:
    """A rank other than the leader timed out waiting for the outcome of the commit. The
    commit may have happened, and the other ranks may have read a success: find out
    before reporting anything, so that every rank reports one outcome (DESIGN invariant
    11). First the published outcome itself (``Coordinator.settle``); if the store is
    out of reach, the storage: the committed manifest of this very attempt (this rank's
    files, with its checksums, from the staged location that is gone). Returns the
    verdict to act on, or raises."""
    settle = getattr(ctx.coord, "settle", None)
    found, value = ("unknown", None)
    if settle is not None:
        found, value = settle(timeout.key, src=ctx.leader, timeout_s=ctx.timeout_s)
    if found == "value":
        log.warning(
            "rank %d: the outcome of step %d came late (%s); it was published all the "
            "same, so this rank reports it like the others",
            ctx.coord.rank,
            step,
            timeout,
        )
        return value
    if found == "unknown":
        manifest = _own_commit(ctx, step, staged, mine)
        if manifest is not None:
            log.warning(
                "rank %d: the coordination store did not answer with the outcome of step "
                "%d (%s), but the checkpoint this save wrote is committed at %s: reporting "
                "success",
                ctx.coord.rank,
                step,
                timeout,
                ctx.storage.url(checkpoint_name(step)),
            )
            return ("ok", (manifest, None, 0.0), None)
    raise errors.CoordinationTimeoutError(
        f"{timeout} The leader may have committed checkpoint step {step} before the "
        "exchange failed: latest() or `atomic-checkpoint list` tells",
        missing_ranks=timeout.missing_ranks,
        key=timeout.key,
    ) from timeout


def _committed_anyway(
    ctx: SaveContext, step: int, timeout: errors.CoordinationTimeoutError
) -> errors.CoordinationTimeoutError:
    """The leader committed, then could not publish the outcome (a rank gave up waiting
    and marked the key): every rank raises, and this error says what is true."""
    return errors.CoordinationTimeoutError(
        f"{timeout}. Checkpoint step {step} was committed at "
        f"{ctx.storage.url(checkpoint_name(step))} before that (latest() lists it), but "
        "every rank reports this save as failed",
        missing_ranks=timeout.missing_ranks,
        key=timeout.key,
    )


def _own_commit(
    ctx: SaveContext, step: int, staged: str, mine: RankReport | None
) -> Manifest | None:
    """The committed manifest of step ``step`` if it is this attempt's: this run's, the
    staged location no longer pending (the strategy's own test), and this rank's files
    listed with the sizes and checksums this rank wrote. None otherwise, or if the
    storage cannot tell."""
    try:
        manifest = read_manifest(ctx.storage, checkpoint_name(step))
        if manifest.run_id != ctx.run_id or not ctx.strategy.is_committed(
            ctx.storage, step, staged
        ):
            return None
    except errors.CheckpointError:
        return None
    listed = {(f.path.rsplit("/", 1)[-1], f.size_bytes, f.checksum) for f in manifest.files}
    ours = {
        (f.path.rsplit("/", 1)[-1], f.size_bytes, f.checksum) for f in (mine.files if mine else ())
    }
    return manifest if ours and ours <= listed else None


def _await_files(
    storage: Storage,
    pending: str,
    files: Sequence[FileEntry],
    timeout_s: float,
    fence: Callable[[], None] | None = None,
) -> None:
    """Wait until every reported file is visible here with its reported size (network
    filesystems show another client's new file late, or with a stale size). ``fence``,
    while files are missing: a job whose run lock was taken over lost its pending files
    to the new job's start-up sweep, and raises ``FencedError`` rather than waiting
    ``timeout_s`` for files that will never come."""
    sizes = {f.path: f.size_bytes for f in files}
    wrong = visibility.await_sizes(storage, pending, sizes, timeout_s, fence)
    if wrong:
        f = next(f for f in files if f.path in wrong)
        raise errors.CommitError(
            f"{len(wrong)} file(s) written by the ranks are not visible to the "
            f"coordinator after {timeout_s:g} s, e.g. {f.path!r} from rank {f.rank}: "
            f"expected {f.size_bytes} bytes, seen {wrong[f.path]}"
        )


def _discard(ctx: SaveContext, pending: str, step: int) -> None:
    try:
        ctx.strategy.discard(ctx.storage, pending)
    except errors.CheckpointError as exc:
        # Best effort: the next start's sweep removes it. Say what was left.
        log.warning(
            "could not remove pending data of step %d at %s: %s (the next start will remove it)",
            step,
            ctx.storage.url(pending),
            exc,
        )
