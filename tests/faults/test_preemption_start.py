"""Preemption while a process starts, in real child processes: armed from the
environment at import, a start-up that outlasts the grace period exits with the requeue
code, a guard that takes the signal over stands the deadline down, and the deadline
counts from the first signal another worker of the node noted. (The in-process cases
are in tests/unit/test_preemption.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from atomic_checkpoint import REQUEUE_EXIT_CODE, CheckpointManager

pytestmark = pytest.mark.timeout(60)

REPO = str(Path(__file__).resolve().parents[2])


def test_env_arms_at_import_a_sigterm_before_the_guard_is_adopted_and_exits_75(tmp_path):
    code = textwrap.dedent(
        f"""
        import atexit, os, signal, time
        import atomic_checkpoint                  # ATOMIC_CHECKPOINT_ARM=1: armed here
        os.kill(os.getpid(), signal.SIGTERM)      # start-up: no manager, no guard yet
        deadline = time.monotonic() + 10
        while atomic_checkpoint.preemption.armed() == (None, None):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        from atomic_checkpoint import CheckpointManager, PreemptionGuard
        mgr = CheckpointManager({str(tmp_path / "ckpt")!r})
        guard = PreemptionGuard(mgr)
        assert guard.requested and guard.signum == signal.SIGTERM
        assert guard.should_save(1) is True and guard.stopping
        mgr.save(1, {{"step": 1}})
        guard.close()
        mgr.close()
        # After exit() a late SIGTERM (the launcher stopping the other ranks) is
        # ignored: the status stays the requeue code, not a death by SIGTERM.
        atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
        guard.exit()
        """
    )
    path = os.pathsep.join([os.path.join(REPO, "src"), REPO])  # this tree's library
    env = {**os.environ, "ATOMIC_CHECKPOINT_ARM": "1", "PYTHONPATH": path}
    env.pop("ATOMIC_CHECKPOINT_GRACE_S", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == REQUEUE_EXIT_CODE == 75, proc.stderr
    reader = CheckpointManager(tmp_path / "ckpt", read_only=True)
    assert reader.latest().step == 1 and reader.restore(1) == {"step": 1}

    # Without the variable, or with it saying no, the same early SIGTERM kills the
    # process (the default action).
    for off in (None, "0", "false", "No", "off", ""):
        if off is None:
            env.pop("ATOMIC_CHECKPOINT_ARM")
        else:
            env["ATOMIC_CHECKPOINT_ARM"] = off
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == -signal.SIGTERM, (off, proc.stderr)


_STARTING = """
import os, signal, sys, time
from atomic_checkpoint import preemption
preemption.arm()                      # the grace period comes from the environment
os.kill(os.getpid(), signal.SIGTERM)  # preempted while the job is still starting
deadline = time.monotonic() + 10
while preemption.armed() == (None, None):
    assert time.monotonic() < deadline
    time.sleep(0.001)
if sys.argv[1] == "guard":            # the job gets as far as its guard
    from atomic_checkpoint import CheckpointManager, PreemptionGuard
    mgr = CheckpointManager(sys.argv[2])
    guard = PreemptionGuard(mgr)
time.sleep(4)                         # a start-up (imports, model, process group) > grace
print("still here")
"""


def _start(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([os.path.join(REPO, "src"), REPO])  # this tree's library
    env = {**os.environ, "PYTHONPATH": path, "ATOMIC_CHECKPOINT_GRACE_S": "1"}
    env.pop("ATOMIC_CHECKPOINT_ARM", None)
    return subprocess.run(
        [sys.executable, "-c", _STARTING, mode, str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_start_up_that_outlasts_the_grace_period_exits_with_the_requeue_code(tmp_path):
    # Grace 1 s: no guard 0.5 s after the SIGTERM, so the process exits with 75 at
    # once instead of starting up until the scheduler's SIGKILL (no exit status).
    proc = _start(tmp_path, "starting")
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr
    assert "still here" not in proc.stdout
    assert "no PreemptionGuard has taken it over" in proc.stderr


def test_once_a_guard_adopts_the_signal_the_start_up_deadline_stands_down(tmp_path):
    proc = _start(tmp_path, "guard")
    assert proc.returncode == 0, proc.stderr  # the guard decides, not the deadline
    assert "still here" in proc.stdout


_NOTED = """
import os, signal, sys, time
from atomic_checkpoint import preemption
preemption.arm()                      # grace period 4 s from the environment
os.kill(os.getpid(), signal.SIGTERM)  # the launcher stopping this worker at start-up
deadline = time.monotonic() + 10
while preemption.armed() == (None, None):
    assert time.monotonic() < deadline
    time.sleep(0.001)
