"""Crash states on an object store (rule 4 of ``docs/crash-model.md``).

On S3, GCS or Azure a PUT or DELETE is atomic and durable when it returns: after a
power loss of the writer, the store holds exactly the requests that completed. So the
crash states of an operation are its prefixes: one per completed request. They are
recorded on fsspec's ``memory://`` filesystem, where one request is one assignment to
or deletion from ``MemoryFileSystem.store`` (the filesystem the library's contract
tests already run on), and each prefix is recovered like the filesystem states of
``reliability/crashstates.py``: a new manager (with the marker strategy, chosen by the
library for object stores), ``checkpoints()``, ``latest()``, ``restore()`` of every
listed step, a new save, ``close()``, ``atomic-checkpoint clean``.

Everything runs in one process (``memory://`` is in-process): the run lock of the
crashed operation belongs to this same process, which the lock counts as an earlier
manager that was never closed, so it is taken over like a dead holder's.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from reliability.crashsim import Exploration, Violation
from reliability.crashstates import (
    after_reboot,
    allowed_versions,
    recovered,
    restored_version,
    state_of,
)


@dataclass
class StoreOp:
    """One completed request: a PUT of ``data`` (``data`` None: a DELETE) of ``key``."""

    key: str
    data: bytes | None
    label: str = ""  # a mark ("committed") instead of a request
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.label:
            return f"mark {self.label} {self.info}"
        return f"{'PUT' if self.data is not None else 'DELETE'} {self.key}"


class _RecordingStore(dict):  # type: ignore[type-arg]
    """``MemoryFileSystem.store`` that records each completed PUT and DELETE."""

    def __init__(self, base: dict[str, Any], ops: list[StoreOp], prefix: str):
        super().__init__(base)
        self.ops = ops
        self.prefix = prefix

    def _mine(self, key: str) -> bool:
        return key == self.prefix or key.startswith(self.prefix + "/")

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        # memory:// shows a file opened for writing at once, empty, and fills it in
        # place; an object store PUTs it whole at close. An empty one is recorded when
        # it is closed (``_record_close``), a copy with its data right away.
        if self._mine(key) and value.getbuffer().nbytes:
            self.put(key, bytes(value.getbuffer()))

    def put(self, key: str, data: bytes) -> None:
        last = next((op for op in reversed(self.ops) if op.key == key), None)
        if last is None or last.data != data:
            self.ops.append(StoreOp(key, data))

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        if self._mine(key):
            self.ops.append(StoreOp(key, None))

    def pop(self, key: str, *default: Any) -> Any:
        had = key in self
        out = super().pop(key, *default)
        if had and self._mine(key):
            self.ops.append(StoreOp(key, None))
        return out


@contextlib.contextmanager
def recording(prefix: str) -> Iterator[list[StoreOp]]:
    """Record the requests under ``prefix`` (a ``memory://`` path, no protocol)."""
    from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

    ops: list[StoreOp] = []
    real = MemoryFileSystem.store
    store = MemoryFileSystem.store = _RecordingStore(real, ops, prefix)
    real_close = MemoryFile.close

    def close(self: Any) -> None:
        if not self.closed and store._mine(self.path) and store.get(self.path) is self:
            store.put(self.path, bytes(self.getbuffer()))
        real_close(self)

    MemoryFile.close = close  # type: ignore[method-assign]
    try:
        yield ops
    finally:
        MemoryFile.close = real_close  # type: ignore[method-assign]
        new = MemoryFileSystem.store
        real.clear()
        real.update(dict(new))
        MemoryFileSystem.store = real


def _snapshot(prefix: str) -> dict[str, bytes]:
    from fsspec.implementations.memory import MemoryFileSystem

    return {
        k: bytes(v.getbuffer())
        for k, v in MemoryFileSystem.store.items()
        if k == prefix or k.startswith(prefix + "/")
    }


def _materialise(objects: dict[str, bytes], old: str, new: str) -> None:
    from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

    fs = MemoryFileSystem()
    for key, data in objects.items():
        path = new + key[len(old) :]
        MemoryFileSystem.store[path] = MemoryFile(fs, path, data)


def _drop(prefix: str) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    for k in [k for k in MemoryFileSystem.store if k.startswith(prefix + "/")]:
        del MemoryFileSystem.store[k]
    MemoryFileSystem.pseudo_dirs[:] = [
        d for d in MemoryFileSystem.pseudo_dirs if not d.startswith(prefix)
    ]


@dataclass(frozen=True)
class StoreScenario:
    name: str
    prepare: Callable[[str], None]
    operate: Callable[[str, Callable[[str, dict[str, Any]], None]], None]
    initial: dict[int, int]
    saves: dict[int, int] = field(default_factory=dict)
    may_drop: frozenset[int] = frozenset()


def _mgr(url: str, **kw: Any) -> Any:
    from atomic_checkpoint import CheckpointManager

    kw.setdefault("timeout_s", 60.0)
    kw.setdefault("visibility_timeout_s", 2.0)
    return CheckpointManager(url, **kw)


def _prepare(steps: dict[int, int]) -> Callable[[str], None]:
    """The pre-state: ``steps`` saved by an earlier job (none: an empty bucket)."""

    def prepare(url: str) -> None:
        if not steps:
            return
        mgr = _mgr(url)
        for step, version in sorted(steps.items()):
            mgr.save(step, state_of(step, version))
        mgr.close()

    return prepare


def _save(step: int, version: int = 0, *, overwrite: bool = False, retention: Any = None):
    def operate(url: str, mark: Callable[[str, dict[str, Any]], None]) -> None:
        mgr = _mgr(url, retention=retention)
        mgr.save(step, state_of(step, version), overwrite=overwrite)
        mark("committed", {"step": step, "version": version})
        mgr.wait()
        mgr.close()

    return operate


def _rollback(to: int):
    def operate(url: str, mark: Callable[[str, dict[str, Any]], None]) -> None:
        mgr = _mgr(url)
        mgr.rollback(to)
        mark("rolled-back", {"to": to})
        mgr.close()

    return operate


def _scenario(
    name: str,
    initial: dict[int, int],
    operate: Callable[[str, Callable[[str, dict[str, Any]], None]], None],
    saves: dict[int, int] | None = None,
    may_drop: Iterable[int] = (),
) -> StoreScenario:
    """``name/memory``: ``operate`` on a bucket holding ``initial``."""
    return StoreScenario(
        f"{name}/memory", _prepare(initial), operate, initial, saves or {}, frozenset(may_drop)
    )


def scenarios() -> dict[str, StoreScenario]:
    from atomic_checkpoint import CheckpointManager, KeepLast

    out = [
        _scenario("save", {1: 0}, _save(2), {2: 0}),
        _scenario("overwrite", {1: 0, 2: 0}, _save(2, 1, overwrite=True), {2: 1}),
        _scenario(
            "retention", {1: 0, 2: 0}, _save(3, retention=KeepLast(1)), {3: 0}, may_drop={1, 2}
        ),
        _scenario("first-start", {}, _save(1), {1: 0}),
    ]
    if hasattr(CheckpointManager, "rollback"):
        out.append(_scenario("rollback", {1: 0, 2: 0, 3: 0}, _rollback(1), may_drop={2, 3}))
    return {s.name: s for s in out}


def _check(url: str, scen: StoreScenario, need: dict[int, set[int]], rolled: int | None):
    """Recover ``url`` and check it (see ``reliability.crashstates`` for the kinds)."""
    with after_reboot():
        return recovered(
            lambda: _mgr(url), url, allowed_versions(scen), need.items(), rolled, restored_version
        )


def run_scenario(name: str | StoreScenario) -> Exploration:
    """Record scenario ``name`` on ``memory://`` and recover every prefix of it."""
    scen = scenarios()[name] if isinstance(name, str) else name
    bucket = f"/crashstore-{uuid.uuid4().hex[:8]}"
    root = f"{bucket}/root"
    url = f"memory://{root}"
    scen.prepare(url)
    baseline = _snapshot(root)
    marks: list[StoreOp] = []
    with recording(root) as ops:

        def mark(label: str, info: dict[str, Any]) -> None:
            ops.append(StoreOp("", None, label=label, info=info))

        scen.operate(url, mark)
    del marks
    result = Exploration()
    seen: set[tuple[tuple[tuple[str, bytes], ...], Any]] = set()
    objects = dict(baseline)
    for k in range(len(ops) + 1):
        if k:
            op = ops[k - 1]
            if not op.label:
                if op.data is None:
                    objects.pop(op.key, None)
                else:
                    objects[op.key] = op.data
        result.generated += 1
        need = {s: {v} for s, v in scen.initial.items() if s not in scen.may_drop}
        for s in need:
            if s in scen.saves:
                need[s].add(scen.saves[s])
        rolled = None
        for op in ops[:k]:
            if op.label == "committed":
                need[op.info["step"]] = {op.info["version"]}
            elif op.label == "rolled-back":
                rolled = op.info["to"]
        key = (
            tuple(sorted(objects.items())),
            (tuple(sorted((s, tuple(v)) for s, v in need.items())), rolled),
        )
        if key in seen:
            continue
        seen.add(key)
        state_root = f"{bucket}-s{k}/root"
        _materialise(objects, root, state_root)
        try:
            found = _check(f"memory://{state_root}", scen, need, rolled)
        finally:
            _drop(f"{bucket}-s{k}")
        result.states += 1
        where = f"crash after request {k}/{len(ops)} ({ops[k - 1].describe() if k else 'nothing'})"
        for kind, detail in found:
            result.counts[kind] = result.counts.get(kind, 0) + 1
            result.violations.append(Violation(kind, detail, where))
    result.cuts = result.cuts_checked = len(ops) + 1
    _drop(bucket)
    return result
