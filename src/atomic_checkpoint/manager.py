"""``CheckpointManager``: the facade users touch. It composes storage, coordination,
the commit protocol, serialization and retention; it owns no I/O of its own.

Two lines in a torchrun script::

    mgr = CheckpointManager("/ckpt/run1", retention=KeepLast(3) | KeepBest(1, "eval_loss"))
    mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})

Every public method that a distributed job calls is collective: call it on every rank,
in the same order. The coordinator (rank 0 of the storage domain) decides, the others
follow its broadcast decision (DESIGN invariant 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsFloat, TypeVar, cast

from . import catalog, commit
from ._checks import flag as _flag
from ._checks import positive_seconds as _positive_seconds
from ._checks import retention_policy
from ._checks import wait_seconds as _wait_seconds
from ._params import parameters_of
from ._version import __version__
from .async_save import AsyncSaver, SaveHandle, SnapshotPool
from .commit import SaveContext
from .coordination import (
    Coordinator,
    agree,
    default_coordinator,
    gather_summary,
    rank_failure,
    run_on_leaders,
    shared_error,
)
from .domains import Domain
from .domains import discover as discover_domains
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FencedError,
    RankFailure,
    ReadOnlyError,
    ResumeError,
    StateMismatchError,
    StepOrderError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    UnsafeCheckpointError,
    permission_advice,
)
from .layout import (
    MANIFEST_NAME,
    META_DIR,
    PENDING_DIR,
    REPLICATED_STATE_FILE,
    RUN_FILE,
    checkpoint_name,
    new_attempt_token,
    new_run_id,
    parse_checkpoint_name,
    rank_state_file,
    run_doc,
    validate_step,
)
from .lock import DEFAULT_LEASE_S, RunLock
from .manifest import (
    SCHEMA_VERSION,
    CheckpointInfo,
    FileEntry,
    Hasher,
    Manifest,
    SharedManifest,
    check_metadata,
    check_metrics,
    format_size,
)
from .rankfiles import RankReport, Staging, write_image, write_plan
from .retention import RetentionPolicy
from .storage import posix, storage_for, visibility
from .storage.base import Storage, direct_io, full_storage_error
from .storage.temps import abandoned_temps
from .strategies import CommitStrategy, choose_strategy

if TYPE_CHECKING:
    from .adopt import AdoptResult

log = logging.getLogger("atomic_checkpoint")

#: The managers of this process (weakly): a second one on a ROOT waits for the first's
#: fenced async save before it sweeps (``_wait_for_fenced_saves``).
_OPEN_MANAGERS: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()

#: ``with`` gives back the same object, subclass included.
_Self = TypeVar("_Self")

_RESUME_MODES = ("auto", "must", "never")
# close(timeout_s=T): how long an async save asked to stop at T gets to end (a write
# stops at its next chunk) before close returns without it.
_STOP_MOMENT_S = 0.5


_F = TypeVar("_F", bound=Callable[..., Any])


def _one_at_a_time(method: _F) -> _F:
    """Run a save method of ``CheckpointManager`` inside its ``_save_slot``."""

    @functools.wraps(method)
    def wrapper(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
        with self._save_slot(f"{method.__name__}()"):
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


def check_world_size(manifest: Manifest, world_size: int) -> None:
    """Refuse per-rank state saved by another number of ranks: each rank reads its own
    file by rank number, so a smaller job would load the first ranks' states and drop
    the others', and a larger one would find none for its last ranks.

    Raises:
        CheckpointError: the world sizes differ (replicated state passes).
    """
    if manifest.state_kind != "replicated" and manifest.world_size != world_size:
        raise CheckpointError(
            f"checkpoint step {manifest.step} holds per-rank state of "
            f"{manifest.world_size} rank(s) but this job has {world_size}; restore it with "
            "the same world size, or save with the DCP integration for resharding (one "
            "process reads one rank's part with restore(rank=r))"
        )


def check_placement(manifest: Manifest, rank: int, *, asked: bool = False) -> None:
    """Refuse, with the cause, a rank's load of per-rank state from a node that does
    not hold it: with node-local disks each node's copy has the files of the ranks
    that ran there when it was saved (``Manifest.domain_ranks``). ``asked``: the part
    was asked for by ``restore(rank=...)``, not by the rank itself.

    Raises:
        CheckpointError: ``rank`` is not among them.
    """
    ranks = manifest.domain_ranks
    if manifest.state_kind == "replicated" or ranks is None or rank in ranks:
        return
    if asked:
        # Not a corrupt checkpoint: without this, the missing file made restore fall
        # back to an older step that held every rank, and a loop over the ranks mixed
        # steps.
        raise CheckpointError(
            f"checkpoint step {manifest.step} here is one node's copy: it holds the state "
            f"of ranks {list(ranks)}, not rank {rank}'s. Read rank {rank}'s part from the "
            "root of the node it ran on"
        )
    raise CheckpointError(
        f"checkpoint step {manifest.step} on this node holds the state of ranks "
        f"{list(ranks)} (the ranks that ran on this node when it was saved), not rank "
        f"{rank}'s: with node-local disks each node keeps its own ranks' files, so "
        "start the job with the same ranks on the same nodes as when it saved (e.g. "
        "torchrun's --node-rank as before), or save to storage every node shares"
    )


class CheckpointManager:
    """Saves, discovers, restores and rotates the checkpoints of one run under ``root``.

    Args:
        root: a directory (local, NFS, sshfs, ...) or a ``Storage``.
        retention: a policy such as ``KeepLast(3) | KeepBest(1, metric="eval_loss")``;
            None keeps everything. The newest checkpoint is never deleted.
        run_id: identity of the run; checkpoints of other runs in ``root`` are never
            counted, resumed from or deleted. Default: the run recorded in ``root``
            (so a restarted job continues its run); without a run file there (a
            checkpoint copied into a new root), the one run id its checkpoints carry
            (adopted, with a warning; several raise ``ResumeError``: pass one); else a
            new one.
        coordinator: how ranks agree; default: torch.distributed when a process group
            is initialised, else single process. Creating a manager is then collective
            (every rank, in the same order), and ``run_id``, ``read_only``, ``resume``,
            ``storage_domains``, ``retention`` and ``strategy`` must be the same on
            every rank: else every rank raises ``CollectiveMismatchError`` naming each
            rank's.
        timeout_s: bound on every wait for other ranks.
        read_only: never write, lock or delete (safe while a job runs); on a network
            filesystem, a stale cached listing is dropped by touching a directory's
            times (a metadata write, no data). A root that does not exist yet lists no
            checkpoints (the job has not saved); an object-store bucket that does not
            exist raises ``StorageError`` at the first listing.
        resume: "auto" (resume if there is a valid checkpoint; error if there are
            checkpoints but none is valid, or, with node-local disks, no step of the run
            is on every node while several are on some nodes only; with a step on every
            node it resumes from the newest such step, with a warning naming the newer
            ones), "must" (error if nothing valid), "never"
            (error if this run already has checkpoints: start a new run instead).
        on_commit: called on the coordinator with each ``CheckpointInfo`` after its
            commit is durable (for uploaders: never a pending path); from the save's
            background thread for async saves. An exception it raises is logged with
            its traceback and does not fail the save (the checkpoint is committed).
        allow_pickle: allow saving/loading objects that need pickle. Loading pickle
            executes code from the checkpoint: only for checkpoints you trust.
        visibility_timeout_s: bound on waits for network filesystems to show changes.
        takeover: take the run lock on ``root`` even from a job that may still be
            alive (it is fenced: it can no longer commit or delete). Without it, a
            holder is taken over only when provably gone (same host and its process
            is dead, or its lease expired), when ``run_id`` is passed and equals
            the holder's (a restarted job), or when it is an earlier manager of this
            same process that was not closed (it is fenced; a warning says so);
            otherwise ``LockHeldError`` names it.
        lease_s: the run lock's lease: renewed every ``lease_s / 3``; a holder that
            has not renewed for ``lease_s`` may be taken over from any host. One whose
            renewals fail for 5/6 of it (a full disk, a read-only remount) stops
            committing, and takes the lock back once the storage takes writes again if
            no other job took it (else ``FencedError``, for good).
        storage_domains: which ranks see the same files under ``root``: "auto"
            (probed at start: one file written per host, read by the others), "shared"
            (one storage domain, no probe: trust it), or "per-host" (each host's own
            disk; each host's first rank writes one probe file and looks only for the
            others', without waiting, so that hosts that share ``root`` are refused
            with that cause). Each storage domain commits its own copy through its own
            leader, and a step counts once every domain has it.
        storage_options: for URL roots (``s3://bucket/prefix``, ``gs://...``): fsspec's
            options (``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``, ...).
        strategy: how saves commit: None chooses from the storage (``"rename"`` where
            directory rename is atomic, ``"marker"`` on object stores and on FUSE
            mounts whose rename is copy+delete, such as ``fuse.s3fs``); ``"rename"`` or
            ``"marker"`` forces one; an object implementing
            ``atomic_checkpoint.strategies.CommitStrategy`` (e.g. a subclass of
            ``RenameStrategy``) is used as it is.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        retention: RetentionPolicy | None = None,
        run_id: str | None = None,
        coordinator: Coordinator | None = None,
        timeout_s: float = 600.0,
        read_only: bool = False,
        resume: str = "auto",
        on_commit: Callable[[CheckpointInfo], object] | None = None,
        allow_pickle: bool = False,
        visibility_timeout_s: float = 30.0,
        takeover: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
        storage_domains: str = "auto",
        storage_options: Mapping[str, Any] | None = None,
        strategy: str | CommitStrategy | None = None,
    ):
        if resume not in _RESUME_MODES:
            raise ValueError(f"resume must be one of {_RESUME_MODES}, got {resume!r}")
        retention_policy(retention)
        if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
            raise ValueError("run_id must be a non-empty string")
        timeout_s = _positive_seconds("timeout_s", timeout_s)
        lease_s = _positive_seconds("lease_s", lease_s)
        visibility_timeout_s = _positive_seconds("visibility_timeout_s", visibility_timeout_s)
        read_only, allow_pickle, takeover = (
            _flag("read_only", read_only),
            _flag("allow_pickle", allow_pickle),
            _flag("takeover", takeover),
        )
        if storage_domains not in ("auto", "shared", "per-host"):
            # Checked here too: a single process never reaches the domains' own check.
            raise ValueError(
                f"storage_domains must be 'auto', 'shared' or 'per-host', got {storage_domains!r}"
            )
        self._named_root = isinstance(root, (str, os.PathLike))
        self.storage: Storage = storage_for(root, storage_options)
        if on_commit is not None and not callable(on_commit):
            # Accepted, it failed after every save (logged), and no upload ever ran.
            raise TypeError(
                f"on_commit must be a callable taking a CheckpointInfo, or None; got "
                f"{type(on_commit).__name__} {on_commit!r:.80}"
            )
        if coordinator is not None:
            _check_coordinator(coordinator)
        self.coordinator = coordinator or default_coordinator()
        # Made here, so this manager marks it left at close (``_leave``); one passed in
        # may go on serving other calls (a TieredCheckpointManager's tier 0).
        self._owns_coordinator = coordinator is None
        retention_policy(retention)
        self._retention = retention
        self.timeout_s = timeout_s
        self.read_only = read_only
        self.on_commit = on_commit
        self.allow_pickle = allow_pickle
        self.visibility_timeout_s = visibility_timeout_s
        self._strategy = choose_strategy(self.storage, strategy)
        #: "rename" or "marker" (or a strategy object's name): how this manager's saves
        #: commit.
        self.commit_strategy: str = self._strategy.name
        if self.rank == 0:
            _log_strategy_once(self.storage, self.commit_strategy, forced=strategy is not None)
        self._closed = False
        self._pid = os.getpid()  # a child made by fork cannot use it (_check_process)
        _OPEN_MANAGERS.add(self)
        # What discovery learned about ROOT (validated manifests and the tokens that
        # prove them unchanged): after the first, the rotation after each save and
        # checkpoints() read only what changed since, not every manifest again
        # (catalog.ManifestCache). The start fills it with the few it reads.
        self._manifests = catalog.ManifestCache()
        self._rotation: threading.Thread | None = None
        self._warned_metrics: set[str] = set()  # _warn_unrecorded_metrics, once each
        # Steps restore() skipped because their files failed their checksums, on every
        # rank alike: retention neither keeps nor deletes them (a corrupt newest must not
        # make it delete the valid one training resumed from), and a save of such a step
        # replaces it without overwrite=True (training went on from an older one).
        self._failed_verification: set[int] = set()
        # Steps this manager committed, or restored with every checksum checked: what
        # apply_retention() may count as kept without reading it in full first.
        self._known_good: set[int] = set()
        # One save at a time per manager (see _save_slot): the thread inside one.
        self._save_mutex = threading.Lock()
        self._saver_thread: int | None = None
        # Rotations start on the thread that commits (the async save's, for save_async)
        # and are joined on the training thread: the hand-over goes through this lock.
        self._rotation_lock = threading.Lock()
        self._rotation_error: BaseException | None = None
        self._last_seq = 0
        self._takeover = takeover
        self._lease_s = lease_s
        self._lock: RunLock | None = None
        if self.world_size > 1:
            self._agree_on_settings(
                run_id=run_id,
                read_only=read_only,
                resume=resume,
                storage_domains=storage_domains,
                retention=_policy_setting(retention),
                strategy=self.commit_strategy,
            )
        self.domain: Domain = discover_domains(
            self.storage,
            self.coordinator,
            mode="shared" if read_only else storage_domains,
            timeout_s=self.timeout_s,
            visibility_timeout_s=visibility_timeout_s,
        )
        if self.domain.count > 1 and self.rank == 0:
            log.info(
                "storage under %s is not shared: %d storage domains (leaders: ranks %s); each "
                "commits its own copy and a step counts once every domain has it",
                self.root,
                self.domain.count,
                list(self.domain.leaders),
            )
        agreed = self._agree_run_id() if run_id is None and self.domain.count > 1 else None
        # Each leader's view of ROOT: a rank receives its own leader's (without the
        # steps) and one summary of every leader's, not every view (O(N) bytes).
        try:
            setup, summary = self._on_leaders(
                "open",
                functools.partial(self._setup_coordinator, run_id, agreed, resume),
                combine=_views_summary,
                pick=_without_steps,
            )
            if not summary["decide"]:
                setup, summary = self._full_views(setup)
        except BaseException:
            # A leader that took its domain's lock before another domain's start failed
            # (its lock held by another job, an I/O error) lets go of it: every rank
            # raises, and a manager that never opened must hold nothing.
            self._release_lock()
            raise
        if self.domain.count > 1:
            # With several domains, a step is valid only where every domain has it.
            setup = {**setup, **summary["setup"]}
        self.run_id: str = setup["run_id"]
        self._last_seq = setup["last_seq"]
        # The newest committed step of this run, the same on every rank (the domain
        # leaders' views, agreed at open): saves below it raise StepOrderError.
        self._newest_step: int | None = summary["newest"]
        # This run's checkpoints found corrupt at open (a file missing or of another
        # size): never loaded, and a save of one of those steps replaces it, as after a
        # restore() that skipped one for its checksums (the same on every rank).
        self._failed_verification.update(setup.get("corrupt_steps", ()))
        self._ctx = SaveContext(
            storage=self.storage,
            coord=self.coordinator,
            run_id=self.run_id,
            timeout_s=self.timeout_s,
            strategy=self._strategy,
            visibility_timeout_s=visibility_timeout_s,
            domain=self.domain,
            lock=self._lock,
        )
        self._domain_victims: dict[int, list[int]] = {}
        try:
            self._check_resume_mode(resume, setup)
        except BaseException:
            self._release_lock()
            raise

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that commits, rotates and cleans this rank's storage domain
        (rank 0 when the storage is shared; one rank per node on node-local disks)."""
        return self.coordinator.rank == self.domain.leader

    @property
    def root(self) -> str:
        return self.storage.url("")

    @property
    def retention(self) -> RetentionPolicy | None:
        """The retention policy (None: keep everything). May be set to another
        policy; ``apply_retention()`` applies it at once, else the next save does. The
        clean-up of a save already committed runs under the policy it committed with:
        setting a new one first waits for it."""
        return self._retention

    @retention.setter
    def retention(self, policy: RetentionPolicy | None) -> None:
        retention_policy(policy)
        # The rotation of the last save reads the policy when it runs, off this thread:
        # set at once, a new policy changed (or cancelled) the clean-up of a save that
        # had returned, depending on timing.
        self._finish_rotation()
        self._retention = policy

    def __repr__(self) -> str:
        where = f"rank={self.rank}/{self.world_size}"
        return f"CheckpointManager({self.root!r}, run_id={self.run_id!r}, {where})"

    # ------------------------------------------------------------------ set-up
    def _collective(
        self,
        phase: str,
        fn: Callable[..., Any] | None,
        *,
        pick: Callable[[Any, Any], Any] | None = None,
        want: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn`` on the domain leaders; every rank gets its own leader's result, or
        every rank raises the failure (``_on_leaders``, without a summary)."""
        return self._on_leaders(phase, fn, pick=pick, want=want, **kwargs)[0]

    def _refuse_in_callback(self, phase: str) -> None:
        """Refuse a collective call made inside ``on_commit`` (see ``_on_leaders``)."""
        if self._callback_thread == threading.get_ident():
            raise CheckpointError(
                f"{phase}: a collective call (checkpoints(), latest(), restore(), a save, "
                "...) was made from on_commit, which runs on the coordinator (rank 0) only: "
                "it would wait for ranks that never make it. Make it after save() returns, "
                "on every rank"
            )

    def _agree(self, call: str, value: Any) -> None:
        """``coordination.agree`` on ``call``'s arguments, refused inside ``on_commit``."""
        self._refuse_in_callback(call)
        agree(self.coordinator, call, value, timeout_s=self.timeout_s)

    def _agree_on_settings(self, **settings: Any) -> None:
        """A new manager's first round with several ranks: the settings that steer its
        collective steps are the same on every rank. A ``run_id`` passed on some ranks
        only was rank 0's, silently, and ``read_only=`` or ``storage_domains=`` on some
        ranks made the ranks' rounds differ (a mismatch naming two rounds, not the
        setting); a ``retention=`` or ``strategy=`` that differs by rank was the
        coordinator's alone (retention), or split one save between two layouts
        (strategy). ``CollectiveMismatchError`` names each rank's settings."""
        try:
            self._agree("CheckpointManager()", settings)
        except CoordinationTimeoutError as exc:
            # The usual cause: a manager created on some ranks only (under
            # `if rank == 0:`, the habit of a single-writer save).
            raise CoordinationTimeoutError(
                f"{exc}. Opening a checkpoint manager is collective: create it on every "
                "rank, in the same order (not under `if rank == 0:`)",
                missing_ranks=exc.missing_ranks,
                key=exc.key,
            ) from None

    def _on_leaders(
        self,
        phase: str,
        fn: Callable[..., Any] | None,
        *,
        combine: Callable[[list[Any]], Any] | None = None,
        pick: Callable[[Any, Any], Any] | None = None,
        want: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        """Run ``fn(**kwargs)`` on each storage domain's leader (only there); every rank
        gets its own leader's result and ``combine`` of every leader's result (in the
        order of ``domain.leaders``), or every rank raises the failure. Collective.

        Refused inside ``on_commit``: it runs on the coordinator alone, so with several
        ranks a collective call there waits for ranks that never make it (refused with
        one process too, so that code is not written that fails once there are more).

        ``pick(result, want)``: what a rank other than the leader receives of its
        leader's result, given the ``want`` it sent (e.g. the manifest with only the
        file that rank reads); default: all of it. Each rank receives its own part
        alone and the one summary (``coordination.run_on_leaders``), so a manifest of N
        ranks' files costs O(N) bytes in all rather than N entries to each of N ranks,
        and with several storage domains each rank gets its own leader's result, not
        every leader's."""
        self._refuse_in_callback(phase)
        return run_on_leaders(
            self.coordinator,
            phase,
            phase,
            None if fn is None else functools.partial(fn, **kwargs),
            leader=self.domain.leader,
            leaders=self.domain.leaders,
            timeout_s=self.timeout_s,
            pick=pick,
            want=want,
            combine=combine,
        )

    def _agree_run_id(self) -> str:
        """Node-local disks: every domain must use one run id. Rank 0's recorded run
        wins, then any domain's, then a new one from rank 0."""
        fresh = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"

        def agreed(views: list[tuple[str | None, str]]) -> str:
            recorded = [rid for rid, _ in views if rid]
            return recorded[0] if recorded else views[0][1]

        _, run_id = self._on_leaders(
            "agree run id",
            lambda: (self._recorded_run_id() or self._adopted_run_id(), fresh),
            combine=agreed,
            pick=_nothing,
        )
        return str(run_id)

    def _full_views(self, setup: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Several storage domains whose leaders' views at open do not decide the newest
        step valid everywhere (``_views_summary``: their newest steps differ by more than
        the few each reported): every leader lists all its valid steps, with a full
        scan, as every start did before. Collective; decided on every rank from the same
        summary, so every rank takes part (DESIGN invariant 3)."""
        return self._on_leaders(
            "open: every valid step",
            lambda: {**setup, **self._scan_view(setup["run_id"])},
            combine=_views_summary,
            pick=_without_steps,
        )

    def _scan_view(self, run_id: str) -> dict[str, Any]:
        """This domain's view of ROOT from every manifest in it (``catalog.scan``)."""
        entries = catalog.scan(self.storage, run_id=run_id, cache=self._manifests)
        seqs = [e.manifest.commit_seq for e in entries if e.manifest is not None]
        valid = [e.step for e in entries if e.status == "ok" and e.step is not None]
        return {
            "last_seq": max(seqs, default=0),
            "n_valid": len(valid),
            "n_valid_counted": True,
            "newest": max(valid, default=None),
            "n_corrupt": sum(1 for e in entries if e.status == "corrupt"),
            "corrupt_steps": list(catalog.corrupt_steps_of(entries, run_id)),
            "valid_steps": valid,
            "complete": True,
            "unmanifested": [e.name for e in entries if e.unmanifested],
            "other_runs": catalog.other_runs_of(entries),
            "shapes": self._other_shapes(e.manifest for e in entries if e.status == "ok"),
        }

    def _other_shapes(self, manifests: Iterable[Manifest | None]) -> dict[int, list[int]]:
        """The valid steps of this view saved by a job of another shape than this one:
        step -> [world size, storage domains] of that job. With node-local disks, a job
        that shrank to fewer nodes saves steps that only those nodes hold; a start of
        the whole job again says so (``_check_resume_mode``) instead of "a disk was
        wiped"."""
        me = [self.world_size, self.domain.count]
        return {
            m.step: shape
            for m in manifests
            if m is not None and (shape := [m.world_size, m.domain_count]) != me
        }

    def _check_not_a_checkpoint(self) -> None:
        """Refuse a ROOT that is one checkpoint (``.../checkpoint-30``, a path-style DCP
        save): opened as a root, it held no checkpoint, so the job started from scratch
        and wrote a new run inside the checkpoint."""
        if self.storage.size(MANIFEST_NAME) is None:
            return
        url = self.storage.url("").rstrip("/")
        parent, _, name = url.rpartition("/")
        step = parse_checkpoint_name(name)
        raise CheckpointError(
            f"{url} is one checkpoint (it holds {MANIFEST_NAME}), not a root of checkpoints: "
            f"pass the directory that holds it ({parent or '..'}) to resume from it"
            + (f", or restore(step={step}) there for this one" if step is not None else "")
            + f"; `atomic-checkpoint verify {url}` checks it. Nothing was written"
        )

    def _start_view(self, run_id: str, resume: str) -> dict[str, Any]:
        """What a writable start needs to know about ROOT, reading manifests newest
        first and stopping at the newest valid one (with several storage domains, the
        newest ``_DOMAIN_VIEW_STEPS``), not every manifest in ROOT: a restart costs the
        same with 10 or 10,000 checkpoints.

        - Resume modes: a valid checkpoint answers "is there one"; only when there is
          none is every manifest read, and the corrupt ones are then counted as before.
          ``resume="never"`` with a valid checkpoint is about to refuse the start: the
          checkpoints are counted for its message, as before.
        - The commit number: the next commit's ``commit_seq`` is above every one read,
          and the walk read every checkpoint name at or above this run's newest valid
          step (other runs' and corrupt ones included). That is every name this
          manager's commits can write or replace: saves below the newest step raise
          ``StepOrderError``, ``overwrite`` replaces only the newest step, ``rollback``
          deletes above the step it returns to (their numbers were read). So a new copy
          of a step never repeats the number of the copy it replaces, which is what
          ``catalog.same_copy`` (a reader racing an overwrite) relies on. A lower step
          may carry a higher number without harm (``adopt`` numbers the checkpoints it
          adopts after every one in ROOT): numbers are compared only within one step,
          never across steps.
        - The manifest cache: it holds only what the walk read, so the first rotation
          after a save (retention needs every checkpoint of the run) and the first
          ``checkpoints()`` read the other manifests once, off the training thread for
          the rotation; later ones read only what changed.
        """
        count = 1 if self.domain.count == 1 else _DOMAIN_VIEW_STEPS
        found = catalog.newest_valid(
            self.storage, run_id=run_id, count=count, cache=self._manifests
        )
        if resume == "never" and found.valid and not found.complete:
            return self._scan_view(run_id)
        return {
            "last_seq": found.last_seq,
            "n_valid": len(found.valid),
            "n_valid_counted": found.complete,
            "newest": found.valid[0].step if found.valid else None,
            "n_corrupt": found.corrupt,
            "corrupt_steps": list(found.corrupt_steps),
            "valid_steps": [m.step for m in found.valid],
            "complete": found.complete,
            "unmanifested": list(found.unmanifested),
            "other_runs": dict(found.other_runs),
            "shapes": self._other_shapes(found.valid),
        }

    def _setup_coordinator(
        self, run_id: str | None, agreed_run_id: str | None = None, resume: str = "auto"
    ) -> dict[str, Any]:
        local = self.storage.local_path("")
        if local is not None and posix.exists(local) and not posix.is_dir(local):
            raise StorageError(
                f"checkpoint root {local!r} is a file, not a directory: pass a directory path",
                path=local,
            )
        self._check_not_a_checkpoint()
        if self.read_only:
            # A root named by the user (not a Storage a tiered manager opened on a tier
            # still to be created) that is not there: a typo, or a watcher started before
            # the job (so INFO, not a warning).
            if self._named_root and local is not None and not posix.exists(local):
                log.info(
                    "checkpoint root %s does not exist (a mistyped path?): a read-only "
                    "manager finds no checkpoint there",
                    local,
                )
            # An explicit run id needs no run file (which may be unreadable).
            recorded = None if run_id is not None else self._recorded_run_id()
            # A reader only needs to know whether there is a valid checkpoint (resume
            # modes): the newest one, not a read of every manifest in ROOT.
            unmanifested: list[str] = []
            newest = catalog.newest(
                self.storage, run_id=run_id or recorded, warn=False, unmanifested=unmanifested
            )
            if run_id is None and recorded is None and newest is not None and newest.run_id:
                # No run file (a copied root, a persistent tier): the reader follows the
                # run of the newest checkpoint, never a mix of every run's checkpoints
                # (restore() returned another run's newer step). run_id= picks another.
                recorded = newest.run_id
            return {
                "run_id": run_id or recorded or "",
                "last_seq": 0,
                "n_valid": int(newest is not None),
                "n_valid_counted": False,
                "newest": None if newest is None else newest.step,
                "n_corrupt": 0,
                # Newer than what a reader loads: said as a writable start says it (an
                # evaluator otherwise went back a step in silence).
                "unmanifested": unmanifested[::-1],  # ascending, as a start lists them
            }
        if resume == "must" and local is not None and not posix.exists(local):
            # Nothing to resume, and nothing created for it (a mistyped path).
            raise ResumeError(
                f"resume='must' but the checkpoint root {local!r} does not exist, so it "
                "has no valid checkpoint to resume from: check the path (nothing was "
                "created)"
            )
        if not visibility.dirs_made(
            self.storage, (META_DIR, PENDING_DIR), on_wait=self._say_stale_root
        ):
            raise StorageError(
                f"{self.root} was deleted through another client of this network "
                f"filesystem, and this client still sees it after "
                f"{visibility.STALE_ROOT_WAIT_S:.0f} s (its cached entry): nothing can be "
                "created in it. Wait until the mount's cache expires and start again, or "
                "remount it"
            )
        # Their entries in ROOT must be durable before anything is created inside them.
        self.storage.fsync_dir("")
        if local is not None and not posix.is_accessible(local, write=True):
            code = errno.EROFS if posix.is_read_only_fs(local) else errno.EACCES
            raise StoragePermissionError(
                f"checkpoint root {local!r} is "
                + (
                    "on a read-only filesystem. "
                    if code == errno.EROFS
                    else "not writable by this user. "
                )
                + permission_advice(code, "create in", f"{local}/{META_DIR}"),
                errno=code,
                path=local,
            )
        recorded = self._recorded_run_id()
        torn = self._run_file_problem
        explicit_run_id = run_id is not None
        if run_id is None and agreed_run_id is not None:
            run_id = agreed_run_id
            self.storage.create_exclusive(RUN_FILE, run_doc(run_id))
        if run_id is None:
            run_id = recorded
            if run_id is None:
                # No run file (a checkpoint copied into a new root) or a torn one: the
                # checkpoints here say which run this is, never a silent fresh start
                # over them (DESIGN invariant 6).
                run_id = self._adopted_run_id() or new_run_id()
                if torn is None and not self.storage.create_exclusive(RUN_FILE, run_doc(run_id)):
                    run_id = self._recorded_run_id() or run_id
        elif explicit_run_id and recorded is None and torn is None:
            # The first job on ROOT records its run even when it named it: a restart
            # that does not pass run_id continues it (not an "adoption" with a warning).
            self.storage.create_exclusive(RUN_FILE, run_doc(run_id))
        # The lock comes before the sweep: only the owner of ROOT may delete anything,
        # or a second job would sweep the pending data of a live one (E3, F1).
        lock = RunLock(self.storage, run_id=run_id, lease_s=self._lease_s)
        try:
            lock.acquire(
                takeover=self._takeover, same_run=explicit_run_id and self._run_id_declared
            )
        except StorageFullError as exc:
            # Nothing was being saved, and retention needs a manager: say what works.
            raise StorageFullError(
                f"cannot take the run lock of {self.root}: the storage is full (or out of "
                f"inodes) ({exc}). Free space first: `atomic-checkpoint prune "
                f"{self.root} --keep-last N` works on a full disk (or delete other files)",
                errno=exc.errno,
                path=exc.path,
            ) from exc
        self._lock = lock
        try:
            if torn is not None:
                self._repair_run_file(run_id, torn)
            self._sweep()
            # No run file before this start (and none torn): a new root, or one whose
            # disk was wiped or replaced (with node-local disks, see _check_resume_mode).
            fresh = recorded is None and torn is None
            return {"run_id": run_id, "fresh": fresh, **self._start_view(run_id, resume)}
        except BaseException:
            self._release_lock()
            raise

    def _say_stale_root(self) -> None:
        log.warning(
            "%s: this client's cache still shows the root as it was before another client "
            "deleted it (a network filesystem); waiting up to %.0f s for that entry to "
            "expire before anything is created in it",
            self.root,
            visibility.STALE_ROOT_WAIT_S,
        )

    def _recorded_run_id(self) -> str | None:
        """The run id recorded in ROOT's run file, or None: no run file, or an empty or
        torn one (``_run_file_problem`` then says what is wrong, and a writable start
        rewrites it under the lock instead of refusing every later start)."""
        self._run_file_problem: str | None = None
        try:
            data = self.storage.read_bytes(RUN_FILE)
            doc = json.loads(data)
        except CheckpointNotFoundError:
            return None
        except StorageError:
            raise  # an I/O error (EIO, EROFS...) is not a corrupt file: keep its errno
        except (ValueError, RecursionError, CheckpointError) as exc:
            doc, problem = None, f"{type(exc).__name__}: {exc}"
        else:
            problem = "it records no run id"
        rid = doc.get("run_id") if isinstance(doc, dict) else None
        if isinstance(rid, str) and rid:
            return rid
        # Empty or torn: a crash inside its creation by an older version (O_EXCL create,
        # then write: the file stayed empty), or a damaged disk.
        self._run_file_problem = problem
        log.warning(
            "%s is empty or damaged (%s); the run id is taken from the checkpoints in %s "
            "(or from run_id=), and a writable start records it again",
            self.storage.url(RUN_FILE),
            problem,
            self.root,
        )
        return None

    def _adopted_run_id(self) -> str | None:
        """ROOT has no usable run file: the run id that its valid checkpoints carry (a
        checkpoint copied into a new root, a run file lost), or, with none valid, the one
        run its torn ones carry (the start then refuses them: ``ResumeError``); None when
        there are none. Never a new run over valid checkpoints without a word (invariant 6).

        Raises:
            ResumeError: the checkpoints carry several run ids: which one continues is
                for the user to say (``run_id=``).
        """
        # Through the manager's cache: the start's walk that follows (``_start_view``)
        # then reads none of these manifests again, so such a root is read once.
        entries = catalog.scan(self.storage, run_id=None, cache=self._manifests)
        runs = catalog.runs_of(e.manifest for e in entries if e.status == "ok" and e.manifest)
        if not runs:
            # None valid: the run the torn ones carry (files missing, other sizes) is
            # this root's too, so that the start refuses to begin from scratch over them
            # (ResumeError), as it does with its run file in place.
            runs = catalog.runs_of(
                e.manifest for e in entries if e.status == "corrupt" and e.manifest
            )
            if len(runs) != 1 or list(runs) == [""]:
                return None
        if list(runs) == [""]:
            # Path-style saves (integrations.dcp.save(checkpoint_id=...)) record no run:
            # a new run takes them on (Manifest.belongs_to) and resumes from them.
            log.warning(
                "%s has no run file and holds %d checkpoint(s) that record no run (steps %s, "
                "saved path-style without a manager): this job's new run continues from them",
                self.root,
                len(runs[""]),
                sorted(runs[""]),
            )
            return None
        if len(runs) > 1:
            listed = "; ".join(
                f"{rid!r}: steps {sorted(steps)}" for rid, steps in sorted(runs.items())
            )
            raise ResumeError(
                f"{self.root} has no run file ({self.storage.url(RUN_FILE)}) and holds "
                f"checkpoints of {len(runs)} runs ({listed}): pass run_id= with the run "
                "to continue (the others are left alone), or move the others away"
            )
        ((rid, steps),) = runs.items()
        log.warning(
            "%s has no usable run file but holds %d checkpoint(s) of run %r (steps %s): "
            "adopting them, this job continues run %r",
            self.root,
            len(steps),
            rid,
            sorted(steps),
            rid,
        )
        return rid

    def _repair_run_file(self, run_id: str, problem: str) -> None:
        """Replace an empty or torn run file (called holding the run lock, so no other
        writer repairs it at the same time); a racer that recorded a run id meanwhile
        wins."""
        current = self._recorded_run_id()
        if current is not None:
            return
        self.storage.write_bytes_atomic(RUN_FILE, run_doc(run_id))
        log.warning(
            "replaced the damaged %s (%s): it now records run %r",
            self.storage.url(RUN_FILE),
            problem,
            run_id,
        )

    def _sweep(self) -> None:
        """Remove pending and trash data left by crashed saves and rotations.

        Only the holder of the run lock sweeps (the coordinator of a writing manager),
        at start-up, before any save of this job exists; the fence is checked before
        each deletion, so a job that lost the lock mid-sweep stops deleting.

        What a crashed save, delete or overwrite leaves is the strategy's to find and
        remove (``CommitStrategy.sweep``): it never removes the only complete copy of a
        step (DESIGN invariant 10). What is left here is the manager's own.
        """
        if self._lock is None or not self._lock.is_held:
            return
        self._wait_for_fenced_saves()
        self._strategy.sweep(self.storage, fence=self._lock.check)
        # A process killed inside an atomic write (run record, lock, claim) left its
        # temporary file: removed once its writer is provably gone (``storage.temps``).
        for d in ("", META_DIR):
            for rel, why in abandoned_temps(self.storage, d):
                self._lock.check()
                try:
                    self.storage.delete_file(rel)
                    log.info("removed temporary file %s: %s", self.storage.url(rel), why)
                except CheckpointError as exc:
                    log.warning("could not remove %s: %s", self.storage.url(rel), exc)

    def _wait_for_fenced_saves(self) -> None:
        """A second manager of this process on the same ROOT (a notebook cell run
        again) took the lock from the first: wait for the first's async save, which its
        fence check now fails and which removes its own pending data, before sweeping.
        Swept under it, the save failed 30 s later with a CommitError ("files written by
        the ranks are not visible") instead of FencedError."""
        here = self.storage.url("")
        for other in list(_OPEN_MANAGERS):
            saver = other._async if other is not self else None
            if saver is None or not saver.is_running or other.storage.url("") != here:
                continue
            log.info("waiting for the async save of an earlier manager of %s to end", here)
            saver.join(self.timeout_s)

    @property
    def async_in_flight(self) -> SaveHandle | None:
        """The handle of the ``save_async`` still writing or committing in the
        background, or None. Local to this rank; never blocks."""
        return self._async.running if self._async is not None else None

    @property
    def strategy(self) -> CommitStrategy:
        """How this manager's saves commit and its checkpoints are retired
        (``commit_strategy`` is its name)."""
        return self._strategy

    def _check_fence(self) -> None:
        """Raise ``FencedError`` if this job lost the run lock (coordinator only; a
        no-op on other ranks and read-only managers, which hold no lock), and
        ``CheckpointError`` once ``close()`` has returned: work that it left running (a
        rotation stuck in a storage call, past ``close(timeout_s=)``) stops at its next
        change of ROOT instead of deleting on after close (DESIGN invariant 12)."""
        if self._closed:
            raise CheckpointError(
                f"{self.root}: this manager was closed; work it left running changes "
                "nothing more (the next start removes what it left)"
            )
        if self._lock is not None:
            self._lock.check()

    def _shapes_text(self, shapes: Mapping[int, list[int]]) -> str:
        """``shapes`` (the views' steps saved by a job of another shape) in words, or ""."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        for step, (world, domains) in sorted(shapes.items()):
            by_shape.setdefault((world, domains), []).append(step)
        said = [
            f"steps {steps} were saved by a job of {_count(world, 'rank')} on "
            f"{_count(domains, 'node')}"
            for (world, domains), steps in by_shape.items()
        ]
        if not said:
            return ""
        return (
            "; ".join(said) + f" (this job: {_count(self.world_size, 'rank')} on "
            f"{_count(self.domain.count, 'node')}), and only some of this job's nodes hold them"
        )

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _check_resume_mode(self, resume: str, setup: Mapping[str, Any]) -> None:
        partial = setup.get("partial_steps") or []
        other_shapes = self._shapes_text(setup.get("shapes") or {})
        # A node whose root had no run file while others hold steps of the run: its
        # disk was wiped or replaced (with KeepLast(1), one step is all there is).
        wiped = bool(partial) and setup.get("fresh_domains", 0) > 0
        if resume in ("auto", "must") and setup["n_valid"] == 0 and (len(partial) > 1 or wiped):
            # Several steps on some nodes only: saves are made one at a time, so a save
            # that failed half way leaves one such step; several mean checkpoints that
            # were committed on every node and that some node has lost (a replaced or
            # wiped disk, other nodes); so does one step where a node's root is new.
            # Never a silent start from scratch over them.
            why = (
                "a node's disk was replaced or wiped, or the job runs on other nodes than "
                "the ones that saved them"
            )
            back = "give the job those nodes' disks back"
            if other_shapes:
                # A job that shrank to fewer nodes saved them: nothing was lost.
                why, back = other_shapes, "resume with the job's shape that saved them"
                if wiped:
                    # Or the job has the shape, but some node's ROOT is not the storage
                    # the others see: its mount is missing, and ROOT there is an empty
                    # local directory (a domain of its own, with no record of the run).
                    fresh = setup.get("fresh_domains", 0)
                    why += (
                        f"; or {_count(fresh, 'node')} of this job see(s) ROOT without any "
                        "record of the run: if every node should see one shared storage "
                        "there, its mount is missing (ROOT is then an empty local "
                        "directory on that node)"
                    )
                    back += ", or mount the shared storage at ROOT on every node"
            raise ResumeError(
                f"{self.root}: checkpoints of run {self.run_id!r} (steps {partial}) are on "
                "some nodes only, and a step counts only once every node has it, so none "
                f"can be resumed: {why}. Refusing to start from scratch over them: {back}, "
                "or start a separate run in another root (these steps stay, never "
                "deleted)",
                partial_steps=tuple(partial),
            )
        newest = setup.get("newest")
        above = [s for s in partial if newest is not None and s > newest]
        if other_shapes and above and self.rank == 0:
            log.warning(
                "%s: %s; this job resumes from step %s, the newest step every node holds, "
                "and its saves of steps %s replace them (to go on from step %s, resume "
                "with the job's shape that saved it)",
                self.root,
                other_shapes,
                newest,
                above,
                above[-1],
            )
        if partial and setup["n_valid"] == 0 and self.rank == 0:
            if self._one_tier_of_several:
                # The tiered manager restores from the persistent tier or the peers: "the
                # job starts from scratch" alarmed operators of restarts that resumed.
                log.info(
                    "%s: step %s of run %r is on some nodes' tier 0 only: this tier has "
                    "nothing to resume; the tiered restore reads the persistent tier or "
                    "the peers' copies",
                    self.root,
                    partial[0],
                    self.run_id,
                )
            else:
                log.warning(
                    "%s: step %s of run %r is on some nodes only (a save that failed half "
                    "way, or a node whose disk was replaced): nothing to resume, the job "
                    "starts from scratch and a save of that step replaces it",
                    self.root,
                    partial[0],
                    self.run_id,
                )
        unmanifested = setup.get("unmanifested") or ()
        # As they are on disk (Accelerate's project view names checkpoints/checkpoint_<i>
        # checkpoint-<i>): what ls and adopt find.
        real = getattr(self.storage, "real", None)
        named = [real(n) if callable(real) else n for n in unmanifested[:5]]
        shown = ", ".join(named) + (", ..." if len(unmanifested) > 5 else "")
        others = setup.get("other_runs") or {}
        other_text = "; ".join(
            f"run {rid!r} (newest step {step})" for rid, step in sorted(others.items())[:5]
        )
        if resume == "must" and setup["n_valid"] == 0:
            raise ResumeError(
                f"resume='must' but {self.root} has no valid checkpoint of run {self.run_id!r}"
                + (
                    f" ({setup['n_corrupt']} corrupt ones were skipped)"
                    if setup["n_corrupt"]
                    else ""
                )
                + (
                    f"; it holds checkpoints of other runs: {other_text}. To continue one, "
                    "pass its run_id"
                    if others
                    else ""
                )
                + (
                    f"; its checkpoint folders without a manifest ({shown}) are another "
                    f"tool's: adopt them first (`atomic-checkpoint adopt {self.root}`, with "
                    "`--framework dcp` for folders DCP wrote; `--dry-run` first shows what "
                    "it would adopt)"
                    if unmanifested
                    else ""
                )
            )
        if resume == "auto" and setup["n_valid"] == 0 and setup["n_corrupt"] > 0:
            newer = self._newer_version_text()
            raise ResumeError(
                f"{self.root} holds {setup['n_corrupt']} checkpoint(s) of run {self.run_id!r} but "
                f"none is valid{newer} (`atomic-checkpoint verify {self.root}` says what is "
                "wrong with each); refusing to start from scratch over them. "
                + (
                    "Upgrade atomic-checkpoint to resume from them"
                    if newer
                    else "Repair them, move them out of the root, or start the new run in "
                    "another root (a new run here could not save the steps they hold)"
                )
            )
        if setup["n_valid"] == 0 and unmanifested and self.rank == 0:
            log.warning(
                "%s holds %d checkpoint folder(s) without a manifest (%s): written by "
                "another tool (a stock Trainer, Accelerate, DCP) or without their "
                "manifest, so nothing tells a complete one from one torn by a crash: "
                "latest() and restore() ignore them until they are adopted. To resume from "
                "the complete ones, adopt them: `atomic-checkpoint adopt %s` (with "
                "`--framework dcp` for folders DCP wrote; `--dry-run` first shows what it "
                "would adopt), or adopt_existing=True in the integrations",
                self.root,
                len(unmanifested),
                shown,
                self.root,
            )
        if setup["n_valid"] == 0 and others and self.rank == 0 and not self.read_only:
            # A new run_id on a copied root (or one named per job, e.g. by the
            # scheduler's job id) starts from scratch beside the checkpoints there.
            log.warning(
                "run %r has no checkpoint in %s, which holds checkpoints of other runs "
                "(%s): this run starts from scratch beside them. To continue one, pass its "
                "run_id (or omit run_id where the root's run file names it)",
                self.run_id,
                self.root,
                other_text,
            )
        elif (newer := _newer_runs(others, setup.get("newest"))) and self.rank == 0:
            # Newer than what this job resumes. A restart without run_id continues the
            # run the run file names, and the newer steps of a job started beside it
            # with its own run_id were ignored in silence.
            log.warning(
                "%s holds newer checkpoints of other runs than step %s of run %r, which "
                "this job continues: %s. They are not this run's: ignored, never deleted. "
                "To continue one of them, pass its run_id",
                self.root,
                setup.get("newest"),
                self.run_id,
                newer,
            )
        if unmanifested and self.rank == 0 and setup.get("newest") is not None:
            # Met on the way down to the newest valid one: newer than what a resume
            # loads. Skipped in silence, an interrupted copy of a root looked like a
            # resume that lost its newest steps for no reason.
            log.warning(
                "%s: %s, newer than step %d (the newest valid checkpoint), has no manifest "
                "(a copy of the root that was cut short, a save of another tool, or a "
                "manifest deleted): it is skipped. `atomic-checkpoint verify %s` says more",
                self.root,
                shown,
                setup["newest"],
                self.root,
            )
        if resume == "never" and setup["n_valid"] > 0:
            found = (
                f"{setup['n_valid']} checkpoint(s)"
                if setup.get("n_valid_counted", True)
                else f"checkpoints (the newest is step {setup['newest']})"
            )
            raise ResumeError(
                f"resume='never' but {self.root} already has {found} of "
                f"run {self.run_id!r}. To train from scratch, use another root (or move "
                "these checkpoints out of it): a new run here could not save the steps they "
                "hold; to continue them, pass resume='auto'"
            )

    def _next_seq(self) -> int:
        self._last_seq += 1
        return self._last_seq

    def adopt_existing(self, framework: str = "auto") -> AdoptResult:
        """Record the complete checkpoints another tool wrote into ROOT as committed
        checkpoints of this run, as :func:`atomic_checkpoint.adopt` does, under the run
        lock this manager holds (``adopt`` takes the lock itself, so it runs before a
        job opens ROOT or after it closes). On one process: call it on the coordinator
        only (``load_dcp(adopt_existing=True)`` does, and shares the outcome).

        Returns what was adopted, refused (with the reason) or already committed.

        Raises:
            ValueError: an unknown ``framework`` (the integrations' ``"dcp"`` and
                ``"lightning"`` rules are loaded on demand).
            CheckpointError: this manager is read-only or closed; storage errors.
            LockError: another job took ROOT over (fenced: nothing more is written).
        """
        from .adopt import adopt_held

        self._check_writable()
        lock = self._lock
        if lock is None:  # pragma: no cover - a writable manager holds it
            raise CheckpointError(f"{self.root}: no run lock held")
        return adopt_held(
            self.storage,
            self.run_id,
            lock,
            framework=framework,
            next_seq=self._next_seq,
            strategy=self.strategy.name,
        )

    # ------------------------------------------------------------------ saving
    def _check_writable(self) -> None:
        if self._closed:
            raise self._closed_error()
        if self.read_only:
            raise ReadOnlyError(
                f"this CheckpointManager on {self.root} is read-only (read_only=True): open "
                "one without read_only=True to save, roll back or delete (it takes the run "
                "lock: one writing job per root)"
            )

    def _closed_error(self) -> CheckpointError:
        return CheckpointError(
            f"this CheckpointManager on {self.root} is closed (close(), or the end of its "
            "with block): open a new CheckpointManager on the root to go on"
        )

    def _state_file(self, replicated: bool) -> str | None:
        """The state file this rank writes into the pending location (its path there),
        or None: with ``replicated=True`` only the coordinator writes."""
        if not replicated:
            return rank_state_file(self.rank)
        return REPLICATED_STATE_FILE if self.is_coordinator else None

    def _check_step_order(self, step: int) -> None:
        """Refuse a save below the newest committed step, on every rank alike (the
        newest step is agreed at open and advanced by each commit), before anything is
        written. Checkpoints are ordered by step: saved after 200, step 110 would be the
        first checkpoint retention deletes, possibly by its own save's pass, and resume
        would load 200, not the state just saved (issue 11, defect 2)."""
        newest = self._newest_step
        if newest is not None and step < newest:
            raise StepOrderError(
                f"cannot save step {step}: step {newest} is already committed in {self.root} "
                f"(run {self.run_id!r}), and checkpoints are ordered by step, so retention "
                f"would delete step {step} first and a resume would load step {newest}. To "
                "continue from an older checkpoint, first call rollback(<that step>) on every "
                f"rank (it deletes this run's checkpoints above it); or save a step above {newest}",
                step=step,
                newest=newest,
            )

    @_one_at_a_time
    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, SupportsFloat] | None = None,
        metadata: Mapping[str, Any] | None = None,
        replicated: bool = False,
        overwrite: bool = False,
    ) -> CheckpointInfo:
        """Save this rank's ``state`` as part of checkpoint ``step``; collective.

        ``state`` is nested dicts/lists/tuples of tensors, arrays, numbers and strings
        (a model + optimizer + scheduler + RNG state). With ``replicated=True`` every
        rank holds the same state and only the coordinator writes it.

        ``metrics`` (names to numbers, for ``KeepBest``; a NaN or inf is left out with
        a warning) and ``metadata`` (JSON values, at most 16 MiB) are recorded as the
        coordinator (rank 0) passed them: pass the same on every rank, or at least on
        rank 0. Ones that cannot be recorded, on any rank, fail the save on every rank.
        With node-local disks (several storage domains) each node's leader commits its
        node's copy: from its own state with ``replicated=True``, and with the metrics
        and metadata it passed, so pass the same on every rank there.

        ``overwrite=True`` replaces a committed ``step``: the new copy is committed
        before the old one goes, and once it is, the save succeeds even if the old copy
        cannot be removed (a warning; the next start or ``clean`` removes it). Without
        an atomic exchange (sshfs, NFS, Windows) the step has no name between the two
        renames: readers that look then wait for the second one (up to
        ``catalog.REPLACE_WAIT_S``), and a crash between them leaves the step absent
        until the next start puts the new copy back.

        Returns:
            The committed checkpoint, identical on every rank, with ``timings_s``.

        Raises:
            StepOrderError: ``step`` is lower than the newest committed step of this
                run (every rank, nothing written): ``rollback`` first to continue from
                an older checkpoint.
            CheckpointExistsError: ``step`` is committed and ``overwrite`` is False.
            CheckpointError: a previous async save failed (raised once, every rank).
        """
        from .serialization import plan_state

        overwrite, replicated = _flag("overwrite", overwrite), _flag("replicated", replicated)
        self._check_writable()
        self._finish_async()  # at most one save in flight
        step = validate_step(step)
        self._check_step_order(step)
        metrics_d, metadata_d, problem = _checked_input(metrics, metadata)
        request = _Request(step, _state_kind(replicated), metrics_d, metadata_d, overwrite)
        rel = self._state_file(replicated)
        plan: Any = None
        if rel is not None and problem is None:
            # Planning walks the tree and finds unsupported objects before anything is
            # written; the commit's first step shares its failure with every rank.
            try:
                plan = plan_state(state, allow_pickle=self.allow_pickle)
            except Exception as exc:  # shared, raised on every rank alike
                problem = exc

        def write(pending: str) -> RankReport:
            if plan is None or rel is None:
                return RankReport((), 0.0, 0.0)
            if self._staging is None:
                self._staging = Staging()
            path = f"{pending}/{rel}"
            return write_plan(self.storage, path, rel, plan, self.rank, step, self._staging)

        return self._save(self._ctx, request, write, problem=problem)

    @contextlib.contextmanager
    def saving(
        self,
        step: int,
        *,
        metrics: Mapping[str, SupportsFloat] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        failed: Exception | None = None,
    ) -> Iterator[SavingDir]:
        """Yield a pending directory that every rank writes files into; committed on
        exit, discarded if the block raises on any rank. Collective.

        The directory is a ``pathlib.Path`` (a ``SavingDir``) whose ``info`` is the
        committed checkpoint once the block has exited (None before, or if it failed).

        Example::

            with mgr.saving(step) as d:
                if mgr.is_coordinator:
                    model.save_pretrained(d)
                torch.save(optim.state_dict(), d / f"optim-{mgr.rank}.pt")
            print(d.info.path)  # checkpoint-<step>, committed on every rank

        Before the block runs on any rank, the ranks check that they passed the same
        step and that none has bad input (``metrics``, ``metadata``, or ``failed``: this
        rank could not prepare its part, e.g. its state dict raised): otherwise every
        rank raises the same error at once (``CommitError``, or
        ``DistributedCheckpointError`` naming the rank; with one process, the error
        itself), and no block runs. Inside the
        block, the others would write first, and a framework's own collectives (DCP's)
        would wait for the rank that left.

        Raises ``StepOrderError`` (before the block runs) like ``save``.
        """
        overwrite = _flag("overwrite", overwrite)
        with self._save_slot("saving()"):
            self._check_writable()
            self._finish_async()  # at most one save in flight
            step = validate_step(step)
            metrics_d, metadata_d, problem = _checked_input(metrics, metadata)
            self._agree_to_save(step, overwrite, failed or problem)
            self._check_step_order(step)
            gen = _SavingBlock(self, step, metrics_d, metadata_d, overwrite)
            with gen as path:
                yield path
            self.last_saved = path.info = gen.info

    def _agree_to_save(self, step: int, overwrite: bool, problem: Exception | None) -> None:
        """One round before a ``saving()`` block: the same step and ``overwrite`` on every
        rank, and no rank's bad input; else every rank raises the same error, at once."""
        if self.world_size == 1:
            if problem is not None:
                raise problem
            return
        failure = None if problem is None else rank_failure(problem, self.rank, "prepare")
        calls, failures = gather_summary(
            self.coordinator,
            f"saving() step {step}: inputs",
            ((step, "files", overwrite), failure),
            _calls_and_failures,
            timeout_s=self.timeout_s,
        )
        commit.check_same_call(calls)
        if failures:
            raise shared_error(failures, step)

    @contextlib.contextmanager
    def _save_slot(self, what: str) -> Iterator[None]:
        """One save at a time per manager, whatever the thread: the step-order check
        and the commit it guards must not interleave with another save's (two threads'
        saves of 103 and 102 would both pass the check and commit out of order). Other
        threads wait their turn; a save started inside one on the same thread (in a
        ``saving()`` block) is an error."""
        self._check_process(what)
        me = threading.get_ident()
        if self._saver_thread == me:
            raise CheckpointError(
                f"{what} was called while this thread is inside a save of this manager (a "
                "saving() block, or an on_commit callback of a synchronous save): one save "
                "at a time per manager; save after the block has exited"
            )
        with self._save_mutex:
            self._saver_thread = me
            try:
                yield
            except BaseException:
                self._close_when_saved(raising=False)
                raise
            else:
                self._close_when_saved(raising=True)
            finally:
                self._saver_thread = None

    def _close_when_saved(self, *, raising: bool) -> None:
        """The ``close()`` asked for inside the save that just ended on this thread (a
        signal handler's, or ``on_commit``'s of a synchronous save), run now that it
        has ended. Its error is raised after a save that succeeded, and logged after one
        that failed (whose own error is the one raised)."""
        closing, self._close_after_save = self._close_after_save, None
        if closing is None:
            return
        try:
            closing()
        except Exception as exc:
            if raising:
                raise
            log.warning("close() after the failed save: %s: %s", type(exc).__name__, exc)

    last_saved: CheckpointInfo | None = None
    #: A ``close()`` called inside a save on the save's own thread, run when it ends.
    _close_after_save: Callable[[], object] | None = None
    #: A tier of a ``TieredCheckpointManager`` (its tier 0 subclass says so): what this
    #: root lacks is not what the job lacks.
    _one_tier_of_several = False
    #: Whether a ``run_id`` passed in was declared by the user (a restarted job may then
    #: take over a live holder's lock of the same run). False for the tiers of a
    #: ``TieredCheckpointManager`` whose run id was read from a tier: a second job
    #: pointed at a live job's tiers took its locks over as "a restarted job".
    _run_id_declared = True
    #: The thread inside ``on_commit``: see ``_on_leaders``.
    _callback_thread: int | None = None

    # ------------------------------------------------------------------ async saving
    _staging: Staging | None = None  # sync saves' O_DIRECT staging, made by the first
    _async: AsyncSaver | None = None  # created by the first save_async
    _snapshots: SnapshotPool | None = None
    _async_coord: Coordinator | None = None

    def prepare_async(self, state: Any, *, replicated: bool = False) -> int:
        """Allocate the host buffers of ``save_async`` for ``state`` now, resident, so
        that the first ``save_async`` blocks training only for the copy, like every
        later one (the first call otherwise also allocates and faults in memory of the
        state's size, several times the copy on VMs).

        Call it once before the training loop, with the state as it will be saved
        (after the optimizer has created its state, e.g. after one step): a later state
        that needs more bytes grows the buffers at that save. Local to this rank, not
        collective; it waits for an async save in flight (and raises its failure, as
        ``save_async`` would) before touching the buffers.

        Returns:
            The size of the buffers in bytes (0 on a rank that writes nothing, i.e.
            every rank but the coordinator with ``replicated=True``).
        """
        from .serialization import plan_state

        self._check_writable()
        self._check_process("prepare_async()")
        self._finish_async()
        if replicated and not self.is_coordinator:
            return 0
        plan = plan_state(state, allow_pickle=self.allow_pickle)
        if self._snapshots is None:
            self._snapshots = SnapshotPool()
        return self._snapshots.reserve(plan)

    @_one_at_a_time
    @parameters_of(save)
    def save_async(self, step, state, *, metrics, metadata, replicated, overwrite) -> SaveHandle:
        """Snapshot ``state`` into host memory, then write and commit it in the
        background; collective (call on every rank, in the same order). It takes the
        parameters of :meth:`save`, with their meanings.

        Returns as soon as every tensor is copied into the snapshot buffers: from then
        on the state may change in place (``optimizer.step()``) without reaching the
        checkpoint. It waits for no other rank, except at the manager's first
        ``save_async`` (one round: the ranks agree on it before the background
        coordinator is made, so a late rank holds the others up to it, ``timeout_s`` at
        most) and for the previous save still in flight (below). The buffers are
        allocated by the first call and reused by every later one (pinned when tensors
        live on a GPU), so an async save holds at most one extra copy of the state.

        At most one save is in flight: this call (like ``save`` and ``saving``) first
        waits for the previous async save and raises its failure (once, on every rank
        alike, even where ``handle.result()`` already raised it). The background commit
        agrees with the other ranks through its own store connection, never through the
        training's collectives, so it cannot deadlock with them. Retention runs only
        after the commit is durable, and ``on_commit`` is called from the background
        thread.

        Unsupported objects in ``state`` are found here, but reported like every other
        failure of the save (by the handle, or the next save/``wait``/``close``), on
        every rank.

        Returns:
            A ``SaveHandle``; ``handle.result()`` is the same ``CheckpointInfo`` on every
            rank (its ``timings_s["snapshot"]`` is the copy time).

        Raises:
            CheckpointError: the previous async save failed (raised once, every rank).
            TypeError, ValueError: the previous async save's metrics or metadata could
                not be recorded (as ``save`` raises them; reported like its failures).
            StepOrderError: as for ``save`` (checked after the previous save ended).
        """
        from .serialization import plan_state, without_gc

        t0 = time.perf_counter()
        overwrite, replicated = _flag("overwrite", overwrite), _flag("replicated", replicated)
        request, input_error, ctx = self._start_async(
            step, metrics, metadata, _state_kind(replicated), overwrite
        )
        step = request.step
        saver, pool = self._async, self._snapshots
        if saver is None or pool is None:  # pragma: no cover - set by _start_async
            raise CheckpointError("async save state is incomplete")
        rel = self._state_file(replicated)
        cancel = saver.cancel
        snapshot: Any = None
        interrupted: BaseException | None = None
        if rel is not None and input_error is None:
            try:
                with without_gc():  # see serialization.without_gc
                    plan = plan_state(state, allow_pickle=self.allow_pickle)
                    snapshot = pool.prepare(plan, cancel=cancel)
            except Exception as exc:  # shared with every rank in the first phase
                input_error = exc
            except BaseException as exc:
                # Ctrl-C while planning or allocating the buffers (the first call's are
                # large): this rank still takes part in the save, as a failure, so every
                # rank fails it at the same call. Raised from here alone, it left the
                # ranks one call apart for the rest of the job.
                interrupted = exc
                input_error = CheckpointError(
                    f"the save was interrupted on rank {self.rank} ({type(exc).__name__}) "
                    "before its snapshot was taken"
                )

        def write(pending: str) -> RankReport:
            if snapshot is None or rel is None:
                return RankReport((), 0.0, 0.0)
            path = f"{pending}/{rel}"
            return write_image(
                self.storage, path, rel, snapshot, self.rank, step, cancel, saver.demote
            )

        def run() -> CheckpointInfo:
            return self._save(ctx, request, write, problem=input_error, snapshot=snapshot)

        # The background save starts before the copy: waiting for the previous rotation
        # and its first phase (agreeing on the pending location) overlap the copy; its
        # writes start as the copy tells it (async_save._STREAM_STEP_BYTES).
        try:
            handle = saver.submit(step, run)
            if snapshot is not None:
                with contextlib.suppress(Exception):  # the write fails with it, on every rank
                    snapshot.copy()
        except BaseException as exc:
            # Interrupted (Ctrl-C) between the start of the background save and the end
            # of the copy: the writer would wait up to 10 minutes for the bytes, and the
            # next call with it. It fails now; with one process, the interrupt was this
            # save's failure, raised here, and the next save goes ahead (with several,
            # every rank still raises it at the same call).
            if snapshot is not None:
                snapshot.fail(exc)
            if self.world_size == 1 and not isinstance(exc, Exception):
                saver.mark_raised()  # started, even if submit() did not return it
            raise
        if interrupted is not None:
            if self.world_size == 1:
                saver.mark_raised()  # the interrupt is this save's failure, raised now
            raise interrupted
        handle.blocked_s = time.perf_counter() - t0
        return handle

    @_one_at_a_time
    def saving_async(
        self,
        step: int,
        write: Callable[[Path], object],
        *,
        metrics: Mapping[str, SupportsFloat] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        failed: Exception | None = None,
        phase: str = "write",
    ) -> SaveHandle:
        """The background counterpart of ``saving()``, for writers that copy the state
        themselves first (``integrations.dcp.async_save_dcp`` stages it with DCP's
        stager): ``write(directory)`` runs on the background save thread and writes
        this rank's files into the pending directory (a ``pathlib.Path`` on a mounted
        filesystem); the checkpoint is committed once every rank's ``write`` returned,
        and discarded on every rank if any raised. Collective, with the rules of
        ``save_async``: at most one save in flight, the previous one's failure raised
        here first, ``handle.result()`` the same on every rank.

        Example::

            staged = copy_of(state)          # on the training thread
            handle = mgr.saving_async(step, lambda d: write_files(staged, d))
            ...                              # training goes on
            handle.result()                  # or mgr.wait()

        Args:
            write: this rank's writer, called at a lowered priority when the platform
                allows (the state is copied already: training keeps the CPU).
            failed: this rank could not prepare its part (its copy failed): the save
                then fails on every rank with this error, named by rank, instead of
                this rank raising alone while the others wait for it.
            phase: the name of this write in the shared error of a failure
                (``rank 1 in phase 'write': ...``).
        """
        t0 = time.perf_counter()
        overwrite = _flag("overwrite", overwrite)
        local = self.storage.local_path("")
        if local is None:
            raise CheckpointError(
                "saving_async() needs a mounted filesystem; use save_async() for object stores"
            )
        request, bad_input, ctx = self._start_async(step, metrics, metadata, "files", overwrite)
        step = request.step
        failed = failed or bad_input
        saver = self._async
        if saver is None:  # pragma: no cover - set by _start_async
            raise CheckpointError("async save state is incomplete")

        def write_files(pending: str) -> RankReport:
            saver.demote()
            write(Path(local, *pending.split("/")))
            return RankReport((), 0.0, 0.0)

        def run() -> CheckpointInfo:
            # scan: arbitrary files, checksummed and fsync'd once every rank wrote them
            return self._save(ctx, request, write_files, problem=failed, scan=True, phase=phase)

        handle = saver.submit(step, run)
        handle.blocked_s = time.perf_counter() - t0
        return handle

    def _start_async(
        self,
        step: int,
        metrics: Mapping[str, SupportsFloat] | None,
        metadata: Mapping[str, Any] | None,
        kind: str,
        overwrite: bool,
    ) -> tuple[_Request, Exception | None, SaveContext]:
        """What every async save does first, on the calling thread: check the inputs,
        finish the previous save (raising its failure once), check the step order,
        create the background saver on the first call (the previous save's rotation is
        waited for by the background save, before it touches ROOT). Returns the checked
        request, this rank's bad metrics or metadata (shared by the commit's first step,
        as bad state is), and the context of the background commit: its own
        store connection, and the saver's ``cancel`` event, which the leader checks with
        the run lock before it creates the pending location and before it commits (an
        abandoned save is never committed)."""
        from .async_save import register_exit

        self._check_writable()
        step = validate_step(step)
        metrics_d, metadata_d, problem = _checked_input(metrics, metadata)
        self._finish_async()
        # The previous save's rotation may still be deleting (unlinking a large file
        # frees its cached pages: about 0.5 s per GiB on ext4). The background save
        # waits for it before it touches ROOT (first thing in its ``run``): the copy
        # into host memory needs no storage, so training is not held up by a delete,
        # and no write of this save starts before the delete freed its space.
        self._check_step_order(step)
        if self._async is None:
            # Created once, on every rank at the same (first) async save, so the clone's
            # key namespace is the same on every rank. One round agrees on that first:
            # a rank in save() meanwhile (save_async on some ranks only) raised nothing
            # until timeout_s, and its ranks stayed out of step for every later call.
            if self.world_size > 1:
                self._agree("save_async", step)
            self._async_coord = self.coordinator.clone()
            self._async = AsyncSaver()
            if self._snapshots is None:  # else made by prepare_async()
                self._snapshots = SnapshotPool()
            register_exit(self)
        if self._async_coord is None:  # pragma: no cover - set together above
            raise CheckpointError("async save state is incomplete")
        ctx = dataclasses.replace(self._ctx, coord=self._async_coord, cancel=self._async.cancel)
        return _Request(step, kind, metrics_d, metadata_d, overwrite), problem, ctx

    def wait(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        """Wait until the in-flight async save is committed and durable, and its
        retention done. Not a collective exchange (each rank waits for its own part),
        but call it on every rank alike: a failure is raised by the first of
        ``wait``/``save``/``save_async``/``saving``/``close`` that follows the save.

        Returns:
            The committed checkpoint; None if no async save was in flight, or if its
            failure was already raised by this manager (``SaveHandle.result()`` does
            not count: it is per rank, and every rank must raise at the same call).

        Raises:
            TimeoutError: the save, or its retention, still running after ``timeout_s``
                (it goes on).
            CheckpointError: the async save failed (raised once, on every rank).
            TypeError, ValueError: its metrics or metadata could not be recorded (as
                ``save`` raises them; every rank raises it, nothing was written).
        """
        self._check_process("wait()")
        timeout_s = _wait_seconds("timeout_s", timeout_s)  # 0 polls
        started = time.monotonic()
        info = self._finish_async(timeout_s)
        # The bound covers the retention too (a deletion stuck in a slow storage call):
        # a preempted job waited for it past its grace period.
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
        if not self._finish_rotation(left):
            raise TimeoutError(
                f"the retention after the last save of {self.root} is still running after "
                f"{timeout_s:g} s (a deletion in a slow storage call); it goes on"
            )
        return info

    def _check_process(self, what: str) -> None:
        """Refuse ``what`` in a child made by ``os.fork()``: the manager's save thread
        and run lock belong to the parent, and a wait for the parent's save blocked for
        ever (the thread does not exist in the child)."""
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"{what}: this CheckpointManager belongs to process {self._pid}, and this "
                f"is process {os.getpid()} (a child made by fork): open a new "
                "CheckpointManager in the child (read_only=True to read checkpoints), or "
                "start children with multiprocessing's 'spawn' method"
            )
        if self._async is not None and self._async.on_save_thread():
            # It would wait for the save it is part of: for ever (close() from the
            # main thread then too).
            raise CheckpointError(
                f"{what} was called from the background thread of an async save (an "
                "on_commit callback, or the write function of saving_async()): it would "
                "wait for the save it runs in, for ever. Call it from the training "
                "thread; for work after each commit, hand it to a thread of your own "
                "(e.g. a concurrent.futures executor)"
            )

    def _finish_async(self, timeout_s: float | None = None) -> CheckpointInfo | None:
        return None if self._async is None else self._async.wait(timeout_s)

    def _close_async(
        self, why: str, stop_bound_s: float | None = None, within_s: float | None = None
    ) -> BaseException | None:
        """Finish the in-flight async save (past ``timeout_s``, ask it to stop) and wait
        until it has ended, however it ends; log which. Returns its failure if this
        manager has not raised it yet. ``stop_bound_s``: see
        ``AsyncSaver.finish_or_abandon`` (interpreter exit). ``within_s``: the whole
        wait, to finish and then to stop (``close(timeout_s=)``), at least a moment to
        stop once asked."""
        saver = self._async
        if saver is None:
            return None
        finish_s = self.timeout_s
        if within_s is not None:
            finish_s = min(finish_s, within_s)
            stop_bound_s = max(within_s - finish_s, _STOP_MOMENT_S)
        error = saver.finish_or_abandon(finish_s, why, stop_bound_s=stop_bound_s)
        if self._snapshots is not None and not saver.is_running:
            self._snapshots.release()
        return error

    def _close_at_exit(self) -> None:
        """atexit hook (registered by the first ``save_async``)."""
        if self._closed or (self._async is not None and self._async.owner_pid != os.getpid()):
            return  # closed already, or a forked child exiting: the parent owns the saves
        try:
            # Bounded: a storage call that never returns must not keep the interpreter
            # from exiting. A save still running then keeps the lock (see _close).
            self._close("interpreter exit", stop_bound_s=min(self.timeout_s, 30.0))
        except Exception as exc:  # logged there too; nobody left to raise to
            log.warning("closing %r at interpreter exit: %s", self, exc)

    def _save(
        self,
        ctx: SaveContext,
        request: _Request,
        write: Callable[[str], RankReport],
        *,
        problem: Exception | None = None,
        scan: bool = False,
        phase: str = "write",
        snapshot: Any = None,
    ) -> CheckpointInfo:
        """One save on this rank (the sync save's caller thread, or an async save's
        background thread), as the commit protocol's steps in order: the previous
        rotation finished (before ROOT is touched; see ``_start_async``), ``begin`` (the
        leader creates the pending location), this rank's ``write`` into it, ``finish``
        (gather, commit, publish), then this manager's bookkeeping and rotation
        (``_after_commit``). ``problem``: this rank's bad input, shared by ``begin``;
        ``phase`` names the write in a shared failure; ``snapshot``: an async save's,
        whose copy time is reported as ``timings_s["snapshot"]``. Collective."""
        step = request.step
        self._finish_rotation()
        overwrite = self._replaces_failed(step, request.overwrite)
        pending = commit.begin(ctx, step, overwrite=overwrite, problem=problem)
        try:
            written = (
                commit.attempt(phase, lambda: write(pending.location), ctx=ctx, pending=pending)
                if pending.writes
                else None
            )
        except BaseException:
            # KeyboardInterrupt/SystemExit during the write: leave no half-written
            # pending data behind if we can help it; the next start sweeps the rest.
            # (``begin`` and ``finish`` clean up after their own failures.)
            commit.abort(ctx, pending)
            raise
        done = commit.finish(
            ctx,
            pending,
            written,
            commit_seq=self._next_seq(),
            state_kind=request.kind,
            metrics=request.metrics,
            metadata=request.metadata,
            scan=scan,
        )
        self._failed_verification.discard(step)  # replaced by a valid copy
        if snapshot is not None:
            done.timings["snapshot"] = snapshot.copy_s
        return self._after_commit(done.manifest, done.timings, done.domain_views)

    def _replaces_failed(self, step: int, overwrite: bool) -> bool:
        """``overwrite`` for a save of ``step``: True also when this run's checkpoint of
        that step failed verification (torn, or a checksum mismatch), which the save
        then replaces, with a warning, instead of refusing it as committed at every
        restart (restore() skips it, so the resumed job saves that step again)."""
        if step in self._failed_verification and not overwrite:
            log.warning(
                "saving step %d replaces checkpoint %s of %s, which failed verification "
                "(a resume skips it)",
                step,
                checkpoint_name(step),
                self.root,
            )
            return True
        return overwrite

    def _after_commit(
        self, manifest: Manifest, timings: dict[str, float], domain_views: Any = None
    ) -> CheckpointInfo:
        """Every rank, after a commit: remember it, start retention (leader), report.
        ``domain_views``: ``commit.Committed.domain_views`` (several storage domains)."""
        if domain_views is not None:
            self._on_domain_view(manifest.step, domain_views)
        info = _with_timings(
            manifest.info(self.storage.url(checkpoint_name(manifest.step))), timings
        )
        self.last_saved = info
        self._known_good.add(manifest.step)
        self._manifests.forget(checkpoint_name(manifest.step))
        if self._newest_step is None or manifest.step > self._newest_step:
            self._newest_step = manifest.step
        if self.is_coordinator and self.retention is not None:
            self._start_rotation(manifest.step)
        if self.rank == 0:
            total = timings.get("total", 0.0)
            log.info(
                "committed %s: %d rank(s), %s in %.3f s (%s/s; write %.3f s, commit %.3f s)",
                info.path,
                manifest.world_size,
                format_size(manifest.size_bytes, digits=2),
                total,
                format_size(manifest.size_bytes / total if total > 0 else 0.0, digits=2),
                timings.get("write", 0.0),
                timings.get("commit", 0.0),
            )
            if self.on_commit is not None:
                self._call_on_commit(info)
        log.debug("rank %d: step %d timings %s", self.rank, manifest.step, timings)
        return info

    def _call_on_commit(self, info: CheckpointInfo) -> None:
        """Call ``on_commit`` with a committed checkpoint. The save has succeeded by
        then, on every rank: a callback that raises (an upload that failed) must not
        make this rank alone raise (the others returned; a loop that stops on rank 0
        leaves them waiting in the next collective) nor report a committed checkpoint
        as failed (a retry would find the step taken). Its exception is logged at
        ERROR with the traceback, and the save returns its info."""
        callback = self.on_commit
        if callback is None:  # pragma: no cover - checked by the caller
            return
        # With one process too (see _on_leaders): code that works there fails once the
        # job has several ranks, and a rollback() there deleted the checkpoint the save
        # then returned.
        self._callback_thread = threading.get_ident()
        try:
            callback(info)
        except Exception:
            log.exception(
                "on_commit callback failed for %s (the checkpoint is committed and kept; "
                "the save succeeded): handle errors inside the callback to act on them",
                checkpoint_name(info.step),
            )
        finally:
            self._callback_thread = None

    def _newer_version_text(self, entries: list[catalog.Entry] | None = None) -> str:
        """``": N of them were written by a newer atomic-checkpoint ..."`` when ROOT's
        corrupt checkpoints include ones of a newer format (the failure path: one scan of
        ROOT unless ``entries`` are given), else ``""``."""
        if entries is None:
            try:
                entries = catalog.scan(self.storage, run_id=self.run_id or None)
            except CheckpointError:
                return ""
        newer = [
            e.name
            for e in entries
            if e.status == "corrupt" and "written by a newer atomic-checkpoint" in str(e.problem)
        ]
        if not newer:
            return ""
        return (
            f": {len(newer)} of them ({', '.join(newer[:3])}{', ...' if len(newer) > 3 else ''}) "
            f"were written by a newer version of atomic-checkpoint (format version above "
            f"{SCHEMA_VERSION}, which this one, {__version__}, reads up to)"
        )

    def _nothing_to_restore(self) -> str:
        """The message of ``restore()`` when ROOT holds no valid checkpoint of this run,
        with what it holds instead (the failure path: one scan of ROOT)."""
        of_run = f" of run {self.run_id!r}" if self.run_id else ""
        message = f"no valid checkpoint{of_run} in {self.root}"
        local = self.storage.local_path("")
        if local is not None and not posix.lexists(local):
            # A read-only manager opens a root that does not exist yet (a watcher
            # started before the job): a mistyped path looked like an empty root.
            return (
                message + ": it does not exist (check the path, and that its filesystem is mounted)"
            )
        try:
            entries = catalog.scan(self.storage, run_id=self.run_id or None)
        except CheckpointError:
            return message
        foreign = [e for e in entries if e.status == "foreign" and e.step is not None]
        unmanifested = [e.name for e in foreign if e.unmanifested]
        others = sum(1 for e in foreign if e.manifest is not None)  # other runs' checkpoints
        if unmanifested:
            message += (
                f"; it holds {len(unmanifested)} checkpoint folder(s) without a manifest "
                f"({', '.join(unmanifested[:5])}{', ...' if len(unmanifested) > 5 else ''}), "
                "written by another tool or without their manifest: to load the complete "
                f"ones, adopt them first (`atomic-checkpoint adopt {self.root}`; `--dry-run` "
                "first shows what it would adopt)"
            )
        if others:
            message += f"; {others} checkpoint(s) of other runs are there (pass run_id=...)"
        newer = self._newer_version_text(entries)
        if newer:
            message += f"; it holds checkpoints that do not load here{newer}: upgrade to load them"
        return message

    # ------------------------------------------------------------------ copies
    def begin_copy(self, step: int) -> CopyAttempt:
        """Start committing a copy of a checkpoint that was committed somewhere else
        (another tier, root or cluster) as step ``step`` of this run: returns where its
        files go. Not collective: the one process that will publish the copy calls it
        (tiered checkpoints: rank 0, from its replication thread).

        The three calls are the commit of a copy, as ``save`` is the commit of a state:
        :meth:`begin_copy`, then write each file under ``attempt.staged`` (paths
        relative to ``storage``) and verify it, then :meth:`publish_copy`; on any failure
        in between, :meth:`abandon_copy`. Nothing is visible until the publish. A
        rotation in flight finishes first (one at a time, as for a save).

        Raises:
            CheckpointError: read-only or closed manager; storage errors.
            LockError: another job took ROOT over (fenced: nothing is written).
        """
        self._check_writable()
        validate_step(step)
        self._finish_rotation()
        self._check_fence()
        return CopyAttempt(step, self._strategy.prepare(self.storage, step, new_attempt_token()))

    def publish_copy(
        self,
        attempt: CopyAttempt,
        source: Manifest,
        files: Sequence[FileEntry],
        *,
        started: float | None = None,
    ) -> CheckpointInfo:
        """Commit the copy staged by :meth:`begin_copy`: ``source``'s step, metrics,
        metadata and checksums under this run, its next commit sequence number and its
        strategy, as one storage domain holding every rank's file (``files``: their
        entries as written here, paths relative to the copy's directory). The caller has
        verified each file against ``source`` (this call checks no bytes). Retention then
        runs as after a save. ``started``: a ``time.perf_counter()`` value, for the
        logged duration. Never replaces a committed step.

        Raises:
            CheckpointExistsError: step ``attempt.step`` is committed here already.
            LockError: another job took ROOT over (fenced: nothing is published).
            CheckpointError: storage errors (the attempt is then still to abandon).
        """
        if source.step != attempt.step:
            raise CheckpointError(f"the copy was begun for step {attempt.step}, not {source.step}")
        self._check_writable()
        self._check_fence()
        manifest = dataclasses.replace(
            source,
            run_id=self.run_id,
            commit_seq=self._next_seq(),
            files=tuple(files),
            strategy=self._strategy.name,
            library_version=__version__,
            domain_ranks=None,
            domain_count=1,
        )
        written = self._strategy.publish(
            self.storage, attempt.staged, manifest, rank=0, overwrite=False
        )
        elapsed = time.perf_counter() - started if started is not None else 0.0
        return self._after_commit(written, {"total": elapsed})

    def abandon_copy(self, attempt: CopyAttempt) -> None:
        """Discard a copy's staged files, unless it was committed after all (a publish
        whose answer was lost). Idempotent; never raises a storage error: what cannot be
        removed now is logged, and the next start of a manager on ROOT sweeps it."""
        try:
            if not self._strategy.is_committed(self.storage, attempt.step, attempt.staged):
                self._strategy.discard(self.storage, attempt.staged)
        except CheckpointError as exc:
            log.warning(
                "could not discard %s (the next start on this root sweeps it): %s",
                self.storage.url(attempt.staged),
                exc,
            )

    # ------------------------------------------------------------------ retention
    def _on_domain_view(
        self,
        step: int,
        views: tuple[
            list[tuple[int, dict[str, float], float]], list[tuple[int, dict[str, float], float]]
        ],
    ) -> None:
        """Several storage domains: decide retention from the steps committed in every
        domain (with domain 0's metrics) and this domain's own (``commit.Committed.
        domain_views``, gathered with the commit), identically on every leader, and
        remember what this domain deletes once the rotation thread runs."""
        if not self.is_coordinator or self.retention is None:
            return
        self._domain_victims[step] = self._victims(step, *views)

    def _victims(
        self,
        newest: int,
        everywhere: Sequence[tuple[int, dict[str, float], float]],
        mine: Sequence[tuple[int, dict[str, float], float]],
    ) -> list[int]:
        """What retention deletes in this domain, given the steps committed in every
        domain (``(step, metrics, created_unix)``, with domain 0's metrics: every leader
        decides alike) and this domain's own; never ``newest``."""
        from .retention import plan_deletions

        assert self.retention is not None
        # Only what every leader has alike (RetentionPolicy.keep says so): metadata
        # and sizes differ per domain or would cost the exchange too much.
        infos = [
            CheckpointInfo(
                step=s,
                path=self.storage.url(checkpoint_name(s)),
                size_bytes=0,
                metrics=m,
                created_unix=t,
                run_id=self.run_id,
            )
            for s, m, t in everywhere
            if s not in self._failed_verification
        ]
        victims = {i.step for i in plan_deletions(self.retention, infos, protect=(newest,))}
        if self.is_coordinator:
            self._warn_unrecorded_metrics(infos, victims)
        newest_common = max((i.step for i in infos), default=-1)
        # Steps only some domains committed (a save that failed half way) never count;
        # once a newer step is complete everywhere they are garbage (B8: node disks fill).
        # Above the step just committed they stay: they may be the only copies a node
        # kept of a run whose other node lost its disk (a save of that step replaces
        # one). A step every domain has but that failed verification is neither: it
        # stays, as with one domain.
        complete = {s for s, _, _ in everywhere}
        partial = {s for s, _, _ in mine if s not in complete and s < newest_common}
        # Except those a tiered job's tier 0 holds for the persistent tier: after a node
        # was replaced, the steps it lost stay restorable from the others' tier 0 and
        # their peer copies, and may be the only copies of a step tier 1 never got.
        held = getattr(self.retention, "held_partial", None)
        if partial and callable(held):
            partial -= set(held(partial))
        victims |= partial
        return sorted(victims - {newest})

    def apply_retention(self) -> list[int]:
        """Apply the retention policy now, as after a save: delete the checkpoints it no
        longer keeps, never the newest one. Collective: call it on every rank.

        Retention runs by itself after every save. Call this when what the policy keeps
        changed without a save: after setting ``mgr.retention`` to a new policy, or
        when the policy's answer depends on something outside ROOT (a
        ``TieredCheckpointManager`` does it for tier 0 at ``close()``, once
        replication has released the steps it held).

        Returns:
            The steps deleted (in any storage domain), ascending; the same on every
            rank.

        Raises:
            ReadOnlyError: the manager is read-only.
            CheckpointError: the manager is closed, or a deletion failed
                (on every rank alike; what was deleted before it stays deleted, the
                rest is retried by the next rotation).
        """
        if self._closed:
            raise self._closed_error()
        if self.read_only:
            raise ReadOnlyError(
                f"apply_retention() on a read-only CheckpointManager of {self.root}: "
                "open it without read_only=True to delete checkpoints"
            )
        # A forked child deleted the parent's checkpoints with it (or waited for ever
        # for the parent's async save).
        self._check_process("apply_retention()")
        self._finish_async()
        self._finish_rotation()
        # Every rank is in this call before the leader deletes anything: the leaders'
        # round below has the leader act first and tell the others after, so a rank 0
        # that called it alone (inside `if rank == 0:`) deleted checkpoints while the
        # other ranks were saving or restoring, and failed only afterwards.
        self._agree("apply_retention()", None)
        if self.domain.count == 1:
            _, deleted = self._on_leaders(
                "apply retention",
                functools.partial(self._retain, verify_kept=True),
                combine=_first,
                pick=_nothing,
            )
            return list(deleted)
        mine, everywhere = self._on_leaders(
            "apply retention: views",
            self._retention_view,
            combine=commit.steps_everywhere,
            pick=_nothing,
        )

        def delete() -> list[int]:
            if not everywhere or self.retention is None:
                return []
            newest = max(s for s, _, _ in everywhere)
            victims = self._victims(newest, everywhere, mine)
            for step in victims:
                self._delete_checkpoint(step)
            return victims

        _, deleted = self._on_leaders(
            "apply retention", delete, combine=_union_sorted, pick=_nothing
        )
        return list(deleted)

    def _retain(self, newest: int | None = None, *, verify_kept: bool = False) -> list[int]:
        """One storage domain, on its leader: apply retention, never to ``newest`` (the
        step just committed; None: the newest committed step). Returns the deleted
        steps. Only what changed since the last scan is read (the manifest cache).

        ``verify_kept`` (``apply_retention``, where no save just committed the newest
        checkpoint): before anything is deleted, the newest checkpoint the policy keeps
        is read in full unless this manager committed or restored it; one that fails
        its checksums is set aside (neither kept nor deleted) and the next newest must
        verify instead, so a corrupt newest never makes retention delete the last
        checkpoint that can be restored (as ``prune`` does)."""
        from .retention import plan_deletions, plan_keeping_a_verified_newest

        if self.retention is None:  # set to None meanwhile (a rotation thread): nothing
            return []
        manifests = catalog.committed(
            self.storage, run_id=self.run_id, warn=False, cache=self._manifests
        )
        infos = [
            m.info(self.storage.url(checkpoint_name(m.step)))
            for m in manifests
            if m.step not in self._failed_verification  # never kept or deleted by policy
        ]
        steps = {i.step for i in infos}
        if newest is None:
            newest = max(steps, default=None)
        if newest not in steps:
            return []  # nothing committed, or our own commit is not visible: a stale view
        if verify_kept:
            victims, infos = plan_keeping_a_verified_newest(
                self.retention,
                infos,
                lambda step: step in self._known_good or self._verifies(step, manifests),
                protect=(newest,),
            )
        else:
            victims = [v.step for v in plan_deletions(self.retention, infos, protect=(newest,))]
        self._warn_unrecorded_metrics(infos, victims)
        stuck: list[tuple[int, StorageError]] = []
        for step in victims:
            try:
                self._delete_checkpoint(step)
            except StorageError as exc:
                # One checkpoint that cannot be deleted (another owner, immutable, a
                # read-only copy) stopped every later deletion, oldest first: the disk
                # filled. The others go; this one is named, and retried next time.
                # (A FencedError is no StorageError: a job that lost ROOT stops here.)
                stuck.append((step, exc))
        if stuck:
            left = [s for s, _ in stuck]
            first = stuck[0][1]
            done = sorted(set(victims) - set(left))
            raise type(first)(  # StorageFullError stays one: the user's except names it
                f"retention could not delete checkpoint step(s) {left} of {self.root} "
                f"(deleted {done or 'nothing else'}; a step still committed is retried at "
                "the next rotation, the files of one already un-committed are removed by "
                f"the next start or `atomic-checkpoint clean`): {first}",
                errno=first.errno,
                path=first.path,
            ) from first
        return sorted(victims)

    def _verifies(self, step: int, manifests: Sequence[Manifest]) -> bool:
        """Whether checkpoint ``step`` (of ``manifests``) passes a full read of its
        files; a failure is logged."""
        name = checkpoint_name(step)
        manifest = next(m for m in manifests if m.step == step)
        try:
            catalog.validate_consistent(self.storage, name, manifest, full=True)
        except CorruptCheckpointError as exc:
            log.warning(
                "retention: %s fails verification, so it does not count as kept and is not "
                "deleted (the next newest must verify instead): %s",
                self.storage.url(name),
                exc,
            )
            return False
        self._known_good.add(step)
        return True

    def _warn_unrecorded_metrics(
        self, infos: Sequence[CheckpointInfo], victims: Collection[int]
    ) -> None:
        """Once per metric and manager: a ``KeepBest`` rule keeps nothing because no
        checkpoint records its metric (a misspelt name), while retention deletes
        checkpoints, among them the ones that rule was meant to keep. (The CLI's
        ``prune --keep-best`` refuses the same mistake.)"""
        from .retention import unrecorded_metrics

        if not victims:
            return
        for metric, recorded in unrecorded_metrics(self.retention, infos).items():
            if metric in self._warned_metrics:
                continue
            self._warned_metrics.add(metric)
            log.warning(
                "retention %r: none of this run's %d checkpoint(s) records metric %r "
                "(they record: %s), so KeepBest keeps none of them and the other rules "
                "decide what is deleted (now: %s). Check the metric name, and pass it in "
                "save(..., metrics={%r: value})",
                self.retention,
                len(infos),
                metric,
                ", ".join(recorded) or "no metric",
                ", ".join(checkpoint_name(s) for s in sorted(victims)),
                metric,
            )

    def _retention_view(self) -> list[tuple[int, dict[str, float], float]]:
        """This domain's committed steps, as retention decides from them (leader)."""
        return [
            (m.step, dict(m.metrics), m.created_unix)
            for m in catalog.committed(
                self.storage, run_id=self.run_id, warn=False, cache=self._manifests
            )
        ]

    def _start_rotation(self, newest: int) -> None:
        """Rotation after a durable commit, on the coordinator, off the training thread.

        The next save (and ``close``, ``rollback``, ``checkpoints``) waits for it, so a
        delete never races a save, and nothing of it runs after ``close``.
        """
        with self._rotation_lock:
            previous = self._rotation
        if previous is not None:
            previous.join()  # one rotation at a time; normally already joined by the save
        rotation = threading.Thread(
            target=self._rotate, args=(newest,), name="atomic-checkpoint-rotation", daemon=True
        )
        # Started before it is published: the training thread may join it at any moment
        # (checkpoints(), restore() during an async save's commit), and a thread that is
        # not started yet cannot be joined.
        rotation.start()
        with self._rotation_lock:
            self._rotation = rotation

    def _rotate(self, newest: int) -> None:
        """Apply retention after the commit of step ``newest`` (the step just saved).

        That step is never deleted here, whatever the policy or the other steps in ROOT
        say (DESIGN invariant 10: a save that returned success keeps its checkpoint);
        saves below the newest step are refused anyway (``StepOrderError``).
        """
        try:
            if self.domain.count > 1:
                # Decided from every domain's view, gathered with the commit.
                for step in self._domain_victims.pop(newest, []):
                    if step != newest:
                        self._delete_checkpoint(step)
                return
            self._retain(newest)
        except BaseException as exc:  # reported at the next save or close
            self._rotation_error = exc

    def _delete_checkpoint(self, step: int, *, why: str = "retention") -> None:
        """Un-commit first (leave the discoverable namespace), then delete the data
        (``CommitStrategy.retire``), unless this job lost the run lock."""
        name = checkpoint_name(step)
        try:
            deleted = self._strategy.retire(
                self.storage, step, rank=self.rank, fence=self._check_fence
            )
        finally:
            self._manifests.forget(name)  # un-committed, or unknown: read it again
            # What this job verified of it is gone with it (and the set stays as small
            # as the root: it grew by one per save over a week-long run).
            self._known_good.discard(step)
        if deleted:
            log.info("%s: deleted %s", why, self.storage.url(name))

    def _finish_rotation(self, within_s: float | None = None) -> bool:
        """Wait for the rotation in flight, if any; log its failure once. Several
        threads may wait at once (an async save's thread, the training thread in
        ``checkpoints()``): each returns only once the rotation ended. ``within_s``
        (``close(timeout_s=)``): wait at most that long, and return False if the
        rotation is still running then (a deletion stuck in a storage call)."""
        with self._rotation_lock:
            t = self._rotation
        if t is threading.current_thread():
            return True  # called from the rotation itself (a policy's code): it is running
        if t is not None:
            t.join(within_s)
            if t.is_alive():
                return False
        with self._rotation_lock:
            if self._rotation is t:
                self._rotation = None
            err, self._rotation_error = self._rotation_error, None
        if err is not None:
            log.warning(
                "retention after the previous save failed: %s: %s (policy %r; the "
                "checkpoints it meant to delete are still there; the next rotation "
                "retries)",
                type(err).__name__,
                err,
                self.retention,
                exc_info=err,
            )
        return True

    # ------------------------------------------------------------------ discovery
    def checkpoints(self) -> list[CheckpointInfo]:
        """This run's valid committed checkpoints, ascending by step. Collective.

        Waits for this manager's own rotation first, so the answer never includes a
        checkpoint it is about to delete.

        The first listing reads every manifest; later ones (and the rotation after each
        save) read only the manifests that changed since: a ``stat`` of each manifest
        (on an object store, one listing of ROOT) proves the others unchanged
        (``catalog.ManifestCache``). Every listed file is still checked for presence
        and size each time, as ``latest()`` checks them.
        """
        self._finish_rotation()
        infos, common = self._on_leaders(
            "list",
            self._list_coordinator,
            combine=_steps_everywhere if self.domain.count > 1 else None,
        )
        if common is not None:
            infos = [i for i in infos if i.step in common]
        # A leader's paths name its own view of ROOT: each rank names the copy it sees.
        return [
            dataclasses.replace(i, path=self.storage.url(checkpoint_name(i.step))) for i in infos
        ]

    def _list_coordinator(self) -> list[CheckpointInfo]:
        return [
            m.info(self.storage.url(checkpoint_name(m.step)))
            for m in catalog.committed(
                self.storage, run_id=self.run_id or None, cache=self._manifests
            )
        ]

    def latest(self) -> CheckpointInfo | None:
        """The newest valid checkpoint of this run, or None. Collective: every rank gets
        the coordinator's answer, so all ranks resume from the same step.

        "Valid" here means committed, manifest intact, every file present with its
        listed size: one manifest read and one ``stat`` per file, cheap even for
        terabyte checkpoints on a network filesystem. Checksums are not computed here
        (that is a full read of every file); ``restore()`` without a step checks them
        while it loads, and falls back to an older checkpoint on every rank if the
        newest one fails (see ``restore``).

        Only the newest candidates are read: one listing of ROOT, then manifests newest
        first until one validates (normally one; each corrupt or other run's checkpoint
        above it costs one more, and a corrupt one is skipped with a warning), so the
        answer costs the same with 10 or 10,000 checkpoints. With several storage
        domains a step counts only once every domain has it, which takes every
        domain's full list (``checkpoints()``).
        """
        self._finish_rotation()
        if self.domain.count > 1:
            found = self.checkpoints()
            return found[-1] if found else None
        manifest = self._collective(
            "latest",
            self._latest_coordinator if self.is_coordinator else None,
            pick=lambda m, _want: None if m is None else SharedManifest.of(m),
        )
        if manifest is None:
            return None
        return manifest.info(self.storage.url(checkpoint_name(manifest.step)))

    def _latest_coordinator(self, skip: frozenset[int] = frozenset()) -> Manifest | None:
        return catalog.newest(self.storage, run_id=self.run_id or None, skip=skip)

    def _record_passed_over(self, loaded: int, top: int) -> None:
        """After ``restore()`` fell back to ``loaded``: the run's checkpoints between it
        and ``top`` that the search passed over without reading them, because their
        sizes already showed them corrupt (a file cut short or missing), are recorded
        as skipped like those whose checksums failed: a save of their step replaces
        them (it raised ``CheckpointExistsError`` at every restart), retention neither
        counts nor deletes them. Listed by the coordinator, the same on every rank; one
        round, only after a fallback."""
        found: list[int] = []
        if self.is_coordinator:
            # Only the names between the two are read (it read every manifest of ROOT:
            # 10,000 of them, or 20 s on an object store, after one corrupt newest).
            between = [(s, n) for s, n in catalog.listed_steps(self.storage) if loaded < s < top]
            found = [
                e.step
                for e in catalog.newest_first(self.storage, run_id=self.run_id, steps=between)
                if e.status == "corrupt" and e.step is not None
            ]
        if self.world_size > 1:
            found = gather_summary(
                self.coordinator,
                "restore: passed over",
                found if self.is_coordinator else None,
                _coordinators_value,
                timeout_s=self.timeout_s,
            )
        self._failed_verification.update(found)

    def _newest_untried(self, tried: set[int]) -> int | None:
        """``restore()``'s next candidate: the newest valid checkpoint not in ``tried``
        (the same set on every rank), found as ``latest()`` finds its answer, newest
        first, not by listing every checkpoint. Collective."""
        self._finish_rotation()
        if self.domain.count > 1:
            found = [c.step for c in self.checkpoints() if c.step not in tried]
            return found[-1] if found else None
        manifest = self._collective(
            "restore: next candidate",
            self._latest_coordinator if self.is_coordinator else None,
            pick=lambda m, _want: None if m is None else SharedManifest.of(m),
            skip=frozenset(tried),
        )
        return None if manifest is None else manifest.step

    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        device: Any = None,
        verify: bool = True,
        allow_pickle: bool | None = None,
        rank: int | None = None,
    ) -> Any:
        """Load this rank's state of checkpoint ``step`` (default: the newest that
        verifies). Collective, and one answer (DESIGN invariant 11): every rank returns
        the state of the same step, or every rank raises the same error.

        Each rank reads only its own file; with ``verify`` its checksum is computed
        while it is read (no second pass). The ranks then exchange how their load went:

        - ``step=None``: if any rank's file of the newest checkpoint is corrupt (fails
          its checksum, torn, not a valid state file), every rank logs a warning naming
          the file(s) and loads the next older checkpoint instead, and so on. The cost
          of a corrupt checkpoint is the read of it; ``latest()`` stays a cheap check of
          sizes. If none is left, ``CorruptCheckpointError`` lists what was skipped.
        - ``step=N``: a corrupt ``N`` raises the same ``CorruptCheckpointError`` (naming
          the rank(s) and file(s)) on every rank.

        Other failures (I/O errors, ``allow_pickle`` refusals) are never skipped: every
        rank raises, the failing rank's own error where every rank failed alike, else
        the same ``DistributedCheckpointError`` naming the failing ranks.

        A reader racing an overwrite of the step (another job saving it again with
        ``overwrite=True``) could pair the manifest of one copy with the files of the
        other: after loading, each rank reads the manifest again, and if it changed on
        any rank, every rank reads the new copy (bounded, ``catalog.READ_ATTEMPTS``).

        Args:
            into: an existing state of the same structure (e.g. ``model.state_dict()``),
                or a part of it: tensors are read straight into it (the fast path); what
                it leaves out is loaded into new memory and returned. A tensor there of
                another shape or dtype, or one the checkpoint does not hold (a key it
                lacks, a list it has shorter, a value of another kind) raises
                ``StateMismatchError`` before anything is read. Targets that share
                memory (tied weights) are checked once read: where the checkpoint holds
                different values for them, ``StateMismatchError`` says so and every
                other target holds the checkpoint's values. After a fallback it holds
                the older checkpoint's values. The checksum is known only once every
                byte is in, so a restore that raises ``CorruptCheckpointError`` (or
                whose fallback then raises) has overwritten it with unverified data:
                the error says so; reinitialise it before using it.
            device: move loaded tensors there (e.g. ``"cuda:0"``). Tensors bound for a
                GPU (here or in ``into``) are read through page-locked buffers that are
                locked once per process (64 MiB; see ``device_staging``).
            verify: check the checksum of every byte read (cheap: hashed while reading).
                Without it, a corrupt file is found only where it does not parse.
            allow_pickle: override the manager's setting for this call.
            rank: read this rank's state instead of the calling rank's (tools, readers).

        Raises:
            CheckpointNotFoundError: no checkpoint of this run (``step=None``), or no
                checkpoint ``step`` (a reader of a live root: also one that the job's
                retention deleted while it was read; list again).
            CorruptCheckpointError: the checkpoint (``step``), or every checkpoint
                (``step=None``), does not verify.
            StateMismatchError: ``into`` does not match the checkpoint (no older
                checkpoint is tried for it).
            CheckpointError: ``device`` is a GPU this process does not see; or the
                checkpoint chosen holds files rather than a saved state (written by
                ``saving()``, a DCP save, or adopted from a framework): its files are
                read by path (``checkpoint_path(step)``), and no older checkpoint is
                tried instead.
        """
        verify = _flag("verify", verify)
        if allow_pickle is not None:
            allow_pickle = _flag("allow_pickle", allow_pickle)
        if device is not None:
            device = _torch_device(device)

        def load(manifest: Manifest) -> Any:
            return self._load_here(manifest, into, device, verify, allow_pickle, rank)

        try:
            return self._restore(step, load, rank)
        except CorruptCheckpointError as exc:
            if into is not None:
                _say_into_is_unverified(exc)
            raise

    def _restore(self, step: int | None, load: Callable[[Manifest], Any], rank: int | None) -> Any:
        """``restore``: ``step``, or the newest checkpoint that ``load`` verifies."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
        if step is not None:
            step = validate_step(step)
            self._agree("restore(step)", step)
            return self._restore_agreed(step, load, rank)
        skipped: list[str] = []
        tried: set[int] = set()
        vanished: dict[int, int] = {}
        while True:
            newest = self._newest_untried(tried)
            if newest is None:
                if skipped:
                    raise CorruptCheckpointError(
                        f"no checkpoint of run {self.run_id!r} in {self.root} verifies: "
                        + "; ".join(skipped)
                        + ". Restore one of them with restore(step=...) only after "
                        "repairing it; `atomic-checkpoint verify` lists every problem"
                    )
                raise CheckpointNotFoundError(self._nothing_to_restore())
            tried.add(newest)
            try:
                state = self._restore_agreed(newest, load, rank)
            except StateMismatchError as exc:
                if skipped:  # an older checkpoint does not fit ``into``, already overwritten
                    _say_into_is_unverified(exc)
                raise
            except CheckpointNotFoundError:
                # Un-committed meanwhile (retention, rollback: list again, it is gone),
                # or replaced by an overwrite of the same step whose old copy's files
                # went while they were read: the step is listed again, with its new
                # copy, a bounded number of times (found by the lifecycle model test).
                vanished[newest] = vanished.get(newest, 0) + 1
                if vanished[newest] <= catalog.READ_ATTEMPTS:
                    tried.discard(newest)
                continue
            except UnsafeCheckpointError:
                raise  # a refusal (pickle) that an older checkpoint would repeat
            except CorruptCheckpointError as exc:
                log.warning(
                    "restore: skipping checkpoint step %d on every rank: %s; trying the "
                    "next older checkpoint",
                    newest,
                    exc,
                )
                skipped.append(f"step {newest}: {exc}")
                self._failed_verification.add(newest)
                continue
            if skipped:
                self._record_passed_over(newest, max(tried))
            if skipped and self._newest_step is not None and self._newest_step > newest:
                # Every checkpoint above this one failed verification, on every rank
                # alike: training goes on from here, so the next save (above this step,
                # below the corrupt ones) must not be refused as a rollback. The corrupt
                # checkpoints stay on disk for inspection; rollback(step) removes them.
                self._newest_step = newest
            return state

    #: The checkpoint the last successful ``restore`` loaded (after a fallback, the older
    #: one), the same on every rank.
    last_restored: CheckpointInfo | None = None

    #: Asked before each removal of a rollback; once it says True the rollback stops
    #: there (``_RollbackStopped``). Set by a tiered manager on its persistent tier's
    #: manager: a rollback whose caller gave up waiting must not go on removing steps
    #: that tier 0 may no longer hold.
    _rollback_stop: Callable[[], bool] | None = None

    def resumed_from(self, info: CheckpointInfo, *, corrupt: Iterable[int] = ()) -> None:
        """Record a resume that your own loader did, so that the manager goes on as
        after a ``restore()`` that made the same choice: for checkpoints whose files
        are read by other code (a ``saving()`` block's, a framework's; the DCP and
        Accelerate integrations call it).

        ``corrupt`` are the newer checkpoints the loader tried first, newest first, and
        found corrupt (every checkpoint above ``info.step`` that it skipped). From then
        on, as after ``restore()`` skipped them: retention neither counts nor deletes
        them (a corrupt newest never makes it delete the checkpoint just loaded), a save
        of one of their steps replaces it with a warning instead of raising
        ``CheckpointExistsError``, and saves above ``info.step`` are not refused as going
        back (``StepOrderError``). Their files stay for inspection (``atomic-checkpoint
        verify``); ``rollback(info.step)`` removes them.

        Call it on every rank alike (a verdict the ranks agreed on). Not collective: it
        only records. ``last_restored`` becomes ``info``.

        Example (files written with ``saving()``, read back by your own code)::

            corrupt = []
            for info in reversed(mgr.checkpoints()):
                if my_loader_accepts(info.path):
                    mgr.resumed_from(info, corrupt=corrupt)
                    break
                corrupt.append(info.step)

        Raises:
            ValueError: a ``corrupt`` step is not above ``info.step``.
        """
        if not isinstance(info, CheckpointInfo):
            raise TypeError(f"info must be a CheckpointInfo, got {type(info).__name__}")
        bad = {validate_step(s) for s in corrupt}
        below = sorted(s for s in bad if s <= info.step)
        if below:
            raise ValueError(
                f"corrupt steps {below} are not above the step resumed from ({info.step}): "
                "pass the newer checkpoints your loader skipped"
            )
        self._failed_verification.update(bad)
        if self._newest_step is not None and self._newest_step in bad:
            # Every checkpoint above info.step failed verification (the contract): the
            # next save, above info.step, is not a rollback (as in _restore).
            self._newest_step = info.step
        self.last_restored = info

    def _restore_agreed(
        self, step: int, load: Callable[[Manifest], Any], rank: int | None = None
    ) -> Any:
        """Resolve ``step`` once (coordinator), load on every rank, agree on the outcome;
        read again if the step was replaced while being read. Each rank receives the
        manifest with only the files it may read (its rank's state file, or ``rank``'s,
        and the replicated one)."""
        wanted = (rank_state_file(self.rank if rank is None else rank), REPLICATED_STATE_FILE)
        first: tuple[Manifest | None, Manifest] | None = None  # (here, resolved) at the 1st try
        for attempt in range(catalog.READ_ATTEMPTS):
            resolved, refused = self._on_leaders(
                "resolve",
                self._resolve_coordinator if self.is_coordinator else None,
                combine=_first_error,
                pick=_files_for,
                want=wanted,
                step=step,
            )
            if refused is not None:
                # Any leader's error, the same on every rank: with several storage
                # domains a step one domain lacks (committed half way) is refused on
                # every rank, not loaded by some while the others raise.
                raise refused
            manifest: Manifest = resolved
            state: Any = None
            error: Exception | None = None
            try:
                state = load(manifest)
            except Exception as exc:  # shared below, then raised on every rank
                error = exc
            # A reader racing an overwrite: a file opened after the swap belongs to the
            # new copy. Reading the manifest again after every file was opened (and
            # read) tells: unchanged on every rank means every rank read this copy.
            try:
                now = catalog.manifest_now(self.storage, checkpoint_name(step))
            except CheckpointError as exc:  # shared like a failed load, never raised alone
                # The read that ends a restore failed (an EIO): this rank's error, said
                # on every rank; nothing is known of the copy here.
                changed, error, reread = False, error or exc, False
            else:
                changed = now is None or not catalog.same_copy(now, manifest)
                first, reread = first or (now, manifest), True
            if (
                reread
                and first is not None
                and attempt == catalog.READ_ATTEMPTS - 1
                and (
                    now is None
                    or (
                        changed
                        and first[0] is not None
                        and catalog.same_copy(now, first[0])
                        and catalog.same_copy(manifest, first[1])
                    )
                )
            ):
                # Absent here at every try while the coordinator found it, or another
                # copy here than the coordinator's with neither changing in all these
                # reads (storage_domains="shared" on node-local disks): not a step being
                # replaced, but a rank that does not see the coordinator's ROOT.
                changed, error = False, self._unseen_step(step, now is not None)
            mine = (changed, None if error is None else _restore_failure(error, self.rank))
            # Rank 0 collects the outcomes; every rank gets one answer (O(N) bytes).
            changed, failures = gather_summary(
                self.coordinator,
                f"restore step {step}: outcome",
                mine,
                _restore_outcome,
                timeout_s=self.timeout_s,
            )
            if changed:
                log.info("checkpoint step %d was replaced while being read: reading it again", step)
                continue
            if not failures:
                self.last_restored = manifest.info(self.storage.url(checkpoint_name(step)))
                self._known_good.add(step)
                return state
            raise _agreed_restore_error(step, failures, error, self.world_size)
        raise CheckpointError(
            f"checkpoint step {step} in {self.root} was replaced {catalog.READ_ATTEMPTS} times "
            "while being read (it is being saved again and again with overwrite=True): "
            "restore it once the writer stops"
        )

    def _unseen_step(self, step: int, other_copy: bool = False) -> StorageError:
        """This rank's error for a step its coordinator read and this rank never saw (or,
        ``other_copy``, saw as another copy, unchanged at every read)."""
        where = self.storage.url(checkpoint_name(step))
        if other_copy:
            return StorageError(
                f"rank {self.rank} sees another copy of {where} than rank "
                f"{self.domain.leader} (its coordinator) read, and neither changed in "
                f"{catalog.READ_ATTEMPTS} reads: the ranks do not share one ROOT. Pass the "
                "same ROOT on every rank; for node-local disks, give each node its own host "
                "name (ATOMIC_CHECKPOINT_HOST) or pass storage_domains='per-host' (not "
                "'shared')"
            )
        return StorageError(
            f"rank {self.rank} does not see {where}, which rank {self.domain.leader} (its "
            "coordinator) read: the ranks do not share one ROOT (a node whose mount is "
            "missing sees an empty local directory there), or the step was deleted while "
            "being read. Check that every rank's ROOT is the same storage"
        )

    def _load_here(
        self,
        manifest: Manifest,
        into: Any,
        device: Any,
        verify: bool,
        allow_pickle: bool | None,
        rank: int | None,
    ) -> Any:
        """This rank's part of ``restore``: read (and verify) its file of ``manifest``."""
        from .serialization import load_state

        rel = checkpoint_name(manifest.step)
        if manifest.state_kind == "files":
            how = "adopted from a framework's files" if manifest.adopted else "saved with saving()"
            if "torch.distributed.checkpoint" in manifest.metadata:  # dcp.DCP_METADATA_KEY
                raise CheckpointError(
                    f"checkpoint step {manifest.step} is a torch.distributed.checkpoint (DCP) "
                    "checkpoint: load it with atomic_checkpoint.integrations.dcp.load_dcp(mgr, "
                    "state_dict, step), which reshards it into your state dict"
                )
            where = manifest.info(self.storage.url(rel)).files_path
            raise CheckpointError(
                f"checkpoint step {manifest.step} was {how}: read its files "
                f"from {where} (CheckpointInfo.files_path; verify(step) checks them first)"
            )
        if manifest.state_kind == "replicated":
            file_rel = REPLICATED_STATE_FILE
        elif rank is not None:
            if not 0 <= rank < manifest.world_size:
                raise ValueError(
                    f"rank {rank} is out of range: checkpoint step {manifest.step} was saved "
                    f"by {manifest.world_size} rank(s)"
                )
            check_placement(manifest, rank, asked=True)
            file_rel = rank_state_file(rank)
        else:
            check_world_size(manifest, self.world_size)
            check_placement(manifest, self.rank)
            file_rel = rank_state_file(self.rank)
        # Marker commits keep each attempt's files under attempt-<token>/.
        entry = catalog.state_file(manifest, file_rel)
        file_rel = entry.path
        catalog.check_inside(self.storage, rel, file_rel)
        path = f"{rel}/{file_rel}"
        pickle_ok = self.allow_pickle if allow_pickle is None else allow_pickle
        # Every byte is hashed (by this thread, as positioned reads from a local file
        # come in; in line with sequential reads elsewhere) before load_state returns,
        # and the state is handed out only if the checksum matches.
        digest = Hasher(manifest.checksum_algorithm) if verify else None
        # Where saves write with O_DIRECT, loads read what is not cached with it too.
        store = direct_io(self.storage)
        direct = store is not None and store.direct_io_enabled()
        with self.storage.open_read(path) as raw:
            try:
                state = load_state(
                    raw,
                    allow_pickle=pickle_ok,
                    into=into,
                    device=device,
                    size_bytes=entry.size_bytes,
                    digest=digest,
                    direct=direct,
                )
            except BaseException as exc:
                where = self.storage.url(path)
                if isinstance(exc, CorruptCheckpointError) and where not in str(exc):
                    # Say which file is bad: a job has one per rank.
                    raise type(exc)(f"{where}: {exc}") from exc
                raise
        if digest is not None:
            got = digest.hexdigest()
            if got != entry.checksum:
                raise CorruptCheckpointError(
                    f"{self.storage.url(path)}: checksum {got} does not match the manifest "
                    f"({entry.checksum}): the file is corrupt"
                )
        return state

    def _resolve_coordinator(self, step: int) -> Manifest | CheckpointError:
        """The manifest of ``step`` (presence and sizes checked), or the error that says
        why there is none: returned, not raised, so that every rank raises this very
        error (type and message), not a wrapper."""
        try:
            return catalog.load_checkpoint(self.storage, validate_step(step))
        except CheckpointError as exc:
            return exc

    def checkpoint_path(self, step: int) -> str:
        """Where checkpoint ``step`` lives (whether or not it exists): the folder that
        holds its manifest. Files a ``saving()`` block wrote in place under the marker
        strategy (object stores, s3fs-fuse mounts) are in a folder inside it: load them
        from ``CheckpointInfo.files_path``."""
        return self.storage.url(checkpoint_name(validate_step(step)))

    def verify(self, step: int) -> CheckpointInfo:
        """Full checksum verification of one checkpoint (run on the calling rank)."""
        m = catalog.load_checkpoint(self.storage, validate_step(step), full=True)
        return m.info(self.storage.url(checkpoint_name(m.step)))

    # ------------------------------------------------------------------ life cycle
    def close(self, timeout_s: float | None = None) -> None:
        """Finish background work, then release the run lock. Idempotent.

        An in-flight async save gets the manager's ``timeout_s`` to finish (or this
        call's ``timeout_s``, if shorter); past that it is asked to stop. Without
        ``timeout_s``, ``close`` then waits until the save has ended, however long its
        last storage call takes (a save past its last fence check is renaming or
        fsyncing its commit, which cannot be taken back), and reports what happened:

        - the save committed (in time, or because it was already committing when asked
          to stop): ``close`` returns;
        - it failed, or stopped before its commit: ``close`` raises its error
          (``SaveAbandonedError`` when it was stopped) unless this manager raised it
          already; nothing of it is a checkpoint.

        Only then does ``close`` wait for that save's retention and release the run
        lock: after ``close`` returns or raises, no thread of this manager touches
        ROOT (DESIGN invariant 12). Both outcomes are logged.

        Called inside a save on the save's own thread (a signal handler that interrupted
        it, or ``on_commit`` of a synchronous save), it returns at once and the manager
        closes as soon as that save has ended (successful or not).

        ``timeout_s`` bounds ``close`` itself, for a job that must exit within a
        preemption's grace period (``close(timeout_s=guard.time_left_s)``): a save
        still inside a storage call once it has passed (a stalled object store) is
        left running, and not a checkpoint unless it was already committing; so is
        retention still deleting an old checkpoint (logged; what it leaves is removed
        by the next start). The run lock then stays with this process, as at
        interpreter exit: released, another job could take ROOT under that save; it is
        taken over once the process is gone.
        """
        if timeout_s is not None:
            timeout_s = _wait_seconds("timeout_s", timeout_s)
        if self._closed:
            return
        if os.getpid() != self._pid:
            # A forked child: the run lock and the save thread are the parent's. Closed
            # here, nothing is released or waited for (the parent goes on with them).
            log.warning(
                "close() in process %d, a child made by fork of process %d that owns this "
                "manager: nothing is released (the parent still holds the run lock)",
                os.getpid(),
                self._pid,
            )
            self._closed = True
            return
        self._check_process("close()")
        self._close_in_save_slot(
            functools.partial(self._close, "close()", stop_bound_s=None, within_s=timeout_s),
            lambda: self._closed,
        )

    def _close_in_save_slot(self, body: Callable[[], object], closed: Callable[[], bool]) -> bool:
        """Run ``body``, a close of this manager (or of the tiered manager over it), as
        ``close()`` must: a save running on another thread ends first (closed under it,
        the run lock was released while it still wrote, and it failed afterwards or
        committed without the lock: DESIGN invariant 12); a save inside ``body`` is
        refused; a second close waits for the first and finds it ``closed()``. Inside a
        save of this very thread (a signal handler that interrupted it, or a synchronous
        save's ``on_commit``), ``body`` runs as soon as that save has ended, and this
        returns False at once (closed there, the lock went under the save, and inside
        ``save_async``'s copy close waited ``timeout_s`` for bytes only this thread
        copies)."""
        me = threading.get_ident()
        if self._saver_thread == me:
            self._close_after_save = body
            log.warning(
                "close() was called inside a save on the same thread (a signal handler, or "
                "on_commit): the manager closes as soon as that save has ended"
            )
            return False
        with self._save_mutex:
            if closed():
                return True
            self._saver_thread = me  # a save called from inside close is refused
            try:
                body()
            finally:
                self._saver_thread = None
        return True

    def _close(
        self,
        why: str,
        *,
        stop_bound_s: float | None,
        before_release: Callable[[bool], None] | None = None,
        within_s: float | None = None,
    ) -> None:
        """``close``. ``before_release(saved)``: run once the async save and the
        rotation are finished, while this job still holds the run lock (``saved``: the
        async save did not fail); a ``TieredCheckpointManager`` drains replication and
        applies tier 0's retention there. ``within_s``: ``close(timeout_s=)``, the
        whole wait for the async save (to finish, then to stop)."""
        deadline = None if within_s is None else time.monotonic() + within_s
        async_error = self._close_async(why, stop_bound_s, within_s)
        if self._async is not None and self._async.is_running:
            # Interpreter exit, or close(timeout_s=) spent: the save is stuck in a
            # storage call. Keep the run lock: released, another job could take ROOT
            # while this save may still rename into it; held by a process about to end,
            # it is taken over once the process is gone (logged by the saver). Not even
            # at the locks' own exit hook: its delete would hang on the stuck storage.
            self._keep_lock_for_what_still_runs()
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._finish_rotation(within_s=left):
            # close(timeout_s=) spent while retention is inside a storage call (a
            # deletion on a stalled mount): as for a stuck save. What it un-committed
            # or half deleted is swept by the next start (a crash there is the same).
            log.warning(
                "%s: retention is still deleting old checkpoints in %s after timeout_s=%g; "
                "left running (the next start removes what it leaves)",
                why,
                self.root,
                within_s,
            )
            self._keep_lock_for_what_still_runs()
            if async_error is not None:
                raise async_error
            return
        try:
            if before_release is not None:
                before_release(async_error is None)
        finally:
            self._release_lock()
            self._closed = True
            self._leave()
        if async_error is not None:
            raise async_error

    def _keep_lock_for_what_still_runs(self) -> None:
        """Close without releasing the run lock: a save or rotation of this manager is
        still inside a storage call, and the lock goes with this process."""
        if self._lock is not None:
            self._lock.keep_at_exit()
        self._closed = True

    def _leave(self) -> None:
        """After close: tell the other ranks that this one makes no more calls, so that
        a rank still saving fails at once, naming it, instead of waiting ``timeout_s``
        (``TorchDistributedCoordinator.leave``; a coordinator without it is skipped)."""
        coords = [self._async_coord]
        if self._owns_coordinator:
            coords.append(self.coordinator)
        for coord in coords:
            leave = getattr(coord, "leave", None)
            if leave is not None:
                leave()

    # ------------------------------------------------------------------ rollback
    def rollback(self, step: int, *, allow_empty: bool = False) -> list[int]:
        """Discard this run's checkpoints above ``step``, to continue training from an
        older checkpoint. Collective: call it on every rank.

        A save below the newest committed step raises ``StepOrderError``; to go back
        from step 200 to step 100, ``restore(100)`` and ``rollback(100)`` (in either
        order), then save 110, 120, ... Each checkpoint of this run above ``step`` is
        un-committed (taken out of the namespace, after checking this job still holds
        the run lock), then deleted, newest first: a crash midway leaves the older
        ones, never a half-deleted checkpoint that a reader could find. Other runs'
        checkpoints and entries that are not ours are never touched. Waits for an
        in-flight async save and for retention first (raising the save's failure, as
        ``save`` does).

        Args:
            step: the step to continue from; it need not exist, but a valid checkpoint
                of this run at or below it must (else retention had already deleted
                the step meant, and nothing would be left to continue from).
            allow_empty: remove this run's checkpoints above ``step`` even if none is
                left at or below it (``rollback(0, allow_empty=True)``: start over).

        Returns:
            The removed steps, newest first; the same list on every rank (with several
            storage domains, the steps removed in any of them). Empty if nothing was
            above ``step``. Saves of steps above ``step`` are allowed afterwards.

        Raises:
            CollectiveMismatchError: the ranks passed different steps (or some ranks
                were in another call); nothing is deleted.
            CheckpointError: it would remove every checkpoint of this run and
                ``allow_empty`` is False; nothing is deleted.
            FencedError: another job took over ROOT; nothing more is deleted.
            CheckpointError: a removal failed: every rank raises the same error, the
                checkpoints not removed yet are still valid, and calling ``rollback``
                again finishes the job.
        """
        allow_empty = _flag("allow_empty", allow_empty)
        self._check_writable()
        self._check_process("rollback()")
        step = validate_step(step)
        # Before anything is deleted: a rank with another step, or in another call
        # (a rollback under `if rank == 0:`), stops it on every rank.
        self._agree("rollback()", step)
        self._finish_async()
        self._finish_rotation()
        _, (removed, summary) = self._on_leaders(
            "rollback",
            self._rollback_coordinator,
            combine=_rollback_summary,
            pick=_nothing,
            step=step,
            allow_empty=allow_empty,
        )
        if not summary["decide"]:
            # As at open: the domains' newest valid steps left differ by more than the few
            # each read; every leader lists all of them.
            _, summary = self._on_leaders(
                "rollback: every valid step",
                self._scan_view,
                combine=_views_summary,
                pick=_nothing,
                run_id=self.run_id,
            )
        self._newest_step = summary["newest"]
        self._failed_verification = {s for s in self._failed_verification if s <= step}
        if self.rank == 0:
            log.info(
                "rollback to step %d in %s: removed step(s) %s; the newest checkpoint is now %s",
                step,
                self.root,
                removed,
                self._newest_step,
            )
        return removed

    def _rollback_coordinator(
        self, step: int, allow_empty: bool = False
    ) -> tuple[list[int], dict[str, Any]]:
        """Remove this domain's checkpoints of this run above ``step``, newest first.
        Returns the removed steps and this domain's view of the valid steps left (its
        newest ones at or below ``step``, as ``_start_view`` reports them at open).

        Reads the manifests above ``step`` and, below it, down to the newest valid one
        (``catalog.above``), not every manifest in ROOT. A corrupt checkpoint with a
        readable manifest of this run is ours and goes; without a manifest nobody can
        tell whose it is, so it is left alone."""
        if self.storage.local_path("") is not None and not self.storage.is_dir(""):
            # A listing of a root that vanished (unmounted, replaced by a file) is empty:
            # "nothing above the step" returned success, and a tiered rollback then
            # rolled tier 0 back while the unreachable persistent tier kept the steps.
            raise StorageError(
                f"rollback({step}): {self.root} is not a directory any more (unmounted, "
                "moved or replaced?): nothing was removed. Call rollback again once it is "
                "back",
                path=self.root,
            )
        count = 1 if self.domain.count == 1 else _DOMAIN_VIEW_STEPS
        found = catalog.above(
            self.storage, step, run_id=self.run_id, count=count, cache=self._manifests
        )
        victims = sorted(found.ours)
        if victims and not found.below.valid and not allow_empty:
            raise CheckpointError(
                f"rollback({step}) would remove every checkpoint of run {self.run_id!r} in "
                f"{self.root} (steps {victims}) and leave none at or below step {step} to "
                f"continue from: nothing was removed. Roll back to one of them (e.g. "
                f"rollback({victims[0]}) keeps step {victims[0]}), or pass "
                "allow_empty=True to remove them all and start over"
            )
        remaining = {
            "valid_steps": [m.step for m in found.below.valid],
            "complete": found.below.complete,
        }
        removed: list[int] = []
        for victim in reversed(victims):
            if self._rollback_stop is not None and self._rollback_stop():
                left = [v for v in victims if v <= victim]
                raise _RollbackStopped(
                    f"rollback to step {step} in {self.root} stopped before step {victim}: "
                    f"its caller gave up; removed step(s) {removed}, step(s) {left} were not "
                    "touched",
                    removed,
                )
            try:
                self._delete_checkpoint(victim, why="rollback")
            except BaseException as exc:
                # A job that lost ROOT (FencedError) cannot roll back at all: the advice
                # to call again would fail the same way.
                again = (
                    "this job lost the run lock: the job that holds ROOT now decides"
                    if isinstance(exc, FencedError)
                    else f"call rollback({step}) again"
                )
                log.error(
                    "rollback to step %d in %s: removed step(s) %s, then removing step %d "
                    "failed; step(s) %s were not touched (%s)",
                    step,
                    self.root,
                    removed,
                    victim,
                    [v for v in victims if v < victim],
                    again,
                )
                raise
            removed.append(victim)
        return removed, remaining

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        close_propagating(self, exc)


