"""The protocol under a real torchrun launch (4 processes, gloo)."""

from __future__ import annotations

import json
import os

import pytest

from atomic_checkpoint import CheckpointManager
from tests.helpers import run_module

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torchrun_four_ranks_round_trip(tmp_path):
    proc = run_module(
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        os.path.join(REPO, "tests", "dist", "scripts", "torchrun_roundtrip.py"),
        tmp_path,
        env={"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
        cwd=REPO,
        timeout_s=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert sorted(x["rank"] for x in lines) == [0, 1, 2, 3]
    assert all(x["restore_ok"] and x["replicated_ok"] for x in lines)
    assert all(x["latest"] == 7 and x["files_step"] == 9 for x in lines)
    assert len({json.dumps(x["infos"]) for x in lines}) == 1  # same CheckpointInfo everywhere
    state = CheckpointManager(tmp_path / "state", read_only=True)
    assert [c.step for c in state.checkpoints()] == [3, 6, 7]
    files = CheckpointManager(tmp_path / "files", read_only=True)
    assert sorted(f for f in os.listdir(tmp_path / "files" / "checkpoint-9")) == [
        "checkpoint.manifest.json",
        "config.json",
        "shard-0.bin",
        "shard-1.bin",
        "shard-2.bin",
        "shard-3.bin",
        "sub",
    ]
    files.verify(9)
