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


def test_sigterm_saves_the_current_step_stops_and_exits_with_the_requeue_code(tmp_path):
    path = os.pathsep.join([str(SCRIPTS), str(REPO / "src"), str(REPO)])
    proc = _spawn(
        [sys.executable, str(SCRIPTS / "accel_preempt.py"), str(tmp_path), "5"],
        _env(tmp_path, PYTHONPATH=path),
    )
    (out,) = _communicate([proc], 100)
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    # A periodic save at 3, the preemption save at 5, nothing after.
    assert result == {"saved": [3, 5], "decided": 5, "exit_code": REQUEUE_EXIT_CODE}
    root = Path(tmp_path) / "checkpoints"
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [3, 5]
    reader.verify(5)
    assert any(p.name.startswith("model") for p in (root / "checkpoint_5").iterdir())
    assert "every rank saves step 5 now" in out
