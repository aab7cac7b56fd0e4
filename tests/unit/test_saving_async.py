"""``CheckpointManager.saving_async``: the background counterpart of ``saving()``, for
writers that copy the state themselves (``async_save_dcp`` is built on it)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from atomic_checkpoint import CheckpointError, CheckpointManager
from atomic_checkpoint.layout import MANIFEST_NAME

pytestmark = pytest.mark.timeout(60)


def test_the_write_runs_in_the_background_and_its_files_are_committed(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    release, seen = threading.Event(), {}

    def write(directory: Path) -> None:
        seen["thread"] = threading.current_thread() is threading.main_thread()
        assert release.wait(30)
        (directory / "sub").mkdir()
        (directory / "sub" / "a.bin").write_bytes(b"a" * 1000)
        (directory / "b.txt").write_text("b")

    handle = mgr.saving_async(4, write, metrics={"loss": 0.5}, metadata={"k": "v"})
    # Returned before the write ran: nothing is visible yet.
    assert not handle.done() and mgr.checkpoints() == []
    release.set()
    info = handle.result(timeout=30)
    assert seen["thread"] is False
    assert mgr.wait() == info and info.step == 4 and info.metrics == {"loss": 0.5}
    assert info.size_bytes == 1001 and info.metadata["k"] == "v"
    manifest = json.loads((Path(info.path) / MANIFEST_NAME).read_text())
    assert sorted(f["path"] for f in manifest["files"]) == ["b.txt", "sub/a.bin"]
    mgr.verify(4)  # every file checksummed by the commit, and intact
    assert (Path(info.path) / "sub" / "a.bin").read_bytes() == b"a" * 1000
    mgr.close()


def test_a_failing_write_commits_nothing_and_is_raised_once_more(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, {"x": 1})

    def write(directory: Path) -> None:
        (directory / "half.bin").write_bytes(b"x" * 10)
        raise OSError(28, "No space left on device")

    handle = mgr.saving_async(2, write)
    with pytest.raises(OSError, match="No space left"):
        handle.result(timeout=30)
    with pytest.raises(OSError):  # once, by the manager's next call
        mgr.wait()
    assert mgr.wait() is None
    assert [c.step for c in mgr.checkpoints()] == [1]
    assert not list((tmp_path / "ckpt").glob("checkpoint-2*"))
    mgr.close()


def test_a_rank_that_could_not_prepare_fails_the_save_without_writing(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    called = []
    why = CheckpointError("rank 0: the copy of the state failed")
    handle = mgr.saving_async(3, called.append, failed=why)
    with pytest.raises(CheckpointError, match="the copy of the state failed"):
        handle.result(timeout=30)
    with pytest.raises(CheckpointError):  # once more, by the manager's next call
        mgr.wait()
    assert called == [] and mgr.checkpoints() == []
    mgr.close()


def test_step_order_and_object_stores_are_refused_before_anything_runs(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(5, {"x": 1})
    from atomic_checkpoint.errors import StepOrderError

    with pytest.raises(StepOrderError):
        mgr.saving_async(4, lambda d: None)
    mgr.close()
    # An object store (fsspec's in-memory one here) has no directory to write into.
    store = CheckpointManager(f"memory://saving-async-{tmp_path.name}/root")
    with pytest.raises(CheckpointError, match="mounted filesystem"):
        store.saving_async(1, lambda d: None)
    store.close()
