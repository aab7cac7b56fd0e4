"""A training job as the README's "Preemption" section writes it, run under
``python -m atomic_checkpoint.launch``: signals armed in the first lines, the guard at
every step boundary, the exit status from the guard.

Arguments: ROOT CTL MAX_STEPS SAVE_EVERY. Each rank writes ``CTL/rank<r>.pid`` and
``CTL/rank<r>.step`` as it goes and ``CTL/result-rank<r>.json`` at the end. With
``PREEMPT_HOLD_STARTUP=1`` every rank stops before the process group exists, writes
``CTL/startup-rank<r>``, and goes on once ``CTL/go`` exists: a test signals it there.
With ``PREEMPT_STOCK=1`` it is the loop as the library's README had it before signals
could be armed and the exit status came from the guard (no ``arm()``, ``sys.exit`` of
75 once the ranks stopped): the ``preemption`` campaign's stock rows, under stock
torchrun.
"""

import os

from atomic_checkpoint import preemption

if os.environ.get("PREEMPT_STOCK") != "1":
    preemption.arm()  # before anything else: from here on a SIGTERM is recorded, not fatal

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

root, ctl = sys.argv[1], Path(sys.argv[2])
max_steps, save_every = int(sys.argv[3]), int(sys.argv[4])
rank = int(os.environ["RANK"])


def put(name: str, text: str) -> None:
    tmp = ctl / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, ctl / name)


put(f"rank{rank}.pid", str(os.getpid()))
if os.environ.get("PREEMPT_HOLD_STARTUP") == "1":
    put(f"startup-rank{rank}", "")
    deadline = time.monotonic() + 60
    while not (ctl / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tests.dist import workers  # noqa: E402

from atomic_checkpoint import CheckpointManager, KeepLast, PreemptionGuard  # noqa: E402

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
world = dist.get_world_size()
mgr = CheckpointManager(root, timeout_s=30, retention=KeepLast(3))
latest = mgr.latest()
start, restored_ok = 1, None
if latest is not None:
    state = mgr.restore(latest.step)
    restored_ok = workers.states_equal(state, workers.make_state(latest.step, rank, big_elems=4096))
    start = latest.step + 1
saved: list[int] = []
with PreemptionGuard(mgr) as guard:
    for step in range(start, start + max_steps):
        grad = torch.ones(1)
        dist.all_reduce(grad)  # the training's own collective
        time.sleep(0.02)
        put(f"rank{rank}.step", str(step))
        if guard.should_save(step) or (step % save_every == 0 and not guard.stopping):
            saved.append(mgr.save(step, workers.make_state(step, rank, big_elems=4096)).step)
        if guard.stopping:
            break
mgr.close()
put(
    f"result-rank{rank}.json",
    json.dumps(
        {
            "rank": rank,
            "world": world,
            "restored": latest.step if latest is not None else None,
            "restored_ok": restored_ok,
            "saved": saved,
            "decided": guard.decided_step,
            "requested_by": list(guard.requested_by),
            "signum": guard.signum,
            "skipped_save": guard.skipped_save,
            "exit_code": guard.exit_code,
        }
    ),
)
dist.destroy_process_group()
if os.environ.get("PREEMPT_STOCK") == "1":
    sys.exit(75 if guard.decided_step is not None else 0)
guard.exit()
