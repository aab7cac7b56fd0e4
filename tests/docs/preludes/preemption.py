# What README.md's "Preemption" job assumes, as the reader's own code: resume(mgr) (restore
# mgr.latest() and return the step to start from), train_step(), total_steps and state.
# The scheduler is modelled by train_step itself: in step 2, rank 0 sends SIGTERM to the
# launcher (the container's PID 1 under Kubernetes), which passes it on to every rank.
# After the launch, the job must have exited 75 (the marker's exit=75) with a verified
# checkpoint of the step every rank agreed to stop at (2, or later if the signal is slow).
# needs: launch:2
# ruff: noqa: E402  (the check after the launch has its own imports)
import os as _os
import signal as _signal


def resume(mgr):
    latest = mgr.latest()
    if latest is None:
        return 0
    state.update(mgr.restore(latest.step))
    return latest.step + 1


def train_step():
    global _steps
    _steps += 1
    state["w"] = [float(_steps)]
    if _steps == 3 and _os.environ["RANK"] == "0":  # the third step: step 2
        _os.kill(_os.getppid(), _signal.SIGTERM)


_steps = 0
total_steps = 5000  # bounded: a job the signal never reached ends with 0, not 75
state = {"w": [0.0]}
# --- sample ---
from atomic_checkpoint import CheckpointManager

with CheckpointManager("ckpt/run1", read_only=True) as mgr:
    steps = [c.step for c in mgr.checkpoints()]
    assert steps[0] == 0 and steps[-1] >= 2, steps  # the periodic save, then the preemption's
    mgr.verify(steps[-1])
print("saved steps", steps)
