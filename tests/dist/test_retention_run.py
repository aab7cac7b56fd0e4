"""Retention in a real 4-rank job: bounded, never torn, best and newest survive."""

from __future__ import annotations

import json
import os

import pytest

from atomic_checkpoint import CheckpointManager, catalog
from atomic_checkpoint._faults import ROTATION_PHASES
from atomic_checkpoint.layout import PENDING_DIR, TRASH_DIR
from tests.dist import workers
from tests.dist.launcher import beside, ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def test_200_saves_keep_last_3_and_best_1_under_an_observer(tmp_path):
    root = tmp_path / "ckpt"
    stop, out = tmp_path / "stop", tmp_path / "observer.json"
    with beside("observer.py", root, stop, out, 200, stop=stop):
        results = run_ranks(
            workers.w_retention_run,
            4,
            str(root),
            list(range(1, 201)),
            tmp_dir=str(tmp_path),
            timeout_s=200,
        )
    values = ok_values(results)
    report = json.loads(out.read_text())
    print(
        f"observer: {report['polls']} polls, {report['checked']} checkpoints validated, "
        f"at most {report['max_seen']} at once, {report['torn']} torn"
    )
    assert report["torn"] == 0, report["problems"]
    assert report["polls"] > 50
    # Kept: last 3 + best 1 = 4, plus at most the one being committed.
    assert report["max_seen"] <= 5
    assert all(v["listed"] == [7, 198, 199, 200] for v in values)
    assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == [
        "checkpoint-198",
        "checkpoint-199",
        "checkpoint-200",
        "checkpoint-7",
    ]


@pytest.mark.parametrize("phase", ROTATION_PHASES)
def test_kill_the_coordinator_at_every_phase_of_rotation(tmp_path, phase):
    root = tmp_path / "ckpt"
    # Rotation after the commit of step 5 deletes step 2; the kill lands inside it.
    results = run_ranks(
        workers.w_retention_run,
        2,
        str(root),
        [1, 2, 3, 4, 5, 6],
        3.0,
        tmp_dir=str(tmp_path),
        faults=f"{phase}@0=kill:2",
        timeout_s=40,
    )
    assert results[0].killed
    # What is discoverable is complete; nothing half-deleted is listed.
    entries = catalog.scan(CheckpointManager(root, read_only=True).storage)
    assert all(e.status in ("ok", "pending") for e in entries), entries
    steps = [e.step for e in entries if e.status == "ok"]
    assert 5 in steps  # the newest committed before the crash is there
    assert 2 not in steps or phase == "before_uncommit"
    # Restart: leftovers are swept, and the next save converges retention.
    values = [
        r.value
        for r in run_ranks(
            workers.w_retention_run, 2, str(root), [6, 7], tmp_dir=str(tmp_path), timeout_s=40
        )
    ]
    assert all(v["listed"] == [5, 6, 7] for v in values), values
    assert os.listdir(root / TRASH_DIR) == [] and os.listdir(root / PENDING_DIR) == []
    for s in (5, 6, 7):
        CheckpointManager(root, read_only=True).verify(s)
