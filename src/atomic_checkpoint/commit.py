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
6. The leader checks its fencing token before that rename; retention runs after the
   commit is durable, off the training thread (see ``manager``).
7. The result is published; every rank returns the same ``Committed``.

With one storage domain each round goes through the leader (``_decide``: one key that
every rank reads; ``gather_phase``: the leader reads every report and answers one
summary), O(N) store requests and bytes for N ranks. With several domains every round
is an all-gather, as the domains' leaders must agree. Nothing here calls back into the
manager: what it decides (the input check, the commit number, the lock to check) comes
in as values, and what it needs afterwards (each domain's committed steps) goes out in
``Committed``.

Marker strategy (object stores, FUSE mounts whose rename is copy+delete): files are
written in place under ``checkpoint-<step>/`` and the manifest, created once, is the
commit. See ``MarkerStrategy``.

Three fsyncs beyond the data: the manifest, the checkpoint directory (covers the
entries of every rank's files, which sit next to the manifest), and ROOT after the
rename.

Overwrite (``overwrite=True``, rename strategy): the new copy is committed before the old
one goes, by one ``RENAME_EXCHANGE`` where the filesystem has it, else by two renames (the
old copy into ``.trash/checkpoint-<step>.<attempt>.replaced``, then the new one in). A
crash between those two leaves the step absent; ``recover_replaced`` (the next start's
sweep, ``atomic-checkpoint clean``) puts a complete copy back. Once ROOT is fsync'd the
save has succeeded: removing the replaced copy is best effort.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ._faults import fault_point
from ._version import __version__
from .catalog import (
    attempt_dir_name,
    marker_name,
    parse_attempt_dir,
    parse_marker_name,
    read_manifest,
)
from .catalog import committed as committed_manifests
from .catalog import validate as validate_checkpoint
from .coordination import Coordinator, exchange_outcomes
from .domains import Domain
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    RankFailure,
    SaveAbandonedError,
    StorageError,
)
from .layout import (
    MANIFEST_NAME,
    PENDING_DIR,
    TRASH_DIR,
    checkpoint_name,
    new_attempt_token,
    parse_checkpoint_name,
    parse_pending_name,
    parse_replaced_name,
    pending_name,
    replaced_name,
)
from .manifest import FileEntry, Manifest
from .storage import posix
from .storage.base import Storage
from .storage.temps import abandoned_temps, parse_temp_name

log = logging.getLogger("atomic_checkpoint")
_T = TypeVar("_T")


@dataclass(frozen=True)
class SharedManifest(Manifest):
    """The committed manifest as the ranks other than the leader get it from a save:
    everything but the file list (``files`` is empty; ``size_bytes`` is the total of the
    files), so the outcome of a save costs O(1) bytes per rank. The manifest in storage
    has the list."""

    total_size_bytes: int = 0

    @classmethod
    def of(cls, manifest: Manifest) -> SharedManifest:
        fields = {f.name: getattr(manifest, f.name) for f in dataclasses.fields(Manifest)}
        fields["files"] = ()
        return cls(**fields, total_size_bytes=manifest.size_bytes)

    @property
    def size_bytes(self) -> int:
        return self.total_size_bytes


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the coordinator after writing."""

    files: tuple[FileEntry, ...]
    write_s: float
    fsync_s: float


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
            storage.rename_dir(pending, final)
        except CheckpointExistsError:
            if not overwrite:
                raise
            self._replace(storage, pending, final, rank=rank, step=manifest.step)
            return manifest
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
        if storage.exchange_dirs(pending, final):
            # One atomic swap (renameat2 RENAME_EXCHANGE): readers see old or new.
            try:
                fault_point("after_rename", rank, step)
                storage.fsync_dir("")
            except BaseException:
                _undo(lambda: storage.exchange_dirs(pending, final), storage, final)
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
        storage.rename_dir(final, replaced)
        try:
            fault_point("mid_replace", rank, step)
            storage.rename_dir(pending, final)
        except BaseException:
            # The save is about to be reported as failed: the old copy goes back. If
            # that fails too, ``discard`` tries again, and the next start's sweep puts
            # a complete copy back whatever happens.
            _undo(lambda: storage.rename_dir(replaced, final), storage, final)
            raise
        try:
            fault_point("after_rename", rank, step)
            storage.fsync_dir("")
        except BaseException:

            def put_back() -> None:
                storage.rename_dir(final, pending)
                storage.rename_dir(replaced, final)

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

        Called by the coordinator (retention), from the rotation thread. Returns what
        ``delete`` removes, or None when the checkpoint is already gone.
        """
        name = checkpoint_name(step)
        storage.makedirs(TRASH_DIR)
        trash = f"{TRASH_DIR}/{name}.{new_attempt_token()}"
        try:
            storage.rename_dir(name, trash)
        except CheckpointNotFoundError:
            return None  # already gone: deletes tolerate ENOENT
        except StorageError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        storage.fsync_dir("")
        return trash

    def delete(self, storage: Storage, uncommitted: str) -> None:
        """Delete what ``uncommit`` took out of the namespace."""
        storage.delete_tree(uncommitted)


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

    def __init__(self) -> None:
        # Attempts whose every rank had reported its files when the commit began (see
        # ``discard``): no upload of theirs can still be in flight.
        self._reported: set[str] = set()

    def pending_location(self, step: int, attempt: str) -> str:
        return f"{checkpoint_name(step)}/{attempt_dir_name(attempt)}"

    def prepare(self, storage: Storage, step: int, attempt: str) -> str:
        final = checkpoint_name(step)
        pending = self.pending_location(step, attempt)
        storage.makedirs(final)
        # The entry of checkpoint-<step>/ in ROOT must be durable before anything in it
        # is: fsync'd files and manifest in a directory whose own entry is lost in a
        # power cut are lost with it (found by the crash-state enumerator).
        storage.fsync_dir("")
        # The marker goes first: from here on, whatever this attempt leaves behind is
        # ours to sweep rather than an anonymous directory we must not touch.
        storage.write_bytes_atomic(
            f"{final}/{marker_name(attempt)}", _marker_doc(step, attempt, "save")
        )
        storage.makedirs(pending)
        storage.fsync_dir(final)
        return pending

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
        if _create_or_own(storage, path, data, step):
            fault_point("after_rename", rank, step)
        else:
            if not overwrite:
                raise CheckpointExistsError(
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
        except CheckpointError:
            # The commit may not survive a crash and every rank is about to be told the
            # save failed: un-commit so no reader builds on it.
            try:
                storage.delete_file(path)
            except CheckpointError as exc:
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
        return written

    def is_committed(self, storage: Storage, step: int, pending: str) -> bool:
        """After a failure: is this attempt's manifest the committed one? Only then are
        its files kept; a manifest that cannot be read keeps them too (the next
        start's sweep decides), so a committed checkpoint is never discarded."""
        final, attempt_dir = pending.rsplit("/", 1)
        try:
            manifest = read_manifest(storage, final)
        except CheckpointNotFoundError:
            return False
        except CheckpointError as exc:
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
                "discarded %s; its marker stays until the next start's sweep, as a rank's "
                "upload may still land there",
                storage.url(pending),
            )
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
        final = checkpoint_name(step)
        path = f"{final}/{MANIFEST_NAME}"
        if storage.size(path) is None:
            return None
        attempt = new_attempt_token()
        storage.write_bytes_atomic(
            f"{final}/{marker_name(attempt)}", _marker_doc(step, attempt, "delete")
        )
        storage.delete_file(path)
        storage.fsync_dir(final)
        return final

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
        for name in storage.listdir(""):
            if parse_checkpoint_name(name) is None:
                continue
            children = storage.listdir(name)
            markers = [a for a in map(parse_marker_name, children) if a is not None]
            # A marker or manifest write killed between its temporary file and the
            # rename leaves the temporary file, beside a manifest or with nothing else.
            temps = tuple(rel for rel, _ in abandoned_temps(storage, name, children))
            if not markers:
                # An empty directory is what a delete leaves when the unlink of its last
                # marker persisted and its rmdir did not (a power loss).
                if temps or not children:
                    out.append(Leftover(name, True, (), (), (), temps))
                continue
            try:
                manifest: Manifest | None = read_manifest(storage, name)
            except CheckpointNotFoundError:
                manifest = None
            except CheckpointError as exc:
                log.warning("not sweeping %s: %s", storage.url(name), exc)
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
            keep = {f.path.split("/", 1)[0] for f in manifest.files}
            stale = tuple(
                f"{name}/{attempt_dir_name(a)}" for a in markers if attempt_dir_name(a) not in keep
            )
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
            except CheckpointNotFoundError:
                now = None
            except CheckpointError as exc:
                raise CommitError(
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

    def sweep(self, storage: Storage, fence: Callable[[], None] | None = None) -> list[str]:
        """Remove what crashed saves and deletes left (coordinator, at start-up, before
        this job saves). Only directories holding our markers are touched, and in them
        only what the listing found: a committed checkpoint keeps its manifest and the
        attempt it lists; an uncommitted one loses its attempts, markers and strays.

        ``fence`` (the run lock's check) is called before each entry: a job that lost
        the lock to a newer one stops deleting at once (``FencedError``). Returns the
        locations cleaned."""
        cleaned = []
        for leftover in self.leftovers(storage):
            if fence is not None:
                fence()
            self.remove_leftover(storage, leftover)
            cleaned.append(storage.url(leftover.name))
        return cleaned


@dataclass(frozen=True)
class Leftover:
    """The remains of crashed marker saves and deletes in one checkpoint directory, as
    listed by ``MarkerStrategy.leftovers`` (paths relative to ROOT).

    Attributes:
        name: ``checkpoint-<step>``.
        committed: a manifest was there: only stale attempts and markers are listed.
        trees: attempt directories (and, when uncommitted, stray subdirectories).
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


class CommitStrategy(Protocol):
    """How a pending save becomes a checkpoint, and how a checkpoint stops being one.

    Every method is called by the coordinator of a storage domain only, and blocks.
    """

    name: str

    def pending_location(self, step: int, attempt: str) -> str: ...

    def prepare(self, storage: Storage, step: int, attempt: str) -> str: ...

    def publish(
        self, storage: Storage, pending: str, manifest: Manifest, *, rank: int, overwrite: bool
    ) -> Manifest: ...

    def is_committed(self, storage: Storage, step: int, pending: str) -> bool: ...

    def discard(self, storage: Storage, pending: str) -> None: ...

    def uncommit(self, storage: Storage, step: int) -> str | None: ...

    def delete(self, storage: Storage, uncommitted: str) -> None: ...


STRATEGIES = ("rename", "marker")


def choose_strategy(storage: Storage, requested: str | None = None) -> CommitStrategy:
    """The strategy for ``storage``: rename where directory rename is atomic, else
    marker; ``requested`` ("rename" or "marker") overrides the choice.

    Raises:
        ValueError: ``requested`` is not a strategy name.
    """
    caps = storage.capabilities
    if requested is None:
        return RenameStrategy() if caps.atomic_dir_rename else MarkerStrategy()
    if requested == "marker":
        return MarkerStrategy()
    if requested == "rename":
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
    except CheckpointNotFoundError:
        return False
    except CheckpointError:
        return None


def _create_or_own(storage: Storage, path: str, data: bytes, step: int) -> bool:
    """``_create_once``, robust to a lost answer. An object store's client retries a
    request whose answer was lost (a reset connection, a timeout, a 5xx from a proxy
    after the store wrote): the retry of a conditional PUT that had landed is refused
    (412), and an error after the PUT landed says nothing about whether it did. Either
    way the manifest is read back: if it is byte for byte this attempt's, this save
    committed it. True if this call's manifest is the committed one."""
    try:
        if _create_once(storage, path, data):
            return True
    except CheckpointError as exc:
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
    except CheckpointError:
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
        except CheckpointError as exc:
            log.warning("could not delete replaced file %s: %s", storage.url(final), exc)
    try:
        names = storage.listdir(final)
    except CheckpointError as exc:
        log.warning("could not list %s to delete replaced files: %s", storage.url(final), exc)
        return  # the committed checkpoint is intact; the next start's sweep tidies up
    for name in names:
        if parse_attempt_dir(name) is not None and not any(p.startswith(f"{name}/") for p in keep):
            try:
                storage.delete_tree(f"{final}/{name}")
            except CheckpointError as exc:
                log.warning("could not delete replaced %s/%s: %s", storage.url(final), name, exc)


def _drop_marker(storage: Storage, final: str, attempt: str) -> None:
    # Best effort: a marker next to a valid manifest is harmless (the manifest decides),
    # and the next start's sweep removes it.
    _best_effort(lambda: storage.delete_file(f"{final}/{marker_name(attempt)}"), storage, final)


def _best_effort(fn: Callable[[], None], storage: Storage, where: str) -> None:
    try:
        fn()
    except CheckpointError as exc:
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
    except CheckpointError as exc:
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
    except (CheckpointNotFoundError, CorruptCheckpointError):
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
    storage.rename_dir(replaced, final)
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
                storage.rename_dir(source, final)
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
        except CheckpointError as exc:
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


@dataclass(frozen=True)
class Failed:
    """What a rank's write produced instead of a ``RankReport``: shared by ``finish``."""

    phase: str
    error: Exception


@dataclass(frozen=True)
class Committed:
    """The outcome of ``finish``, identical on every rank of a storage domain."""

    #: The committed manifest (other ranks than the leader, with one storage domain:
    #: a ``SharedManifest``, the same manifest without its file list).
    manifest: Manifest
    #: Seconds per step: prepare, write, fsync, gather, commit, publish, total.
    timings: dict[str, float]
    #: Several storage domains: each domain's committed steps after this commit,
    #: ``[(step, metrics, created_unix)]`` by domain (retention decides from them).
    domain_views: list[Any] | None = None


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
    pending = Pending(step, "", False, overwrite, None, time.perf_counter())
    mine = problem if ctx.is_coordinator else None

    def prepare() -> tuple[int, str, bool]:
        if mine is not None:
            raise mine
        attempt = new_attempt_token()
        # Known before it exists, so a failure from here on discards it.
        pending.owned = ctx.strategy.pending_location(step, attempt)
        _fence(ctx, step)
        exists = _is_step_committed(ctx.storage, step, overwrite=overwrite)
        if exists and not overwrite and len(ctx.leaders) == 1:
            raise _exists_error(ctx.storage, step)
        return step, ctx.strategy.prepare(ctx.storage, step, attempt), exists

    with _aborting(ctx, pending):
        decided = _decide(ctx, pending, "prepare", prepare)
    exists_in = [d[2] for d in decided]
    if all(exists_in) and not overwrite:
        # Committed in every domain (several domains: each leader only said so).
        abort(ctx, pending)
        raise _exists_error(ctx.storage, step)
    leader_step, pending.location, exists = decided[_domain_index(ctx)]
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
                _await_dir(ctx.storage, pending.location, ctx.visibility_timeout_s)
            pending.writes = True
        except Exception as exc:  # shared by finish, never swallowed
            pending.problem = ("write", exc)
    pending.timings["prepare"] = time.perf_counter() - pending.started
    return pending


def attempt(phase: str, write: Callable[[], RankReport]) -> RankReport | Failed:
    """Step 2 on one rank: ``write()`` this rank's files into ``Pending.location``
    (fsync'd, with their checksums), or what failed, for ``finish`` to share."""
    try:
        return write()
    except Exception as exc:  # every failure is shared, never swallowed
        return Failed(phase, exc)


def finish(
    ctx: SaveContext,
    pending: Pending,
    written: RankReport | Failed | None,
    *,
    commit_seq: int = 0,
    state_kind: str,
    metrics: Mapping[str, float],
    metadata: Mapping[str, Any],
    scan: Callable[[str], RankReport] | None = None,
) -> Committed:
    """Steps 3-7, collective: every rank reports what it wrote (``written``: its
    report, its failure, or None if it wrote nothing); the leader checks that every
    file is visible with its size, writes the manifest, commits with the strategy and
    fsyncs; every rank returns the same outcome.

    ``scan`` (files written by arbitrary code: ``saving()``, DCP) runs on the leader
    once every rank has written, and reports what is under the pending location.
    ``commit_seq`` numbers the commit in the manifest (the caller's counter).

    On any failure the leader removes the pending location (unless it is committed)
    and every rank raises the same error.
    """
    storage, rank, step = ctx.storage, ctx.coord.rank, pending.step
    if pending.writes and not isinstance(written, Failed):
        fault_point("after_write", rank, step)
    t = time.perf_counter()
    with _aborting(ctx, pending):
        # 3. every rank's step and report, gathered on the leader; every rank gets
        # one summary (failures, differing steps), so that every rank names the same
        # failed or missing ranks within ``timeout_s``.
        def report() -> tuple[int, RankReport | None]:
            if pending.problem is not None:
                raise _InPhase(*pending.problem)
            if isinstance(written, Failed):
                raise _InPhase(written.phase, written.error)
            return step, written if pending.writes else None

        mine, reports, (steps, write_s, fsync_s) = gather_phase(
            ctx, step, "write", report, _write_summary, to_leader=_through_leader(ctx)
        )
        if steps is not None:
            _check_same_step(steps)
        timings = pending.timings
        timings["write"], timings["fsync"] = write_s, fsync_s
        timings["gather"] = time.perf_counter() - t - write_s - fsync_s

        # 4-6. the leader commits; 7. every rank gets the outcome.
        t = time.perf_counter()

        def commit() -> tuple[Manifest, Any, float]:
            done = _commit_on_leader(
                ctx,
                pending,
                [r for _, r in reports or () if r is not None],
                scan,
                commit_seq,
                state_kind,
                metrics,
                metadata,
            )
            pending.committed = True
            return done

        def settle(timeout: CoordinationTimeoutError) -> Any:
            if ctx.is_coordinator:
                raise _committed_anyway(ctx, step, timeout) if pending.committed else timeout
            return _settle_outcome(ctx, step, pending.location, mine[1], timeout)

        results = _decide(ctx, pending, "commit", commit, settle=settle)
    manifest, _, timings["publish"] = results[_domain_index(ctx)]
    views = [r[1] for r in results] if len(ctx.leaders) > 1 else None
    timings["commit"] = time.perf_counter() - t
    if not ctx.is_coordinator and not storage.capabilities.coherent:
        _await_committed(storage, step, ctx.visibility_timeout_s)
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


def _failure(exc: BaseException, rank: int, phase: str) -> RankFailure:
    return RankFailure(rank, phase, type(exc).__name__, str(exc) or repr(exc))


class _Aborted(Exception):
    """Internal: a phase failed somewhere; carries the error to raise on this rank."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _InPhase(Exception):
    """Internal: a failure inside a round, reported under the step of the protocol it
    belongs to (a rank's input check travels with its write report)."""

    def __init__(self, phase: str, error: Exception):
        super().__init__(str(error))
        self.phase = phase
        self.error = error


@contextlib.contextmanager
def _aborting(ctx: SaveContext, pending: Pending) -> Iterator[None]:
    """On any failure inside: ``abort``, then raise the one shared error."""
    try:
        yield
    except _Aborted as aborted:
        abort(ctx, pending)
        raise aborted.error from None
    except BaseException:
        abort(ctx, pending)
        raise


def _fence(ctx: SaveContext, step: int) -> None:
    if ctx.cancel is not None and ctx.cancel.is_set():
        raise SaveAbandonedError(
            f"the async save of step {step} was abandoned; it is not committed"
        )
    if ctx.lock is not None:
        ctx.lock.check()


def _domain_index(ctx: SaveContext) -> int:
    """This rank's storage domain, as an index into what ``_decide`` returns."""
    return ctx.leaders.index(ctx.leader)


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
    settle: Callable[[CoordinationTimeoutError], Any] | None = None,
) -> list[_T]:
    """Run ``fn`` on the domain leader(s); every rank gets every leader's result, in
    the order of ``ctx.leaders``, or every rank raises the same error.

    Through one leader (``_through_leader``), the leader publishes one key that every
    rank reads; a leader that failed removes what it created before it publishes the
    failure, so no rank returns while its pending data still exists. The commit's
    result reaches the others without its file list (``SharedManifest``): N ranks
    reading N entries each would put O(N^2) bytes through the store. ``settle`` decides
    what a timeout means (the commit may have happened). Otherwise (several domains)
    every rank sends its own outcome in one all-gather (``run_phase``).
    """
    step, rank = pending.step, ctx.coord.rank
    if not _through_leader(ctx):
        lead = ctx.is_coordinator

        def here() -> Any:
            if lead:
                return fn()
            if phase == "commit":
                fault_point("during_broadcast", rank, step)
            return None

        values = run_phase(ctx, step, phase, here)
        return [values[lead_rank] for lead_rank in ctx.leaders]
    # On the wire: ("ok", *result) or ("error", the shared error). The commit's result
    # is sent as (manifest without its files, publish_s): one domain has no views.
    mine: Any = None
    verdict: Any = None
    if ctx.is_coordinator:
        try:
            mine = fn()
            if phase == "commit":
                verdict = ("ok", SharedManifest.of(mine[0]), mine[2])
            else:
                verdict = ("ok", *mine)
        except Exception as exc:  # shared, never swallowed
            abort(ctx, pending)
            verdict = ("error", _shared_error([_failure(exc, rank, phase)], step))
    elif phase == "commit":
        fault_point("during_broadcast", rank, step)
    publish: Callable[..., Any] = ctx.coord.publish  # type: ignore[attr-defined]
    key = f"save step {step}: {phase}"
    try:
        verdict = publish(key, verdict, src=ctx.leader, timeout_s=ctx.timeout_s)
    except CoordinationTimeoutError as exc:
        if settle is None:
            raise
        verdict = settle(exc)
    if verdict[0] == "error":
        raise _Aborted(verdict[1])
    if ctx.is_coordinator:
        return [mine]
    if phase == "commit":
        return [(verdict[1], None, verdict[2])]  # type: ignore[list-item]
    return [tuple(verdict[1:])]  # type: ignore[list-item]


def _run_here(
    ctx: SaveContext, phase: str, fn: Callable[[], _T] | None
) -> tuple[Any, tuple[Any, RankFailure | None]]:
    """Run ``fn`` on this rank; returns its result (None if it failed) and what this rank
    sends: (result, its failure or None)."""
    value: Any = None
    error: BaseException | None = None
    failed_in = phase
    if fn is not None:
        try:
            value = fn()
        except _InPhase as exc:
            failed_in, error = exc.phase, exc.error
        except Exception as exc:  # every failure is shared, never swallowed
            error = exc
    if ctx.coord.world_size == 1 and error is not None:
        raise _Aborted(error)
    return value, (value, None if error is None else _failure(error, ctx.coord.rank, failed_in))


def run_phase(ctx: SaveContext, step: int, phase: str, fn: Callable[[], _T] | None) -> list[_T]:
    """Run ``fn`` on this rank (None: nothing to do here), then share the outcome.

    Returns every rank's result, indexed by rank. If any rank failed, every rank raises
    the same ``DistributedCheckpointError`` (with one rank, the original error).
    """
    value, (_, failure) = _run_here(ctx, phase, fn)
    if ctx.coord.world_size == 1:
        return [value]
    what = f"save step {step}: {phase}" if step >= 0 else phase
    try:
        values, failures = exchange_outcomes(
            ctx.coord, what, value, failure, timeout_s=ctx.timeout_s
        )
    except CoordinationTimeoutError as exc:
        raise _Aborted(exc) from exc
    if failures:
        raise _Aborted(_shared_error(failures, step))
    return values


def run_collective(ctx: SaveContext, phase: str, fn: Callable[[], _T] | None) -> list[_T]:
    """``run_phase`` outside a save (start-up, listing, restore): returns every rank's
    result, or raises on every rank the one shared error itself (the original error
    with one rank)."""
    try:
        return run_phase(ctx, -1, phase, fn)
    except _Aborted as aborted:
        raise aborted.error from None


def gather_phase(
    ctx: SaveContext,
    step: int,
    phase: str,
    fn: Callable[[], _T],
    summarize: Callable[[list[_T]], Any],
    *,
    to_leader: bool = True,
) -> tuple[_T, list[_T] | None, Any]:
    """Like ``run_phase``, but only the domain leader gets every rank's result: the
    others get ``summarize(results)``, computed once on the leader. Returns this rank's
    result, its domain's results (on the leader; None elsewhere) and the summary. If
    any rank failed, every rank raises the same error.

    Through a coordinator with ``gather`` (and ``to_leader``: one storage domain), a
    round costs O(N) store requests and O(N) bytes for N ranks; an all-gather sends
    every rank every result (O(N^2) bytes).
    """
    value, payload = _run_here(ctx, phase, fn)
    if ctx.coord.world_size == 1:
        return value, [value], summarize([value])

    def reduce(outcomes: list[Any]) -> tuple[list[RankFailure], Any]:
        failures = [f for _, f in outcomes if f is not None]
        return (failures, None) if failures else ([], summarize([v for v, _ in outcomes]))

    what = f"save step {step}: {phase}" if step >= 0 else phase
    gather = getattr(ctx.coord, "gather", None) if to_leader else None
    try:
        everything: list[Any] | None
        if gather is None:  # every rank gets every result
            everything = ctx.coord.all_gather(what, payload, timeout_s=ctx.timeout_s)
            failures, summary = reduce(everything)
            everything = [everything[r] for r in ctx.members]
        else:
            everything, (failures, summary) = gather(
                what, payload, dst=ctx.leader, timeout_s=ctx.timeout_s, reduce=reduce
            )
    except CoordinationTimeoutError as exc:
        raise _Aborted(exc) from exc
    if failures:
        raise _Aborted(_shared_error(failures, step))
    if not ctx.is_coordinator or everything is None:
        return value, None, summary
    return value, [v for v, _ in everything], summary


def _check_same_step(steps: Sequence[int]) -> None:
    """Abort the save on every rank unless every rank passed the same step."""
    if len(set(steps)) > 1:
        by_rank = dict(enumerate(steps))
        raise _Aborted(
            CommitError(
                f"the ranks were asked to save different steps ({by_rank}, by rank): every "
                "rank must call save() with the same step. Nothing was committed; compute "
                "the step once (e.g. on rank 0) and use it on every rank"
            )
        )


def _shared_error(failures: Sequence[RankFailure], step: int) -> CheckpointError:
    """The one error every rank raises for these failures."""
    if len(failures) == 1 and failures[0].error_type == "CheckpointExistsError":
        return CheckpointExistsError(failures[0].message)
    # Negative steps mark operations other than a save (start-up, listing, restore).
    return DistributedCheckpointError(list(failures), step=step if step >= 0 else None)


def _commit_on_leader(
    ctx: SaveContext,
    pending: Pending,
    reports: Sequence[RankReport],
    scan: Callable[[str], RankReport] | None,
    commit_seq: int,
    state_kind: str,
    metrics: Mapping[str, float],
    metadata: Mapping[str, Any],
) -> tuple[Manifest, Any, float]:
    """Steps 4-6 on the domain leader. Returns the manifest as written, the domain's
    committed steps (several domains only) and the time it took."""
    storage, staged, step = ctx.storage, pending.location, pending.step
    tc = time.perf_counter()
    scanned = [scan(staged)] if scan is not None else []
    files = _merge(list(reports) + scanned)
    _await_files(storage, staged, files, ctx.visibility_timeout_s)
    _fence(ctx, step)
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
    manifest = ctx.strategy.publish(
        storage, staged, manifest, rank=ctx.coord.rank, overwrite=pending.replace
    )
    view = None
    if len(ctx.leaders) > 1:
        view = [
            (m.step, dict(m.metrics), m.created_unix)
            for m in committed_manifests(storage, run_id=ctx.run_id, warn=False)
        ]
    fault_point("during_broadcast", ctx.coord.rank, step)
    return manifest, view, time.perf_counter() - tc


def _write_summary(written: list[tuple[int, RankReport | None]]) -> tuple[Any, float, float]:
    """What every rank needs of the write round's reports (only the leader gets them):
    every rank's step if they differ (else None), the slowest write and fsync."""
    steps = [w[0] for w in written]
    reports = [r for _, r in written if r is not None]
    return (
        steps if len(set(steps)) > 1 else None,
        max((r.write_s for r in reports), default=0.0),
        max((r.fsync_s for r in reports), default=0.0),
    )


def _settle_outcome(
    ctx: SaveContext,
    step: int,
    staged: str,
    mine: RankReport | None,
    timeout: CoordinationTimeoutError,
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
            return ("ok", manifest, 0.0)
    raise CoordinationTimeoutError(
        f"{timeout} The leader may have committed checkpoint step {step} before the "
        "exchange failed: latest() or `atomic-checkpoint list` tells",
        missing_ranks=timeout.missing_ranks,
        key=timeout.key,
    ) from timeout


def _committed_anyway(
    ctx: SaveContext, step: int, timeout: CoordinationTimeoutError
) -> CoordinationTimeoutError:
    """The leader committed, then could not publish the outcome (a rank gave up waiting
    and marked the key): every rank raises, and this error says what is true."""
    return CoordinationTimeoutError(
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
    except CheckpointError:
        return None
    listed = {(f.path.rsplit("/", 1)[-1], f.size_bytes, f.checksum) for f in manifest.files}
    ours = {
        (f.path.rsplit("/", 1)[-1], f.size_bytes, f.checksum) for f in (mine.files if mine else ())
    }
    return manifest if ours and ours <= listed else None


def _foreign_entries(storage: Storage, rel: str) -> list[str]:
    return [
        n
        for n in storage.listdir(rel)
        if parse_marker_name(n) is None and parse_attempt_dir(n) is None
    ]


def _is_step_committed(storage: Storage, step: int, *, overwrite: bool = False) -> bool:
    """Whether ``checkpoint-<step>`` is taken: by a manifest, or (with ``overwrite``,
    which then replaces it) by a foreign directory. Without ``overwrite`` a foreign
    directory is an error: it is never replaced silently."""
    name = checkpoint_name(step)
    try:
        read_manifest(storage, name)
    except CheckpointNotFoundError:
        # Marker-strategy leftovers (markers, attempt directories) are ours, not foreign.
        if storage.is_dir(name) and _foreign_entries(storage, name):
            if overwrite:
                return True
            raise CommitError(
                f"{storage.url(name)} exists but is not a committed checkpoint (no manifest): "
                "it was not written by atomic-checkpoint, or by an incomplete in-place save. "
                "Move it away, or pass overwrite=True to replace it"
            ) from None
        return False
    except CorruptCheckpointError:
        pass
    return True


def _exists_error(storage: Storage, step: int) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"checkpoint step {step} is already committed at "
        f"{storage.url(checkpoint_name(step))}; pass overwrite=True to replace it atomically, "
        "or save under a new step"
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
    One listing of ``pending`` comes first: on an object store a size query is a HEAD
    request per file, one after another from the leader (16,384 at 4096 ranks of four
    files each), where a listing costs one request per 1,000 files. Files the listing
    does not show with their size (a listing may lag behind a lookup on NFS) are asked
    one by one.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    listed: dict[str, int] = {}
    if len(files) > 1:
        with contextlib.suppress(CheckpointError):  # the per-file queries decide
            listed = dict(storage.walk_files(pending))
    while True:
        wrong = []
        for f in files:
            if listed.get(f.path) == f.size_bytes:
                continue
            size = storage.size(f"{pending}/{f.path}")
            if size != f.size_bytes:
                wrong.append((f, size))
        if not wrong:
            return
        files, listed = [f for f, _ in wrong], {}
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


def _await_dir(storage: Storage, path: str, timeout_s: float) -> None:
    """Ranks other than the coordinator, on a network filesystem: wait until the pending
    directory the coordinator just created is visible here (NFS clients cache negative
    lookups; a refresh of the parent drops them)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    while not storage.is_dir(path):
        if time.monotonic() >= deadline:
            raise CommitError(
                f"the pending directory {storage.url(path)} that the coordinator created is "
                f"not visible from this rank after {timeout_s:g} s: does this rank see the "
                "same storage under the checkpoint root?"
            )
        storage.refresh(parent)
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _await_committed(storage: Storage, step: int, timeout_s: float) -> None:
    """Non-coordinators on a network filesystem: wait until the commit is visible.

    Runs after every rank was told the save committed, so it never fails the save: a
    rank that raised here while the others returned would report a failure for a
    committed step (found by the libfiu campaign on s3fs-fuse: an EIO reading the
    manifest back through one rank's mount). A manifest that stays invisible or cannot
    be read from this rank is a warning; the checkpoint is committed either way."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    where = storage.url(checkpoint_name(step))
    while True:
        try:
            read_manifest(storage, checkpoint_name(step))
            return
        except CheckpointNotFoundError:
            if time.monotonic() >= deadline:
                log.warning(
                    "checkpoint step %d is committed but not visible from this rank after "
                    "%g s: %s (this mount's cache is stale; it shows the step later)",
                    step,
                    timeout_s,
                    where,
                )
                return
        except CheckpointError as exc:
            log.warning(
                "checkpoint step %d is committed, but this rank cannot read its manifest "
                "back at %s: %s",
                step,
                where,
                exc,
            )
            return
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
