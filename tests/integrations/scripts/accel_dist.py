"""torchrun job (2 processes, gloo): save_state / load_state with rotation and resume.

Phase A: steps 1-8, save_state(accelerator) every 2 steps (automatic naming: steps
0-3) with total_limit=2. Phase B: a fresh Accelerator and model, load_state(), steps
9-12 with saves. Phase C: the same 12 steps uninterrupted. Writes OUT/result-<rank>.json.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import differences, dump, snapshot
from tiny_accel import build, train_step

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from atomic_checkpoint.catalog import read_manifest
from atomic_checkpoint.integrations.accelerate import close, load_state, save_state

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])


def run(project: str, steps: range, *, resume: bool) -> dict[str, object]:
    acc, model, opt, sched = build(project, total_limit=2)
    out: dict[str, object] = {"losses": {}}
    if resume:
        info = load_state(acc, timeout_s=60)
        out["loaded_step"] = info.step if info else None
        out["iteration_after_load"] = acc.save_iteration
        out["after_load"] = snapshot(model, opt, sched)
    for step in steps:
        out["losses"][step] = train_step(acc, model, opt, sched, step)
        if step % 2 == 0:
            info = save_state(acc, timeout_s=60)
            out.setdefault("saved", []).append(info.step)
            if step == 8:
                out["after_save_8"] = snapshot(model, opt, sched)
    close(acc)
    return out


def main() -> None:
    project = os.path.join(OUT, "project")
    a = run(project, range(1, 9), resume=False)
    root = os.path.join(project, "checkpoints")
    dist.barrier()  # rank 0 has finished its rotation (close): list from every rank
    listing_a = sorted(os.listdir(root))
    b = run(project, range(9, 13), resume=True)
    dist.barrier()
    c = run(os.path.join(OUT, "reference"), range(1, 13), resume=False)
    result: dict[str, object] = {
        "saved_a": a["saved"],
        "saved_b": b["saved"],
        "listing_a": listing_a,
        "listing_b": sorted(os.listdir(root)),
        "loaded_step": b["loaded_step"],
        "iteration_after_load": b["iteration_after_load"],
        "restored_vs_saved": differences(b["after_load"], a["after_save_8"]),
        "losses_b": b["losses"],
        "losses_c": {k: v for k, v in c["losses"].items() if k > 8},
    }
    if RANK == 0:
        mgr = CheckpointManager(root, read_only=True, coordinator=SingleProcessCoordinator())
        result["files"] = {
            str(i.step): sorted(
                f.path
                for f in read_manifest(mgr.storage, f"checkpoint-{mgr.verify(i.step).step}").files
            )
            for i in mgr.checkpoints()
        }
    dump(os.path.join(OUT, f"result-{RANK}.json"), result)


if __name__ == "__main__":
    main()