def close_propagating(mgr: Any, exc: BaseException | None) -> None:
    """``mgr.close()`` as a ``with`` block ends: if the block raised, its exception goes
    on (the training error, ``KeyboardInterrupt``, the preemption exit's
    ``SystemExit``); a failure of ``close()`` itself (a failed async save) is then
    logged and noted on it, never raised in its place."""
    if exc is None:
        mgr.close()
        return
    try:
        mgr.close()
    except Exception as failure:
        log.error("closing %r after the with-block raised: %s", mgr, failure)
        note = getattr(exc, "add_note", None)  # Python >= 3.11
        if note is not None:
            note(f"closing the checkpoint manager also failed: {failure}")


@dataclasses.dataclass(frozen=True)
class CopyAttempt:
    """A copy being committed (:meth:`CheckpointManager.begin_copy`): the step, and the
    directory its files go to (relative to the manager's storage), invisible until
    :meth:`CheckpointManager.publish_copy`."""

    step: int
    staged: str


class SavingDir(type(Path())):  # type: ignore[misc]  # PosixPath or WindowsPath
    """The pending directory a ``saving()`` block writes into: a ``pathlib.Path``.
    ``info`` is the committed checkpoint after the block (identical on every rank), or
    None (inside the block, or when the save failed)."""

    info: CheckpointInfo | None = None


