"""Filesystem calls by OS path, for what works on a mounted filesystem directly.

The backends use them (the directory fsync of :mod:`.local`, and of :mod:`.fsspec`
over fsspec's local filesystem), and so does the rest of the package wherever it must
reach a path itself: the leader's fsync of files that another writer left
(``saving()`` blocks, adoption), the link and containment checks of invariant 9 on a
mounted root, the CLI's checks of ROOT, and the files that a framework writes by OS
path (Lightning's ``.ckpt``, DCP's and Accelerate's folders). Outside ``storage/`` no
module calls ``os``, ``os.path`` queries, ``open()`` or ``shutil`` on a path (a unit
test checks it): OSError is mapped here, at the storage boundary, into the
:mod:`atomic_checkpoint.errors` tree, or answered as a plain yes/no where a query
cannot fail.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    UnsafeCheckpointError,
    map_os_error,
)
from ..manifest import Hasher
from .base import NEARLY_FULL_BYTES, free_bytes

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def fsync_directory(path: str) -> None:
    """fsync the directory at OS path ``path``, so the entries in it are durable; the
    one directory fsync of the backends on a mounted filesystem.

    Raises:
        StorageError: the directory cannot be opened or fsync'd (mapped from OSError).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise map_os_error(exc, "open directory", path) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        # EINVAL: the filesystem does not support directory fsync (some FUSE); the
        # entries are as durable as that filesystem makes them.
        if exc.errno != errno.EINVAL:
            close_quietly(fd)
            raise map_os_error(exc, "fsync directory", path) from exc
    try:
        # NFS and FUSE may report a deferred error here (EIO, EINTR): ours, not bare.
        os.close(fd)
    except OSError as exc:
        raise map_os_error(exc, "close directory", path) from exc


def close_quietly(fd: int) -> None:
    """Close ``fd`` on a path that is already failing (or a pipe being given up): its
    own error adds nothing."""
    with contextlib.suppress(OSError):
        os.close(fd)


def read_available(fd: int, size: int) -> bytes:
    """What a non-blocking descriptor (a pipe) holds now, up to ``size`` bytes; empty
    when nothing is there or it cannot be read."""
    try:
        return os.read(fd, size)
    except OSError:  # BlockingIOError included: nothing yet
        return b""


def write_error(exc: OSError, action: str, path: str) -> StorageError:
    """``map_os_error`` for a failed write, fsync or close of a file being written, except
    that an EIO where the filesystem has (nearly) no space left is the full disk it is:
    SFTP, what sshfs speaks, has no "disk full" status, and sshfs reports a full server
    disk as EIO. Without this, the save failed with a bare I/O error and none of the
    full-disk advice (``StorageFullError``)."""
    if exc.errno == errno.EIO:
        free = free_bytes(os.path.dirname(path) or ".")
        if free is not None and free < NEARLY_FULL_BYTES:
            exc = OSError(
                errno.ENOSPC,
                f"{exc.strerror or exc} (errno {errno.EIO}) with {free} bytes free on its "
                "filesystem: a full disk, which this mount reports as an I/O error (sshfs "
                "does)",
            )
    return map_os_error(exc, action, path)


def fsync_file(path: str, reader: Any = None) -> None:
    """fsync ``path`` through a descriptor opened for writing: Windows cannot flush a
    file through a read-only handle (EBADF; FAILURE_MODES A7), POSIX can but the same
    rule keeps one code path. A file its writer left read-only (mode 0444, not root)
    cannot be opened for writing: POSIX then fsyncs ``reader``'s descriptor, or one
    opened for reading when no ``reader`` is given.

    Raises:
        StorageError: the file cannot be opened or fsync'd.
    """
    fd: int | None
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
    except PermissionError:
        if reader is not None:
            fd = None
        else:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as exc:
                raise map_os_error(exc, "open for fsync", path) from exc
    except OSError as exc:
        raise map_os_error(exc, "open for fsync", path) from exc
    try:
        os.fsync(reader.fileno() if fd is None else fd)
    except OSError as exc:
        raise write_error(exc, "fsync", path) from exc
    finally:
        if fd is not None:
            os.close(fd)


def dirs_deepest_first(path: str) -> list[str]:
    """Every directory under ``path`` (``""`` for ``path`` itself), ``/``-separated and
    relative to it, deepest first; symlinked directories are not followed. An entry
    that vanishes meanwhile is left out (``os.walk`` skips what it cannot list)."""
    dirs = [dirpath for dirpath, _dirs, _files in os.walk(path)]
    dirs.sort(key=lambda d: d.count(os.sep), reverse=True)
    rels = (os.path.relpath(d, path).replace(os.sep, "/") for d in dirs)
    return ["" if rel == "." else rel for rel in rels]


