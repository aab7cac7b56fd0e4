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

Replication of one step, on the replicator thread (single process; multi-rank jobs
below):

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

Step order spans both tiers. A start reads tier 1's newest step of the run; while tier
0 holds nothing as new (a wiped tier 0), a save at or below it raises
``StepOrderError`` (a resume would load tier 1's step, and tier 1 would never take the
lower one). ``rollback(step)`` goes back on both: the training thread asks the
replicator thread, which alone drives tier 1, to roll tier 1 back (a copy in flight is
discarded; multi-rank: an agreed round, rank 0 on tier 1, then each node leader drops
its peer copies above the step) and to forget the steps above it; only then is tier 0
rolled back. While it runs, a reading of tier 0 queues nothing above the step. A tier 1
that cannot be reached fails the call before anything is removed.

Multi-rank jobs (a ``torch.distributed`` process group, or ``coordinator=``): tier 0 is
node-local (each node its own disk under the same path, found by the storage-domain
probe of ``domains.py``, or ``fast_domains="per-host"``), so each node's leader commits
its node's copy of a step with the ordinary protocol: that copy's manifest lists its
own ranks' files only. Every rank runs a replicator thread; they move in lockstep
through a coordinator of their own (``Coordinator.clone()``: its own store connection
and keys, never the training's collectives), one agreed round per step, oldest first:

A. rank 0 (which alone opens tier 1, holds its run lock and runs its retention) picks
   the step and creates its pending location on tier 1, and broadcasts it;
B. each node's leader streams its node's files into that location, verified as read
   and read back on arrival, as above; every rank gathers every node's result;
C. rank 0 publishes one manifest (every rank's file, the checksums of the save,
   ``domain_count`` 1) only if every node's upload verified and every rank's file is
   there, else discards the attempt; it broadcasts the outcome (committed, failed: a
   corrupt tier 0 copy, never retried; or retry after a back-off), so every rank's
   ``wait_replicated``/``replication_backlog`` agree.

At start (and after tier 1 was unreachable) one round agrees what tier 1 lacks: the
steps every node committed on tier 0, newer than tier 1's newest. While a rank's part
of a round works on storage (rank 0's on tier 1, a leader's copy), every rank's
replicator meets the others every second (less often above 1,000 ranks) until every
part has ended: a slow or stalled tier 1 makes a slow round, whatever ``timeout_s``. A
rank that dies (or freezes) mid-round misses a meeting, so the others' round times out
(``timeout_s``): replication stops there and the steps stay held on tier 0 until the job
restarts. Each round begins with one exchange that also says whether any rank is
closing: the replicators stop together, between rounds, so a ``close()`` never leaves
another rank waiting in a round. ``latest()``,
``checkpoints()`` and ``restore()`` are collective: each rank says which steps it can
load from its own node's tier 0 copy, rank 0 says what tier 1 holds, and every rank
picks the newest step that every rank can load from some tier. Each rank then reads
its own file, from its node's copy, else from tier 1 (a node whose local tier was wiped
or replaced), and every rank learns every rank's outcome: all return that step, or
all move to an older one (a copy failed its checksums) or raise alike. ``save()``,
``save_async()`` and ``restore()`` are supported; ``saving()`` is single-process.

Peer replicas (``peers=K``, multi-node ``torch.distributed`` jobs): each node's files
of every step also go to the tier 0 of the next K nodes (ring order of the node
leaders), so a node's files survive the loss of up to K nodes before tier 1 has them.
The bytes travel point to point over a gloo group created at construction
(``new_group(backend="gloo")``, collectively, on every rank): a group of its own, so
the transfers never mix with the training's collectives and may run on the replicator
thread while the training thread runs those. The replicator threads run one agreed
peer round per step, before any tier 1 work, and also while a tier 1 round waits on a
slow or silent persistent tier (peer copies need no persistent tier):

P1. every node leader reads its committed tier 0 manifest of the step, and every rank
    gathers them (through the replicator's coordinator): the file list, sizes and
    checksums of the save;
P2. each leader streams its node's files to the next K leaders while it receives the
    previous K leaders' files, chunk by chunk (both sides know every size from P1, so a
    file the sender cannot read goes out as zeros and fails the receiver's checksums).
    The receiver writes them under ``.peers/node-<n>/.incoming-<token>/`` on its own
    tier 0, hashing every byte, fsyncs them and, only if every file matches the
    sender's manifest, writes that manifest last and renames the directory to
    ``.peers/node-<n>/checkpoint-<step>`` (the commit); a mismatch leaves nothing;
P3. every rank gathers every leader's outcome: the step is "recoverable without the
    persistent tier" (``peer_recoverable``, ``wait_peers``) only if every node's copy
    committed on K peers, i.e. every node's files are on K+1 nodes.

Peer copies are outside tier 0's catalog (which lists ``checkpoint-<step>`` names
only) and follow tier 0's retention: a node drops its peer copies of a step once its
own tier 0 dropped the step (its policy holds every step not yet on tier 1, so the
only copy of an unpersisted step is never dropped). ``checkpoints()``/``latest()``
count the nodes holding each rank's file (``node_copies``). ``restore()`` counts a
peer copy as loadable: a node whose ranks lack the step locally gets its node's files
from the nearest node holding a copy (the holder reads its copy and sends it over the
group, the receiver verifies every byte against the manifest recorded at save and
commits it under its own ``.peers/``, as in P2), then its ranks load from it; a copy
that is rejected or fails to load falls back to tier 1, and every rank agrees on the
step as above (``last_restored.from_peers`` names the ranks served by a peer).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass
from typing import Any, TypeVar, cast

from . import catalog, layout
from ._checks import flag, retention_policy
from ._faults import fault_point
from .async_save import lower_priority
from .coordination import (
    Coordinator,
    SingleProcessCoordinator,
    default_coordinator,
    gather_routed,
    gather_summary,
    gather_to,
    ranks_text,
)
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CollectiveMismatchError,
    CommitError,
    CorruptCheckpointError,
    LockError,
    LockHeldError,
    ResumeError,
    StepOrderError,
    StorageError,
    StorageFullError,
    UnsafeCheckpointError,
)
from .layout import (
    MANIFEST_NAME,
    checkpoint_name,
    new_attempt_token,
    parse_checkpoint_name,
    rank_state_file,
    validate_step,
)
from .manager import (
    CheckpointManager,
    CopyAttempt,
    _RollbackStopped,
    check_world_size,
    close_propagating,
)
from .manifest import CheckpointInfo, FileEntry, Hasher, Manifest
from .storage import open_storage, posix, storage_for
from .storage.base import Storage, answer_within, renaming

__all__ = ["Tier", "TieredCheckpointInfo", "TieredCheckpointManager"]

log = logging.getLogger("atomic_checkpoint")

#: ``with`` gives back the same object, subclass included.
_Self = TypeVar("_Self")
_R = TypeVar("_R")

_CHUNK = 8 << 20
# Back-off between attempts while the persistent tier fails (unreachable, throttled):
# doubled after each failure up to the maximum, reset by a success or a new save.
_RETRY_MIN_S = 0.05
# The longest a start waits for the persistent tier (bounded by ``timeout_s``): an
# endpoint that accepts connections and never answers must not hold the job's start.
_START_WAIT_S = 30.0
# What close() gives the replicator to stop, even with timeout_s=0: a copy in flight
# notices the stop between two chunks.
_STOP_GRACE_S = 2.0
# Multi-rank: how often the replicators meet while a rank's part of a round works on
# storage (less often above 1,000 ranks; at most a quarter of timeout_s), so that they
# wait for a slow rank as long as it lives (``_while_working``).
_MEET_EVERY_S = 1.0


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
    #: Multi-rank jobs: the fewest nodes whose tier 0 holds any one rank's file (its
    #: own node's copy and, with ``peers=``, peer copies: 1 without them, 0 where a
    #: node lacks its copy); the step survives the loss of ``node_copies - 1`` nodes
    #: without the persistent tier. 0 in a single-process job.
    node_copies: int = 0
    #: After a ``restore()``: the ranks that loaded a copy sent by a peer node.
    from_peers: tuple[int, ...] = ()


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

    def held_partial(self, steps: set[int]) -> frozenset[int]:
        """Of ``steps``, committed on this node's tier 0 but not on every node's (a node
        whose tier 0 was replaced lacks them), those still waiting for the persistent
        tier: the manager's retention keeps them instead of removing them as the
        leftovers of a save that failed half way. They may be the only copies of a step
        (restored from this node's files and its peer copies)."""
        return frozenset(self._owner._held_steps(steps) & steps)


@dataclass
class _Views:
    """What a collective listing gathered (see ``_views_multi``)."""

    locals_: list[set[int]]
    slow: set[int]
    infos: dict[int, CheckpointInfo]
    leader: list[int] = dataclasses.field(default_factory=list)  # peers only
    held: dict[int, dict[int, list[tuple[int, tuple[int, ...]]]]] = dataclasses.field(
        default_factory=dict
    )
    slow_error: str | None = None  # peers only: why rank 0 could not list tier 1
    #: A restore's view reads tier 1 newest first and stops at its first candidate:
    #: the lowest step read there. Below it, ``slow`` says nothing (None: all read).
    slow_floor: int | None = None
    #: A restore's view: the newest tier 1 step passed over because a job of another
    #: number of ranks saved it (not every rank has a file in it), as words.
    other_shape: str | None = None


def _meta_errors(leaders: list[int], metas: list[Any]) -> list[str]:
    """On rank 0, a peer round's first exchange: the nodes whose copy cannot be sent."""
    return [
        f"node {i}: {metas[lead]['error']}"
        for i, lead in enumerate(leaders)
        if "error" in metas[lead]
    ]


def _peer_problems(reports: list[dict[int, str | None] | None]) -> list[str]:
    """On rank 0, a peer round's last exchange: every copy that a leader rejected."""
    return [
        f"node {src} -> rank {r}: {msg}"
        for r, rep in enumerate(reports)
        for src, msg in (rep or {}).items()
        if msg is not None
    ]


def _merge_views(views: list[tuple[Any, ...]]) -> _Views:
    """On rank 0, ``_views_multi``'s exchange: every rank's view as one ``_Views``. The
    step infos are merged (each step's once, tier 1's and rank 0's first), and ranks
    that can load the same steps (a node's ranks) share one set object, which pickles
    once: the answer grows with the nodes and steps, not with ranks times nodes."""
    same: dict[frozenset[int], set[int]] = {}
    locals_ = [same.setdefault(frozenset(v[0]), set(v[0])) for v in views]
    infos = dict(views[0][2])
    out = _Views(locals_, views[0][1] or set(), infos)
    if len(views[0]) > 3:  # with peer replicas
        for v in views:
            for s, info in v[5].items():
                infos.setdefault(s, info)
        out.leader = [v[3] for v in views]
        out.held = {r: v[4] for r, v in enumerate(views) if r == v[3]}
        out.slow_error = views[0][6]
    if views[0][1] is None and out.slow_error is None:
        # Rank 0 could not list tier 1 (its log says why): not an empty tier 1. Taken for
        # one, a rollback said it would remove "every checkpoint on both tiers" on some
        # ranks, and a restore found "no checkpoint" where tier 1 holds the run.
        out.slow_error = "it did not answer rank 0 (see the warning logged there)"
    return out


class _Stopped(Exception):
    """Internal: ``close()`` asked the replicator to stop mid-copy."""


class _Interrupted(Exception):
    """A replication attempt discarded for a rollback (single process)."""


class _RoundFailed(Exception):
    """Internal: a multi-rank replication round failed alike on every rank (tier 1
    unreachable, a node's upload failed): every rank backs off and retries."""


class _Stalled(StorageError):
    """``last_replication_error`` while a multi-rank round waits on slow storage."""


class _ArrivalMismatch(CommitError):
    """The bytes tier 1 holds after a copy do not match the recorded checksums (a write
    or transfer went wrong): the attempt is discarded and retried."""


def check_tiers_separate(fast: Storage, slow: Storage) -> None:
    """Refuse tiers that are one location, or one inside the other: each tier's manager
    would take the other's checkpoints for its own (retention, sweeps), and a copy
    "replicated" onto itself protects nothing."""

    def where(storage: Storage) -> str:
        local = storage.local_path("")
        return (posix.real_path(local) if local is not None else storage.url("")).rstrip("/")

    a, b = where(fast), where(slow)
    if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
        raise ValueError(
            f"tier 0 ({fast.url('')}) and tier 1 ({slow.url('')}) must be two separate "
            "locations, neither inside the other: the persistent tier is the copy that "
            "survives the loss of the fast one"
        )


class _Tier0Manager(CheckpointManager):
    """The manager of a tiered job's tier 0: a step its root lacks may be on the
    persistent tier or a peer, so its start does not call that "starting from scratch"."""

    _one_tier_of_several = True
    _run_id_declared = False


class _DeclaredTier0Manager(_Tier0Manager):
    """Tier 0 of a job that was given its ``run_id``."""

    _run_id_declared = True


