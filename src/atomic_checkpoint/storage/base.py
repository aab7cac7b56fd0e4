"""The ``Storage`` protocol: the few operations the commit protocol needs.

Paths are relative to the storage root and always ``/``-separated. Every method maps
backend errors to :mod:`atomic_checkpoint.errors` (``StorageError`` and subclasses);
no ``OSError`` escapes a backend. Unless stated otherwise a method may be called by any
rank, from any thread, and blocks until the operation is done.

Optional abilities are declared in ``StorageCapabilities``, never found by probing for
methods: ``direct_io`` says the backend is a :class:`DirectIOStorage` (O_DIRECT writers
for large state files; reach it through :func:`direct_io`).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from ..errors import (
    CorruptCheckpointError,
    StorageError,
    StorageFullError,
    UnsafeCheckpointError,
)

#: The most bytes :meth:`Storage.read_bytes` reads. Everything read whole (manifests,
#: the run file, lock and marker files) is untrusted input and far smaller; a larger
#: file is refused from its size before a byte is read, so a multi-GiB or sparse 10 TiB
#: "manifest" costs one ``fstat``, not the memory to hold it (DESIGN invariant 9).
MAX_READ_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class StorageCapabilities:
    """What a backend can do; the commit strategy is chosen from this.

    Attributes:
        name: short backend name for logs ("local", "sshfs", "s3", "memory", ...).
        atomic_dir_rename: renaming a directory is one atomic namespace change (POSIX
            filesystems). False for object stores and FUSE mounts whose rename is
            copy+delete (s3fs-fuse, gcsfuse): those use the marker strategy.
        dir_fsync: fsync of a directory makes entries durable. False on Windows, and a
            silent no-op on sshfs (still called: harmless).
        exclusive_create: creating a file fails if it exists, across every client.
        coherent: all clients see namespace changes at once. False on network
            filesystems, where readers poll with a bound after a change.
        direct_io: the backend implements :class:`DirectIOStorage`: large state files
            may be written, and read where the page cache does not hold them, with
            O_DIRECT. It declares that the methods exist, not that this root uses
            them: ``direct_io_enabled()`` says that (filesystem type, the backend's
            own setting). ``LocalStorage`` declares it on whatever capabilities it is
            given, and views of one (``ProjectStorage``) inherit it; object stores and
            ``MemoryStorage`` do not, and are never asked for a direct writer.
    """

    name: str
    atomic_dir_rename: bool = True
    dir_fsync: bool = True
    exclusive_create: bool = True
    coherent: bool = True
    direct_io: bool = False


class Reader(Protocol):
    """A file open for reading: ``readinto`` fills caller-owned buffers (no copies)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int | None: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any, /) -> Any: ...


@runtime_checkable
class Writer(Protocol):
    """A file being written. ``close()`` makes it durable (fsync); ``abort()`` discards."""

    def write(self, data: bytes | memoryview) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


_W = TypeVar("_W", bound="AbortOnError")


class AbortOnError:
    """What the backends' writers share: in a ``with`` block, ``close()`` (durable) when
    the block succeeds, ``abort()`` (nothing left behind) when it raises."""

    def close(self) -> None:
        raise NotImplementedError  # pragma: no cover - every writer overrides it

    def abort(self) -> None:
        raise NotImplementedError  # pragma: no cover - every writer overrides it

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@runtime_checkable
class Storage(Protocol):
    """Storage backend used by the commit protocol."""

    @property
    def capabilities(self) -> StorageCapabilities:
        """What the backend can do (read-only to the library: a property or a plain
        attribute)."""
        ...

    def url(self, path: str = "") -> str:
        """A human/tool-facing location for ``path`` (local path or URL)."""
        ...

    def local_path(self, path: str = "") -> str | None:
        """The OS path for ``path`` when the backend is a mounted filesystem, else None."""
        ...

    def makedirs(self, path: str) -> None:
        """Create ``path`` and parents; existing directories are fine. Idempotent."""
        ...

    def open_write(self, path: str, *, size_hint: int | None = None) -> Writer:
        """Create (truncate) ``path`` for writing. ``size_hint`` lets the backend
        reserve space up front, so a full disk fails before any data is written."""
        ...

    def open_read(self, path: str) -> Reader:
        """Open ``path`` for unbuffered binary reading (``readinto`` supported)."""
        ...

    def read_bytes(self, path: str) -> bytes:
        """Read a small file whole. Raises CheckpointNotFoundError if missing, and
        CorruptCheckpointError (see :func:`too_large`) for a file larger than
        ``MAX_READ_BYTES``, judged from its size before reading, without reading more
        than ``MAX_READ_BYTES + 1`` bytes should it grow meanwhile."""
        ...

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` atomically and durably (temp, fsync, rename,
        directory fsync): readers see the old or the new content, never a part."""
        ...

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` only if it does not exist. Returns False if it
        existed. Durable when True is returned."""
        ...

    def listdir(self, path: str) -> list[str]:
        """Names in directory ``path``; [] if it does not exist."""
        ...

    def size(self, path: str) -> int | None:
        """Size in bytes of file ``path``, or None if it does not exist."""
        ...

    def is_dir(self, path: str) -> bool: ...

    def walk_files(self, path: str) -> list[tuple[str, int]]:
        """Every file under ``path`` as (path relative to ``path``, size), sorted."""
        ...

    def fsync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable (best effort where the
        platform cannot, see ``capabilities.dir_fsync``)."""
        ...

    def delete_file(self, path: str) -> None:
        """Delete a file; a missing file is not an error."""
        ...

    def delete_tree(self, path: str) -> None:
        """Delete a directory tree; missing entries are not an error."""
        ...

    def refresh(self, path: str) -> None:
        """Drop cached metadata of directory ``path`` where a client caches it
        (network filesystems); a no-op elsewhere."""
        ...


