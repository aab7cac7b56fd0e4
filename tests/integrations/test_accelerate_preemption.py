"""``preemption_guard(accelerator)``: a real Accelerate loop (CPU) gets a real SIGTERM
mid-training, saves the step it is at with ``save_state`` (atomically), stops, and
exits with the requeue code; the checkpoint loads back."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from atomic_checkpoint import REQUEUE_EXIT_CODE, CheckpointManager
from tests.integrations.helpers import REPO, SCRIPTS
from tests.integrations.helpers import communicate as _communicate
from tests.integrations.helpers import job_env as _env
from tests.integrations.helpers import spawn as _spawn

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path: Path, *args: str, within_s: float = 100, **env: str) -> tuple[int, str]:
    path = os.pathsep.join([str(SCRIPTS), str(REPO / "src"), str(REPO)])
    proc = _spawn(
        [sys.executable, str(SCRIPTS / "accel_preempt.py"), str(tmp_path), *args],
        _env(tmp_path, PYTHONPATH=path, **env),
    )
    (out,) = _communicate([proc], within_s)
    return int(proc.returncode), out


def test_sigterm_saves_the_current_step_stops_and_exits_with_the_requeue_code(tmp_path):
    rc, out = _run(tmp_path, "5")
    assert rc == REQUEUE_EXIT_CODE, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    # A periodic save at 3, the preemption save at 5, nothing after.
    assert result == {"saved": [3, 5], "decided": 5, "exit_code": REQUEUE_EXIT_CODE}
    root = Path(tmp_path) / "checkpoints"
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [3, 5]
    reader.verify(5)
    assert any(p.name.startswith("model") for p in (root / "checkpoint_5").iterdir())
    assert "every rank saves step 5 now" in out


def test_a_preempted_loop_exits_within_the_grace_period_while_retention_is_stuck(tmp_path):
    # With total_limit=1 the preemption save's rotation deletes step 3, and that
    # deletion hangs (a stalled mount). close(accelerator) waited for it without a
    # bound, past the grace period: the scheduler's SIGKILL, not the requeue code.
    # close(accelerator, timeout_s=guard.time_left_s) leaves it running instead.
    grace_s = 8.0
    rc, out = _run(
        tmp_path,
        "5",
        "1",
        within_s=45,
        ATOMIC_CHECKPOINT_GRACE_S=str(grace_s),
        ATOMIC_CHECKPOINT_FAULTS="mid_delete@*=hang:3",
    )
    assert rc == REQUEUE_EXIT_CODE, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"saved": [3, 5], "decided": 5, "exit_code": REQUEUE_EXIT_CODE}
    assert "retention is still deleting old checkpoints" in out
    root = Path(tmp_path) / "checkpoints"
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [5]  # 3 was un-committed first
    reader.verify(5)