class _Tier1Manager(CheckpointManager):
    """Tier 1 of a job whose run id was read from a tier, not given."""

    _run_id_declared = False


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
            thread (an exception there is logged, never stops replication; the step
            is persistent then, and ``wait_replicated``, ``rollback`` and ``close``,
            which would wait for that thread, are refused there); multi-rank: on rank 0
            only.
        timeout_s, allow_pickle, resume, takeover: as for ``CheckpointManager``
            (``resume`` and ``takeover`` apply to tier 0).
        retry_max_s: the longest wait between attempts while tier 1 fails.
        coordinator: how ranks agree (default: ``torch.distributed`` when a process
            group is initialised, else one process); see the module docstring.
        fast_domains: how tier 0 is laid out across ranks (``"auto"``: probe,
            ``"per-host"``: one node-local disk per host, ``"shared"``); multi-rank only.
        peers: K, how many other nodes' tier 0 also receive each node's files of every
            step saved (ring order, over a gloo group of its own); 0 (default): none.
            Multi-node ``torch.distributed`` jobs only; see the module docstring.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        run_id: str | None = None,
        on_commit: Callable[[int, CheckpointInfo], object] | None = None,
        timeout_s: float = 600.0,
        allow_pickle: bool = False,
        resume: str = "auto",
        takeover: bool = False,
        retry_max_s: float = 5.0,
        coordinator: Coordinator | None = None,
        fast_domains: str = "auto",
        peers: int = 0,
    ):
        tiers = list(tiers)
        if len(tiers) != 2 or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError(
                "tiers must be two Tier(...) objects, fastest first: "
                "[Tier(local_root, ...), Tier(persistent_root, ...)]"
            )
        coord = coordinator or default_coordinator()
        self._coord = coord
        self.rank = coord.rank
        self.world_size = coord.world_size
        self._multi = coord.world_size > 1
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
        self._abandon = False  # interpreter exit: stop without the agreed last round
        self._kick = False  # a new step arrived: retry at once
        # rollback(): the step tier 1 is to go back to, asked of the replicator thread
        # (it owns tier 1), and its answer: ("ok", removed steps) or ("error", exc).
        self._rollback_req: int | None = None
        self._rollback_result: tuple[str, Any] | None = None
        # Counts the requests: the replicator tells one its caller gave up on (the
        # caller clears the request on timeout) from one still awaited.
        self._rollback_ticket = 0
        # Multi-rank: the request whose caller this rank's replicator told the others is
        # still waiting (_rollback_round); that caller then waits for the round's answer.
        self._rollback_pinned = 0
        # While a rollback runs: the highest step a reading of tier 0 may queue for
        # replication (the steps above it are being removed from tier 0).
        self._ceiling: int | None = None
        # Tier 1's newest step of this run, read at open: a save at or below it while
        # tier 0 holds nothing as new (a wiped or replaced tier 0) is refused.
        self._floor: int | None = None
        self._queuer: threading.Thread | None = None
        self._persistent: CheckpointManager | None = None
        self._reader: CheckpointManager | None = None
        self._reader_storage: Storage | None = None
        self._closed = False
        self._left_at_close: list[int] = []  # what close() returned, for a second close()
        self._start_wait_s = min(self.timeout_s, _START_WAIT_S)
        # Several ranks: a read of tier 1 that one rank makes while the others wait in a
        # round for it ends well within the round's timeout_s (a rank arriving after
        # the others gave up failed every rank's start, whatever timeout_s was).
        self._slow_wait_s = (
            min(self._start_wait_s, self.timeout_s / 2) if self._multi else self._start_wait_s
        )
        # The thread opening tier 1 at start, while it has not answered (single process).
        self._opener: threading.Thread | None = None
        self._io_worker: threading.Thread | None = None  # _while_working's, multi-rank
        self._open_done = False
        self._open_error: BaseException | None = None
        self._start_gave_up = False
        #: The tier the last ``restore`` loaded from (0 or 1) and what it loaded.
        self.last_restored: TieredCheckpointInfo | None = None

        fast, slow = tiers
        # Tier 0's policy is wrapped (it never deletes an unreplicated step), and the
        # wrapper always looked valid: KeepLast (the class) kept everything, with a
        # traceback at each save. Checked as the manager checks tier 1's.
        retention_policy(fast.retention)
        retention_policy(slow.retention)
        self._fast_storage = _open(fast)
        self._slow_storage = _open(slow)
        check_tiers_separate(self._fast_storage, self._slow_storage)
        # The persistent tier's client (an object store's session) is set up beside the
        # rest of the start, not by the first request: restore's first listing of tier
        # 1 would otherwise wait for it (0.2-0.3 s per process with s3fs).
        connect = getattr(self._slow_storage, "connect", None)
        if connect is not None:
            threading.Thread(target=connect, name="atomic-checkpoint-connect", daemon=True).start()
        opened_slow: CheckpointError | None = None
        # Tier 0 holds no run file when its manager was opened with a run id (below):
        # then its newest checkpoint names the run.
        rid = run_id or _recorded_run_id(self._fast_storage) or _newest_run_id(self._fast_storage)
        unread: StorageError | None = None
        if rid is None:
            # A fresh or wiped tier 0: the persistent tier says which run this is
            # (never a silent fresh start over its checkpoints, DESIGN invariant 6). If
            # it cannot be read, that error is raised: nobody can tell.
            slow_url = self._slow_storage.url("")
            try:
                rid = answer_within(
                    self._slow_wait_s,
                    f"the persistent tier {slow_url}",
                    lambda: (
                        _recorded_run_id(self._slow_storage) or _newest_run_id(self._slow_storage)
                    ),
                )
            except StorageError as exc:
                if not (self._multi and peers):
                    raise StorageError(
                        f"{self._fast_storage.url('')} holds no checkpoint (a new or replaced "
                        f"node), so the run this job continues is read from the persistent "
                        f"tier {slow_url}, which cannot be read: {exc}. Start the job again "
                        "once it answers (nothing was written)"
                    ) from exc
                unread = exc  # the other nodes may know (a wiped node, peer copies)
        if self._multi:
            # One run on every node: rank 0's answer, else any node's (a wiped node
            # learns it from the persistent tier or from the others).
            rid, unreadable, differ = gather_summary(
                coord,
                "tiered: run id",
                (rid, unread is not None, (self._slow_storage.url(""), int(peers or 0))),
                _run_id_of,
                timeout_s=self.timeout_s,
            )
            if differ is not None:
                # Every rank alike: with other peers= on one node its peer rounds
                # never matched the others' (a raw store timeout), and another
                # persistent tier on one node was silently rank 0's.
                raise CollectiveMismatchError(
                    "the ranks opened the tiers with different settings (persistent tier, "
                    f"peers=): {differ}. Pass the same Tier list (tier 0 may be each "
                    "node's own path) and the same peers= on every rank"
                )
            if rid is None and unreadable:
                # Every rank raises alike: nobody can tell which run this is.
                raise unread or StorageError(
                    f"{self._slow_storage.url('')} cannot be read on some node and no node's "
                    f"{self._fast_storage.url('')} names the run: retry once the persistent "
                    "tier answers"
                )

        declared = run_id is not None
        self._run_id_given = declared

        def open_fast(mode: str) -> CheckpointManager:
            return self._tier_manager(
                _DeclaredTier0Manager if declared else _Tier0Manager,
                self._fast_storage,
                rid,
                coord,
                retention=(
                    _HoldUnreplicated(fast.retention, self) if fast.retention is not None else None
                ),
                on_commit=self._on_fast_commit,
                strategy=fast.strategy,
                resume=mode,
                takeover=takeover,
                storage_domains=fast_domains if self._multi else "shared",
            )

        try:
            self.fast = open_fast(resume)
        except ResumeError as exc:
            # A node's tier 0 wiped (replaced) while the others hold the run's steps:
            # the tiered restore gets them from tier 1 or the peers. Tier 0 holds only
            # corrupt checkpoints of the run (a torn copy of its one step): not a start
            # from scratch over them if tier 1 holds valid ones, from which restore()
            # loads. Every rank reads the same tier 1 alike.
            wiped = bool(exc.partial_steps)
            if resume == "must" or not (wiped or self._slow_has_valid(rid)):
                raise
            if not wiped:
                log.warning(
                    "%s holds no valid checkpoint of run %r, only corrupt ones (see "
                    "`atomic-checkpoint verify`); the persistent tier %s holds valid ones: "
                    "restore() loads from there",
                    self._fast_storage.url(""),
                    rid,
                    self._slow_storage.url(""),
                )
            self.fast = open_fast("never")  # never refuses a tier 0 without a valid one
        self.run_id: str = self.fast.run_id
        if self._multi:
            try:
                self._floor = coord.broadcast(
                    "tiered: floor",
                    self._read_floor_within() if self.rank == 0 else None,
                    src=0,
                    timeout_s=self.timeout_s,
                )
            except BaseException:
                self.fast.close()
                raise
        self._local_reader_mgr: CheckpointManager | None = None
        self._peers = 0
        self._peer_group: Any = None
        self._peer_todo: set[int] = set()  # committed on tier 0, peer round not run yet
        self._peer_done: set[int] = set()
        self._peer_safe: set[int] = set()  # every node's files on peers + 1 nodes
        self._peer_failed: dict[int, str] = {}
        self._peer_readers: dict[int, CheckpointManager] = {}
        if peers:
            try:
                self._open_peers(int(peers))
            except BaseException:
                self.fast.close()  # every rank alike: the same arguments, the same job
                raise
        if self._multi:
            # Replication is agreed among ranks through a coordinator of its own (its
            # own store connection and keys), from the replicator threads only.
            self._rc = coord.clone()
            self._thread = threading.Thread(
                target=self._replicate_loop_multi,
                name="atomic-checkpoint-replicator",
                daemon=True,
            )
            self._thread.start()
            atexit.register(_stop_at_exit, weakref.ref(self), os.getpid())
            return
        # Tier 1 is opened (its run lock, what it lacks) on a thread of its own, waited
        # for at most _start_wait_s: past that, the job starts and saves to tier 0, and
        # the replicator takes over once the opening returns.
        self._opener = threading.Thread(
            target=self._open_at_start, name="atomic-checkpoint-open", daemon=True
        )
        self._opener.start()
        self._opener.join(self._start_wait_s)
        with self._cv:
            done, error = self._open_done, self._open_error
            self._start_gave_up = not done
        if not done:
            opened_slow = StorageError(
                f"{self._slow_storage.url('')} did not answer within {self._start_wait_s:g} s"
            )
        elif isinstance(error, StorageError):  # unreachable: saves go on, replication retries
            opened_slow = error
        elif error is not None:
            # Another live job holds tier 1, or it holds only corrupt checkpoints: a
            # decision for the user, not something to retry.
            self.fast.close()
            raise error
        if done:
            self._opener = None
        if opened_slow is not None:
            log.warning(
                "persistent tier %s is unreachable at start (%s): saves go to %s and are "
                "held there; replication starts when it answers",
                self._slow_storage.url(""),
                opened_slow,
                self.fast.root,
            )
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
        background. Where tier 0 is full, tier 0's retention is applied once (steps
        held for replication and replicated since are freed) and, if it freed any, the
        save is made again; else its ``StorageFullError`` is raised."""
        self._check_open()
        self._check_floor(step)
        try:
            info = self.fast.save(step, state, **kwargs)
        except StorageFullError:
            # Tier 0 filled while tier 1 was away (its steps held past the policy until
            # replicated). Once they are replicated, only the next commit's retention
            # would free them, and no save could commit: every later save failed until
            # close(). Raised on every rank alike, so every rank takes this way.
            if self.fast.retention is None or not self.fast.apply_retention():
                raise
            log.warning(
                "tier 0 %s was full: retention freed the steps replication no longer "
                "holds; saving step %s again",
                self.fast.root,
                step,
            )
            info = self.fast.save(step, state, **kwargs)
        if self._multi:
            self._queue(info.step)  # every rank: the replicators go step by step together
        return info

    def save_async(self, step: int, state: Any, **kwargs: Any) -> Any:
        """``CheckpointManager.save_async`` on tier 0; replication starts once the
        step commits there."""
        self._check_open()
        self._check_floor(step)
        handle = self.fast.save_async(step, state, **kwargs)
        if self._multi:
            # Every rank queues the step once its commit is known here (rank 0's
            # on_commit alone would leave the other replicators behind).
            self._queuer = threading.Thread(
                target=self._queue_when_done, args=(handle,), daemon=True
            )
            self._queuer.start()
        return handle

    def _queue_when_done(self, handle: Any) -> None:
        try:
            info = handle.result()
        except BaseException:  # a failed save has nothing to replicate; save raises it
            return
        self._queue(info.step)

    def _queue(self, step: int, *, peer_round: bool = True) -> None:
        """Queue ``step`` for replication (and, with ``peer_round``, for its peer round)."""
        with self._cv:
            self._todo.add(step)
            if peer_round and self._peer_group is not None and step not in self._peer_done:
                self._peer_todo.add(step)
            self._kick = True
            self._cv.notify_all()

    @property
    def coordinator(self) -> Coordinator:
        """How the ranks agree (tier 0's manager's coordinator); a ``PreemptionGuard``
        votes through it."""
        return self._coord

    @property
    def last_saved(self) -> CheckpointInfo | None:
        """The last checkpoint committed on tier 0 by this manager (with its
        ``timings_s``), or None."""
        return self.fast.last_saved

    @property
    def async_in_flight(self) -> Any:
        """The handle of tier 0's ``save_async`` still writing or committing, or
        None. Local to this rank; never blocks."""
        return self.fast.async_in_flight

    def prepare_async(self, state: Any, **kwargs: Any) -> int:
        """``CheckpointManager.prepare_async`` on tier 0."""
        return self.fast.prepare_async(state, **kwargs)

    def wait(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Wait for tier 0's async save (``CheckpointManager.wait``), not for replication
        (``wait_replicated``)."""
        return self.fast.wait(timeout_s)

    def saving(self, step: int, **kwargs: Any) -> Any:
        """``CheckpointManager.saving`` on tier 0 (tier 0 must be a mounted filesystem;
        single-process jobs)."""
        self._check_open()
        if self._multi:
            raise NotImplementedError("saving() of a multi-rank tiered job: use save()")
        self._check_floor(step)
        return self.fast.saving(step, **kwargs)

    def _check_floor(self, step: int) -> None:
        """Refuse a save at or below tier 1's newest step of this run when tier 0 holds
        nothing as new (a wiped or replaced tier 0): a resume would load tier 1's newer
        step, and tier 1 orders checkpoints by step (``StepOrderError``, as a single
        root does). The same on every rank: the floor is agreed at open."""
        floor, newest = self._floor, self.fast._newest_step
        if floor is None or (newest is not None and newest >= floor):
            return
        step = validate_step(step)
        if step <= floor:
            raise StepOrderError(
                f"cannot save step {step}: the persistent tier {self._slow_storage.url('')} "
                f"holds step {floor} of run {self.run_id!r}, newer than anything on "
                f"{self.fast.root}, and checkpoints are ordered by step, so a resume would "
                f"load step {floor}. To continue from it, restore() and save above {floor}; "
                "to continue from an older checkpoint, first call rollback(<that step>) on "
                "every rank (it deletes this run's checkpoints above it on both tiers)",
                step=step,
                newest=floor,
            )

    def _open_at_start(self) -> None:
        """The opener thread: ``_open_persistent`` once. What it raised is handed to
        the constructor, or, once the constructor stopped waiting, handled here: an
        unreachable tier is retried by the replicator, anything else stops replication."""
        error: BaseException | None = None
        try:
            self._open_persistent()
        except BaseException as exc:
            error = exc
        with self._cv:
            self._open_done, self._open_error = True, error
            late = self._start_gave_up
            if late and error is not None and not isinstance(error, StorageError):
                self._fatal = error
            self._cv.notify_all()
        if late and self._fatal is error and error is not None:
            log.error("replication to %s stopped: %s", self._slow_storage.url(""), error)

    def _slow_has_valid(self, run_id: str | None) -> bool:
        """Whether tier 1 holds a valid checkpoint of ``run_id`` (False if it cannot
        tell within the start's bound)."""
        if run_id is None:
            return False
        try:
            found = answer_within(
                self._slow_wait_s,
                f"the persistent tier {self._slow_storage.url('')}",
                lambda: catalog.newest_valid(self._slow_storage, run_id=run_id),
            )
        except CheckpointError:
            return False
        return bool(found.valid)

    def _read_floor_within(self) -> int | None:
        """``_read_floor``, or None if tier 1 does not answer within the start's bound."""
        try:
            return answer_within(
                self._slow_wait_s,
                f"the persistent tier {self._slow_storage.url('')}",
                self._read_floor,
            )
        except StorageError as exc:
            log.warning("%s: saves are not checked against its newest step", exc)
            return None

    def _read_floor(self) -> int | None:
        """Tier 1's newest valid step of this run; None if it holds none or cannot be
        read (then nothing is refused: replication reconciles once it answers)."""
        try:
            found = catalog.newest_valid(self._slow_storage, run_id=self.run_id)
        except CheckpointError as exc:
            log.debug("reading %s at start: %s", self._slow_storage.url(""), exc)
            return None
        return found.valid[0].step if found.valid else None

    def rollback(self, step: int, *, allow_empty: bool = False) -> list[int]:
        """Discard this run's checkpoints above ``step`` on both tiers (and their peer
        copies), to continue training from an older checkpoint. Collective: call it on
        every rank.

        As ``CheckpointManager.rollback``: ``restore(100)`` and ``rollback(100)`` (in
        either order), then save 110, 120, ... Tier 1 goes first, through the
        replicator (a copy in flight is discarded; nothing above ``step`` is replicated
        again), then tier 0: if tier 1 cannot be reached, the error is raised before
        tier 0 is touched, and calling ``rollback`` again once it answers does it all.
        Waits for an in-flight async save first (raising its failure, as ``save``
        does).

        Args:
            step: the step to continue from; it need not exist on either tier.
            allow_empty: remove this run's checkpoints above ``step`` even if no tier
                keeps one at or below it (``rollback(0, allow_empty=True)``: start over).

        Returns:
            The steps removed from either tier, newest first; the same on every rank.

        Raises:
            CheckpointError: it would remove every checkpoint of this run on both tiers
                and ``allow_empty`` is False (nothing is removed); or a tier could not
                be rolled back (unreachable, another job holds it, replication
                stopped): every rank raises alike; the steps not removed yet are still
                valid.
        """
        self._check_open()
        self._not_on_the_replicator("rollback()")
        step = validate_step(step)
        allow_empty = flag("allow_empty", allow_empty)
        self.fast.wait()
        if not allow_empty:
            # As CheckpointManager.rollback: it removed every checkpoint of both tiers,
            # the persistent one included, with INFO lines as the only notice. A tier 1
            # that cannot be listed is not taken for an empty one (the message said its
            # steps did not exist): its rollback below says it did not answer.
            if self._multi:
                v = self._views_multi()
                held: list[int] | None = (
                    None
                    if v.slow_error is not None
                    else [c.step for c in self._checkpoints_multi(v)]
                )
            else:
                fast, slow = self._tier_lists()
                held = None if slow is None else [c.step for c in (*fast, *slow)]
            victims = [s for s in held or () if s > step]
            if held is not None and victims and not any(s <= step for s in held):
                raise CheckpointError(
                    f"rollback({step}) would remove every checkpoint of run "
                    f"{self.run_id!r} on both tiers (steps {victims}) and leave none at "
                    f"or below step {step} to continue from: nothing was removed. Roll "
                    f"back to one of them (e.g. rollback({victims[0]}) keeps step "
                    f"{victims[0]}), or pass allow_empty=True to remove them all and "
                    "start over"
                )
        if self._queuer is not None:
            self._queuer.join()  # its step is queued before the replicator is asked
        with self._cv:
            self._ceiling = step
        try:
            removed = set(self._rollback_persistent(step))
            try:
                removed |= set(self.fast.rollback(step, allow_empty=True))
            except CheckpointError as exc:
                # Said in the error (its type and fields kept), not in a log line only: a
                # restart that does not call rollback again copies tier 0's steps above
                # `step` back to tier 1, and restore() then loads one of them.
                exc.args = (
                    f"rollback({step}) is half done: {self._slow_storage.url('')} was rolled "
                    f"back (steps {sorted(removed, reverse=True)} removed), but tier 0 "
                    f"{self.fast.root} was not: {exc.args[0] if exc.args else exc}. Call "
                    f"rollback({step}) again once tier 0 can be written, before saving or "
                    f"restarting: a restart without it replicates tier 0's steps above "
                    f"{step} again",
                    *exc.args[1:],
                )
                raise
        finally:
            with self._cv:
                self._ceiling = None
        if self._floor is not None and self._floor > step:
            self._floor = None
        return sorted(removed, reverse=True)

    def _rollback_persistent(self, step: int) -> list[int]:
        """Ask the replicator thread (it owns tier 1) to roll tier 1 back; its answer."""
        with self._cv:
            if self._fatal is not None:
                raise CheckpointError(
                    f"rollback to step {step}: replication to {self._slow_storage.url('')} "
                    f"has stopped ({self._fatal}), so this manager cannot roll it back; "
                    f"nothing was removed from {self.fast.root}"
                )
            self._rollback_result = None
            self._rollback_req = step
            self._rollback_ticket += 1
            ticket = self._rollback_ticket
            self._kick = True
            self._cv.notify_all()

            def answered() -> bool:
                return self._rollback_result is not None or not self._thread.is_alive()

            done = self._cv.wait_for(answered, timeout=self.timeout_s)
            if not done and self._rollback_pinned == ticket:
                # Several ranks: this rank's replicator told the others this call still
                # waits, so the round goes on to roll back tier 0 with it; giving up now
                # would leave the others in tier 0's rollback alone. The rest of the
                # round is a few exchanges, each bounded by timeout_s.
                done = self._cv.wait_for(answered, timeout=3 * self.timeout_s)
            result, self._rollback_result = self._rollback_result, None
            self._rollback_req = None
        if result is None:
            why = "its replicator has stopped" if done else f"no answer in {self.timeout_s:g} s"
            raise CheckpointError(
                f"rollback to step {step}: {self._slow_storage.url('')} was not rolled back "
                f"({why}: {self._fatal or self._last_error or 'see the log'}); nothing was "
                f"removed from {self.fast.root}: call rollback({step}) again"
            )
        kind, value = result
        if kind == "error":
            raise CheckpointError(
                f"rollback to step {step}: {self._slow_storage.url('')} could not be rolled "
                f"back ({value}); no checkpoint was removed from {self.fast.root}: call "
                f"rollback({step}) again once it answers"
            ) from value
        return list(value)

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
        pm = self._new_persistent()
        try:
            on_slow = {c.step for c in pm.checkpoints()}
            on_fast = self._on_fast()
        except BaseException:
            pm.close()
            raise
        newest_slow = max(on_slow, default=None)
        with self._cv:
            self._persistent = pm
            self._floor = newest_slow
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
        behind = sorted(on_fast - on_slow - missing)
        if behind:
            log.info(
                "steps %s on %s are not on %s and at or below its newest step %s: not "
                "replicated (dropped by its retention, or left behind when the run went on "
                "from the persistent tier without them); tier 0's retention may delete them",
                behind,
                self.fast.root,
                pm.root,
                newest_slow,
            )

    def _on_fast(self) -> set[int]:
        """The steps of this run committed on tier 0, read from storage, not through
        tier 0's manager (the replicator thread runs this while the training thread
        saves through it). During a rollback, only those at or below its step: the
        ones above are being removed, never to be replicated again."""
        ceiling = self._ceiling
        return {s for s in self._still_on_fast() if ceiling is None or s <= ceiling}

    def _replicate_loop(self) -> None:
        # Replication is never urgent next to training: the lowest CPU priority, as an
        # async save's writer thread (the copy's hashing runs here).
        lower_priority()
        delay = _RETRY_MIN_S
        while True:
            with self._cv:
                if self._stop.is_set():
                    return
                rollback, ticket = self._rollback_req, self._rollback_ticket
                if (
                    rollback is None
                    and self._fatal is None
                    and self._persistent is not None
                    and not self._todo
                ):
                    self._cv.wait()
                    continue
            opener = self._opener
            if opener is not None:  # the start's opening of tier 1 has not returned yet
                opener.join()
                self._opener = None
                continue
            if rollback is not None:
                self._serve_rollback(rollback, ticket)
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
            except _Interrupted:
                continue  # a rollback: served at the top of the loop
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
                # A lease that lapsed during an outage: the outage is what to report.
                delay = self._back_off(self._last_error or exc, delay)
            except Exception as exc:  # unreachable, throttled: retried with a back-off
                delay = self._back_off(exc, delay)

    def _serve_rollback(self, step: int, ticket: int) -> None:
        """The replicator's part of ``rollback(step)`` (single process): tier 1 loses
        this run's checkpoints above ``step``, and nothing above it is replicated again.
        ``ticket``: the request's number (``_rollback_persistent``)."""
        result: tuple[str, Any]
        try:
            if self._fatal is not None:
                raise CheckpointError(
                    f"replication to {self._slow_storage.url('')} stopped: {self._fatal}"
                )
            if self._persistent is None:
                self._open_persistent()  # queues only steps at or below the ceiling
            assert self._persistent is not None
            removed = self._stoppable_rollback(step, functools.partial(self._gave_up, ticket))
            result = ("ok", removed)
            if self._gave_up(ticket):
                self._replicate_again(step, removed)
            else:
                # Only now: if tier 1 failed, tier 0 keeps these steps, to replicate.
                self._purge_above(step)
        except _RollbackStopped as exc:
            # Its caller gave up while tier 1 was stalled, before this rollback removed
            # everything: the rest stays (tier 0 may no longer hold those steps), and
            # what went is replicated again from tier 0 where it still is.
            self._replicate_again(step, exc.removed)
            result = ("error", exc)
        except Exception as exc:
            if isinstance(exc, LockError):
                self._drop_persistent()
            result = ("error", exc)
        with self._cv:
            if self._rollback_ticket != ticket:
                return  # a newer request is waiting: this answer is nobody's, not its
            self._rollback_req = None
            self._rollback_result = result
            self._cv.notify_all()

    def _gave_up(self, ticket: int) -> bool:
        """Whether the caller of rollback request ``ticket`` on this rank gave up
        waiting (it raised that nothing was rolled back)."""
        with self._cv:
            return self._rollback_req is None or self._rollback_ticket != ticket

    def _stoppable_rollback(self, step: int, stop: Callable[[], bool]) -> list[int]:
        """Tier 1's rollback to ``step``, asking ``stop`` before each removal: a rollback
        whose caller gave up (tier 1 stalled past ``timeout_s``) and that tier 1 answers
        later removes nothing more (``_RollbackStopped``). It went on: the steps tier 0's
        retention had already dropped were removed from tier 1 too, and lost from every
        tier by a call that said nothing was removed."""
        persistent = self._persistent
        assert persistent is not None
        persistent._rollback_stop = stop
        try:
            return persistent.rollback(step, allow_empty=True)
        finally:
            persistent._rollback_stop = None

    def _replicate_again(self, step: int, removed: list[int]) -> None:
        """A rollback whose caller gave up waiting (tier 1 did not answer in time) was
        carried out on tier 1 once it answered. The caller raised that nothing was
        rolled back, and tier 0 still holds the steps: they are valid, so each one
        goes back to tier 1. (They were forgotten instead, and a step the user then
        kept, by rolling back to it, stayed on the node-local tier only, with every
        call saying it was replicated.)"""
        held = self._still_on_fast() & set(removed)
        with self._cv:
            self._replicated -= set(removed)
            self._todo |= held
            self._kick = True
            self._cv.notify_all()
        if removed:
            log.warning(
                "the rollback to step %d that did not finish in time (its call raised) "
                "was carried out on %s afterwards: steps %s were removed there; tier 0 "
                "still holds %s, replicated again (call rollback(%d) again to discard them)",
                step,
                self._slow_storage.url(""),
                sorted(removed),
                sorted(held),
                step,
            )

    def _purge_above(self, step: int) -> None:
        """Forget every step above ``step`` (rolled back): not replicated, not peer
        copied, and a new save of the same number starts afresh."""
        with self._cv:
            for steps in (self._todo, self._replicated, self._peer_todo):
                steps -= {s for s in steps if s > step}
            for done in (self._peer_done, self._peer_safe):
                done -= {s for s in done if s > step}
            for failed in (self._failed, self._peer_failed):
                for s in [s for s in failed if s > step]:
                    del failed[s]
            self._cv.notify_all()

    def _check_interrupt(self) -> None:
        """Between the chunks of a copy: close() stops it; a rollback (single
        process) discards it, to be served at once."""
        if self._stop.is_set():
            raise _Stopped()
        if not self._multi and self._rollback_req is not None:
            raise _Interrupted()

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
        if source.domain_count > 1:
            # One node's copy of a multi-node save holds its own ranks' files only:
            # published alone it would be a checkpoint missing the other nodes' ranks.
            raise UnsafeCheckpointError(
                f"{src_store.url(name)} is one node's copy of a {source.domain_count}-node "
                f"save (ranks {list(source.domain_ranks or ())} of {source.world_size}): it "
                "is replicated only together with every other node's copy: restart the "
                "job on the same nodes, or run `atomic-checkpoint drain` on every node at "
                "once under torchrun (--nnodes N --nproc-per-node 1)"
            )
        # A rotation in flight on tier 1 finishes first (one at a time, as for a save).
        attempt = pm.begin_copy(step)
        try:
            try:
                there = catalog.load_checkpoint(dst, step)
            except CheckpointError:  # absent, or a torn or foreign copy the commit refuses
                there = None
            if there is not None:
                if catalog.same_content(there, source):
                    pm.abandon_copy(attempt)
                    return  # committed by an attempt whose end we never saw (a crash)
                raise CheckpointExistsError(
                    f"step {step} on {dst.url(name)} is another copy than the one on "
                    f"{src_store.url(name)} (different checksums): not replaced; inspect both"
                )
            files = self._copy_files(source, attempt.staged, rank=0)
            fault_point("before_replica_commit", 0, step)
            self._check_interrupt()
            pm.publish_copy(attempt, source, files, started=t0)
        except BaseException:
            pm.abandon_copy(attempt)
            raise
        log.info("replicated %s to %s", name, dst.url(name))

    def _copy_verified(
        self,
        src: str,
        dst: str,
        entry: FileEntry,
        algorithm: str,
        reading: Storage,
    ) -> None:
        """Stream ``src`` (on ``reading``: tier 0, or a peer copy of this node's files)
        to ``dst`` (tier 1), hashing each byte read; raise ``CorruptCheckpointError``
        (nothing committed) if it is not the saved file."""
        h = Hasher(algorithm)
        size = 0
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        w = self._slow_storage.open_write(dst, size_hint=entry.size_bytes)
        try:
            with reading.open_read(src) as r:
                while n := r.readinto(view):
                    self._check_interrupt()
                    h.update(view[:n])
                    w.write(view[:n])
                    size += n
                    if size > entry.size_bytes:
                        break
            digest = h.hexdigest()
            if size != entry.size_bytes or digest != entry.checksum:
                raise CorruptCheckpointError(
                    f"{reading.url(src)}: read {size} bytes with checksum {digest}, "
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
                self._check_interrupt()
                h.update(view[:n])
                size += n
        digest = h.hexdigest()
        if size != entry.size_bytes or digest != entry.checksum:
            raise _ArrivalMismatch(
                f"step {step}: {self._slow_storage.url(dst)} holds {size} bytes with checksum "
                f"{digest} after the copy, the save recorded {entry.size_bytes} bytes with "
                f"{entry.checksum}; the attempt is discarded and retried"
            )

    # ------------------------------------------------------------------ multi-rank
    def _replicate_loop_multi(self) -> None:
        """Every rank's replicator, in lockstep through ``self._rc``: reconcile once,
        then one agreed round per step (see the module docstring). Each decision comes
        from values every rank received alike, so every rank takes the same next step."""
        lower_priority()
        delay = _RETRY_MIN_S
        while True:
            with self._cv:
                while (
                    not self._stop.is_set()
                    and self._reconciled
                    and not self._todo
                    and not self._peer_todo
                    and self._rollback_req is None
                ):
                    self._cv.wait()
                if self._abandon:
                    return  # interpreter exit without close(): nobody to agree with
                stopping = self._stop.is_set()
                reconciled = self._reconciled
                step = min(self._todo) if self._todo else None
                peer_step = min(self._peer_todo) if self._peer_todo else None
                rollback, ticket = self._rollback_req, self._rollback_ticket
                self._kick = False
            try:
                # Each round starts with one agreed exchange: whether any rank is
                # stopping (close() on every rank: they stop together, so no rank is
                # left waiting in a round another one will never join); a rollback,
                # once every rank asks for it (rollback() is collective; until then the
                # others' rounds go on); with peer replicas, the oldest step any rank
                # reports for a peer round (peer rounds first: they need no persistent
                # tier, which may be the reason the others wait; a rank whose save has
                # not returned yet reports None).
                stop, back, chosen = gather_summary(
                    self._rc,
                    "tiered: next",
                    (stopping, peer_step, rollback),
                    _next_round,
                    timeout_s=self.timeout_s,
                )
                if stop:
                    return
                if back is not None:
                    self._rollback_round(back, ticket)
                    continue
                if chosen is not None:
                    self._peer_round(chosen)
                    continue
                if not reconciled:
                    self._reconcile_multi()
                else:
                    self._replicate_multi(step)
                delay = _RETRY_MIN_S
            except _RoundFailed as exc:  # every rank got the same outcome: all retry
                delay = self._back_off(exc, delay)
            except Exception as exc:
                # A rank is gone (an exchange timed out: CheckpointError), or a bug. Either
                # way replication stops here: the waits end with this error at once, and
                # the other ranks' exchanges with this one time out (timeout_s) instead of
                # waiting for a thread that is gone.
                err = exc
                if not isinstance(exc, CheckpointError):
                    err = CheckpointError(
                        f"replication stopped on rank {self.rank}: {type(exc).__name__}: {exc}"
                    )
                    err.__cause__ = exc
                with self._cv:
                    self._fatal = err
                    self._cv.notify_all()
                log.error(
                    "replication stopped on rank %d: %s", self.rank, exc, exc_info=err is not exc
                )
                return

    def _while_working(
        self,
        what: str,
        work: Callable[[], _R] | None,
        *,
        abandoned: tuple[int, threading.Event] | None = None,
    ) -> _R | None:
        """This rank's part of a multi-rank round that works on storage (``work``; None:
        this rank has none), run on a helper thread while every rank's replicator meets
        the others every ``_MEET_EVERY_S`` until every rank's part has ended; returns
        its result (or raises what it raised).

        The round's next exchange then finds every rank on time. Waiting there instead
        timed out after ``timeout_s`` whenever a rank's part took longer (a persistent
        tier that stalls past it, a large step's copy), which reads as a dead rank and
        stopped replication for the rest of the job. A rank that dies or freezes misses
        a meeting and is named within ``timeout_s``, as before. While a part runs
        longer than ``timeout_s``, ``last_replication_error`` says which ranks it waits
        for. A close() on any rank ends the round on every rank (``_RoundFailed``; the
        next round's first exchange stops them); a part stuck in a storage call goes on
        in its daemon thread and its result is dropped. ``abandoned``: a rollback
        round's (this rank's request ticket, an event): each meeting says whether some
        rank's caller gave up, and sets the event if one did."""
        box: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                box.append((True, work() if work is not None else None))
            except BaseException as exc:  # handed to the replicator thread below
                box.append((False, exc))

        worker = threading.Thread(target=run, name="atomic-checkpoint-replica-io", daemon=True)
        self._io_worker = worker  # close() does not wait on tier 1 while it is stuck
        worker.start()
        # A meeting costs the store O(N) requests: at most ~1,000 a second at any scale.
        every = min(max(_MEET_EVERY_S, self.world_size / 1000), self.timeout_s / 4)
        t0 = time.monotonic()
        # Peer rounds go on meanwhile (not during a rollback): they need no persistent
        # tier, and a stalled one held every step saved during the stall on one node.
        peering = self._peer_group is not None and what != "rollback"
        while True:
            worker.join(every)
            with self._cv:
                peer_step = min(self._peer_todo) if peering and self._peer_todo else None
            gone = abandoned is not None and self._gave_up(abandoned[0])
            busy, stopping, chosen, given_up = gather_summary(
                self._rc,
                f"tiered: {what}, working",
                (not box, self._stop.is_set(), peer_step, gone),
                _busy_ranks,
                timeout_s=self.timeout_s,
            )
            if given_up and abandoned is not None:
                abandoned[1].set()
            if not busy:
                break
            if stopping:
                raise _RoundFailed(
                    f"closed while rank(s) {busy} still worked on storage ({what} of a "
                    "replication round)"
                )
            if chosen is not None:
                self._peer_round(chosen)  # every rank alike: the value is agreed
                continue
            waited = time.monotonic() - t0
            if waited > self.timeout_s:
                with self._cv:
                    if self._last_error is None or isinstance(self._last_error, _Stalled):
                        self._last_error = _Stalled(
                            f"the replication round ({what}) has waited {waited:.0f} s for "
                            f"rank(s) {busy} working on storage (the persistent tier is "
                            "slow or not answering); it goes on when they finish"
                        )
        with self._cv:
            if isinstance(self._last_error, _Stalled):
                self._last_error = None
        ok, value = box[0]
        if not ok:
            raise value
        return cast(_R, value)

    def _rollback_round(self, asked: list[int], ticket: int) -> None:
        """The replicators' part of ``rollback`` (every rank, agreed): rank 0 rolls
        tier 1 back, then every rank forgets the steps above it and node leaders drop
        their peer copies above it; every rank gets the same outcome. ``ticket``: this
        rank's request (``_rollback_persistent``).

        A caller that gave up waiting (tier 1 stalled past ``timeout_s``) raised that
        nothing was rolled back, and its tier 0 keeps the steps. Once tier 1 answers, the
        ranks agree whether every caller still waits: if one gave up, what tier 1 lost
        is replicated again from tier 0, nothing is forgotten, and every caller still
        waiting raises too, so that no rank rolls tier 0 back alone. (The steps were
        forgotten instead, and a step the user then kept stayed on the node-local tier
        only, with every call saying it was replicated.)"""
        step = min(asked)
        # Set once a meeting of the round hears that some rank's caller gave up: rank 0
        # then removes nothing more from tier 1.
        abandoned = threading.Event()

        def stop() -> bool:
            return abandoned.is_set() or self._gave_up(ticket)

        removed, problem = self._while_working(
            "rollback",
            functools.partial(self._rollback_slow, asked, stop) if self.rank == 0 else None,
            abandoned=(ticket, abandoned),
        ) or ([], None)
        removed, problem = self._rc.broadcast(
            "tiered: rollback", (removed, problem), src=0, timeout_s=self.timeout_s
        )
        with self._cv:
            waiting = not self._gave_up(ticket)  # _cv is re-entrant
            if waiting:
                self._rollback_pinned = ticket  # its caller now waits for this answer
        gave_up = gather_summary(
            self._rc,
            "tiered: rollback callers",
            waiting,
            lambda found: [r for r, still in enumerate(found) if not still],
            timeout_s=self.timeout_s,
        )
        kind, value = "error", problem
        if gave_up:
            self._replicate_again(step, removed)  # what went, if it stopped part way
            late = (
                "; it was rolled back later, and what it lost there is replicated again from tier 0"
                if problem is None
                else f" ({problem})"
            )
            value = f"rank(s) {gave_up} stopped waiting for it after {self.timeout_s:g} s{late}"
        elif problem is None:
            # Tier 1 holds nothing above the step: forget those steps, and drop their
            # peer copies (a failure leaves tier 0 untouched: calling again finishes).
            self._purge_above(step)
            mine = None
            if self._peer_group is not None and self.fast.is_coordinator:
                mine = self._drop_peer_copies_above(step)
            problems = gather_summary(
                self._rc,
                "tiered: rollback peers",
                mine,
                lambda found: [f"rank {r}: {p}" for r, p in enumerate(found) if p is not None],
                timeout_s=self.timeout_s,
            )
            kind, value = ("error", "; ".join(problems)) if problems else ("ok", removed)
        with self._cv:
            if self._gave_up(ticket):
                return  # its caller gave up (it raised): this answer is nobody's
            self._rollback_req = None
            self._rollback_result = (kind, CheckpointError(value) if kind == "error" else value)
            self._cv.notify_all()

    def _rollback_slow(
        self, asked: list[int], stop: Callable[[], bool]
    ) -> tuple[list[int], str | None]:
        """Rank 0's part of the rollback round: tier 1 rolled back to the step every
        rank asked for, unless ``stop`` says a caller gave up; the steps removed, and
        what went wrong."""
        if len(set(asked)) > 1:
            return [], f"the ranks called rollback() with different steps: {sorted(set(asked))}"
        try:
            if self._persistent is None:
                self._persistent = self._new_persistent()
            return self._stoppable_rollback(asked[0], stop), None
        except _RollbackStopped as exc:
            return exc.removed, f"{self._slow_storage.url('')}: {exc}"
        except CheckpointError as exc:
            self._drop_persistent()
            return [], f"{self._slow_storage.url('')}: {type(exc).__name__}: {exc}"

    def _drop_peer_copies_above(self, step: int) -> str | None:
        """Remove the peer copies this node holds of steps above ``step`` (rolled
        back): each one's manifest first (un-committed), then its files. Returns what
        failed, or None."""
        store = self._fast_storage
        try:
            for node in store.listdir(_PEERS):
                for name in store.listdir(f"{_PEERS}/{node}"):
                    s = parse_checkpoint_name(name)
                    if s is not None and s > step:
                        copy = f"{_PEERS}/{node}/{name}"
                        store.delete_file(f"{copy}/{MANIFEST_NAME}")
                        store.fsync_dir(copy)
                        store.delete_tree(copy)
        except CheckpointError as exc:
            return f"removing the peer copies above step {step} under {store.url(_PEERS)}: {exc}"
        return None

    def _reconcile_multi(self) -> None:
        """Agree on what tier 1 lacks: the steps every node committed on tier 0, newer
        than tier 1's newest, minus tier 1's. Rank 0 opens tier 1 (its run lock)."""
        on_fast = self._on_fast() if self.fast.is_coordinator else None
        on_slow, error = self._while_working(
            "reconcile", self._slow_steps if self.rank == 0 else None
        ) or (None, None)
        # With peer replicas, each node leader also says whose peer copies it holds, so
        # that a step saved before this start (a restart) gets its copies too.
        held = None
        if self._peer_group is not None and self.fast.is_coordinator:
            try:
                holdings = self._peer_holdings()[0]
                held = {step: sorted({n for n, _r in v}) for step, v in holdings.items()}
            except CheckpointError as exc:
                log.warning("could not list the peer copies under %s: %s", self.fast.root, exc)
                held = {}

        def agree(views: list[tuple[Any, ...]]) -> tuple[Any, ...]:
            # On rank 0, once: every rank reads this answer, not every rank's view.
            kind, msg = views[0][2] or (None, None)
            if kind is not None:
                return kind, msg, set(), (set(), set()), None
            common = set.intersection(*(v[0] for v in views if v[0] is not None))
            held = self._held_by_every_node(views) | common
            return None, None, views[0][1], (common, held), self._peer_state_at_start(common, views)

        kind, msg, slow_steps, (common, replicable), peer_state = gather_summary(
            self._rc,
            "tiered: reconcile",
            (on_fast, on_slow, error, held),
            agree,
            timeout_s=self.timeout_s,
        )
        if kind == "fatal":
            raise CheckpointError(f"replication to {self._slow_storage.url('')}: {msg}")
        if kind == "retry":
            raise _RoundFailed(f"opening {self._slow_storage.url('')}: {msg}")
        newest_slow = max(slow_steps, default=None)
        missing = {s for s in replicable - slow_steps if newest_slow is None or s > newest_slow}
        with self._cv:
            self._todo = {s for s in self._todo | missing if s not in slow_steps}
            self._replicated |= common & slow_steps
            if peer_state is not None:
                step, complete = peer_state
                if complete:
                    self._peer_safe.add(step)
                elif step not in self._peer_done:
                    self._peer_todo.add(step)
            self._reconciled = True
            self._cv.notify_all()

    def _slow_steps(self) -> tuple[set[int] | None, tuple[str, str] | None]:
        """Rank 0's part of the reconcile round: the steps tier 1 holds (opening it and
        taking its run lock first), or the error, "fatal" (another job holds the lock)
        or "retry"."""
        try:
            if self._persistent is None:
                self._persistent = self._new_persistent()
            return {c.step for c in self._persistent.checkpoints()}, None
        except LockHeldError as exc:
            return None, ("fatal", str(exc))
        except CheckpointError as exc:
            self._drop_persistent()
            return None, ("retry", f"{type(exc).__name__}: {exc}")

    def _held_by_every_node(self, views: list[tuple[Any, ...]]) -> set[int]:
        """With peer replicas: the steps every node holds, on its tier 0 or as the copy
        of its own files that a restore committed under its ``.peers/node-<i>/`` (its
        tier 0 was replaced): each node can send its files of them (``_node_copy``), so
        they are replicable. A step restored so and not replicated before the job ended
        was never queued again: the replaced node's tier 0 lacks it."""
        if self._peer_group is None:
            return set()
        per_node = []
        for i, leader in enumerate(self.fast.domain.leaders):
            fast, held = views[leader][0] or set(), views[leader][3] or {}
            per_node.append(set(fast) | {s for s, sources in held.items() if i in sources})
        return set.intersection(*per_node) if per_node else set()

    def _peer_state_at_start(
        self, common: set[int], views: list[tuple[Any, ...]]
    ) -> tuple[int, bool] | None:
        """With peer replicas: the newest step every node holds on tier 0 at this start
        (saved before it, by an earlier run of the job), and whether the leaders'
        reports (``views``, every rank's, merged on rank 0) show each node's files of it
        committed on the next ``peers`` nodes already. If not, the replicator runs its
        peer round, so that a restarted job is again recoverable without the persistent
        tier; if so, it is ``peer_recoverable`` at once. None without peer replicas or
        without such a step."""
        if self._peer_group is None or not common:
            return None
        step, domain = max(common), self.fast.domain
        n = domain.count
        holders: dict[int, set[int]] = {}  # source node -> nodes holding its copy of step
        for receiver, leader in enumerate(domain.leaders):
            for src in (views[leader][3] or {}).get(step, ()):
                holders.setdefault(src, set()).add(receiver)
        complete = all(
            {(src + d) % n for d in range(1, self._peers + 1)} <= holders.get(src, set())
            for src in range(n)
        )
        return step, complete

    def _new_persistent(self) -> CheckpointManager:
        """A manager of tier 1 (taking its run lock), driven by this process alone."""
        slow = self.tiers[1]
        return self._tier_manager(
            CheckpointManager if self._run_id_given else _Tier1Manager,
            self._slow_storage,
            self.run_id,
            SingleProcessCoordinator(),
            retention=slow.retention,
            on_commit=self._on_slow_commit,
            strategy=slow.strategy,
            storage_domains="shared",
        )

    def _replicate_multi(self, mine: int | None) -> None:
        """One agreed replication round of the step rank 0 picks (its oldest waiting).

        A: rank 0 creates the pending location on tier 1 and sends it. B: each node's
        leader copies its node's files into it, verified as read and on arrival, and
        every rank gathers the results. C: rank 0 publishes the manifest (every rank's
        files, the checksums of the save) only if every node's copy verified, and sends
        the outcome: committed, failed (a corrupt copy: never retried) or retry."""
        rc, t0 = self._rc, time.perf_counter()
        # Each part that works on storage runs while the ranks meet (_while_working),
        # so a slow persistent tier is a slow round, not a rank taken for dead.
        plan = self._while_working(
            "plan", functools.partial(self._plan_multi, mine) if self.rank == 0 else None
        )
        plan = rc.broadcast("tiered: plan", plan, src=0, timeout_s=self.timeout_s)
        assert plan is not None
        step = plan["step"]
        if "error" in plan:
            raise _RoundFailed(plan["error"])
        copy = None
        if not plan.get("done") and self.fast.is_coordinator:
            copy = functools.partial(self._copy_outcome, step, plan["staged"])
        copied = self._while_working("copy", copy) or ("ok", [])
        # Only rank 0 reads the nodes' results (it commits); everyone gets the outcome.
        results = gather_to(rc, "tiered: copied", copied, dst=0, timeout_s=self.timeout_s)
        commit = None
        if results is not None and not plan.get("done"):
            commit = functools.partial(self._commit_multi, step, plan, results, t0)
        outcome = self._while_working("commit", commit) or ("committed", None)
        outcome = rc.broadcast("tiered: outcome", outcome, src=0, timeout_s=self.timeout_s)
        kind, msg = outcome
        with self._cv:
            if kind == "committed":
                self._todo.discard(step)
                self._replicated.add(step)
                self._last_error = None
            elif kind == "failed":
                log.error("replication of step %s failed: %s; it stays on tier 0 only", step, msg)
                self._todo.discard(step)
                self._failed[step] = CorruptCheckpointError(f"step {step}: {msg}")
            self._cv.notify_all()
        if kind == "retry":
            raise _RoundFailed(f"step {step}: {msg}")

    def _plan_multi(self, step: int | None) -> dict[str, Any]:
        """Rank 0's part of round A."""
        if step is None:  # rank 0 is ahead of nobody: its queue is never empty here
            return {"step": -1, "error": "rank 0 has no step to replicate"}
        try:
            pm = self._persistent
            if pm is None:
                pm = self._persistent = self._new_persistent()
            attempt = pm.begin_copy(step)  # after a rotation in flight on tier 1
            try:
                there = catalog.load_checkpoint(self._slow_storage, step)
            except CheckpointError:
                there = None
            if there is not None:
                pm.abandon_copy(attempt)
                return {"step": step, "done": True}  # an attempt whose end we never saw
            return {"step": step, "staged": attempt.staged}
        except CheckpointError as exc:
            self._drop_persistent()
            return {"step": step, "error": f"{type(exc).__name__}: {exc}"}

    def _copy_outcome(self, step: int, staged: str) -> tuple[str, Any]:
        """A node leader's part of round B, as the result rank 0 gathers: ("ok", the
        entries), ("failed", why: a corrupt tier 0 copy, never retried) or ("retry",
        why)."""
        try:
            return "ok", self._copy_node_files(step, staged)
        except _Stopped:
            # close() on this rank: the round ends alike for everyone (rank 0 discards
            # the attempt), and the next round's exchange stops them all.
            return "retry", f"rank {self.rank}: stopping"
        except (CorruptCheckpointError, UnsafeCheckpointError, CheckpointNotFoundError) as e:
            return "failed", f"rank {self.rank}: {e}"
        except Exception as e:
            return "retry", f"rank {self.rank}: {type(e).__name__}: {e}"

    def _copy_node_files(self, step: int, staged: str) -> list[FileEntry]:
        """A node leader's part of round B: its node's files of ``step`` into
        ``staged`` on tier 1, each verified as read and again on arrival."""
        storage, source = self._node_copy(step)
        return self._copy_files(source, staged, rank=self.rank, storage=storage)

    def _node_copy(self, step: int) -> tuple[Storage, Manifest]:
        """Where this node's files of ``step`` are, and their manifest: its tier 0, else
        (a node whose tier 0 was wiped, restored from a peer's copy of its files) the
        copy that restore committed under its own ``.peers/node-<i>/``. Without the
        second, a step restored so never reached the persistent tier: the node's own
        tier 0 lacks it, while ``wait_replicated`` said True."""
        try:
            return self._fast_storage, catalog.load_checkpoint(self._fast_storage, step)
        except CheckpointNotFoundError:
            if self._peer_group is None:
                raise
            own = self._peer_storage(self.fast.domain.index)
            try:
                return own, catalog.load_checkpoint(own, step)
            except CheckpointNotFoundError:
                pass
            raise

    def _copy_files(
        self, source: Manifest, staged: str, *, rank: int, storage: Storage | None = None
    ) -> list[FileEntry]:
        """Copy every file of ``source`` (committed on tier 0, or on ``storage``) into
        ``staged`` on tier 1, each verified as read and again on arrival; their entries,
        as tier 1 records them. ``rank`` is the one the ``mid_replicate`` fault point is
        armed for."""
        step = source.step
        name = checkpoint_name(step)
        reading = self._fast_storage if storage is None else storage
        files = []
        for i, entry in enumerate(source.files):
            rel = catalog.plain_path(entry.path)
            catalog.check_inside(reading, name, entry.path)
            self._copy_verified(
                f"{name}/{entry.path}",
                f"{staged}/{rel}",
                entry,
                source.checksum_algorithm,
                reading,
            )
            files.append(FileEntry(rel, entry.size_bytes, entry.checksum, entry.rank))
            if i == 0:
                fault_point("mid_replicate", rank, step)
        for f in files:
            self._check_arrived(f"{staged}/{f.path}", f, source.checksum_algorithm, step)
        return files

    def _commit_multi(
        self, step: int, plan: dict[str, Any], results: list[tuple[str, Any]], t0: float
    ) -> tuple[str, str | None]:
        """Rank 0's part of round C: publish tier 1's manifest if every node's copy
        verified, else discard the attempt."""
        pm = self._persistent
        staged = plan["staged"]
        bad = [(k, m) for k, m in results if k != "ok"]
        try:
            if bad:
                kind = "failed" if any(k == "failed" for k, _ in bad) else "retry"
                return kind, "; ".join(m for k, m in bad if k == kind)
            if pm is None:
                return "retry", "the persistent tier was closed"
            source = self._node_copy(step)[1]
            files = sorted((f for _k, fs in results for f in fs), key=lambda f: f.path)
            expected = {catalog.plain_path(rank_state_file(r)) for r in range(source.world_size)}
            have = {f.path for f in files}
            if source.state_kind != "replicated" and not expected <= have:
                return "failed", (
                    f"the nodes' copies hold {sorted(have)}, not every rank's file "
                    f"({sorted(expected - have)} missing)"
                )
            fault_point("before_replica_commit", 0, step)
            pm.publish_copy(CopyAttempt(step, staged), source, files, started=t0)
        except CheckpointError as exc:
            self._discard(pm, step, staged)  # unless it was committed after all
            if isinstance(exc, LockError):
                self._drop_persistent()
            return "retry", f"{type(exc).__name__}: {exc}"
        finally:
            if bad:
                self._discard(pm, step, staged)
        log.info("replicated %s of %d ranks", checkpoint_name(step), self.world_size)
        return "committed", None

    def _discard(self, pm: CheckpointManager | None, step: int, staged: str) -> None:
        if pm is not None:
            pm.abandon_copy(CopyAttempt(step, staged))

    # ------------------------------------------------------------------ peer replicas
    def _open_peers(self, k: int) -> None:
        """Collective, at construction: the gloo group of the peer transfers (its own
        group: never mixed with the training's collectives, and usable from the
        replicator thread while the training thread runs those)."""
        if k < 0:
            raise ValueError(f"peers must be >= 0, got {k}")
        nodes = self.fast.domain.count
        if not self._multi or nodes < 2:
            log.warning(
                "peers=%d: this job has %d node(s) with a tier 0 of its own; no peer copies",
                k,
                nodes,
            )
            return
        if self._fast_storage.local_path("") is None:
            raise ValueError(
                f"peers= needs tier 0 on a mounted filesystem, not {self._fast_storage.url('')}"
            )
        import datetime

        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "peers= sends files between nodes over torch.distributed: initialise the "
                "process group (init_process_group) before the TieredCheckpointManager"
            )
        if k > nodes - 1:
            log.warning("peers=%d but only %d other node(s): each holds a copy", k, nodes - 1)
        self._peers = min(k, nodes - 1)
        self._peer_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
        )

    def _peer_dir(self, node: int) -> str:
        return f"{_PEERS}/node-{node}"

    def _peer_storage(self, node: int) -> Storage:
        path = self._fast_storage.local_path(self._peer_dir(node))
        assert path is not None
        return open_storage(path)

    def _peer_round(self, step: int) -> None:
        """One agreed peer round of ``step`` (every rank): each node leader sends its
        node's files to the leaders of the next K nodes and receives the previous K
        nodes' files, verifies them against the sender's manifest, commits them under
        ``.peers/node-<n>/`` by rename; every rank gathers every leader's outcome."""
        domain, k = self.fast.domain, self._peers
        leaders = list(domain.leaders)
        meta: dict[str, Any] | None = None
        if self.fast.is_coordinator:
            self._prune_peer_copies()
            meta = _node_meta(self._fast_storage, step)

        def to_leaders(metas: list[Any]) -> dict[int, Any]:
            # On rank 0: each leader gets the metas of the K nodes it receives from (what
            # arrives is checked against them), the other ranks nothing; every rank gets
            # the nodes' errors.
            n = len(leaders)
            return {
                lead: {(i - d) % n: metas[leaders[(i - d) % n]] for d in range(1, k + 1)}
                for i, lead in enumerate(leaders)
            }

        _, meta_errors, node_meta = gather_routed(
            self._rc,
            f"tiered: peer meta {step}",
            f"peer meta {step}",
            lambda: meta,
            functools.partial(_meta_errors, leaders),
            to_leaders,
            dst=0,
            routed=self.fast.is_coordinator,
            timeout_s=self.timeout_s,
        )
        report: dict[int, str | None] = {}
        if self.fast.is_coordinator:
            n, me = domain.count, domain.index
            for d in range(1, k + 1):
                dst, src = (me + d) % n, (me - d) % n
                report[src] = self._transfer(
                    step,
                    send=(domain.leaders[dst], self._fast_storage, checkpoint_name(step), meta),
                    recv=(domain.leaders[src], src, node_meta[src]),
                    tag=_TAG_REPLICATE,
                )
        problems = gather_summary(
            self._rc, f"tiered: peer done {step}", report, _peer_problems, timeout_s=self.timeout_s
        ) + list(meta_errors)
        with self._cv:
            self._peer_todo.discard(step)
            self._peer_done.add(step)
            if problems:
                self._peer_failed[step] = "; ".join(problems)
                log.warning("peer copies of step %d incomplete: %s", step, "; ".join(problems))
            else:
                self._peer_safe.add(step)
            self._cv.notify_all()

    def _transfer(
        self,
        step: int,
        *,
        send: tuple[int, Storage, str, dict[str, Any] | None] | None,
        recv: tuple[int, int, dict[str, Any] | None] | None,
        tag: int,
    ) -> str | None:
        """Send one node's copy of ``step`` (``(to rank, storage, checkpoint dir, its
        meta)``) and receive another's (``(from rank, its node index, its meta)``) at
        once, chunk by chunk, over the peer group. Both sides know every size from the
        metas gathered before, so the streams stay aligned whatever happens: a file the
        sender cannot read goes out as zeros and fails the receiver's checksums. The
        received copy commits under ``.peers/node-<n>/checkpoint-<step>`` (files
        verified and fsync'd, manifest last, then one rename) only if every byte
        matches the sender's manifest. Returns None, or why the received copy was
        rejected (None too when nothing was to be received)."""
        import torch
        import torch.distributed as dist

        group = self._peer_group
        out: Any = iter(())
        if send is not None and send[3] is not None and "error" not in send[3]:
            out = _read_chunks(send[1], send[2], _files_of(send[3]))
        sink: _PeerSink | None = None
        if recv is not None and recv[2] is not None and "error" not in recv[2]:
            sink = _PeerSink(self._fast_storage, self._peer_dir(recv[1]), step, recv[2])
        sizes = sink.chunk_sizes() if sink is not None else []
        # One buffer each way, reused: every chunk is hashed and written before the
        # next is received, and every send completes before the next chunk is read.
        inbox = torch.empty(max(sizes, default=0), dtype=torch.uint8)
        started = time.perf_counter()
        try:
            i = 0
            while True:
                chunk = next(out, None)
                work = (
                    dist.isend(chunk, send[0], group=group, tag=tag)  # type: ignore[index]
                    if chunk is not None
                    else None
                )
                if i < len(sizes):
                    buf = inbox[: sizes[i]]
                    dist.recv(buf, recv[0], group=group, tag=tag)  # type: ignore[index]
                    assert sink is not None
                    sink.write(buf.numpy())
                    i += 1
                if work is not None:
                    work.wait()
                if chunk is None and i >= len(sizes):
                    break
        except RuntimeError as exc:  # gloo: a peer gone or timed out
            if sink is not None:
                sink.abort()
            raise CheckpointError(
                f"rank {self.rank}: peer transfer of step {step} failed ({exc}); the peer "
                "rank is gone or timed out"
            ) from exc
        if sink is None:
            return None
        received = time.perf_counter()
        rejected = sink.commit()
        log.info(
            "peer copy of step %d from rank %d: %.1f MiB received in %.3f s, committed in %.3f s%s",
            step,
            recv[0],  # type: ignore[index]
            sum(sizes) / 2**20,
            received - started,
            time.perf_counter() - received,
            "" if rejected is None else f", rejected: {rejected}",
        )
        return rejected

    def _prune_peer_copies(self) -> None:
        """Tier 0's retention, applied to the peer copies this node holds: a step's
        copies go once this node's own tier 0 dropped the step (its policy, holding
        every step not yet on the persistent tier, decides for both)."""
        try:
            local = sorted(self._still_on_fast())
            if not local:
                return
            for node in self._fast_storage.listdir(_PEERS):
                for name in self._fast_storage.listdir(f"{_PEERS}/{node}"):
                    s = parse_checkpoint_name(name)
                    dropped = s is not None and s < max(local) and s not in local
                    if dropped or (s is None and name.startswith(_INCOMING)):
                        self._fast_storage.delete_tree(f"{_PEERS}/{node}/{name}")
        except CheckpointError as exc:
            log.warning("could not drop old peer copies under %s: %s", self.fast.root, exc)

    def _peer_holdings(
        self,
    ) -> tuple[dict[int, list[tuple[int, tuple[int, ...]]]], dict[int, CheckpointInfo]]:
        """The committed peer copies on this node (presence and sizes checked):
        step -> [(node index, its ranks)], and an info of each step."""
        out: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        infos: dict[int, CheckpointInfo] = {}
        for node in self._fast_storage.listdir(_PEERS):
            if not node.startswith("node-") or not node[5:].isdigit():
                continue
            store = self._peer_storage(int(node[5:]))
            for m in catalog.committed(store, run_id=self.run_id, warn=False):
                ranks = tuple(m.domain_ranks or range(m.world_size))
                out.setdefault(m.step, []).append((int(node[5:]), ranks))
                infos.setdefault(m.step, m.info(store.url(checkpoint_name(m.step))))
        return out, infos

    def peer_recoverable(self) -> list[int]:
        """The steps saved by this job whose every node's files are committed on
        ``peers + 1`` nodes' tier 0 (agreed by a gathered round on every rank): they
        survive the loss of ``peers`` nodes without the persistent tier. After a
        restart, the newest step every node holds counts too once its peer copies are
        complete (found so at the start, or sent by the start's own peer round)."""
        with self._cv:
            return sorted(self._peer_safe)

    def wait_peers(self, step: int | None = None, timeout_s: float | None = None) -> bool:
        """Wait until the peer round of ``step`` (default: every step saved so far)
        ran. Returns True when it made the step(s) recoverable without the persistent
        tier, False on a timeout or when a copy failed (``peer_recoverable``), and at
        once when this job makes no peer copies (``peers=0``, or a job on one node)."""
        if self._peer_group is None:
            return False  # it returned True: nothing makes a step recoverable here
        with self._cv:
            self._cv.wait_for(
                lambda: (
                    self._fatal is not None
                    or (step not in self._peer_todo if step is not None else not self._peer_todo)
                ),
                timeout=timeout_s,
            )
            if step is not None:
                return step in self._peer_safe
            return not self._peer_todo and not (self._peer_done - self._peer_safe)

    def _local_reader(self) -> CheckpointManager:
        if self._local_reader_mgr is None:
            self._local_reader_mgr = self._read_only(self._fast_storage)
        return self._local_reader_mgr

    def _read_only(self, storage: Storage) -> CheckpointManager:
        """A read-only manager of one tier, driven by this process alone (no lock, no
        collective): listing and loading."""
        return self._tier_manager(
            CheckpointManager,
            storage,
            self.run_id,
            SingleProcessCoordinator(),
            read_only=True,
            storage_domains="shared",
        )

    def _tier_manager(
        self,
        cls: type[CheckpointManager],
        storage: Storage,
        run_id: str | None,
        coordinator: Coordinator,
        **settings: Any,
    ) -> CheckpointManager:
        """The manager of one tier (tier 0, tier 1, or a read-only view of either): of
        this job's run, with its ``timeout_s`` and ``allow_pickle``, and ``settings``."""
        return cls(
            storage,
            run_id=run_id,
            coordinator=coordinator,
            timeout_s=self.timeout_s,
            allow_pickle=self.allow_pickle,
            **settings,
        )

    def _views_multi(self, *, newest: bool = False, want: int | None = None) -> _Views:
        """Collective: what each rank can load from its own tier 0 (its node's copy
        holds its file), what tier 1 holds (read by rank 0 only), and rank 0's infos;
        with peer copies, also each rank's node leader and the peer copies each leader's
        tier 0 holds.

        With ``newest`` (a restore, ``latest()``), tier 1 is listed by name and its
        manifests are read newest first only down to the newest step every rank can
        load (``want``: that step's only), once the fast tiers' views are in: a few
        manifest reads however many checkpoints tier 1 keeps (``_Views.slow_floor``)."""
        local = {
            m.step: m
            for m in catalog.committed(self._fast_storage, run_id=self.run_id, warn=False)
            if m.domain_ranks is None or self.rank in m.domain_ranks
        }
        slow: dict[int, CheckpointInfo] | None = None
        infos: dict[int, CheckpointInfo] = {}
        slow_error: str | None = None
        names: list[tuple[int, str]] | None = None
        if self.rank == 0:
            try:
                if newest:
                    names = self._slow_within(
                        lambda: catalog.listed_steps(self._slow_read_storage())
                    )
                    slow = {}
                else:
                    listed = self._slow_within(lambda: self._slow_reader().checkpoints())
                    slow = {c.step: c for c in listed}
            except (StorageError, CommitError) as exc:
                slow_error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "persistent tier %s cannot be read: %s", self._slow_storage.url(""), exc
                )
            infos = {
                s: m.info(self._fast_storage.url(checkpoint_name(s))) for s, m in local.items()
            }
            infos.update(slow or {})
        mine: tuple[Any, ...] = (
            set(local),
            None if slow is None else set(slow),
            infos if self.rank == 0 else None,
        )
        if self._peer_group is not None:
            held: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
            more: dict[int, CheckpointInfo] = {}
            if self.fast.is_coordinator:
                try:
                    held, more = self._peer_holdings()
                except CheckpointError as exc:
                    log.warning("peer copies under %s cannot be listed: %s", self.fast.root, exc)
                more.update(
                    (s, m.info(self._fast_storage.url(checkpoint_name(s))))
                    for s, m in local.items()
                )
            mine += (self.fast.domain.leader, held, more, slow_error)

        # Rank 0 merges the views once; every rank reads that one answer. With peer
        # copies, an all-gather sent each node leader's step infos to every rank.
        def merge(views: list[tuple[Any, ...]]) -> _Views:
            v = _merge_views(views)
            if names is not None:
                self._read_slow_newest(v, names, want)
            return v

        return gather_summary(
            self._coord, "tiered: loadable", mine, merge, timeout_s=self.timeout_s
        )

    def _read_slow_newest(self, v: _Views, names: list[tuple[int, str]], want: int | None) -> None:
        """On rank 0, in a restore's views: read tier 1's checkpoints named ``names``
        newest first (only ``want``'s, if given), stopping at the first that every rank
        can load (valid on tier 1, or at or below the newest step every rank loads from
        tier 0 or a peer); fills ``v.slow``, tier 1's infos and ``v.slow_floor``."""
        reach = self._fast_reach(v)
        top = max(set.intersection(*reach), default=None) if reach else None
        storage = self._slow_read_storage()
        walked = names if want is None else [(s, n) for s, n in names if s == want]
        floor: int | None = None
        try:
            for entry in catalog.newest_first(storage, run_id=self.run_id, steps=walked):
                m = entry.manifest
                if (
                    want is None
                    and entry.status == "ok"
                    and m is not None
                    and m.state_kind == "per_rank"
                    and m.world_size != self.world_size
                ):
                    # Saved by a job of another shape (one that shrank to fewer nodes):
                    # not every rank of this one has a file in it. Passed over, as a
                    # plain root's start passes over the steps only some nodes hold;
                    # restore(step) still says why it cannot load it.
                    v.other_shape = v.other_shape or (
                        f"{entry.name} on {storage.url('')} holds per-rank state of "
                        f"{m.world_size} rank(s) but this job has {self.world_size}"
                    )
                    log.warning(
                        "restore: %s on %s was saved by a job of %d rank(s), and this job "
                        "has %d: not every rank can load it, so restore() loads an older "
                        "step. Saves below step %d raise StepOrderError: call "
                        "rollback(<the step restored>) first (it deletes the newer steps "
                        "on both tiers), or start the job with %d ranks again to resume "
                        "from step %d",
                        entry.name,
                        storage.url(""),
                        m.world_size,
                        self.world_size,
                        m.step,
                        m.world_size,
                        m.step,
                    )
                    continue
                if entry.status == "ok" and entry.manifest is not None:
                    v.slow.add(entry.manifest.step)
                    v.infos[entry.manifest.step] = entry.manifest.info(storage.url(entry.name))
                    if want is None:
                        floor = entry.manifest.step
                        break
                else:
                    catalog.warn_skipped(storage, entry)
                if want is None and top is not None and (entry.step or 0) <= top:
                    floor = entry.step
                    break
        except (StorageError, CommitError) as exc:
            log.warning("persistent tier %s cannot be read: %s", storage.url(""), exc)
            v.slow.clear()
            v.slow_error = f"{type(exc).__name__}: {exc}"
        v.slow_floor = floor

    def _loadable(self, v: _Views) -> set[int]:
        """The steps every rank can load from some tier."""
        return set.intersection(*(loc | v.slow for loc in self._fast_reach(v)))

    def _fast_reach(self, v: _Views) -> list[set[int]]:
        """For each rank, the steps it can load without tier 1: its node's tier 0
        copy, or a peer copy some node holds of its file."""
        return [loc | self._peer_loadable(v, r) for r, loc in enumerate(v.locals_)]

    def _peer_loadable(self, v: _Views, rank: int) -> set[int]:
        """The steps some node holds a peer copy of ``rank``'s file of."""
        return {
            s
            for held in v.held.values()
            for s, copies in held.items()
            if any(rank in ranks for _n, ranks in copies)
        }

    def _node_copies(self, v: _Views, step: int) -> int:
        """The fewest nodes whose tier 0 holds any one rank's file of ``step``."""
        if not v.leader:
            return 1 if all(step in loc for loc in v.locals_) else 0
        counts = []
        for r, loc in enumerate(v.locals_):
            nodes = {v.leader[r]} if step in loc else set()
            nodes |= {
                h
                for h, held in v.held.items()
                if any(r in ranks for _n, ranks in held.get(step, ()))
            }
            counts.append(len(nodes))
        return min(counts)

    def _checkpoints_multi(self, v: _Views | None = None) -> list[TieredCheckpointInfo]:
        if v is None:
            v = self._views_multi()
        everywhere = set.intersection(*self._fast_reach(v))
        out = []
        for step in sorted(self._loadable(v)):
            tiers = tuple(t for t, held in ((0, step in everywhere), (1, step in v.slow)) if held)
            info = _tiered(v.infos[step], tiers)
            info = dataclasses.replace(info, node_copies=self._node_copies(v, step))
            out.append(info)
        if not out and v.slow_error is not None:
            raise self._unreadable(v)
        return out

    def _unreadable(self, v: _Views) -> StorageError:
        """Nothing loadable while tier 1 could not be read: "no checkpoint" would be a
        claim nobody can check (a silent fresh start over a run, DESIGN invariant 6)."""
        return StorageError(
            f"no step every rank can load from tier 0 or a peer's copy, and the persistent "
            f"tier {self._slow_storage.url('')} cannot be read ({v.slow_error}): retry once "
            "it answers"
        )

    def _fetch_plan(self, v: _Views, step: int) -> list[tuple[int, int, int]]:
        """Who fetches ``step`` from whom, alike on every rank (it is computed from the
        agreed views): ``(receiving leader, holding leader, node)`` for every node whose
        ranks lack ``step`` on their own tier 0 while a peer holds their files."""
        if not v.leader:
            return []
        plan: list[tuple[int, int, int]] = []
        world = len(v.locals_)
        for lead in sorted(set(v.leader)):
            members = [r for r in range(world) if v.leader[r] == lead]
            need = [r for r in members if step not in v.locals_[r]]
            if not need:
                continue
            holders = sorted(
                (
                    ((h - lead) % world, h, n)
                    for h, held in v.held.items()
                    for n, ranks in held.get(step, ())
                    if all(r in ranks for r in need)
                ),
            )
            if holders:
                _d, h, n = holders[0]
                plan.append((lead, h, n))
        return plan

    def _fetch_from_peers(
        self, v: _Views, step: int, plan: list[tuple[int, int, int]]
    ) -> int | None:
        """Collective, during a restore (every rank, with the same ``plan``): every
        node of the plan gets its node's files from a peer holding them (the holder
        reads its copy and sends it over the peer group; the receiver verifies every
        byte against the manifest recorded at save and commits it under ``.peers/``).
        Returns the node index of the peer copy this rank can load from (on its own
        tier 0), or None."""
        if not plan:
            return None
        metas = {
            lead: _node_meta(self._peer_storage(n), step)
            for lead, h, n in plan
            if h == self.rank and h != lead
        }
        routed = _route_fetch_metas(self._coord, step, plan, metas, self.timeout_s)
        result: str | None = None
        for lead, h, n in plan:
            if h == lead or self.rank not in (lead, h):
                continue
            meta = metas[lead] if self.rank == h else routed
            try:
                if self.rank == h:
                    self._transfer(
                        step,
                        send=(lead, self._peer_storage(n), checkpoint_name(step), meta),
                        recv=None,
                        tag=_TAG_RESTORE,
                    )
                else:
                    result = meta.get("error") or self._transfer(
                        step, send=None, recv=(h, n, meta), tag=_TAG_RESTORE
                    )
            except CheckpointError as exc:
                result = str(exc) if self.rank == lead else result
        rejected = _share_rejections(self._coord, step, result, self.timeout_s)
        for lead, h, n in plan:
            if v.leader[self.rank] != lead:
                continue
            if lead in rejected:
                log.warning(
                    "restore: the peer copy of step %d from rank %d is rejected: %s",
                    step,
                    h,
                    rejected[lead],
                )
                return None
            return n
        return None

    def _restore_multi(self, step: int | None, kwargs: dict[str, Any]) -> Any:
        """Each rank loads its own file of the newest step every rank can load: from its
        node's tier 0 copy, else from a peer's copy (sent over and verified), else from
        tier 1; every rank learns every rank's outcome, so all return the same step or
        all raise (DESIGN invariant 11)."""
        if step is not None:
            step = validate_step(step)
        # Tier 1 is read newest first, down to the first candidate only; a fallback
        # below that (the newer candidates failed to load) reads the rest of it.
        v = self._views_multi(newest=True, want=step)
        loadable = self._loadable(v)
        skipped: list[str] = []
        tried: set[int] = set()
        while True:
            slow, infos, mine = v.slow, v.infos, v.locals_[self.rank]
            pending = [step] if step is not None else sorted(loadable, reverse=True)
            pending = [c for c in pending if c not in tried]
            if v.slow_floor is not None and (not pending or pending[0] < v.slow_floor):
                v = self._views_multi()  # every rank alike: the same agreed outcomes
                loadable = self._loadable(v)
                continue
            if not pending:
                break
            s = pending[0]
            tried.add(s)
            plan = self._fetch_plan(v, s) if self._peer_group is not None else []
            # A rank whose own tier 0 holds its file loads it while the fetch runs: the
            # fetch's receivers load last, so only their load follows the transfer.
            with ThreadPoolExecutor(1, thread_name_prefix="atomic-checkpoint-load") as pool:
                early = pool.submit(self._load_mine, 0, s, kwargs) if plan and s in mine else None
                peer_node = self._fetch_from_peers(v, s, plan)
            tiers: list[int | str] = [
                t
                for t, held in ((0, s in mine), ("peer", peer_node is not None), (1, s in slow))
                if held
            ]
            state: Any = None
            used: int | str | None = None
            problem: tuple[str, str] | None = None
            for tier in tiers:
                try:
                    if tier == 0 and early is not None:
                        state = early.result()
                    else:
                        state = self._load_mine(tier, s, kwargs, peer_node)
                    used, problem = tier, None
                    break
                except Exception as exc:  # shared below: every rank raises alike
                    kind = "corrupt" if isinstance(exc, CorruptCheckpointError) else "error"
                    problem = (kind, f"rank {self.rank}, tier {tier}: {type(exc).__name__}: {exc}")
                    log.warning("restore: step %d %s; trying the next copy", s, problem[1])
            if not tiers:
                problem = ("missing", f"rank {self.rank}: step {s} is on no tier it can read")
            # Rank 0 collects the outcomes; every rank gets one summary (O(N) bytes).
            problems, used_tiers, from_peers = gather_summary(
                self._coord,
                f"tiered: restore {s}",
                (used, problem),
                _restore_outcomes,
                timeout_s=self.timeout_s,
            )
            if not problems:
                info = infos.get(s)
                if info is not None:
                    self.last_restored = dataclasses.replace(
                        _tiered(info, used_tiers), from_peers=from_peers
                    )
                if from_peers and s not in slow and (not slow or s > max(slow)):
                    # Some node's files of it are only in peer copies now (its tier 0
                    # was wiped): replicated from there (_node_copy), as a save would be.
                    # Every rank alike (from_peers and slow are agreed). No peer round:
                    # the copies that restore used are where they were.
                    self._queue(s, peer_round=False)
                return state
            text = "; ".join(m for _k, m in problems)
            if step is not None or any(k == "error" for k, _m in problems):
                error_type = (
                    CorruptCheckpointError
                    if all(k == "corrupt" for k, _m in problems)
                    else CheckpointNotFoundError
                    if all(k == "missing" for k, _m in problems)
                    else CheckpointError
                )
                raise error_type(f"restore of step {s}: {text}")
            skipped.append(f"step {s}: {text}")
        if skipped:
            raise CorruptCheckpointError(
                "no checkpoint every rank can load verifies: " + "; ".join(skipped)
            )
        if v.slow_error is not None:
            raise self._unreadable(v)
        if v.other_shape is not None:
            raise CheckpointError(
                f"no checkpoint of run {self.run_id!r} that every rank can load: "
                f"{v.other_shape}; restore it with the same number of ranks"
            )
        raise CheckpointNotFoundError(
            f"no checkpoint of run {self.run_id!r} that every rank can load from "
            f"{self.fast.root} (each node's own) or {self._slow_storage.url('')}"
        )

    def _load_mine(
        self, tier: int | str, step: int, kwargs: dict[str, Any], peer_node: int | None = None
    ) -> Any:
        if tier == "peer":
            assert peer_node is not None
            reader = self._peer_reader(peer_node)
        else:
            reader = self._local_reader() if tier == 0 else self._slow_reader()
        manifest = catalog.load_checkpoint(reader.storage, step)
        # It reads its own file by rank number (rank=, below): the check that rank=
        # skips in the plain manager.
        check_world_size(manifest, self.world_size)
        return reader._load_here(
            manifest,
            into=kwargs.get("into"),
            device=kwargs.get("device"),
            verify=kwargs.get("verify", True),
            allow_pickle=kwargs.get("allow_pickle"),
            rank=self.rank,
        )

    def _peer_reader(self, node: int) -> CheckpointManager:
        if node not in self._peer_readers:
            self._peer_readers[node] = self._read_only(self._peer_storage(node))
        return self._peer_readers[node]

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
        self._not_on_the_replicator("wait_replicated()")
        if step is not None:
            step = validate_step(step)
        with self._cv:
            reconciled = self._reconciled
            if step is not None:
                limit, only = step, True
            else:
                # Every step committed so far. Before tier 1 was first reached, which of
                # tier 0's steps it lacks is unknown: tier 0's newest bounds them.
                limit, only = max(self._todo | self._failed.keys(), default=-1), False
        if not reconciled and step is None:
            limit = max({limit} | self._still_on_fast())

        def waiting() -> set[int]:
            if only:
                return {limit} & self._todo
            return {s for s in self._todo if s <= limit}

        with self._cv:
            self._cv.wait_for(
                lambda: self._fatal is not None or (self._reconciled and not waiting()),
                timeout=timeout_s,
            )
            failures = dict(self._failed)
            given_up = sorted(s for s in failures if s == limit or (not only and s <= limit))
        # A step replication gave up on (its tier 0 copy fails its checksums) is not on
        # the persistent tier: "every step committed so far" is not there while tier 0
        # still holds it. Only the failures new to this call were raised, so a failure
        # recorded just before it (or a second call) returned True.
        if given_up and not only:
            given_up = sorted(set(given_up) & self._still_on_fast())
        if given_up:
            raise failures[given_up[0]]
        with self._cv:
            if not self._reconciled or waiting():
                if self._fatal is not None:
                    raise CheckpointError(
                        f"replication to {self._slow_storage.url('')} stopped: {self._fatal}"
                    )
                return False
            known = step is None or step in self._replicated
        if not known and not self._is_on_slow(step):  # type: ignore[arg-type]
            # The hint only where the step may have been meant as a timeout
            # (wait_replicated(30)); a rolled-back step was read as one too.
            hint = (
                f" (the first argument is a step; to wait for every step at most {step} s, "
                f"call wait_replicated(timeout_s={step}))"
                if timeout_s is None
                else ""
            )
            raise CheckpointNotFoundError(
                f"step {step} is not a checkpoint of {self.fast.root} (never committed, or "
                f"removed since: rollback, retention), so it is not being replicated{hint}"
            )
        return True

    def _still_on_fast(self) -> set[int]:
        """This run's steps committed on tier 0 now (one listing)."""
        return {
            m.step for m in catalog.committed(self._fast_storage, run_id=self.run_id, warn=False)
        }

    def _never_replicated(self) -> list[int]:
        """The steps replication gave up on (``replication_failures``) that tier 0 still
        holds: on tier 0 only, for good."""
        with self._cv:
            failed = set(self._failed)
        return sorted(failed & self._still_on_fast()) if failed else []

    def _is_on_slow(self, step: int) -> bool:
        try:
            catalog.load_checkpoint(self._slow_storage, step)
        except CheckpointError:
            return False
        return True

    @property
    def last_replication_error(self) -> BaseException | None:
        """Why the last attempt to reach the persistent tier failed (None once an
        attempt succeeded): replication is retrying while this is set. Once replication
        has stopped for good (a rank gone, which ``wait_replicated`` raises), why it
        stopped, so that a thread watching this sees it without waiting."""
        with self._cv:
            return self._fatal if self._fatal is not None else self._last_error

    def replication_failures(self) -> dict[int, CheckpointError]:
        """The steps that will never be replicated from this tier 0, with why (a copy
        that fails its checksums, another copy of the step already on tier 1)."""
        with self._cv:
            return dict(self._failed)

    def replication_backlog(self) -> list[int]:
        """The steps committed on tier 0 and not yet on the persistent tier (before the
        persistent tier was first reached: every step tier 0 holds)."""
        with self._cv:
            todo, reconciled = set(self._todo), self._reconciled
        if not reconciled:
            todo |= self._still_on_fast()
        return sorted(todo)

    # ------------------------------------------------------------------ discovery
    def _slow_within(self, fn: Callable[[], _R]) -> _R:
        """``fn()`` reading tier 1, or ``StorageError`` once it has not answered within
        the start's bound (``min(timeout_s, 30 s)``; with several ranks at most half of
        ``timeout_s``, as the others wait for it): an endpoint that accepts
        connections and never answers held ``restore``/``latest``/``checkpoints`` for
        its client's minutes of retries, where tier 0 could answer (the read goes on in
        the background until it ends)."""
        return answer_within(
            self._slow_wait_s, f"the persistent tier {self._slow_storage.url('')}", fn
        )

    def _slow_reader(self) -> CheckpointManager:
        # A separate read-only manager (its own storage object): restore and listing
        # never wait for, or share state with, the replicator's copy in flight.
        if self._reader is None:
            self._reader = self._read_only(self._slow_read_storage())
        return self._reader

    def _slow_read_storage(self) -> Storage:
        if self._reader_storage is None:
            self._reader_storage = _open(self.tiers[1])
        return self._reader_storage

    def _tier_lists(self) -> tuple[list[CheckpointInfo], list[CheckpointInfo] | None]:
        fast = self.fast.checkpoints()
        try:
            slow: list[CheckpointInfo] | None = self._slow_within(
                lambda: self._slow_reader().checkpoints()
            )
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

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that commits tier 0's copy of this rank's node (as
        ``CheckpointManager.is_coordinator``)."""
        return self.fast.is_coordinator

    def verify(self, step: int) -> TieredCheckpointInfo:
        """Full checksum verification of every copy of ``step`` this rank can read:
        tier 0's (this node's copy) and tier 1's. Run on the calling rank.

        Returns:
            The step's info (the fastest tier's), with ``tiers`` the tiers whose copy
            verified.

        Raises:
            CorruptCheckpointError: a copy fails its checksums (the message names the
                tier, and says whether the other tier's copy verified: ``restore``
                falls back to a good one).
            CheckpointNotFoundError: neither tier holds the step.
            StorageError: tier 1 cannot be read and tier 0 does not hold the step.
        """
        self._check_open()
        step = validate_step(step)
        found: list[tuple[int, CheckpointInfo]] = []
        corrupt: list[str] = []
        missing: CheckpointError | None = None
        for tier, storage in ((0, self._fast_storage), (1, self._slow_read_storage())):
            try:
                m = catalog.load_checkpoint(storage, step, full=True)
            except CheckpointNotFoundError as exc:
                missing = exc
                continue
            except CorruptCheckpointError as exc:
                corrupt.append(f"tier {tier}: {exc}")
                continue
            except StorageError:
                if tier == 0 or not found:
                    raise
                log.warning("verify: tier 1 (%s) cannot be read", self._slow_storage.url(""))
                continue
            found.append((tier, m.info(storage.url(checkpoint_name(step)))))
        if corrupt:
            good = f"tier {found[0][0]}'s copy verified" if found else "no copy verified"
            raise CorruptCheckpointError(f"step {step}: {'; '.join(corrupt)} ({good})")
        if not found:
            raise CheckpointNotFoundError(
                f"step {step} is on neither tier ({self.fast.root}, {self._slow_storage.url('')})"
            ) from missing
        return _tiered(found[0][1], tuple(t for t, _ in found))

    def checkpoints(self) -> list[TieredCheckpointInfo]:
        """Every step valid on some tier, ascending, each with the tiers that hold it
        (``tiers``); the info is the fastest holder's. Multi-rank (collective): the steps
        every rank can load from some tier; ``tiers`` has 0 when every rank's node holds
        it locally."""
        if self._multi:
            return self._checkpoints_multi()
        fast, slow = self._tier_lists()
        by_step: dict[int, tuple[CheckpointInfo, list[int]]] = {}
        for tier, infos in ((0, fast), (1, slow or [])):
            for info in infos:
                _first, held = by_step.setdefault(info.step, (info, []))
                held.append(tier)
        return [_tiered(info, tuple(held)) for _step, (info, held) in sorted(by_step.items())]

    def latest(self) -> TieredCheckpointInfo | None:
        """The newest step valid on some tier (presence and sizes checked, as
        ``CheckpointManager.latest``), with the tiers that hold it. Multi-rank
        (collective): the newest step every rank can load from some tier."""
        if self._multi:
            # Tier 1 read newest first down to the newest step every rank can load:
            # what is listed at or above its floor is exactly what a full listing has.
            v = self._views_multi(newest=True)
            held = [
                c
                for c in self._checkpoints_multi(v)
                if v.slow_floor is None or c.step >= v.slow_floor
            ]
            return held[-1] if held else None
        found = [(0, self.fast.latest())]
        try:
            found.append((1, self._slow_within(lambda: self._slow_reader().latest())))
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

        Multi-rank (collective): the newest step every rank can load; each rank reads
        its own file from its node's tier 0 copy, else from the persistent tier (a node
        whose local tier was wiped), and every rank returns that step or raises alike.
        ``last_restored.tiers`` lists the tiers the ranks read from; ``rank=`` (another
        rank's part) is for a single process and raises ``ValueError`` here.
        """
        if self._multi:
            if kwargs.get("rank") is not None:
                # Each rank's load is placed by the tiers (its node's tier 0 holds its
                # own file): rank= was ignored, and every rank got its own part.
                raise ValueError(
                    f"restore(rank={kwargs['rank']!r}) reads one rank's part in a single "
                    f"process; in this job of {self.world_size} ranks each rank restores "
                    "its own. To read another rank's part, open the persistent tier: "
                    f"CheckpointManager({self._slow_storage.url('')!r}, read_only=True)"
                    ".restore(step, rank=r)"
                )
            return self._restore_multi(step, kwargs)
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
        ``timeout_s`` (default: the manager's ``timeout_s``), stop the replicator, apply
        tier 0's retention to the steps the drain released (``apply_retention``), then
        release tier 0's run lock and close tier 1. Idempotent.

        Returns:
            The steps that did not reach the persistent tier (empty when drained). They
            stay on tier 0 and are replicated at the next start on the same tier 0, but
            for those replication gave up on (``replication_failures()``: a tier 0 copy
            that fails its checksums), which never will be.

        Multi-rank: collective. The replicators stop together, at the start of their
        next round (a copy in flight is discarded, never half committed): a rank whose
        ``close()`` comes first waits for the others' (at most the manager's
        ``timeout_s``; with ``close(timeout_s=T)``, at most ``T`` and 2 s for the
        replicator to stop, which is then left behind if it has not).
        """
        if self._closed:
            return list(self._left_at_close)
        self._not_on_the_replicator("close()")
        # Under tier 0's save slot, as CheckpointManager.close: a save on another thread
        # ends first (closed under it, tier 0's lock went while it still wrote), a second
        # close() waits for the first and returns what it returned, and a close inside a
        # save on this thread runs once that save has ended.
        if not self.fast._close_in_save_slot(
            functools.partial(self._close, timeout_s), lambda: self._closed
        ):
            return self.replication_backlog()
        return list(self._left_at_close)

    def _close(self, timeout_s: float | None) -> list[int]:
        """``close``, with tier 0's save slot held by this thread."""
        error: BaseException | None = None
        stopped = False

        def stop_replication(saved: bool, *, drain: bool = True) -> None:
            # Tier 0's saves are done and its run lock still held.
            nonlocal stopped
            bound = self.timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + (bound if drain else 0.0)
            try:
                if drain:
                    self._drain(bound)
            finally:  # an interrupt (Ctrl-C) in the drain still stops the replicator
                with self._cv:
                    self._stop.set()
                    self._cv.notify_all()
            # A copy in flight stops between chunks; a replicator inside one storage call
            # that does not answer (an unreachable tier 1 and its client's retries) is
            # left behind once the bound is spent: it can no longer commit anything half
            # way, and close() keeps its word on timeout_s.
            # (Multi-rank: the replicators stop together, at their next agreed exchange,
            # which waits up to the manager's timeout_s for the other ranks' close(); an
            # explicit close(timeout_s=) is kept instead, as a preempted job's grace
            # period must be: it overran by the manager's timeout_s, 600 s by default.)
            grace = self.timeout_s if self._multi and drain and timeout_s is None else _STOP_GRACE_S
            self._thread.join(max(deadline - time.monotonic(), grace))
            stopped = True
            stuck = (self._thread, self._opener, self._io_worker)
            if any(t is not None and t.is_alive() for t in stuck):
                log.warning(
                    "close(): the replicator is still waiting for %s after %g s: left behind; "
                    "tier 1's run lock is released in the background (or lapses with its "
                    "lease)",
                    self._slow_storage.url(""),
                    bound,
                )
                threading.Thread(
                    target=self._drop_persistent, name="atomic-checkpoint-release", daemon=True
                ).start()
            else:
                self._drop_persistent()
            if saved and self.fast.retention is not None:
                # The drain released steps that tier 0's retention held for replication
                # (the last saves' steps, copied after their rotation): without this they
                # would stay beyond the policy until the next job's first save.
                try:
                    self.fast.apply_retention()
                except CheckpointError as exc:  # the same on every rank; nothing lost
                    log.warning("tier 0's retention at close failed: %s", exc)

        try:
            if not self.fast._closed:
                self.fast._close("close()", stop_bound_s=None, before_release=stop_replication)
        except BaseException as exc:  # raised below, after the replicator has stopped
            error = exc
        if not stopped:
            # Interrupted (Ctrl-C): stop without draining, which waited for the whole
            # drain (up to timeout_s) before the interrupt was raised.
            stop_replication(False, drain=error is None or isinstance(error, Exception))
        if self._peer_group is not None and self.fast.is_coordinator:
            self._prune_peer_copies()  # tier 0's last rotation is done (closed above)
        for reader in (self._reader, self._local_reader_mgr, *self._peer_readers.values()):
            if reader is not None:
                reader.close()
        left = self.replication_backlog()
        if left:
            with self._cv:
                reached = self._reconciled
            url = self._slow_storage.url("")
            # Never reached: some of them may well be there from an earlier run.
            where = (
                f"not replicated to {url}"
                if reached
                else f"not known to be on {url}, which this run never reached"
            )
            log.warning(
                "closed with steps %s %s (%s); they stay on %s and are replicated (if "
                "missing there) when a TieredCheckpointManager opens these tiers again",
                left,
                where,
                self._last_error or self._fatal or "time ran out",
                self.fast.root,
            )
        never = self._never_replicated()
        if never:
            log.warning(
                "closed with steps %s on %s only: replication gave up on them in this run "
                "(%s; `atomic-checkpoint verify %s` checks a copy said to be corrupt, and "
                "the next start, or `atomic-checkpoint drain` on every node, tries again)",
                never,
                self.fast.root,
                "; ".join(f"step {s}: {self._failed[s]}" for s in never),
                self.fast.root,
            )
        left = sorted(set(left) | set(never))
        self._left_at_close, self._closed = left, True
        if error is not None:
            raise error
        return left

    def _not_on_the_replicator(self, what: str) -> None:
        """Refuse a call that waits for replication from the replicator's own thread
        (``on_commit(1, info)`` runs there): it waited for itself, and replication
        stopped for good."""
        if threading.current_thread() is getattr(self, "_thread", None):
            raise CheckpointError(
                f"{what} was called from on_commit(1, ...), on the replicator's thread: it "
                "would wait for itself. on_commit(1, info) is called once step info.step "
                "is committed on the persistent tier: there is nothing to wait for"
            )

    def _drain(self, timeout_s: float | None) -> None:
        with self._cv:
            self._cv.wait_for(
                lambda: (
                    (self._reconciled and not self._todo and not self._peer_todo)
                    or self._fatal is not None
                ),
                timeout=timeout_s,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                "this TieredCheckpointManager is closed (close(), or the end of its with "
                "block): open a new one to go on"
            )

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        close_propagating(self, exc)

    def __repr__(self) -> str:
        return (
            f"TieredCheckpointManager({self.fast.root!r} -> {self._slow_storage.url('')!r}, "
            f"run_id={self.run_id!r})"
        )


