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
  written or an error is raised. Space is reserved up front with ``fallocate(2)`` when
  the size is known, so a full disk fails before any data is written. Not glibc's
  ``posix_fallocate``: where the filesystem cannot reserve (FUSE: s3fs, sshfs) it falls
  back to writing a byte into every 4 KiB block, which through s3fs took 5.6 s for
  16 MiB; the system call just says EOPNOTSUPP and we skip the reservation.
- Files get the permissions of the umask (0o666 & ~umask), never a temp file's 0o600
  (FAILURE_MODES D7).
- Symbolic links below ROOT are never followed (DESIGN invariant 9): every operation
  checks with ``lstat`` that no directory on its way below ROOT is a link, opens files
  with ``O_NOFOLLOW``, lists a linked directory as empty and refuses to delete a tree
  that is a link. ``ROOT/checkpoint-9 -> /other/root/checkpoint-9`` would otherwise be
  restored from, and deleted through (the marker strategy removed the other root's
  manifest and data). ROOT itself may be a link: the user chose it.
- ``read_bytes`` (manifests, run, lock and marker files: untrusted) refuses a file
  larger than ``MAX_READ_BYTES`` from its ``fstat`` size, before reading a byte.

Network filesystems (sshfs, NFS, SMB, ...: ``capabilities.coherent`` is False, read from
the mount table by :mod:`.detect` when no capabilities are given). Each client serves
names and attributes from its own cache, so another client's change shows up late
(FAILURE_MODES D1); measured on sshfs with default caching:

- A directory listing stays stale for ~20 s. Any metadata write through the mount on
  *that* directory drops it (refreshing ROOT does not refresh a subdirectory), so
  ``listdir`` first touches the directory's times (``refresh``) and lists what the
  server has.
- A name deleted or renamed away through another client keeps passing ``stat()`` here
  for ~20 s, and no refresh drops that; ``open()`` always asks the server. Even
  ``renameat2(RENAME_NOREPLACE)`` fails with EEXIST there, answered by the kernel from
  that cached entry. Existence decisions are therefore made from a refreshed listing of
  the parent, and "is it committed?" (``catalog``) by opening the manifest.
- A path that was deleted and re-created elsewhere keeps its old size here until a
  metadata write on the path itself (``refresh(path)``).
- The loser of an ``O_EXCL`` or ``mkdir`` race gets EPERM, and rename onto a non-empty
  directory gives EPERM too (ext4 gives EEXIST/ENOTEMPTY, XFS EEXIST).
- Directory fsync succeeds and syncs nothing: ``dir_fsync`` is False there, so it is
  skipped; the names are as durable as the server's filesystem makes them.
- The mount can vanish under a running job: when its ssh transport dies, sshfs exits
  and unmounts itself, and the mount point becomes the empty local directory beneath,
  where later writes would silently land. The device of ROOT is recorded at open and
  checked before every write, namespace change, listing and read: a change raises a
  ``StorageError`` instead (the same export mounted again at the same place is fine).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import logging
import os
import queue
import re
import shutil
import stat
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from .._faults import fault_point
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    map_os_error,
)
from . import base
from .detect import local_capabilities, mount_of
from .posix import close_quietly, fsync_directory, write_error
from .temps import temp_name

log = logging.getLogger("atomic_checkpoint")

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


