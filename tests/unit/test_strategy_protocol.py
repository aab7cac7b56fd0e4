"""The commit strategy protocol is complete (issue 13): both strategies implement every
method the manager, the CLI and the integrations call, so none of them needs
``isinstance`` or a private call, and a user's strategy object is used as it is.

Runs on a temporary directory (``LocalStorage``) and, for the marker strategy, on the
in-memory storage; nothing else is touched.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
from pathlib import Path
from typing import Any

import pytest

import atomic_checkpoint
from atomic_checkpoint import CheckpointManager, KeepLast, catalog, strategies
from atomic_checkpoint.layout import PENDING_DIR, TRASH_DIR, checkpoint_name
from atomic_checkpoint.storage import LocalStorage
from atomic_checkpoint.storage.base import Storage
from atomic_checkpoint.storage.memory import MemoryStorage
from atomic_checkpoint.strategies import (
    CommitStrategy,
    MarkerStrategy,
    RenameStrategy,
    choose_strategy,
)
from tests.faults.test_failure_modes import np_state
from tests.helpers import same

pytestmark = pytest.mark.timeout(60)

# Everything the manager, the CLI, adopt, tiered and the integrations call on a
# strategy, written out here so that a member dropped from the protocol fails this test.
MEMBERS = (
    "name",
    "writes_in_place",
    "pending_location",
    "prepare",
    "publish",
    "is_committed",
    "discard",
    "uncommit",
    "delete",
    "retire",
    "sweep",
    "leftovers",
    "remove_leftover",
)
STRATEGY_CLASSES = [RenameStrategy, MarkerStrategy]
SRC = Path(atomic_checkpoint.__file__).parent


def committed_steps(storage: Storage) -> list[int]:
    return [m.step for m in catalog.committed(storage, run_id=None, warn=False)]


def files_under(root: Path) -> list[str]:
    out = []
    for d, dirs, names in os.walk(root):
        for name in dirs + names:
            out.append(os.path.relpath(os.path.join(d, name), root))
    return sorted(out)


def with_two_checkpoints(storage: Storage, strategy: str) -> None:
    with CheckpointManager(storage, strategy=strategy) as mgr:
        mgr.save(1, np_state(1))
        mgr.save(2, np_state(2))


USERS_OWN = "notes.txt"


def leave_remains(storage: Storage) -> None:
    """What crashed saves and deletes of both strategies leave: a pending attempt, an
    un-committed checkpoint in the trash, a stray file in ``.pending/`` named as ours,
    and a marker save of step 7 whose ranks had written when the process died; and a
    user's own file in ``.pending/``, which no sweep removes."""
    storage.makedirs(f"{PENDING_DIR}/checkpoint-5.00000000000000aa")
    storage.write_bytes_atomic(f"{PENDING_DIR}/checkpoint-5.00000000000000aa/rank-0.bin", b"x")
    storage.write_bytes_atomic(f"{PENDING_DIR}/checkpoint-6.00000000000000dd", b"y")
    storage.write_bytes_atomic(f"{PENDING_DIR}/{USERS_OWN}", b"not ours")
    storage.makedirs(f"{TRASH_DIR}/checkpoint-3.00000000000000bb")
    storage.write_bytes_atomic(f"{TRASH_DIR}/checkpoint-3.00000000000000bb/rank-0.bin", b"z")
    attempt = MarkerStrategy().prepare(storage, 7, "00000000000000cc")
    storage.write_bytes_atomic(f"{attempt}/rank-0.bin", b"w")


@pytest.mark.parametrize("cls", STRATEGY_CLASSES, ids=lambda c: c.__name__)
def test_each_strategy_implements_every_member_of_the_protocol(cls):
    strategy = cls()
    assert isinstance(strategy, CommitStrategy)
    assert isinstance(strategy.name, str) and strategy.name
    assert isinstance(strategy.writes_in_place, bool)
    for member in MEMBERS[2:]:
        method = getattr(strategy, member)
        assert callable(method), member
        # Every parameter the protocol declares is accepted, by the same name and kind.
        declared = inspect.signature(getattr(CommitStrategy, member)).parameters
        accepted = inspect.signature(getattr(cls, member)).parameters
        for name, param in declared.items():
            assert name in accepted, f"{cls.__name__}.{member} lacks {name!r}"
            assert accepted[name].kind == param.kind, f"{cls.__name__}.{member}({name})"