def _next_round(
    reports: list[tuple[bool, int | None, int | None]],
) -> tuple[bool, list[int] | None, int | None]:
    """The multi-rank replicator's first exchange of a round, on rank 0: whether any
    rank is stopping; the steps of a rollback once every rank asks for one (each rank's:
    they should be one step); and the oldest step any rank has for a peer round."""
    stop = any(s for s, _, _ in reports)
    asked = [r for _, _, r in reports]
    back = None if any(r is None for r in asked) else [int(r) for r in asked if r is not None]
    return stop, back, _oldest(p for _, p, _ in reports)


def _busy_ranks(
    reports: list[tuple[bool, bool, int | None, bool]],
) -> tuple[str, bool, int | None, bool]:
    """A meeting of ``_while_working``, on rank 0: the ranks still working ("" when
    none; the first 8 named, so the answer stays small at any scale), whether any rank
    is stopping, the oldest step any rank has for a peer round (as ``_next_round``), and
    whether any rank's rollback caller gave up."""
    busy = [r for r, (working, *_) in enumerate(reports) if working]
    peer = _oldest(p for _, _, p, _ in reports)
    stopping = any(stop for _, stop, _, _ in reports)
    return (ranks_text(busy, 8) if busy else ""), stopping, peer, any(g for *_, g in reports)