class _SavingBlock:
    """The body of ``saving()``: the user writes, then every rank commits or aborts."""

    def __init__(
        self,
        mgr: CheckpointManager,
        step: int,
        metrics: dict[str, float],
        metadata: dict[str, Any],
        overwrite: bool,
    ):
        self.mgr, self.step, self.metrics, self.metadata, self.overwrite = (
            mgr,
            step,
            metrics,
            metadata,
            overwrite,
        )
        self.info: CheckpointInfo | None = None
        self._pending: commit.Pending | None = None

    def __enter__(self) -> SavingDir:
        mgr = self.mgr
        local = mgr.storage.local_path("")
        if local is None:
            raise CheckpointError(
                "saving() needs a mounted filesystem; use save() for object stores"
            )
        mgr._finish_rotation()
        # Step 1 on every rank; the user's block is step 2; ``__exit__`` finishes.
        pending = self._pending = commit.begin(
            mgr._ctx,
            self.step,
            overwrite=mgr._replaces_failed(self.step, self.overwrite),
        )
        if not pending.writes:  # this rank must not write: finish says why, everywhere
            self._finish(None)
            raise CommitError(f"step {self.step}: this rank was told not to write")
        # The storage's own path of it: Accelerate's project view maps checkpoint-<n>/
        # (where the marker strategy writes in place) to checkpoints/checkpoint_<n>/; a
        # join of ROOT and the protocol's name put the files where the commit never
        # looked, and every save_state() failed on an s3fs-mounted project.
        where = mgr.storage.local_path(pending.location)
        return SavingDir(where if where is not None else local)

    def _finish(self, written: RankReport | commit.Failed | None) -> None:
        mgr, pending = self.mgr, self._pending
        if pending is None:
            return
        # ``finish`` removes the pending location itself if the save fails.
        done = commit.finish(
            mgr._ctx,
            pending,
            written,
            commit_seq=mgr._next_seq(),
            state_kind="files",
            metrics=self.metrics,
            metadata=self.metadata,
            scan=True,  # the block's files: neither checksummed nor fsync'd yet
        )
        mgr._failed_verification.discard(self.step)  # replaced by a valid copy
        self.info = mgr._after_commit(done.manifest, done.timings, done.domain_views)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self._finish(RankReport((), 0.0, 0.0))
            return
        # The block failed on this rank: every rank's save fails alike. With one
        # process the user's exception propagates; with several, this rank raises the
        # error every other rank raises (naming this rank), its own exception the cause,
        # so that code handling the save's failure runs alike on every rank.
        why = CheckpointError(f"the saving() block raised {type(exc).__name__}: {exc}")
        # An integration's DistributedCheckpointError said a full disk already (DCP).
        full = (
            None
            if isinstance(exc, DistributedCheckpointError)
            else full_storage_error(self.mgr.storage, exc)
        )
        try:
            self._finish(commit.Failed("write", full or why))
        except CheckpointError as shared:
            # A DistributedCheckpointError from the block is already every rank's error
            # (the integrations agree on their own failures, e.g. save_dcp's): kept.
            if (
                self.mgr.world_size > 1
                and isinstance(exc, Exception)
                and not isinstance(exc, DistributedCheckpointError)
            ):
                raise shared from exc
        if full is not None and self.mgr.world_size == 1:
            raise full from exc


