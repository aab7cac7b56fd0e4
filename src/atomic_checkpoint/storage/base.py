"""The ``Storage`` protocol: the few operations the commit protocol needs.

Paths are relative to the storage root and always ``/``-separated. Every method maps
backend errors to :mod:`atomic_checkpoint.errors` (``StorageError`` and subclasses);
no ``OSError`` escapes a backend. Unless stated otherwise a method may be called by any
rank, from any thread, and blocks until the operation is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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
    """

    name: str
    atomic_dir_rename: bool = True
    dir_fsync: bool = True
    exclusive_create: bool = True
    coherent: bool = True


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


@runtime_checkable
class Storage(Protocol):
    """Storage backend used by the commit protocol."""

    capabilities: StorageCapabilities

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
        """Read a small file whole. Raises CheckpointNotFoundError if missing."""
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

    def rename_dir(self, src: str, dst: str) -> None:
        """Rename directory ``src`` to ``dst`` atomically; fails with
        CheckpointExistsError if ``dst`` exists (never replaces it)."""
        ...

    def exchange_dirs(self, a: str, b: str) -> bool:
        """Atomically swap two directories if the backend can; False if it cannot."""
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