#: What a Storage must have: the protocol's methods and its ``capabilities``.
_STORAGE_MEMBERS = (
    "capabilities",
    *(name for name, value in vars(Storage).items() if callable(value) and name[0] != "_"),
)


def looks_like_storage(obj: object) -> bool:
    """Whether ``obj`` was meant as a Storage (it has any of the protocol's members):
    :func:`check_storage` then says what it lacks, rather than a generic type error."""
    return any(hasattr(obj, name) for name in _STORAGE_MEMBERS)


def check_storage(obj: object) -> Storage:
    """``obj`` as a Storage, or ``TypeError`` naming every member of the protocol it
    lacks (or a ``capabilities`` that is not a :class:`StorageCapabilities`). Checked
    when a storage is handed in, not at its first save: a missing ``fsync_dir`` found
    at the commit of that save fails it half way, after its files are written."""
    missing = [
        name
        for name in _STORAGE_MEMBERS
        if not hasattr(obj, name) or (name != "capabilities" and not callable(getattr(obj, name)))
    ]
    kind = type(obj).__name__
    if missing:
        raise TypeError(
            f"{kind} is not a Storage: it lacks {', '.join(missing)} (the Storage protocol "
            "of atomic_checkpoint.storage; subclassing LocalStorage or MemoryStorage gives "
            "every method)"
        )
    caps = obj.capabilities  # type: ignore[attr-defined]
    if not isinstance(caps, StorageCapabilities):
        raise TypeError(
            f"{kind}.capabilities must be a StorageCapabilities (what the backend can do: "
            f"atomic rename, directory fsync, ...), got {type(caps).__name__}"
        )
    return cast(Storage, obj)


@runtime_checkable
class RenamingStorage(Storage, Protocol):
    """A storage whose directories can be renamed: mounted filesystems (local disks,
    NFS, sshfs, FUSE mounts). What the rename strategy, overwrite's swap and the
    replaced-copy recovery need. Object stores (``FsspecStorage``) have no directory
    rename (moving a prefix copies every object, then deletes it, and can stop half
    way) and are not ``RenamingStorage``: their checkpoints commit with the marker
    strategy, which never renames."""

    def rename_dir(self, src: str, dst: str) -> None:
        """Rename directory ``src`` to ``dst`` in one namespace change where the
        filesystem can (``capabilities.atomic_dir_rename``); fails with
        CheckpointExistsError if ``dst`` exists (never replaces it)."""
        ...

    def exchange_dirs(self, a: str, b: str) -> bool:
        """Atomically swap two directories if the backend can; False if it cannot."""
        ...


def _implements(obj: object, protocol: type) -> bool:
    """``isinstance(obj, protocol)`` for a runtime-checkable protocol, remembered per
    class: the check walks every member of the protocol (about 0.07 ms in CPython
    3.11), and the commit path asks it several times per save. The protocols checked
    here are methods, which a class defines, and ``capabilities``, which every instance
    of a backend class has, so the answer is the class's."""
    key = (type(obj), protocol)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = isinstance(obj, protocol)
    return known


_IMPLEMENTS: dict[tuple[type, type], bool] = {}


#: Free bytes under which a write's failure is taken for the full disk it likely was.
NEARLY_FULL_BYTES = 1 << 20


def free_bytes(path: str) -> int | None:
    """Bytes free to this user on the filesystem of ``path`` (its nearest existing
    parent), or None if that cannot be told."""
    while True:
        try:
            st = os.statvfs(path)
            return st.f_bavail * st.f_frsize
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if not parent or parent == path:
                return None
            path = parent
        except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
            return None


