"""The exception tree of atomic-checkpoint.

Every error about checkpoints, storage and coordination derives from
:class:`CheckpointError`; low-level ``OSError``\\ s and backend errors are mapped at the
storage boundary and chained (``raise StorageError(...) from exc``), so callers never
need to catch ``OSError``. A bad argument (a step of the wrong type, a negative
timeout) is a plain ``TypeError`` or ``ValueError`` raised before anything is done;
``wait(timeout_s=...)`` raises ``TimeoutError``; with one process, an exception of the
caller's own (``saving()``'s block, ``saving_async``'s write function, ``failed=``) is
raised as it is (with several, every rank raises a ``DistributedCheckpointError``
naming it).
Where a builtin fits, it is mixed in, so ``except FileNotFoundError`` still works::

    CheckpointError(Exception)
    ├── CheckpointNotFoundError(CheckpointError, FileNotFoundError)
    ├── CheckpointExistsError(CheckpointError, FileExistsError)
    ├── StepOrderError(CheckpointError, ValueError)   a save below the newest step
    ├── CorruptCheckpointError(CheckpointError)
    │   ├── UnsafeCheckpointError        path escapes, pickle not allowed
    │   └── UnsupportedSchemaError       written by a newer version
    ├── SerializationError(CheckpointError, TypeError)
    ├── StateMismatchError(CheckpointError, ValueError)   restore(into=) of another shape
    ├── StorageError(CheckpointError, OSError)
    │   ├── StorageFullError             ENOSPC, EDQUOT
    │   └── StoragePermissionError(StorageError, PermissionError)   EACCES, EPERM, EROFS
    ├── CommitError(CheckpointError)
    ├── CoordinationTimeoutError(CheckpointError, TimeoutError)
    ├── CollectiveMismatchError(CheckpointError)   ranks made different calls
    ├── DistributedCheckpointError(CheckpointError)   carries every rank's failure
    │   ├── DistributedStorageFullError(DistributedCheckpointError, StorageFullError)
    │   └── DistributedStateMismatchError(DistributedCheckpointError, StateMismatchError)
    ├── SaveAbandonedError(CheckpointError)   an async save stopped by close() or exit
    ├── LockError(CheckpointError)
    │   ├── LockHeldError                another live job owns ROOT
    │   └── FencedError                  this job's token is stale (a zombie)
    ├── ResumeError(CheckpointError, ValueError)   asked to resume, nothing valid
    └── ReadOnlyError(CheckpointError, PermissionError)

All errors are picklable: they cross ranks inside :class:`DistributedCheckpointError`.
"""

from __future__ import annotations

import errno as _errno
import os as _os
import re as _re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CollectiveMismatchError",
    "CommitError",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "DistributedStateMismatchError",
    "DistributedStorageFullError",
    "FencedError",
    "LockError",
    "LockHeldError",
    "RankFailure",
    "ReadOnlyError",
    "ResumeError",
    "SaveAbandonedError",
    "SerializationError",
    "StateMismatchError",
    "StepOrderError",
    "StorageError",
    "StorageFullError",
    "StoragePermissionError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
]


class CheckpointError(Exception):
    """Root of every error raised by atomic-checkpoint."""

    def __reduce__(self):  # type: ignore[no-untyped-def,unused-ignore]
        # Subclasses that take keyword arguments still unpickle: rebuild from args and
        # restore the instance dict.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls, args, state):  # type: ignore[no-untyped-def,unused-ignore]
    obj = cls.__new__(cls)
    Exception.__init__(obj, *args)
    obj.__dict__.update(state)
    return obj


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested checkpoint (or any checkpoint) does not exist."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint for this step is already committed (pass ``overwrite=True``)."""


