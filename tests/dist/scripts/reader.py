"""A reader process that polls latest()/restore() while a job saves, counting torn reads.

Usage: reader.py ROOT WORLD STOP_FILE OUT_JSON DEADLINE_S
A read is torn if a checkpoint that is still committed fails to load or verify, or
holds anything but the exact state of its step. A checkpoint deleted by rotation
between latest() and the read is counted as "vanished", not torn.
"""

import json
import sys
import time

from atomic_checkpoint import CheckpointError, CheckpointManager
from atomic_checkpoint.catalog import read_manifest
from atomic_checkpoint.layout import checkpoint_name
from tests.dist.workers import make_state, states_equal
from tests.helpers import library_warnings

root, world, stop_file, out, deadline_s = (
    sys.argv[1],
    int(sys.argv[2]),
    sys.argv[3],
    sys.argv[4],
    float(sys.argv[5]),
)
warnings_seen = library_warnings()
mgr = CheckpointManager(root, read_only=True)
# Ready: the job may start saving (on a loaded machine this process's imports can take
# longer than the job's whole run).
with open(out + ".ready", "w") as f:
    f.write("ready")
reads = torn = vanished = 0
steps_seen = set()
problems = []
deadline = time.monotonic() + deadline_s
import os

while time.monotonic() < deadline and not os.path.exists(stop_file):
    try:
        info = mgr.latest()
    except CheckpointError as exc:
        torn += 1
        problems.append(f"latest(): {exc}")
        continue
    if info is None:
        time.sleep(0.005)
        continue
    for r in range(world):
        try:
            state = mgr.restore(info.step, rank=r)
        except CheckpointError as exc:
            try:
                read_manifest(mgr.storage, checkpoint_name(info.step))
            except CheckpointError:
                vanished += 1  # rotated away under us: not a torn read
                break
            torn += 1
            problems.append(f"step {info.step} rank {r}: {exc}")
            break
        reads += 1
        steps_seen.add(info.step)
        if not states_equal(state, make_state(info.step, r, n_big=2, big_elems=1 << 15)):
            torn += 1
            problems.append(f"step {info.step} rank {r}: wrong content")
with open(out, "w") as f:
    json.dump(
        {
            "reads": reads,
            "torn": torn,
            "vanished": vanished,
            "steps_seen": len(steps_seen),
            "problems": problems[:10],
            "warnings": warnings_seen.messages[:10],
        },
        f,
    )
