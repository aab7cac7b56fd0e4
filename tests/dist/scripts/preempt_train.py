"""A training job as the README's "Preemption" section writes it, run under
``python -m atomic_checkpoint.launch``: signals armed in the first lines, the guard at
every step boundary (and inside evaluation), the exit status from the guard.

Arguments: ROOT CTL MAX_STEPS SAVE_EVERY. Each rank writes ``CTL/rank<r>.pid`` and
``CTL/rank<r>.step`` as it goes and ``CTL/result-rank<r>.json`` at the end. A step is
data loading, the training collective, every ``EVAL_EVERY`` steps a short evaluation
(which asks the guard at each of its iterations, as the README says long loops must),
then the guard's boundary and, every SAVE_EVERY steps, a periodic save (``save_async``
with ``PREEMPT_ASYNC=1``); ``KeepLast(3)`` rotates.

Holding at a moment, so that a signal lands exactly there:
``PREEMPT_HOLD=<moment>`` (and ``PREEMPT_HOLD_NTH=<n>``, default 1: its n-th
occurrence) makes the rank(s) that reach it write ``CTL/at-<moment>-rank<r>`` and wait
until ``CTL/go`` exists, then up to 1 s more until this rank has seen a signal, and write
``CTL/left-<moment>-rank<r>`` (whether the signal arrived before it left). Moments:

- ``startup``: every rank, before the process group exists
  (``PREEMPT_HOLD_STARTUP=1`` is the same, writing ``CTL/startup-rank<r>``);
- ``eval``, ``data-loading``: every rank, inside those phases of a step;
- ``loader-workers``: every rank, having read a batch from a DataLoader with
  ``PREEMPT_LOADER_WORKERS`` worker processes (whose pids go to ``CTL/rank<r>.loaders``,
  for the campaign to signal them too); ours protects the loader with
  ``preemption.protect_dataloaders``, the stock loop does not;
- ``periodic-save``: rank 0 inside a synchronous save, its first file partly written
  (the library's ``mid_write`` fault point);
- ``async-save``: rank 0's background writer of a ``save_async``, same point, while
  the main thread trains on (``PREEMPT_ASYNC=1``);
- ``mid-commit``: rank 0 between its files' fsync and the manifest (``after_write``);
- ``rotation``: rank 0 deleting an old step for retention, the step un-committed, its
  data not yet deleted (``after_uncommit``).

The save-side moments wrap the library's named fault points (``atomic_checkpoint._faults``
documents them) in this process; nothing else of the library changes.

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
import threading
import time
from datetime import timedelta
from pathlib import Path

root, ctl = sys.argv[1], Path(sys.argv[2])
max_steps, save_every = int(sys.argv[3]), int(sys.argv[4])
rank = int(os.environ["RANK"])
EVAL_EVERY, EVAL_ITERS = 4, 3
HOLD = os.environ.get("PREEMPT_HOLD", "startup" if os.environ.get("PREEMPT_HOLD_STARTUP") else "")
HOLD_NTH = int(os.environ.get("PREEMPT_HOLD_NTH", "1"))
EVERY_RANK = ("startup", "eval", "data-loading", "loader-workers")
live = {"guard": None}  # the guard, once it exists
seen = {"n": 0}


def put(name: str, text: str) -> None:
    tmp = ctl / f".{name}.{threading.get_ident()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, ctl / name)


def signalled() -> bool:
    if live["guard"] is not None:
        return live["guard"].requested
    early = preemption.armed()
    return early is not None and early[0] is not None


def hold(moment: str, step: int | None) -> None:
    """Wait here (the n-th time this rank reaches ``moment``) until the campaign has
    delivered its signal: the signal then lands while this rank is at that moment."""
    if moment != HOLD or (moment not in EVERY_RANK and rank != 0):
        return
    seen["n"] += 1
    if seen["n"] != HOLD_NTH:
        return
    where = {"step": step, "thread": threading.current_thread().name, "at": time.monotonic()}
    put(f"at-{moment}-rank{rank}", json.dumps(where))
    if moment == "startup":
        put(f"startup-rank{rank}", "")
    deadline = time.monotonic() + 60
    while not (ctl / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    # The agent forwards a signal it received a moment later: give it that moment.
    deadline = time.monotonic() + 1.0
    while not signalled() and time.monotonic() < deadline:
        time.sleep(0.01)
    put(f"left-{moment}-rank{rank}", json.dumps({**where, "signalled": signalled()}))


put(f"rank{rank}.pid", str(os.getpid()))
hold("startup", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tests.dist import workers  # noqa: E402

import atomic_checkpoint.commit as _commit  # noqa: E402
import atomic_checkpoint.rankfiles as _rankfiles  # noqa: E402
import atomic_checkpoint.strategies as _strategies  # noqa: E402
from atomic_checkpoint import CheckpointManager, KeepLast, PreemptionGuard  # noqa: E402

_SAVE_POINTS = {"mid_write": ("periodic-save", "async-save"), "after_write": ("mid-commit",)}
_SAVE_POINTS["after_uncommit"] = ("rotation",)


def _holding(point):  # type: ignore[no-untyped-def]
    def fault_point(phase: str, rank_: int, step: int | None = None) -> None:
        for moment in _SAVE_POINTS.get(phase, ()):
            main = threading.current_thread() is threading.main_thread()
            if (moment == "periodic-save" and not main) or (moment == "async-save" and main):
                continue
            hold(moment, step)
        point(phase, rank_, step)

    return fault_point


_commit.fault_point = _holding(_commit.fault_point)
_strategies.fault_point = _holding(_strategies.fault_point)
_rankfiles.fault_point = _holding(_rankfiles.fault_point)

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
world = dist.get_world_size()
mgr = CheckpointManager(root, timeout_s=30, retention=KeepLast(3))
latest = mgr.latest()
start, restored_ok = 1, None
if latest is not None:
    state = mgr.restore(latest.step)
    restored_ok = workers.states_equal(state, workers.make_state(latest.step, rank, big_elems=4096))
    start = latest.step + 1
loader_it = None
if int(os.environ.get("PREEMPT_LOADER_WORKERS", "0")):
    from torch.utils.data import DataLoader

    n = int(os.environ["PREEMPT_LOADER_WORKERS"])
    # Batches as lists: tensors would come back through shared memory, whose
    # descriptors travel over an AF_UNIX socket in $TMPDIR (too long a path under
    # pytest's temporary directories).
    loader = DataLoader(
        list(range(100_000)),
        batch_size=8,
        num_workers=n,
        persistent_workers=True,
        collate_fn=list,
    )
    if os.environ.get("PREEMPT_STOCK") != "1":
        preemption.protect_dataloaders(loader)
    loader_it = iter(loader)
    next(loader_it)  # the workers run now
    put(f"rank{rank}.loaders", " ".join(str(w.pid) for w in loader_it._workers))
saved: list[int] = []
committed_at = None
use_async = os.environ.get("PREEMPT_ASYNC") == "1"
with PreemptionGuard(mgr) as guard:
    live["guard"] = guard
    for step in range(start, start + max_steps):
        hold("data-loading", step)  # the next batch is being read
        if loader_it is not None:
            next(loader_it)  # from the loader's workers
            hold("loader-workers", step)
        batch = torch.full((8,), float(step))
        grad = batch.sum().reshape(1)
        dist.all_reduce(grad)  # the training's own collective
        time.sleep(0.02)
        put(f"rank{rank}.step", str(step))
        if step % EVAL_EVERY == 0:
            for i in range(EVAL_ITERS):
                if i == 1:
                    hold("eval", step)
                dist.all_reduce(torch.ones(1))
                # Long loops ask the guard too; the boundary below then saves this step.
                if guard.should_save(step) or guard.stopping:
                    break
        if guard.should_save(step):
            saved.append(mgr.save(step, workers.make_state(step, rank, big_elems=4096)).step)
            committed_at = time.monotonic()
        elif step % save_every == 0 and not guard.stopping:
            state = workers.make_state(step, rank, big_elems=4096)
            if use_async:
                mgr.save_async(step, state)
                saved.append(step)
            else:
                saved.append(mgr.save(step, state).step)
        if guard.stopping:
            break
mgr.close(timeout_s=guard.time_left_s)  # as the README: within the grace period
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
            "committed_at": committed_at,
        }
    ),
)
dist.destroy_process_group()
if os.environ.get("PREEMPT_STOCK") == "1":
    sys.exit(75 if guard.decided_step is not None else 0)
guard.exit()