def _oldest(steps: Iterable[int | None]) -> int | None:
    """The oldest step some rank has for a peer round (a rank whose save has not
    returned yet has None)."""
    return min((s for s in steps if s is not None), default=None)


def _stop_at_exit(ref: weakref.ref[TieredCheckpointManager], pid: int) -> None:
    """Interpreter exit without ``close()``: stop the replicator (an attempt in flight is
    discarded, never half committed), bounded, without draining."""
    mgr = ref()
    if mgr is None or mgr._closed or os.getpid() != pid:
        return
    with mgr._cv:
        mgr._abandon = True
        mgr._stop.set()
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
    return storage_for(tier.root, tier.storage_options)


def _recorded_run_id(storage: Storage) -> str | None:
    """The run id in a root's run file, or None (no run file, or an unreadable one: the
    manager that opens the root then says what is wrong)."""
    try:
        return catalog.recorded_run_id(storage)
    except CheckpointError:
        return None


def _newest_run_id(storage: Storage) -> str | None:
    """The run of the newest checkpoint in a root without a run file (the persistent
    tier: its manager is opened with tier 0's run id and records none)."""
    newest = catalog.newest(storage, run_id=None, warn=False)
    return None if newest is None else newest.run_id


def _tiered(info: CheckpointInfo, tiers: tuple[int, ...]) -> TieredCheckpointInfo:
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(CheckpointInfo)}
    return TieredCheckpointInfo(**fields, tiers=tiers)


