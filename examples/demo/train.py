"""A small data-parallel training job that checkpoints with atomic-checkpoint.

Run under torchrun (4 processes, CPU/gloo)::

    torchrun --standalone --nproc_per_node=4 examples/demo/train.py --root /tmp/ckpt

It resumes from the newest complete checkpoint if there is one. The two lines that
matter are marked ``# <-- atomic-checkpoint``.
"""

from __future__ import annotations

import argparse
import os
import random
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from atomic_checkpoint import CheckpointManager, KeepBest, KeepLast


def say(msg: str) -> None:
    # One os.write per line: torchrun's shared pipe interleaves partial writes.
    if dist.get_rank() == 0:
        os.write(1, f"[train] {msg}\n".encode())


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(64, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--out", help="write the final model weights here (rank 0)")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    random.seed(rank)
    # Plain data parallelism with one all-reduce per parameter: unlike DDP's gradient
    # buckets (rebuilt after the first iteration of every process), the reduction order
    # is the same in a resumed run, so the demo can compare weights bit for bit.
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)

    mgr = CheckpointManager(  # <-- atomic-checkpoint
        args.root, retention=KeepLast(3) | KeepBest(1, metric="loss", mode="min"), timeout_s=60
    )
    start = 0
    latest = mgr.latest()  # every rank gets the same answer
    if latest is not None:
        state = mgr.restore(latest.step)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        start = latest.step
        say(f"resumed from checkpoint step {latest.step} (loss {latest.metrics['loss']:.4f})")
    else:
        say("no checkpoint yet: starting from scratch")

    loss_fn = nn.BCEWithLogitsLoss()
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, world)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        sched.step()
        if step % args.save_every == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            state = {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "step": step,
            }
            info = mgr.save(step, state, metrics={"loss": float(mean)})  # <-- atomic-checkpoint
            say(f"step {step}: loss {float(mean):.4f}, committed {os.path.basename(info.path)} "
                f"in {info.timings_s['total'] * 1000:.0f} ms")
    mgr.close()
    if args.out and rank == 0:
        torch.save(model.state_dict(), args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