def _load_fallocate() -> Callable[..., int] | None:
    """The ``fallocate(2)`` system call (Linux), without glibc's slow emulation."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return,unused-ignore]


_fallocate = _load_fallocate()
_FALLOC_FL_KEEP_SIZE = 1


def _reserve(fd: int, size_hint: int | None, path: str, abort: Callable[[], None]) -> None:
    """Reserve ``size_hint`` bytes for the new file ``fd`` before writing it, so a full
    disk fails at open (``abort`` is called first, then StorageError) instead of after
    gigabytes were written.

    KEEP_SIZE: the blocks are reserved without changing the file's size, so a short
    write can never leave a file longer than what was written. EOPNOTSUPP, EINVAL and
    ENOSYS (FUSE, NFSv3: the filesystem cannot reserve) are ignored; the write loop
    still catches ENOSPC.
    """
    if not size_hint or _fallocate is None:
        return
    if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, size_hint) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        abort()
        reserve_error = OSError(code, os.strerror(code), path)
        raise map_os_error(reserve_error, "reserve space for", path) from None


def _replace(src: str, dst: str) -> None:
    """``os.replace`` of one file onto another, errors mapped. Windows: a virus scanner
    or indexer holding the old file open fails the replace for a moment (winerror 5 or
    32); retried."""
    try:
        _retry_windows(lambda: os.replace(src, dst))
    except OSError as exc:
        raise map_os_error(exc, "rename", f"{src} -> {dst}") from exc


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


class _LocalReader:
    """An unbuffered file whose read errors arrive as ``StorageError`` (with errno and
    path) like every other storage error: a failing disk, or a network filesystem
    whose server went away, fails ``read`` with EIO/ESTALE after a successful open."""

    def __init__(self, f: io.FileIO, path: str):
        self._f = f
        self._path = path

    def read(self, size: int = -1, /) -> bytes:
        try:
            return self._f.readall() if size is None or size < 0 else self._f.read(size) or b""
        except OSError as exc:
            raise self._read_error(exc) from exc

    def readinto(self, buffer: Any, /) -> int | None:
        try:
            return self._f.readinto(buffer)
        except OSError as exc:
            raise self._read_error(exc) from exc

    def _read_error(self, exc: OSError) -> CheckpointError:
        if exc.errno == errno.ENOENT:
            # s3fs-fuse reads an object at the first read, not at open: one deleted in
            # between (another node's retention) is gone, as if the open had missed it.
            return CheckpointNotFoundError(f"{self._path!r} was removed while being read")
        return map_os_error(exc, "read", self._path)

    def seek(self, offset: int, whence: int = 0, /) -> int:
        try:
            return self._f.seek(offset, whence)
        except OSError as exc:
            raise map_os_error(exc, "seek in", self._path) from exc

    def tell(self) -> int:
        try:
            return self._f.tell()
        except OSError as exc:
            raise map_os_error(exc, "seek in", self._path) from exc

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        # A FUSE mount whose server went away fails the close too (sshfs: ENOTCONN),
        # after the read that failed first.
        try:
            self._f.close()
        except OSError as exc:
            raise map_os_error(exc, "close", self._path) from exc

    @property
    def closed(self) -> bool:
        return self._f.closed

    def __getattr__(self, name: str) -> Any:
        # Anything else a file-like consumer asks for (readable, name, ...) is the file's.
        return getattr(self._f, name)

    def __enter__(self) -> _LocalReader:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # Leaving on an error (a read that failed): that error is the one to raise, not
        # the close's that followed from the same cause (it replaced a StorageError
        # naming the file with a bare OSError).
        try:
            self._f.close()
        except OSError as close_exc:
            log.debug("closing %s after an error also failed: %s", self._path, close_exc)


class _LocalWriter(base.AbortOnError):
    """Writes through one descriptor; ``close()`` fsyncs it before closing."""

    def __init__(self, storage: LocalStorage, rel: str, size_hint: int | None):
        self._storage = storage
        self._rel = rel
        self._path = storage._abs(rel)
        # O_NOFOLLOW: a link planted under the file's name is never written through.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0) | _NOFOLLOW
        try:
            self._fd: int | None = os.open(self._path, flags, 0o666)
        except OSError as exc:
            raise _open_error(exc, "create", self._path) from exc
        try:
            _reserve(self._fd, size_hint, self._path, self.abort)
        except BaseException:  # KeyboardInterrupt in fallocate: no descriptor left open
            self.abort()
            raise

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
            raise write_error(exc, "write", self._path) from exc

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _sync_and_close(fd, self._path)

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        _discard(fd, self._path)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _sync_and_close(fd: int, path: str, before: Callable[[int], None] | None = None) -> None:
    """``before(fd)`` (if given), fsync and close a file written through ``fd``; the
    descriptor is closed whatever is raised. fsync goes through the writable descriptor:
    on Windows a read-only handle cannot be flushed, and on NFS close() alone does not
    make data durable."""
    try:
        if before is not None:
            before(fd)
        os.fsync(fd)
    except OSError as exc:
        close_quietly(fd)
        raise write_error(exc, "fsync", path) from exc
    except BaseException:
        # KeyboardInterrupt during the fsync: the descriptor of a file that is about to
        # be deleted kept its blocks in use until the process ended.
        close_quietly(fd)
        raise
    try:
        os.close(fd)
    except OSError as exc:
        # NFS and FUSE can report deferred write errors (ENOSPC, EIO) only at close.
        raise write_error(exc, "close", path) from exc


def _discard(fd: int | None, path: str) -> None:
    """Close ``fd`` (if open) and remove the partial file ``path``; best effort, as an
    abort runs on a path that is failing already."""
    if fd is not None:
        close_quietly(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _lstat(p: str) -> os.stat_result | None:
    """``os.lstat(p)``, or None if ``p`` (or a directory on its way) is missing."""
    try:
        return os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise map_os_error(exc, "stat", p) from exc


def _open_error(exc: OSError, action: str, path: str) -> CheckpointError:
    """Map a failed ``open``; ELOOP from ``O_NOFOLLOW`` means ``path`` is a link."""
    if exc.errno == errno.ELOOP and os.path.islink(path):
        return base.linked(path)
    return map_os_error(exc, action, path)


def _device_of(path: str) -> int:
    """``st_dev`` of ``path``, or of its nearest existing ancestor: a root that does not
    exist yet will be created on its parent's filesystem."""
    p = path
    for _ in range(p.count(os.sep) + 2):
        try:
            # "<dir>/." walks into the directory, so an automount point is mounted
            # first and its real filesystem is the one recorded.
            return os.stat(os.path.join(p, ".")).st_dev
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(p)
            if parent == p:
                raise
            p = parent
    return os.stat(p).st_dev  # pragma: no cover - the loop reaches the top first


