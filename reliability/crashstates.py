"""The ``crash-states`` campaign: every protocol operation, every crash state.

Each scenario builds a durable pre-state in one process (forked, so a manager it
leaves open leaves its run lock to a process that is gone), then runs one protocol
operation in another under :class:`reliability.crashsim.Recorder`; that process is
gone too when recovery runs, as after a power loss. Every crash state of
the recorded operations (:func:`reliability.crashsim.crash_states`) is materialised
in a fresh directory and recovered the way a restarted job and its operator would: a
new ``CheckpointManager`` on the root (run lock takeover, sweep), ``checkpoints()``,
``latest()``, ``restore()`` of every listed step, a new save, ``close()``, then
``atomic-checkpoint clean``. Checked there:

- ``torn``: a listed checkpoint that does not restore bit-exactly to a version that
  was saved under that step (or a step nobody saved);
- ``lost``: a checkpoint durably committed before the crash is not listed. Durably
  committed: in the pre-state (unless the operation's retention may delete it), or
  its ``save()`` returned, or its commit barrier was reached (the state with no
  volatile change persisted already holds its new manifest);
- ``stuck``: the start, a listed restore, the next save, ``close()`` or ``clean``
  raised or failed: a human would have to repair the root;
- ``leaks``: ``.pending/`` or ``.trash/`` still hold something after that start and
  ``clean``, a ``checkpoint-<step>/`` still holds an in-progress marker or has no
  manifest (empty, or data without a marker: nothing would ever remove it), or a
  temporary file of an atomic write is left anywhere in ROOT.

After ``rollback()`` returned, the next save is of the step right above the one rolled
back to: the removed steps must not come back. Recovery runs ``REBOOT_S`` after the
crash, without fsyncs of its own (its durability is what the other scenarios test).

    python -m reliability.crashstates [--scenario NAME] [--per-cut N] [--max-states N]

prints the states explored per scenario and every violation with its crash state
(the operation it crashed after, the volatile changes lost, the unsynced files torn).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

if __package__ in (None, ""):  # run by its path: make the repository importable
    import _repo_on_path  # noqa: F401  (reliability/_repo_on_path.py)

from reliability import run_module
from reliability.crashsim import (
    CrashState,
    Exploration,
    Recorder,
    Tree,
    capability_profile,
    explore,
)

MANIFEST = "checkpoint.manifest.json"
_N = 2000  # float64 values per state: 16000 bytes, four 4 KiB blocks
WIDE = 6  # checkpoints one rotation deletes, crashed saves one sweep removes (*-wide)


def state_of(step: int, version: int = 0) -> dict[str, Any]:
    """The state saved as ``step`` (``version`` > 0: an overwrite's new content)."""
    import numpy as np

    return {"w": np.arange(_N, dtype=np.float64) + step * 1000 + version * 0.5}


def files_of(step: int, version: int = 0) -> dict[str, bytes]:
    """What a ``saving()`` block writes as ``step``: a file at the top and one in a
    directory that holds only a directory (DESIGN invariant 2: every directory on the
    way is fsync'd, not only the parents of files)."""
    tag = f"{step}.{version}".encode()
    return {
        "config.json": b'{"step": "' + tag + b'"}',
        "model/shards/weights.bin": tag * (9000 // len(tag)),
    }


def _write_files(directory: str, files: dict[str, bytes]) -> None:
    """Write like user code does (``save_pretrained``): no fsync of its own."""
    for rel, data in files.items():
        path = os.path.join(directory, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


def _same(got: Any, want: dict[str, Any]) -> bool:
    import numpy as np

    return (
        isinstance(got, dict)
        and set(got) == set(want)
        and all(np.array_equal(np.asarray(got[k]), want[k]) for k in want)
    )


# ============================================================================ scenarios
Record = Callable[[], Recorder]


@dataclass(frozen=True)
class Scenario:
    """One protocol operation under test.

    prepare(root): builds the pre-state (its own process; ``os._exit`` follows, so a
    manager left open leaves its run lock to a dead process). operate(root, record):
    runs the operation, recording inside ``with record() as rec`` and marking
    ``rec.mark("committed", step=S, version=V)`` where a ``save()`` returned.
    initial: step -> version committed in the pre-state. saves: step -> version the
    operation saves. may_drop: initial steps the operation's retention may delete.
    exchange: False emulates a filesystem without renameat2 flags (sshfs, NFS).
    strategy: the commit strategy forced on every manager (None: automatic).
    """

    name: str
    prepare: Callable[[str], None]
    operate: Callable[[str, Record], None]
    initial: dict[int, int]
    saves: dict[int, int] = field(default_factory=dict)
    may_drop: frozenset[int] = frozenset()
    exchange: bool = True
    strategy: str | None = None
    retention: Any = None
    direct_io: bool = False
    files: bool = False  # saved with saving() (files_of), not save() (state_of)
    tiered: bool = False  # ROOT/fast and ROOT/slow of a TieredCheckpointManager


def _manager(root: str, scen: Scenario, **kw: Any) -> Any:
    from atomic_checkpoint import CheckpointManager

    kw.setdefault("timeout_s", 60.0)
    kw.setdefault("visibility_timeout_s", 2.0)
    return CheckpointManager(root, strategy=scen.strategy, **kw)


def _opened(root: str, **kw: Any) -> Any:
    """A manager of ``root`` with the current scenario's commit strategy and otherwise
    the library's defaults: as the operation under test (or its preparation) opens it."""
    from atomic_checkpoint import CheckpointManager

    return CheckpointManager(root, strategy=_CURRENT.strategy, **kw)


def _saved(steps: dict[int, int], *, close: bool = True) -> Callable[[str], None]:
    def prepare(root: str) -> None:
        mgr = _opened(root)
        for step, version in sorted(steps.items()):
            mgr.save(step, state_of(step, version))
        mgr.wait()
        if close:
            mgr.close()

    return prepare


def _operation(act: Callable[[Any, Any], None]) -> Callable[[str, Record], None]:
    """The operation ``act(mgr, rec)`` on a manager opened before recording starts (with
    the scenario's retention), then the manager's ``close()``, recorded too."""

    def operate(root: str, record: Record) -> None:
        mgr = _opened(root, retention=_CURRENT.retention)
        with record() as rec:
            act(mgr, rec)
            mgr.close()

    return operate


@contextlib.contextmanager
def _no_room_for(*names: str) -> Iterator[None]:
    """A full disk as far as the directories ``names`` are concerned: creating one fails
    with ENOSPC (the recorder's ``os.mkdir`` is wrapped, so nothing is recorded for it).
    The deletions of a rotation are what would free the space, and the rename strategy
    then un-commits into a directory of ours that exists (``.pending/``, else
    ``.atomic-checkpoint/``) instead of a new ``.trash/``."""
    recorded = os.mkdir

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        where = os.fspath(path)
        if os.path.basename(where.rstrip("/")) in names and not os.path.isdir(where):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)
        recorded(path, *args, **kwargs)

    os.mkdir = mkdir  # type: ignore[assignment]
    try:
        yield
    finally:
        os.mkdir = recorded


def _full_disk(full: bool | str) -> contextlib.AbstractContextManager[None]:
    """``full``: False, True (no room for ``.trash/``), or ``"pending too"`` (no room
    for ``.pending/`` either, on a root that has none: one of adopted checkpoints)."""
    from atomic_checkpoint.layout import PENDING_DIR, TRASH_DIR

    if not full:
        return contextlib.nullcontext()
    return _no_room_for(TRASH_DIR, *([PENDING_DIR] if full == "pending too" else []))


def _without_pending(prepare: Callable[[str], None]) -> Callable[[str], None]:
    """``prepare``, then ``.pending/`` and ``.trash/`` removed (empty after a clean
    close): a root whose checkpoints were adopted, never staged there."""

    def without(root: str) -> None:
        from atomic_checkpoint.layout import PENDING_DIR, TRASH_DIR

        prepare(root)
        for name in (PENDING_DIR, TRASH_DIR):
            if os.path.isdir(os.path.join(root, name)):
                os.rmdir(os.path.join(root, name))

    return without


def _op_save(
    step: int,
    version: int = 0,
    *,
    overwrite: bool = False,
    asynchronous: bool = False,
    full_disk: bool | str = False,
):
    def act(mgr: Any, rec: Any) -> None:
        with _full_disk(full_disk):
            if asynchronous:
                mgr.save_async(step, state_of(step, version), overwrite=overwrite).result()
            else:
                mgr.save(step, state_of(step, version), overwrite=overwrite)
            rec.mark("committed", step=step, version=version)
            mgr.wait()

    return _operation(act)


def _op_saving(step: int):
    def act(mgr: Any, rec: Any) -> None:
        with mgr.saving(step) as d:
            _write_files(str(d), files_of(step))
        rec.mark("committed", step=step, version=0)

    return _operation(act)


def _prepare_saving(steps: list[int]) -> Callable[[str], None]:
    def prepare(root: str) -> None:
        mgr = _opened(root)
        for step in steps:
            with mgr.saving(step) as d:
                _write_files(str(d), files_of(step))
        mgr.close()

    return prepare


def _op_failing(step: int, version: int, point: str, *, overwrite: bool = False):
    """A ``save`` that fails where fault point ``point`` raises, then ``wait()``: the
    save's own clean-up (the strategy's ``discard``, an overwrite's put-back) is what
    the crash cuts."""

    def act(mgr: Any, rec: Any) -> None:
        os.environ["ATOMIC_CHECKPOINT_FAULTS"] = f"{point}@*=raise"
        try:
            mgr.save(step, state_of(step, version), overwrite=overwrite)
        except Exception:
            pass
        finally:
            os.environ.pop("ATOMIC_CHECKPOINT_FAULTS", None)
        rec.mark("failed")
        mgr.wait()

    return _operation(act)


def _op_rollback(to: int, *, full_disk: bool | str = False):
    def act(mgr: Any, rec: Any) -> None:
        with _full_disk(full_disk):
            mgr.rollback(to)
        rec.mark("rolled-back", to=to)

    return _operation(act)


def _op_prune(keep_last: int, *, full_disk: bool | str = False):
    """``atomic-checkpoint prune ROOT --keep-last N`` as a user runs it (in process, so
    recorded), on a disk as full as ``full_disk`` says."""

    def operate(root: str, record: Record) -> None:
        from atomic_checkpoint.cli import main as cli_main

        out = io.StringIO()
        with record(), _full_disk(full_disk):
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                rc = cli_main(["prune", root, "--keep-last", str(keep_last)])
            if rc != 0:
                raise RuntimeError(f"prune exited {rc}: {out.getvalue()[-500:]}")

    return operate


def _op_start(save_step: int | None = None):
    """A start on the root (run.json, lock acquire or takeover, sweep), optionally a
    first save, then close."""

    def operate(root: str, record: Record) -> None:
        with record() as rec:
            mgr = _opened(root)
            rec.mark("started")
            if save_step is not None:
                mgr.save(save_step, state_of(save_step))
                rec.mark("committed", step=save_step, version=0)
            mgr.close()

    return operate


def _prepare_crashed(root: str) -> None:
    """Checkpoints 1 and 2, then what a crashed save and a crashed rotation leave:
    a pending attempt and a trash entry; the job dies holding the run lock."""
    mgr = _opened(root)
    mgr.save(1, state_of(1))
    mgr.save(2, state_of(2))
    mgr.wait()
    if _CURRENT.strategy != "marker":
        shutil.copytree(
            os.path.join(root, "checkpoint-2"), f"{root}/.pending/checkpoint-3.0a1b2c3d4e5f6a7b"
        )
        os.remove(f"{root}/.pending/checkpoint-3.0a1b2c3d4e5f6a7b/{MANIFEST}")
        shutil.copytree(
            os.path.join(root, "checkpoint-1"), f"{root}/.trash/checkpoint-0.9f8e7d6c5b4a3928"
        )
    else:
        # A marker save that crashed: in-progress marker and data, no manifest.
        from atomic_checkpoint.strategies import MarkerStrategy

        storage = mgr.storage
        pending = MarkerStrategy().prepare(storage, 3, "0a1b2c3d4e5f6a7b")
        with storage.open_write(f"{pending}/rank-00000.safetensors") as w:
            w.write(b"\0" * 5000)
    os.sync()
    # No close: the lock stays with this process, which exits now.


def _prepare_interrupted_overwrite(root: str) -> None:
    """Checkpoints 1 and 2 (version 0), then what an overwrite of step 2 (version 1)
    without RENAME_EXCHANGE leaves when it crashes between its two renames: the old
    copy in ``.trash/checkpoint-2.<a>.replaced``, the new one, whole, in
    ``.pending/checkpoint-2.<a>``, step 2 absent; the job dies holding the run lock.
    The next start's ``recover_replaced`` must put a complete copy back durably
    before its sweep deletes the other one."""
    mgr = _opened(root)
    mgr.save(1, state_of(1))
    mgr.save(2, state_of(2))
    mgr.wait()
    attempt = "0a1b2c3d4e5f6a7b"
    old = os.path.join(root, ".trash", f"checkpoint-2.{attempt}.replaced")
    os.makedirs(os.path.dirname(old), exist_ok=True)
    shutil.copytree(os.path.join(root, "checkpoint-2"), old)
    mgr.save(2, state_of(2, 1), overwrite=True)
    mgr.wait()
    os.rename(os.path.join(root, "checkpoint-2"), f"{root}/.pending/checkpoint-2.{attempt}")
    os.sync()
    # No close: the lock stays with this process, which exits now.


def _prepare_many_crashed(n: int) -> Callable[[str], None]:
    """Checkpoint 1, then ``n`` crashed saves' leftovers (and, with the rename strategy,
    ``n`` crashed rotations' trash): the sweep of the next start deletes them all."""

    def prepare(root: str) -> None:
        from atomic_checkpoint.strategies import MarkerStrategy

        mgr = _opened(root)
        mgr.save(1, state_of(1))
        mgr.wait()
        for i in range(n):
            step = 10 + i
            if _CURRENT.strategy != "marker":
                src = os.path.join(root, "checkpoint-1")
                shutil.copytree(src, f"{root}/.pending/checkpoint-{step}.{i:016x}")
                os.remove(f"{root}/.pending/checkpoint-{step}.{i:016x}/{MANIFEST}")
                shutil.copytree(src, f"{root}/.trash/checkpoint-{step}.{i:016x}")
            else:
                pending = MarkerStrategy().prepare(mgr.storage, step, f"{i:016x}")
                for r in range(2):
                    with mgr.storage.open_write(f"{pending}/rank-{r:05d}.safetensors") as w:
                        w.write(b"\1" * 5000)
        os.sync()

    return prepare


def _prepare_dead_holder(root: str) -> None:
    """Checkpoint 1, then the job dies holding the run lock."""
    mgr = _opened(root)
    mgr.save(1, state_of(1))
    mgr.wait()


def _prepare_empty(root: str) -> None:
    os.makedirs(root, exist_ok=True)


#: The storages every basic scenario runs on: the commit strategy and whether the
#: filesystem has renameat2 flags.
_STORAGES: dict[str, dict[str, Any]] = {
    "local": {},
    "no-exchange": {"exchange": False},
    "marker": {"strategy": "marker"},
}


def _on(storage: str, templates: list[Scenario], **settings: Any) -> list[Scenario]:
    """The ``templates`` as ``<name>/<storage>``, with ``settings`` (the storage's
    ``exchange``, ``strategy``, ``direct_io``)."""
    return [replace(t, name=f"{t.name}/{storage}", **settings) for t in templates]


def _scenarios() -> list[Scenario]:
    from atomic_checkpoint import CheckpointManager, KeepLast

    save = Scenario("save", _saved({1: 0}), _op_save(2), {1: 0}, {2: 0})
    async_save = Scenario(
        "async-save", _saved({1: 0}), _op_save(2, asynchronous=True), {1: 0}, {2: 0}
    )
    basic = [
        save,
        Scenario(
            "overwrite", _saved({1: 0, 2: 0}), _op_save(2, 1, overwrite=True), {1: 0, 2: 0}, {2: 1}
        ),
        Scenario(
            "retention",
            _saved({1: 0, 2: 0}),
            _op_save(3),
            {1: 0, 2: 0},
            {3: 0},
            may_drop=frozenset({1, 2}),
            retention=KeepLast(1),
        ),
        Scenario("sweep", _prepare_crashed, _op_start(), {1: 0, 2: 0}),
        Scenario("takeover", _prepare_dead_holder, _op_start(2), {1: 0}, {2: 0}),
        Scenario("first-start", _prepare_empty, _op_start(1), {}, {1: 0}),
        async_save,
    ]
    out = [s for storage, settings in _STORAGES.items() for s in _on(storage, basic, **settings)]
    # A start after an overwrite without RENAME_EXCHANGE crashed between its two
    # renames: recover_replaced's rename back and its fsyncs are recorded too.
    out += _on(
        "no-exchange",
        [
            Scenario(
                "recover-replaced",
                _prepare_interrupted_overwrite,
                _op_start(),
                {1: 0, 2: 0},
                {2: 1},
            ),
            Scenario(
                "failed-overwrite",
                _saved({1: 0, 2: 0}),
                # fails between the two renames of an overwrite without RENAME_EXCHANGE
                _op_failing(2, 1, "mid_replace", overwrite=True),
                {1: 0, 2: 0},
                {2: 1},
            ),
        ],
        **_STORAGES["no-exchange"],
    )
    # A save that fails after every rank reported its files (the commit began): the
    # attempt is discarded (with the marker strategy, its data before its marker), and
    # no crash during that may leave step 2 listed or leftovers a start cannot remove.
    out += [
        s
        for storage in ("local", "marker")
        for s in _on(
            storage,
            [Scenario("failed-save", _saved({1: 0}), _op_failing(2, 0, "after_manifest"), {1: 0})],
            **_STORAGES[storage],
        )
    ]
    with_files = [
        Scenario("saving", _prepare_saving([1]), _op_saving(2), {1: 0}, {2: 0}, files=True)
    ]
    if hasattr(CheckpointManager, "rollback"):
        with_files.append(
            Scenario(
                "rollback",
                _saved({1: 0, 2: 0, 3: 0}),
                _op_rollback(1),
                {1: 0, 2: 0, 3: 0},
                may_drop=frozenset({2, 3}),
            )
        )
    for storage in ("local", "marker"):
        out += _on(storage, with_files, **_STORAGES[storage])
    # A rotation and a rollback on a full disk: ``.trash/`` cannot be created, so the
    # rename strategy un-commits into ``.pending/`` (strategies._trash_dir). The marker
    # strategy writes its marker and needs no new directory: rename strategies only.
    full = [
        Scenario(
            "retention-full-disk",
            _saved({1: 0, 2: 0}),
            _op_save(3, full_disk=True),
            {1: 0, 2: 0},
            {3: 0},
            may_drop=frozenset({1, 2}),
            retention=KeepLast(1),
        ),
        Scenario(
            "rollback-full-disk",
            _saved({1: 0, 2: 0, 3: 0}),
            _op_rollback(1, full_disk=True),
            {1: 0, 2: 0, 3: 0},
            may_drop=frozenset({2, 3}),
        ),
        # `prune` (which the full-disk errors advise) on a root of adopted checkpoints,
        # with no .pending/ and no room for .trash/ nor .pending/: the un-commit goes
        # into .atomic-checkpoint/ (it holds the run lock, so it exists).
        Scenario(
            "prune-full-disk-adopted",
            _without_pending(_saved({1: 0, 2: 0, 3: 0})),
            _op_prune(1, full_disk="pending too"),
            {1: 0, 2: 0, 3: 0},
            may_drop=frozenset({1, 2}),
        ),
    ]
    for storage in ("local", "no-exchange"):
        out += _on(storage, full, **_STORAGES[storage])
    # Wide operations, for the state count of --full: one rotation deleting WIDE
    # checkpoints, one start sweeping WIDE crashed saves (their deletes are volatile
    # together: up to 5**WIDE combinations at one crash point).
    steps = {s: 0 for s in range(1, WIDE + 1)}
    wide = [
        Scenario(
            "retention-wide",
            _saved(steps),
            _op_save(WIDE + 1),
            steps,
            {WIDE + 1: 0},
            may_drop=frozenset(steps),
            retention=KeepLast(1),
        ),
        Scenario("sweep-wide", _prepare_many_crashed(WIDE), _op_start(), {1: 0}),
    ]
    for storage, settings in _STORAGES.items():
        out += _on(storage, wide, **settings)
    out += _on("local-odirect", [save, async_save], direct_io=True)
    out += _tiered_scenarios()
    return out


SCENARIOS: dict[str, Scenario] = {}
_CURRENT: Scenario = None  # type: ignore[assignment]  # set in the child processes


def scenarios() -> dict[str, Scenario]:
    if not SCENARIOS:
        SCENARIOS.update({s.name: s for s in _scenarios()})
    return SCENARIOS


# ============================================================================ tiered
# A TieredCheckpointManager with ROOT/fast as tier 0 and ROOT/slow as the persistent
# tier, both on the recorded filesystem: one power loss hits both (the worst case; on
# separate machines each tier's crash states are a subset of these). ``retention`` is
# (tier 0's KeepLast, tier 1's KeepLast), None for keep-all.


def _tiers(root: str, keep: Any) -> list[Any]:
    from atomic_checkpoint import KeepLast, Tier

    fast_keep, slow_keep = keep or (None, None)
    return [
        Tier(os.path.join(root, "fast"), retention=KeepLast(fast_keep) if fast_keep else None),
        Tier(os.path.join(root, "slow"), retention=KeepLast(slow_keep) if slow_keep else None),
    ]


def _prepare_tiered(steps: list[int]) -> Callable[[str], None]:
    def prepare(root: str) -> None:
        from atomic_checkpoint import TieredCheckpointManager

        mgr = TieredCheckpointManager(_tiers(root, _CURRENT.retention))
        for step in steps:
            mgr.save(step, state_of(step))
            if not mgr.wait_replicated(step, timeout_s=60):
                raise RuntimeError(f"step {step} was not replicated")
        mgr.close()
        os.sync()

    return prepare


def _op_tiered(steps: list[int], *, block: int | None = None):
    """Save ``steps`` on tier 0 and wait until the persistent tier has them. With
    ``block``, replication of that step fails (an injected EIO mid-copy: the attempt
    is discarded) until every step was saved, so tier 0's rotation meets a step that
    exists nowhere else and must hold it."""

    def operate(root: str, record: Record) -> None:
        from atomic_checkpoint import TieredCheckpointManager
        from atomic_checkpoint._faults import ENV

        mgr = TieredCheckpointManager(_tiers(root, _CURRENT.retention), retry_max_s=0.05)
        if not mgr.wait_replicated(timeout_s=60):  # reconciled before recording
            raise RuntimeError("the pre-state's steps were not replicated")
        with record() as rec:
            if block is not None:
                os.environ[ENV] = f"mid_replicate@0=raise:{block}"
            for step in steps:
                mgr.save(step, state_of(step))
                rec.mark("committed", step=step, version=0)
            os.environ.pop(ENV, None)
            for step in steps:
                if not mgr.wait_replicated(step, timeout_s=60):
                    raise RuntimeError(f"step {step} was not replicated")
                rec.mark("persisted", step=step)
            if mgr.close() != []:
                raise RuntimeError("close() left steps unreplicated")

    return operate


def _op_tiered_rollback(to: int):
    """``rollback(to)`` of a tiered job whose steps are on both tiers: tier 1 first
    (through the replicator), then tier 0; marked once it returned."""

    def operate(root: str, record: Record) -> None:
        from atomic_checkpoint import TieredCheckpointManager

        mgr = TieredCheckpointManager(_tiers(root, _CURRENT.retention), retry_max_s=0.05)
        if not mgr.wait_replicated(timeout_s=60):  # reconciled before recording
            raise RuntimeError("the pre-state's steps were not replicated")
        with record() as rec:
            mgr.rollback(to)
            rec.mark("rolled-back", step=to)
        mgr.close()

    return operate


def _tiered_expectation(trace: Trace, state: CrashState) -> Any:
    """Which steps were acknowledged on tier 0 (``save`` returned) and as persisted
    (``wait_replicated`` returned True) before the crash, and the step a returned
    ``rollback()`` went back to."""
    wanted = ("committed", "persisted", "rolled-back")
    marks = [(m.label, m.info["step"]) for m in state.marks if m.label in wanted]
    return tuple(sorted(marks))


def _tier_view(path: str, allowed: dict[int, set[int]]) -> tuple[set[int], list[tuple[str, str]]]:
    """A tier's valid steps after the crash, read-only (nothing repaired yet), each
    restored bit-exactly or reported ``torn``."""
    from atomic_checkpoint import CheckpointManager

    if not os.path.isdir(path):
        return set(), []
    found: list[tuple[str, str]] = []
    reader = CheckpointManager(path, read_only=True)
    steps = {c.step for c in reader.checkpoints()}
    for step in sorted(steps):
        if step not in allowed:
            found.append(("torn", f"{path}: step {step} is listed but was never saved"))
            continue
        try:
            got = reader.restore(step=step)
        except Exception as exc:
            found.append(("torn", f"{path}: restore(step={step}): {type(exc).__name__}: {exc}"))
            continue
        if not any(_same(got, state_of(step, v)) for v in allowed[step]):
            found.append(("torn", f"{path}: step {step} restores to content nobody saved"))
    reader.close()
    return steps, found


def _check_tiered(path: str, state: CrashState, need: Any, trace: Trace) -> list[tuple[str, str]]:
    """Recover a tiered root: first read each tier as the crash left it (a step
    acknowledged as persisted must be on the persistent tier; a step acknowledged on
    tier 0 must be on some tier: retention never deleted its only copy), then start
    the tiered job, which must finish replication, restore, save, close and clean."""
    from atomic_checkpoint import TieredCheckpointManager

    scen = trace.scenario
    allowed = allowed_versions(scen)
    fast, slow = os.path.join(path, "fast"), os.path.join(path, "slow")
    found: list[tuple[str, str]] = []
    on_fast, bad = _tier_view(fast, allowed)
    found += bad
    on_slow, bad = _tier_view(slow, allowed)
    found += bad
    committed = {s for label, s in need if label == "committed"}
    persisted = {s for label, s in need if label == "persisted"}
    rolled = max((s for label, s in need if label == "rolled-back"), default=None)
    for step in sorted(persisted - on_slow):
        found.append(("lost", f"step {step} was acknowledged as persisted and is not on {slow}"))
    kept = committed | (set(scen.initial) - scen.may_drop)
    for step in sorted(kept - on_fast - on_slow):
        found.append(("lost", f"step {step} is on no tier (tier 0: {on_fast}, 1: {on_slow})"))
    try:
        mgr = TieredCheckpointManager(_tiers(path, scen.retention), retry_max_s=0.05)
    except Exception as exc:
        return [*found, ("stuck", f"the next start failed: {type(exc).__name__}: {exc}")]
    try:
        if not mgr.wait_replicated(timeout_s=60):
            found.append(("stuck", f"replication did not finish: {mgr.replication_backlog()}"))
        held = {c.step: c.tiers for c in mgr.checkpoints()}
        for step in sorted(committed):
            if 1 not in held.get(step, ()):
                found.append(("lost", f"step {step} did not reach {slow} after the restart"))
        back = sorted(s for s in held if rolled is not None and s > rolled)
        if back:  # a returned rollback: what it removed never comes back, on any tier
            found.append(("torn", f"steps {back}, rolled back to {rolled}, are back: {held}"))
        if held:
            newest = max(held)
            got = mgr.restore()
            if not any(_same(got, state_of(newest, v)) for v in allowed.get(newest, ())):
                found.append(("torn", f"restore() of step {newest} gave content nobody saved"))
        # After a returned rollback the job saves right above its step.
        nxt = max([*held, *allowed, 0]) + 1 if rolled is None else rolled + 1
        mgr.save(nxt, state_of(nxt))
        if not mgr.wait_replicated(nxt, timeout_s=60):
            found.append(("stuck", f"the next save {nxt} was not replicated"))
    except Exception as exc:
        found.append(("stuck", f"recovery failed: {type(exc).__name__}: {exc}"))
    finally:
        try:
            if mgr.close(timeout_s=60):
                found.append(("stuck", "close() left steps unreplicated"))
        except Exception as exc:
            found.append(("stuck", f"close() failed: {type(exc).__name__}: {exc}"))
    for tier in (fast, slow):
        found += cleaned(tier)
        found += [(kind, f"{tier}: {detail}") for kind, detail in _leftovers(tier)]
    return found


def _tiered_scenarios() -> list[Scenario]:
    return [
        # One step's replication: copy, read-back, publish on tier 1.
        Scenario(
            "tiered-replicate/local",
            _prepare_tiered([1]),
            _op_tiered([2]),
            {1: 0},
            {2: 0},
            tiered=True,
        ),
        # Cross-tier retention: tier 0 keeps 1 and must hold step 4 (its replication
        # fails until step 5 is saved), tier 1 keeps 2 (it drops steps 2 and 3, the
        # user's policy: step 3 has left tier 0 by then, step 2 long before).
        Scenario(
            "tiered-retention/local",
            _prepare_tiered([1, 2, 3]),
            _op_tiered([4, 5], block=4),
            {1: 0, 2: 0, 3: 0},
            {4: 0, 5: 0},
            may_drop=frozenset({1, 2, 3}),
            retention=(1, 2),
            tiered=True,
        ),
        # Going back on both tiers: tier 1 first (a manifest un-committed, then
        # deleted, by the replicator), then tier 0. Until it returned either tier may
        # hold either set; once it returned, steps 2 and 3 are gone from both for good.
        Scenario(
            "tiered-rollback/local",
            _prepare_tiered([1, 2, 3]),
            _op_tiered_rollback(1),
            {1: 0, 2: 0, 3: 0},
            may_drop=frozenset({2, 3}),
            tiered=True,
        ),
    ]


# ============================================================================ recording
def _child(phase: str, name: str, root: str, out: str) -> None:
    """Run in a fresh process: build the pre-state, then record the operation."""
    global _CURRENT
    scen = _CURRENT = scenarios()[name]
    import logging

    logging.getLogger("atomic_checkpoint").addHandler(logging.NullHandler())
    logging.getLogger("atomic_checkpoint").propagate = False
    from atomic_checkpoint import rankfiles
    from atomic_checkpoint.storage.local import LocalStorage

    if scen.direct_io:
        # Every state file goes through the O_DIRECT writers (pwrite from aligned
        # buffers, ftruncate of the padding), however small.
        rankfiles._DIRECT_MIN_BYTES = 0
        LocalStorage.direct_io = True
    else:
        LocalStorage.direct_io = False
    # The pre-state is built by a forked child that exits without cleaning up (a
    # manager it leaves open keeps the run lock, held by a process that is gone).
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with capability_profile(scen.exchange):
                scen.prepare(root)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"building the pre-state of {name} failed (status {status})")
    recorders: list[Recorder] = []

    def record() -> Recorder:
        rec = Recorder(root, exchange=scen.exchange)
        recorders.append(rec)
        return rec

    scen.operate(root, record)
    (rec,) = recorders
    final_manifests = {}
    for step in scen.saves:
        obj = rec.live.resolve(f"checkpoint-{step}/{MANIFEST}")
        if obj is not None:
            final_manifests[step] = rec.live.data[obj]
    with open(out, "wb") as f:
        pickle.dump({"baseline": rec.baseline, "ops": rec.ops, "manifests": final_manifests}, f)


@dataclass
class Trace:
    scenario: Scenario
    baseline: Tree
    ops: list[Any]
    manifests: dict[int, bytes]


def record_trace(name: str, workdir: str) -> Trace:
    """Prepare and record scenario ``name`` in a fresh process (the pre-state in a
    forked child of it) under ``workdir``."""
    root = os.path.join(workdir, "root")
    out = os.path.join(workdir, "trace.pickle")
    proc = run_module(
        "reliability.crashstates", "--child", "record", name, root, out, timeout_s=120
    )
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"scenario {name} failed to record:\n{proc.stderr[-3000:]}")
    with open(out, "rb") as f:
        doc = pickle.load(f)
    return Trace(scenarios()[name], doc["baseline"], doc["ops"], doc["manifests"])