def _say_into_is_unverified(exc: CheckpointError) -> None:
    """Add to ``exc`` (raised by a ``restore(into=)`` after a load that failed its
    verification) that the caller's tensors hold unverified data now: they are read
    straight into, and the checksum is known only once every byte is in."""
    exc.args = (
        f"{exc.args[0] if exc.args else exc}. The tensors passed as into= may hold data of a "
        "checkpoint that failed verification now: reinitialise them (or restore another "
        "checkpoint into them) before using them",
        *exc.args[1:],
    )


def _calls_and_failures(
    values: list[tuple[tuple[int, str, bool], RankFailure | None]],
) -> tuple[list[tuple[int, str, bool]], list[RankFailure]]:
    """Each rank's ``(step, kind, overwrite)``, and the failures, of ``_agree_to_save``'s
    round."""
    return [s for s, _ in values], [f for _, f in values if f is not None]


class _RollbackStopped(CheckpointError):
    """A rollback that its ``_rollback_stop`` hook stopped between two removals:
    ``removed`` went (un-committed, then deleted), the others were not touched and are
    still valid checkpoints."""

    def __init__(self, message: str, removed: list[int]):
        super().__init__(message)
        self.removed = removed


@dataclasses.dataclass(frozen=True)
class _Request:
    """One save as its caller asked for it, its arguments checked: what ``_save``
    commits. ``kind`` is the manifest's ``state_kind``: ``per_rank``, ``replicated`` or
    ``files`` (a ``saving()`` block's)."""

    step: int
    kind: str
    metrics: dict[str, float]
    metadata: dict[str, Any]
    overwrite: bool