# Peer copies live on tier 0 beside the node's own checkpoints, out of the catalog's
# sight (it lists ``checkpoint-<step>`` names only): ``.peers/node-<n>/checkpoint-<S>``.
_PEERS = layout.PEERS_DIR
_INCOMING = ".incoming-"
# Gloo tags: a replication round (replicator thread) and a restore (training thread)
# never take each other's messages.
_TAG_REPLICATE = 1
_TAG_RESTORE = 2


def _chunk_sizes(size: int) -> list[int]:
    return [min(_CHUNK, size - off) for off in range(0, size, _CHUNK)]


def _route_fetch_metas(
    coord: Coordinator,
    step: int,
    plan: list[tuple[int, int, int]],
    metas: dict[int, dict[str, Any]],
    timeout_s: float,
) -> Any:
    """A peer fetch's first round (collective): each holder's ``metas`` (receiving
    leader -> what it sends, ``_node_meta``) go to their receivers alone, through rank
    0: O(N) bytes a round, as a save's. Returns this rank's (a receiver always gets
    one), or None."""
    holder_of = {lead: h for lead, h, _n in plan if h != lead}
    _, _, routed = gather_routed(
        coord,
        f"tiered: peer fetch {step}",
        f"peer fetch {step}",
        lambda: metas,
        lambda _sent: None,
        lambda sent: {lead: sent[h][lead] for lead, h in holder_of.items()},
        dst=0,
        routed=coord.rank in holder_of,
        timeout_s=timeout_s,
    )
    return routed