def test_only_the_marker_strategy_writes_in_place():
    assert RenameStrategy().writes_in_place is False
    assert MarkerStrategy().writes_in_place is True


@pytest.mark.parametrize("strategy", ["rename", "marker"])
def test_sweep_is_idempotent_on_a_real_directory(tmp_path, strategy):
    storage = LocalStorage(tmp_path)
    with_two_checkpoints(storage, strategy)
    leave_remains(storage)
    sweeper = choose_strategy(storage, strategy)
    fenced = []
    cleaned = sweeper.sweep(storage, fence=lambda: fenced.append(1))
    assert fenced, "the fence is checked before removing anything"
    # Whatever the strategy, the rename strategy's remains go (an earlier run may have
    # left them); the marker strategy's only under the marker strategy, as before.
    assert os.listdir(tmp_path / PENDING_DIR) == [USERS_OWN]
    assert os.listdir(tmp_path / TRASH_DIR) == []
    assert (tmp_path / "checkpoint-7").exists() == (strategy == "rename")
    assert len(cleaned) == (3 if strategy == "rename" else 4)
    assert committed_steps(storage) == [1, 2]
    after = files_under(tmp_path)
    assert sweeper.sweep(storage) == []
    assert files_under(tmp_path) == after
    assert committed_steps(storage) == [1, 2]


def test_marker_sweep_is_idempotent_in_memory():
    storage = MemoryStorage()
    with_two_checkpoints(storage, "marker")
    leave_remains(storage)
    sweeper = MarkerStrategy()
    assert len(sweeper.sweep(storage)) == 4
    assert storage.listdir(PENDING_DIR) == [USERS_OWN] and storage.listdir(TRASH_DIR) == []
    assert "checkpoint-7" not in storage.listdir("")
    after = storage.walk_files("")
    assert sweeper.sweep(storage) == []
    assert storage.walk_files("") == after
    assert committed_steps(storage) == [1, 2]


def test_a_fenced_sweep_removes_nothing(tmp_path):
    storage = LocalStorage(tmp_path)
    leave_remains(storage)
    before = files_under(tmp_path)

    class Fenced(Exception):
        pass

    def fence() -> None:
        raise Fenced

    for strategy in (RenameStrategy(), MarkerStrategy()):
        with pytest.raises(Fenced):
            strategy.sweep(storage, fence=fence)
    assert files_under(tmp_path) == before


def rename_storage(tmp_path: Path) -> Storage:
    return LocalStorage(tmp_path)


@pytest.mark.parametrize(
    "strategy, make_storage",
    [
        ("rename", rename_storage),
        ("marker", rename_storage),
        ("marker", lambda _: MemoryStorage()),
    ],
    ids=["rename-local", "marker-local", "marker-memory"],
)
def test_retire_is_idempotent(tmp_path, strategy, make_storage):
    storage = make_storage(tmp_path)
    with_two_checkpoints(storage, strategy)
    retirer = choose_strategy(storage, strategy)
    assert retirer.retire(storage, 1) is True
    assert committed_steps(storage) == [2]
    assert retirer.retire(storage, 1) is False  # gone already: not an error
    assert committed_steps(storage) == [2]
    # Nothing of step 1 is left to sweep: retire deleted what it un-committed.
    assert retirer.leftovers(storage) == []
    assert checkpoint_name(1) not in storage.listdir("")


@pytest.mark.parametrize("strategy", ["rename", "marker"])
def test_retire_fires_the_rotation_fault_points_in_order(tmp_path, monkeypatch, strategy):
    storage = LocalStorage(tmp_path)
    with_two_checkpoints(storage, strategy)
    seen: list[tuple[str, int, bool]] = []

    def record(phase: str, rank: int, step: int | None = None) -> None:
        seen.append((phase, rank, 1 in committed_steps(storage)))

    monkeypatch.setattr(strategies, "fault_point", record)
    fence_calls: list[bool] = []
    retirer = choose_strategy(storage, strategy)
    retirer.retire(storage, 1, rank=3, fence=lambda: fence_calls.append(not seen))
    # First before anything, again once the un-commit is done (before any delete).
    assert fence_calls == [True, False], "the fence is checked first, and after the un-commit"
    # Committed before the un-commit, not after it (the campaigns kill at these points).
    assert seen == [
        ("before_uncommit", 3, True),
        ("after_uncommit", 3, False),
        ("mid_delete", 3, False),
    ]