def _state_kind(replicated: bool) -> str:
    return "replicated" if replicated else "per_rank"


def _checked_input(
    metrics: Mapping[str, SupportsFloat] | None, metadata: Mapping[str, Any] | None
) -> tuple[dict[str, float], dict[str, Any], Exception | None]:
    """A save's metrics and metadata, checked, and what is wrong with them on this rank
    (None if nothing): handed to the commit's first step, which raises it on every
    rank. Raised here on this rank alone, it left the other ranks in the save while
    this one went on to the next (every later save then failed)."""
    try:
        return check_metrics(metrics), check_metadata(metadata), None
    except (TypeError, ValueError) as exc:
        return {}, {}, exc


#: With several storage domains, how many of its newest valid steps each leader reports
#: at open: enough to agree without a full scan when a save failed half way (its step
#: committed in some domains only) or two in a row did.
_DOMAIN_VIEW_STEPS = 3


def _files_for(resolved: Any, names: tuple[str, ...]) -> Any:
    """``restore``'s resolved manifest as a rank other than the leader receives it:
    only the entries of the state files ``names`` (at the top of the checkpoint, or
    under a committed attempt's directory: ``catalog.state_file``); an error as it is."""
    if not isinstance(resolved, Manifest):
        return resolved
    return SharedManifest.of(resolved, keep=lambda f: f.path.rsplit("/", 1)[-1] in names)


