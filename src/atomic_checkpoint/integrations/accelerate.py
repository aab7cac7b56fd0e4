"""Atomic ``save_state`` / ``load_state`` for Hugging Face Accelerate.

Installed once on the ``Accelerator``, the switch makes every ``accelerator.save_state()``
and ``accelerator.load_state()`` of the program atomic, third-party code's included::

    from atomic_checkpoint.integrations.accelerate import make_atomic

    accelerator = make_atomic(Accelerator(project_config=config))
    accelerator.load_state()      # newest complete checkpoint (CheckpointNotFoundError if none)
    ...
    accelerator.save_state()      # committed atomically, named as Accelerate names it

Or call the two functions at the call sites::

    from atomic_checkpoint.integrations.accelerate import load_state, save_state

    info = load_state(accelerator, missing_ok=True)  # newest complete checkpoint, or None
    ...
    save_state(accelerator)                          # instead of accelerator.save_state()

``close(accelerator)`` at the end waits for the last rotation (it also runs at exit).

``Accelerator.save_state`` with ``automatic_checkpoint_naming`` writes straight into
``checkpoints/checkpoint_<i>``: a crash mid-save leaves a torn folder, and
``load_state()`` takes the highest-numbered folder whatever it holds (FAILURE_MODES
A1). Worse, ``total_limit`` deletes the oldest folders *before* the new one is written,
so a crash during the save with ``total_limit=1`` leaves nothing to resume from (B4).

Here Accelerate's own ``save_state`` writes into the pending directory of a
:class:`~atomic_checkpoint.CheckpointManager`; the coordinator of each storage domain
checksums and fsyncs every file, writes the manifest last and renames the directory
into place, and only then applies retention, un-committing before deleting. The root
is the project directory, and Accelerate's names are kept (``storage.project``)::

    <project_dir>/                           ROOT
      checkpoints/checkpoint_3/              committed: listed by load_state()
        model.safetensors  optimizer.bin  scheduler.bin  random_states_<rank>.pkl
        checkpoint.manifest.json             written last
      .pending/checkpoint-4.<attempt>/       a save in progress: never loaded
      .atomic-checkpoint/                    run, lock, layout record

``checkpoints/`` holds committed checkpoints only, so Accelerate's own ``save_state()``
and ``load_state()`` (which list it and sort by the digits in each name) keep working
beside ours. With ``root=...`` checkpoints are ``ROOT/checkpoint-<step>`` instead. A
project written by an earlier version (our folders inside ``checkpoints/``) is used as
it is.

The step defaults to ``accelerator.save_iteration`` (Accelerate's automatic naming
counter); ``load_state`` sets that counter past the newest checkpoint (also when it
loaded an older one), so the next save neither collides nor falls below the newest.
``total_limit`` becomes ``KeepLast(total_limit)`` unless a ``retention`` policy is given.
``save_on_each_node`` keeps its meaning, verified against the storage (see
:class:`FrameworkRoot`). ``load_state(..., adopt_existing=True)`` first adopts the
complete folders that Accelerate's own ``save_state`` wrote (``atomic_checkpoint.adopt``).
An error raised by ``save_state``/``load_state`` releases the root's run lock.

This module also holds the machinery the Trainer integration (``hf.py``) shares: a
checkpoint root written by a framework's own save function, over one or several
storage domains.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, SupportsFloat

from .. import catalog
from .._checks import flag, positive_seconds, retention_policy
from ..adopt import CheckpointFolder, accelerate_is_complete, adopt, set_aside_unmanifested
from ..catalog import read_manifest
from ..coordination import Coordinator, gather_summary, rank_failure, shared_failures
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    LockError,
    ResumeError,
    StorageError,
)
from ..layout import (
    ACCELERATE_DIR,
    MANIFEST_NAME,
    META_DIR,
    checkpoint_name,
    parse_accelerate_name,
    parse_attempt_dir,
    parse_checkpoint_name,
    validate_step,
)
from ..lock import without_takeover_advice
from ..manager import CheckpointManager
from ..manifest import CheckpointInfo
from ..preemption import PreemptionGuard, protect_dataloaders, protecting_loaders_of
from ..retention import KeepLast
from ..storage import is_url, posix
from ..storage.base import Storage
from ..storage.detect import local_capabilities
from ..storage.local import LocalStorage, local_root
from ..storage.project import ProjectStorage, layout_of, record_layout

__all__ = [
    "FrameworkRoot",
    "close",
    "load_state",
    "make_atomic",
    "preemption_guard",
    "save_state",
]

log = logging.getLogger("atomic_checkpoint")


def _share_outcome(
    coordinator: Coordinator,
    key: str,
    own: BaseException | None,
    *,
    phase: str,
    step: int | None,
    timeout_s: float,
) -> None:
    """Collective: share this rank's outcome of ``phase`` (``own``: its error, or None);
    then every rank raises one error naming each failing rank (on a failing rank, its
    own error is the cause): ``except CheckpointError`` catches it on every rank alike.
    A single process raises its own error."""
    failure = None if own is None else rank_failure(own, coordinator.rank, phase)
    failures = shared_failures(coordinator, key, failure, timeout_s=timeout_s)
    if not failures:
        return
    if own is not None and coordinator.world_size == 1:
        raise own  # one process: its own error, as a save's is
    raise DistributedCheckpointError(failures, step=step) from own


def framework_path(label: str, root: str | os.PathLike[str]) -> str:
    """The local path of a framework's checkpoint root (``local_root``), or
    ``CheckpointError`` for a URL: the framework writes its files by OS path, and
    os.path.abspath made "s3://bkt/run" the local folder ./s3:/bkt/run, where the saves
    "succeeded" on the node's disk and nothing reached the bucket."""
    text = os.fspath(root)
    if is_url(text):
        raise CheckpointError(
            f"{label}: {text!r} is a URL; the framework writes its files by OS path, so "
            "its checkpoints need a mounted filesystem (a local disk, NFS, or the bucket "
            "mounted with s3fs-fuse, then the mount's path)"
        )
    return local_root(text)