def remove_empty_dir(path: str) -> None:
    """Remove directory ``path`` if it is empty, atomically: ``rmdir`` fails on a
    non-empty directory, so a racing writer's new files are never touched. Best effort
    (not empty, already gone, or not removable: left as it is)."""
    with contextlib.suppress(OSError):
        os.rmdir(path)


def is_link(path: str) -> bool:
    """Whether ``path`` is a symbolic link (never raises)."""
    return os.path.islink(path)


def is_dir(path: str) -> bool:
    """Whether ``path`` is a directory, or a link to one (never raises)."""
    return os.path.isdir(path)


def is_file(path: str) -> bool:
    """Whether ``path`` is a regular file, or a link to one (never raises)."""
    return os.path.isfile(path)


def lexists(path: str) -> bool:
    """Whether an entry ``path`` exists (a dangling link too; never raises)."""
    return os.path.lexists(path)


def link_target(path: str) -> str:
    """Where the link ``path`` points, as stored in it; ``"?"`` if it cannot be read."""
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def real_path(path: str) -> str:
    """``path`` with every symbolic link resolved (``os.path.realpath``)."""
    return os.path.realpath(path)


def is_accessible(path: str, *, write: bool = False) -> bool:
    """Whether this user may list and enter directory ``path`` (``write``: create
    entries in it), by ``access(2)`` with the real user id."""
    return os.access(path, os.W_OK if write else os.R_OK | os.X_OK)


def owner_and_mode(path: str) -> str | None:
    """``owner uid 1001, group 100, mode 0755`` of ``path`` for a message, or None if
    it cannot be examined."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"owner uid {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"


def is_read_only_fs(path: str) -> bool:
    """Whether the filesystem holding ``path`` is mounted read-only (``statvfs``)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return False


def list_names(path: str) -> list[str]:
    """The names in directory ``path``; empty if it is missing or cannot be listed."""
    try:
        return list_dir(path) or []
    except CheckpointError:
        return []


def tree_size(path: str) -> int:
    """Bytes under ``path`` without following symlinks (a link is its own size); 0 if
    it is missing. Files removed meanwhile (a concurrent cleaner) are not counted.

    Raises:
        StorageError: ``path`` cannot be stat'ed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise map_os_error(exc, "stat", path) from exc
    if not os.path.isdir(path) or os.path.islink(path):
        return st.st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def check_inside(base: str, file_rel: str, where: str) -> None:
    """Refuse the checkpoint directory ``base`` if it, or any path to ``file_rel``
    inside it, is a symbolic link (links are never followed, wherever they point:
    DESIGN invariant 9); a file that resolves outside ``base``; and a file that is not
    a regular file: opening a FIFO for reading blocks until a writer comes (never), a
    device reads forever. ``where`` names the checkpoint in the errors.

    Raises:
        UnsafeCheckpointError: a link, or a path resolving outside ``base``.
        CorruptCheckpointError: ``file_rel`` is not a regular file.
    """
    parts = file_rel.split("/")
    if any(part in ("", ".", "..") for part in parts):
        # Manifests never list such paths (validate_relative_path); a caller's own
        # path is refused as one that resolves outside.
        raise UnsafeCheckpointError(
            f"{where}: file {file_rel!r} resolves outside the checkpoint; refusing to read it"
        )
    # One lstat per component, from the checkpoint down: with no link on the way and no
    # "..", the file is inside ``base`` without resolving anything. (os.path.realpath,
    # which this used, lstats every directory from / down, three times per file: 24-48
    # calls per file where a root lies deep, in every latest() and verify.)
    path = base
    for i in range(len(parts) + 1):
        if i:
            path = os.path.join(path, parts[i - 1])
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return  # missing or unreadable: the size check or the open says so
        if stat.S_ISLNK(mode):
            target = os.path.realpath(path)
            real_base = os.path.realpath(base)
            inside = path != base and os.path.commonpath([real_base, target]) == real_base
            what = "the checkpoint" if path == base else f"file {file_rel!r}"
            raise UnsafeCheckpointError(
                f"{where}: {what} is a symbolic link that resolves "
                f"{'inside' if inside else 'outside'} the checkpoint ({target}); links are "
                "never followed, so it is not read (nor deleted through). A copy made "
                "with links (cp -rs, a Hugging Face hub cache snapshot) is read once "
                "copied with the files themselves (cp -rL, rsync -L)"
            )
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError(
            f"{where}: file {file_rel!r} is {_not_regular(mode)}; refusing to read it"
        )


def files_as_listed(base: str, files: Iterable[tuple[str, int]]) -> bool:
    """Whether every ``(path, size_bytes)`` of ``files`` under directory ``base`` is a
    regular file of that size reached through directories only, never a link: one
    ``lstat`` per file and per directory on the way. False at the first doubt
    (including an error)."""
    dirs: set[str] = set()
    try:
        for rel, size_bytes in files:
            parts = rel.split("/")
            path = base
            for part in parts[:-1]:
                path = os.path.join(path, part)
                if path not in dirs:
                    if not stat.S_ISDIR(os.lstat(path).st_mode):
                        return False
                    dirs.add(path)
            st = os.lstat(os.path.join(path, parts[-1]))
            if not stat.S_ISREG(st.st_mode) or st.st_size != size_bytes:
                return False
    except OSError:
        return False
    return True


def exists(path: str) -> bool:
    """Whether ``path`` exists, following links (a dangling link does not; never
    raises)."""
    return os.path.exists(path)


def make_dirs(path: str) -> None:
    """Create directory ``path`` and its parents; an existing one is fine.

    Raises:
        StorageError: it cannot be created.
    """
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise map_os_error(exc, "create", path) from exc


def rename(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` (one ``rename(2)``).

    Raises:
        StorageError: the rename failed.
    """
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise map_os_error(exc, "rename", f"{src} -> {dst}") from exc