# ============================================================================ checking
def expectation(trace: Trace, state: CrashState) -> tuple[tuple[int, frozenset[int]], ...]:
    """What must be listed after recovery from ``state``: step -> the versions it may
    have. Initial steps (unless retention may drop them), steps whose save returned
    (the new version only), steps whose new manifest the barriers alone guarantee."""
    scen = trace.scenario
    if scen.tiered:
        return _tiered_expectation(trace, state)
    need: dict[int, frozenset[int]] = {}
    for step, version in scen.initial.items():
        if step not in scen.may_drop:
            versions = {version}
            if step in scen.saves:
                versions.add(scen.saves[step])
            need[step] = frozenset(versions)
    for step, manifest in trace.manifests.items():
        obj = state.minimal.resolve(f"checkpoint-{step}/{MANIFEST}")
        if obj is not None and state.minimal.data.get(obj) == manifest:
            old = scen.initial.get(step)
            need[step] = frozenset({scen.saves[step]} | ({old} if old is not None else set()))
    for m in state.marks:
        if m.label == "committed":
            need[m.info["step"]] = frozenset({m.info["version"]})
    return tuple(sorted(need.items()))


#: The restart after a power loss comes at least this long after the crash (a machine
#: boots for longer): time-based bounds shorter than this (a takeover claim goes stale
#: after 15 s) have passed when recovery runs. The run lock's lease (60 s) has not.
REBOOT_S = 30.0