def _format_device(dev: int) -> str:
    if hasattr(os, "major"):
        return f"{os.major(dev)}:{os.minor(dev)}"
    return str(dev)  # pragma: no cover - Windows: a volume serial number


#: Filesystems on block devices whose O_DIRECT path is solid: a large aligned write goes
#: from the caller's memory to the device by DMA, skipping the copy into the page cache
#: (measured here on ext4/virtio, 1 GiB: 0.28 s and 0.01 s of CPU, against 0.6-0.7 s and
#: 0.25 s through the page cache). Network and FUSE filesystems, tmpfs and overlayfs
#: keep buffered writes: their O_DIRECT semantics vary, or they refuse it.
_DIRECT_IO_FS = frozenset({"ext4", "xfs", "btrfs", "f2fs"})


class _DirectWriter:
    """Writes one file with O_DIRECT from block-aligned memory, ``depth`` writes in flight
    (the :class:`.base.DirectWriter` of ``LocalStorage``).

    ``submit(view, offset)`` queues a write of ``view`` at ``offset`` (address, length
    and offset multiples of ``base.DIRECT_IO_ALIGN``; the last block of the file may be
    padded, ``close`` cuts it) and returns an event set once ``view`` may be reused.
    The writes run in ``depth`` I/O threads, so the device always has a request queued:
    one synchronous O_DIRECT write at a time leaves it idle between requests (measured:
    0.43 s per GiB with one, 0.33 s with two). ``close(size_bytes)`` waits for every
    write, truncates the padding, fsyncs and closes. One thread calls ``submit`` and
    ``close``; the I/O threads inherit its CPU priority.
    """

    def __init__(self, storage: LocalStorage, rel: str, size_hint: int | None, depth: int = 2):
        self._path = storage._abs(rel)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | _NOFOLLOW
        try:
            self._fd: int | None = os.open(self._path, flags, 0o666)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # this filesystem refuses O_DIRECT
                raise _NoDirectIO(str(exc)) from exc
            raise _open_error(exc, "create", self._path) from exc
        # Set before the reservation: a full disk aborts through abort(), which stops
        # the (not yet started) I/O threads.
        self._error: OSError | None = None
        self._aborting = False
        # A SimpleQueue (C, no Python-level lock): a KeyboardInterrupt that landed in a
        # queue.Queue's put() on the training thread left its mutex held, and the
        # abort that followed waited on it for ever, as did the I/O threads.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        try:
            _reserve(self._fd, size_hint, self._path, self.abort)
            for _ in range(depth):
                t = threading.Thread(target=self._run, name="atomic-checkpoint-io", daemon=True)
                t.start()
                self._threads.append(t)
        except BaseException:  # an interrupt here left the descriptor and threads
            self.abort()
            raise

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            view, offset, done = item
            try:
                if self._error is None and not self._aborting and self._fd is not None:
                    self._pwrite(self._fd, view, offset)
            except OSError as exc:
                if self._error is None:
                    self._error = exc
            finally:
                done.set()

    @staticmethod
    def _pwrite(fd: int, view: memoryview, offset: int) -> None:
        while view:
            n = os.pwrite(fd, view[:_WRITE_CHUNK], offset)
            if n <= 0:  # pragma: no cover - POSIX raises instead of returning 0
                raise OSError(errno.ENOSPC, "short write")
            view = view[n:]
            offset += n

    def _raise_error(self) -> None:
        exc = self._error
        if exc is not None:
            raise write_error(exc, "write", self._path) from exc

    def submit(self, view: memoryview, offset: int) -> _Done:
        """Queue a write; raises the error of an earlier write, if one failed."""
        self._raise_error()
        done = _Done()
        self._queue.put((view, offset, done))
        return done

    def _stop(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def drain(self) -> None:
        """Wait until every queued write is done; raise the first failure."""
        self._stop()
        self._raise_error()

    def close(self, size_bytes: int) -> None:
        """Wait for the writes, cut the file to ``size_bytes``, fsync, close."""
        self._stop()
        fd, self._fd = self._fd, None
        if fd is None:
            return

        def cut(fd: int) -> None:
            self._raise_error()
            if os.fstat(fd).st_size != size_bytes:
                os.ftruncate(fd, size_bytes)  # the padded last block

        _sync_and_close(fd, self._path, before=cut)

    def abort(self) -> None:
        self._aborting = True  # queued writes are skipped
        self._stop()
        fd, self._fd = self._fd, None
        _discard(fd, self._path)


class _Done:
    """Set once a write's buffer may be reused: a ``threading.Event`` built on one C
    lock. An Event's wait() holds a Python-level condition lock, which a
    KeyboardInterrupt landing at the wrong instruction of the training thread leaves
    held; the I/O thread's set() then blocks for ever, and the abort joining it too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        if self._lock.locked():
            with contextlib.suppress(RuntimeError):  # set twice: already released
                self._lock.release()

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float | None = None) -> bool:
        got = self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))
        if got:
            self._lock.release()  # stays set for every later wait
        return got


class _NoDirectIO(Exception):
    """The filesystem refused O_DIRECT at open."""


def local_root(root: str | os.PathLike[str]) -> str:
    """The absolute path of a local root, normalised once at the boundary: ``~``
    expanded, relative to the working directory, ``.``/``..`` and trailing slashes
    removed; a ``file://`` URL is decoded as RFC 8089 says (``Path.as_uri()`` writes a
    space as ``%20`` and ``[`` as ``%5B``). Symlinks are kept in the path (messages
    name the root as given) and resolved where it matters: the mount is detected on
    the resolved path (``detect.mount_of``).

    Raises:
        ValueError: a ``file://`` URL that names a host (``file://tmp/x``, one slash
            short of ``file:///tmp/x``): it was read as the relative path ``tmp/x``; or
            a URL with one slash lost (``s3:/bucket/run``, what ``pathlib.Path`` makes
            of ``s3://bucket/run``).
        CheckpointNotFoundError: a relative root while the working directory no longer
            exists (deleted or replaced since the process started).
    """
    text = os.fspath(root)
    collapsed = re.match(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)", text)
    if collapsed:
        # pathlib turns "s3://bucket/run" into "s3:/bucket/run": as a local path it
        # became ./s3:/bucket/run, and the checkpoints stayed on the node's disk (the
        # CLI said "<cwd>/s3:/bucket/run does not exist").
        scheme = collapsed.group(1)
        meant = text[5:] if scheme == "file" else f"{scheme}://{text[len(scheme) + 2 :]}"
        raise ValueError(
            f"{text!r} looks like {meant!r} with one slash lost (pathlib.Path collapses "
            "'//'): pass the URL as a str, not a Path (or put './' in front of a local "
            "directory really named like this)"
        )
    if text.startswith("file://"):
        host, slash, rest = text[len("file://") :].partition("/")
        if host and host.lower() != "localhost":
            raise ValueError(
                f"{text!r} names the host {host!r}: a file URL of a local path has three "
                f"slashes (file:///{host}/{rest}), or 'localhost' as its host"
            )
        text = urllib.parse.unquote(slash + rest)
        if os.name == "nt" and len(text) > 2 and text[0] == "/" and text[2] == ":":
            text = text[1:]  # file:///C:/x names C:/x
    text = os.path.expanduser(text)
    try:
        return os.path.abspath(text)
    except FileNotFoundError:  # os.getcwd(): the working directory is gone
        raise CheckpointNotFoundError(
            f"the relative root {text!r} cannot be resolved: the working directory no "
            "longer exists (deleted or replaced since this process started). Pass an "
            "absolute root",
        ) from None


def refuse_dangling_root(root: str) -> None:
    """Raise ``CheckpointNotFoundError`` for a root that is a symbolic link to nothing
    (said as such: creating it failed with "create directory '<root>/.atomic-checkpoint'
    failed: No such file or directory")."""
    if os.path.islink(root) and not os.path.exists(root):
        raise CheckpointNotFoundError(
            f"checkpoint root {root!r} is a symbolic link to {os.readlink(root)!r}, which "
            "does not exist (an unmounted filesystem, or a moved directory)"
        )


class LocalStorage:
    """Storage on a mounted filesystem rooted at ``root`` (an OS path).

    Args:
        root: the checkpoint root; it need not exist yet.
        capabilities: what the filesystem can do; default: read from the mount table
            (:func:`.detect.local_capabilities`), so an sshfs or NFS root is known to be
            non-coherent and an s3fs-fuse root to have no atomic directory rename.
            ``direct_io`` is declared whatever is given: this backend implements
            :class:`.base.DirectIOStorage`; its ``direct_io`` attribute decides where
            O_DIRECT is used.

    Raises:
        StorageError: the filesystem holding ``root`` cannot be examined.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, capabilities: base.StorageCapabilities | None = None
    ):
        # As open_storage normalises it: LocalStorage(root, capabilities=...), the
        # override the docs recommend for a FUSE mount, took "~/ckpt" and file:// URLs
        # as relative paths under the working directory.
        self.root = local_root(root)
        refuse_dangling_root(self.root)
        caps = capabilities or local_capabilities(self.root)
        self.capabilities = caps if caps.direct_io else replace(caps, direct_io=True)
        self._refresh_failed = False
        try:
            self._root_device = _device_of(self.root)
        except OSError as exc:
            raise map_os_error(exc, "examine the filesystem of", self.root) from exc
        self._root_mount = self._mount_identity()

    def _mount_identity(self) -> tuple[str, str, str] | None:
        mount = mount_of(self.root)
        return None if mount is None else (mount.mount_point, mount.fstype, mount.source)

    def check_root(self) -> None:
        """Raise if ROOT is no longer on the filesystem it was on when opened.

        Called by every rank before each write, namespace change, listing and read (a
        ``stat`` of ROOT: served from the client's cache on network filesystems).

        The same export mounted again at the same mount point (an automounter's idle
        expiry, or a remount after a lost connection) counts as unchanged.

        Raises:
            StorageError: the filesystem changed (a network mount went away and the
                mount point is now a local directory) or cannot be reached.
        """
        try:
            device = _device_of(self.root)
        except OSError as exc:
            raise map_os_error(exc, "examine the filesystem of", self.root) from exc
        if device == self._root_device:
            return
        mount = self._mount_identity()
        if mount is not None and mount == self._root_mount:
            # The same export mounted again at the same place (an automounter expired
            # and remounted it): a new device number, the same files.
            log.info("checkpoint root %s was remounted (%s %s)", self.root, mount[1], mount[2])
            self._root_device = device
            return
        now = f"{mount[1]} at {mount[0]}" if mount is not None else "unknown"
        was = self._root_mount
        if mount is not None and was is not None and len(mount[0]) > len(was[0]):
            # A mount point nearer ROOT than the one it was on: a filesystem appeared
            # over it; "the mount it was on is gone" sent users to remount what was
            # never unmounted.
            raise StorageError(
                f"a filesystem ({now}) was mounted over checkpoint root {self.root!r} since "
                f"it was opened (it was on {was[1]} at {was[0]}): what this job saw there "
                "is hidden under it. Nothing was written. Unmount it to carry on, or open "
                "a new CheckpointManager (restart the job) to use the new filesystem",
                errno=errno.ENODEV,
                path=self.root,
            )
        raise StorageError(
            f"the filesystem under checkpoint root {self.root!r} changed since it was "
            f"opened (device {_format_device(self._root_device)}, "
            f"{self.capabilities.name}; now device {_format_device(device)}, {now}): the "
            "mount it was on is gone (sshfs unmounts itself when its ssh connection dies), "
            "and anything written now would land on the directory underneath the mount "
            "point, invisible to every other node. Nothing was written. Mount the same "
            "filesystem there again and this job carries on, or restart the job: it "
            "resumes from the last checkpoint",
            errno=errno.ENODEV,
            path=self.root,
        )

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r}, {self.capabilities.name})"

    def _join(self, rel: str) -> str:
        return os.path.join(self.root, *base.parts_inside(self.root, rel)) if rel else self.root

    def _abs(self, rel: str) -> str:
        """The OS path of ``rel`` for an operation on it: no directory on the way below
        ROOT may be a symbolic link (DESIGN invariant 9; each operation decides about
        ``rel`` itself, never following it where it reads, writes or deletes)."""
        return base.check_no_links(self.root, rel, final=False) if rel else self.root

    def url(self, path: str = "") -> str:
        return self._join(path)

    def local_path(self, path: str = "") -> str | None:
        return self._join(path)

    def makedirs(self, path: str) -> None:
        self.check_root()
        # Every component, this one included: a ``.pending`` linked elsewhere would
        # take every later write outside ROOT.
        p = base.check_no_links(self.root, path)
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
        self.check_root()
        return _LocalWriter(self, path, size_hint)

    #: O_DIRECT writes of large files: None decides from the filesystem type (ext4,
    #: XFS, btrfs, f2fs get them), False never, True wherever the OS has O_DIRECT.
    direct_io: bool | None = None
    _direct_io_auto: bool | None = None

    def direct_io_enabled(self) -> bool:
        """Whether large state files are written, and read where the page cache does not
        hold them, with O_DIRECT here (see ``direct_io``)."""
        use = self.direct_io
        if use is None:
            if self._direct_io_auto is None:
                mount = mount_of(self.root)
                self._direct_io_auto = bool(
                    mount is not None
                    and mount.fstype in _DIRECT_IO_FS
                    and self.capabilities.coherent
                )
            use = self._direct_io_auto
        return bool(use) and hasattr(os, "O_DIRECT")

    def open_write_direct(
        self, path: str, *, size_hint: int | None = None
    ) -> base.DirectWriter | None:
        """Open ``path`` for O_DIRECT writes from block-aligned memory (see
        ``_DirectWriter``), or return None where this filesystem should not get them.

        Called by the rank that writes a large state file, from the thread that saves.
        """
        if not self.direct_io_enabled():
            return None
        self.check_root()
        try:
            return _DirectWriter(self, path, size_hint)
        except _NoDirectIO:
            self._direct_io_auto = False
            return None

    def open_read(self, path: str) -> base.Reader:
        self.check_root()
        p = self._abs(path)
        # O_NONBLOCK: opening a FIFO for reading would block until a writer comes;
        # nothing but a regular file is ever read (blocking is restored for reads).
        # O_NOFOLLOW: a file that is a link (to anywhere) is never read through.
        flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(p, flags | _NOFOLLOW)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{p!r} does not exist") from exc
        except NotADirectoryError as exc:
            # A parent is a file (a stray file named checkpoint-700 in ROOT): the path
            # does not exist, as on an object store where such a key has no children.
            raise CheckpointNotFoundError(f"{p!r} does not exist (a parent is a file)") from exc
        except OSError as exc:
            raise _open_error(exc, "open", p) from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptCheckpointError(
                    f"{p!r} is not a regular file (a FIFO, socket or device); refusing to read it"
                )
            if hasattr(os, "O_NONBLOCK"):
                os.set_blocking(fd, True)
            f = io.FileIO(fd, "rb", closefd=True)
        except FileNotFoundError as exc:
            # sshfs answers fstat by path: a name replaced by another writer between
            # our open and fstat is ENOENT there (seen under load in the contract test
            # of write_bytes_atomic). The name was just being replaced: "not there",
            # as if the open itself had missed it.
            os.close(fd)
            raise CheckpointNotFoundError(f"{p!r} vanished while being opened") from exc
        except OSError as exc:
            os.close(fd)
            raise map_os_error(exc, "open", p) from exc
        except BaseException:
            os.close(fd)
            raise
        return _LocalReader(f, p)

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            # Bounded by the size from fstat before a byte is read (a sparse 10 TiB
            # "manifest" is refused at once), and by what the reads return should the
            # file grow meanwhile; a size cached stale on a network filesystem is only
            # a hint, the loop reads until EOF.
            try:
                size = os.fstat(f.fileno()).st_size
            except OSError as exc:
                raise map_os_error(exc, "stat", self._join(path)) from exc
            if size > base.MAX_READ_BYTES:
                raise base.too_large(self._join(path), size)
            parts = []
            left = base.MAX_READ_BYTES + 1
            while left > 0:
                chunk = f.read(min(left, max(size + 1, 64 << 10)))
                if not chunk:
                    break
                parts.append(chunk)
                left -= len(chunk)
            if left <= 0:
                raise base.too_large(self._join(path), None)
            return b"".join(parts)

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        self.check_root()
        final = self._abs(path)
        tmp = temp_name(final)
        w = _LocalWriter(self, os.path.relpath(tmp, self.root).replace(os.sep, "/"), None)
        try:
            w.write(data)
            w.close()
            # A reader on another NFS/sshfs client can open a file after it is created and
            # before it is written: publish by rename, never by writing in place.
            _replace(tmp, final)
        except BaseException:
            w.abort()
            raise
        self.fsync_dir(os.path.dirname(path.rstrip("/")) if "/" in path else "")

    def replace_file(self, src: str, dst: str) -> None:
        """Rename file ``src`` onto ``dst`` in one step, then fsync ``dst``'s directory:
        readers see the old or the new ``dst``, never a part of either. The streaming
        counterpart of ``write_bytes_atomic`` for files written with ``open_write``
        (Lightning's ``.ckpt``: a pending file beside ``dst``, so the rename never
        degrades to a copy across filesystems).

        Called by the one writer of ``dst``; blocks; ``src`` must be closed (fsync'd).

        Raises:
            StorageError: the rename failed (``src`` is left where it was).
        """
        self.check_root()
        _replace(self._abs(src), self._abs(dst))
        self.fsync_dir(dst.rsplit("/", 1)[0] if "/" in dst else "")

    def replace_with_link(self, path: str, temp: str, target: str) -> None:
        """Make ``path`` a symbolic link to ``target`` in one step, then fsync its
        directory: the link is made at ``temp`` (a sibling of ``path``), then renamed onto
        ``path``, so readers see the old entry or the new link, never no entry (Lightning's
        ``save_last="link"`` removes ``last.ckpt``, then links it again). ``target`` is
        stored as given (relative to ``path``'s directory, as Lightning writes it).

        Called by the one writer of ``path``; blocks.

        Raises:
            StorageError: the link or the rename failed (``temp`` is removed).
        """
        self.check_root()
        temp_abs = self._abs(temp)
        try:
            os.symlink(target, temp_abs)
        except OSError as exc:
            raise map_os_error(exc, "symlink", temp_abs) from exc
        try:
            _replace(temp_abs, self._abs(path))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp_abs)
            raise
        self.fsync_dir(path.rsplit("/", 1)[0] if "/" in path else "")

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; True if this call did.

        Published whole, never created empty and filled later: the data goes to a
        temporary file beside ``path`` and is fsync'd, then ``link(2)`` gives it its
        name, then the directory is fsync'd. link is atomic and fails with EEXIST when
        the name exists, on every client of NFS and sshfs too, so of racing creators
        exactly one wins; a crash at any moment leaves the name absent or complete. (An
        ``O_EXCL`` create, then write, then fsync, froze a 0-byte file there when the
        process died in between, and every later start tripped over it.) A crash can
        leave the temporary file (``<name>.tmp-<writer>-...``): a few bytes, never read,
        removed by the next sweep or ``clean`` (``storage.temps``).

        NFS: a link whose reply was lost is retransmitted and then answers EEXIST
        although it succeeded; the temporary file's link count (2) tells. Where hard
        links are not supported (FAT, some FUSE and SMB mounts) it falls back to the
        ``O_EXCL`` create.
        """
        self.check_root()
        p = self._abs(path)
        tmp = temp_name(p)
        self._write_new_file(tmp, data)
        try:
            fault_point("mid_create", -1)
            try:
                os.link(tmp, p)
                won = True
            except FileExistsError:
                won = os.stat(tmp).st_nlink == 2  # NFS: our retransmitted link
            except OSError as exc:
                if exc.errno == errno.EPERM and self._exists_fresh(p):
                    return False  # sshfs: the loser of a link race often gets EPERM
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                    raise map_os_error(exc, "link", f"{tmp} -> {p}") from exc
                return self._create_exclusive_in_place(path, data)
        finally:
            self._drop_temporary(tmp)
        if won:
            self.fsync_dir(path.rsplit("/", 1)[0] if "/" in path else "")
        return won

    @staticmethod
    def _drop_temporary(tmp: str) -> None:
        """Unlink ``create_exclusive``'s temporary file. Only the next start's sweep
        (or ``clean``) would remove it otherwise, so a failed unlink (a transient EIO or
        ENOSPC from the filesystem, found by the libfiu campaign on s3fs-fuse) is
        retried once and, if it fails again, named in a warning rather than left
        silently."""
        for attempt in range(2):
            try:
                os.unlink(tmp)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if attempt:
                    log.warning(
                        "could not remove the temporary file %s (%s): a few bytes that "
                        "nothing reads; delete it by hand",
                        tmp,
                        exc,
                    )

    def _write_new_file(self, p: str, data: bytes) -> None:
        """Create ``p`` (which must not exist), write ``data`` and fsync it; on failure
        nothing is left."""
        try:
            fd = _open_new(p)
        except OSError as exc:
            raise map_os_error(exc, "create", p) from exc
        _fill_new(fd, p, data)

    def _create_exclusive_in_place(self, path: str, data: bytes) -> bool:
        """``create_exclusive`` where hard links are not supported: ``O_EXCL`` create,
        write, fsync (a crash in between leaves the name empty or short)."""
        p = self._abs(path)
        try:
            fd = _open_new(p)
        except FileExistsError:
            return False
        except PermissionError as exc:
            # sshfs: the loser of an O_EXCL race often gets EPERM, not EEXIST.
            if self._exists_fresh(p):
                return False
            raise map_os_error(exc, "create", p) from exc
        except OSError as exc:
            raise map_os_error(exc, "create", p) from exc
        _fill_new(fd, p, data)
        self.fsync_dir(path.rsplit("/", 1)[0] if "/" in path else "")
        return True

    def listdir(self, path: str) -> list[str]:
        """Names in directory ``path``, as the server has them on network filesystems
        (the client's cached listing is dropped first); [] if it does not exist, and
        [] if it is reached through a symbolic link (not a directory of this root)."""
        self.check_root()
        try:
            p = base.check_no_links(self.root, path) if path else self.root
        except CheckpointError:
            return []
        if not self.capabilities.coherent and not self._drop_cached_metadata(p):
            # The server has no such directory; this client's cache still lists what
            # it held (sshfs, for about 20 s after another client deleted it).
            return []
        try:
            return sorted(os.listdir(p))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise map_os_error(exc, "list", p) from exc

    def size(self, path: str) -> int | None:
        p = self._abs(path)
        st = _lstat(p)
        if st is None:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise base.linked(p)  # its target's size is outside's business
        if not stat.S_ISREG(st.st_mode):
            # A directory (or FIFO) is no file: None, as object stores and MemoryStorage
            # answer. Its st_size (4096 for a directory) read as a file's size.
            return None
        return st.st_size

    def stat_token(self, path: str) -> tuple[int, ...] | None:
        """What identifies this version of file ``path`` without reading it (device,
        inode, size, modification and change times in ns), or None if it is missing, a
        link or not a regular file. A file replaced by a rename (``write_bytes_atomic``,
        a checkpoint directory renamed over) is a new inode with new times, so an equal
        token means the same bytes. On network filesystems the attributes come from this
        client's cache: its own changes show at once, other clients' within the cache's
        timeout. Used by ``catalog.ManifestCache``."""
        st = _lstat(self._abs(path))
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory of this root: a link to one is not."""
        try:
            return stat.S_ISDIR(os.lstat(self._abs(path)).st_mode)
        except (OSError, CheckpointError):
            return False

    def walk_files(self, path: str) -> list[tuple[str, int]]:
        """Every file under ``path``. A symbolic link among them raises: a checkpoint
        holds regular files and directories only, and a link would be refused by every
        reader (``saving()`` blocks that wrote one fail here, before the commit)."""
        top = base.check_no_links(self.root, path) if path else self.root
        out: list[tuple[str, int]] = []
        try:
            for dirpath, dirs, files in os.walk(top):
                for name in files + dirs:
                    full = os.path.join(dirpath, name)
                    st = os.lstat(full)
                    if stat.S_ISLNK(st.st_mode):
                        raise base.linked(full)
                    if name in files:
                        rel = os.path.relpath(full, top).replace(os.sep, "/")
                        out.append((rel, st.st_size))
        except OSError as exc:
            raise map_os_error(exc, "walk", top) from exc
        return sorted(out)

    def rename_dir(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, never replacing ``dst``.

        Raises:
            CheckpointExistsError: ``dst`` exists.
            CheckpointNotFoundError: ``src`` does not exist (e.g. deleted by another
                client: deletes tolerate that).
        """
        self.check_root()
        s, d = self._abs(src), self._abs(dst)
        if _renameat2 is not None:
            rc = _renameat2(_AT_FDCWD, os.fsencode(s), _AT_FDCWD, os.fsencode(d), _RENAME_NOREPLACE)
            if rc == 0:
                return
            code = ctypes.get_errno()
            # sshfs: the kernel answers EEXIST from its own cached entry of dst, which
            # outlives a delete through another client by ~20 s; ask the server.
            if code == errno.EEXIST and (self.capabilities.coherent or self._exists_fresh(d)):
                raise CheckpointExistsError(f"{d!r} already exists")
            if code not in (errno.EEXIST, errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise self._rename_error(OSError(code, os.strerror(code), s), s, d)
            # EINVAL: this filesystem (sshfs, some FUSE/NFS) refuses renameat2 flags.
        if self._exists_fresh(d):
            raise CheckpointExistsError(f"{d!r} already exists")
        try:
            _retry_windows(lambda: os.rename(s, d))
        except OSError as exc:
            # ENOTEMPTY/EEXIST (ext4, XFS) or EPERM (sshfs): someone created dst after
            # our check. Never treat it as success.
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) or (
                exc.errno == errno.EPERM and self._exists_fresh(d)
            ):
                raise CheckpointExistsError(f"{d!r} already exists") from exc
            raise self._rename_error(exc, s, d) from exc

    def _rename_error(self, exc: OSError, s: str, d: str) -> CheckpointError:
        # ENOENT: the source is gone (another client deleted or renamed it; on sshfs it
        # may still stat() here), or the target's parent is missing.
        if exc.errno == errno.ENOENT and os.path.isdir(os.path.dirname(d)):
            return CheckpointNotFoundError(f"cannot rename {s!r} to {d!r}: {s!r} does not exist")
        return map_os_error(exc, "rename", f"{s} -> {d}")

    def _exists_fresh(self, p: str) -> bool:
        """Whether ``p`` exists on the server, not just in this client's cache."""
        if self.capabilities.coherent:
            return os.path.lexists(p)
        # sshfs: a name deleted or renamed away through another client keeps passing
        # stat() here for ~20 s and no refresh drops that, but a listing refreshed by a
        # metadata write on the parent is current.
        parent, name = os.path.split(p)
        self._drop_cached_metadata(parent)
        try:
            return name in os.listdir(parent)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def exchange_dirs(self, a: str, b: str) -> bool:
        if _renameat2 is None:
            return False
        self.check_root()
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
        fsync_directory(self._abs(path))

    def delete_file(self, path: str) -> None:
        self.check_root()
        p = self._abs(path)
        try:
            _retry_windows(lambda: os.unlink(p))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise map_os_error(exc, "delete", p) from exc

    def delete_tree(self, path: str) -> None:
        self.check_root()
        # rmtree never follows links inside the tree, but the tree itself (or a
        # directory on the way to it) being a link would delete another root's data.
        p = base.check_no_links(self.root, path)
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
        """Drop this client's cached metadata of ``path``: the listing of a directory,
        or the attributes (size) of a file. A no-op on coherent filesystems."""
        if self.capabilities.coherent:
            return
        self.check_root()
        try:
            p = self._abs(path)
        except CheckpointError:
            return  # reached through a link: nothing of ours to refresh
        self._drop_cached_metadata(p)

    def _drop_cached_metadata(self, p: str) -> bool:
        """Returns False when the server says ``p`` does not exist (whatever this
        client's cache still shows), else True."""
        # sshfs, NFS: a metadata write through the mount makes the client drop what it
        # cached for that path (sshfs: the directory listing, or a file's attributes),
        # so a listing taken before another node's commit is renewed. Touching the
        # times is the cheapest such write; nothing orders by mtime (layout.py).
        if os.path.islink(p):
            return True  # utime through it would touch the times of a file outside ROOT
        try:
            os.utime(p)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            # Read-only mount or not our directory: listings may lag (~20 s on sshfs).
            if not self._refresh_failed:
                self._refresh_failed = True
                log.debug("cannot refresh cached metadata of %s (%s): listings may lag", p, exc)
        return True


def _open_new(p: str) -> int:
    """Create ``p`` for writing; it must not exist (``FileExistsError`` otherwise)."""
    return os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)


def _fill_new(fd: int, p: str, data: bytes) -> None:
    """Write ``data`` through ``fd`` (just created as ``p``), then ``_sync_and_close``
    (whose close reports a deferred write error too); on failure the file is removed,
    so nothing half-written keeps the name."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        _discard(fd, p)
        raise write_error(exc, "write", p) from exc
    try:
        _sync_and_close(fd, p)
    except BaseException:
        _discard(None, p)
        raise
