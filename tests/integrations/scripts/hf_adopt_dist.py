"""torchrun job (2 processes, gloo): a stock Trainer run, then the same job continued
with AtomicCheckpointCallback(adopt_existing=True).

Phase A: the stock Trainer (no atomic-checkpoint) trains 4 steps, saving checkpoint-2
and checkpoint-4 with both ranks' RNG files; checkpoint-4 is then torn the way a crash
of rank 0 mid-save leaves it (trainer_state.json, written last, missing). Phase B: the
integration adopts on the writing process while the other waits, and both resume from
checkpoint-2 and train to 6. Results go to OUT/result-<rank>.json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist
from compare import dump
from tiny_hf import RandomTokens, SnapshotAt, tiny_args, tiny_model
from transformers import Trainer

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from atomic_checkpoint.integrations.hf import AtomicCheckpointCallback

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])


def main() -> None:
    run = os.path.join(OUT, "run")
    stock = Trainer(
        model=tiny_model(), args=tiny_args(run, max_steps=4), train_dataset=RandomTokens(32)
    )
    stock.train()
    if RANK == 0:
        os.unlink(os.path.join(run, "checkpoint-4", "trainer_state.json"))
    dist.barrier()

    snap = SnapshotAt(2)
    callback = AtomicCheckpointCallback(adopt_existing=True, timeout_s=60)
    continued = Trainer(
        model=tiny_model(),
        args=tiny_args(run, max_steps=6),
        train_dataset=RandomTokens(32),
        callbacks=[callback, snap],
    )
    continued.train(resume_from_checkpoint=True)
    doc: dict[str, object] = {
        "first_step": snap.first_step_seen,
        "refused": {str(k): v for k, v in continued._atomic_checkpoint.refused.items()},
        "global_step": continued.state.global_step,
    }
    dist.barrier()
    if RANK == 0:
        with CheckpointManager(run, read_only=True, coordinator=SingleProcessCoordinator()) as mgr:
            doc["committed"] = {c.step: bool(c.adopted) for c in mgr.checkpoints()}
            for c in mgr.checkpoints():
                mgr.verify(c.step)
    dump(os.path.join(OUT, f"result-{RANK}.json"), doc)


if __name__ == "__main__":
    main()
