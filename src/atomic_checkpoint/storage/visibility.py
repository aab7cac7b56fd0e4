"""Waiting, bounded, until another client's change is visible here.

On a coherent storage (a local disk, an object store: ``capabilities.coherent``) a
change is visible to every client once the call that made it returns, and nothing here
waits. A network filesystem's client caches attributes, directory listings and negative
lookups for seconds (NFS ``actimeo``, sshfs ``dcache_timeout``): a file another node
just wrote can show its old size (0 on sshfs) or not at all, a directory another node
deleted can still show in a listing. Each function here probes, drops the cached
metadata (``Storage.refresh``) and probes again, backing off from 5 ms to 0.5 s, until
the change shows or the bound passes; what the bound's end means (an error, a warning,
the cached answer) is the caller's to say.

Any rank may call these, from any thread; they change nothing on the storage.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from ..errors import CheckpointError, CommitError
from .base import Storage

_T = TypeVar("_T")

#: How long a directory another client deleted may still show in this client's cached
#: listing before it counts as there (sshfs: about 20 s by default, cut short by a
#: refresh).
STALE_DIR_WAIT_S = 3.0


def until(
    storage: Storage,
    refresh: str,
    probe: Callable[[], _T],
    done: Callable[[_T], bool],
    timeout_s: float,
) -> _T:
    """``probe()`` until ``done`` of its value, refreshing the cached metadata of
    directory ``refresh`` between tries, for at most ``timeout_s``; returns the last
    value (``done`` of it is False when the bound passed)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        value = probe()
        if done(value) or time.monotonic() >= deadline:
            return value
        storage.refresh(refresh)
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


#: How long a start waits for this client's cached entry of a root another client
#: deleted to expire (sshfs keeps it about 20 s, and no refresh drops the kernel's).
STALE_ROOT_WAIT_S = 30.0


def dirs_made(
    storage: Storage,
    names: tuple[str, ...],
    *,
    timeout_s: float = STALE_ROOT_WAIT_S,
    on_wait: Callable[[], None] | None = None,
) -> bool:
    """``storage.makedirs`` of each of ``names`` (entries of the root), made where the
    server has them. On a network filesystem a root that another client deleted can
    still be in this client's cache: ``makedirs`` then finds the cached entries and
    creates nothing, and every file created inside fails with ENOENT until the entry
    expires. The root's listing, read from the server, tells; until it shows every one
    of ``names``, they are made again, for up to ``timeout_s`` (``on_wait()`` is called
    once, when waiting starts). Returns whether they are there."""

    def made() -> bool:
        try:
            for name in names:
                storage.makedirs(name)
        except CheckpointError as exc:
            if storage.capabilities.coherent or getattr(exc, "errno", None) != errno.ENOENT:
                raise
            return False  # the root is gone at the server and still cached here
        return storage.capabilities.coherent or set(names) <= set(storage.listdir(""))

    if made():
        return True
    if on_wait is not None:
        on_wait()
    return until(storage, "", made, bool, timeout_s)


def dir_still_there(storage: Storage, name: str) -> bool:
    """``storage.is_dir(name)`` for an entry of the root, on a network filesystem once
    this client's cached view of it is refreshed: a directory another node deleted (a
    rollback) is not taken for one that is there."""
    if not storage.is_dir(name):
        return False
    if storage.capabilities.coherent:
        return True
    # The stat is answered from the cache; a listing of the root, once its cached
    # listing is dropped, comes from the server.
    storage.refresh("")
    if until(storage, "", lambda: name in storage.listdir(""), lambda x: not x, STALE_DIR_WAIT_S):
        return storage.is_dir(name)
    return False


def await_sizes(
    storage: Storage,
    directory: str,
    sizes: Mapping[str, int],
    timeout_s: float,
    while_missing: Callable[[], None] | None = None,
) -> dict[str, int | None]:
    """Wait until every file ``sizes`` names (relative to ``directory``) is visible here
    with its size. Returns what is still wrong when ``timeout_s`` passed (the size seen,
    None for no file); empty once every file is visible.

    One listing of ``directory`` comes first: on an object store a size query is a HEAD
    request per file, one after another (16,384 at 4,096 ranks of four files each),
    where a listing costs one request per 1,000 files. Files the listing does not show
    with their size (a listing may lag behind a lookup on NFS) are asked one by one.
    ``while_missing`` is called while files are missing, at once and then every second,
    and may raise to stop the wait (a fenced job's files will never come).
    """
    listed: dict[str, int] = {}
    if len(sizes) > 1:
        with contextlib.suppress(CheckpointError):  # the per-file queries decide
            listed = dict(storage.walk_files(directory))
    wrong = dict(sizes)
    called = [0.0]

    def probe() -> dict[str, int | None]:
        nonlocal listed, wrong
        seen = {p: listed.get(p) for p in wrong}
        for p, want in wrong.items():
            if seen[p] != want:
                seen[p] = storage.size(f"{directory}/{p}")
        missing = {p: s for p, s in seen.items() if s != wrong[p]}
        wrong, listed = {p: wrong[p] for p in missing}, {}
        if missing and while_missing is not None and time.monotonic() - called[0] >= 1.0:
            while_missing()
            called[0] = time.monotonic()
        return missing

    return until(storage, directory, probe, lambda missing: not missing, timeout_s)


def await_dir(storage: Storage, path: str, timeout_s: float) -> None:
    """Ranks other than the coordinator, on a network filesystem: wait until the pending
    directory the coordinator just created is visible here (NFS clients cache negative
    lookups; a refresh of the parent drops them)."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if not until(storage, parent, lambda: storage.is_dir(path), bool, timeout_s):
        raise CommitError(
            f"the pending directory {storage.url(path)} that the coordinator created is "
            f"not visible from this rank after {timeout_s:g} s: does this rank see the "
            "same storage under the checkpoint root?"
        )