def _share_rejections(
    coord: Coordinator, step: int, result: str | None, timeout_s: float
) -> dict[int, str]:
    """A peer fetch's last round (collective): every rank learns which receiving
    leaders rejected their copy, and why (``result``: this rank's reason, or None);
    each reads that one answer, not every rank's result."""
    return gather_summary(
        coord, f"tiered: peer fetched {step}", result, _rejections, timeout_s=timeout_s
    )


def _rejections(results: list[str | None]) -> dict[int, str]:
    """A peer fetch's outcome, on rank 0: each receiving leader's reason for rejecting
    its copy (indexed by rank), nothing for the copies that verified."""
    return {rank: why for rank, why in enumerate(results) if why is not None}


def _node_meta(storage: Storage, step: int) -> dict[str, Any]:
    """What a sender tells every rank before a transfer: its committed manifest's bytes
    (files, sizes, checksums of the save), or why it has none."""
    name = checkpoint_name(step)
    try:
        manifest = catalog.load_checkpoint(storage, step)
        for entry in manifest.files:
            catalog.check_inside(storage, name, entry.path)
        raw = storage.read_bytes(f"{name}/{MANIFEST_NAME}")
        Manifest.from_json_bytes(raw, where=storage.url(name))
    except CheckpointError as exc:
        return {"error": f"{storage.url(name)}: {type(exc).__name__}: {exc}"}
    return {"manifest": raw}