class StepOrderError(CheckpointError, ValueError):
    """A save of a step lower than the newest committed step of this run.

    Retention orders checkpoints by step, so a lower step saved after a higher one
    would be the first one deleted, and a resume would load the higher one, not the
    state just saved. Raised on every rank before anything is written. To continue
    from an older checkpoint, discard the newer ones with
    ``CheckpointManager.rollback(step)`` first.

    Attributes:
        step: the step that was to be saved.
        newest: the newest committed step of this run.
    """

    def __init__(self, message: str, *, step: int, newest: int):
        super().__init__(message)
        self.step = step
        self.newest = newest


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint does not match its manifest, or the manifest is invalid."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """Loading would read outside the checkpoint or execute code from it."""


class UnsupportedSchemaError(CorruptCheckpointError):
    """The manifest was written by a newer version of atomic-checkpoint."""


class SerializationError(CheckpointError, TypeError):
    """The state holds an object that cannot be saved safely."""


class StateMismatchError(CheckpointError, ValueError):
    """``restore(into=...)`` was given a state that does not match the checkpoint (a
    tensor of another shape or dtype where the checkpoint holds one, or a tensor where
    it holds none: a key it lacks, or a value of another kind): the checkpoint is fine,
    the target is not, so ``restore()`` never falls back to an older checkpoint for
    it."""


class StorageError(CheckpointError, OSError):
    """A storage operation failed; ``errno`` and ``filename`` are kept from the cause."""

    def __init__(self, message: str, *, errno: int | None = None, path: str | None = None):
        CheckpointError.__init__(self, message)
        self.errno = errno
        self.filename = path
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # type: ignore[no-untyped-def,unused-ignore]
        # OSError keeps errno/filename in C slots, not in __dict__: pass them explicitly.
        return (_rebuild_storage, (type(self), str(self), self.errno, self.path))


def _rebuild_storage(cls, message, code, path):  # type: ignore[no-untyped-def,unused-ignore]
    return cls(message, errno=code, path=path)


class StorageFullError(StorageError):
    """No space left (ENOSPC) or quota exceeded (EDQUOT)."""


class StoragePermissionError(StorageError, PermissionError):
    """Permission denied, or the filesystem is read-only."""


class CommitError(CheckpointError):
    """The commit could not be completed; the previous checkpoints are untouched."""


class CoordinationTimeoutError(CheckpointError, TimeoutError):
    """Ranks did not arrive at a barrier within the timeout."""

    def __init__(self, message: str, *, missing_ranks: tuple[int, ...] = (), key: str = ""):
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)
        self.key = key


class CollectiveMismatchError(CheckpointError):
    """The ranks made different collective calls at the same point of the job (one
    saves while another restores, or one skipped a call under ``if rank == 0:``).

    ``calls`` maps a rank to the exchange it was in (e.g. ``"save step 10: write"``):
    every rank when the collecting rank saw the mismatch, two ranks when a rank found
    another's value in its place."""

    def __init__(self, message: str, *, calls: dict[int, str] | None = None):
        super().__init__(message)
        self.calls = dict(calls or {})


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: shipped to every rank inside the distributed error."""

    rank: int
    phase: str
    error_type: str
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank} in phase {self.phase!r}: {self.error_type}: {self.message}"


class DistributedCheckpointError(CheckpointError):
    """One or more ranks failed; every rank raises this same error.

    Attributes:
        failures: one :class:`RankFailure` per failing rank, ordered by rank.
        step: the step being saved (or loaded), when known.
        operation: ``"save"`` or ``"load"``: what failed, which decides what the
            message promises about the checkpoints on storage.
    """

    def __new__(cls, failures: Any = (), *args: Any, **kwargs: Any) -> DistributedCheckpointError:
        # A rank out of space makes the error a StorageFullError too, a target of
        # restore(into=) that does not match a StateMismatchError: `except
        # StorageFullError:` (or StateMismatchError) works with one rank and many alike.
        if cls is DistributedCheckpointError:
            kinds = {getattr(f, "error_type", None) for f in failures}
            cls = next((mixed for name, mixed in _MIXED if name in kinds), cls)
        return super().__new__(cls)

    def __init__(
        self,
        failures: list[RankFailure] | tuple[RankFailure, ...],
        *,
        step: int | None = None,
        operation: str = "save",
    ):
        self.failures = tuple(sorted(failures, key=lambda f: f.rank))
        self.step = step
        self.operation = operation
        what = f"checkpoint step {step}" if step is not None else "checkpoint operation"
        # A rank's message may end a sentence already: never "..".
        lines = "; ".join(str(f).rstrip().rstrip(".") for f in self.failures)
        if operation == "load":
            outcome = (
                f"loading {what} failed on {len(self.failures)} rank(s): {lines}. Nothing "
                "on storage was changed; the state being loaded into may be partly "
                "overwritten, so load again (another step, or a state matching the "
                "checkpoint) before training from it."
            )
        else:
            outcome = (
                f"{what} failed on {len(self.failures)} rank(s): {lines}. "
                "No partial checkpoint is visible; the previous checkpoints are intact."
            )
        super().__init__(outcome)
        self.args = (outcome,)  # OSError (the subclass below) sets them in __new__

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(f.rank for f in self.failures)


class DistributedStorageFullError(DistributedCheckpointError, StorageFullError):
    """A ``DistributedCheckpointError`` in which at least one rank ran out of space
    (ENOSPC, EDQUOT): raised on every rank, and caught by ``except StorageFullError``
    as the one-process error is. ``errno`` is the first such rank's (ENOSPC or
    EDQUOT); ``failures`` names each rank."""

    def __init__(
        self,
        failures: list[RankFailure] | tuple[RankFailure, ...],
        *,
        step: int | None = None,
        operation: str = "save",
    ):
        DistributedCheckpointError.__init__(self, failures, step=step, operation=operation)
        self.errno = _first_full_errno(self.failures)

    def __reduce__(self):  # type: ignore[no-untyped-def,unused-ignore]
        return (_rebuild_full, (type(self), self.args, dict(self.__dict__)))


class DistributedStateMismatchError(DistributedCheckpointError, StateMismatchError):
    """A ``DistributedCheckpointError`` in which at least one rank's ``restore(into=)``
    target did not match the checkpoint: raised on every rank, and caught by ``except
    StateMismatchError`` (or ``ValueError``) as the one-process error is."""


#: The failures that make a distributed error also the one-process error's type, in
#: order of precedence (``DistributedCheckpointError.__new__``).
_MIXED: tuple[tuple[str, type[DistributedCheckpointError]], ...] = (
    (StorageFullError.__name__, DistributedStorageFullError),
    (StateMismatchError.__name__, DistributedStateMismatchError),
)


def _rebuild_full(cls, args, state):  # type: ignore[no-untyped-def,unused-ignore]
    obj = _rebuild(cls, args, state)
    obj.errno = _first_full_errno(obj.failures)  # a C slot of OSError, not in the instance dict
    return obj


def _first_full_errno(failures: tuple[RankFailure, ...]) -> int:
    """The errno of the first rank out of space (EDQUOT or ENOSPC), as its message
    names it (``map_os_error``'s "(errno N)"); ENOSPC if it names none."""
    for f in failures:
        if f.error_type == StorageFullError.__name__:
            found = _re.search(r"\(errno (\d+)\)", f.message)
            if found and int(found.group(1)) in (_errno.ENOSPC, _errno.EDQUOT):
                return int(found.group(1))
    return _errno.ENOSPC


class SaveAbandonedError(CheckpointError):
    """An in-flight async save was given up (manager closed or interpreter exiting
    before it could finish); nothing of it was committed by this process."""


class LockError(CheckpointError):
    """Problems with the run lock on ROOT."""


class LockHeldError(LockError):
    """Another live job holds the run lock on ROOT."""


class FencedError(LockError):
    """This job's fencing token is stale: another job took over ROOT."""


class ResumeError(CheckpointError, ValueError):
    """Asked to resume, but no valid checkpoint was found.

    A ``ValueError`` too, as the Hugging Face Trainer's own "no valid checkpoint found"
    is, so code that catches that around ``train(resume_from_checkpoint=True)`` keeps
    working.

    Attributes:
        partial_steps: with node-local disks, the run's steps that some nodes hold and
            others lack (a node's disk replaced or wiped, or steps saved by the job
            when it ran on fewer nodes); empty otherwise.
    """

    def __init__(self, message: str, *, partial_steps: tuple[int, ...] = ()):
        super().__init__(message)
        self.partial_steps = tuple(partial_steps)


class ReadOnlyError(CheckpointError, PermissionError):
    """A write was attempted through a read-only manager."""


_FULL = {_errno.ENOSPC, getattr(_errno, "EDQUOT", -1)}
_PERM = {_errno.EACCES, _errno.EPERM, _errno.EROFS}


#: The actions of ``map_os_error`` that only read: a reader needs no write access.
_READING = ("read", "open", "list", "stat", "walk", "seek in", "examine")


def permission_advice(code: int, action: str, path: str) -> str:
    """What to do about a permission error of ``action`` on ``path``: for a read, read
    access (a reader never needs to write); for a read-only filesystem, remounting;
    for a write, the directory this user may not write in, with its owner and mode
    (in a group-shared root, the directory another user created)."""
    if code == _errno.EROFS:
        return (
            "The filesystem holding it is mounted read-only: remount it read-write to "
            "save, or open the root with read_only=True to restore from it (the "
            "command line's list, verify and inspect only read)."
        )
    if action.startswith(_READING) and action != "open for fsync":
        return (
            "This user may not read it: check its permissions and those of the "
            "directories above it (files written under another user's umask 077 are "
            "unreadable to others)."
        )
    from .storage.posix import owner_and_mode  # storage imports this module

    # A rename or link names both sides ("SRC -> DST"): either directory may be the
    # one this user may not write in (it was read as one directory "SRC -> DST/..").
    parents = []
    for side in path.split(" -> "):
        parent = side.rstrip("/").rpartition("/")[0] or "/"
        if parent not in parents:
            parents.append(parent)
    places = []
    for parent in parents:
        who = owner_and_mode(parent)
        places.append(f"{parent!r}{f' ({who})' if who else ''}")
    where = " or ".join(places)
    them = "it" if len(places) == 1 else "them"
    as_root = ""
    if _os.name == "posix" and _os.geteuid() == 0:
        # Root passes every permission bit of a local filesystem: the mode and owner
        # above rarely explain it.
        as_root = (
            " This process runs as root: look also for an immutable or append-only "
            "attribute (lsattr -d; chattr -i), a read-only bind mount, a security policy "
            "(SELinux, AppArmor), or a network filesystem that maps root to nobody."
        )
    return (
        f"This user may not write in {where}: make {them} writable by the job's user (a "
        "root shared by a group wants umask 002 and group-writable directories), or open "
        "the root with read_only=True to restore from it (the command line's list, "
        f"verify and inspect only read).{as_root}"
    )


def map_os_error(exc: OSError, action: str, path: str) -> StorageError:
    """Map an OSError raised by ``action`` on ``path`` to the project's error tree."""
    code = exc.errno
    reason = exc.strerror or str(exc) or type(exc).__name__
    if code is None:  # an fsspec driver's error without one (a read timeout)
        return StorageError(f"{action} {path!r} failed: {reason}", path=path)
    if code in _FULL:
        return StorageFullError(
            f"{action} {path!r} failed: {reason} (errno {code}). Free space (or inodes: "
            "`df -i`) on the checkpoint storage, then save again. In the running job: set "
            "mgr.retention to a lower policy and call mgr.apply_retention(). With the job "
            "stopped: `atomic-checkpoint prune ROOT --keep-last N` (it works on a full "
            "disk; beside a live job it needs --force, after which that job can no longer "
            "save and must be restarted).",
            errno=code,
            path=path,
        )
    if code in _PERM:
        return StoragePermissionError(
            f"{action} {path!r} failed: {reason} (errno {code}). "
            + permission_advice(code, action, path),
            errno=code,
            path=path,
        )
    return StorageError(f"{action} {path!r} failed: {reason} (errno {code})", errno=code, path=path)
