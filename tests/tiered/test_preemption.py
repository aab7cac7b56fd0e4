"""A preempted tiered job: ``PreemptionGuard`` over a ``TieredCheckpointManager``
saves the agreed step on tier 0, and ``close(timeout_s=guard.time_left_s)`` replicates
it to the persistent tier within what is left of the grace period, so the job that
requeues on another node (an empty tier 0) resumes from it. A real SIGTERM to a real
child process; both tiers are local directories."""

from __future__ import annotations

import json
import textwrap

import pytest
from tests.helpers import run_python

from atomic_checkpoint import REQUEUE_EXIT_CODE, CheckpointManager, catalog

JOB = textwrap.dedent(
    """
    import json, os, signal, sys

    from atomic_checkpoint import preemption
    preemption.arm()

    import numpy as np
    from atomic_checkpoint import KeepLast, PreemptionGuard, Tier, TieredCheckpointManager

    fast, slow, signal_at, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mgr = TieredCheckpointManager(
        [Tier(fast, retention=KeepLast(1)), Tier(slow, retention=KeepLast(3))]
    )
    latest = mgr.latest()
    start = 0
    if latest is not None:
        start = int(mgr.restore()["step"]) + 1
    with PreemptionGuard(mgr, grace_s=30) as guard:
        for step in range(start, start + steps):
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
            if guard.should_save(step) or (step % 10 == 0 and not guard.stopping):
                mgr.save(step, {"step": np.int64(step), "w": np.full(1000, float(step))})
            if guard.stopping:
                break
    left = guard.time_left_s
    print(json.dumps({
        "start": start,
        "decided": guard.decided_step,
        "time_left": left,
        "not_replicated": mgr.close(timeout_s=left),
    }))
    guard.exit()
    """
)


@pytest.mark.timeout(120)
def test_a_preempted_tiered_job_replicates_its_last_save_within_the_grace_period(tmp_path):
    fast, slow = tmp_path / "node-a", tmp_path / "persistent"
    child = run_python(JOB, fast, slow, 25, 1000, timeout_s=90)
    assert child.returncode == REQUEUE_EXIT_CODE, child.stderr
    out = json.loads(child.stdout.splitlines()[-1])
    assert out["start"] == 0 and out["decided"] == 25, out
    assert 0 < out["time_left"] <= 30
    assert out["not_replicated"] == []  # drained within the grace period
    persistent = CheckpointManager(slow, read_only=True)
    assert [c.step for c in persistent.checkpoints()] == [10, 20, 25]
    catalog.load_checkpoint(persistent.storage, 25, full=True)

    # Requeued on another node: its tier 0 is empty; the job resumes from step 25.
    child = run_python(JOB, tmp_path / "node-b", slow, -1, 10, timeout_s=90)
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.splitlines()[-1])
    assert out["start"] == 26 and out["decided"] is None, out