@contextlib.contextmanager
def after_reboot() -> Iterator[None]:
    """The run lock's clock ``REBOOT_S`` after the crash (the states are written now),
    and no fsync."""
    from atomic_checkpoint.lock import RunLock

    defaults = RunLock.__init__.__kwdefaults__
    real, real_fsync = defaults["clock"], os.fsync
    defaults["clock"] = lambda: real() + REBOOT_S
    # Recovery's own durability is not under test here (its crash states are those
    # of the scenarios it is made of): skipping its fsyncs makes a state ~5x cheaper.
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        defaults["clock"] = real
        os.fsync = real_fsync


def check_state(path: str, state: CrashState, need: Any, trace: Trace) -> list[tuple[str, str]]:
    """Recover ``path`` as a restarted job would and check the invariants."""
    with after_reboot():
        if trace.scenario.tiered:
            return _check_tiered(path, state, need, trace)
        return _check_state(path, state, need, trace)


def _check_state(path: str, state: CrashState, need: Any, trace: Trace) -> list[tuple[str, str]]:
    scen = trace.scenario
    rolled = [m.info["to"] for m in state.marks if m.label == "rolled-back"]
    with capability_profile(scen.exchange):
        found = recovered(
            lambda: _manager(path, scen),
            path,
            allowed_versions(scen),
            need,
            rolled[-1] if rolled else None,
            _files_match if scen.files else restored_version,
        )
    return found + _leftovers(path)


