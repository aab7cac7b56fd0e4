"""The README's demo, run for real: torchrun with 4 ranks, a SIGKILL mid-save, resume."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_kills_mid_save_and_resumes_bit_identically():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "demo", "run.py")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=280,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "the job died in the middle of a save" in out
    assert "resumed from checkpoint step 15" in out
    assert "bit-identical" in out
    # The listing after the kill shows 5, 10, 15 and nothing of step 20 as a checkpoint.
    after_kill = out.split("=== 2.")[1].split("=== 3.")[0]
    assert "checkpoint-15" in after_kill or " 15 " in after_kill
    assert "half-written save left in .pending/: ['checkpoint-20." in after_kill
