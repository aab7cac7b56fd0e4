"""Atomic ``save_state`` / ``load_state`` for Hugging Face Accelerate.

Two lines replace the stock calls::

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
into place, and only then applies retention, un-committing before deleting::

    ROOT/                                  (default: <project_dir>/checkpoints)
      checkpoint-3/                        committed: listed by load_state()
        model.safetensors  optimizer.bin  scheduler.bin  random_states_<rank>.pkl
        checkpoint.manifest.json           written last
      .pending/checkpoint-4.<attempt>/     a save in progress: never loaded

The step defaults to ``accelerator.save_iteration`` (Accelerate's automatic naming
counter); ``load_state`` sets that counter past the loaded step, so the next save does
not collide. ``total_limit`` becomes ``KeepLast(total_limit)`` unless a ``retention``
policy is given. ``save_on_each_node`` keeps its meaning, verified against the storage
(see :class:`FrameworkRoot`).

This module also holds the machinery the Trainer integration (``hf.py``) shares: a
checkpoint root written by a framework's own save function, over one or several
storage domains.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..catalog import parse_attempt_dir, parse_marker_name, read_manifest
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    RankFailure,
    ResumeError,
    StorageError,
    map_os_error,
)
from ..layout import (
    TRASH_DIR,
    checkpoint_name,
    new_attempt_token,
    validate_step,
)
from ..manager import CheckpointManager
from ..manifest import CheckpointInfo
from ..preemption import PreemptionGuard
from ..retention import KeepLast

__all__ = ["FrameworkRoot", "close", "load_state", "preemption_guard", "save_state"]

log = logging.getLogger("atomic_checkpoint")


def _rank_failure(exc: BaseException, rank: int, phase: str) -> RankFailure:
    return RankFailure(rank, phase, type(exc).__name__, str(exc) or repr(exc))


def _raise_if_failed(
    outcomes: Sequence[RankFailure | None], own: BaseException | None, *, step: int | None
) -> None:
    """After an exchange of outcomes: the failing rank re-raises its own error, every
    other rank raises one error naming each failing rank."""
    failures = [f for f in outcomes if f is not None]
    if not failures:
        return
    if own is not None:
        raise own
    raise DistributedCheckpointError(failures, step=step)


class FrameworkRoot:
    """A checkpoint root that a framework's own save function writes into.

    One per (job, root): a :class:`~atomic_checkpoint.CheckpointManager` whose storage
    domains are probed (``storage_domains="auto"``) and checked against what the
    framework was told (``save_on_each_node``), plus the protocol around the
    framework's writes. Every method is collective over all ranks of the job, called in
    the same order.

    Args:
        root: the directory checkpoints are committed under.
        per_node: the framework's ``save_on_each_node``: every node's local rank 0
            writes a full copy. Without it only global rank 0 writes the model and
            optimizer, so storage that is not shared by all ranks is an error.
        retention: the retention policy.
        label: names the framework in messages and store keys.
        timeout_s: bound on every wait for other ranks.
        visibility_timeout_s: bound on waits for network filesystems.
        strategy: the commit strategy (None: chosen from the storage).

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
    ):
        self.root = os.path.abspath(os.fspath(root))
        self.label = label
        self.timeout_s = timeout_s
        self.manager = CheckpointManager(
            self.root,
            retention=retention,
            timeout_s=timeout_s,
            visibility_timeout_s=visibility_timeout_s,
            storage_domains="auto",
            strategy=strategy,
        )
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

    @property
    def is_coordinator(self) -> bool:
        """True on the one rank of this storage domain that commits and rotates."""
        return self.manager.is_coordinator

    def path(self, step: int) -> str:
        """The directory that holds the framework's files of committed checkpoint
        ``step`` under this rank's root: ``ROOT/checkpoint-<step>``, or its committed
        ``attempt-<token>/`` directory under the marker strategy (object-store mounts,
        where files are written in place)."""
        name = checkpoint_name(step)
        base = os.path.join(self.root, name)
        if self.manager.commit_strategy != "marker":
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
        metrics: Mapping[str, float] | None = None,
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
            DistributedCheckpointError: a rank failed (the failing rank re-raises its
                own error); no partial checkpoint is visible anywhere.
        """
        step = validate_step(step)
        mgr = self.manager
        final_base = os.path.join(self.root, checkpoint_name(step))
        if mgr.is_coordinator:
            self._set_aside_torn(step)
        with mgr.saving(step, metrics=metrics, metadata=metadata, overwrite=True) as pending:
            target = pending / nested if nested else pending
            # Marker strategy: the pending directory is the committed attempt directory.
            final = str(pending) if _is_under(str(pending), final_base) else final_base
            failure: BaseException | None = None
            try:
                write(target, final)
            except Exception as exc:
                failure = exc
            # Every rank's writes must be finished before the coordinator moves the
            # nested entries up, and every rank must leave the block the same way:
            # this exchange is that barrier, and it shares failures.
            outcomes = mgr.coordinator.all_gather(
                f"{self.label} step {step}: files written",
                None if failure is None else _rank_failure(failure, mgr.rank, "write"),
                timeout_s=self.timeout_s,
            )
            _raise_if_failed(outcomes, failure, step=step)
            if mgr.domain.count > 1:
                self._check_copies_match(target, step)
            if nested and mgr.is_coordinator:
                _flatten(pending, nested, step=step, label=self.label)
        if mgr.last_saved is None:  # pragma: no cover - saving() either commits or raises
            raise CommitError(f"{self.label} step {step}: the save returned no checkpoint")
        return mgr.last_saved

    def _set_aside_torn(self, step: int) -> None:
        """Coordinator: move a torn ``checkpoint-<step>`` without a manifest (left by a
        crash of a save made without this integration) out of the way of the save of
        the same step, as the framework's own save would have overwritten it.

        Best effort: if it cannot be moved, the commit protocol refuses the save and
        every rank gets that error.
        """
        storage = self.manager.storage
        name = checkpoint_name(step)
        try:
            read_manifest(storage, name)
            return  # committed (or ours and corrupt): the commit replaces it atomically
        except CheckpointNotFoundError:
            pass
        except CheckpointError:
            return
        entries = storage.listdir(name)
        if not entries or any(
            parse_marker_name(e) is not None or parse_attempt_dir(e) is not None for e in entries
        ):
            return  # empty, or marker-strategy leftovers that the commit protocol owns
        trash = f"{TRASH_DIR}/{name}.{new_attempt_token()}"
        try:
            storage.makedirs(TRASH_DIR)
            storage.rename_dir(name, trash)
        except CheckpointError as exc:
            log.warning("%s: could not move the torn %s aside: %s", self.label, name, exc)
            return
        log.warning(
            "%s: %s had no manifest (a save torn by a crash, or written without "
            "atomic-checkpoint): replaced by this save",
            self.label,
            storage.url(name),
        )
        try:
            storage.delete_tree(trash)
        except CheckpointError as exc:  # the next start-up sweeps .trash/
            log.warning("%s: could not delete %s: %s", self.label, storage.url(trash), exc)

    def _check_copies_match(self, target: Path, step: int) -> None:
        """Several storage domains: every domain must hold the same kinds of files.

        Per-rank files differ by their rank number only, so names are compared with
        digit runs masked. A domain whose copy lacks what another holds (a framework
        that writes some files on global rank 0 only, although told to save on each
        node) would commit a checkpoint that cannot be resumed from on that node.
        """
        mgr = self.manager
        names = sorted(set(_masked_names(target))) if mgr.is_coordinator else None
        views = mgr.coordinator.all_gather(
            f"{self.label} step {step}: files of each storage domain",
            names,
            timeout_s=self.timeout_s,
        )
        copies = {lead: set(views[lead] or ()) for lead in mgr.domain.leaders}
        everything = set().union(*copies.values())
        lacking = {
            lead: sorted(everything - got) for lead, got in copies.items() if got != everything
        }
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
        valid = [i.step for i in mgr.checkpoints()]  # agreed by every domain
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
        for candidate in candidates:
            problem: str | None = None
            if verify and mgr.is_coordinator:
                try:
                    mgr.verify(candidate)
                except CorruptCheckpointError as exc:
                    problem = str(exc)
                    log.warning("%s: skipping checkpoint step %d: %s", self.label, candidate, exc)
            problems = mgr.coordinator.all_gather(
                f"{self.label}: verified step {candidate}", problem, timeout_s=self.timeout_s
            )
            bad = [p for p in problems if p]
            if not bad:
                return candidate
            if step is not None:
                raise CorruptCheckpointError(
                    f"{self.label}: checkpoint step {step} failed verification: {bad[0]}"
                )
        names = _checkpoint_like_names(self.root) if mgr.is_coordinator else []
        seen = mgr.coordinator.all_gather(
            f"{self.label}: checkpoint folders", names, timeout_s=self.timeout_s
        )
        torn = sorted({n for found in seen for n in found})
        if not torn:
            return None
        raise ResumeError(
            f"{self.label}: asked to resume, but no checkpoint under {self.root} is complete "
            f"and valid in every storage domain; found {torn} without a valid manifest "
            "(torn by a crash mid-save, or written without atomic-checkpoint). Move them "
            "away to start from scratch, or resume from an explicit path"
        )

    def close(self) -> None:
        """Wait for background retention. Not collective; idempotent."""
        self.manager.close()


def _is_under(path: str, parent: str) -> bool:
    p, q = os.path.normpath(os.path.abspath(path)), os.path.normpath(os.path.abspath(parent))
    return p == q or p.startswith(q + os.sep)


def _masked_names(directory: Path) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(directory):
        rel = os.path.relpath(dirpath, directory)
        for name in files:
            path = name if rel == "." else f"{rel}/{name}"
            out.append(re.sub(r"[0-9]+", "#", path.replace(os.sep, "/")))
    return out


# Names frameworks give checkpoint folders: ours and the Trainer's (checkpoint-N), and
# Accelerate's automatic naming (checkpoint_N).
_CHECKPOINT_LIKE = re.compile(r"^checkpoint[-_][0-9]+$")


def _checkpoint_like_names(root: str) -> list[str]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(n for n in names if _CHECKPOINT_LIKE.match(n))


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
    for name in sorted(os.listdir(inner)):
        src, dst = inner / name, pending / name
        try:
            os.rename(src, dst)
        except OSError as exc:
            raise map_os_error(exc, "rename", f"{src} -> {dst}") from exc
    try:
        os.rmdir(inner)
    except OSError as exc:
        raise map_os_error(exc, "remove", str(inner)) from exc


# ---------------------------------------------------------------------- Accelerate API
_ROOTS_ATTR = "_atomic_checkpoint_roots"


def _root_for(
    accelerator: Any, root: str | os.PathLike[str] | None, retention: Any, timeout_s: float
) -> FrameworkRoot:
    config = accelerator.project_configuration
    if root is None:
        if not accelerator.project_dir:
            raise CheckpointError(
                "save_state/load_state: pass root=..., or give the Accelerator a "
                "ProjectConfiguration(project_dir=...) (checkpoints then go to "
                "<project_dir>/checkpoints, as with automatic_checkpoint_naming)"
            )
        root = os.path.join(accelerator.project_dir, "checkpoints")
    key = os.path.abspath(os.fspath(root))
    roots: dict[str, tuple[FrameworkRoot, Any]] = accelerator.__dict__.setdefault(_ROOTS_ATTR, {})
    if key in roots:
        opened, policy = roots[key]
        if retention is not None and retention != policy:
            raise ValueError(
                f"{key} is already open with retention {policy!r}; pass retention only on "
                "the first save_state/load_state call for a root"
            )
        return opened
    if retention is None and config.total_limit is not None and config.total_limit > 0:
        retention = KeepLast(int(config.total_limit))
    opened = FrameworkRoot(
        key,
        per_node=bool(config.save_on_each_node),
        retention=retention,
        label="accelerate",
        timeout_s=timeout_s,
    )
    roots[key] = (opened, retention)
    return opened


def save_state(
    accelerator: Any,
    root: str | os.PathLike[str] | None = None,
    step: int | None = None,
    *,
    retention: Any = None,
    metrics: Mapping[str, float] | None = None,
    timeout_s: float = 600.0,
    **save_state_kwargs: Any,
) -> CheckpointInfo:
    """``accelerator.save_state()``, committed atomically. Call it on every process.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        root: where checkpoints are committed; default ``<project_dir>/checkpoints``.
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
        The committed checkpoint (``info.path`` is ``ROOT/checkpoint-<step>``).
    """
    opened = _root_for(accelerator, root, retention, timeout_s)
    config = accelerator.project_configuration
    if step is None:
        step = int(accelerator.save_iteration)

    def write(directory: Path, final: str) -> None:
        # With automatic naming, Accelerate ignores output_dir, deletes old folders and
        # picks its own: turn it off for this call, so it writes into our pending
        # directory and leaves deletion to the retention that runs after the commit.
        automatic = config.automatic_checkpoint_naming
        config.automatic_checkpoint_naming = False
        try:
            accelerator.save_state(output_dir=str(directory), **save_state_kwargs)
        finally:
            config.automatic_checkpoint_naming = automatic

    return opened.save(
        step,
        write,
        metrics=metrics,
        metadata={"accelerate": {"iteration": int(accelerator.save_iteration)}},
    )


def load_state(
    accelerator: Any,
    root: str | os.PathLike[str] | None = None,
    step: int | None = None,
    *,
    missing_ok: bool = False,
    verify: bool = True,
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
        retention: as for :func:`save_state` (only on the first call for a root).
        timeout_s: bound on every wait for other processes.
        **load_state_kwargs: passed to ``Accelerator.load_state``.

    Returns:
        The loaded checkpoint, or None (only with ``missing_ok``).

    Raises:
        CheckpointNotFoundError: nothing to load (without ``missing_ok``), or ``step``
            is not a valid checkpoint.
        ResumeError: checkpoint folders exist but none is complete and valid.
    """
    opened = _root_for(accelerator, root, retention, timeout_s)
    chosen = opened.resolve(step, verify=verify)
    if chosen is None:
        if missing_ok:
            return None
        raise CheckpointNotFoundError(
            f"load_state: no checkpoint under {opened.root}; pass missing_ok=True to start "
            "from scratch when there is none"
        )
    accelerator.load_state(opened.path(chosen), **load_state_kwargs)
    # Continue the automatic-naming counter after the loaded step, so the next
    # save_state() does not collide with (and replace) a newer checkpoint.
    accelerator.project_configuration.iteration = chosen + 1
    found = [i for i in opened.manager.checkpoints() if i.step == chosen]
    if not found:
        raise CheckpointNotFoundError(
            f"load_state: checkpoint step {chosen} under {opened.root} vanished while it "
            "was being loaded (another job rotating this root?)"
        )
    return found[0]


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
        close(accelerator)
        guard.exit()          # exit status 75 (requeue) when preempted, else 0

    Args:
        accelerator: the ``accelerate.Accelerator``.
        root: as for :func:`save_state`.
        grace_s: the scheduler's grace period (default ``ATOMIC_CHECKPOINT_GRACE_S``): a
            save that recent saves say cannot finish in time is not started.
        retention: as for :func:`save_state` (only on the first call for a root).
        timeout_s: bound on the wait for the other processes at each check.
    """
    opened = _root_for(accelerator, root, retention, timeout_s)
    return PreemptionGuard(opened.manager, timeout_s=timeout_s, grace_s=grace_s)


def close(accelerator: Any) -> None:
    """Finish background retention and release the run lock of every root that
    :func:`save_state` / :func:`load_state` opened for ``accelerator``.

    Call it at the end of training (it also runs at interpreter exit). Not collective;
    idempotent; a later ``save_state`` opens the root again.
    """
    roots: dict[str, tuple[FrameworkRoot, Any]] = accelerator.__dict__.get(_ROOTS_ATTR, {})
    while roots:
        _key, (opened, _policy) = roots.popitem()
        opened.close()