def _views_summary(views: list[dict[str, Any]]) -> dict[str, Any]:
    """What every rank needs of the domain leaders' views of ROOT (in the order of the
    leaders; computed once): whether they ``decide`` the newest step valid in every
    domain, that step (``newest``; None: there is none, or the manager is read-only and
    did not list them) and, for a start, the view of the whole job (``setup``: a step
    counts only where every domain has it).

    Each leader reports its newest valid steps, all of them only if its view is
    ``complete``. A step above the newest one common to the views is valid everywhere
    only if some view lacks it for not reaching that far down, so the views decide if
    every incomplete view reaches down to that common step; where they do not, every
    leader lists all its steps (``_full_views``). One domain: always."""
    steps = [set(v.get("valid_steps") or ()) for v in views]
    common = set.intersection(*steps) if steps else set()
    newest = max(common, default=None)
    if len(views) == 1 or all(v.get("complete", True) for v in views):
        decide = True
    else:
        decide = newest is not None and all(
            v.get("complete", True) or newest >= min(v["valid_steps"]) for v in views
        )
    setup = {
        "n_valid": len(common),
        "n_valid_counted": all(v.get("n_valid_counted", True) for v in views),
        "newest": newest,
        "n_corrupt": sum(v.get("n_corrupt", 0) for v in views),
        "corrupt_steps": sorted({s for v in views for s in v.get("corrupt_steps", ())}),
        "last_seq": max((v.get("last_seq", 0) for v in views), default=0),
        "unmanifested": sorted({n for v in views for n in v.get("unmanifested", ())}),
        "other_runs": {r: s for v in views for r, s in (v.get("other_runs") or {}).items()},
        # Steps some domains hold and others not (see _check_resume_mode).
        "partial_steps": sorted(set.union(*steps) - common) if steps else [],
        # Domains whose root had no run file before this start (a wiped node's).
        "fresh_domains": sum(1 for v in views if v.get("fresh", False)),
        # Of those, the ones saved by a job of another shape (``_other_shapes``).
        "shapes": {
            s: shape
            for v in views
            for s, shape in (v.get("shapes") or {}).items()
            if s not in common
        },
    }
    return {"decide": decide, "newest": newest, "setup": setup}