class FrameworkRoot:
    """A checkpoint root that a framework's own save function writes into.

    One per (job, root): a :class:`~atomic_checkpoint.CheckpointManager` whose storage
    domains are probed (``storage_domains="auto"``) and checked against what the
    framework was told (``save_on_each_node``), plus the protocol around the
    framework's writes. Every method is collective over all ranks of the job, called in
    the same order.

    Args:
        root: the directory checkpoints are committed under (with ``storage``: the
            directory that storage is a view of, for messages).
        per_node: the framework's ``save_on_each_node``: every node's local rank 0
            writes a full copy. Without it only global rank 0 writes the model and
            optimizer, so storage that is not shared by all ranks is an error.
        retention: the retention policy.
        label: names the framework in messages and store keys.
        timeout_s: bound on every wait for other ranks.
        visibility_timeout_s: bound on waits for network filesystems.
        strategy: the commit strategy (None: chosen from the storage).
        storage: the storage of ``root`` when it is not a plain directory of
            ``checkpoint-<step>`` folders (``storage.project.ProjectStorage``).

    Raises:
        StorageError: ``per_node`` is False but some ranks cannot see the storage
            rank 0 writes to (FAILURE_MODES A5).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        per_node: bool,
        retention: Any,
        label: str,
        timeout_s: float = 600.0,
        visibility_timeout_s: float = 30.0,
        strategy: str | None = None,
        storage: Storage | None = None,
    ):
        self.root = framework_path(label, root)
        self.label = label
        self.timeout_s = timeout_s
        try:
            self.manager = CheckpointManager(
                self.root if storage is None else storage,
                retention=retention,
                timeout_s=timeout_s,
                visibility_timeout_s=visibility_timeout_s,
                storage_domains="auto",
                strategy=strategy,
            )
        except LockError as exc:
            # Its advice names CheckpointManager(takeover=True), which a Trainer or
            # Accelerate user does not call: say what they can do instead.
            exc.args = (without_takeover_advice(str(exc)), *exc.args[1:])
            raise
        domain = self.manager.domain
        if domain.count > 1 and not per_node:
            self.manager.close()
            raise StorageError(
                f"{label}: {self.root} is not shared by all processes: the ranks form "
                f"{domain.count} storage domains (led by ranks {list(domain.leaders)}), but "
                "save_on_each_node is off, so only rank 0 writes the model and optimizer "
                "and the other copies would lack them. Set save_on_each_node=True so each "
                "node commits a full copy, or put the root on storage every node mounts",
                path=self.root,
            )
        atexit.register(self.close)

    def _local(self, name: str) -> str:
        """The OS path of ``name`` (``ROOT/checkpoint-<step>``, or the folder that the
        storage keeps it in, e.g. Accelerate's ``checkpoints/checkpoint_<step>``)."""
        local = self.manager.storage.local_path(name)
        return local if local is not None else os.path.join(self.root, name)

    @property
    def folders(self) -> str:
        """The directory that holds the checkpoint folders (``ROOT``, or Accelerate's
        ``checkpoints/`` in a project directory)."""
        return os.path.dirname(self._local(checkpoint_name(0)))

    @property
    def is_coordinator(self) -> bool:
        """True on the one rank of this storage domain that commits and rotates."""
        return self.manager.is_coordinator

    def path(self, step: int) -> str:
        """The directory that holds the framework's files of committed checkpoint
        ``step`` under this rank's root: ``ROOT/checkpoint-<step>``, or its committed
        ``attempt-<token>/`` directory under a strategy that writes in place (the marker
        strategy: object-store mounts)."""
        name = checkpoint_name(step)
        base = self._local(name)
        if not self.manager.strategy.writes_in_place:
            return base
        manifest = read_manifest(self.manager.storage, name)
        tops = {f.path.split("/", 1)[0] for f in manifest.files if "/" in f.path}
        if len(tops) == 1:
            (top,) = tops
            if parse_attempt_dir(top) is not None:
                return os.path.join(base, top)
        return base

    def save(
        self,
        step: int,
        write: Callable[[Path, str], None],
        *,
        nested: str | None = None,
        metrics: Mapping[str, SupportsFloat] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Commit checkpoint ``step`` with the files ``write`` puts into a directory.

        Every rank calls ``write(directory, final)``: the framework writes whatever it
        writes into ``directory``; ``final`` is where those files will be once
        committed (for paths the framework records). With ``nested``, the framework
        writes into ``directory/nested`` (it insists on naming the folder itself) and
        the coordinator moves the entries up before the commit. A step that is already
        committed is replaced atomically (the framework saved the same step again).

        Returns:
            The committed checkpoint, the same on every rank.

        Raises:
            DistributedCheckpointError: a rank failed, on every rank alike (the failing
                rank's own error is its cause); no partial checkpoint is visible
                anywhere.
        """
        step = validate_step(step)
        mgr = self.manager
        final_base = self._local(checkpoint_name(step))
        if mgr.is_coordinator:
            set_aside_unmanifested(mgr.storage, step, self.label)
        with mgr.saving(step, metrics=metrics, metadata=metadata, overwrite=True) as pending:
            target = pending / nested if nested else pending
            # Marker strategy: the pending directory is the committed attempt directory.
            final = str(pending) if posix.is_under(str(pending), final_base) else final_base
            failure: BaseException | None = None
            try:
                write(target, final)
            except Exception as exc:
                failure = exc
            # Every rank's writes must be finished before the coordinator moves the
            # nested entries up, and every rank must leave the block the same way:
            # this exchange is that barrier, and it shares failures.
            _share_outcome(
                mgr.coordinator,
                f"{self.label} step {step}: files written",
                failure,
                phase="write",
                step=step,
                timeout_s=self.timeout_s,
            )
            if mgr.domain.count > 1:
                self._check_copies_match(target, step)
            if nested and mgr.is_coordinator:
                _flatten(pending, nested, step=step, label=self.label)
        if pending.info is None:  # pragma: no cover - saving() either commits or raises
            raise CommitError(f"{self.label} step {step}: the save returned no checkpoint")
        return pending.info

    def _check_copies_match(self, target: Path, step: int) -> None:
        """Several storage domains: every domain must hold the same kinds of files.

        Per-rank files differ by their rank number only, so names are compared with
        digit runs masked. A domain whose copy lacks what another holds (a framework
        that writes some files on global rank 0 only, although told to save on each
        node) would commit a checkpoint that cannot be resumed from on that node.
        """
        mgr = self.manager
        names = sorted(set(_masked_names(target))) if mgr.is_coordinator else None
        leaders = mgr.domain.leaders

        def lacking_of(views: list[list[str] | None]) -> dict[int, list[str]]:
            copies = {lead: set(views[lead] or ()) for lead in leaders}
            everything = set().union(*copies.values())
            return {
                lead: sorted(everything - got) for lead, got in copies.items() if got != everything
            }

        lacking = gather_summary(
            mgr.coordinator,
            f"{self.label} step {step}: files of each storage domain",
            names,
            lacking_of,
            timeout_s=self.timeout_s,
        )
        if lacking:
            detail = "; ".join(f"domain of rank {lead} lacks {m}" for lead, m in lacking.items())
            raise CommitError(
                f"{self.label} step {step}: the copies written on the {mgr.domain.count} "
                f"storage domains differ ({detail}; digits shown as #). The framework did "
                "not write a full copy on every node, so nothing was committed"
            )

    def resolve(self, step: int | None = None, *, verify: bool = True) -> int | None:
        """The step to resume from: the newest one committed and valid in every storage
        domain (or ``step``, checked). The same answer on every rank.

        Args:
            step: a specific step, or None for the newest.
            verify: recompute every checksum of the candidate on each domain's
                coordinator; a checkpoint that fails is skipped with a warning.

        Returns:
            The step, or None if the root holds no checkpoint and nothing torn.

        Raises:
            CheckpointNotFoundError: ``step`` is not a valid checkpoint everywhere.
            CorruptCheckpointError: ``step`` fails verification.
            ResumeError: checkpoint folders exist, but none is valid everywhere.
        """
        mgr = self.manager
        infos = {i.step: i for i in mgr.checkpoints()}  # agreed by every domain
        valid = list(infos)
        if step is not None:
            step = validate_step(step)
            if step not in valid:
                raise CheckpointNotFoundError(
                    f"{self.label}: step {step} is not a valid committed checkpoint under "
                    f"{self.root} (in every storage domain); valid steps: {valid}"
                )
            candidates = [step]
        else:
            candidates = sorted(valid, reverse=True)
        skipped: list[int] = []  # newer ones that failed verification
        for candidate in candidates:
            problem: tuple[bool, str] | None = None
            if mgr.is_coordinator:
                problem = self._unusable(candidate, verify)
            bad = gather_summary(
                mgr.coordinator,
                f"{self.label}: verified step {candidate}",
                problem,
                _given,
                timeout_s=self.timeout_s,
            )
            if not bad:
                # As after restore(): retention neither counts nor deletes the corrupt
                # newer ones (it deleted the checkpoint just resumed from and kept them),
                # and a save of one of their steps replaces it.
                mgr.resumed_from(infos[candidate], corrupt=skipped)
                return candidate
            corrupt, why = bad[0]
            if corrupt:
                skipped.append(candidate)
            if step is not None:
                if not corrupt:
                    raise CheckpointError(f"{self.label}: {why}")
                raise CorruptCheckpointError(
                    f"{self.label}: checkpoint step {step} failed verification: {why}"
                )
        names = _checkpoint_like_names(self.folders) if mgr.is_coordinator else []
        torn = gather_summary(
            mgr.coordinator,
            f"{self.label}: checkpoint folders",
            names,
            _union,
            timeout_s=self.timeout_s,
        )
        if not torn:
            return None
        raise ResumeError(
            f"{self.label}: asked to resume, but no checkpoint under {self.folders} is complete "
            f"and valid in every storage domain; found {torn} without a valid manifest "
            "(torn by a crash mid-save, or written without atomic-checkpoint). Move them "
            "away to start from scratch"
            # The Trainer takes a folder to resume from; Accelerate's integration a step.
            + (", or resume from an explicit path" if self.label == "Trainer" else "")
        )

    def _unusable(self, step: int, verify: bool) -> tuple[bool, str] | None:
        """On the coordinator: why checkpoint ``step`` cannot be resumed by the
        framework, as (corrupt, why); None if it can. A ``CheckpointManager.save()``
        into this root (an evaluation job's) holds the manager's own state file, none
        of the framework's: loading it failed inside the framework at every restart."""
        mgr = self.manager
        try:
            manifest = read_manifest(mgr.storage, checkpoint_name(step))
        except CheckpointError as exc:
            return True, str(exc)
        if manifest.state_kind != "files":
            why = (
                f"checkpoint step {step} under {self.root} was saved by "
                "CheckpointManager.save(), not through the framework (it holds none of "
                "its files): load it with CheckpointManager.restore()"
            )
            log.warning("%s: skipping %s", self.label, why)
            return False, why
        if verify:
            try:
                mgr.verify(step)
            except CorruptCheckpointError as exc:
                log.warning("%s: skipping checkpoint step %d: %s", self.label, step, exc)
                return True, str(exc)
        return None

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for background retention (at most ``timeout_s``: see
        ``CheckpointManager.close``). Not collective; idempotent."""
        self.manager.close(timeout_s=timeout_s)


def _given(values: list[Any]) -> list[Any]:
    """What the ranks reported, in rank order, without the ranks that had nothing."""
    return [v for v in values if v]


def _union(values: list[list[str]]) -> list[str]:
    return sorted({n for found in values for n in found})


def _masked_names(directory: Path) -> list[str]:
    return [re.sub(r"[0-9]+", "#", path) for path in posix.file_paths(str(directory))]


# Names frameworks give checkpoint folders: ours and the Trainer's (checkpoint-N), and
# Accelerate's automatic naming (checkpoint_N).
_CHECKPOINT_LIKE = re.compile(r"^checkpoint[-_][0-9]+\Z")


def _checkpoint_like_names(root: str) -> list[str]:
    return sorted(n for n in posix.list_names(root) if _CHECKPOINT_LIKE.match(n))


def _flatten(pending: Path, nested: str, *, step: int, label: str) -> None:
    """Move ``pending/nested/*`` up into ``pending`` (renames inside one uncommitted
    directory: nothing is visible to readers yet)."""
    inner = pending / nested
    if not inner.is_dir():
        raise CommitError(
            f"{label} step {step}: the framework wrote nothing into {str(inner)!r}, the "
            "directory it was pointed at; this version writes checkpoints somewhere else "
            "and is not supported by the integration"
        )
    for name in sorted(posix.list_names(str(inner))):
        posix.rename(str(inner / name), str(pending / name))
    posix.remove_dir(str(inner))


# ---------------------------------------------------------------------- Accelerate API
_ROOTS_ATTR = "_atomic_checkpoint_roots"
# The stock bound save_state/load_state that make_atomic() replaced on an instance.
_STOCK_ATTR = "_atomic_checkpoint_stock"
_warned: set[str] = set()


def _stock(accelerator: Any, name: str) -> Callable[..., Any]:
    """Accelerate's own ``save_state``/``load_state`` of ``accelerator`` (what ours call
    to write and read the files, also after :func:`make_atomic` replaced them)."""
    stock = accelerator.__dict__.get(_STOCK_ATTR)
    return stock[name] if stock else getattr(accelerator, name)


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _project_root(project: str) -> tuple[str, Storage | None]:
    """The root and storage of an Accelerate project directory: the project directory
    itself, viewed with Accelerate's names (``checkpoints/checkpoint_<i>``; the layout is
    recorded on first use), or, for a project an earlier version wrote (with our folders
    inside ``checkpoints/``), that folder as a plain root, so its checkpoints stay
    resumable."""
    folder = os.path.join(project, ACCELERATE_DIR)
    if posix.is_dir(os.path.join(folder, META_DIR)):
        _warn_once(
            folder,
            "accelerate: %s holds checkpoint-<n> folders written by an earlier version of "
            "atomic-checkpoint, and its .pending/ and .atomic-checkpoint/ folders make "
            "Accelerate's own save_state()/load_state() fail there (IndexError); it is used "
            "as it is. Start a new project_dir to get Accelerate's checkpoint_<n> names",
            folder,
        )
        return folder, None
    posix.make_dirs(project)
    base = LocalStorage(project, capabilities=local_capabilities(project))
    view = ProjectStorage(base)  # refuses a checkpoints/ that is a link or a mount point
    if layout_of(project) is None:
        record_layout(base)
    return project, view


def _checked(accelerator: Any, retention: Any, timeout_s: Any) -> float:
    """The checks every entry point makes before it opens or writes anything: an
    Accelerator, a retention policy (or None) and a positive ``timeout_s`` (returned as
    a float). A mistake in them was found at the first save, after the root was made."""
    if not (hasattr(accelerator, "project_configuration") and hasattr(accelerator, "save_state")):
        raise TypeError(
            f"expected an accelerate.Accelerator, got {type(accelerator).__name__} "
            f"{accelerator!r}: pass the job's Accelerator (accelerator = Accelerator(...))"
        )
    retention_policy(retention)
    return positive_seconds("timeout_s", timeout_s)


def _root_for(
    accelerator: Any, root: str | os.PathLike[str] | None, retention: Any, timeout_s: float
) -> tuple[str, FrameworkRoot]:
    """The open root of ``accelerator`` (opened on first use) and its key."""
    config = accelerator.project_configuration
    if root is None and not accelerator.project_dir:
        raise CheckpointError(
            "save_state/load_state: pass root=..., or give the Accelerator a "
            "ProjectConfiguration(project_dir=...) (checkpoints then go to "
            "<project_dir>/checkpoints/checkpoint_<n>, as with automatic_checkpoint_naming)"
        )
    key = framework_path("accelerate", root if root is not None else accelerator.project_dir)
    roots: dict[str, tuple[FrameworkRoot, Any]] = accelerator.__dict__.setdefault(_ROOTS_ATTR, {})
    if key in roots:
        opened, policy = roots[key]
        if retention is not None and retention != policy:
            raise ValueError(
                f"{key} is already open with retention {policy!r}; pass retention only on "
                "the first save_state/load_state call for a root"
            )
        return key, opened
    where, storage = (key, None) if root is not None else _project_root(key)
    if retention is None and config.total_limit is not None and config.total_limit > 0:
        retention = KeepLast(int(config.total_limit))
    opened = FrameworkRoot(
        where,
        per_node=bool(config.save_on_each_node),
        retention=retention,
        label="accelerate",
        timeout_s=timeout_s,
        storage=storage,
    )
    roots[key] = (opened, retention)
    return key, opened


def _forget(accelerator: Any, key: str) -> None:
    """Close the root ``key`` of ``accelerator`` (releasing its run lock) after an error:
    the next call opens it again. Not collective (every rank that raised calls it)."""
    roots: dict[str, tuple[FrameworkRoot, Any]] = accelerator.__dict__.get(_ROOTS_ATTR, {})
    entry = roots.pop(key, None)
    if entry is not None:
        try:
            entry[0].close()
        except Exception as exc:  # the error being raised is the one to report
            log.warning("accelerate: closing %s after an error failed too: %s", key, exc)


def _complete_stock(storage: Storage, step: int) -> bool:
    """Whether the folder of ``step`` is a complete checkpoint that Accelerate's own
    ``save_state`` wrote: no manifest, and Accelerate's completeness rule accepts it. A
    torn or unreadable one is not (a save replaces it, as the commit protocol does)."""
    name = checkpoint_name(step)
    try:
        read_manifest(storage, name)
        return False
    except CheckpointNotFoundError:
        try:
            return accelerate_is_complete(CheckpointFolder(storage, name, step)) is None
        except CheckpointError:
            return False
    except CheckpointError:
        return False


def _complete_stock_above(storage: Storage, step: int) -> list[int]:
    """The steps above ``step`` whose folders are complete checkpoints that Accelerate's
    own ``save_state`` wrote (``_complete_stock``: no manifest, every file read)."""
    found = (parse_checkpoint_name(n) for n in storage.listdir(""))
    return sorted(s for s in found if s is not None and s > step and _complete_stock(storage, s))


def _refuse_stock_checkpoint(opened: FrameworkRoot, step: int) -> None:
    """Collective: refuse to save over a *complete* folder of the same step that
    Accelerate's own ``save_state`` wrote (no manifest). A torn one is replaced, as the
    commit protocol does; a complete one is the user's checkpoint, and Accelerate itself
    refuses to overwrite it too."""
    mgr = opened.manager
    problem = None
    if mgr.is_coordinator:
        name = checkpoint_name(step)
        if mgr.storage.is_dir(name) and _complete_stock(mgr.storage, step):
            # With the newest step there: an iteration above it is free.
            listed = catalog.listed_steps(mgr.storage)
            newest = max((s for s, _ in listed), default=step)
            problem = (mgr.storage.url(name), newest)
    given = gather_summary(
        mgr.coordinator,
        f"accelerate step {step}: stock checkpoint in the way",
        problem,
        _given,
        timeout_s=opened.timeout_s,
    )
    if given:
        where, newest = given[0]
        raise CheckpointExistsError(
            f"save_state: {where} is a complete checkpoint that Accelerate's own save_state() "
            f"wrote (it has no manifest); not replacing it with step {step}. Resume from it "
            "with load_state(accelerator, adopt_existing=True) (the next save then follows "
            "it), or save above the newest step in the project: set "
            f"accelerator.project_configuration.iteration = {newest + 1}"
        )


def save_state(
    accelerator: Any,
    root: str | os.PathLike[str] | None = None,
    step: int | None = None,
    *,
    retention: Any = None,
    metrics: Mapping[str, SupportsFloat] | None = None,
    timeout_s: float = 600.0,
    **save_state_kwargs: Any,
) -> CheckpointInfo:
    """``accelerator.save_state()``, committed atomically. Call it on every process.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        root: where checkpoints are committed; default the project directory, with
            Accelerate's names: ``<project_dir>/checkpoints/checkpoint_<step>``. An
            explicit root holds ``ROOT/checkpoint-<step>`` folders.
        step: the checkpoint's step; default ``accelerator.save_iteration`` (the
            automatic-naming counter, which ``save_state`` advances).
        retention: e.g. ``KeepLast(3) | KeepBest(1, metric="eval_loss")``; default
            ``KeepLast(project_configuration.total_limit)``, or keep everything. Applied
            after the new checkpoint is durable, never before. Only on the first call
            for a root.
        metrics: recorded in the manifest (for ``KeepBest``).
        timeout_s: bound on every wait for other processes.
        **save_state_kwargs: passed to ``Accelerator.save_state`` (e.g.
            ``safe_serialization``).

    Returns:
        The committed checkpoint (``info.path`` is its folder).

    Raises:
        CheckpointExistsError: a complete folder of that step written by Accelerate's
            own ``save_state`` is in the way (a torn one is replaced).

    An error releases the root's run lock (the next call opens the root again).
    """
    timeout_s = _checked(accelerator, retention, timeout_s)
    if step is not None:
        step = validate_step(step)  # before the root is opened: nothing written for it
    key, opened = _root_for(accelerator, root, retention, timeout_s)
    try:
        config = accelerator.project_configuration
        if step is None:
            step = int(accelerator.save_iteration)
        _refuse_stock_checkpoint(opened, step)

        def write(directory: Path, final: str) -> None:
            # With automatic naming, Accelerate ignores output_dir, deletes old folders
            # and picks its own: turn it off for this call, so it writes into our pending
            # directory and leaves deletion to the retention that runs after the commit.
            automatic = config.automatic_checkpoint_naming
            config.automatic_checkpoint_naming = False
            try:
                _stock(accelerator, "save_state")(output_dir=str(directory), **save_state_kwargs)
            finally:
                config.automatic_checkpoint_naming = automatic

        return opened.save(
            step,
            write,
            metrics=metrics,
            metadata={"accelerate": {"iteration": int(accelerator.save_iteration)}},
        )
    except BaseException:
        _forget(accelerator, key)
        raise


def load_state(
    accelerator: Any,
    root: str | os.PathLike[str] | None = None,
    step: int | None = None,
    *,
    missing_ok: bool = False,
    verify: bool = True,
    adopt_existing: bool = False,
    retention: Any = None,
    timeout_s: float = 600.0,
    **load_state_kwargs: Any,
) -> CheckpointInfo | None:
    """``accelerator.load_state()`` from the newest complete checkpoint. Collective.

    Every process loads the same step: the newest one committed and valid in every
    storage domain. Torn folders (a crash mid-save) are never candidates; a checkpoint
    whose checksums fail is skipped with a warning.

    Args:
        accelerator: the ``accelerate.Accelerator`` (after ``prepare``).
        root: as for :func:`save_state`.
        step: a specific step; default the newest.
        missing_ok: return None when ``root`` holds no checkpoint at all (a first run)
            instead of raising.
        verify: recompute every checksum before loading.
        adopt_existing: first adopt the ``checkpoint_<n>`` folders that Accelerate's
            own ``save_state`` wrote there (``atomic_checkpoint.adopt``): each one that
            Accelerate's completeness rule (``adopt.accelerate_is_complete``) accepts
            gets a manifest with checksums taken now; a torn one is never adopted (a
            warning says why). Idempotent.
        retention: as for :func:`save_state` (only on the first call for a root).
        timeout_s: bound on every wait for other processes.
        **load_state_kwargs: passed to ``Accelerator.load_state``.

    Returns:
        The loaded checkpoint, or None (only with ``missing_ok``).

    Raises:
        CheckpointNotFoundError: nothing to load (without ``missing_ok``), or ``step``
            is not a valid checkpoint.
        CorruptCheckpointError: ``step`` (or the folder given) fails verification.
        ResumeError: checkpoint folders exist but none is complete and valid (folders
            written by Accelerate's own ``save_state``: pass ``adopt_existing=True``).

    An error releases the root's run lock (the next call opens the root again).
    """
    timeout_s = _checked(accelerator, retention, timeout_s)
    missing_ok, verify = flag("missing_ok", missing_ok), flag("verify", verify)
    adopt_existing = flag("adopt_existing", adopt_existing)
    if step is not None:
        step = validate_step(step)
    key, opened = _root_for(accelerator, root, retention, timeout_s)
    try:
        if adopt_existing:
            opened = _adopt_existing(accelerator, key, opened, root, retention, timeout_s)
        try:
            chosen = opened.resolve(step, verify=verify)
        except ResumeError as exc:
            if adopt_existing:
                raise
            raise ResumeError(
                f"{exc}. Folders that Accelerate's own save_state() wrote are adopted by "
                "load_state(accelerator, adopt_existing=True) when they are complete"
            ) from None
        if chosen is None:
            name = os.path.basename(os.fspath(opened.folders).rstrip("/"))
            one = parse_accelerate_name(name)
            one = parse_checkpoint_name(name) if one is None else one
            if one is not None:
                # root= one checkpoint folder: missing_ok would skip the checkpoint asked for.
                raise CheckpointNotFoundError(
                    f"load_state: {opened.folders} is one checkpoint folder, not a folder of "
                    f"checkpoints: pass the folder that holds it as root= (or none, for the "
                    f"project's), with step={one}"
                )
            if missing_ok:
                return None
            raise CheckpointNotFoundError(
                f"load_state: no checkpoint under {opened.folders}; pass missing_ok=True to "
                "start from scratch when there is none"
            )
        storage = opened.manager.storage
        stock = _complete_stock_above(storage, chosen)  # read once: the warning, the numbering
        if stock and step is None and not adopt_existing and opened.manager.is_coordinator:
            log.warning(
                "load_state: loading step %d, the newest checkpoint of ours; %s are newer, "
                "complete checkpoints that Accelerate's own save_state() wrote (no manifest), "
                "not loaded: their training is dropped. To resume from the newest, call "
                "load_state(accelerator, adopt_existing=True) instead",
                chosen,
                [storage.url(checkpoint_name(s)) for s in stock],
            )
        _stock(accelerator, "load_state")(opened.path(chosen), **load_state_kwargs)
        # Continue the automatic-naming counter after the newest checkpoint, not after
        # the loaded one: Accelerate's number counts saves, not training steps, and
        # checkpoints are ordered by it (a save below the newest is refused). Loading an
        # older checkpoint on purpose, or after the newer ones failed verification, so
        # goes on with the next number and keeps the newer folders, as Accelerate does.
        # A checkpoint of ours that failed verification counts too (a truncated file, an
        # unreadable manifest: its manifest is there): the next save never lands on it.
        # So does a complete folder without a manifest (Accelerate's own save_state
        # wrote it, or its manifest was lost), which a save refuses to replace: a resume
        # that skipped it failed at its first save, at every restart. A torn one does
        # not: the next save of its number replaces it, as Accelerate's would.
        committed = opened.manager.checkpoints()
        newest = max([chosen, *stock, *(i.step for i in committed)])
        for name in storage.listdir(""):
            s = parse_checkpoint_name(name)
            if s is not None and s > newest and storage.size(f"{name}/{MANIFEST_NAME}") is not None:
                newest = s
        accelerator.project_configuration.iteration = max(chosen, newest) + 1
        found = [i for i in committed if i.step == chosen]
        if not found:
            raise CheckpointNotFoundError(
                f"load_state: checkpoint step {chosen} under {opened.folders} vanished while "
                "it was being loaded (another job rotating this root?)"
            )
        return found[0]
    except BaseException:
        _forget(accelerator, key)
        raise


def _adopt_existing(
    accelerator: Any,
    key: str,
    opened: FrameworkRoot,
    root: str | os.PathLike[str] | None,
    retention: Any,
    timeout_s: float,
) -> FrameworkRoot:
    """Collective: adopt the stock checkpoints of ``opened`` (on the coordinator of each
    storage domain, under the run lock that ``adopt`` takes itself, so ours is released
    first), share the outcome, and open the root again."""
    mgr = opened.manager
    lead, coordinator, run_id = mgr.is_coordinator, mgr.coordinator, mgr.run_id
    _forget(accelerator, key)
    own: BaseException | None = None
    if lead:
        try:
            result = adopt(mgr.storage, framework="accelerate", run_id=run_id)
            for step, why in sorted(result.refused.items()):
                log.warning("accelerate: not adopting step %d under %s: %s", step, opened.root, why)
            if result.adopted:
                log.info("accelerate: adopted steps %s under %s", result.adopted, opened.root)
        except Exception as exc:
            own = exc
    _share_outcome(
        coordinator,
        "accelerate: adopted existing checkpoints",
        own,
        phase="adopt",
        step=None,
        timeout_s=timeout_s,
    )
    return _root_for(accelerator, root, retention, timeout_s)[1]


def make_atomic(
    accelerator: Any,
    *,
    root: str | os.PathLike[str] | None = None,
    retention: Any = None,
    adopt_existing: bool = False,
    verify: bool = True,
    timeout_s: float = 600.0,
) -> Any:
    """Make ``accelerator.save_state()`` and ``accelerator.load_state()`` atomic, once
    for the whole program (third-party code that calls them included)::

        accelerator = make_atomic(Accelerator(project_config=ProjectConfiguration(
            project_dir="runs/exp1", automatic_checkpoint_naming=True, total_limit=3)))

    After it, ``accelerator.save_state()`` is :func:`save_state` and
    ``accelerator.load_state()`` is :func:`load_state` (newest complete checkpoint;
    with ``adopt_existing``, stock folders are adopted first). With automatic naming,
    ``save_state`` ignores its ``output_dir``, as Accelerate does. Otherwise, and for
    ``load_state``, a folder that is one of the root's checkpoints
    (``".../checkpoints/checkpoint_7"``) is that step, committed or loaded atomically,
    and any other folder is left to Accelerate (a warning says it is not atomic). Call
    it on every process; idempotent.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        root, retention, verify, timeout_s: as for :func:`save_state`/:func:`load_state`.
        adopt_existing: as for :func:`load_state`.

    Returns:
        ``accelerator`` (the same object).
    """
    timeout_s = _checked(accelerator, retention, timeout_s)
    verify, adopt_existing = flag("verify", verify), flag("adopt_existing", adopt_existing)
    if _STOCK_ATTR in accelerator.__dict__:
        return accelerator
    if root is None and not accelerator.project_dir:
        raise CheckpointError(
            "make_atomic: the Accelerator has no project_dir: give it a "
            "ProjectConfiguration(project_dir=...) (checkpoints then go to "
            "<project_dir>/checkpoints/checkpoint_<n>), or pass root=..."
        )
    stock = {"save_state": accelerator.save_state, "load_state": accelerator.load_state}

    def step_of(path: str | os.PathLike[str]) -> int | None:
        _, opened = _root_for(accelerator, root, retention, timeout_s)
        name = os.path.basename(os.path.normpath(os.fspath(path)))
        step = parse_accelerate_name(name)
        step = parse_checkpoint_name(name) if step is None else step
        if step is None or os.path.abspath(path) != opened._local(checkpoint_name(step)):
            _warn_once(
                f"outside:{path}",
                "accelerate: %s is not a checkpoint folder of %s: saved and loaded by "
                "Accelerate itself, not atomically",
                path,
                opened.folders,
            )
            return None
        return step

    def atomic_save_state(
        output_dir: str | os.PathLike[str] | None = None, *args: Any, **kwargs: Any
    ) -> str:
        # With automatic naming Accelerate ignores output_dir (so do we).
        explicit = not accelerator.project_configuration.automatic_checkpoint_naming
        step = step_of(output_dir) if explicit and output_dir is not None else None
        if explicit and output_dir is not None and step is None:
            return stock["save_state"](output_dir, *args, **kwargs)
        if args:  # safe_serialization, positionally
            kwargs["safe_serialization"] = args[0]
        info = save_state(
            accelerator, root, step, retention=retention, timeout_s=timeout_s, **kwargs
        )
        return info.files_path  # as the stock call: the folder that holds the files

    def atomic_load_state(
        input_dir: str | os.PathLike[str] | None = None, *args: Any, **kwargs: Any
    ) -> CheckpointInfo | None:
        step = None if input_dir is None else step_of(input_dir)
        if input_dir is not None and step is None:
            return stock["load_state"](input_dir, *args, **kwargs)
        if args:  # load_kwargs, positionally
            kwargs["load_kwargs"] = args[0]
        return load_state(
            accelerator,
            root,
            step,
            verify=verify,
            adopt_existing=adopt_existing,
            retention=retention,
            timeout_s=timeout_s,
            **kwargs,
        )

    accelerator.__dict__[_STOCK_ATTR] = stock
    accelerator.save_state = atomic_save_state
    accelerator.load_state = atomic_load_state
    return accelerator


def preemption_guard(
    accelerator: Any,
    root: str | os.PathLike[str] | None = None,
    *,
    grace_s: float | None = None,
    retention: Any = None,
    timeout_s: float = 600.0,
) -> PreemptionGuard:
    """A :class:`~atomic_checkpoint.PreemptionGuard` for the root :func:`save_state`
    commits to: on SIGTERM/SIGUSR1 to any process, every process saves the same step
    once and stops. Call it on every process, in the main thread, once the
    ``Accelerator`` exists::

        guard = preemption_guard(accelerator, grace_s=60)
        for step in range(start, total_steps):
            train_step()
            if guard.should_save(step) or (step % 500 == 0 and not guard.stopping):
                save_state(accelerator)
            if guard.stopping:
                break
        guard.close()
        close(accelerator, timeout_s=guard.time_left_s)  # None: no signal, no bound
        guard.exit()          # exit status 75 (requeue) when preempted, else 0

    Args:
        accelerator: the ``accelerate.Accelerator``.
        root: as for :func:`save_state`.
        grace_s: the scheduler's grace period (default ``ATOMIC_CHECKPOINT_GRACE_S``): a
            save that recent saves say cannot finish in time is not started.
        retention: as for :func:`save_state` (only on the first call for a root).
        timeout_s: bound on the wait for the other processes at each check.

    The DataLoaders the accelerator has prepared, and those it prepares later, get
    workers that go on through the scheduler's SIGTERM
    (:func:`~atomic_checkpoint.preemption.protect_dataloaders`): SLURM signals every
    process of the job step, and under torch's own worker handler the workers exit
    and the next batch raises before the guard can save. Workers already running (a
    loader iterated before this call, with ``persistent_workers``) keep torch's handler.
    """
    _, opened = _root_for(accelerator, root, retention, timeout_s)
    guard = PreemptionGuard(opened.manager, timeout_s=timeout_s, grace_s=grace_s)
    protect_dataloaders(getattr(accelerator, "_dataloaders", ()))
    protecting_loaders_of(accelerator, "prepare_data_loader")
    return guard


def close(accelerator: Any, timeout_s: float | None = None) -> None:
    """Finish background retention and release the run lock of every root that
    :func:`save_state` / :func:`load_state` opened for ``accelerator``.

    Call it at the end of training (it also runs at interpreter exit). Not collective;
    idempotent; a later ``save_state`` opens the root again. ``timeout_s`` bounds the
    whole call, for a preempted job that must exit within its grace period
    (``close(accelerator, timeout_s=guard.time_left_s)``): retention still deleting
    then is left running, as ``CheckpointManager.close(timeout_s=)`` says.
    """
    roots: dict[str, tuple[FrameworkRoot, Any]] = accelerator.__dict__.get(_ROOTS_ATTR, {})
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while roots:
        _key, (opened, _policy) = roots.popitem()
        opened.close(timeout_s=None if deadline is None else max(0.0, deadline - time.monotonic()))
