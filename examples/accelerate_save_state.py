"""Atomic Accelerate ``save_state``/``load_state``: rotation that never deletes before
the new checkpoint is committed, and a restart that resumes from the newest complete
checkpoint.

Run:  python examples/accelerate_save_state.py [PROJECT_DIR]

CPU only, a few seconds. Under ``accelerate launch`` or ``torchrun`` nothing changes:
every process calls the same code.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed

from atomic_checkpoint.integrations.accelerate import close, load_state, save_state


def setup(project_dir: str):
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return (accelerator, *accelerator.prepare(model, optimizer))


def train(accelerator, model, optimizer, steps: range) -> float:
    loss = torch.tensor(0.0)
    for step in steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            save_state(accelerator)  # instead of accelerator.save_state()
    return float(loss.detach())


def listing(project_dir: str) -> list[str]:
    root = os.path.join(project_dir, "checkpoints")
    names = [n for n in os.listdir(root) if n.startswith("checkpoint_")]
    return sorted(names, key=lambda n: int(n.split("_")[1]))  # by step, never by string


def main() -> None:
    from _dir import example_dir  # beside this file

    project_dir = example_dir(__doc__, "accel-atomic-")

    accelerator, model, optimizer = setup(project_dir)
    loss = train(accelerator, model, optimizer, range(1, 41))
    close(accelerator)  # wait for the last rotation
    print(f"trained 40 steps (loss {loss:.3f}), save_state every 10 with total_limit=2")
    print(f"  committed: {listing(project_dir)} (numbered by save, as automatic naming does;")
    print("  each old one was deleted only after the next one was committed)")

    # A restart: fresh process state, same project directory.
    accelerator, model, optimizer = setup(project_dir)
    info = load_state(accelerator, missing_ok=True)  # instead of accelerator.load_state()
    if info is None:
        raise SystemExit("nothing to resume from")
    name = os.path.basename(info.path)
    print(f"load_state() restored {name} ({info.size_bytes} bytes, checksums verified)")
    print(f"  the next save_state() is checkpoint_{accelerator.save_iteration}")
    loss = train(accelerator, model, optimizer, range(41, 61))
    close(accelerator)
    print(f"trained 20 more steps (loss {loss:.3f}): {listing(project_dir)}")


if __name__ == "__main__":
    main()
