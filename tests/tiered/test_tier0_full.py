"""Tier 0 filled while the persistent tier was away: its steps are held past tier 0's
policy until they are replicated. Once they are, only a commit's retention frees them,
and no save could commit on the full disk: every later save raised StorageFullError
until ``close()`` (the error's advice, ``prune`` or ``apply_retention()``, did not apply
to a running tiered job)."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import numpy as np
import pytest
from tests.testbed.pytest_fixtures import small_disk  # noqa: F401

from atomic_checkpoint import (
    CheckpointManager,
    KeepLast,
    StorageFullError,
    Tier,
    TieredCheckpointManager,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(1 << 18, step, dtype=np.float32)}  # 1 MiB


def test_a_save_on_a_tier_0_full_of_steps_replicated_since_frees_them_and_commits(
    small_disk, tmp_path
):
    disk = small_disk(6, "tmpfs")
    fast, slow = disk.path / "fast", tmp_path / "slow"
    mgr = TieredCheckpointManager(
        [Tier(str(fast), retention=KeepLast(1)), Tier(str(slow))], retry_max_s=0.2
    )
    mgr.save(1, _state(1))
    assert mgr.wait_replicated(timeout_s=30)
    (tmp_path / "away").mkdir()
    slow.rename(tmp_path / "away" / "slow")  # the persistent tier is gone for a while
    slow.write_text("not a directory")
    saved = []
    for step in range(2, 12):
        try:
            mgr.save(step, _state(step))
            saved.append(step)
        except StorageFullError:
            break
    assert 2 <= len(saved) < 10, saved  # held on tier 0 until it filled
    slow.unlink()
    (tmp_path / "away" / "slow").rename(slow)  # back
    assert mgr.wait_replicated(timeout_s=60)
    after = saved[-1] + 1
    info = mgr.save(after, _state(after))  # raised StorageFullError for good
    assert info.step == after
    assert mgr.wait_replicated(timeout_s=60)
    assert mgr.close() == []
    with CheckpointManager(slow, read_only=True) as tier1:
        assert [c.step for c in tier1.checkpoints()] == [1, *saved, after]
        assert np.array_equal(tier1.restore(after)["w"], _state(after)["w"])
