"""The Accelerate integration (save_state / load_state), with the real accelerate,
real torchrun jobs on gloo and real SIGKILLs.

Each multi-process test is one launch whose job writes what it saw to JSON files
(tests/integrations/scripts/accel_*.py); the assertions are grouped here.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from .helpers import RUN_TIMEOUT_S, SCRIPTS, communicate, job_env, run_example, run_job, spawn

STATE_FILES = {"model.safetensors", "optimizer.bin", "scheduler.bin"}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _checkpoints(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("checkpoint")]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_torchrun_job_saves_rotates_and_resumes_identically(tmp_path: Path) -> None:
    """2 processes: save_state with automatic naming and total_limit=2 commits both
    ranks' files and rotates after each commit; a fresh Accelerator's load_state
    restores exactly the saved state and continues the naming."""
    run_job(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPTS / "accel_dist.py"),
            str(tmp_path),
        ],
        job_env(tmp_path),
        "torchrun accel_dist.py",
    )
    for rank in (0, 1):
        r = _load(tmp_path / f"result-{rank}.json")
        assert r["saved_a"] == [0, 1, 2, 3]  # step = Accelerate's save iteration
        assert _checkpoints(r["listing_a"]) == ["checkpoint_2", "checkpoint_3"]
        assert r["loaded_step"] == 3
        assert r["iteration_after_load"] == 4  # the next save does not collide
        assert r["saved_b"] == [4, 5]
        assert _checkpoints(r["listing_b"]) == ["checkpoint_4", "checkpoint_5"]
        # model, optimizer, scheduler and RNG after load_state == right after the save
        assert r["restored_vs_saved"] == []
        assert r["losses_b"] == r["losses_c"] and len(r["losses_b"]) == 4
    files = _load(tmp_path / "result-0.json")["files"]  # every checksum verified
    assert sorted(files, key=int) == ["4", "5"]
    for names in files.values():
        assert STATE_FILES | {"random_states_0.pkl", "random_states_1.pkl"} <= set(names)


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_sigkill_mid_save_stock_loses_everything_atomic_resumes_exactly(tmp_path: Path) -> None:
    """total_limit=1, killed during the third save (model written, optimizer not): stock
    Accelerate had already deleted the previous checkpoint, so only a torn folder is
    left and load_state() fails; the integration still has the previous checkpoint,
    complete, and resumes from it with the reference run's exact state."""
    stock, atomic, ref = tmp_path / "stock", tmp_path / "atomic", tmp_path / "ref"
    script = str(SCRIPTS / "accel_kill.py")
    runs = [
        spawn([sys.executable, script, "run", kind, str(out)], job_env(tmp_path))
        for kind, out in (("stock", stock), ("atomic", atomic))
    ]
    for p, out in zip(runs, communicate(runs, RUN_TIMEOUT_S), strict=True):
        assert p.returncode == -signal.SIGKILL, out[-4000:]

    result = tmp_path / "result.json"
    run_job(
        [sys.executable, script, "check", str(stock), str(atomic), str(ref), str(result)],
        job_env(tmp_path),
        "accel_kill.py check",
    )
    r = _load(result)
    # Stock: the rotation ran before the save, so the only folder left is the torn one.
    assert r["stock_listing"] == ["checkpoint_2"]
    assert r["stock_files"] == {"checkpoint_2": ["model.safetensors"]}
    assert r["stock_load"].startswith("FileNotFoundError"), r["stock_load"]
    assert "optimizer.bin" in r["stock_load"]
    # The integration refuses to start fresh over those folders, and tells apart
    # "nothing there" (an error unless missing_ok) from "nothing valid there".
    assert r["atomic_on_stock"].startswith("ResumeError") and "checkpoint_2" in r["atomic_on_stock"]
    assert r["atomic_on_empty"].startswith("CheckpointNotFoundError")
    assert r["atomic_on_empty_missing_ok"] == "returned None"
    # Atomic: the previous checkpoint is intact and is what load_state() restores.
    assert _checkpoints(r["atomic_listing"]) == ["checkpoint_1"]
    assert r["atomic_loaded_step"] == 1
    assert r["restored_vs_reference"] == []
    assert r["losses_resumed"] == r["losses_reference"] and len(r["losses_resumed"]) == 4


@pytest.mark.timeout(180)
def test_example_runs_and_says_what_happened(tmp_path: Path) -> None:
    project = tmp_path / "project"
    stdout = run_example(tmp_path, "accelerate_save_state.py", project)
    assert "committed: ['checkpoint_2', 'checkpoint_3']" in stdout
    assert "load_state() restored checkpoint_3" in stdout
    assert "the next save_state() is checkpoint_4" in stdout
    assert "['checkpoint_4', 'checkpoint_5']" in stdout
    assert (project / "checkpoints" / "checkpoint_5" / "checkpoint.manifest.json").is_file()
