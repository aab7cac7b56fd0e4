"""Crash-state enumeration: every state a power loss can leave, under a weak model.

A SIGKILL keeps the page cache, so kill campaigns never see a missing fsync or a window
between two renames whose directory was not yet fsync'd. This module does what ALICE
(OSDI'14) and CrashMonkey (OSDI'18) do for C systems, for this Python library:

1. **Record.** :class:`Recorder` wraps the ``os`` functions the library mutates storage
   with (``open`` with ``O_CREAT``/``O_TRUNC``, ``write``, ``pwrite``, ``ftruncate``,
   ``fsync``, ``mkdir``, ``rename``, ``replace``, ``link``, ``unlink``, ``rmdir``; the
   ``dir_fd`` forms ``shutil.rmtree`` uses) and the ``renameat2`` system call of
   ``storage/local.py`` (``RENAME_NOREPLACE`` and ``RENAME_EXCHANGE``), while an
   operation under test runs on a real directory. Every call under that directory
   becomes an :class:`Op` in a model of the tree that names objects by identity (a
   directory renamed later keeps its entries), with the bytes written (``O_DIRECT``
   ``pwrite`` included). At the end the model is compared with the real tree: a
   mutation the recorder missed is an error, never a silently smaller state space.
2. **Enumerate.** For every prefix of the recorded operations (the crash point), the
   operations not yet covered by a durability barrier are *volatile*
   (:func:`crash_states`): a directory-entry change (create, mkdir, link, rename,
   exchange, unlink, rmdir) persists only once its directory is fsync'd; file data
   only once the file is fsync'd. Each volatile entry change may be lost independently
   of the others, subject to its dependencies (the changes of one name persist in
   order; an object must exist before it is renamed or linked; a directory is removed
   only after its entries), and each file with volatile data is old, new, or torn at
   4 KiB block granularity (new size with zeros; new blocks up to a block boundary
   then old ones; cut at a block boundary). Large combinations are sampled with a
   seeded generator, so a run is reproducible and says how many states it checked.
3. **Materialise and check.** Each distinct state is written to a fresh directory and
   handed to a checker (``reliability/crashstates.py`` runs the library's recovery:
   a new manager, ``latest()``, ``restore()``, ``clean``).

The persistence model, and which filesystem guarantee each part relies on, is in
``docs/crash-model.md``.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import os
import random
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

BLOCK = 4096

#: Kinds of recorded operations.
ENTRY_KINDS = frozenset({"create", "mkdir", "link", "rename", "exchange", "unlink", "rmdir"})
DATA_KINDS = frozenset({"write", "trunc"})


class RecorderError(Exception):
    """The recorder met something it cannot model, or missed a mutation."""


@dataclass
class Op:
    """One recorded operation. Entry operations name slots as (directory id, name).

    kind: create, mkdir, link (``dir``/``name`` get ``obj``); rename (``dir``/``name``
    to ``dir2``/``name2``, moving ``obj``, replacing ``obj2`` if not None); exchange
    (``obj`` at ``dir``/``name`` and ``obj2`` at ``dir2``/``name2`` swap); unlink, rmdir
    (``obj`` leaves ``dir``/``name``); write (``data`` at ``offset`` of ``obj``); trunc
    (``obj`` to ``size``); fsync (file ``obj``'s data); dsync (directory ``obj``'s
    entries); mark (a label the operation under test set, with ``info``).
    """

    kind: str
    obj: int = -1
    dir: int = -1
    name: str = ""
    dir2: int = -1
    name2: str = ""
    obj2: int | None = None
    offset: int = 0
    data: bytes = b""
    size: int = 0
    label: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # the path, for people reading a violation

    def describe(self) -> str:
        if self.kind == "mark":
            return f"mark {self.label} {self.info}"
        if self.kind == "write":
            return f"write {self.where} [{self.offset}, {self.offset + len(self.data)})"
        if self.kind == "trunc":
            return f"truncate {self.where} to {self.size}"
        return f"{self.kind} {self.where}"


class Tree:
    """A directory tree by object identity: ``entries[dir_id][name] = obj_id``.

    ``kind[obj]`` is ``"d"`` (directory), ``"f"`` (regular file) or ``"l"`` (symlink,
    ``data`` holds its target); ``data[obj]`` a file's bytes. Object 0 is the root.
    """

    def __init__(self) -> None:
        self.entries: dict[int, dict[str, int]] = {0: {}}
        self.kind: dict[int, str] = {0: "d"}
        self.data: dict[int, bytes] = {}
        self.next_id = 1

    def copy(self) -> Tree:
        t = Tree()
        t.entries = {d: dict(e) for d, e in self.entries.items()}
        t.kind = dict(self.kind)
        t.data = dict(self.data)
        t.next_id = self.next_id
        return t

    def new(self, kind: str) -> int:
        i = self.next_id
        self.next_id += 1
        self.kind[i] = kind
        if kind == "d":
            self.entries[i] = {}
        else:
            self.data[i] = b""
        return i

    @classmethod
    def snapshot(cls, root: str) -> Tree:
        """The tree under the real directory ``root`` (hard links kept as one object)."""
        t = cls()
        inodes: dict[tuple[int, int], int] = {}

        def walk(path: str, d: int) -> None:
            for name in sorted(os.listdir(path)):
                p = os.path.join(path, name)
                st = os.lstat(p)
                if stat.S_ISDIR(st.st_mode):
                    i = t.new("d")
                    t.entries[d][name] = i
                    walk(p, i)
                elif stat.S_ISLNK(st.st_mode):
                    i = t.new("l")
                    t.data[i] = os.fsencode(os.readlink(p))
                    t.entries[d][name] = i
                elif stat.S_ISREG(st.st_mode):
                    key = (st.st_dev, st.st_ino)
                    if key not in inodes:
                        i = inodes[key] = t.new("f")
                        with open(p, "rb") as f:
                            t.data[i] = f.read()
                    t.entries[d][name] = inodes[key]
                else:
                    raise RecorderError(f"{p}: not a file, directory or symlink")

        walk(root, 0)
        return t

    # -------------------------------------------------------------- entry changes
    def apply(self, op: Op) -> None:
        """Apply an entry or data operation; raises RecorderError if it cannot apply."""
        k = op.kind
        try:
            if k in ("create", "mkdir", "link"):
                ents = self.entries[op.dir]
                if op.name in ents:
                    raise RecorderError(f"{op.describe()}: name exists")
                ents[op.name] = op.obj
            elif k == "rename":
                src = self.entries[op.dir]
                if src.get(op.name) != op.obj:
                    raise RecorderError(f"{op.describe()}: source missing")
                dst = self.entries[op.dir2]
                if dst.get(op.name2) != op.obj2:
                    raise RecorderError(f"{op.describe()}: target changed")
                if op.obj2 is not None and self.kind.get(op.obj2) == "d" and self.entries[op.obj2]:
                    raise RecorderError(f"{op.describe()}: replaces a non-empty directory")
                del src[op.name]
                dst[op.name2] = op.obj
            elif k == "exchange":
                a, b = self.entries[op.dir], self.entries[op.dir2]
                if a.get(op.name) != op.obj or b.get(op.name2) != op.obj2:
                    raise RecorderError(f"{op.describe()}: sides changed")
                a[op.name], b[op.name2] = op.obj2, op.obj  # type: ignore[assignment]
            elif k in ("unlink", "rmdir"):
                ents = self.entries[op.dir]
                if ents.get(op.name) != op.obj:
                    raise RecorderError(f"{op.describe()}: entry missing")
                if k == "rmdir" and self.entries.get(op.obj):
                    raise RecorderError(f"{op.describe()}: directory not empty")
                del ents[op.name]
            elif k == "write":
                old = self.data[op.obj]
                end = op.offset + len(op.data)
                if len(old) < op.offset:
                    old = old + bytes(op.offset - len(old))
                self.data[op.obj] = old[: op.offset] + op.data + old[end:]
            elif k == "trunc":
                old = self.data[op.obj]
                self.data[op.obj] = old[: op.size] + bytes(max(0, op.size - len(old)))
        except KeyError as exc:
            raise RecorderError(f"{op.describe()}: unknown object {exc}") from None

    # -------------------------------------------------------------- queries
    def lookup(self, d: int, name: str) -> int | None:
        return self.entries.get(d, {}).get(name)

    def resolve(self, rel: str) -> int | None:
        """The object at ``rel`` (``/``-separated, relative to the root), or None."""
        cur = 0
        for part in [p for p in rel.split("/") if p]:
            nxt = self.lookup(cur, part)
            if nxt is None:
                return None
            cur = nxt
        return cur

    def files(self) -> dict[str, bytes]:
        """Reachable regular files and symlinks by relative path (dirs end with ``/``)."""
        out: dict[str, bytes] = {}

        def walk(d: int, prefix: str) -> None:
            for name, i in sorted(self.entries[d].items()):
                if self.kind[i] == "d":
                    out[prefix + name + "/"] = b""
                    walk(i, prefix + name + "/")
                elif self.kind[i] == "l":
                    out[prefix + name + "@"] = self.data[i]
                else:
                    out[prefix + name] = self.data[i]

        walk(0, "")
        return out

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for path, data in self.files().items():
            h.update(path.encode() + b"\0" + hashlib.blake2b(data, digest_size=16).digest())
        return h.hexdigest()

    def materialise(self, dest: str) -> None:
        """Write the reachable tree into the empty or missing directory ``dest``."""
        os.makedirs(dest, exist_ok=True)
        first_path: dict[int, str] = {}

        def walk(d: int, path: str) -> None:
            for name, i in sorted(self.entries[d].items()):
                p = os.path.join(path, name)
                kind = self.kind[i]
                if kind == "d":
                    os.mkdir(p)
                    walk(i, p)
                elif kind == "l":
                    os.symlink(os.fsdecode(self.data[i]), p)
                elif i in first_path:
                    os.link(first_path[i], p)
                else:
                    first_path[i] = p
                    with open(p, "wb") as f:
                        f.write(self.data[i])

        walk(0, dest)


def diff_trees(real: Tree, model: Tree) -> list[str]:
    fa, fb = real.files(), model.files()
    out = []
    for p in sorted(set(fa) | set(fb)):
        if p not in fa:
            out.append(f"only in the model: {p}")
        elif p not in fb:
            out.append(f"only in the real tree: {p}")
        elif fa[p] != fb[p]:
            out.append(f"content differs: {p} ({len(fa[p])} vs {len(fb[p])} bytes)")
    return out


# ====================================================================== recording
@dataclass
class _Fd:
    obj: int
    pos: int
    path: str


class Recorder:
    """Records every mutation under ``root`` while active (``with Recorder(root) as rec``).

    Args:
        root: the directory under test; its current content is the durable baseline
            (build it in an earlier process: that is the state "fully synced").
        exchange: False emulates a filesystem that refuses every ``renameat2`` flag
            (sshfs, NFS; Windows has no renameat2): ``exchange_dirs`` returns False and
            ``rename_dir`` falls back to check-then-rename, as the library does there.

    ``mark(label, **info)`` records a point of the operation (e.g. ``save()`` returned).
    After the ``with`` block, ``ops`` holds the operations and ``baseline`` the tree
    before them; leaving the block checks the model against the real tree.
    """

    _active: Recorder | None = None

    def __init__(self, root: str | os.PathLike[str], *, exchange: bool = True):
        self.root = os.path.realpath(os.fspath(root))
        self.exchange = exchange
        self.baseline = Tree.snapshot(self.root)
        self.live = self.baseline.copy()
        self.ops: list[Op] = []
        self._fds: dict[int, _Fd] = {}
        self._lock = threading.RLock()
        self._saved: dict[tuple[Any, str], Any] = {}

    # ------------------------------------------------------------ paths
    def _rel(self, path: Any, dir_fd: int | None) -> str | None:
        """``path`` relative to the root, or None when it is outside."""
        p = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(p):
            fd = self._fds.get(dir_fd)
            if fd is None:
                return None
            base = os.path.join(self.root, fd.path) if fd.path else self.root
            p = os.path.join(base, p)
        p = os.path.normpath(os.path.abspath(p))
        if p == self.root:
            return ""
        if not p.startswith(self.root + os.sep):
            return None
        return p[len(self.root) + 1 :].replace(os.sep, "/")

    def _slot(self, rel: str) -> tuple[int, str]:
        parent, _, name = rel.rpartition("/")
        d = self.live.resolve(parent)
        if d is None or self.live.kind[d] != "d":
            raise RecorderError(f"parent of {rel!r} is not in the model")
        return d, name

    def _record(self, op: Op) -> None:
        if op.kind != "mark" and op.kind not in ("fsync", "dsync"):
            self.live.apply(op)
        self.ops.append(op)

    def _fd_rel(self, fd: _Fd) -> str:
        return fd.path

    def mark(self, label: str, **info: Any) -> None:
        with self._lock:
            self.ops.append(Op("mark", label=label, info=info))

    # ------------------------------------------------------------ patching
    def __enter__(self) -> Recorder:
        if Recorder._active is not None:
            raise RecorderError("a Recorder is already active")
        from atomic_checkpoint.storage import local

        Recorder._active = self
        self._patch(os, "open", self._open)
        self._patch(os, "close", self._close)
        self._patch(os, "write", self._write)
        self._patch(os, "pwrite", self._pwrite)
        self._patch(os, "ftruncate", self._ftruncate)
        self._patch(os, "fsync", self._fsync)
        self._patch(os, "fdatasync", self._fsync)
        self._patch(os, "mkdir", self._mkdir)
        self._patch(os, "rename", self._rename)
        self._patch(os, "replace", self._rename)
        self._patch(os, "link", self._link)
        self._patch(os, "unlink", self._unlink)
        self._patch(os, "remove", self._unlink)
        self._patch(os, "rmdir", self._rmdir)
        self._patch(os, "symlink", self._unsupported("symlink"))
        self._patch(os, "truncate", self._unsupported("truncate"))
        if local._renameat2 is not None:
            self._patch(local, "_renameat2", self._renameat2(local._renameat2))
        return self

    def _patch(self, mod: Any, name: str, fn: Callable[..., Any]) -> None:
        self._saved[(mod, name)] = getattr(mod, name)
        setattr(mod, name, fn)

    def _real(self, mod: Any, name: str) -> Any:
        return self._saved[(mod, name)]

    def __exit__(self, *exc: object) -> None:
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        self._saved.clear()
        Recorder._active = None
        if exc[0] is None:
            self.check_complete()

    def check_complete(self) -> None:
        """Raise RecorderError if the real tree differs from the model (a missed write)."""
        real = Tree.snapshot(self.root)
        problems = diff_trees(real, self.live)
        if problems:
            raise RecorderError(
                "the recorder missed mutations under " + self.root + ": " + "; ".join(problems[:8])
            )

    def _unsupported(self, what: str) -> Callable[..., Any]:
        real = getattr(os, what)

        def fn(path: Any, *args: Any, **kw: Any) -> Any:
            if self._rel(path, kw.get("dir_fd")) is not None:
                raise RecorderError(f"os.{what} under the recorded root is not modelled")
            return real(path, *args, **kw)

        return fn

    # ------------------------------------------------------------ wrappers
    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        real = self._real(os, "open")
        with self._lock:
            rel = self._rel(path, dir_fd)
            if rel is None:
                return real(path, flags, mode, dir_fd=dir_fd)
            obj = self.live.resolve(rel)
            fd = real(path, flags, mode, dir_fd=dir_fd)
            if obj is None:
                if not flags & os.O_CREAT:
                    raise RecorderError(f"opened {rel!r}, which the model does not have")
                d, name = self._slot(rel)
                obj = self.live.new("f")
                self._record(Op("create", obj=obj, dir=d, name=name, where=rel))
            elif (
                flags & os.O_TRUNC and flags & (os.O_WRONLY | os.O_RDWR) and self.live.data.get(obj)
            ):
                self._record(Op("trunc", obj=obj, size=0, where=rel))
            self._fds[fd] = _Fd(obj, 0, rel)
            return fd

    def _close(self, fd: int) -> None:
        with self._lock:
            self._real(os, "close")(fd)
            self._fds.pop(fd, None)

    def _write(self, fd: int, data: Any) -> int:
        with self._lock:
            n = self._real(os, "write")(fd, data)
            f = self._fds.get(fd)
            if f is not None and n > 0:
                chunk = bytes(memoryview(data).cast("B")[:n])
                self._record(Op("write", obj=f.obj, offset=f.pos, data=chunk, where=f.path))
                f.pos += n
            return n  # type: ignore[no-any-return]

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self._lock:
            n = self._real(os, "pwrite")(fd, data, offset)
            f = self._fds.get(fd)
            if f is not None and n > 0:
                chunk = bytes(memoryview(data).cast("B")[:n])
                self._record(Op("write", obj=f.obj, offset=offset, data=chunk, where=f.path))
            return n  # type: ignore[no-any-return]

    def _ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            self._real(os, "ftruncate")(fd, size)
            f = self._fds.get(fd)
            if f is not None:
                self._record(Op("trunc", obj=f.obj, size=size, where=f.path))

    def _fsync(self, fd: int) -> None:
        with self._lock:
            self._real(os, "fsync")(fd)
            f = self._fds.get(fd)
            if f is not None:
                kind = "dsync" if self.live.kind.get(f.obj) == "d" else "fsync"
                self._record(Op(kind, obj=f.obj, where=f.path or "."))

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real = self._real(os, "mkdir")
        with self._lock:
            rel = self._rel(path, dir_fd)
            real(path, mode, dir_fd=dir_fd)
            if rel is None:
                return
            d, name = self._slot(rel)
            obj = self.live.new("d")
            self._record(Op("mkdir", obj=obj, dir=d, name=name, where=rel))

    def _rename(
        self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        real = self._real(os, "rename")
        with self._lock:
            rs, rd = self._rel(src, src_dir_fd), self._rel(dst, dst_dir_fd)
            if rs is None and rd is None:
                return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)  # type: ignore[no-any-return]
            if rs is None or rd is None:
                raise RecorderError(f"rename across the recorded root: {src!r} -> {dst!r}")
            obj, old = self.live.resolve(rs), self.live.resolve(rd)
            real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            self._record_rename(rs, rd, obj, old)

    def _record_rename(self, rs: str, rd: str, obj: int | None, old: int | None) -> None:
        if obj is None:
            raise RecorderError(f"renamed {rs!r}, which the model does not have")
        if obj == old:
            return  # renaming a name onto a link of the same file changes nothing
        self._record_between("rename", rs, rd, obj, old, "->")

    def _record_between(
        self, kind: str, rs: str, rd: str, obj: int, obj2: int | None, arrow: str
    ) -> None:
        """Record ``kind`` (rename, exchange) from the slot of ``rs`` to that of ``rd``."""
        d, n = self._slot(rs)
        d2, n2 = self._slot(rd)
        where = f"{rs} {arrow} {rd}"
        self._record(Op(kind, obj=obj, dir=d, name=n, dir2=d2, name2=n2, obj2=obj2, where=where))

    def _link(self, src: Any, dst: Any, **kw: Any) -> None:
        real = self._real(os, "link")
        with self._lock:
            rs = self._rel(src, kw.get("src_dir_fd"))
            rd = self._rel(dst, kw.get("dst_dir_fd"))
            real(src, dst, **kw)
            if rd is None:
                return
            obj = self.live.resolve(rs) if rs is not None else None
            if obj is None:
                raise RecorderError(f"link into the recorded root from outside: {src!r}")
            d, n = self._slot(rd)
            self._record(Op("link", obj=obj, dir=d, name=n, where=f"{rs} => {rd}"))

    def _remove(self, real: Callable[..., Any], kind: str, path: Any, dir_fd: int | None) -> None:
        with self._lock:
            rel = self._rel(path, dir_fd)
            if rel is None:
                real(path, dir_fd=dir_fd)
                return
            obj = self.live.resolve(rel)
            real(path, dir_fd=dir_fd)
            if obj is None:
                raise RecorderError(f"removed {rel!r}, which the model does not have")
            d, n = self._slot(rel)
            self._record(Op(kind, obj=obj, dir=d, name=n, where=rel))

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._remove(self._real(os, "unlink"), "unlink", path, dir_fd)

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._remove(self._real(os, "rmdir"), "rmdir", path, dir_fd)

    def _renameat2(self, real: Callable[..., int]) -> Callable[..., int]:
        def fn(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
            if flags and not self.exchange:
                ctypes.set_errno(errno.EINVAL)  # sshfs, NFS: no renameat2 flags
                return -1
            with self._lock:
                rs, rd = self._rel(old, None), self._rel(new, None)
                if rs is None and rd is None:
                    return real(olddirfd, old, newdirfd, new, flags)
                if rs is None or rd is None:
                    raise RecorderError(f"renameat2 across the recorded root: {old!r} {new!r}")
                a, b = self.live.resolve(rs), self.live.resolve(rd)
                rc = real(olddirfd, old, newdirfd, new, flags)
                if rc != 0:
                    return rc
                if flags & 2:  # RENAME_EXCHANGE
                    if a is None or b is None:
                        raise RecorderError(f"exchange of missing objects {rs!r} {rd!r}")
                    self._record_between("exchange", rs, rd, a, b, "<->")
                else:
                    self._record_rename(rs, rd, a, b)
                return rc

        return fn


class capability_profile:
    """Emulate a filesystem without ``renameat2`` flags (sshfs, NFS) without recording:
    for the recovery run of a state recorded with ``Recorder(..., exchange=False)``."""

    def __init__(self, exchange: bool):
        self.exchange = exchange
        self._saved: Any = None

    def __enter__(self) -> None:
        from atomic_checkpoint.storage import local

        if self.exchange or local._renameat2 is None:
            return
        real = self._saved = local._renameat2

        def refuse(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
            if flags:
                ctypes.set_errno(errno.EINVAL)
                return -1
            return real(olddirfd, old, newdirfd, new, flags)  # type: ignore[no-any-return]

        local._renameat2 = refuse

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            from atomic_checkpoint.storage import local

            local._renameat2 = self._saved
            self._saved = None


# ====================================================================== enumeration
def dependencies(ops: list[Op], *, parents: bool = True) -> list[frozenset[int]]:
    """For each entry operation, the earlier entry operations that must persist for it
    to persist: the previous change of each name it touches (changes of one name
    persist in order), the creation of what it links, for an rmdir or a rename onto a
    directory every removal from that directory, and (``parents``) the creation of the
    directories it changes.

    For creates, mkdirs and links the last kind only limits what may persist *by
    chance*: an fsync of a directory makes its entries durable, not the directory's
    own entry in its parent, so a durable entry in a directory whose creation is not
    durable is unreachable after the crash, not a reason to keep the directory
    (``crash_states`` closes the durable set with ``parents=False``). A rename into
    another directory is atomic, so it keeps the dependency on its new directory."""
    deps: list[frozenset[int]] = []
    last_slot: dict[tuple[int, str], int] = {}
    created_by: dict[int, int] = {}
    removals: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind not in ENTRY_KINDS:
            deps.append(frozenset())
            continue
        slots = [(op.dir, op.name)]
        if op.kind in ("rename", "exchange"):
            slots.append((op.dir2, op.name2))
        d = {last_slot[s] for s in slots if s in last_slot}
        if op.kind == "link" and op.obj in created_by:
            d.add(created_by[op.obj])
        # An entry cannot persist in a directory whose own creation did not. For a
        # rename or exchange between two directories this is atomicity (the object is
        # at one of its names after the crash, never moved into an unreachable
        # directory), so it holds even when the rename is durable; a created entry,
        # or one renamed within a directory, can be durable and unreachable.
        if parents:
            targets = {s[0] for s in slots}
        elif op.kind == "rename" and op.dir2 != op.dir:
            targets = {op.dir2}
        elif op.kind == "exchange" and op.dir2 != op.dir:
            targets = {op.dir, op.dir2}
        else:
            targets = set()
        d.update(created_by[t] for t in targets if t in created_by)
        if op.kind == "rmdir":
            d.update(removals.get(op.obj, ()))
        if op.kind == "rename" and op.obj2 is not None:
            d.update(removals.get(op.obj2, ()))
        deps.append(frozenset(d))
        for s in slots:
            last_slot[s] = i
        if op.kind in ("create", "mkdir"):
            created_by[op.obj] = i
        if op.kind in ("unlink", "rmdir", "rename"):
            removals.setdefault(op.dir, []).append(i)
    return deps


def covering_barriers(ops: list[Op]) -> list[int]:
    """For each operation, the index of the first later barrier that makes it durable
    (``len(ops)`` when none does): an entry change is durable once its directory is
    fsync'd (a rename or exchange once either of its directories is: one journal
    transaction), file data once the file is fsync'd. Barriers and marks cover
    themselves."""
    n = len(ops)
    cover = [n] * n
    pending_dir: dict[int, list[int]] = {}
    pending_data: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind in ENTRY_KINDS:
            pending_dir.setdefault(op.dir, []).append(i)
            if op.kind in ("rename", "exchange") and op.dir2 != op.dir:
                pending_dir.setdefault(op.dir2, []).append(i)
        elif op.kind in DATA_KINDS:
            pending_data.setdefault(op.obj, []).append(i)
        elif op.kind == "dsync":
            for j in pending_dir.pop(op.obj, []):
                cover[j] = min(cover[j], i)
            cover[i] = i
        elif op.kind == "fsync":
            for j in pending_data.pop(op.obj, []):
                cover[j] = min(cover[j], i)
            cover[i] = i
        else:
            cover[i] = i
    return cover


def _close_down(chosen: set[int], deps: list[frozenset[int]]) -> set[int]:
    out = set(chosen)
    stack = list(chosen)
    while stack:
        for d in deps[stack.pop()]:
            if d not in out:
                out.add(d)
                stack.append(d)
    return out


def _entry_subsets(
    volatile: list[int], deps: list[frozenset[int]], rng: random.Random, cap: int
) -> list[frozenset[int]]:
    """Downward-closed subsets of ``volatile`` (what of it persisted), at most ``cap``.

    First the structured ones, most telling first: none, all, all but each one (and
    what depends on it), each one alone (with its dependencies), every prefix (an
    ordered-metadata filesystem); then the others, drawn with ``rng`` (all of them
    when there are few volatile changes, random closed sets otherwise)."""
    vset = set(volatile)
    local = {i: deps[i] & vset for i in volatile}
    out: dict[frozenset[int], None] = {frozenset(): None, frozenset(volatile): None}
    for v in volatile:
        dependents = {v}
        for i in volatile:
            if local[i] & dependents:
                dependents.add(i)
        out[frozenset(vset - dependents)] = None
    for v in volatile:
        out[frozenset(_close_down({v}, local))] = None  # type: ignore[arg-type]
    for j in range(1, len(volatile)):
        out[frozenset(volatile[:j])] = None
    if len(out) >= cap:
        return list(out)[:cap]
    if len(volatile) <= 10:
        rest = []
        for mask in range(1 << len(volatile)):
            sub = {v for b, v in enumerate(volatile) if mask >> b & 1}
            if all(local[i] <= sub for i in sub) and frozenset(sub) not in out:
                rest.append(frozenset(sub))
        for sub in rng.sample(rest, min(len(rest), cap - len(out))):
            out[sub] = None
        return list(out)
    tries = 0
    while len(out) < cap and tries < cap * 4:
        tries += 1
        p = rng.random()
        pick = {v for v in volatile if rng.random() < p}
        out[frozenset(_close_down(pick, local))] = None  # type: ignore[arg-type]
    return list(out)


def _data_variants(old: bytes, new: bytes) -> list[tuple[str, bytes]]:
    """What a crash can leave of a file whose data went from ``old`` (durable) to
    ``new`` without an fsync: either, the new size with the blocks not written
    (zeros where the old file had none), new blocks up to a boundary then the rest not
    written, or the new content cut at a block boundary (the size persisted late)."""
    size_only = old[: len(new)] + bytes(max(0, len(new) - len(old)))
    out = [("old", old), ("new", new), ("size-only", size_only)]
    nblocks = -(-len(new) // BLOCK)
    for b in sorted({1, nblocks // 2, nblocks - 1}):
        if 0 < b < nblocks:
            out.append((f"torn@{b}", new[: b * BLOCK] + size_only[b * BLOCK :]))
            out.append((f"cut@{b}", new[: b * BLOCK]))
    seen: set[bytes] = set()
    unique = []
    for name, data in out:
        if data not in seen:
            seen.add(data)
            unique.append((name, data))
    return unique


@dataclass
class CrashState:
    """One state a power loss can leave.

    cut: the crash came after ``ops[:cut]`` completed. lost: the volatile entry
    changes that did not persist. data: per file path with unsynced data, which
    variant persisted. marks: the marks set before the crash. minimal: the tree with
    nothing volatile persisted (what the barriers guarantee at this cut).
    """

    cut: int
    ops: list[Op]
    lost: list[int]
    data: dict[str, str]
    marks: list[Op]
    tree: Tree
    minimal: Tree

    def describe(self) -> str:
        last = self.ops[self.cut - 1].describe() if self.cut else "nothing"
        parts = [f"crash after op {self.cut}/{len(self.ops)} ({last})"]
        if self.lost:
            parts.append("lost: " + "; ".join(self.ops[i].describe() for i in self.lost[:6]))
            if len(self.lost) > 6:
                parts[-1] += f"; +{len(self.lost) - 6} more"
        changed = {p: v for p, v in self.data.items() if v != "new"}
        if changed:
            parts.append(
                "unsynced data: " + ", ".join(f"{p}={v}" for p, v in sorted(changed.items()))
            )
        return "; ".join(parts)


def _paths_by_obj(tree: Tree) -> dict[int, str]:
    out: dict[int, str] = {}

    def walk(d: int, prefix: str) -> None:
        for name, i in tree.entries[d].items():
            out.setdefault(i, prefix + name)
            if tree.kind[i] == "d":
                walk(i, prefix + name + "/")

    walk(0, "")
    return out


def crash_states(
    baseline: Tree,
    ops: list[Op],
    *,
    per_cut: int = 64,
    seed: int = 0,
    cuts: list[int] | None = None,
) -> Iterator[CrashState]:
    """Every crash point (or those in ``cuts``), and for each up to ``per_cut`` states:
    the combinations of volatile entry changes (:func:`_entry_subsets`) and unsynced
    file data (:func:`_data_variants`), sampled with ``seed`` when there are more."""
    deps = dependencies(ops)
    hard = dependencies(ops, parents=False)
    cover = covering_barriers(ops)
    # Every object the operations create exists from the start, unlinked: a crash
    # state links the ones whose entries persisted.
    baseline = baseline.copy()
    for op in ops:
        if op.kind in ("create", "mkdir") and op.obj not in baseline.kind:
            baseline.kind[op.obj] = "d" if op.kind == "mkdir" else "f"
            if op.kind == "mkdir":
                baseline.entries[op.obj] = {}
            else:
                baseline.data[op.obj] = b""
    points = range(len(ops) + 1) if cuts is None else cuts
    for k in points:
        rng = random.Random(f"{seed}:{k}")
        forced = _close_down(
            {i for i in range(k) if ops[i].kind in ENTRY_KINDS and cover[i] < k}, hard
        )
        volatile = [i for i in range(k) if ops[i].kind in ENTRY_KINDS and i not in forced]
        # File data: durable up to the last fsync of each file before the cut.
        durable_data: dict[int, list[Op]] = {}
        all_data: dict[int, list[Op]] = {}
        for i in range(k):
            op = ops[i]
            if op.kind in DATA_KINDS:
                all_data.setdefault(op.obj, []).append(op)
                if cover[i] < k:
                    durable_data.setdefault(op.obj, []).append(op)
        base_min = baseline.copy()
        for i in sorted(forced):
            base_min.apply(ops[i])
        old_new: dict[int, tuple[bytes, bytes]] = {}
        for obj, dops in all_data.items():
            scratch = Tree()
            scratch.kind[obj] = "f"
            scratch.data[obj] = baseline.data.get(obj, b"")
            for op in durable_data.get(obj, []):
                scratch.apply(op)
            old = scratch.data[obj]
            for op in dops[len(durable_data.get(obj, [])) :]:
                scratch.apply(op)
            old_new[obj] = (old, scratch.data[obj])
        minimal = base_min.copy()
        for obj, (old, _) in old_new.items():
            minimal.data[obj] = old
        unsynced = [obj for obj, (old, new) in old_new.items() if old != new]
        variants = {obj: _data_variants(*old_new[obj]) for obj in unsynced}
        # Data choices: index per unsynced file into its variants (1 = "new").
        combos: list[dict[int, int]] = []
        n_combo = 1
        for obj in unsynced:
            n_combo *= len(variants[obj])
        if n_combo <= per_cut:
            for pick in itertools.product(*(range(len(variants[o])) for o in unsynced)):
                combos.append(dict(zip(unsynced, pick, strict=True)))
        else:
            combos.append({o: 1 for o in unsynced})
            combos.append({o: 0 for o in unsynced})
            for o in unsynced:
                for v in range(len(variants[o])):
                    if v != 1:
                        combos.append({**{x: 1 for x in unsynced}, o: v})
            while len(combos) < per_cut:
                combos.append({o: rng.randrange(len(variants[o])) for o in unsynced})
        subsets = _entry_subsets(volatile, deps, rng, per_cut)
        pairs: list[tuple[frozenset[int], dict[int, int]]]
        if len(subsets) * len(combos) <= per_cut:
            pairs = [(s, c) for s in subsets for c in combos]
        else:
            pairs = [(s, combos[0]) for s in subsets]
            full = frozenset(volatile)
            pairs += [(full, c) for c in combos[1:]] + [(frozenset(), c) for c in combos[1:]]
            while len(pairs) < per_cut:
                pairs.append((rng.choice(subsets), rng.choice(combos)))
            pairs = pairs[:per_cut]
        marks = [ops[i] for i in range(k) if ops[i].kind == "mark"]
        for subset, combo in pairs:
            # Everything persisted, in order, on top of the baseline.
            tree = baseline.copy()
            for i in sorted(forced | subset):
                tree.apply(ops[i])
            names = _paths_by_obj(tree)
            data_desc = {}
            for obj, (_old, new) in old_new.items():
                if obj in combo:
                    name, data = variants[obj][combo[obj]]
                else:
                    name, data = "new", new
                tree.data[obj] = data
                if obj in names and obj in combo:
                    data_desc[names[obj]] = name
            yield CrashState(
                cut=k,
                ops=ops,
                lost=sorted(set(volatile) - subset),
                data=data_desc,
                marks=marks,
                tree=tree,
                minimal=minimal,
            )


@dataclass
class Violation:
    kind: str
    detail: str
    state: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail} [{self.state}]"


@dataclass
class Exploration:
    """What :func:`explore` did: ``states`` distinct states checked, ``generated``
    states enumerated (before removing duplicates), ``cuts`` crash points enumerated,
    ``cuts_checked`` those with at least one state checked."""

    states: int = 0
    generated: int = 0
    cuts: int = 0
    cuts_checked: int = 0
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


_WORKER_CHECK: Any = None  # the check function, inherited by forked workers


def _work(task: tuple[int, str, CrashState, Any]) -> tuple[int, list[tuple[str, str]]]:
    n, path, state, e = task
    state.tree.materialise(path)
    try:
        return n, _WORKER_CHECK(path, state, e)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def explore(
    baseline: Tree,
    ops: list[Op],
    check: Callable[[str, CrashState, Any], list[tuple[str, str]]],
    workdir: str,
    *,
    expect: Callable[[CrashState], Any] = lambda s: None,
    per_cut: int = 64,
    seed: int = 0,
    max_states: int | None = None,
    cuts: list[int] | None = None,
    jobs: int = 1,
) -> Exploration:
    """Materialise each distinct crash state in a fresh directory under ``workdir`` and
    run ``check(path, state, expectation)``, which returns ``(kind, detail)`` pairs
    (kinds as in ``reliability.tally.VIOLATIONS``). ``expect(state)`` gives what must
    hold there (hashable): states with the same tree and the same expectation are
    checked once. ``max_states`` caps the distinct states checked, taken round robin
    over the crash points. ``jobs`` > 1 checks
    in that many forked processes (POSIX), which inherit ``check``."""
    global _WORKER_CHECK
    result = Exploration()
    seen: set[tuple[str, Any]] = set()
    cut_seen: set[int] = set()
    all_cuts: set[int] = set()
    described: dict[int, str] = {}

    def distinct() -> Iterator[tuple[CrashState, Any]]:
        for state in crash_states(baseline, ops, per_cut=per_cut, seed=seed, cuts=cuts):
            result.generated += 1
            all_cuts.add(state.cut)
            e = expect(state)
            key = (state.tree.fingerprint(), e)
            if key not in seen:
                seen.add(key)
                yield state, e

    def capped() -> Iterator[tuple[CrashState, Any]]:
        # Round robin over the crash points, so a cap still reaches the last ones
        # (after the commit and the return), not only the first states enumerated.
        by_cut: dict[int, list[tuple[CrashState, Any]]] = {}
        for state, e in distinct():
            by_cut.setdefault(state.cut, []).append((state, e))
        queues = [iter(v) for _, v in sorted(by_cut.items())]
        while queues:
            alive = []
            for q in queues:
                item = next(q, None)
                if item is not None:
                    yield item
                    alive.append(q)
            queues = alive

    def tasks() -> Iterator[tuple[int, str, CrashState, Any]]:
        chosen = distinct() if max_states is None else capped()
        for n, (state, e) in enumerate(chosen, start=1):
            if max_states is not None and n > max_states:
                break
            cut_seen.add(state.cut)
            described[n] = state.describe()
            # What a worker needs: the tree (the operations stay here).
            light = CrashState(
                state.cut, [], state.lost, state.data, state.marks, state.tree, Tree()
            )
            yield n, os.path.join(workdir, f"state-{n}"), light if jobs > 1 else state, e

    def collect(n: int, found: list[tuple[str, str]]) -> None:
        result.states += 1
        for kind, detail in found:
            result.counts[kind] = result.counts.get(kind, 0) + 1
            result.violations.append(Violation(kind, detail, described[n]))

    _WORKER_CHECK = check
    try:
        if jobs > 1:
            import multiprocessing

            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for n, found in pool.imap_unordered(_work, tasks(), chunksize=4):
                    collect(n, found)
        else:
            for task in tasks():
                collect(*_work(task))
    finally:
        _WORKER_CHECK = None
    result.violations.sort(key=lambda v: v.state)
    result.cuts = len(all_cuts)
    result.cuts_checked = len(cut_seen)
    return result