at = preemption.armed()[1]
for seconds_before in sys.argv[2:]:   # another worker of the node, signalled earlier
    os.mkdir(os.path.join(sys.argv[1], f"{at - float(seconds_before):.6f}-15-1"))
time.sleep(6)                         # a start-up longer than the grace period
print("still here")
"""


@pytest.mark.parametrize("seconds_before", [3.0, 5.0])
def test_the_start_up_deadline_counts_from_the_first_signal_noted_on_the_node(
    tmp_path, seconds_before
):
    # Under the launcher: another worker got its signal 3 s before this one (its own
    # deadline ended it, and the agent's SIGTERM reached this one only then), so 4 s of
    # grace leave nothing to wait for. A note 5 s older than this signal (more than the
    # grace period) is from an earlier preemption the job outlived: not counted.
    shared = tmp_path / "signals"
    shared.mkdir()
    path = os.pathsep.join([os.path.join(REPO, "src"), REPO])  # this tree's library
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "ATOMIC_CHECKPOINT_GRACE_S": "4",
        "ATOMIC_CHECKPOINT_SIGNALS_DIR": str(shared),
    }
    env.pop("ATOMIC_CHECKPOINT_ARM", None)
    proc = subprocess.run(
        [sys.executable, "-c", _NOTED, str(shared), str(seconds_before)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr
    assert "still here" not in proc.stdout
    assert ("at another worker of this node" in proc.stderr) == (seconds_before < 4), proc.stderr
    # It noted its own signal for the other workers: when, SIGTERM, its pid.
    mine = [n for n in os.listdir(shared) if not n.endswith("-1")]
    assert len(mine) == 1 and mine[0].split("-")[1] == str(int(signal.SIGTERM)), mine


_IN_A_C_CALL = """
import os, signal, sys, threading, time
from atomic_checkpoint import preemption
preemption.arm()                      # the grace period comes from the environment
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=20))
# SIGTERM while the main thread waits inside torch's store client, as in
# init_process_group waiting for a slower rank: no Python handler runs until it returns.
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    store.get("never-set")
except Exception as exc:
    print("the wait ended:", type(exc).__name__)
print("still here")
"""


@pytest.mark.timeout(90)
def test_a_signal_while_the_main_thread_is_inside_a_c_call_still_meets_the_deadline(tmp_path):
    # The start-up deadline read what the Python handler recorded, and that handler only
    # runs between bytecodes: a rank blocked in init_process_group (waiting for a slower
    # one) never acted on its SIGTERM, and the launcher's SIGKILL ended it long after
    # the grace period. The C-level handler's wakeup pipe tells the deadline at once.
    path = os.pathsep.join([os.path.join(REPO, "src"), REPO])
    env = {**os.environ, "PYTHONPATH": path, "ATOMIC_CHECKPOINT_GRACE_S": "4"}
    env.pop("ATOMIC_CHECKPOINT_ARM", None)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _IN_A_C_CALL], env=env, capture_output=True, text=True, timeout=80
    )
    assert proc.returncode == REQUEUE_EXIT_CODE, (proc.returncode, proc.stdout, proc.stderr)
    assert "still here" not in proc.stdout and "the wait ended" not in proc.stdout
    assert "no PreemptionGuard has taken it over" in proc.stderr
    assert time.monotonic() - started < 15  # the store's own wait is 20 s