def _rollback_summary(
    results: list[tuple[list[int], dict[str, Any]]],
) -> tuple[list[int], dict[str, Any]]:
    """The leaders' rollbacks, as every rank needs them: the steps removed in any
    domain (newest first), and the summary of the views left (``_views_summary``)."""
    removed = sorted({s for gone, _ in results for s in gone}, reverse=True)
    return removed, _views_summary([left for _, left in results])


def _restore_outcome(
    outcomes: list[tuple[bool, tuple[RankFailure, str] | None]],
) -> tuple[bool, list[tuple[RankFailure, str]]]:
    """Every rank's outcome of a load, as every rank needs it: whether any rank saw the
    checkpoint replaced while reading it, and the ranks' failures in rank order."""
    return any(c for c, _ in outcomes), [f for _, f in outcomes if f is not None]


def _torch_device(device: Any) -> Any:
    """``restore(device=...)`` as a ``torch.device``, checked before anything is read: a
    CUDA device this process cannot use is refused here, in words, not by torch's
    ``AssertionError`` from the first tensor moved (after the file was read).

    Raises:
        ValueError: ``device`` names no torch device.
        CheckpointError: it is a CUDA device that this process has not got.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"restore(device={device!r}): not a torch device ({exc})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise CheckpointError(
                f"restore(device={device!r}): this process sees {count} CUDA device(s) "
                "(torch.cuda.device_count(); CUDA_VISIBLE_DEVICES may hide some): load "
                "with device=None or 'cpu', or where that GPU is visible"
            )
    elif dev.type not in ("cpu", "meta"):
        # Another backend (mps, xpu, hpu...): one empty tensor asks torch whether this
        # process can use it, before the file is read; it answered with a
        # NotImplementedError or RuntimeError from the first tensor otherwise.
        try:
            torch.empty(0, device=dev)
        except Exception as exc:
            raise CheckpointError(
                f"restore(device={device!r}): this process cannot allocate on {dev} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
                "load with device=None or 'cpu', or where that device is available"
            ) from None
    return dev


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _without_steps(setup: dict[str, Any], _want: Any) -> dict[str, Any]:
    """A leader's view at open as the other ranks of its domain receive it: without its
    list of steps (the summary says what they need of it)."""
    return {k: v for k, v in setup.items() if k not in ("valid_steps", "shapes")}


def _nothing(_result: Any, _want: Any) -> None:
    """For a round whose summary is all the other ranks need of the leaders' results."""
    return None