def allowed_versions(scen: Any) -> dict[int, set[int]]:
    """Step -> the versions saved under it, in the pre-state or by the operation."""
    allowed: dict[int, set[int]] = {}
    for step, version in [*scen.initial.items(), *scen.saves.items()]:
        allowed.setdefault(step, set()).add(version)
    return allowed


def recovered(
    start: Callable[[], Any],
    target: str,
    allowed: dict[int, set[int]],
    need: Iterable[tuple[int, Collection[int]]],
    rolled: int | None,
    version_of: Callable[[Any, int, set[int]], int | str],
) -> list[tuple[str, str]]:
    """Recover ``target`` as a restarted job would: ``start()`` a manager, list, restore
    every listed step (``version_of``: the version it holds, or what is wrong), save
    again, close, then ``atomic-checkpoint clean``. ``need``: (step, versions) pairs
    durably committed. ``rolled``: the step a returned ``rollback()`` went back to."""
    found: list[tuple[str, str]] = []
    try:
        mgr = start()
    except Exception as exc:
        return [("stuck", f"the next start failed: {type(exc).__name__}: {exc}")]
    try:
        listed = listed_steps(mgr, allowed, found)
        restored: dict[int, int] = {}
        for step in listed:
            match = version_of(mgr, step, allowed[step])
            if isinstance(match, str):
                found.append(("torn", match))
            else:
                restored[step] = match
        for step, versions in need:
            if step not in listed:
                found.append(
                    ("lost", f"step {step} was durably committed and is gone (listed: {listed})")
                )
            elif step in restored and restored[step] not in versions:
                found.append(
                    (
                        "lost",
                        f"step {step} restores to version {restored[step]}, "
                        f"but version {sorted(versions)} was committed",
                    )
                )
        # After rollback() returned, saves above its step are allowed: the steps it
        # removed must not come back after a power loss.
        nxt = max([*listed, *allowed, 0]) + 1 if rolled is None else rolled + 1
        found += next_save(mgr, nxt)
    except Exception as exc:
        found.append(("stuck", f"recovery failed: {type(exc).__name__}: {exc}"))
    finally:
        found += closed(mgr)
    return found + cleaned(target)


