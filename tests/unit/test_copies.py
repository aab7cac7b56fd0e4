"""``CheckpointManager.begin_copy`` / ``publish_copy`` / ``abandon_copy``: committing a
copy of a checkpoint committed elsewhere (what tiered checkpoints do from tier 0 to
tier 1), through the public API alone."""

from __future__ import annotations

import pytest
import torch

from atomic_checkpoint import CheckpointExistsError, CheckpointManager, KeepLast, ReadOnlyError
from atomic_checkpoint.catalog import load_checkpoint
from atomic_checkpoint.layout import PENDING_DIR, checkpoint_name
from atomic_checkpoint.manifest import FileEntry


def _copy_files(src: CheckpointManager, dst: CheckpointManager, step: int, staged: str):
    """Every file of ``src``'s step into ``staged`` on ``dst``; their entries."""
    manifest = load_checkpoint(src.storage, step)
    entries = []
    for entry in manifest.files:
        data = src.storage.read_bytes(f"{checkpoint_name(step)}/{entry.path}")
        w = dst.storage.open_write(f"{staged}/{entry.path}")
        w.write(data)
        w.close()
        entries.append(FileEntry(entry.path, entry.size_bytes, entry.checksum, entry.rank))
    return manifest, entries


def _pending(mgr: CheckpointManager) -> list[str]:
    return mgr.storage.listdir(PENDING_DIR) if mgr.storage.is_dir(PENDING_DIR) else []


@pytest.fixture
def pair(tmp_path):
    with CheckpointManager(tmp_path / "a") as src, CheckpointManager(tmp_path / "b") as dst:
        yield src, dst


def test_a_published_copy_is_a_verified_checkpoint_of_the_target_run(pair):
    src, dst = pair
    state = {"w": torch.arange(6.0), "step": 7}
    src.save(7, state, metrics={"loss": 0.5}, metadata={"note": "x"})
    attempt = dst.begin_copy(7)
    assert dst.checkpoints() == []  # nothing visible before the publish
    source, files = _copy_files(src, dst, 7, attempt.staged)
    info = dst.publish_copy(attempt, source, files)
    assert info.step == 7 and info.metrics == {"loss": 0.5}
    there = load_checkpoint(dst.storage, 7)
    assert there.run_id == dst.run_id != src.run_id
    assert there.files == tuple(files) and there.metadata == source.metadata
    assert [c.step for c in dst.checkpoints()] == [7]
    assert dst.verify(7).step == 7  # every checksum read back
    restored = dst.restore(7)
    assert torch.equal(restored["w"], state["w"]) and restored["step"] == 7
    assert _pending(dst) == []
    dst.abandon_copy(attempt)  # after the publish: the copy stays
    assert dst.verify(7).commit_seq == info.commit_seq


def test_an_abandoned_copy_leaves_nothing_and_abandoning_twice_is_harmless(pair):
    src, dst = pair
    src.save(3, {"w": torch.ones(2)})
    attempt = dst.begin_copy(3)
    _copy_files(src, dst, 3, attempt.staged)
    assert _pending(dst)
    dst.abandon_copy(attempt)
    dst.abandon_copy(attempt)
    assert _pending(dst) == [] and dst.checkpoints() == []


def test_a_copy_never_replaces_a_committed_step(pair):
    src, dst = pair
    src.save(5, {"w": torch.ones(2)})
    dst.save(5, {"w": torch.zeros(2)})
    attempt = dst.begin_copy(5)
    source, files = _copy_files(src, dst, 5, attempt.staged)
    with pytest.raises(CheckpointExistsError):
        dst.publish_copy(attempt, source, files)
    dst.abandon_copy(attempt)
    assert torch.equal(dst.restore(5)["w"], torch.zeros(2)) and _pending(dst) == []


def test_publishing_another_steps_manifest_is_refused(pair):
    src, dst = pair
    src.save(1, {"w": torch.ones(2)})
    attempt = dst.begin_copy(2)
    source, files = _copy_files(src, dst, 1, attempt.staged)
    with pytest.raises(Exception, match="begun for step 2, not 1"):
        dst.publish_copy(attempt, source, files)
    dst.abandon_copy(attempt)
    assert dst.checkpoints() == []


def test_retention_runs_after_a_published_copy(tmp_path):
    with (
        CheckpointManager(tmp_path / "a") as src,
        CheckpointManager(tmp_path / "b", retention=KeepLast(1)) as dst,
    ):
        for step in (1, 2):
            src.save(step, {"w": torch.full((2,), float(step))})
            attempt = dst.begin_copy(step)
            dst.publish_copy(attempt, *_copy_files(src, dst, step, attempt.staged))
        assert [c.step for c in dst.checkpoints()] == [2]


def test_a_read_only_manager_begins_no_copy(tmp_path):
    with CheckpointManager(tmp_path / "a") as src:
        src.save(1, {"w": torch.ones(2)})
    with CheckpointManager(tmp_path / "a", read_only=True) as ro, pytest.raises(ReadOnlyError):
        ro.begin_copy(2)
