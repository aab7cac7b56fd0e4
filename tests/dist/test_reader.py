"""A concurrent reader never sees a torn checkpoint while a 4-rank job saves and rotates."""

from __future__ import annotations

import json
import time

import pytest

from atomic_checkpoint import CheckpointManager
from tests.dist import workers
from tests.dist.launcher import beside, ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def test_reader_polling_during_50_saves_sees_no_torn_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    stop, out = tmp_path / "stop", tmp_path / "reader.json"
    with beside("reader.py", root, 4, stop, out, 180, stop=stop) as reader:
        ready = tmp_path / "reader.json.ready"
        for _ in range(1200):  # bounded: 120 s for the reader's imports and start
            if ready.exists() or reader.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), "the reader process did not start"
        results = run_ranks(
            workers.w_save_steps,
            4,
            str(root),
            list(range(1, 51)),
            3,
            30.0,
            0.02,  # pause between saves, as training steps would
            tmp_dir=str(tmp_path),
            timeout_s=180,
        )
    for v in ok_values(results):
        assert v["done"] == list(range(1, 51))
    report = json.loads(out.read_text())
    print(
        f"reader: {report['reads']} reads of {report['steps_seen']} distinct steps, "
        f"{report['torn']} torn, {report['vanished']} vanished under rotation"
    )
    assert report["torn"] == 0, report["problems"]
    # A checkpoint rotated away under the reader is not reported as corrupt.
    assert report["warnings"] == []
    assert report["reads"] >= 20 and report["steps_seen"] >= 5
    # Retention kept exactly the last 3, all complete.
    mgr = CheckpointManager(root, read_only=True)
    assert [c.step for c in mgr.checkpoints()] == [48, 49, 50]
    for s in (48, 49, 50):
        mgr.verify(s)