def full_storage_error(storage: Storage, exc: BaseException) -> StorageFullError | None:
    """Where a write into ``storage`` failed because its filesystem is full, the error
    that says so, else None. The frameworks' writers report a full disk in their own
    words, without ENOSPC (``torch.save``: "[enforce fail at inline_container.cc] .
    unexpected pos ..."). ``exc`` counts as the full disk when it is ENOSPC/EDQUOT, or
    when the filesystem has under ``NEARLY_FULL_BYTES`` free now (mounted storages; an
    object store is never full). Its ``__cause__`` is ``exc``: callers report
    ``full_storage_error(storage, exc) or exc``. Called by whoever reports a failed
    write, once."""
    if isinstance(exc, StorageFullError):
        return None  # already ours, with its advice
    if not isinstance(exc, Exception) and not isinstance(getattr(exc, "failures", None), dict):
        # An interruption is not a write's. DCP's CheckpointException derives from
        # BaseException only, and carries the ranks' errors in ``failures``.
        return None
    code = _full_errno(exc)
    local = storage.local_path("")
    if code not in (errno.ENOSPC, errno.EDQUOT):
        free = None if local is None else free_bytes(local)
        if free is None or free >= NEARLY_FULL_BYTES:
            return None
        code = errno.ENOSPC
    root = storage.url("")
    full = StorageFullError(
        f"a write into {root} failed because its filesystem is full ({type(exc).__name__}: "
        f"{str(exc)[:300]}). Nothing was committed and the checkpoints already there are "
        f"intact. Free space (`atomic-checkpoint prune {root} --keep-last N` works on a "
        "full disk, or delete other files), then save again",
        errno=code,
        path=local or root,
    )
    full.__cause__ = exc
    return full


def _full_errno(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT where ``exc`` or what it wraps says so (its causes, and the
    per-rank failures of DCP's ``CheckpointException``, ``{rank: (error, trace)}``),
    else ``exc``'s own errno. A bounded walk: each exception once."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo and len(seen) < 64:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        code = getattr(e, "errno", None)
        if code in (errno.ENOSPC, errno.EDQUOT):
            return int(code)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) and v else v for v in failures.values()]
    own = getattr(exc, "errno", None)
    return own if isinstance(own, int) else None


def renaming(storage: Storage) -> RenamingStorage:
    """``storage`` as a :class:`RenamingStorage`, or ``StorageError`` (ENOTSUP) saying
    that it has no directory rename."""
    if _implements(storage, RenamingStorage):
        return cast(RenamingStorage, storage)
    raise StorageError(
        f"cannot rename directories in {storage.url('')!r}: {storage.capabilities.name} has no "
        "atomic directory rename (moving a prefix copies every object, then deletes it, "
        "and can stop half way). Checkpoints here are committed with the marker strategy, "
        "which never renames",
        errno=errno.ENOTSUP,
        path=storage.url(""),
    )


#: Address, length and file offset of every O_DIRECT write are multiples of this: the
#: page size, a multiple of every logical block size up to 4 KiB.
DIRECT_IO_ALIGN = 4096


class Done(Protocol):
    """Set once a submitted write's buffer may be reused (``threading.Event`` has it)."""

    def wait(self, timeout: float | None = None) -> bool: ...

    def is_set(self) -> bool: ...


class DirectWriter(Protocol):
    """One file being written with O_DIRECT from block-aligned memory, several writes in
    flight. One thread calls every method; ``close`` makes the file durable (fsync),
    ``abort`` discards it."""

    def submit(self, view: memoryview, offset: int) -> Done:
        """Queue a write of ``view`` at ``offset`` (address, length and offset multiples
        of ``DIRECT_IO_ALIGN``; the file's last block may be padded, ``close`` cuts it).
        Returns an event set once ``view`` may be reused; raises the error of an earlier
        write, if one failed."""
        ...

    def drain(self) -> None:
        """Wait until every queued write is done; raise the first failure."""
        ...

    def close(self, size_bytes: int) -> None:
        """Wait for the writes, cut the file to ``size_bytes``, fsync, close."""
        ...

    def abort(self) -> None:
        """Skip queued writes and remove the file. Idempotent."""
        ...


