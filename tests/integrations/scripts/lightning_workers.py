"""Rank functions for ``tests/dist/launcher.run_ranks`` in the Lightning tests.

They use the plugin's implementation without its Lightning base class, so a forked
rank imports torch and atomic-checkpoint only (importing Lightning costs seconds per
process on two cores); the Lightning plugins add nothing but that base class.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from atomic_checkpoint.integrations.lightning import _AtomicFileIO

KILL_PHASES = ("mid_write", "after_manifest", "after_rename")


def checkpoint_dict(step: int, n: int = 2000) -> dict[str, Any]:
    """A Lightning-shaped checkpoint dict (what ``dump_checkpoint`` returns)."""
    g = torch.Generator().manual_seed(step)
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {"w": torch.randn(n, generator=g), "b": torch.zeros(3)},
        "optimizer_states": [
            {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": []}
        ],
        "lr_schedulers": [{"last_epoch": step, "_last_lr": [0.1]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
    }


def w_overwrite_killed(rank: int, world: int, root: str) -> None:
    """Rank r overwrites its own last.ckpt; a fault point kills it at KILL_PHASES[r]."""
    path = os.path.join(root, KILL_PHASES[rank], "last.ckpt")
    io = _AtomicFileIO()
    io.save_checkpoint(checkpoint_dict(4), path)
    io.save_checkpoint(checkpoint_dict(6), path)