class RecordingStrategy(RenameStrategy):
    """A user's strategy: the rename strategy, recording what the manager calls."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def prepare(self, storage: Storage, step: int, attempt: str) -> str:
        self.calls.append(("prepare", step))
        return super().prepare(storage, step, attempt)

    def publish(self, storage, pending, manifest, *, rank, overwrite):  # type: ignore[no-untyped-def]
        self.calls.append(("publish", manifest.step))
        return super().publish(storage, pending, manifest, rank=rank, overwrite=overwrite)

    def retire(self, storage, step, *, rank=0, fence=None):  # type: ignore[no-untyped-def]
        self.calls.append(("retire", step))
        return super().retire(storage, step, rank=rank, fence=fence)

    def sweep(self, storage, fence=None):  # type: ignore[no-untyped-def]
        self.calls.append(("sweep", None))
        return super().sweep(storage, fence)


def test_a_strategy_object_is_used_by_a_real_manager(tmp_path):
    recording = RecordingStrategy()
    with CheckpointManager(tmp_path, strategy=recording, retention=KeepLast(1)) as mgr:
        assert mgr.strategy is recording
        assert mgr.commit_strategy == "recording"
        mgr.save(1, np_state(1))
        mgr.save(2, np_state(2))
    assert recording.calls == [
        ("sweep", None),
        ("prepare", 1),
        ("publish", 1),
        ("prepare", 2),
        ("publish", 2),
        ("retire", 1),
    ]
    (manifest,) = catalog.committed(LocalStorage(tmp_path), run_id=None, warn=False)
    assert (manifest.step, manifest.strategy) == (2, "recording")


def test_an_object_that_is_not_a_strategy_is_refused_by_name(tmp_path):
    class Half:
        name = "half"

        def prepare(self, storage: Storage, step: int, attempt: str) -> str:
            return ""

    with pytest.raises(TypeError, match="lacks writes_in_place, pending_location, publish"):
        CheckpointManager(tmp_path, strategy=Half())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy must be one of"):
        choose_strategy(LocalStorage(tmp_path), "copy")


def _python_sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.name != "strategies.py")


def _strategy_names() -> set[str]:
    tree = ast.parse((SRC / "strategies.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_no_module_dispatches_on_a_strategy_class_or_imports_its_private_names():
    moved = _strategy_names()
    problems = []
    for path in _python_sources():
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and any(
                    isinstance(n, ast.Name) and n.id in ("RenameStrategy", "MarkerStrategy")
                    for n in ast.walk(node.args[1])
                )
            ):
                problems.append(f"{rel}:{node.lineno}: isinstance on a strategy class")
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                module = node.module.rsplit(".", 1)[-1]
                if module not in ("commit", "strategies"):
                    continue
                for alias in node.names:
                    if alias.name.startswith("_"):
                        problems.append(f"{rel}:{node.lineno}: private {module}.{alias.name}")
                    elif module == "commit" and alias.name in moved:
                        problems.append(
                            f"{rel}:{node.lineno}: {alias.name} from commit, not strategies"
                        )
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "_delete_checkpoint"
                and rel != "manager.py"
            ):
                problems.append(f"{rel}:{node.lineno}: the manager's private _delete_checkpoint")
    assert problems == []


class _CountsListings(MemoryStorage):
    listings = 0

    def listdir(self, path: str) -> list[str]:
        self.listings += 1
        return super().listdir(path)


def test_marker_leftovers_on_an_object_store_list_only_the_marked_checkpoints():
    # A restart sweeps; on an object store a listing is a request, and listing every
    # checkpoint made a writable start cost one request per checkpoint in ROOT.
    storage = _CountsListings()
    with CheckpointManager(storage, strategy="marker") as mgr:
        for step in range(1, 41):
            mgr.save(step, np_state(step))
    MarkerStrategy().prepare(storage, 41, "00000000000000dd")  # a save that died
    storage.listings = 0
    (left,) = MarkerStrategy().leftovers(storage)
    assert left.name == "checkpoint-41" and not left.committed
    assert storage.listings <= 3, storage.listings  # ROOT, then the marked one


@pytest.mark.parametrize("strategy", ["rename", "marker"])
@pytest.mark.parametrize("kept", ["rolled back to", "untouched"])
def test_an_uncommit_that_lands_after_a_takeover_is_put_back(
    tmp_path, monkeypatch, caplog, strategy, kept
):
    """A job's retention passed its fence check, then its un-commit of step 1 stalled
    (a slow rename or a held request) while another job took ROOT over and rolled back
    to step 1 (or left it alone). The stalled un-commit landed afterwards and deleted
    the new holder's only checkpoint. Now the job checks the fence again once the
    un-commit is done, puts step 1 back and stops, deleting nothing."""
    import threading

    from atomic_checkpoint import FencedError

    stalled, go_on = threading.Event(), threading.Event()

    def stall(phase: str, rank: int, step: int | None = None) -> None:
        if phase == "before_uncommit" and step == 1:
            stalled.set()
            assert go_on.wait(30)

    monkeypatch.setattr(strategies, "fault_point", stall)
    old = CheckpointManager(tmp_path, retention=KeepLast(1), strategy=strategy)
    old.save(1, np_state(1))
    old.save(2, np_state(2))  # its rotation of step 1 runs behind, and stalls
    assert stalled.wait(30)
    new = CheckpointManager(tmp_path, takeover=True, strategy=strategy)
    if kept == "rolled back to":
        new.rollback(1)
    assert [c.step for c in new.checkpoints()] == ([1] if kept == "rolled back to" else [1, 2])
    go_on.set()
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        old.wait()  # the rotation's outcome is logged: fenced, after putting step 1 back
    assert "retention after the previous save failed: FencedError" in caplog.text
    assert [c.step for c in new.checkpoints()] == ([1] if kept == "rolled back to" else [1, 2])
    assert same(new.restore(1), np_state(1))
    new.save(3, np_state(3))  # the holder goes on
    new.close()
    with pytest.raises(FencedError):
        old.save(4, np_state(4))
    old.close()


def test_a_marker_commit_that_lands_after_a_takeover_is_not_reported_committed(monkeypatch):
    """The marker strategy's commit is one create of the manifest: held in flight (a
    stalled PUT) while another job took ROOT over and swept the attempt's files, it
    landed afterwards and save() returned a checkpoint the root does not hold."""
    import threading

    from atomic_checkpoint import FencedError
    from atomic_checkpoint.layout import MANIFEST_NAME

    held, go_on = threading.Event(), threading.Event()
    real_create = MemoryStorage.create_exclusive

    def create_exclusive(self: MemoryStorage, path: str, data: bytes) -> bool:
        if path == f"{checkpoint_name(3)}/{MANIFEST_NAME}" and not held.is_set():
            held.set()
            assert go_on.wait(30)
        return real_create(self, path, data)

    # Object-store semantics (no directories: the create lands whatever was swept).
    monkeypatch.setattr(MemoryStorage, "create_exclusive", create_exclusive)
    storage = MemoryStorage()
    old = CheckpointManager(storage, strategy="marker")
    old.save(1, np_state(1))
    saved: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: saved.append(_raised(old.save, 3, np_state(3))))
    thread.start()
    assert held.wait(30)
    new = CheckpointManager(storage, takeover=True, strategy="marker")  # sweeps step 3's files
    go_on.set()
    thread.join(30)
    assert isinstance(saved[0], FencedError), saved
    # It says what landed (invariant 12: an error never hides a commit that happened).
    assert "The manifest of step 3 landed after that" in str(saved[0]), saved
    new.save(3, np_state(3))  # the holder's save of that step replaces what landed
    assert same(new.restore(3), np_state(3))
    new.close()
    old.close()


def _raised(call: Any, *args: Any) -> BaseException | None:
    try:
        call(*args)
    except BaseException as exc:
        return exc
    return None