def _files_of(meta: Mapping[str, Any]) -> Manifest:
    return Manifest.from_json_bytes(meta["manifest"], where="a peer's manifest")


def _read_chunks(storage: Storage, name: str, manifest: Manifest) -> Any:
    """The sender's stream: every file of the manifest, in order, in ``_CHUNK`` pieces
    of exactly the recorded sizes. What cannot be read goes out as zeros (the receiver's
    checksums reject it): the receiver expects exactly these sizes."""
    import torch

    out = torch.empty(
        min(_CHUNK, max((e.size_bytes for e in manifest.files), default=0)), dtype=torch.uint8
    )
    for entry in manifest.files:
        reader: Any = None
        try:
            reader = storage.open_read(f"{name}/{entry.path}")
        except Exception as exc:
            log.warning("peer copy: cannot read %s: %s", storage.url(name), exc)
        try:
            for n in _chunk_sizes(entry.size_bytes):
                buf = out[:n]  # the caller sends each chunk before it asks for the next
                got = 0
                if reader is not None:
                    try:
                        view = memoryview(buf.numpy())  # type: ignore[arg-type]
                        while got < n and (k := reader.readinto(view[got:])):
                            got += k
                    except Exception as exc:
                        log.warning("peer copy: reading %s failed: %s", entry.path, exc)
                        reader.close()
                        reader = None
                if got < n:
                    buf[got:] = 0  # a short or failed read: zeros, which the checksum rejects
                yield buf
        finally:
            if reader is not None:
                reader.close()