def restored_version(mgr: Any, step: int, versions: set[int]) -> int | str:
    """The version of ``state_of(step, version)`` that ``restore(step)`` gives, or what
    is wrong with it."""
    try:
        got = mgr.restore(step=step)
    except Exception as exc:
        return f"restore(step={step}) failed: {type(exc).__name__}: {exc}"
    match = [v for v in versions if _same(got, state_of(step, v))]
    return match[0] if match else f"step {step} restores to content nobody saved"


def listed_steps(mgr: Any, allowed: dict[int, set[int]], found: list[tuple[str, str]]) -> list[int]:
    """The recovered job's listed steps that were ever saved; ``latest()`` must be the
    newest of them, and a step never saved must not be listed (``torn`` into ``found``)."""
    listed = [c.step for c in mgr.checkpoints()]
    latest = mgr.latest()
    if (latest.step if latest else None) != (max(listed) if listed else None):
        found.append(("torn", f"latest() is {latest} but the newest listed is {listed}"))
    for step in listed:
        if step not in allowed:
            found.append(("torn", f"step {step} is listed but was never saved"))
    return [step for step in listed if step in allowed]


def next_save(mgr: Any, step: int) -> list[tuple[str, str]]:
    """The recovered job saves again: a state that blocks it needs a human."""
    try:
        mgr.save(step, state_of(step))
    except Exception as exc:
        return [("stuck", f"the next save failed: {type(exc).__name__}: {exc}")]
    return []


