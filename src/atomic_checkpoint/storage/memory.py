"""``MemoryStorage``: an in-process storage with fault injection, for unit tests of
pure protocol logic only. Real filesystems are tested with ``LocalStorage`` on real
mounts; nothing here stands in for them.

Faults are injected per operation name and path substring::

    s = MemoryStorage()
    s.inject("write", "rank-00001", OSError(errno.ENOSPC, "No space left"), times=1)
"""

from __future__ import annotations

import errno
import io
import threading
from dataclasses import dataclass

from ..errors import CheckpointExistsError, CheckpointNotFoundError, map_os_error
from .base import MAX_READ_BYTES, Reader, StorageCapabilities, too_large


@dataclass
class _Fault:
    op: str
    match: str
    error: OSError
    times: int | None


class _MemWriter:
    def __init__(self, storage: MemoryStorage, path: str):
        self._s = storage
        self._path = path
        self._buf = bytearray()
        self._closed = False

    def write(self, data: bytes | memoryview) -> None:
        self._s._maybe_fail("write", self._path)
        self._buf += memoryview(data).cast("B")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._s._maybe_fail("fsync", self._path)
        with self._s._lock:
            self._s.files[self._path] = bytes(self._buf)

    def abort(self) -> None:
        self._closed = True
        with self._s._lock:
            self._s.files.pop(self._path, None)


class MemoryStorage:
    """Files and directories in dicts; every operation can be made to fail."""

    def __init__(self, *, capabilities: StorageCapabilities | None = None):
        self.capabilities = capabilities or StorageCapabilities(name="memory", direct_io=False)
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {""}
        self.ops: list[tuple[str, str]] = []
        self._faults: list[_Fault] = []
        self._lock = threading.RLock()

    def inject(self, op: str, match: str, error: OSError, *, times: int | None = 1) -> None:
        """Make operation ``op`` on paths containing ``match`` raise ``error``
        (``times`` times, or always when None)."""
        self._faults.append(_Fault(op, match, error, times))

    def _maybe_fail(self, op: str, path: str) -> None:
        with self._lock:
            self.ops.append((op, path))
            for f in self._faults:
                if f.op == op and f.match in path and (f.times is None or f.times > 0):
                    if f.times is not None:
                        f.times -= 1
                    raise map_os_error(f.error, op, path) from f.error

    def url(self, path: str = "") -> str:
        return f"memory://{path}"

    def local_path(self, path: str = "") -> str | None:
        return None

    def _parent(self, path: str) -> str:
        return path.rsplit("/", 1)[0] if "/" in path else ""

    def makedirs(self, path: str) -> None:
        self._maybe_fail("makedirs", path)
        with self._lock:
            parts = path.split("/") if path else []
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d in self.files:
                    raise map_os_error(OSError(errno.EEXIST, "File exists"), "makedirs", d)
                self.dirs.add(d)

    def open_write(self, path: str, *, size_hint: int | None = None) -> _MemWriter:
        self._maybe_fail("open_write", path)
        if self._parent(path) not in self.dirs:
            raise map_os_error(OSError(errno.ENOENT, "No such directory"), "create", path)
        return _MemWriter(self, path)

    def open_read(self, path: str) -> Reader:
        self._maybe_fail("open_read", path)
        with self._lock:
            if path not in self.files:
                raise CheckpointNotFoundError(f"{path!r} does not exist")
            return io.BytesIO(self.files[path])

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            size = f.seek(0, io.SEEK_END)
            if size > MAX_READ_BYTES:
                raise too_large(path, size)
            f.seek(0)
            return f.read()

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        self._maybe_fail("write_atomic", path)
        with self._lock:
            self.files[path] = bytes(data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        self._maybe_fail("create_exclusive", path)
        with self._lock:
            if path in self.files:
                return False
            self.files[path] = bytes(data)
            return True

    def listdir(self, path: str) -> list[str]:
        self._maybe_fail("listdir", path)
        prefix = f"{path}/" if path else ""
        with self._lock:
            names = {
                p[len(prefix) :].split("/", 1)[0]
                for p in [*self.files, *self.dirs]
                if p.startswith(prefix) and p != path and p
            }
        return sorted(names)

    def size(self, path: str) -> int | None:
        with self._lock:
            data = self.files.get(path)
        return None if data is None else len(data)

    def is_dir(self, path: str) -> bool:
        return path in self.dirs

    def walk_files(self, path: str) -> list[tuple[str, int]]:
        prefix = f"{path}/" if path else ""
        with self._lock:
            return sorted(
                (p[len(prefix) :], len(d)) for p, d in self.files.items() if p.startswith(prefix)
            )

    def _move(self, src: str, dst: str) -> None:
        pre = f"{src}/"
        self.files = {
            (dst + p[len(src) :] if p.startswith(pre) else p): d for p, d in self.files.items()
        }
        self.dirs = {
            (dst + p[len(src) :] if p == src or p.startswith(pre) else p) for p in self.dirs
        }

    def rename_dir(self, src: str, dst: str) -> None:
        self._maybe_fail("rename", src)
        with self._lock:
            if dst in self.dirs or dst in self.files:
                raise CheckpointExistsError(f"{dst!r} already exists")
            if src not in self.dirs:
                raise CheckpointNotFoundError(f"{src!r} does not exist")
            self._move(src, dst)

    def exchange_dirs(self, a: str, b: str) -> bool:
        self._maybe_fail("rename", a)
        with self._lock:
            tmp = f"{a}.__exchange__"
            self._move(a, tmp)
            self._move(b, a)
            self._move(tmp, b)
        return True

    def fsync_dir(self, path: str) -> None:
        self._maybe_fail("fsync_dir", path)

    def delete_file(self, path: str) -> None:
        self._maybe_fail("delete", path)
        with self._lock:
            self.files.pop(path, None)

    def delete_tree(self, path: str) -> None:
        self._maybe_fail("delete", path)
        pre = f"{path}/"
        with self._lock:
            self.files = {
                p: d for p, d in self.files.items() if not p.startswith(pre) and p != path
            }
            self.dirs = {p for p in self.dirs if not p.startswith(pre) and p != path}

    def refresh(self, path: str) -> None:
        return None
