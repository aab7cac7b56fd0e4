"""SIGKILL in the middle of an Accelerate save made through the stock call, then a
restart: Accelerate's names kept, its own calls working beside ours.

accel_layout.py run {stock|switch} PROJECT_DIR
    Trains steps 1-6 and calls the stock ``accelerator.save_state()`` every 2 steps
    (automatic naming; ``stock``: plain Accelerate, no total_limit; ``switch``: after
    ``make_atomic(accelerator)``, total_limit=1), and kills itself with SIGKILL during
    the third save (iteration 2): after model.safetensors is written, before
    optimizer.bin.

accel_layout.py check {stock|switch} PROJECT_DIR REF_DIR RESULT_JSON
    stock: continues the stock run with the integration (load_state with
    adopt_existing=True), then saves once with it. switch: restarts with the switch
    installed (``accelerator.load_state()``), and also loads with a plain Accelerator.
    Each restored state is compared with an uninterrupted reference run, and training
    continues to step 8.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import differences, dump, snapshot
from tiny_accel import build, kill_during_save, train_step

from atomic_checkpoint.integrations.accelerate import close, load_state, make_atomic, save_state

KILL_AT_SAVE = 2


def run(kind: str, project: str) -> None:
    acc, model, opt, sched = build(project, total_limit=None if kind == "stock" else 1)
    if kind == "switch":
        make_atomic(acc, timeout_s=60)
    kill_during_save(acc, KILL_AT_SAVE)
    for step in range(1, 7):
        train_step(acc, model, opt, sched, step)
        if step % 2 == 0:
            acc.save_state()  # the stock call, as third-party code makes it
    raise SystemExit("the run finished without being killed")


def _listing(project: str) -> dict[str, list[str]]:
    root = os.path.join(project, "checkpoints")
    return {d: sorted(os.listdir(os.path.join(root, d))) for d in sorted(os.listdir(root))}


def _reference(ref: str) -> tuple[dict[str, object], dict[int, float], dict[str, object]]:
    """An uninterrupted run: its state right after the second save (iteration 1, step
    4), its losses of steps 5-8, and its state after step 8."""
    acc, model, opt, sched = build(ref, total_limit=None)
    state: dict[str, object] = {}
    losses: dict[int, float] = {}
    for step in range(1, 9):
        losses[step] = train_step(acc, model, opt, sched, step)
        if step == 4:
            state = snapshot(model, opt, sched)
    return state, {k: v for k, v in losses.items() if k >= 5}, snapshot(model, opt, sched)


def _outcome(fn) -> str:
    try:
        return f"returned {fn()!r}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


def check(kind: str, project: str, ref: str, result: str) -> None:
    doc: dict[str, object] = {"listing_after_kill": _listing(project)}
    reference, ref_losses, at_8 = _reference(ref)
    doc["losses_reference"] = ref_losses
    acc, model, opt, sched = build(project, total_limit=None, seed=123)  # load overrides it
    if kind == "stock":
        info = load_state(acc, adopt_existing=True, timeout_s=60)
        doc["loaded_step"] = info.step if info else None
        doc["loaded_adopted"] = bool(info and info.path.endswith("checkpoint_1"))
    else:
        make_atomic(acc, timeout_s=60)
        info = acc.load_state()
        doc["loaded_step"] = info.step if info else None
    doc["restored_vs_reference"] = differences(snapshot(model, opt, sched), reference)
    doc["iteration_after_load"] = acc.save_iteration
    doc["losses_resumed"] = {s: train_step(acc, model, opt, sched, s) for s in range(5, 9)}
    if kind == "stock":
        doc["saved"] = _outcome(lambda: save_state(acc, timeout_s=60).step)
    else:
        doc["saved"] = _outcome(lambda: os.path.basename(acc.save_state()))
    close(acc)
    doc["listing_after_save"] = _listing(project)
    if kind == "switch":
        # Accelerate alone (no switch) on the same project: it lists checkpoints/ and
        # loads the highest-numbered folder, which is the one just committed.
        acc, model, opt, sched = build(project, total_limit=None, seed=321)
        doc["stock_load"] = _outcome(acc.load_state)
        # What the restart committed at iteration 2 is the reference after step 8.
        doc["stock_loaded_vs_saved"] = differences(snapshot(model, opt, sched), at_8)
    dump(result, doc)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        check(*sys.argv[2:6])