def closed(mgr: Any) -> list[tuple[str, str]]:
    """The recovered job closes cleanly."""
    try:
        mgr.close()
    except Exception as exc:
        return [("stuck", f"close() failed: {type(exc).__name__}: {exc}")]
    return []


def cleaned(target: str) -> list[tuple[str, str]]:
    """`atomic-checkpoint clean TARGET`, as a user runs it, must succeed."""
    from atomic_checkpoint.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = cli_main(["clean", target])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 2
    if rc != 0:
        return [("stuck", f"`atomic-checkpoint clean` exited {rc}: {out.getvalue()[-300:]}")]
    return []


def _leftovers(path: str) -> list[tuple[str, str]]:
    """After a start and ``clean``, ``.pending/`` and ``.trash/`` are empty, no
    in-progress marker and no temporary file of an atomic write is left, and every
    ``checkpoint-<step>`` directory holds a manifest."""
    from atomic_checkpoint.layout import parse_marker_name
    from atomic_checkpoint.storage.temps import parse_temp_name

    out = []
    for d in (".pending", ".trash"):
        left = os.listdir(os.path.join(path, d)) if os.path.isdir(os.path.join(path, d)) else []
        if left:
            out.append(("leaks", f"{d}/ still holds {left} after a start and clean"))
    for name in sorted(os.listdir(path)):
        d = os.path.join(path, name)
        if not name.startswith("checkpoint-") or not os.path.isdir(d):
            continue
        markers = [n for n in os.listdir(d) if parse_marker_name(n) is not None]
        if markers:
            out.append(("leaks", f"{name}/ still holds markers {markers} after a start and clean"))
        elif not os.path.exists(os.path.join(d, MANIFEST)):
            left = sorted(os.listdir(d))
            out.append(("leaks", f"{name}/ has no manifest and no marker, holding {left[:3]}"))
    temps = sorted(
        os.path.relpath(os.path.join(d, n), path)
        for d, _, names in os.walk(path)
        for n in names
        if parse_temp_name(n) is not None
    )
    if temps:
        out.append(("leaks", f"temporary files left after a start and clean: {temps[:3]}"))
    return out


