"""A checkpoint root that keeps Accelerate's layout on disk.

Accelerate's automatic naming puts checkpoints in ``<project_dir>/checkpoints/
checkpoint_<i>``, and its ``save_state()``/``load_state()`` list that folder and sort
every entry by the digits in its name: an entry without digits (``.pending``) raises
``IndexError``, and an entry with digits is loaded or rotated as a checkpoint. So the
protocol's own folders cannot live there, and they need the same filesystem as the
checkpoints (a directory rename never crosses filesystems).

:class:`ProjectStorage` is a view of the project directory (ROOT) in which the protocol's
names hold (``layout.py``): ``checkpoint-<step>`` is ``checkpoints/checkpoint_<step>``
on disk, ``.pending``, ``.trash`` and ``.atomic-checkpoint`` sit in the project directory
itself, next to ``checkpoints/``. Nothing else of the project directory (Accelerate's
``logs/``, the user's files) is listed. An entry of ``checkpoints/`` that is not a
strict ``checkpoint_<step>`` is listed as ``checkpoints/<name>``, which never parses as a
step. Everything else (links refused, sizes, fsyncs, fencing) is the wrapped storage's.

The layout is recorded in ``ROOT/.atomic-checkpoint/layout.json``, so every tool that
opens ROOT, or its ``checkpoints/`` folder, sees the same checkpoints
(:func:`open_project`): the CLI needs no flag.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from typing import Any

from ..errors import CorruptCheckpointError, StorageError, UnsafeCheckpointError
from ..layout import (
    ACCELERATE_DIR,
    ACCELERATE_LAYOUT,
    LAYOUT_FILE,
    META_DIR,
    PENDING_DIR,
    TRASH_DIR,
    accelerate_name,
    checkpoint_name,
    parse_accelerate_name,
    parse_checkpoint_name,
)
from . import posix
from .base import DirectWriter, Reader, Storage, Writer, direct_io, renaming

__all__ = ["ProjectStorage", "layout_of", "open_project", "record_layout"]

log = logging.getLogger("atomic_checkpoint")

_INTERNAL = (PENDING_DIR, TRASH_DIR, META_DIR)
_MAX_LAYOUT_BYTES = 4096


class ProjectStorage:
    """The protocol's view of an Accelerate project directory (see the module doc).

    Args:
        base: a storage rooted at the project directory (``LocalStorage``).

    Raises:
        StorageError: ``checkpoints/`` is a symbolic link or on another filesystem than
            the project directory: a commit (a rename from ``.pending/``) could not be
            atomic there, or would cross the link.
    """

    def __init__(self, base: Storage):
        self.base = base
        self.capabilities = base.capabilities
        project = base.local_path("")
        if project is not None:
            _check_same_filesystem(project)
        # Optional methods of the wrapped storage, mapped (absent stays absent: callers
        # test for them with getattr). Direct I/O is declared instead (capabilities,
        # inherited from the base): see ``direct_io_enabled`` below.
        for name in ("stat_token",):
            fn = getattr(base, name, None)
            if fn is not None:
                setattr(self, name, _mapping(self, fn))

    def __repr__(self) -> str:
        return f"ProjectStorage({self.base!r}, {ACCELERATE_LAYOUT})"

    def real(self, path: str) -> str:
        """The path in the project directory of the protocol's ``path``."""
        if not path:
            return ""
        head, sep, rest = path.partition("/")
        if head in _INTERNAL or head == ACCELERATE_DIR:
            return path
        step = parse_checkpoint_name(head)
        if step is not None:
            return f"{ACCELERATE_DIR}/{accelerate_name(step)}{sep}{rest}"
        return f"{ACCELERATE_DIR}/{path}"  # a foreign entry of checkpoints/

    # The Storage protocol: every path mapped, the root's listing composed.
    def url(self, path: str = "") -> str:
        return self.base.url(self.real(path))

    def local_path(self, path: str = "") -> str | None:
        return self.base.local_path(self.real(path))

    def makedirs(self, path: str) -> None:
        self.base.makedirs(self.real(path))

    def open_write(self, path: str, *, size_hint: int | None = None) -> Writer:
        return self.base.open_write(self.real(path), size_hint=size_hint)

    def open_read(self, path: str) -> Reader:
        return self.base.open_read(self.real(path))

    def read_bytes(self, path: str) -> bytes:
        return self.base.read_bytes(self.real(path))

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        self.base.write_bytes_atomic(self.real(path), data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        return self.base.create_exclusive(self.real(path), data)

    def listdir(self, path: str) -> list[str]:
        if path:
            return self.base.listdir(self.real(path))
        out = [n for n in self.base.listdir("") if n in _INTERNAL]
        for name in self.base.listdir(ACCELERATE_DIR):
            step = parse_accelerate_name(name)
            if step is not None:
                out.append(checkpoint_name(step))
            elif parse_checkpoint_name(name) is not None or name in (*_INTERNAL, ACCELERATE_DIR):
                out.append(f"{ACCELERATE_DIR}/{name}")  # would read as one of ours
            else:
                out.append(name)
        return sorted(out)

    def size(self, path: str) -> int | None:
        return self.base.size(self.real(path))

    def is_dir(self, path: str) -> bool:
        return self.base.is_dir(self.real(path))

    def walk_files(self, path: str) -> list[tuple[str, int]]:
        return self.base.walk_files(self.real(path))

    def rename_dir(self, src: str, dst: str) -> None:
        real_dst = self.real(dst)
        if real_dst.startswith(f"{ACCELERATE_DIR}/") and not self.base.is_dir(ACCELERATE_DIR):
            # Accelerate creates checkpoints/ on its first save; a commit may come first.
            self.base.makedirs(ACCELERATE_DIR)
            self.base.fsync_dir("")
        renaming(self.base).rename_dir(self.real(src), real_dst)

    def exchange_dirs(self, a: str, b: str) -> bool:
        return renaming(self.base).exchange_dirs(self.real(a), self.real(b))

    def fsync_dir(self, path: str) -> None:
        if path:
            self.base.fsync_dir(self.real(path))
            return
        # The root of the view is two directories: checkpoints/ (where commits rename
        # to) and the project directory (where the internal folders are).
        self.base.fsync_dir("")
        if self.base.is_dir(ACCELERATE_DIR):
            self.base.fsync_dir(ACCELERATE_DIR)

    def delete_file(self, path: str) -> None:
        self.base.delete_file(self.real(path))

    def delete_tree(self, path: str) -> None:
        self.base.delete_tree(self.real(path))

    def refresh(self, path: str) -> None:
        self.base.refresh(self.real(path))
        if not path:
            self.base.refresh(ACCELERATE_DIR)

    # DirectIOStorage, declared by ``capabilities.direct_io`` (the base's): asked only
    # where the base declares it too.
    def direct_io_enabled(self) -> bool:
        base = direct_io(self.base)
        return base is not None and base.direct_io_enabled()

    def open_write_direct(self, path: str, *, size_hint: int | None = None) -> DirectWriter | None:
        base = direct_io(self.base)
        if base is None:
            return None
        return base.open_write_direct(self.real(path), size_hint=size_hint)


def _mapping(view: ProjectStorage, fn: Any) -> Any:
    def mapped(path: str, *args: Any, **kwargs: Any) -> Any:
        return fn(view.real(path), *args, **kwargs)

    return mapped


def _check_same_filesystem(project: str) -> None:
    where = os.path.join(project, ACCELERATE_DIR)
    try:
        st = os.lstat(where)
        root = os.stat(project)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"cannot examine {where!r}: {exc}", errno=exc.errno, path=where) from exc
    advice = (
        "Checkpoints are committed by renaming a finished folder from the project "
        "directory's .pending/ into checkpoints/, which must be a real directory on the "
        "same filesystem. Make checkpoints/ a plain directory (link or mount the whole "
        "project directory instead), or pass root=... (a directory on the filesystem you "
        "want) to keep the checkpoints there"
    )
    if stat.S_ISLNK(st.st_mode):
        raise StorageError(
            f"{where} is a symbolic link (to {os.readlink(where)}). {advice}", path=where
        )
    if st.st_dev != root.st_dev:
        raise StorageError(
            f"{where} is on another filesystem than {project} (a mount point). {advice}",
            errno=errno.EXDEV,
            path=where,
        )


