"""``LocalStorage``: POSIX filesystems (ext4, xfs, tmpfs, NFS, sshfs, Lustre) and Windows.

Durability discipline (DESIGN invariant 2): a file is written, fsync'd through the
writable descriptor that wrote it, closed; its directory is fsync'd; a rename is
followed by an fsync of the parent of the new name.

Filesystem behaviours handled here, each learned on a real system:

- ``os.rename`` of a directory onto an existing *empty* directory silently replaces it
  on POSIX. Commits must never replace, so on Linux we use ``renameat2(RENAME_NOREPLACE)``
  and fall back to rename-with-check where the filesystem refuses the flag (sshfs gives
  EINVAL for any renameat2 flag).
- "Target exists" arrives as ENOTEMPTY or EEXIST on ext4, EEXIST on XFS, and EPERM on
  sshfs; the latter is disambiguated by looking at the target.
- fsync of a directory is a silent no-op on sshfs, and impossible on Windows (a
  directory cannot be opened for fsync there: transformers#28637 crashed on exactly that).
  On Windows we skip directory fsync and rely on NTFS metadata journaling.
- Windows: ``os.replace`` for files; renames and deletes retry briefly on sharing
  violations (a virus scanner or indexer holding a handle: winerror 5 and 32).
- A single large ``os.write`` on a full disk is a *short write*, not an exception; the
  next write raises ENOSPC. The write loop therefore continues until every byte is
  written or an error is raised. Space is reserved up front with ``posix_fallocate``
  when the size is known, so a full disk fails before any data is written.
- Files get the permissions of the umask (0o666 & ~umask), never a temp file's 0o600
  (FAILURE_MODES D7).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import CheckpointExistsError, CheckpointNotFoundError, StorageError, map_os_error
from .base import Reader, StorageCapabilities

_IS_WINDOWS = os.name == "nt"
_T = TypeVar("_T")
_WRITE_CHUNK = 256 << 20  # stay below the 2 GiB single-write limit of Linux and macOS

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _load_renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return,unused-ignore]


_renameat2 = _load_renameat2()


def _retry_windows(fn: Callable[[], _T], attempts: int = 8) -> _T:
    """Retry ``fn`` on Windows sharing violations; elsewhere call it once."""
    if not _IS_WINDOWS:
        return fn()
    delay = 0.01
    for i in range(attempts):
        try:
            return fn()
        except PermissionError as exc:
            if getattr(exc, "winerror", None) not in (5, 32) or i == attempts - 1:
                raise
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


class _LocalWriter:
    """Writes through one descriptor; ``close()`` fsyncs it before closing."""

    def __init__(self, storage: LocalStorage, rel: str, size_hint: int | None):
        self._storage = storage
        self._rel = rel
        self._path = storage._abs(rel)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
        try:
            self._fd: int | None = os.open(self._path, flags, 0o666)
        except OSError as exc:
            raise map_os_error(exc, "create", self._path) from exc
        if size_hint and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(self._fd, 0, size_hint)
            except OSError as exc:
                # EOPNOTSUPP/EINVAL: the filesystem cannot reserve (sshfs, some FUSE);
                # the write loop still catches ENOSPC.
                if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
                    self.abort()
                    raise map_os_error(exc, "reserve space for", self._path) from exc

    def write(self, data: bytes | memoryview) -> None:
        fd = self._fd
        if fd is None:
            raise StorageError(f"write to closed file {self._path!r}", path=self._path)
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        try:
            while view:
                n = os.write(fd, view[:_WRITE_CHUNK])
                if n <= 0:  # pragma: no cover - POSIX raises instead of returning 0
                    raise OSError(errno.ENOSPC, "short write", self._path)
                view = view[n:]
        except OSError as exc:
            raise map_os_error(exc, "write", self._path) from exc

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # fsync through the writable descriptor: on Windows a read-only handle
            # cannot be flushed, and on NFS close() alone does not make data durable.
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise map_os_error(exc, "fsync", self._path) from exc
        try:
            os.close(fd)
        except OSError as exc:
            # NFS and FUSE can report deferred write errors (ENOSPC, EIO) only at close.
            raise map_os_error(exc, "close", self._path) from exc

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self._path)

    def __enter__(self) -> _LocalWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class LocalStorage:
    """Storage on a mounted filesystem rooted at ``root`` (an OS path)."""

    def __init__(
        self, root: str | os.PathLike[str], *, capabilities: StorageCapabilities | None = None
    ):
        self.root = os.path.abspath(os.fspath(root))
        self.capabilities = capabilities or StorageCapabilities(
            name="local", dir_fsync=not _IS_WINDOWS
        )

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r}, {self.capabilities.name})"

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def url(self, path: str = "") -> str:
        return self._abs(path)

    def local_path(self, path: str = "") -> str | None:
        return self._abs(path)

    def makedirs(self, path: str) -> None:
        p = self._abs(path)
        try:
            os.makedirs(p, exist_ok=True)
        except FileExistsError as exc:
            raise StorageError(
                f"cannot create directory {p!r}: a file with that name exists",
                errno=exc.errno,
                path=p,
            ) from exc
        except OSError as exc:
            # Shared filesystems: another client may create the same directory between
            # our check and our mkdir (FAILURE_MODES D8); exist_ok covers EEXIST, sshfs
            # reports the lost race as EPERM.
            if os.path.isdir(p):
                return
            raise map_os_error(exc, "create directory", p) from exc

    def open_write(self, path: str, *, size_hint: int | None = None) -> _LocalWriter:
        return _LocalWriter(self, path, size_hint)

    def open_read(self, path: str) -> Reader:
        p = self._abs(path)
        try:
            return open(p, "rb", buffering=0)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{p!r} does not exist") from exc
        except OSError as exc:
            raise map_os_error(exc, "open", p) from exc

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            try:
                return f.read()
            except OSError as exc:
                raise map_os_error(exc, "read", self._abs(path)) from exc

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        final = self._abs(path)
        tmp = f"{final}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        w = _LocalWriter(self, os.path.relpath(tmp, self.root).replace(os.sep, "/"), None)
        try:
            w.write(data)
            w.close()
            # A reader on another NFS/sshfs client can open a file after it is created and
            # before it is written: publish by rename, never by writing in place.
            _retry_windows(lambda: os.replace(tmp, final))
        except BaseException:
            w.abort()
            raise
        self.fsync_dir(os.path.dirname(path.rstrip("/")) if "/" in path else "")

    def create_exclusive(self, path: str, data: bytes) -> bool:
        p = self._abs(path)
        try:
            fd = os.open(
                p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666
            )
        except FileExistsError:
            return False
        except PermissionError as exc:
            # sshfs: the loser of an O_EXCL race often gets EPERM, not EEXIST.
            if os.path.lexists(p):
                return False
            raise map_os_error(exc, "create", p) from exc
        except OSError as exc:
            raise map_os_error(exc, "create", p) from exc
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(p)
            raise map_os_error(exc, "write", p) from exc
        os.close(fd)
        self.fsync_dir(path.rsplit("/", 1)[0] if "/" in path else "")
        return True

    def listdir(self, path: str) -> list[str]:
        p = self._abs(path)
        try:
            return sorted(os.listdir(p))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise map_os_error(exc, "list", p) from exc

    def size(self, path: str) -> int | None:
        p = self._abs(path)
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise map_os_error(exc, "stat", p) from exc
        return st.st_size

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self._abs(path))

    def walk_files(self, path: str) -> list[tuple[str, int]]:
        base = self._abs(path)
        out: list[tuple[str, int]] = []
        try:
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    full = os.path.join(dirpath, name)
                    rel = os.path.relpath(full, base).replace(os.sep, "/")
                    out.append((rel, os.stat(full).st_size))
        except OSError as exc:
            raise map_os_error(exc, "walk", base) from exc
        return sorted(out)

    def rename_dir(self, src: str, dst: str) -> None:
        s, d = self._abs(src), self._abs(dst)
        if _renameat2 is not None:
            rc = _renameat2(_AT_FDCWD, os.fsencode(s), _AT_FDCWD, os.fsencode(d), _RENAME_NOREPLACE)
            if rc == 0:
                return
            code = ctypes.get_errno()
            if code == errno.EEXIST:
                raise CheckpointExistsError(f"{d!r} already exists")
            if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise map_os_error(OSError(code, os.strerror(code), s), "rename", f"{s} -> {d}")
            # EINVAL: this filesystem (sshfs, some FUSE/NFS) refuses renameat2 flags.
        if os.path.lexists(d):
            raise CheckpointExistsError(f"{d!r} already exists")
        try:
            _retry_windows(lambda: os.rename(s, d))
        except OSError as exc:
            # ENOTEMPTY/EEXIST (ext4, XFS) or EPERM (sshfs): someone created dst after
            # our check. Never treat it as success.
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) or (
                exc.errno == errno.EPERM and os.path.lexists(d)
            ):
                raise CheckpointExistsError(f"{d!r} already exists") from exc
            raise map_os_error(exc, "rename", f"{s} -> {d}") from exc

    def exchange_dirs(self, a: str, b: str) -> bool:
        if _renameat2 is None:
            return False
        pa, pb = self._abs(a), self._abs(b)
        rc = _renameat2(_AT_FDCWD, os.fsencode(pa), _AT_FDCWD, os.fsencode(pb), _RENAME_EXCHANGE)
        if rc == 0:
            return True
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            return False
        raise map_os_error(OSError(code, os.strerror(code)), "exchange", f"{pa} <-> {pb}")

    def fsync_dir(self, path: str) -> None:
        if not self.capabilities.dir_fsync:
            return
        p = self._abs(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise map_os_error(exc, "open directory", p) from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            # EINVAL: the filesystem does not support directory fsync (some FUSE); the
            # entries are as durable as that filesystem makes them.
            if exc.errno != errno.EINVAL:
                raise map_os_error(exc, "fsync directory", p) from exc
        finally:
            os.close(fd)

    def delete_file(self, path: str) -> None:
        p = self._abs(path)
        try:
            _retry_windows(lambda: os.unlink(p))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise map_os_error(exc, "delete", p) from exc

    def delete_tree(self, path: str) -> None:
        p = self._abs(path)
        errors: list[OSError] = []

        def onerror(_fn: object, failed: str, info: object) -> None:
            exc = info[1] if isinstance(info, tuple) else info
            # Deletes tolerate ENOENT: a concurrent cleaner or a network filesystem's
            # stale listing can make entries disappear under us.
            if isinstance(exc, FileNotFoundError):
                return
            if isinstance(exc, OSError):
                errors.append(exc)

        if sys.version_info >= (3, 12):
            _retry_windows(lambda: shutil.rmtree(p, onexc=onerror))
        else:
            _retry_windows(lambda: shutil.rmtree(p, onerror=onerror))
        if errors and os.path.lexists(p):
            raise map_os_error(errors[0], "delete", p) from errors[0]

    def refresh(self, path: str) -> None:
        # sshfs/FUSE: any metadata write through a mount drops its cached listing of
        # that directory, so a stale listing taken before another node's commit is
        # renewed. utime on the directory is the cheapest such write.
        if self.capabilities.coherent:
            return
        with contextlib.suppress(OSError):
            os.utime(self._abs(path))
