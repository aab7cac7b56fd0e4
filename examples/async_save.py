"""Async saves: training goes on while the checkpoint is written, and restores go
straight into the model's own tensors.

Run:  python examples/async_save.py [CHECKPOINT_DIR]

One process, CPU only, a ~64 MiB model; takes a few seconds. It trains a few steps,
saving asynchronously every third step, and changes the weights in place right after
each ``save_async`` returns (as ``optimizer.step()`` does): the checkpoint still holds
the weights as they were at the call. It then restores the newest checkpoint into the
model's existing tensors, compares it with the copy taken at save time, and prints how
long training was blocked by each kind of save.
"""

from __future__ import annotations

import time

import torch

from atomic_checkpoint import CheckpointManager, KeepLast


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(16)))


def main(root: str) -> None:
    model = make_model()
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(f"model: {mb:.0f} MiB in {len(list(model.parameters()))} tensors; root: {root}")
    expected: dict[int, dict[str, torch.Tensor]] = {}
    blocked: list[float] = []
    with CheckpointManager(root, retention=KeepLast(2)) as mgr:
        # The snapshot buffers, allocated and faulted in now rather than by the first
        # save_async (which then blocks only for the copy, like every later one).
        mgr.prepare_async({"model": model.state_dict(), "step": 0})
        for step in range(1, 10):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99).add_(0.01)  # a "training step", in place
            if step % 3 == 0:
                expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
                t = time.perf_counter()
                handle = mgr.save_async(step, {"model": model.state_dict(), "step": step})
                blocked.append(time.perf_counter() - t)
                with torch.no_grad():  # changes after the call do not reach the checkpoint
                    for p in model.parameters():
                        p.add_(1.0)
                print(f"step {step}: save_async returned after {blocked[-1] * 1e3:.0f} ms")
        info = handle.result()  # the last save, durable and committed
        print(
            f"step {info.step}: committed {info.path} "
            f"({info.size_bytes / 2**20:.0f} MiB) in the background"
        )
        t = time.perf_counter()
        mgr.save(10, {"model": model.state_dict(), "step": 10})
        sync_s = time.perf_counter() - t
        print(f"step 10: a synchronous save blocked for {sync_s * 1e3:.0f} ms")
        print("checkpoints:", [c.step for c in mgr.checkpoints()])

        target = make_model()  # restore into its existing tensors: no new allocations
        dest = {"model": target.state_dict(), "step": 0}
        t = time.perf_counter()
        got = mgr.restore(9, into=dest)
        load_s = time.perf_counter() - t
        same = all(torch.equal(target.state_dict()[k], v) for k, v in expected[9].items())
        print(
            f"restored step {got['step']} into the model in {load_s * 1e3:.0f} ms (verified); "
            f"identical to the weights at save_async time: {same}"
        )
        if not same:
            raise SystemExit("restored weights differ from the snapshot")


if __name__ == "__main__":
    from _dir import example_dir  # beside this file

    main(example_dir(__doc__, "async-save-"))