def layout_of(project: str) -> str | None:
    """The layout recorded in ``project/.atomic-checkpoint/layout.json``, or None.

    Raises:
        CorruptCheckpointError: the file exists but is not a layout record.
    """
    where = os.path.join(project, *LAYOUT_FILE.split("/"))
    try:
        # No link followed (DESIGN invariant 9), no wait on a FIFO planted there (it
        # hung every opener of the root), and a bounded read of untrusted bytes.
        data = posix.read_head(where, _MAX_LAYOUT_BYTES + 1)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{exc}: it should be the layout record of the project directory; delete it "
            "if this directory holds no checkpoints of that layout"
        ) from None
    except (UnsafeCheckpointError, StorageError):
        return None
    if data is None:
        return None
    try:
        doc = json.loads(data) if len(data) <= _MAX_LAYOUT_BYTES else None
    except (ValueError, RecursionError):
        doc = None
    name = doc.get("layout") if isinstance(doc, dict) else None
    if name != ACCELERATE_LAYOUT:
        raise CorruptCheckpointError(
            f"{where} is not a layout record this version knows (expected "
            f'{{"layout": "{ACCELERATE_LAYOUT}"}}, got {data[:200]!r}); it says how '
            "the checkpoints under that directory are named. Remove it only if the "
            "directory holds no checkpoints of that layout"
        )
    return name


def record_layout(base: Storage) -> None:
    """Record the Accelerate layout in ``ROOT/.atomic-checkpoint/layout.json`` (once;
    durable before any checkpoint of that layout exists)."""
    base.makedirs(META_DIR)
    base.fsync_dir("")
    doc = {"layout": ACCELERATE_LAYOUT, "checkpoints": f"{ACCELERATE_DIR}/checkpoint_<step>"}
    base.create_exclusive(LAYOUT_FILE, json.dumps(doc).encode())


def open_project(path: str, make: Any) -> Storage | None:
    """The view of the Accelerate project at ``path``, or of the project whose
    ``checkpoints/`` folder ``path`` is; None when neither records that layout.

    Args:
        path: an absolute local path.
        make: opens a plain storage of a directory (``make(directory)``).
    """
    if layout_of(path) == ACCELERATE_LAYOUT:
        return ProjectStorage(make(path))
    parent, name = os.path.split(path)
    if name != ACCELERATE_DIR or os.path.lexists(os.path.join(path, META_DIR)):
        return None  # a root of its own (also: one written by an older version)
    try:
        recorded = layout_of(parent)
    except CorruptCheckpointError:
        return None
    if recorded != ACCELERATE_LAYOUT:
        return None
    log.info(
        "%s is the checkpoints folder of the Accelerate project %s: opening that", path, parent
    )
    return ProjectStorage(make(parent))
