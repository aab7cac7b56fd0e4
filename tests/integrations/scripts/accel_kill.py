"""SIGKILL in the middle of an Accelerate save, stock and atomic.

accel_kill.py run {stock|atomic} PROJECT_DIR
    Trains steps 1-6, saving every 2 steps with automatic naming and total_limit=1,
    and kills itself with SIGKILL during the third save (steps 0, 1, then 2): after
    model.safetensors is written, before optimizer.bin.

accel_kill.py check STOCK_DIR ATOMIC_DIR REF_DIR RESULT_JSON
    Tries the stock load_state() on the stock run and atomic load_state() on the
    atomic run, compares the restored state with an uninterrupted reference, and
    continues both to step 8.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import differences, dump, snapshot
from tiny_accel import build, kill_during_save, train_step

from atomic_checkpoint.integrations.accelerate import close, load_state, save_state

KILL_AT_SAVE = 2


def run(kind: str, project: str) -> None:
    acc, model, opt, sched = build(project, total_limit=1)
    kill_during_save(acc, KILL_AT_SAVE)
    for step in range(1, 7):
        train_step(acc, model, opt, sched, step)
        if step % 2 == 0:
            if kind == "stock":
                acc.save_state()
            else:
                save_state(acc, timeout_s=60)
    raise SystemExit("the run finished without being killed")


def check(stock: str, atomic: str, ref: str, result: str) -> None:
    doc: dict[str, object] = {}
    stock_root = os.path.join(stock, "checkpoints")
    doc["stock_listing"] = sorted(os.listdir(stock_root))
    doc["stock_files"] = {
        d: sorted(os.listdir(os.path.join(stock_root, d))) for d in doc["stock_listing"]
    }
    acc, model, opt, sched = build(stock, total_limit=1)
    try:
        acc.load_state()
        doc["stock_load"] = "succeeded"
    except Exception as exc:
        doc["stock_load"] = f"{type(exc).__name__}: {exc}"
        doc["stock_traceback"] = traceback.format_exc()
    # The integration pointed at the stock run: no silent fresh start over its folders.
    doc["atomic_on_stock"] = _outcome(lambda: load_state(acc, missing_ok=True, timeout_s=60))
    empty = os.path.join(ref, "empty")
    doc["atomic_on_empty"] = _outcome(lambda: load_state(acc, root=empty, timeout_s=60))
    doc["atomic_on_empty_missing_ok"] = _outcome(
        lambda: load_state(acc, root=empty, missing_ok=True, timeout_s=60)
    )
    close(acc)

    doc["atomic_listing"] = sorted(os.listdir(os.path.join(atomic, "checkpoints")))
    acc, model, opt, sched = build(atomic, total_limit=1, seed=123)  # load must override this
    info = load_state(acc, timeout_s=60)
    doc["atomic_loaded_step"] = info.step if info else None
    restored = snapshot(model, opt, sched)
    resumed = {s: train_step(acc, model, opt, sched, s) for s in range(5, 9)}
    close(acc)

    acc, model, opt, sched = build(ref, total_limit=1)
    reference: dict[int, float] = {}
    for step in range(1, 9):
        reference[step] = train_step(acc, model, opt, sched, step)
        if step % 2 == 0:
            acc.save_state()
            if step == 4:  # the state that checkpoint step 1 (the second save) holds
                doc["restored_vs_reference"] = differences(restored, snapshot(model, opt, sched))
    doc["losses_resumed"] = resumed
    doc["losses_reference"] = {k: v for k, v in reference.items() if k >= 5}
    dump(result, doc)


def _outcome(fn) -> str:
    try:
        return f"returned {fn()!r}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        check(*sys.argv[2:6])
