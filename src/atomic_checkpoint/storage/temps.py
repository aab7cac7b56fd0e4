"""Temporary files the storages write beside a final name, and when one is abandoned.

A small document (manifest, marker, lock, run record) is written to a temporary file
beside its final name, fsync'd, and then renamed or linked into place, so no reader
ever opens a half-written one. A process killed between the create and the rename
leaves the temporary file behind, and since the final name is never written by it,
nothing else would ever remove it: the start-up sweep and ``atomic-checkpoint clean``
do, once its writer is provably gone.

The name says who wrote it: ``<final>.tmp-<tag>-<pid>-<tid>-<ns>``, where ``<tag>``
names the writer's host, boot and pid namespace (``_process.writer_tag``). A temporary
file is abandoned when

- its tag is ours and its pid no longer runs (at once, whatever the file's age), or
- it is older than ``STALE_TEMP_S`` (another host's, a reused pid's, or a name written
  before tags existed: ``<final>.tmp-<pid>-<...>``). A live writer holds its temporary
  file for the time of one small write; an hour is far beyond any such write, even on a
  FUSE mount that uploads on close.

Deleting a live writer's temporary file would make its rename fail: never done before
one of the two conditions holds.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._process import pid_gone, writer_tag

if TYPE_CHECKING:
    from .base import Storage

__all__ = [
    "STALE_TEMP_S",
    "TempName",
    "abandoned_reason",
    "abandoned_temps",
    "parse_temp_name",
    "temp_name",
]

#: A temporary file this old has no live writer, whoever wrote it.
STALE_TEMP_S = 3600.0

_TAGGED_RE = re.compile(
    r"^(?P<final>.+)\.tmp-(?P<tag>[0-9a-f]{10})-(?P<pid>[0-9]{1,10})-[0-9]{1,24}-[0-9]{1,24}\Z"
)
#: Names from before the writer tag: ``.tmp-<pid>-<ns>``, ``.tmp-<pid>-<tid>-<ns>`` and
#: fsspec's ``.tmp-<pid>-<tid>``; only their age can tell.
_LEGACY_RE = re.compile(r"^(?P<final>.+)\.tmp-(?P<pid>[0-9]{1,10})(?:-[0-9]{1,24}){1,2}\Z")


@dataclass(frozen=True)
class TempName:
    """A parsed temporary file name: the final name it was for, and its writer."""

    final: str
    tag: str | None
    pid: int


def temp_name(final: str) -> str:
    """A fresh temporary name beside ``final`` (a path or a bare name), unique per
    process, thread and call."""
    return f"{final}.tmp-{writer_tag()}-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"


def parse_temp_name(name: str) -> TempName | None:
    """The parts of one of our temporary file names, or None for any other name."""
    m = _TAGGED_RE.match(name)
    if m:
        return TempName(m["final"], m["tag"], int(m["pid"]))
    m = _LEGACY_RE.match(name)
    if m:
        return TempName(m["final"], None, int(m["pid"]))
    return None


def abandoned_reason(name: str, mtime: float | None, *, now: float | None = None) -> str | None:
    """Why the temporary file ``name`` (modified at ``mtime``, None if unknown) has no
    live writer, or None when it may still have one (or is not ours)."""
    parsed = parse_temp_name(name)
    if parsed is None:
        return None
    if parsed.tag is not None and parsed.tag == writer_tag() and pid_gone(parsed.pid):
        return f"its writer (pid {parsed.pid} on this host) is gone"
    if mtime is not None:
        age = (time.time() if now is None else now) - mtime
        if age > STALE_TEMP_S:
            return f"it is {age / 3600:.1f} h old"
    return None


def abandoned_temps(
    storage: Storage, directory: str, names: list[str] | None = None
) -> list[tuple[str, str]]:
    """``(path, reason)`` for each abandoned temporary file directly in ``directory``
    (relative to the storage's root; ``names``: its listing, if already read). Object
    stores write whole objects and leave none; where the storage has a local path, the
    file's age comes from ``lstat`` (a symbolic link is never ours)."""
    if storage.local_path(directory) is None:
        return []  # an object store: whole objects, no temporary files, no listing spent
    found = []
    for name in storage.listdir(directory) if names is None else names:
        if parse_temp_name(name) is None:
            continue
        rel = f"{directory}/{name}" if directory else name
        mtime = None
        local = storage.local_path(rel)
        if local is not None:
            try:
                st = os.lstat(local)
            except OSError:
                continue  # gone since the listing (its writer renamed it)
            if not stat.S_ISREG(st.st_mode):
                continue
            mtime = st.st_mtime
        reason = abandoned_reason(name, mtime)
        if reason is not None:
            found.append((rel, reason))
    return found