class _PeerSink:
    """The receiver's side of one transfer: writes a node's files under a staged
    directory, hashing every byte, and commits them as ``checkpoint-<step>`` only if
    each file matches the sender's manifest (size and checksum)."""

    def __init__(self, storage: Storage, peer_dir: str, step: int, meta: Mapping[str, Any]):
        self.storage = storage
        self.peer_dir = peer_dir
        self.raw: bytes = meta["manifest"]
        self.manifest = _files_of(meta)
        self.final = f"{peer_dir}/{checkpoint_name(step)}"
        self.staged = f"{peer_dir}/{_INCOMING}{new_attempt_token()}"
        self.error: str | None = None
        self._i = -1
        self._left = 0
        self._writer: Any = None
        self._hasher: Hasher | None = None
        try:
            storage.makedirs(self.staged)
        except CheckpointError as exc:
            self.error = f"{storage.url(self.staged)}: {exc}"

    def chunk_sizes(self) -> list[int]:
        return [n for e in self.manifest.files for n in _chunk_sizes(e.size_bytes)]

    def _advance(self) -> None:
        """Finish the current file (if any) and open the next one."""
        if self._i >= 0:
            self._finish()
        self._i += 1
        entry = self.manifest.files[self._i]
        self._left = entry.size_bytes
        self._hasher = Hasher(self.manifest.checksum_algorithm)
        self._writer = None
        if self.error is None:
            path = f"{self.staged}/{entry.path}"
            try:
                if "/" in entry.path:
                    self.storage.makedirs(path.rsplit("/", 1)[0])
                self._writer = self.storage.open_write(path, size_hint=entry.size_bytes)
            except CheckpointError as exc:
                self.error = f"{self.storage.url(path)}: {exc}"

    def _finish(self) -> None:
        entry = self.manifest.files[self._i]
        assert self._hasher is not None
        digest = self._hasher.hexdigest()
        if self._writer is not None:
            try:
                self._writer.close()  # fsync'd through its descriptor
            except CheckpointError as exc:
                self.error = self.error or f"{self.storage.url(self.staged)}: {exc}"
            self._writer = None
        if self.error is None and digest != entry.checksum:
            self.error = (
                f"{entry.path} arrived with checksum {digest}, the sender's manifest records "
                f"{entry.checksum}: the copy is rejected"
            )

    def write(self, data: Any) -> None:
        while self._left == 0:
            self._advance()
        view = memoryview(data)
        assert self._hasher is not None
        self._hasher.update(view)
        self._left -= len(view)
        if self._writer is not None:
            try:
                self._writer.write(view)
            except CheckpointError as exc:
                self.error = self.error or f"{self.storage.url(self.staged)}: {exc}"
                self._writer.abort()
                self._writer = None

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        try:
            self.storage.delete_tree(self.staged)
        except CheckpointError as exc:
            log.warning("could not remove %s: %s", self.storage.url(self.staged), exc)

    def commit(self) -> str | None:
        """Verify the last files, then publish: manifest last, one rename. Returns
        None, or why the copy was rejected (then nothing of it remains)."""
        try:
            while self._i + 1 < len(self.manifest.files):
                self._advance()  # zero-byte files after the last chunk
            if self._i >= 0:
                self._finish()
        except CheckpointError as exc:
            self.error = self.error or str(exc)
        if self.error is not None:
            self.abort()
            return self.error
        try:
            self.storage.write_bytes_atomic(f"{self.staged}/{MANIFEST_NAME}", self.raw)
            self.storage.fsync_dir(self.staged)
            if self.storage.is_dir(self.final):
                self.storage.delete_tree(self.final)  # an older copy of the step
            renaming(self.storage).rename_dir(self.staged, self.final)
            self.storage.fsync_dir(self.peer_dir)
        except CheckpointError as exc:
            self.abort()
            return f"committing {self.storage.url(self.final)}: {exc}"
        return None


def _restore_outcomes(
    outcomes: list[tuple[int | str | None, tuple[str, str] | None]],
) -> tuple[list[tuple[str, str]], tuple[int, ...], tuple[int, ...]]:
    """Every rank's outcome of loading one step (the tier it used, or its problem), as
    every rank needs it: the problems in rank order, the tiers used (a peer's copy is on
    tier 0, another node's) and the ranks that loaded a peer's copy."""
    problems = [p for _u, p in outcomes if p is not None]
    used = {0 if u == "peer" else u for u, _p in outcomes if u is not None}
    peers = tuple(r for r, (u, _p) in enumerate(outcomes) if u == "peer")
    return problems, tuple(sorted(int(t) for t in used)), peers


def _run_id_of(
    views: list[tuple[str | None, bool, tuple[str, int]]],
) -> tuple[str | None, bool, str | None]:
    """The run id rank 0 names, else the first any node names; whether some node could
    not read the persistent tier; and, when the ranks' settings (persistent tier,
    ``peers``) differ, the first ranks of each, as words (else None)."""
    settings: dict[tuple[str, int], list[int]] = {}
    for rank, (_r, _u, mine) in enumerate(views):
        settings.setdefault(tuple(mine), []).append(rank)  # type: ignore[arg-type]
    differ = None
    if len(settings) > 1:
        differ = "; ".join(
            f"rank(s) {ranks_text(ranks, 4)}: {url}, peers={k}"
            for (url, k), ranks in settings.items()
        )
    return next((r for r, _u, _s in views if r), None), any(u for _r, u, _s in views), differ
