"""Sharded DCP checkpoints inside atomic commits: save on 4 ranks, load on 2.

Run:  python examples/dcp_sharded.py [CHECKPOINT_DIR]

It starts its own CPU processes (gloo). Under torchrun, call ``save_dcp`` /
``load_dcp`` the same way from every rank. Takes a few seconds on a laptop.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from atomic_checkpoint import CheckpointManager, KeepLast
from atomic_checkpoint.integrations.dcp import load_dcp, save_dcp


def model_state(step: int, world: int, *, empty: bool = False) -> dict:
    """A tiny "model + optimizer" whose tensors are DTensors row-sharded over the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(step)
    weight = torch.zeros(8, 4) if empty else torch.randn(8, 4, generator=g)
    momentum = torch.zeros(8, 4) if empty else torch.randn(8, 4, generator=g)
    return {
        "model": {"weight": distribute_tensor(weight, mesh, [Shard(0)])},
        "optim": {"momentum": distribute_tensor(momentum, mesh, [Shard(0)])},
        "step": 0 if empty else step,
    }


def save_job(rank: int, world: int, root: str) -> None:
    # Two lines: a manager, then save_dcp instead of dcp.save.
    mgr = CheckpointManager(root, retention=KeepLast(2))
    for step in (100, 200, 300):
        save_dcp(mgr, step, model_state(step, world))
    kept = [c.step for c in mgr.checkpoints()]
    if rank == 0:
        print(f"{world} ranks saved steps [100, 200, 300]; kept by KeepLast(2): {kept}")
        print(
            f"  {root}/checkpoint-300: {sorted(os.listdir(os.path.join(root, 'checkpoint-300')))}"
        )
    mgr.close()


def load_job(rank: int, world: int, root: str) -> None:
    mgr = CheckpointManager(root)
    state = model_state(0, world, empty=True)  # the layout of *this* job: 2 shards
    info = load_dcp(mgr, state)  # the newest checkpoint that verifies, resharded
    expected = model_state(info.step, world)
    same = torch.equal(
        state["model"]["weight"].full_tensor(), expected["model"]["weight"].full_tensor()
    )
    same &= torch.equal(
        state["optim"]["momentum"].full_tensor(), expected["optim"]["momentum"].full_tensor()
    )
    rows = tuple(state["model"]["weight"].to_local().shape)
    if rank == 0:
        print(f"{world} ranks loaded step {info.step} (saved by 4 ranks): each rank holds")
        print(f"  {rows} of the (8, 4) weight; identical to what was saved: {same}")
    mgr.close()


def _rank_main(fn, rank: int, world: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        fn(rank, world, root)
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, root: str) -> None:
    """Run ``fn(rank, world, root)`` in ``world`` processes, like torchrun would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, root)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        raise SystemExit(f"ranks {failed} failed")


def main() -> None:
    from _dir import example_dir  # beside this file

    root = example_dir(__doc__, "dcp-sharded-")
    launch(save_job, 4, root)
    launch(load_job, 2, root)


if __name__ == "__main__":
    main()
