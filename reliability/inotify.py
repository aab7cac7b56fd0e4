"""Proof that a file was never opened: Linux inotify through ctypes.

The kernel reports every ``open`` and read (``IN_OPEN``, ``IN_ACCESS``) of a watched
inode, whichever path or symlink reached it, so a watch on a file outside a checkpoint
proves the library never read it (a ``stat`` is not reported: it reads no data).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

IN_ACCESS = 0x001
IN_OPEN = 0x020
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")


class OpenWatch:
    """Counts opens and reads of a set of paths (files or directories)."""

    def __init__(self, paths: list[str]):
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        self._names: dict[int, str] = {}
        for p in paths:
            wd = libc.inotify_add_watch(self._fd, os.fsencode(p), IN_OPEN | IN_ACCESS)
            if wd < 0:
                code = ctypes.get_errno()
                raise OSError(code, f"inotify_add_watch({p!r}): {os.strerror(code)}")
            self._names[wd] = p

    def events(self) -> list[str]:
        """Paths opened or read since the last call (one entry per event)."""
        out: list[str] = []
        while True:
            try:
                buf = os.read(self._fd, 65536)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    return out
                raise
            pos = 0
            while pos + _EVENT.size <= len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                pos += _EVENT.size + length
                what = "open" if mask & IN_OPEN else "read"
                out.append(f"{what} {self._names.get(wd, '?')}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> OpenWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
