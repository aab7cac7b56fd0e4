"""An Accelerate loop with ``preemption_guard``, signals armed first; SIGTERM to itself
during step ``SIGNAL_AT`` (as a scheduler would send it). Writes ``OUT/result.json``
and exits with the guard's exit status.

Arguments: OUT SIGNAL_AT [TOTAL_LIMIT].
"""

from atomic_checkpoint import preemption

preemption.arm()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from tiny_accel import build, train_step  # noqa: E402

from atomic_checkpoint.integrations.accelerate import (  # noqa: E402
    close,
    preemption_guard,
    save_state,
)

out, signal_at = sys.argv[1], int(sys.argv[2])
limit = int(sys.argv[3]) if len(sys.argv) > 3 else None
accelerator, model, optimizer, scheduler = build(out, total_limit=limit)
guard = preemption_guard(accelerator)
saved = []
for step in range(1, 50):
    train_step(accelerator, model, optimizer, scheduler, step)
    if step == signal_at:
        os.kill(os.getpid(), signal.SIGTERM)
    if guard.should_save(step) or (step % 3 == 0 and not guard.stopping):
        saved.append(save_state(accelerator, step=step).step)
    if guard.stopping:
        break
guard.close()
close(accelerator, timeout_s=guard.time_left_s)  # None: not preempted, no bound
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"saved": saved, "decided": guard.decided_step, "exit_code": guard.exit_code}, f)
guard.exit()