def _scratch(workdir: str) -> str:
    """Where crash states are materialised: /dev/shm when it is a writable tmpfs (the
    states are thrown away after their check; tmpfs makes them cheap), else
    ``workdir``."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return workdir


def _files_match(mgr: Any, step: int, versions: set[int]) -> int | str:
    """The version a ``saving()`` checkpoint holds, or what is wrong with it. Files are
    found through the manifest (the marker strategy keeps them under the attempt's
    directory)."""
    import json

    try:
        mgr.verify(step)
        where = mgr.checkpoint_path(step)
        with open(os.path.join(where, MANIFEST), "rb") as f:
            listed = [e["path"] for e in json.load(f)["files"]]
        got = {}
        for path in listed:
            rel = path.split("/", 1)[1] if path.startswith("attempt-") else path
            with open(os.path.join(where, *path.split("/")), "rb") as f:
                got[rel] = f.read()
    except Exception as exc:
        return f"verify({step}) or reading its files failed: {type(exc).__name__}: {exc}"
    for v in sorted(versions):
        if got == files_of(step, v):
            return v
    return f"step {step} holds files nobody saved ({sorted(got)})"


@dataclass
class ScenarioResult:
    name: str
    ops: int
    exploration: Exploration
    seconds: float


def run_scenario(
    name: str,
    workdir: str,
    *,
    per_cut: int = 16,
    seed: int = 0,
    max_states: int | None = None,
    jobs: int = 1,
) -> ScenarioResult:
    """Record scenario ``name`` and check every crash state (up to ``max_states``)."""
    import logging

    t0 = time.monotonic()
    base = tempfile.mkdtemp(prefix=name.replace("/", "-") + "-", dir=workdir)
    states: str | None = None
    try:
        trace = record_trace(name, base)
        states = tempfile.mkdtemp(prefix="ac-crash-", dir=_scratch(workdir))
        lib_log = logging.getLogger("atomic_checkpoint")
        saved = lib_log.disabled
        lib_log.disabled = True  # recovery logs takeovers and sweeps by design
        try:
            result = explore(
                trace.baseline,
                trace.ops,
                lambda p, s, e: check_state(p, s, e, trace),
                states,
                expect=lambda s: expectation(trace, s),
                per_cut=per_cut,
                seed=seed,
                max_states=max_states,
                jobs=jobs,
            )
        finally:
            lib_log.disabled = saved
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if states is not None:
            shutil.rmtree(states, ignore_errors=True)
    return ScenarioResult(name, len(trace.ops), result, time.monotonic() - t0)


def run_all(
    names: list[str] | None,
    workdir: str,
    *,
    per_cut: int,
    seed: int,
    max_states: int | None,
    jobs: int = 1,
) -> Iterator[ScenarioResult]:
    for name in names or list(scenarios()):
        yield run_scenario(
            name, workdir, per_cut=per_cut, seed=seed, max_states=max_states, jobs=jobs
        )


# ============================================================================ campaign
#: The operations ``tests/crash`` recovers from sampled crash states in CI.
CI_SCENARIOS = (
    "save/local",
    "overwrite/local",
    "retention/local",
    "sweep/local",
    "takeover/local",
    "first-start/local",
    "async-save/local",
    "save/no-exchange",
    "overwrite/no-exchange",
    "retention/no-exchange",
    "save/marker",
    "overwrite/marker",
    "retention/marker",
    "sweep/marker",
    "first-start/marker",
    "save/local-odirect",
    "async-save/local-odirect",
    "saving/local",
    "saving/marker",
    "recover-replaced/no-exchange",
    "failed-overwrite/no-exchange",
    "failed-save/local",
    "failed-save/marker",
)

#: --quick / --full sizes: (states sampled per crash point, cap per scenario). --quick
#: runs the operations ``tests/crash`` does not (so CI covers every one between the
#: two); --full runs all of them and checks about 108,000 distinct states (most of them
#: in the *-wide scenarios).
SIZES = {"quick": (4, 20), "full": (1500, None)}


def run(size: str, seed: int, progress: Any, workdir: str) -> Any:
    """The ``crash-states`` campaign (``reliability/run.py``): every scenario, one
    trial (and one fault: the power loss) per distinct crash state checked. States are
    checked in ``min(4, cpu_count)`` processes (one when this process runs threads)."""
    from reliability.tally import Tally

    per_cut, cap = SIZES[size]
    # Forked workers: only from a process with no other thread (a fork copies locks
    # other threads may hold; Python 3.12 warns about it).
    jobs = max(1, min(4, os.cpu_count() or 1)) if threading.active_count() == 1 else 1
    tally = Tally("crash-states")
    names = [n for n in scenarios() if size != "quick" or n not in CI_SCENARIOS]
    for res in run_all(names, workdir, per_cut=per_cut, seed=seed, max_states=cap, jobs=jobs):
        ex = res.exploration
        tally.trials += ex.states
        tally.faults += ex.states
        tally.count("states", res.name, ex.states)
        tally.count("crash_points", res.name, ex.cuts)
        tally.count("recorded_ops", res.name, res.ops)
        for v in ex.violations:
            tally.violate(v.kind, f"{res.name}: {v}")
        progress(
            f"  {res.name}: {res.ops} ops, {ex.cuts} crash points, {ex.states} states "
            f"({ex.generated} enumerated), {len(ex.violations)} violations, "
            f"{res.seconds:.1f} s"
        )
    _run_object_store(tally, progress)
    return tally.finish()


def _run_object_store(tally: Any, progress: Any) -> None:
    """The object-store scenarios (``reliability/crashstore.py``): every prefix of the
    completed requests, on ``memory://``. Few states each, so every size runs all."""
    try:
        from reliability import crashstore
    except ImportError as exc:  # pragma: no cover - fsspec is a test dependency
        tally.stats["object_store"] = f"skipped: {exc}"
        return
    for name in crashstore.scenarios():
        t0 = time.monotonic()
        ex = crashstore.run_scenario(name)
        tally.trials += ex.states
        tally.faults += ex.states
        tally.count("states", name, ex.states)
        tally.count("crash_points", name, ex.cuts)
        for v in ex.violations:
            tally.violate(v.kind, f"{name}: {v}")
        progress(
            f"  {name}: {ex.cuts - 1} requests, {ex.states} states, "
            f"{len(ex.violations)} violations, {time.monotonic() - t0:.1f} s"
        )


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        code = 1
        try:
            _child(*argv[1:5])
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # no atexit: a manager left open keeps its lock, as after a crash
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", action="append", choices=sorted(scenarios()))
    parser.add_argument("--per-cut", type=int, default=16)
    parser.add_argument("--max-states", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="processes checking states")
    parser.add_argument("--show", type=int, default=5, help="violations printed per scenario")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="ac-crash-states-")
    bad = 0
    try:
        for res in run_all(
            args.scenario,
            workdir,
            per_cut=args.per_cut,
            seed=args.seed,
            max_states=args.max_states,
            jobs=args.jobs,
        ):
            ex = res.exploration
            print(
                f"{res.name}: {res.ops} ops, {ex.cuts} crash points, {ex.states} states "
                f"({ex.generated} enumerated), violations {ex.counts or 0}, "
                f"{res.seconds:.1f} s",
                flush=True,
            )
            for v in ex.violations[: args.show]:
                print(f"    {v}", flush=True)
            bad += len(ex.violations)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
