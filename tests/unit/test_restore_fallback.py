"""``restore()`` without a step skips a checkpoint that fails its checksum and loads the
next older one; ``restore(step=N)`` of it raises ``CorruptCheckpointError`` (DESIGN
invariants 6 and 11; the multi-rank agreement is in ``tests/dist/test_agreement.py``).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, CorruptCheckpointError


def _state(step: int) -> dict:
    return {"step": step, "w": np.full(4096, float(step), dtype=np.float32)}


def _flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restore_falls_back_past_checksum_failures_and_says_which(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    for s in (10, 20, 30):
        mgr.save(s, _state(s))
    bad = [str(tmp_path / f"checkpoint-{s}" / "rank-00000.safetensors") for s in (20, 30)]
    for path in bad:
        _flip_middle_byte(path)

    # latest() checks sizes only (cheap): both corrupt checkpoints still look complete.
    assert mgr.latest().step == 30
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        state = mgr.restore()
    assert state["step"] == 10 and float(state["w"][0]) == 10.0
    assert mgr.last_restored is not None and mgr.last_restored.step == 10
    skipped = [
        r.getMessage() for r in caplog.records if "skipping checkpoint step" in r.getMessage()
    ]
    assert len(skipped) == 2
    assert bad[1] in skipped[0] and bad[0] in skipped[1]

    with pytest.raises(CorruptCheckpointError, match="checksum") as info:
        mgr.restore(step=30)
    assert bad[1] in str(info.value)
    mgr.close()


def test_restore_with_nothing_that_verifies_is_an_error_listing_what_was_skipped(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    _flip_middle_byte(str(tmp_path / "checkpoint-1" / "rank-00000.safetensors"))
    # Never a silent fresh start: the error says what was found and why it was refused.
    with pytest.raises(CorruptCheckpointError, match=r"step 1: .*checksum"):
        mgr.restore()
    mgr.close()
