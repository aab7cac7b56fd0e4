"""``close()`` with an async save in flight, on a real local filesystem (issue 11,
defect 3; DESIGN invariant 12).

A save that is slow after its last fence check (the rename that commits it, or the
fsync of ROOT after it) cannot be taken back: ``close()`` must wait for it, say that it
committed, run its retention under the run lock, and only then release the lock. A
save that is slow before its commit is asked to stop, and ``close()`` waits until it
has stopped and discarded its pending data. Either way, nothing of the manager touches
ROOT after ``close()`` returns or raises, and what it says about the save is true.

The slow storage call is a real ``LocalStorage`` call that waits on an event, so the
interleaving is exact; no sleep decides it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from atomic_checkpoint import CheckpointManager, KeepLast, LocalStorage
from atomic_checkpoint.async_save import SaveAbandonedError
from atomic_checkpoint.layout import PENDING_DIR

pytestmark = pytest.mark.timeout(120)

# A broken close() returns about timeout_s (0.5 s here) after it asks the save to stop;
# a correct one cannot return while the storage call is held. The test gives a broken
# close() this long to return early; a correct one never does, so this is no race.
EARLY_RETURN_WINDOW_S = 3.0


class HeldCallStorage(LocalStorage):
    """A real LocalStorage whose chosen call, once armed, waits until ``release`` is set.

    ``call``: ``"rename_dir"`` (the rename of the pending directory that commits a save),
    ``"fsync_dir"`` (the fsync of ROOT just after that rename), ``"open_write"`` (a
    rank's state file, before anything is committed) or ``"delete_tree"`` (retention
    deleting a checkpoint it un-committed).
    """

    def __init__(self, root: Any, call: str):
        super().__init__(root)
        self.call = call
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def _hold(self, name: str, matches: bool) -> None:
        if self.armed and name == self.call and matches:
            self.armed = False  # hold this one call only
            self.entered.set()
            if not self.release.wait(60):
                raise TimeoutError("the test never released the held call")

    def rename_dir(self, src: str, dst: str) -> None:
        self._hold("rename_dir", src.startswith(f"{PENDING_DIR}/"))
        super().rename_dir(src, dst)

    def fsync_dir(self, path: str) -> None:
        if self.call == "fsync_dir" and path == "" and self._renamed_in():
            self._hold("fsync_dir", True)
        super().fsync_dir(path)

    def _renamed_in(self) -> bool:
        return os.path.isdir(os.path.join(self.local_path(""), "checkpoint-2"))

    def open_write(self, path: str, *, size_hint: int | None = None) -> Any:
        self._hold("open_write", path.endswith(".safetensors"))
        return super().open_write(path, size_hint=size_hint)

    def delete_tree(self, path: str) -> None:
        self._hold("delete_tree", True)
        super().delete_tree(path)


def tree(root: Any) -> dict[str, tuple[int, int]]:
    """Every entry under ``root`` with its size and mtime: any mutation changes it."""
    out: dict[str, tuple[int, int]] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def listed(root: Any) -> list[int]:
    return [c.step for c in CheckpointManager(root, read_only=True).checkpoints()]


def close_in_thread(mgr: CheckpointManager, root: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Call close() from another thread; record its outcome and ROOT as it returns."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            mgr.close()
            outcome["error"] = None
        except BaseException as exc:  # the outcome is what the test judges
            outcome["error"] = exc
        outcome["tree"] = tree(root)

    closer = threading.Thread(target=run, name="test-closer")
    closer.start()
    return closer, outcome


def wait_until(cond: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def stuck_close(tmp_path: Any, call: str) -> dict[str, Any]:
    """Steps 1 (committed) and 2 (async, held in ``call``); close() from a thread while
    step 2 is held; then release it. Returns what the test judges."""
    root = tmp_path / "ckpt"
    storage = HeldCallStorage(root, call)
    mgr = CheckpointManager(storage, timeout_s=0.5, retention=KeepLast(1))
    mgr.save(1, {"w": torch.ones(4)})
    storage.armed = True
    handle = mgr.save_async(2, {"w": torch.zeros(4)})
    assert storage.entered.wait(30), f"the save never reached {call}"
    closer, outcome = close_in_thread(mgr, root)
    saver = mgr._async
    assert saver is not None
    wait_until(saver.cancel.is_set, "close() asked the save to stop")
    closer.join(EARLY_RETURN_WINDOW_S)
    returned_early = not closer.is_alive()
    storage.release.set()
    closer.join(60)
    assert not closer.is_alive(), "close() did not return once the storage call went on"
    # Whatever a broken close() left running ends now: the save, then its rotation.
    assert handle._done.wait(60)
    for t in threading.enumerate():
        if t.name == "atomic-checkpoint-rotation":
            t.join(60)
    return {
        "returned_early": returned_early,
        "error": outcome["error"],
        "tree_at_close": outcome["tree"],
        "tree_after": tree(root),
        "listed": listed(root),
        "root": root,
    }


@pytest.mark.parametrize("call", ["rename_dir", "fsync_dir"])
def test_close_waits_for_a_save_stuck_after_its_last_fence_and_says_it_committed(tmp_path, call):
    r = stuck_close(tmp_path, call)
    assert not r["returned_early"], (
        f"close() returned ({r['error']!r}) while step 2 was in its {call}, past its last "
        "fence check: the save could still commit after close()"
    )
    # The save was committing when asked to stop: it committed, and close() says so.
    assert r["error"] is None, f"close() reported {r['error']!r} but step 2 committed"
    # Its retention ran before close() returned, under the lock: KeepLast(1) keeps 2.
    assert r["listed"] == [2]
    # Nothing touched ROOT after close() returned.
    assert r["tree_after"] == r["tree_at_close"]
    # The lock was released: a new job opens ROOT without taking anything over.
    CheckpointManager(r["root"]).close()


def test_close_stops_a_save_stuck_before_its_commit_and_says_it_did_not_commit(tmp_path):
    r = stuck_close(tmp_path, "open_write")
    assert not r["returned_early"], (
        f"close() returned ({r['error']!r}) while step 2 was still writing: its "
        "clean-up then ran after close()"
    )
    assert isinstance(r["error"], SaveAbandonedError), r["error"]
    assert "step 2 was abandoned" in str(r["error"])
    # True: step 2 is not a checkpoint, its pending data is gone, step 1 is intact...
    assert r["listed"] == [1]
    assert os.listdir(r["root"] / PENDING_DIR) == []
    # ...all of it before close() returned.
    assert r["tree_after"] == r["tree_at_close"]
    CheckpointManager(r["root"]).close()


def test_close_waits_for_a_save_running_on_another_thread(tmp_path):
    # close() returned at once while a saving() block still wrote on another thread;
    # that save then failed ("the run lock ... is not held") and removed its pending
    # data after close had returned.
    mgr = CheckpointManager(tmp_path)
    inside, release = threading.Event(), threading.Event()
    outcome: list[Any] = []

    def save() -> None:
        try:
            with mgr.saving(1) as d:
                (d / "a.bin").write_bytes(b"1")
                inside.set()
                release.wait(10)
            outcome.append(d.info.step)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=save)
    t.start()
    assert inside.wait(10)
    closer = threading.Thread(target=mgr.close)
    closer.start()
    time.sleep(0.5)
    assert closer.is_alive()  # waiting for the save
    release.set()
    closer.join(10)
    t.join(10)
    assert outcome == [1], outcome
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [1]
    assert os.listdir(tmp_path / PENDING_DIR) == []


def test_a_second_manager_on_the_root_lets_the_firsts_async_save_fail_as_fenced(
    tmp_path, monkeypatch
):
    # A notebook cell run again opens a second manager on the same ROOT while the
    # first's async save writes: the second's start swept that save's pending data,
    # and the save failed 30 s later with "files written by the ranks are not visible"
    # instead of FencedError.
    from atomic_checkpoint import FencedError
    from atomic_checkpoint._faults import ENV as FAULTS_ENV

    first = CheckpointManager(tmp_path)
    first.save(1, {"w": torch.ones(4)})
    # Held for a second after its write: still in flight when the second one opens
    # (a fast machine committed it before, and nothing was left to fence).
    monkeypatch.setenv(FAULTS_ENV, "after_write@0=delay:2")
    handle = first.save_async(2, {"w": torch.arange(1 << 22, dtype=torch.float32)})
    t0 = time.monotonic()
    second = CheckpointManager(tmp_path)
    with pytest.raises(FencedError):
        handle.result()
    assert time.monotonic() - t0 < 20
    second.save(3, {"w": torch.ones(4)})
    assert [c.step for c in second.checkpoints()] == [1, 3]
    second.close()
    with pytest.raises(FencedError):
        first.close()


def closed_within(mgr: CheckpointManager, storage: HeldCallStorage, timeout_s: float) -> None:
    """Once ``storage``'s call is held: ``close(timeout_s=)`` returns within the bound
    and the moment to stop, not after the stuck call; then the call is released."""
    assert storage.entered.wait(30)
    try:
        t = time.monotonic()
        mgr.close(timeout_s=timeout_s)
        took = time.monotonic() - t
    finally:
        storage.release.set()
    assert took < timeout_s + 1.5, took


def test_close_with_a_timeout_returns_within_it_while_a_save_is_stuck_in_storage(tmp_path):
    # A preempted job's close(timeout_s=guard.time_left_s): close() took no argument,
    # and with the async save inside a storage call that does not return (a stalled
    # object store), close() waited for it past the grace period.
    root = tmp_path / "root"
    storage = HeldCallStorage(root, "open_write")
    mgr = CheckpointManager(storage, timeout_s=30)
    mgr.save(1, {"w": torch.ones(4)})
    storage.armed = True
    mgr.save_async(2, {"w": torch.ones(4)})
    closed_within(mgr, storage, 1.0)
    assert listed(root) == [1]  # never a checkpoint: it had not committed
    other = CheckpointManager(tmp_path / "other")
    with pytest.raises(ValueError):
        other.close(timeout_s=-1)
    other.close()


def test_close_with_a_timeout_returns_within_it_while_retention_is_stuck_deleting(tmp_path, caplog):
    # close(timeout_s=) bounded the async save only: with the rotation after the last
    # save stuck deleting an old checkpoint (a stalled mount), it joined the rotation
    # without a bound, and a preempted job overran its grace period. Once close() has
    # returned, the rotation left running deletes nothing more (DESIGN invariant 12).
    root = tmp_path / "root"
    with CheckpointManager(root) as first:
        first.save(1, {"w": torch.ones(4)})
        first.save(2, {"w": torch.ones(4)})
    storage = HeldCallStorage(root, "delete_tree")
    mgr = CheckpointManager(storage, timeout_s=30, retention=KeepLast(1))
    storage.armed = True
    mgr.save(3, {"w": torch.zeros(4)})  # its rotation deletes step 1 (held), then 2
    closed_within(mgr, storage, 1.0)
    assert "retention is still deleting old checkpoints" in caplog.text
    assert listed(root) == [2, 3]  # step 1 was un-committed before its deletion stuck
    for t in threading.enumerate():
        if t.name == "atomic-checkpoint-rotation":
            t.join(60)
    assert listed(root) == [2, 3]  # not deleted after close() returned
