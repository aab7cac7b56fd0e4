"""A tiny model and a deterministic loop for Accelerate tests (CPU, seconds)."""

from __future__ import annotations

import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed


def build(project_dir: str, *, total_limit: int | None, seed: int = 0):
    """A prepared (model, optimizer, scheduler) with dropout, so RNG state matters."""
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=total_limit
        ),
    )
    set_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def train_step(accelerator, model, optimizer, scheduler, step: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + accelerator.process_index)
    x = torch.randn(4, 8, generator=g)
    loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return float(loss.item())


def kill_during_save(accelerator, save_iteration: int) -> None:
    """SIGKILL this process in the middle of the save numbered ``save_iteration``: when
    ``torch.save`` is about to write ``optimizer.bin`` (the model file is on disk,
    nothing else), as a crash between two files of one save would."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        name = os.path.basename(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else ""
        if name == "optimizer.bin" and accelerator.save_iteration == save_iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
