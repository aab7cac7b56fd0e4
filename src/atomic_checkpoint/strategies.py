"""The two commit strategies: how a pending save becomes a checkpoint, how a checkpoint
stops being one, and what each leaves behind when a process dies half way.

``commit`` drives a save through its seven steps on every rank; the coordinator's
storage work in them (create the pending location, publish, discard) is the strategy's.
Retention, ``rollback`` and ``atomic-checkpoint prune`` retire checkpoints through it; a
writable manager's start-up (``sweep``) and ``atomic-checkpoint clean`` (``leftovers``,
``remove_leftover``) remove what crashed saves and deletes left. ``CommitStrategy``
says who calls what, from which thread, in which order.

Rename strategy (POSIX filesystems; ``RenameStrategy``): stage in
``.pending/checkpoint-<step>.<attempt>/``, commit by one atomic directory rename to
``checkpoint-<step>`` (drawn in ``commit``). Its remains are entries of ``.pending/``
(crashed saves) and ``.trash/`` (crashed retention deletes, replaced copies).

Marker strategy (object stores, FUSE mounts whose rename is copy+delete;
``MarkerStrategy``): files are written in place under ``checkpoint-<step>/`` and the
manifest, created once, is the commit. Its remains are ``checkpoint-<step>/``
directories holding an in-progress marker.

Overwrite (``overwrite=True``, rename strategy): the new copy is committed before the old
one goes, by one ``RENAME_EXCHANGE`` where the filesystem has it, else by two renames (the
old copy into ``.trash/checkpoint-<step>.<attempt>.replaced``, then the new one in).
Between those two the step has no name in ROOT: readers that find it absent while its
old copy is in ``.trash/`` and its new one in ``.pending/`` wait for the second rename
(``catalog._back``). A crash between them leaves the step absent; ``recover_replaced``
(the next start's sweep, ``atomic-checkpoint clean``) puts a complete copy back. Once ROOT
is fsync'd the save has succeeded: removing the replaced copy is best effort.

A ROOT may hold the remains of both strategies (a run forced ``strategy="marker"`` on a
disk whose rename is atomic, then a later run chose rename): ``clean`` looks for both,
and each strategy's ``sweep`` removes at least what the rename strategy leaves.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from . import errors
from ._faults import fault_point
from .catalog import read_manifest
from .catalog import validate as validate_checkpoint
from .layout import (
    MANIFEST_NAME,
    META_DIR,
    PENDING_DIR,
    TRASH_DIR,
    attempt_dir_name,
    checkpoint_name,
    is_own_entry,
    marker_name,
    new_attempt_token,
    parse_attempt_dir,
    parse_checkpoint_name,
    parse_marker_name,
    parse_pending_name,
    parse_replaced_name,
    pending_name,
    replaced_name,
)
from .manifest import Manifest
from .storage import posix
from .storage.base import RenamingStorage, Storage, renaming
from .storage.temps import abandoned_temps, parse_temp_name

__all__ = [
    "STRATEGIES",
    "CommitStrategy",
    "Leftover",
    "MarkerStrategy",
    "RenameStrategy",
    "ReplaceRecovery",
    "choose_strategy",
    "create_or_own",
    "recover_replaced",
    "restore_replaced",
]

log = logging.getLogger("atomic_checkpoint")
#: The run lock's check (raises ``FencedError`` once this job lost the lock), or None.
_Fence = Callable[[], None] | None


@runtime_checkable
class CommitStrategy(Protocol):
    """How a pending save becomes a checkpoint, how a checkpoint stops being one, and
    how what a crash left behind is found and removed.

    Every method is called by the coordinator of a storage domain only (its leader
    rank, or the ``atomic-checkpoint`` CLI's single process), blocks, and raises
    ``CheckpointError`` for storage failures. One save calls, in order:
    ``pending_location``, ``prepare`` (step 1), ``publish`` (steps 4-5) once every rank
    wrote into the pending location; after a failure ``is_committed``, then ``discard``
    unless it says the commit landed. ``CheckpointManager(strategy=...)`` accepts any
    object implementing this protocol (``choose_strategy``); the manager, the CLI and
    the integrations call nothing else of it.
    """

    #: Recorded in every manifest it commits (``Manifest.strategy``) and logged.
    name: str
    #: True when a save writes its files in place under ``checkpoint-<step>/`` (in an
    #: ``attempt-<token>/`` directory beside the manifest) instead of renaming a staged
    #: directory there: where a committed checkpoint's files lie.
    writes_in_place: bool

    def pending_location(self, step: int, attempt: str) -> str:
        """Where attempt ``attempt`` of ``step`` writes its files (relative to ROOT).

        Pure (no I/O, idempotent): the coordinator knows the location before it exists,
        so a failure on any rank discards it. Called on the thread that runs the save.
        """
        ...

    def prepare(self, storage: Storage, step: int, attempt: str) -> str:
        """Create the pending location durably and return it (step 1).

        Called by the coordinator on the thread that runs the save (the training
        thread, or the async save's thread), and by ``tiered``'s replicator thread for
        its persistent tier. Once per attempt token: not idempotent.
        """
        ...

    def publish(
        self, storage: Storage, pending: str, manifest: Manifest, *, rank: int, overwrite: bool
    ) -> Manifest:
        """Write ``manifest`` and commit ``pending`` as checkpoint ``manifest.step``
        (steps 4-5); with ``overwrite``, replace a committed copy, new before old goes.
        Returns the manifest as written. Fires the ``after_manifest`` and
        ``after_rename`` fault points.

        Called by the coordinator on the thread that runs the save, once every rank
        reported its files. Once per attempt: not idempotent.

        Raises:
            CheckpointExistsError: the step is committed and ``overwrite`` is False.
        """
        ...

    def is_committed(self, storage: Storage, step: int, pending: str) -> bool:
        """After a failure: did this attempt's commit land anyway (a peer timed out
        after the coordinator committed)? Then nothing may be discarded.

        Called by the coordinator on the thread that runs the save. Read-only,
        idempotent.
        """
        ...

    def discard(self, storage: Storage, pending: str) -> None:
        """Delete an attempt that did not commit (what it replaced is put back first).

        Called by the coordinator on the thread that runs the save, after
        ``is_committed`` said no. Idempotent: what is gone already is not an error.
        """
        ...

    def uncommit(self, storage: Storage, step: int) -> str | None:
        """Take checkpoint ``step`` out of the namespace: from then on it is not a
        checkpoint. Returns what ``delete`` removes, or None when it is gone already.

        Called through ``retire`` only. Idempotent (None the second time).
        """
        ...

    def delete(self, storage: Storage, uncommitted: str) -> None:
        """Delete what ``uncommit`` returned. Called through ``retire`` only, once per
        ``uncommit``; a delete cut short is finished by ``sweep`` or ``clean``."""
        ...

    def retire(self, storage: Storage, step: int, *, rank: int = 0, fence: _Fence = None) -> bool:
        """Un-commit checkpoint ``step``, then delete it: ``fence()`` (a job that lost
        the run lock deletes nothing), ``uncommit``, ``delete``, with the fault points
        ``before_uncommit``, ``after_uncommit`` and ``mid_delete`` (``rank`` names this
        rank in them). Returns False when the step was gone already.

        Called by the coordinator: from the rotation thread (retention after a commit),
        the training thread (``rollback``), and the CLI's ``prune``. Idempotent.
        """
        ...

    def sweep(self, storage: Storage, fence: _Fence = None) -> list[str]:
        """Remove what crashed saves, deletes and overwrites left in ROOT, after putting
        back a complete copy of a step an interrupted overwrite left absent. Removes at
        least the rename strategy's remains (``.pending/``, ``.trash/``), whatever the
        strategy: a ROOT may hold those of an earlier run. ``fence`` is called before
        each removal, so a job that lost the run lock stops at once (``FencedError``).
        Returns the locations removed; a removal that fails is logged and left for the
        next sweep.

        Called by the holder of the run lock, on the thread that opens a writable
        manager, before its first save. Idempotent: a second sweep finds nothing.
        """
        ...

    def leftovers(self, storage: Storage) -> list[Leftover]:
        """What crashed saves and deletes of this strategy left, one ``Leftover`` per
        entry, without changing anything. Called by ``sweep`` and by the CLI's
        ``clean`` (which shows the list and, unless ``--dry-run``, removes it).
        Read-only."""
        ...

    def remove_leftover(self, storage: Storage, leftover: Leftover) -> None:
        """Delete exactly what ``leftovers`` listed in ``leftover``, never a manifest:
        whatever appeared since (a newer job's attempt or commit) stays. Called by
        ``sweep`` and by the CLI's ``clean``."""
        ...


def _heads(manifest: Manifest) -> set[str]:
    """The top-level entries of a checkpoint that its manifest's files are under."""
    return {f.path.split("/", 1)[0] for f in manifest.files}


def _orphan_attempts(
    name: str, children: Sequence[str], keep: set[str], markers: Sequence[str]
) -> tuple[str, ...]:
    """The attempt folders of committed checkpoint ``name`` that neither its manifest
    (``keep``) nor a marker names: what an overwrite cut after its new manifest landed
    left of the attempt it replaced (its marker went at its own commit long before).
    They were never found: billed on an object store for as long as the step is kept."""
    named = {attempt_dir_name(a) for a in markers}
    return tuple(
        f"{name}/{c}"
        for c in children
        if parse_attempt_dir(c) is not None and c not in keep and c not in named
    )


def _marked_checkpoints(storage: Storage) -> set[str] | None:
    """The ``checkpoint-<step>`` names holding an in-progress marker or a temporary
    file directly, from one recursive listing of ROOT; None if that listing fails (the
    caller then looks into every checkpoint)."""
    try:
        listed = storage.walk_files("")
    except errors.CheckpointError:
        return None
    out = set()
    attempts: dict[str, set[str]] = {}
    for rel, _size in listed:
        top, _, child = rel.partition("/")
        if not child or parse_checkpoint_name(top) is None:
            continue
        head, sub, _ = child.partition("/")
        if sub:
            if parse_attempt_dir(head) is not None:
                attempts.setdefault(top, set()).add(head)
            continue
        if parse_marker_name(child) is not None or parse_temp_name(child) is not None:
            out.add(top)
    # Two attempt folders in one checkpoint: an overwrite cut after its manifest left
    # the replaced one, with no marker to name it.
    return out | {top for top, heads in attempts.items() if len(heads) > 1}


@dataclass(frozen=True)
class Leftover:
    """What a crashed save, delete or overwrite left in one place, as listed by a
    strategy's ``leftovers`` (paths relative to ROOT).

    Attributes:
        name: where it is: ``checkpoint-<step>`` (marker strategy), or the entry
            ``.pending/<name>`` or ``.trash/<name>`` itself (rename strategy).
        committed: a manifest was there: only stale attempts and markers are listed.
        trees: attempt directories (and, when uncommitted, stray subdirectories); under
            the rename strategy the entry itself (a stray file or link there is
            unlinked, never followed).
        files: stray files of an uncommitted directory (never the manifest).
        markers: the in-progress markers, deleted last.
        temps: temporary files of marker and manifest writes whose writer is gone
            (``storage.temps``). A directory holding only these beside a manifest, or
            nothing at all, is listed with ``committed`` True and nothing else.
    """

    name: str
    committed: bool
    trees: tuple[str, ...]
    files: tuple[str, ...]
    markers: tuple[str, ...]
    temps: tuple[str, ...] = ()

    @property
    def paths(self) -> list[str]:
        """Everything that is removed, in order."""
        return [*self.trees, *self.files, *self.temps, *self.markers]

    @property
    def kind(self) -> str:
        """What ``clean`` calls it: "pending" (a save that never committed), "trash"
        (an un-commit or overwrite whose delete did not finish), "stale" (attempts or
        markers beside a committed manifest), "temporary" (only abandoned temporary
        files) or "empty" (a directory a delete did not remove)."""
        top = self.name.split("/", 1)[0]
        if top == TRASH_DIR:
            return "trash"
        if top == PENDING_DIR or not self.committed:
            return "pending"
        if self.trees or self.markers:
            return "stale"
        return "temporary" if self.temps else "empty"


class RenameStrategy:
    """Stage in ``.pending/``, commit by one atomic directory rename.

    What a crash leaves: an entry of ``.pending/`` (a save that never committed) or of
    ``.trash/`` (an un-commit whose delete did not finish, or the replaced copy of an
    overwrite), and after an overwrite stopped between its two renames, its step absent
    (``recover_replaced`` puts a complete copy back before anything is removed).
    """

    name = "rename"
    writes_in_place = False

    def pending_location(self, step: int, attempt: str) -> str:
        return f"{PENDING_DIR}/{pending_name(step, attempt)}"

    def prepare(self, storage: Storage, step: int, attempt: str) -> str:
        return _durable_dir(storage, self.pending_location(step, attempt), PENDING_DIR)

    def publish(
        self, storage: Storage, pending: str, manifest: Manifest, *, rank: int, overwrite: bool
    ) -> Manifest:
        """Write the manifest into ``pending``, then rename it to its final name.
        Returns the manifest as written."""
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
            renaming(storage).rename_dir(pending, final)
        except errors.CheckpointExistsError:
            if not overwrite:
                raise
            self._replace(storage, pending, final, rank=rank, step=manifest.step)
            return manifest
        fault_point("after_rename", rank, manifest.step)
        try:
            storage.fsync_dir("")
        except errors.CheckpointError:
            # The rename may not survive a crash, and every rank is about to be told the
            # save failed: take it back out of the namespace so no reader builds on it.
            try:
                renaming(storage).rename_dir(final, pending)
            except errors.CheckpointError as exc:
                log.warning(
                    "checkpoint step %d could not be un-committed after a failed "
                    "fsync of the root: %s",
                    manifest.step,
                    exc,
                )
            raise
        return manifest

    def _replace(self, storage: Storage, pending: str, final: str, *, rank: int, step: int) -> None:
        """Overwrite a committed step: the new copy is committed before the old one goes.

        Until ROOT is fsync'd the swap may not survive a crash, and a failure there is
        reported as "not committed": so it is undone first (the old copy is put back),
        and what the error says is true. Once ROOT is fsync'd the save has succeeded:
        removing the replaced copy is best effort, a failure is a warning and the
        leftover goes with the next start's sweep or ``atomic-checkpoint clean``
        (DESIGN invariant 10).
        """
        if renaming(storage).exchange_dirs(pending, final):
            # One atomic swap (renameat2 RENAME_EXCHANGE): readers see old or new.
            try:
                fault_point("after_rename", rank, step)
                storage.fsync_dir("")
            except BaseException:
                _undo(lambda: renaming(storage).exchange_dirs(pending, final), storage, final)
                raise
            _remove_replaced(storage, pending, step)  # now holds the old checkpoint
            return
        # No atomic exchange (sshfs and NFS refuse renameat2 flags; Windows): un-commit
        # the old copy by moving it out of the namespace under a name that says "replaced
        # by attempt <a>", then rename the new one in. A crash between the two renames
        # leaves step `step` absent with both copies complete, the old one in .trash and
        # the new one in .pending: the next start (``recover_replaced``) puts the new one
        # in place. One rename moves one entry between two directories atomically, and
        # ROOT's fsync below makes both renames durable.
        parsed = parse_pending_name(pending.rsplit("/", 1)[1])
        attempt = parsed[1] if parsed is not None else new_attempt_token()
        replaced = f"{TRASH_DIR}/{replaced_name(step, attempt)}"
        if not storage.is_dir(TRASH_DIR):
            # .trash/ must be durable before a rename into it is.
            storage.makedirs(TRASH_DIR)
            storage.fsync_dir("")
        renaming(storage).rename_dir(final, replaced)
        try:
            fault_point("mid_replace", rank, step)
            renaming(storage).rename_dir(pending, final)
        except BaseException:
            # The save is about to be reported as failed: the old copy goes back. If
            # that fails too, ``discard`` tries again, and the next start's sweep puts
            # a complete copy back whatever happens.
            _undo(lambda: renaming(storage).rename_dir(replaced, final), storage, final)
            raise
        try:
            fault_point("after_rename", rank, step)
            storage.fsync_dir("")
        except BaseException:

            def put_back() -> None:
                renaming(storage).rename_dir(final, pending)
                renaming(storage).rename_dir(replaced, final)

            _undo(put_back, storage, final)
            raise
        _remove_replaced(storage, replaced, step)

    def discard(self, storage: Storage, pending: str) -> None:
        """Delete a pending attempt that did not commit. If it was an overwrite stopped
        between its two renames, the copy it replaced is put back first: the save
        failed, so the old checkpoint is the committed one (``restore_replaced``)."""
        restore_replaced(storage, pending)
        storage.delete_tree(pending)

    def is_committed(self, storage: Storage, step: int, pending: str) -> bool:
        """After a failure: did this attempt's commit land anyway (the coordinator
        renamed, then a peer timed out)? Then the pending name no longer exists."""
        return not storage.is_dir(pending)

    def uncommit(self, storage: Storage, step: int) -> str | None:
        """Take checkpoint ``step`` out of the namespace with one rename into ``.trash/``.

        Called through ``retire`` (retention, ``rollback``, ``prune``). Returns what
        ``delete`` removes, or None when the checkpoint is already gone.
        """
        taken = self._uncommit(storage, step)
        return None if taken is None else taken[0]

    def _uncommit(self, storage: Storage, step: int) -> tuple[str, Callable[[], None]] | None:
        """``uncommit``, and how to undo it (``_retire``: a job found fenced after it)."""
        name = checkpoint_name(step)
        trash = f"{_trash_dir(storage)}/{name}.{new_attempt_token()}"
        try:
            renaming(storage).rename_dir(name, trash)
        except errors.CheckpointNotFoundError:
            return None  # already gone: deletes tolerate ENOENT
        except errors.StorageError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        storage.fsync_dir("")

        def undo() -> None:
            # Never over a copy that is there now: a new holder's save of this step.
            renaming(storage).rename_dir(trash, name)
            storage.fsync_dir("")

        return trash, undo

    def delete(self, storage: Storage, uncommitted: str) -> None:
        """Delete what ``uncommit`` took out of the namespace."""
        storage.delete_tree(uncommitted)

    def retire(self, storage: Storage, step: int, *, rank: int = 0, fence: _Fence = None) -> bool:
        """Rename checkpoint ``step`` into ``.trash/``, then delete it there
        (``CommitStrategy.retire``: callers, fault points, idempotence)."""
        return _retire(self, storage, step, rank=rank, fence=fence)

    def leftovers(self, storage: Storage, *, keep: frozenset[str] = frozenset()) -> list[Leftover]:
        """Every entry of ``.pending/`` and ``.trash/`` (and ``.atomic-checkpoint/``, where
        an un-commit on a full disk may go: ``_trash_dir``) named as this library names them
        (``layout.is_own_entry``: a user's own files in folders of those names, in a
        directory that was never a checkpoint root, are not ours to delete) but those in
        ``keep`` (what ``recover_replaced`` restores in a dry run or could not settle:
        never the only complete copy of a step), one ``Leftover`` each. Read-only;
        called by ``sweep`` and by the CLI's ``clean`` after its ``recover_replaced``."""
        out: list[Leftover] = []
        for directory in (PENDING_DIR, TRASH_DIR, META_DIR):  # META_DIR: _trash_dir
            for name in storage.listdir(directory):
                rel = f"{directory}/{name}"
                if rel not in keep and is_own_entry(name):
                    out.append(Leftover(rel, False, (rel,), (), ()))
        return out

    def remove_leftover(self, storage: Storage, leftover: Leftover) -> None:
        """Delete one entry listed by ``leftovers``: a directory whole, a stray file or
        symbolic link by unlinking it (never following it). Idempotent."""
        for rel in (*leftover.trees, *leftover.files):
            _remove_entry(storage, rel)

    def sweep(self, storage: Storage, fence: _Fence = None) -> list[str]:
        """First finish the overwrites a crash stopped between their two renames
        (``recover_replaced``), then remove every other entry of ``.pending/`` and
        ``.trash/`` (``CommitStrategy.sweep``: callers, fence, idempotence).

        Raises:
            FencedError: this job lost the run lock (from ``fence``).
            CheckpointError: ``.pending/`` or ``.trash/`` cannot be listed.
        """
        if fence is not None:
            fence()
        recovery = recover_replaced(storage)
        cleaned = []
        for leftover in self.leftovers(storage, keep=recovery.keep):
            if fence is not None:
                fence()
            where = storage.url(leftover.name)
            try:
                self.remove_leftover(storage, leftover)
            except errors.CheckpointError as exc:
                log.warning("could not remove abandoned %s: %s", where, exc)
                continue
            log.info("removed abandoned %s", where)
            cleaned.append(where)
        return cleaned


def _trash_dir(storage: Storage) -> str:
    """Where ``uncommit`` renames a checkpoint to: ``.trash/``, created if need be. On a
    full disk, where even that directory cannot be created (the deletion is what would
    free the space), an existing directory of ours instead: ``.pending/``, else
    ``.atomic-checkpoint/`` (it holds the run lock, so it exists whenever a deletion
    runs: a root that never rotated, such as one of adopted checkpoints, has neither of
    the others). A rename into an existing directory allocates nothing, and whatever is
    left there is removed by the next start's sweep and by ``clean`` (``leftovers``)."""
    try:
        storage.makedirs(TRASH_DIR)
    except errors.StorageFullError:
        instead = PENDING_DIR if storage.is_dir(PENDING_DIR) else META_DIR
        if not storage.is_dir(instead):
            raise
        log.warning(
            "cannot create %s (the storage is full): un-committing into %s instead",
            storage.url(TRASH_DIR),
            storage.url(instead),
        )
        return instead
    return TRASH_DIR


class MarkerStrategy:
    """Write in place under ``checkpoint-<step>/``; the manifest, created once and
    written last, is the commit. For storages without an atomic directory rename:
    object stores (``FsspecStorage``) and FUSE mounts whose rename is copy+delete
    (``fuse.s3fs``, gcsfuse, mountpoint-s3, ...; see ``storage.detect``)::

        during a save                              after the commit
        ROOT/checkpoint-200/                       ROOT/checkpoint-200/
          checkpoint.pending-<a>.json  (first)       attempt-<a>/rank-00000.safetensors
          attempt-<a>/rank-00000.safetensors         attempt-<a>/rank-00001.safetensors
          attempt-<a>/rank-00001.safetensors         checkpoint.manifest.json  (last, once)

    - The in-progress marker is written before any data, so whatever a crashed save
      leaves is recognisably ours: ``list`` shows it as pending, the next start of the
      job sweeps it.
    - Each attempt writes its data under its own ``attempt-<token>/``, so two writers
      racing for one step never overwrite each other's files, and the manifest lists
      only the winner's files: the loser's data cannot corrupt the winner.
    - The manifest is created with a conditional create where the storage offers one
      (S3 ``If-None-Match: *``): of two racing writers exactly one commits, the other
      gets ``CheckpointExistsError`` and discards its own attempt. Without it (FUSE
      mounts, where O_EXCL does not exclude between clients) the manifest is published
      whole (temporary name, then a one-file rename) after a check; two writers on two
      mounts can then both believe they committed, but the manifest that stays lists
      one attempt's complete files.
    - Nothing without a valid manifest is a checkpoint. Retention deletes the manifest
      first (the un-commit, one DELETE), then the data, markers last.
    - A lost answer is not a failure: when the manifest's create is refused or fails,
      the manifest is read back, and if it is byte for byte this attempt's, the save
      committed (the store wrote it; its answer was lost and the client's retry was
      refused with 412).
    - An attempt discarded before every rank reported keeps its marker (a late rank's
      upload may still land there); the next start's sweep or ``clean`` removes it.

    Fault points: ``after_manifest`` fires just before the manifest is created (all data
    written, nothing committed) and ``after_rename`` just after (committed), so crash
    tests mean the same thing under both strategies.
    """

    name = "marker"
    writes_in_place = True

    def __init__(self) -> None:
        # Attempts whose every rank had reported its files when the commit began (see
        # ``discard``): no upload of theirs can still be in flight.
        self._reported: set[str] = set()
        # Attempts discarded before every rank had reported: their markers stayed (see
        # ``discard``), until a later commit proves every rank has moved on.
        self._markers_left: set[str] = set()

    def pending_location(self, step: int, attempt: str) -> str:
        return f"{checkpoint_name(step)}/{attempt_dir_name(attempt)}"

    def prepare(self, storage: Storage, step: int, attempt: str) -> str:
        final = checkpoint_name(step)
        pending = self.pending_location(step, attempt)
        # checkpoint-<step>/ in ROOT (found by the crash-state enumerator: see
        # _durable_dir), then the marker: from here on, whatever this attempt leaves
        # behind is ours to sweep rather than an anonymous directory we must not touch.
        _durable_dir(storage, final, "")
        storage.write_bytes_atomic(
            f"{final}/{marker_name(attempt)}", _marker_doc(step, attempt, "save")
        )
        return _durable_dir(storage, pending, final)

    def publish(
        self, storage: Storage, pending: str, manifest: Manifest, *, rank: int, overwrite: bool
    ) -> Manifest:
        step = manifest.step
        final, attempt_dir = pending.rsplit("/", 1)
        written = dataclasses.replace(
            manifest,
            files=tuple(
                dataclasses.replace(f, path=f"{attempt_dir}/{f.path}") for f in manifest.files
            ),
        )
        data = written.to_json_bytes()
        path = f"{final}/{MANIFEST_NAME}"
        # Called once every rank has reported its files: all of them are written.
        self._reported.add(pending)
        storage.fsync_dir(pending)
        fault_point("after_manifest", rank, step)
        old: Manifest | None = None
        if create_or_own(storage, path, data, step):
            fault_point("after_rename", rank, step)
        else:
            if not overwrite:
                raise errors.CheckpointExistsError(
                    f"checkpoint step {step} was committed at {storage.url(final)} by another "
                    "writer while this save was writing; this attempt's files are discarded "
                    "and the other writer's checkpoint is untouched. Is a second job using "
                    "the same root?"
                )
            old = _manifest_or_none(storage, final)
            # One PUT (or a one-file rename on a FUSE mount) swaps the commit record:
            # readers see the old checkpoint or the new one, both complete.
            storage.write_bytes_atomic(path, data)
            fault_point("after_rename", rank, step)
        try:
            storage.fsync_dir(final)
        except errors.CheckpointError:
            # The commit may not survive a crash and every rank is about to be told the
            # save failed: un-commit so no reader builds on it.
            try:
                storage.delete_file(path)
            except errors.CheckpointError as exc:
                log.warning("could not un-commit step %d after a failed fsync: %s", step, exc)
            raise
        if old is not None:
            # Only once the new commit is durable; best effort (DESIGN invariant 10).
            _delete_unreferenced(storage, final, old, written)
        self._reported.discard(pending)
        _abort_orphan_uploads(storage, pending, written)
        attempt = parse_attempt_dir(attempt_dir)
        if attempt is not None:
            _drop_marker(storage, final, attempt)
        self._finish_left_discards(storage)
        return written

    def _finish_left_discards(self, storage: Storage) -> None:
        """Finish the discards whose marker stayed: every rank reported its files for
        the commit just made, so every rank's earlier save (run in order on each rank)
        has ended, and no upload into those attempts can still land. Their late files
        go, then their markers (last, as in ``discard``). A failed save on an object
        store left ``checkpoint-<step>/`` listed as pending, and ``verify ROOT`` failing,
        until the next start's sweep, however cleanly the job ended."""
        for pending in sorted(self._markers_left):
            self._reported.add(pending)  # no upload can land now: discard drops the marker
            try:
                self.discard(storage, pending)
                _remove_if_empty(storage, pending.rsplit("/", 1)[0])
            except errors.CheckpointError as exc:
                log.warning(
                    "could not finish removing the failed save %s: %s (the next start's "
                    "sweep removes it)",
                    storage.url(pending),
                    exc,
                )
                self._reported.discard(pending)
            self._markers_left.discard(pending)

    def is_committed(self, storage: Storage, step: int, pending: str) -> bool:
        """After a failure: is this attempt's manifest the committed one? Only then are
        its files kept; a manifest that cannot be read keeps them too (the next
        start's sweep decides), so a committed checkpoint is never discarded."""
        final, attempt_dir = pending.rsplit("/", 1)
        try:
            manifest = read_manifest(storage, final)
        except errors.CheckpointNotFoundError:
            return False
        except errors.CheckpointError as exc:
            log.warning(
                "cannot tell whether step %d was committed (%s); keeping %s for the next "
                "start's sweep",
                step,
                exc,
                storage.url(pending),
            )
            return True
        return not manifest.files or any(
            f.path.split("/", 1)[0] == attempt_dir for f in manifest.files
        )

    def discard(self, storage: Storage, pending: str) -> None:
        """Delete an attempt that did not commit. Its marker is deleted last, and only
        when every rank had reported its files (the commit began): before that, a rank
        may still be uploading (the save failed because it was late, or another rank
        failed while it wrote), and a PUT that lands after this delete would be data no
        marker points to, invisible to the sweep and to ``clean`` for ever. So then the
        marker stays: the directory lists as pending, and the next start's sweep (or
        ``clean``) removes it whole, late uploads included."""
        final, attempt_dir = pending.rsplit("/", 1)
        storage.delete_tree(pending)
        attempt = parse_attempt_dir(attempt_dir)
        if attempt is None:
            return
        if pending not in self._reported:
            log.info(
                "discarded %s; its marker stays until the next commit (or start's sweep), "
                "as a rank's upload may still land there",
                storage.url(pending),
            )
            self._markers_left.add(pending)
            return
        self._reported.discard(pending)
        # The attempt's removal is made durable before the marker's: a power loss must
        # not keep the unlink of the marker and lose those of the data, which would leave
        # data that no marker names and nothing ever removes.
        storage.fsync_dir(final)
        storage.delete_file(f"{final}/{marker_name(attempt)}")  # the marker goes last
        _remove_if_empty(storage, final)

    def uncommit(self, storage: Storage, step: int) -> str | None:
        """Delete the manifest of checkpoint ``step``: from then on it is not a
        checkpoint. A marker is written first, so a crash before the data is gone
        leaves a directory the sweep recognises. Returns what ``delete`` removes, or
        None when there is no manifest (already gone)."""
        taken = self._uncommit(storage, step)
        return None if taken is None else taken[0]

    def _uncommit(self, storage: Storage, step: int) -> tuple[str, Callable[[], None]] | None:
        """``uncommit``, and how to undo it (``_retire``: a job found fenced after it).
        The manifest is read, not only sized (one request either way), to be put back."""
        final = checkpoint_name(step)
        path = f"{final}/{MANIFEST_NAME}"
        try:
            committed = storage.read_bytes(path)
        except errors.CheckpointNotFoundError:
            return None
        attempt = new_attempt_token()
        marker = f"{final}/{marker_name(attempt)}"
        storage.write_bytes_atomic(marker, _marker_doc(step, attempt, "delete"))
        storage.delete_file(path)
        storage.fsync_dir(final)

        def undo() -> None:
            # Created once: a manifest there now is a new holder's commit of this step.
            storage.create_exclusive(path, committed)
            storage.delete_file(marker)
            storage.fsync_dir(final)

        return final, undo

    def delete(self, storage: Storage, uncommitted: str) -> None:
        """Delete an un-committed checkpoint directory: data first, markers last, so a
        crash half way still leaves a marker and the next sweep finishes the job. The
        names are listed once and exactly those go; a manifest is never deleted here (one
        that appeared since ``uncommit`` is a newer commit of this step)."""
        names = storage.listdir(uncommitted)
        for name in names:
            if parse_marker_name(name) is not None or name == MANIFEST_NAME:
                continue
            if parse_attempt_dir(name) is not None or storage.is_dir(f"{uncommitted}/{name}"):
                storage.delete_tree(f"{uncommitted}/{name}")
            else:
                storage.delete_file(f"{uncommitted}/{name}")
        storage.fsync_dir(uncommitted)  # data gone durably before its markers (discard)
        for name in names:
            if parse_marker_name(name) is not None:
                storage.delete_file(f"{uncommitted}/{name}")
        _drop_if_empty(storage, uncommitted)

    def leftovers(self, storage: Storage) -> list[Leftover]:
        """What crashed saves and deletes left, one ``Leftover`` per ``checkpoint-<step>``
        directory holding our markers: with no manifest there, every attempt, marker and
        stray file listed in it; beside a committed manifest, the stale attempts (those
        it does not list) and the markers. ``remove_leftover`` deletes exactly what is
        listed here, so whatever appears later (a newer job's attempt or manifest) is
        never touched."""
        out: list[Leftover] = []
        names = [n for n in storage.listdir("") if parse_checkpoint_name(n) is not None]
        if storage.local_path("") is None:
            # An object store: one recursive listing (a request per 1,000 keys) finds
            # the checkpoints that hold a marker or a temporary file, instead of one
            # listing per checkpoint (10,000 requests on every start at 10,000
            # checkpoints). It has no empty directories, the only other case below.
            marked = _marked_checkpoints(storage)
            if marked is not None:
                names = [n for n in names if n in marked]
        for name in names:
            children = storage.listdir(name)
            markers = [a for a in map(parse_marker_name, children) if a is not None]
            # A marker or manifest write killed between its temporary file and the
            # rename leaves the temporary file, beside a manifest or with nothing else.
            temps = tuple(rel for rel, _ in abandoned_temps(storage, name, children))
            manifest: Manifest | None = None
            attempts = [c for c in children if parse_attempt_dir(c) is not None]
            if markers or temps or len(attempts) > 1:
                try:
                    manifest = read_manifest(storage, name)
                except errors.CheckpointNotFoundError:
                    pass
                except errors.CheckpointError as exc:
                    log.warning("not sweeping %s: %s", storage.url(name), exc)
                    continue
            if manifest is not None:
                # A file the manifest lists is the checkpoint's, whatever its name: a
                # saving() block's "x.tmp-1-2" or "checkpoint.pending-<hex>.json" was
                # deleted here as our leftover, and the checkpoint read as corrupt.
                listed = {f"{name}/{f.path}" for f in manifest.files}
                temps = tuple(t for t in temps if t not in listed)
                markers = [a for a in markers if f"{name}/{marker_name(a)}" not in listed]
            if not markers:
                # An empty directory is what a delete leaves when the unlink of its last
                # marker persisted and its rmdir did not (a power loss).
                # A file of that name (not ours) lists no children either.
                orphans = (
                    _orphan_attempts(name, children, _heads(manifest), [])
                    if manifest is not None
                    else ()
                )
                if temps or orphans or (not children and storage.is_dir(name)):
                    out.append(Leftover(name, True, orphans, (), (), temps))
                continue
            marker_paths = tuple(f"{name}/{marker_name(a)}" for a in markers)
            if manifest is None:
                trees, files = [], []
                for child in children:
                    if child == MANIFEST_NAME or parse_marker_name(child) is not None:
                        continue  # a manifest that appeared since is a newer job's commit
                    if parse_temp_name(child) is not None:
                        continue  # only once its writer is gone (``temps``)
                    rel = f"{name}/{child}"
                    if parse_attempt_dir(child) is not None or storage.is_dir(rel):
                        trees.append(rel)
                    else:
                        files.append(rel)
                # A marker names its attempt even when nothing of it is listed (an
                # unfinished multipart upload is invisible until aborted).
                for a in markers:
                    rel = f"{name}/{attempt_dir_name(a)}"
                    if rel not in trees:
                        trees.append(rel)
                out.append(Leftover(name, False, tuple(trees), tuple(files), marker_paths, temps))
                continue
            keep = _heads(manifest)
            stale = tuple(
                f"{name}/{attempt_dir_name(a)}" for a in markers if attempt_dir_name(a) not in keep
            ) + _orphan_attempts(name, children, keep, markers)
            out.append(Leftover(name, True, stale, (), marker_paths, temps))
        return out

    def remove_leftover(self, storage: Storage, leftover: Leftover) -> None:
        """Delete exactly what ``leftover`` lists: data first, markers last (an
        interrupted removal is found again by the next sweep), never a manifest.

        An entry listed as uncommitted is looked at once more first: if a manifest has
        appeared since (a job that took over committed this step), any listed attempt
        it references is kept. Attempt directories go whole: ``attempt-<token>/`` holds
        one attempt's files only (the token is random), including a rank's upload that
        landed after its leader gave up."""
        trees = list(leftover.trees)
        if not leftover.committed:
            try:
                now: Manifest | None = read_manifest(storage, leftover.name)
            except errors.CheckpointNotFoundError:
                now = None
            except errors.CheckpointError as exc:
                raise errors.CommitError(
                    f"not removing {storage.url(leftover.name)}: its manifest appeared since "
                    f"it was listed and cannot be read ({exc}); run the sweep again"
                ) from exc
            if now is not None:
                used = {f.path.split("/", 1)[0] for f in now.files}
                kept = [t for t in trees if t.rsplit("/", 1)[-1] in used]
                if kept:
                    log.warning(
                        "%s was committed since it was listed as abandoned: keeping %s",
                        storage.url(leftover.name),
                        ", ".join(kept),
                    )
                trees = [t for t in trees if t not in kept]
        for rel in trees:
            storage.delete_tree(rel)
            _remove_if_empty(storage, rel)
        for rel in [*leftover.files, *leftover.temps]:
            if rel.rsplit("/", 1)[-1] != MANIFEST_NAME:  # never a commit record
                storage.delete_file(rel)
        if leftover.markers:
            storage.fsync_dir(leftover.name)  # data gone durably before its markers
        for rel in leftover.markers:
            storage.delete_file(rel)
        _drop_if_empty(storage, leftover.name)

    def retire(self, storage: Storage, step: int, *, rank: int = 0, fence: _Fence = None) -> bool:
        """Delete the manifest of checkpoint ``step``, then its data, markers last
        (``CommitStrategy.retire``: callers, fault points, idempotence)."""
        return _retire(self, storage, step, rank=rank, fence=fence)

    def sweep(self, storage: Storage, fence: _Fence = None) -> list[str]:
        """Remove what crashed saves and deletes left (``CommitStrategy.sweep``:
        callers, fence, idempotence).

        First the rename strategy's remains (``RenameStrategy.sweep``): a run may have
        used it on this ROOT, and an interrupted overwrite is put back before anything
        goes. Then this strategy's, in place: only directories holding our markers are
        touched, and in them only what the listing found: a committed checkpoint keeps
        its manifest and the attempt it lists; an uncommitted one loses its attempts,
        markers and strays. A job that took over meanwhile (and may commit that step)
        is never undone: ``fence`` is checked before each directory. A failure there is
        logged and ends this part of the sweep (the next start tries again).

        Raises:
            FencedError: this job lost the run lock (from ``fence``).
            CheckpointError: ``.pending/`` or ``.trash/`` cannot be listed.
        """
        cleaned = RenameStrategy().sweep(storage, fence)
        try:
            for leftover in self.leftovers(storage):
                if fence is not None:
                    fence()
                self.remove_leftover(storage, leftover)
                where = storage.url(leftover.name)
                log.info("removed abandoned marker-strategy data in %s", where)
                cleaned.append(where)
        except errors.LockError:
            raise  # fenced: this job must stop, not carry on without its lock
        except errors.CheckpointError as exc:
            log.warning("could not sweep abandoned saves in %s: %s", storage.url(""), exc)
        return cleaned


STRATEGIES = ("rename", "marker")


def choose_strategy(
    storage: Storage, requested: str | CommitStrategy | None = None
) -> CommitStrategy:
    """The strategy for ``storage``: rename where directory rename is atomic, else
    marker; ``requested`` ("rename" or "marker") overrides the choice, and a strategy
    object (anything implementing ``CommitStrategy``) is used as it is.

    Raises:
        ValueError: ``requested`` is a string but not a strategy name.
        TypeError: ``requested`` is an object that lacks part of ``CommitStrategy``.
        StorageError: ``requested`` is ``"rename"`` on a storage that has no directory
            rename (an object store).
    """
    if requested is not None and not isinstance(requested, str):
        if not isinstance(requested, CommitStrategy):
            missing = [m for m in _protocol_members() if not hasattr(requested, m)]
            raise TypeError(
                f"strategy must be one of {STRATEGIES}, None (automatic) or an object "
                f"implementing atomic_checkpoint.strategies.CommitStrategy; "
                f"{type(requested).__name__} lacks {', '.join(missing)}"
            )
        return requested
    caps = storage.capabilities
    if requested is None:
        # A storage with no rename_dir (the plain Storage protocol, as a user writes
        # one) commits by marker whatever its capabilities say: they default to an
        # atomic rename, and every save failed with "cannot rename directories".
        renames = caps.atomic_dir_rename and isinstance(storage, RenamingStorage)
        return RenameStrategy() if renames else MarkerStrategy()
    if requested == "marker":
        return MarkerStrategy()
    if requested == "rename":
        renaming(storage)  # an object store: StorageError (ENOTSUP), before anything runs
        if not caps.atomic_dir_rename:
            log.warning(
                "atomic-checkpoint: strategy='rename' on %s (%s), whose directory rename is "
                "not atomic: a crash during a commit can leave a checkpoint split between "
                "two names. The marker strategy is safe there",
                storage.url(""),
                caps.name,
            )
        return RenameStrategy()
    raise ValueError(f"strategy must be one of {STRATEGIES} or None (automatic), got {requested!r}")


def _protocol_members() -> tuple[str, ...]:
    """Every attribute and method a ``CommitStrategy`` has, in the order declared."""
    methods = [n for n, v in vars(CommitStrategy).items() if callable(v) and not n.startswith("_")]
    return (*CommitStrategy.__annotations__, *methods)


def _retire(
    strategy: RenameStrategy | MarkerStrategy,
    storage: Storage,
    step: int,
    *,
    rank: int,
    fence: _Fence,
) -> bool:
    """``CommitStrategy.retire`` for every strategy here: the fault points fire at the
    same moments whatever un-commits (the fault campaigns name them)."""
    if fence is not None:
        fence()  # a job that lost the run lock deletes nothing
    fault_point("before_uncommit", rank, step)
    taken = strategy._uncommit(storage, step)
    if taken is None:
        return False  # already gone: deletes tolerate ENOENT
    uncommitted, undo = taken
    if fence is not None:
        # Again: the un-commit may have been held (a stalled request or rename) while
        # another job took ROOT over, and that job may have kept this very step (its
        # rollback to it). Put it back and stop; nothing of it is deleted.
        try:
            fence()
        except errors.FencedError:
            try:
                undo()
            except errors.CheckpointError as exc:
                log.warning(
                    "atomic-checkpoint: this job lost the run lock while it un-committed "
                    "checkpoint %d and could not put it back (%s); the job holding ROOT "
                    "now finds it in %s (its next start or `clean` removes it)",
                    step,
                    exc,
                    storage.url(uncommitted),
                )
            raise
    fault_point("after_uncommit", rank, step)
    fault_point("mid_delete", rank, step)
    strategy.delete(storage, uncommitted)
    return True


def _remove_entry(storage: Storage, rel: str) -> None:
    """Remove one entry of ``.pending/`` or ``.trash/``: a directory whole; a stray file
    or symbolic link by unlinking it, never following it."""
    local = storage.local_path(rel)
    if local is not None and (posix.is_link(local) or not posix.is_dir(local)):
        storage.delete_file(rel)
    else:
        storage.delete_tree(rel)


def _durable_dir(storage: Storage, path: str, parent: str) -> str:
    """Create ``path`` (and its parents) and make its entry in ``parent`` durable before
    anything is written into it: fsync'd files and manifest in a directory whose own
    entry a power cut loses are lost with it. Returns ``path``."""
    storage.makedirs(path)
    storage.fsync_dir(parent)
    return path


def _marker_doc(step: int, attempt: str, purpose: str) -> bytes:
    doc = {
        "format": "atomic-checkpoint-marker",
        "purpose": purpose,
        "step": step,
        "attempt": attempt,
        "created_unix": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    return json.dumps(doc, sort_keys=True).encode("utf-8") + b"\n"


def _create_once(storage: Storage, path: str, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists; True if this call created it."""
    if storage.capabilities.exclusive_create:
        return storage.create_exclusive(path, data)
    # No exclusive create between clients (s3fs-fuse, gcsfuse: O_EXCL is checked only
    # by this mount). Check, then publish the whole file by a one-file rename: never
    # created empty and filled later, which another mount could read as a 0-byte file.
    if storage.size(path) is not None:
        return False
    storage.write_bytes_atomic(path, data)
    return True


def _is_own_manifest(storage: Storage, path: str, data: bytes) -> bool | None:
    """Whether the manifest at ``path`` is exactly ``data`` (this attempt's: it names the
    attempt's unique directory and its commit time); None if it cannot be read."""
    try:
        size = storage.size(path)
        if size is None:
            return False
        if size != len(data):
            return False  # bounded: never reads another writer's manifest whole
        return storage.read_bytes(path) == data
    except errors.CheckpointNotFoundError:
        return False
    except errors.CheckpointError:
        return None


def create_or_own(storage: Storage, path: str, data: bytes, step: int) -> bool:
    """Create ``path`` with ``data`` once (the commit of a manifest: the marker
    strategy's, ``adopt``'s), robust to a lost answer. An object store's client retries a
    request whose answer was lost (a reset connection, a timeout, a 5xx from a proxy
    after the store wrote): the retry of a conditional PUT that had landed is refused
    (412), and an error after the PUT landed says nothing about whether it did. Either
    way the manifest is read back: if it is byte for byte this attempt's, this save
    committed it. True if this call's manifest is the committed one."""
    try:
        if _create_once(storage, path, data):
            return True
    except errors.CheckpointError as exc:
        if _is_own_manifest(storage, path, data) is not True:
            raise
        log.info(
            "the manifest %s was created by this save although the request failed (%s): "
            "the store wrote it, then its answer was lost",
            storage.url(path),
            exc,
        )
        return True
    if _is_own_manifest(storage, path, data) is True:
        log.info(
            "step %d: the create of %s was refused because this save's own first request "
            "had landed (its answer was lost and the client retried): committed",
            step,
            storage.url(path),
        )
        return True
    return False


def _abort_orphan_uploads(storage: Storage, pending: str, manifest: Manifest) -> None:
    """After a commit: abort multipart uploads left open under the committed attempt.
    Every file it lists is complete, so an open upload there is an orphan (a start
    whose answer was lost, then retried) that no sweep would reach: the attempt is
    committed. Only files of at least one part size went up in parts."""
    abort = getattr(storage, "abort_uploads", None)
    block = getattr(storage, "block_size_bytes", None)
    if abort is None or not isinstance(block, int):
        return
    if any(f.size_bytes >= block for f in manifest.files):
        abort(pending)


def _manifest_or_none(storage: Storage, rel: str) -> Manifest | None:
    try:
        return read_manifest(storage, rel)
    except errors.CheckpointError:
        return None


def _delete_unreferenced(storage: Storage, final: str, old: Manifest, new: Manifest) -> None:
    """After a durable overwrite: delete the old checkpoint's files the new one does not
    list. Best effort: the save has succeeded, a failure is a warning."""
    keep = {f.path for f in new.files}
    for f in old.files:
        if f.path in keep:
            continue
        try:
            storage.delete_file(f"{final}/{f.path}")
        except errors.CheckpointError as exc:
            log.warning("could not delete replaced file %s: %s", storage.url(final), exc)
    try:
        names = storage.listdir(final)
    except errors.CheckpointError as exc:
        log.warning("could not list %s to delete replaced files: %s", storage.url(final), exc)
        return  # the committed checkpoint is intact; the next start's sweep tidies up
    for name in names:
        if parse_attempt_dir(name) is not None and not any(p.startswith(f"{name}/") for p in keep):
            try:
                storage.delete_tree(f"{final}/{name}")
            except errors.CheckpointError as exc:
                log.warning("could not delete replaced %s/%s: %s", storage.url(final), name, exc)


def _drop_marker(storage: Storage, final: str, attempt: str) -> None:
    # Best effort: a marker next to a valid manifest is harmless (the manifest decides),
    # and the next start's sweep removes it.
    _best_effort(lambda: storage.delete_file(f"{final}/{marker_name(attempt)}"), storage, final)


def _best_effort(fn: Callable[[], None], storage: Storage, where: str) -> None:
    try:
        fn()
    except errors.CheckpointError as exc:
        log.warning("cleanup in %s skipped: %s (the next start sweeps it)", storage.url(where), exc)


def _remove_if_empty(storage: Storage, rel: str) -> None:
    """Remove directory ``rel`` if it is empty, atomically (rmdir fails on a non-empty
    directory, so a racing writer's new files are never touched). Object stores have
    no empty directories; in-memory storages keep theirs (harmless: no manifest)."""
    local = storage.local_path(rel)
    if local is not None:
        posix.remove_empty_dir(local)


def _drop_if_empty(storage: Storage, rel: str) -> None:
    """After a sweep or a retention delete emptied ``rel``: remove the directory itself.
    On a mounted filesystem by ``rmdir`` (atomic: fails if a newer writer put anything
    there). In memory, only when nothing is left, so the step disappears from listings.
    Object stores have no directories: nothing to do, and nothing is deleted by prefix
    (a manifest a newer job committed meanwhile would go with it)."""
    if storage.local_path(rel) is not None:
        _remove_if_empty(storage, rel)
    elif not getattr(storage, "is_object_store", False) and not storage.walk_files(rel):
        storage.delete_tree(rel)


def _undo(fn: Callable[[], object], storage: Storage, final: str) -> None:
    """Take back an overwrite whose commit is not durable, before reporting it failed.
    A failure here is logged: the copies stay where ``recover_replaced`` finds them."""
    try:
        fn()
        # The copy put back must be durable before the caller's discard deletes the
        # other one: a crash could keep the delete and lose this rename, and the next
        # start's sweep took the replaced copy, orphaned in .trash/, for garbage.
        storage.fsync_dir("")
    except Exception as exc:
        log.warning(
            "could not put the replaced copy of %s back after a failed overwrite: %s "
            "(the next start restores a complete copy)",
            storage.url(final),
            exc,
        )


def _remove_replaced(storage: Storage, rel: str, step: int) -> None:
    """After a durable overwrite: delete the replaced copy. The save has succeeded
    whatever happens here; a failure leaves a leftover for the next sweep or ``clean``."""
    try:
        storage.delete_tree(rel)
    except errors.CheckpointError as exc:
        log.warning(
            "checkpoint step %d was overwritten and committed, but its replaced copy %s "
            "could not be removed: %s (the next start removes it, or run "
            "`atomic-checkpoint clean`)",
            step,
            storage.url(rel),
            exc,
        )


def _is_whole(storage: Storage, rel: str, step: int) -> bool:
    """Whether ``rel`` holds a complete copy of checkpoint ``step``: a manifest of that
    step and every listed file present with its listed size (DESIGN invariant 1). An
    I/O error (StorageError) propagates: it says nothing about the copy."""
    try:
        manifest = read_manifest(storage, rel)
        if manifest.step != step:
            return False
        validate_checkpoint(storage, rel, manifest)
    except (errors.CheckpointNotFoundError, errors.CorruptCheckpointError):
        return False
    return True


def restore_replaced(storage: Storage, pending: str) -> bool:
    """A failed overwrite (rename strategy, no atomic exchange) that stopped between its
    two renames: put the copy it replaced back under ``checkpoint-<step>``, so the
    failure it reports is true. Returns True if a copy was put back.

    Raises:
        CheckpointError: the old copy could not be put back; the caller must then keep
            ``pending`` (the next start's ``recover_replaced`` decides).
    """
    parsed = parse_pending_name(pending.rsplit("/", 1)[-1])
    if parsed is None:
        return False
    step, attempt = parsed
    replaced = f"{TRASH_DIR}/{replaced_name(step, attempt)}"
    final = checkpoint_name(step)
    if not storage.is_dir(replaced) or final in storage.listdir(""):
        return False
    renaming(storage).rename_dir(replaced, final)
    storage.fsync_dir("")
    log.warning(
        "the overwrite of checkpoint step %d failed between its two renames: the previous "
        "copy is back at %s",
        step,
        storage.url(final),
    )
    return True


@dataclass(frozen=True)
class ReplaceRecovery:
    """What ``recover_replaced`` did.

    Attributes:
        restored: ``(step, copy, source)`` for each step put back: ``copy`` is "new" or
            "old", ``source`` the path it was renamed from.
        keep: paths under ``.pending/`` and ``.trash/`` that a sweep or ``clean`` must
            leave alone (recovery could not decide, or could not finish, there).
    """

    restored: tuple[tuple[int, str, str], ...] = ()
    keep: frozenset[str] = frozenset()


def recover_replaced(storage: Storage, *, dry_run: bool = False) -> ReplaceRecovery:
    """Finish overwrites that a crash stopped between their two renames (rename
    strategy without an atomic exchange: sshfs, NFS, Windows).

    Such a crash leaves ``checkpoint-<step>`` absent, the old copy in
    ``.trash/checkpoint-<step>.<a>.replaced`` and the new one in
    ``.pending/checkpoint-<step>.<a>``. The new copy is renamed in when it is complete
    (its manifest was fsync'd before the first rename, so it is, unless someone touched
    it), else the old one: either way the step is back, whole. A replaced copy whose
    ``.pending`` twin is gone belongs to an overwrite that finished: it is garbage, like
    every retention un-commit in ``.trash/`` (those never come back). Trash from older
    versions (``checkpoint-<step>.<token>``) cannot be told apart from retention's and is
    left to the sweep, as before.

    Called by the lock holder before it sweeps ``.pending/`` and ``.trash/`` (a
    writable manager's start-up, ``atomic-checkpoint clean``). With ``dry_run``
    nothing changes; what would be restored is reported and kept.
    """
    restored: list[tuple[int, str, str]] = []
    keep: set[str] = set()
    pending_names = set(storage.listdir(PENDING_DIR))
    for name in storage.listdir(TRASH_DIR):
        parsed = parse_replaced_name(name)
        if parsed is None:
            continue
        step, attempt = parsed
        old = f"{TRASH_DIR}/{name}"
        new = f"{PENDING_DIR}/{pending_name(step, attempt)}"
        final = checkpoint_name(step)
        if pending_name(step, attempt) not in pending_names:
            continue  # the overwrite finished: its new copy is checkpoint-<step>
        try:
            if final in storage.listdir(""):
                if not _is_whole(storage, final, step):
                    log.warning(
                        "%s is not a complete checkpoint, and two copies of step %d lie "
                        "in %s and %s: leaving all three for you to inspect",
                        storage.url(final),
                        step,
                        storage.url(old),
                        storage.url(new),
                    )
                    keep.update((old, new))
                continue  # the step is whole: both other copies are extra
            source = copy = None
            if _is_whole(storage, new, step):
                source, copy = new, "new"
            elif _is_whole(storage, old, step):
                source, copy = old, "old"
            if source is None or copy is None:
                log.warning(
                    "an overwrite of checkpoint step %d was interrupted and neither copy "
                    "(%s, %s) is complete: the step is lost",
                    step,
                    storage.url(new),
                    storage.url(old),
                )
                continue
            if dry_run:
                keep.add(source)
            else:
                renaming(storage).rename_dir(source, final)
                storage.fsync_dir("")
                storage.fsync_dir(source.split("/", 1)[0])
                log.warning(
                    "an overwrite of checkpoint step %d was interrupted between its two "
                    "renames: restored the %s copy from %s",
                    step,
                    copy,
                    storage.url(source),
                )
            restored.append((step, copy, source))
        except errors.CheckpointError as exc:
            log.warning(
                "could not recover the interrupted overwrite of checkpoint step %d (%s): "
                "keeping both copies (%s, %s) for the next start",
                step,
                exc,
                storage.url(new),
                storage.url(old),
            )
            keep.update((old, new))
    return ReplaceRecovery(tuple(restored), frozenset(keep))