def remove_dir(path: str) -> None:
    """Remove the empty directory ``path``.

    Raises:
        StorageError: it is not empty, or cannot be removed.
    """
    try:
        os.rmdir(path)
    except OSError as exc:
        raise map_os_error(exc, "remove", path) from exc


def file_paths(path: str) -> list[str]:
    """The ``/``-separated paths of the files under ``path``, relative to it; links to
    directories are not followed, what cannot be listed is left out."""
    out = []
    for dirpath, _dirs, files in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        for name in files:
            out.append((name if rel == "." else f"{rel}/{name}").replace(os.sep, "/"))
    return out


def file_size(path: str) -> int | None:
    """The size of the file at ``path`` (following links), or None if it is missing.

    Raises:
        StorageError: it cannot be stat'ed.
    """
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise map_os_error(exc, "stat", path) from exc


def _not_regular(mode: int) -> str:
    kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
    return f"not a regular file ({kind})"


def open_regular(path: str) -> int:
    """A descriptor of regular file ``path``, opened for reading without following a
    link and without blocking: a FIFO planted where a file is expected blocked the
    open for ever (until a writer came), and a link made its target's content this
    file's.

    Raises:
        FileNotFoundError: it does not exist.
        UnsafeCheckpointError: it is a symbolic link.
        CorruptCheckpointError: it is not a regular file (a FIFO, socket, device or
            directory).
        StorageError: it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise UnsafeCheckpointError(
                f"{path!r} is a symbolic link; links are never followed"
            ) from exc
        raise map_os_error(exc, "open", path) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(f"{path!r} is {_not_regular(mode)}")
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_head(path: str, limit_bytes: int) -> bytes | None:
    """At most ``limit_bytes`` from the start of regular file ``path`` (see
    ``open_regular``); None if it is missing.

    Raises:
        UnsafeCheckpointError: it is a symbolic link.
        CorruptCheckpointError: it is not a regular file.
        StorageError: it cannot be read.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read(limit_bytes)
    except OSError as exc:
        raise map_os_error(exc, "read", path) from exc


def hash_file(path: str, hasher: Hasher, chunk_bytes: int) -> int:
    """Feed regular file ``path`` (see ``open_regular``) into ``hasher`` in chunks of
    ``chunk_bytes`` (unbuffered, into one reused buffer); returns its size.

    Raises:
        CheckpointNotFoundError: it does not exist.
        UnsafeCheckpointError: it is a symbolic link.
        CorruptCheckpointError: it is not a regular file.
        StorageError: it cannot be read.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint file {path!r} does not exist") from exc
    try:
        with os.fdopen(fd, "rb", buffering=0) as f:
            return hasher.consume(f, memoryview(bytearray(chunk_bytes)))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint file {path!r} does not exist") from exc
    except OSError as exc:
        raise map_os_error(exc, "read", path) from exc


def list_dir(path: str) -> list[str] | None:
    """The names in directory ``path``; None if it is missing.

    Raises:
        StorageError: it cannot be listed.
    """
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise map_os_error(exc, "list", path) from exc


def mtime(path: str) -> float | None:
    """The modification time of ``path`` (following links), or None if it cannot be
    stat'ed (missing, or an error: the caller then has no age to go by)."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def is_under(path: str, parent: str) -> bool:
    """Whether ``path`` is ``parent`` or inside it (lexically, after making both
    absolute and normal; links are not followed)."""
    p, q = os.path.normpath(os.path.abspath(path)), os.path.normpath(os.path.abspath(parent))
    return p == q or p.startswith(q + os.sep)
