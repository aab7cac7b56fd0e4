"""One "node" of a 2-node torchrun job (1 process per node) whose nodes have their
own disks: each node trains with output_dir=BASE/node<N>, a directory the other node
never sees, and ATOMIC_CHECKPOINT_HOST names the node.

1. save_on_each_node=False: the first save must fail on every rank, saying the
   storage is not shared (stock: node 1's checkpoint would lack the model). Then a
   Trainer that writes the model on rank 0 only despite save_on_each_node=True: the
   first save must fail on every rank and commit nothing, on either node.
2. save_on_each_node=True: steps 1-6 of an 8-step schedule, saving every 2 steps with
   save_total_limit=2: each node commits its own complete copy and rotates it.
3. Node 1 loses its checkpoint-6 (as if its commit never happened); both nodes
   resume with resume_from_checkpoint=True and must agree on step 4, the newest step
   complete on every node, then train to 8.

Writes BASE/result-<rank>.json.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist
from compare import dump
from tiny_hf import RandomTokens, SnapshotAt, StopAt, tiny_args, tiny_model
from transformers import Trainer, TrainerCallback

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from atomic_checkpoint.catalog import read_manifest
from atomic_checkpoint.integrations.hf import make_atomic

BASE = sys.argv[1]
RANK = int(os.environ["RANK"])
NODE = int(os.environ["GROUP_RANK"])
OUT = os.path.join(BASE, f"node{NODE}")


class HalfCopyTrainer(Trainer):
    """Writes the model on global rank 0 only, although told to save on each node (what
    transformers 5.x save_pretrained does): node 1's copy would lack the weights."""

    def _save(self, output_dir=None, state_dict=None):
        if RANK == 0:
            super()._save(output_dir, state_dict)
        else:
            os.makedirs(output_dir, exist_ok=True)


def build(*, per_node: bool, callbacks: list[TrainerCallback], cls: type = Trainer) -> Trainer:
    t = cls(
        model=tiny_model(),
        args=tiny_args(OUT, max_steps=8, save_total_limit=2, save_on_each_node=per_node),
        train_dataset=RandomTokens(64),
        callbacks=callbacks,
    )
    return make_atomic(t, timeout_s=60)


def committed() -> dict[str, list[str]]:
    mgr = CheckpointManager(OUT, read_only=True, coordinator=SingleProcessCoordinator())
    return {
        str(i.step): sorted(
            f.path for f in read_manifest(mgr.storage, f"checkpoint-{i.step}").files
        )
        for i in mgr.checkpoints()
    }


def main() -> None:
    result: dict[str, object] = {"rank": RANK, "node": NODE}
    try:
        build(per_node=False, callbacks=[]).train()
        result["shared_flag_error"] = None
    except Exception as exc:
        result["shared_flag_error"] = f"{type(exc).__name__}: {exc}"

    try:
        build(per_node=True, callbacks=[], cls=HalfCopyTrainer).train()
        result["half_copy_error"] = None
    except Exception as exc:
        result["half_copy_error"] = f"{type(exc).__name__}: {exc}"
    result["after_half_copy"] = sorted(os.listdir(OUT))

    build(per_node=True, callbacks=[StopAt(6)]).train()
    result["after_first_run"] = committed()

    if NODE == 1:
        shutil.move(os.path.join(OUT, "checkpoint-6"), os.path.join(BASE, "node1-lost-6"))
    dist.barrier()

    snap = SnapshotAt(4)
    build(per_node=True, callbacks=[snap]).train(resume_from_checkpoint=True)
    result["resumed_first_step"] = snap.first_step_seen
    result["after_resume"] = committed()
    result["listing"] = sorted(os.listdir(OUT))
    dump(os.path.join(BASE, f"result-{RANK}.json"), result)


if __name__ == "__main__":
    main()
