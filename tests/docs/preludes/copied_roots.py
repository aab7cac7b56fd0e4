# Roots holding checkpoints copied from other runs, as README.md's "Resuming" assumes:
# new_root/checkpoint-7 copied (cp -a) from one run's root, and mixed_root holding
# checkpoints of two runs. The runs save with the real CheckpointManager.
# ruff: noqa: F821  (the sample uses these names, or defines them)
import shutil
import tempfile

from atomic_checkpoint import CheckpointManager

_runs = tempfile.mkdtemp()
for _run_id, _step in (("run-20240101-120000-1a2b3c4d", 7), ("run-20240202-090000-5e6f7a8b", 9)):
    with CheckpointManager(f"{_runs}/{_run_id}", run_id=_run_id) as _m:
        _m.save(_step, {"w": [float(_step)]})
    for _dest in ["new_root", "mixed_root"] if _step == 7 else ["mixed_root"]:
        shutil.copytree(f"{_runs}/{_run_id}/checkpoint-{_step}", f"{_dest}/checkpoint-{_step}")
# --- sample ---
# The first manager adopted the copied run and resumes from it; the second continues the
# run it was told to, among the two in mixed_root.
_first = CheckpointManager("new_root", read_only=True)
assert _first.latest().step == 7, _first.latest()
assert mgr.run_id == "run-20240101-120000-1a2b3c4d", mgr.run_id
assert mgr.latest().step == 7, mgr.latest()
print("ok")
