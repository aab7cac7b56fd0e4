"""``make_atomic(trainer, preemption=True)`` under a real launcher: the HF Trainer in a
2-rank gloo job started by ``python -m atomic_checkpoint.launch``
(``scripts/preempt_frameworks.py``), a real SIGTERM to one worker only. The other rank
never sees a signal; the guard's vote at ``on_step_end`` must still stop both at one
step, save that step atomically on both, and every process must exit with the requeue
code. (The single-process case is ``tests/integrations/test_hf_preemption.py``; the
``preemption`` campaign measures the stock Trainer against it.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atomic_checkpoint import REQUEUE_EXIT_CODE, CheckpointManager

pytest.importorskip("transformers", reason="the HF integration needs transformers")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "dist" / "scripts" / "preempt_frameworks.py"


def test_sigterm_to_one_worker_stops_both_ranks_at_one_saved_step_with_the_requeue_code(
    tmp_path,
):
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
        "ATOMIC_CHECKPOINT_GRACE_S": "60",
    }
    env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    with open(tmp_path / "launch.log", "w") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "atomic_checkpoint.launch", "--standalone"),
                *("--nproc-per-node=2", "--monitor-interval=0.1", str(SCRIPT), "hf", "ours"),
                *(str(tmp_path), str(ctl), "3000", "1000"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
            env=env,
        )
        try:

            def step(r: int) -> int:
                try:
                    return int((ctl / f"rank{r}.step").read_text() or 0)
                except (FileNotFoundError, ValueError):
                    return 0

            deadline = time.monotonic() + 120
            while not all(step(r) >= 3 for r in range(2)):
                assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "the job never reached step 3"
                time.sleep(0.05)
            os.kill(int((ctl / "rank1.pid").read_text()), signal.SIGTERM)
            rc = proc.wait(90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    out = (tmp_path / "launch.log").read_text()
    assert rc == REQUEUE_EXIT_CODE, out[-4000:]
    results = [json.loads((ctl / f"result-rank{r}.json").read_text()) for r in range(2)]
    decided = {r["decided"] for r in results}
    assert len(decided) == 1 and None not in decided, results
    step_ = decided.pop()
    assert all(r["exit_code"] == REQUEUE_EXIT_CODE and r["global_step"] == step_ for r in results)
    # save_steps=1000: the only checkpoint is the preemption save, committed and whole.
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    assert [c.step for c in reader.checkpoints()] == [step_]
    reader.verify(step_)
    names = {p.name for p in (tmp_path / "run" / f"checkpoint-{step_}").iterdir()}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= names
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= names  # both ranks' part
    assert f"every rank saves step {step_} now" in out