@runtime_checkable
class DirectIOStorage(Storage, Protocol):
    """A storage that offers O_DIRECT I/O of large files: one whose
    ``capabilities.direct_io`` is True and that implements this protocol. Callers reach
    it through :func:`direct_io`, never by probing for the methods."""

    def direct_io_enabled(self) -> bool:
        """Whether large state files are written, and read where the page cache does
        not hold them, with O_DIRECT on this root. Called by every rank that saves or
        restores, from the thread that does; cheap after the first call."""
        ...

    def open_write_direct(self, path: str, *, size_hint: int | None = None) -> DirectWriter | None:
        """Open ``path`` for O_DIRECT writes, or return None where this root should not
        get them (``direct_io_enabled()`` is False, or the filesystem refused O_DIRECT:
        the caller writes through ``open_write`` instead). Called by the rank that
        writes a large state file, from the thread that saves. ``size_hint`` reserves
        the space up front, as in ``open_write``."""
        ...


def direct_io(storage: Storage) -> DirectIOStorage | None:
    """``storage`` as a :class:`DirectIOStorage` where its capabilities declare one
    and it implements the protocol, else None: a user's wrapper that copied
    ``LocalStorage``'s capabilities but not its direct-I/O methods is written and read
    without O_DIRECT (it failed with an AttributeError at its first large save or
    restore)."""
    if not storage.capabilities.direct_io or not _implements(storage, DirectIOStorage):
        return None
    return cast(DirectIOStorage, storage)


def too_large(where: str, size_bytes: int | None) -> CorruptCheckpointError:
    """The error of a ``read_bytes`` refused by size (``None``: it grew while read)."""
    size = "more than that" if size_bytes is None else f"{size_bytes} bytes"
    return CorruptCheckpointError(
        f"{where} is {size}: atomic-checkpoint reads at most {MAX_READ_BYTES} bytes of a "
        "manifest, run, lock or marker file, so this is not one of ours (or is corrupt); "
        "refusing to read it"
    )


def check_no_links(root: str, rel: str, *, final: bool = True) -> str:
    """The OS path of ``rel`` below ``root``, after checking that no entry on the way
    below ``root`` (and, with ``final``, not ``rel`` itself) is a symbolic link.

    DESIGN invariant 9: nothing outside ROOT is read, written or deleted through
    links that ROOT holds (``ROOT/checkpoint-9 -> /other/root/checkpoint-9`` would
    otherwise be restored from, and deleted through, by retention). ``root`` itself
    may be a link: the user chose it. Checked with ``lstat`` (one per component,
    served from the attribute cache on network filesystems); the first component
    that does not exist ends the check, the operation itself then reports it.

    Raises:
        UnsafeCheckpointError: naming the link and where it points.
    """
    parts = [p for p in parts_inside(root, rel) if p]
    path = root
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        if i == len(parts) - 1 and not final:
            break
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            break  # missing (or unreadable): the operation says so
        if stat.S_ISLNK(mode):
            raise linked(path)
    return os.path.join(root, *parts) if parts else root


def parts_inside(root: str, rel: str) -> list[str]:
    """The components of ``rel``, a path relative to ``root``; ``UnsafeCheckpointError``
    for one that climbs out through ``..`` (``read_bytes("../../etc/hostname")`` read
    outside the root; an object store's keys have no ``..``)."""
    parts = rel.split("/")
    if ".." in parts:
        raise UnsafeCheckpointError(
            f"storage path {rel!r} leaves {root} through '..': paths are relative to the "
            "root and stay inside it"
        )
    return parts


def linked(path: str) -> UnsafeCheckpointError:
    """The error for a symbolic link met inside a checkpoint root."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return UnsafeCheckpointError(
        f"{path} is a symbolic link (to {target}): atomic-checkpoint never follows links "
        "inside a checkpoint root, so nothing outside the root is read, written or deleted "
        "through them; it is left alone. Replace the link by the real directory or file "
        "(cp -rL or rsync -L copy what links point to)"
    )


_R = TypeVar("_R")


def answer_within(
    seconds: float,
    what: str,
    call: Callable[[], _R],
    late: Callable[[], Exception] | None = None,
) -> _R:
    """``call()``'s result (or its exception), or ``StorageError`` (``late()`` if
    given) if it has not returned within ``seconds``: for a storage call that may never
    answer (an endpoint that accepts connections and stays silent, whose client retries
    for minutes). The call goes on in a daemon thread and what it returns later is
    dropped, so only reads, or writes that are safe to finish unobserved, go through
    here."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))

    worker = threading.Thread(target=run, name="atomic-checkpoint-bounded", daemon=True)
    worker.start()
    worker.join(max(seconds, 0.0))
    if not box:
        # A deadline already passed gives no time at all: said as such, not "-0.0009 s".
        within = f"within {seconds:g} s" if seconds > 0 else "within the time left (none)"
        raise late() if late else StorageError(f"{what} did not answer {within}")
    ok, value = box[0]
    if ok:
        return cast(_R, value)
    raise value