def _first(results: list[Any]) -> Any:
    return results[0]


def _first_error(results: list[Any]) -> CheckpointError | None:
    """The first of the leaders' results that is an error (in the leaders' order)."""
    return next((r for r in results if isinstance(r, CheckpointError)), None)


def _union_sorted(results: list[list[int]]) -> list[int]:
    return sorted({s for r in results for s in r})


def _steps_everywhere(results: list[list[CheckpointInfo]]) -> set[int]:
    """The steps every domain's leader listed."""
    return set.intersection(*({i.step for i in r} for r in results))


def _restore_failure(exc: Exception, rank: int) -> tuple[RankFailure, str]:
    """What one rank tells the others about its failed load, and its kind: ``corrupt``
    (the checkpoint is bad: a fallback may skip it), ``refused`` (an unsafe checkpoint
    or a pickle refusal, which an older checkpoint may well repeat) or ``error`` (I/O,
    arguments: says nothing about the checkpoint)."""
    if isinstance(exc, UnsafeCheckpointError):
        kind = "refused"
    elif isinstance(exc, (CorruptCheckpointError, CheckpointNotFoundError)):
        # A file the manifest lists that cannot be opened is as corrupt as a torn one.
        kind = "corrupt"
    else:
        kind = "error"
    return RankFailure(rank, "restore", type(exc).__name__, str(exc) or repr(exc)), kind


def _newer_runs(others: Mapping[str, int], newest: int | None) -> str:
    """``run 'a' (newest step 20); ...`` for the runs in ``others`` (run -> its newest
    step) newer than ``newest``; "" when there is none."""
    return "; ".join(
        f"run {rid!r} (newest step {step})"
        for rid, step in sorted(others.items())[:5]
        if newest is None or step > newest
    )


def _agreed_restore_error(
    step: int, failures: list[tuple[RankFailure, str]], mine: Exception | None, world: int
) -> Exception:
    """The one error every rank raises after a failed load, built from what every rank
    sent, so type and message are the same everywhere (DESIGN invariant 11)."""
    if world == 1 and mine is not None:
        return mine
    if all(kind == "corrupt" for _, kind in failures):
        return CorruptCheckpointError(
            f"checkpoint step {step} does not verify on {len(failures)} of {world} rank(s): "
            + "; ".join(f"rank {f.rank}: {f.message}" for f, _ in failures)
        )
    types = {f.error_type for f, _ in failures}
    if len(failures) == world and len(types) == 1 and mine is not None:
        return mine  # every rank failed alike: its own error (same type everywhere)
    return DistributedCheckpointError(
        [RankFailure(f.rank, f"restore step {step}", f.error_type, f.message) for f, _ in failures],
        step=step,
        operation="load",
    )


def _with_timings(info: CheckpointInfo, timings: dict[str, float]) -> CheckpointInfo:
    from dataclasses import replace

    return replace(info, timings_s=dict(timings))


_STRATEGY_LOGGED: set[tuple[str, str]] = set()


def _policy_setting(policy: Any) -> str | None:
    """A retention policy as the ranks compare it at open: its repr where its class
    defines one (every policy here does: ``KeepLast(3) | KeepBest(1, ...)``), else its
    class name (the default repr holds an address, which differs by process)."""
    if policy is None:
        return None
    if type(policy).__repr__ is object.__repr__:
        return type(policy).__qualname__
    return repr(policy)


def _log_strategy_once(storage: Storage, strategy: str, *, forced: bool) -> None:
    """Say once per root and process which commit strategy is used, and why."""
    key = (storage.url(""), strategy)
    if key in _STRATEGY_LOGGED:
        return
    _STRATEGY_LOGGED.add(key)
    caps = storage.capabilities
    if forced:
        why = f"{caps.name}: chosen with strategy={strategy!r}"
    elif strategy == "marker":
        why = f"{caps.name}: directory rename is copy+delete"
    else:
        why = f"{caps.name}: atomic directory rename"
    log.info("atomic-checkpoint: using %s commits on %s (%s)", strategy, storage.url(""), why)


def _check_coordinator(coord: Any) -> None:
    """Raise ``TypeError`` or ``ValueError`` unless ``coord`` looks like a
    :class:`Coordinator` (an AttributeError from deep inside the first exchange said
    nothing of what was passed)."""
    missing = [
        m for m in ("all_gather", "broadcast", "clone") if not callable(getattr(coord, m, None))
    ]
    rank, world = getattr(coord, "rank", None), getattr(coord, "world_size", None)
    if missing or isinstance(coord, type):
        raise TypeError(
            f"coordinator must be a Coordinator object (rank, world_size, all_gather, "
            f"broadcast, clone), or None for the default; got {type(coord).__name__} "
            f"{coord!r:.80}" + (f" (no {', '.join(missing)})" if missing else "")
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world)):
        raise TypeError(
            f"coordinator.rank and .world_size must be ints, got {rank!r} and {world!r}"
        )
    if not 0 <= rank < world:  # type: ignore[operator]
        raise ValueError(
            f"coordinator.rank must be in [0, world_size): got rank {rank} of world_size {world}"
        )


def _coordinators_value(values: list[Any]) -> Any:
    """A round's summary: rank 0's value (the coordinator of one storage domain)."""
    return values[0]
