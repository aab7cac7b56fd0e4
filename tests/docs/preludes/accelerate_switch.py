# What README.md's Accelerate switch assumes: Accelerate's names imported. After it, a
# tiny model trains and saves twice through the stock accelerator.save_state(), which the
# switch made atomic.
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from atomic_checkpoint import CheckpointManager

# --- sample ---
_model = torch.nn.Linear(8, 1)
_model, _opt = accelerator.prepare(_model, torch.optim.SGD(_model.parameters(), lr=0.1))
for _ in range(2):
    accelerator.backward(_model(torch.randn(4, 8)).sum())
    _opt.step()
    accelerator.save_state()
assert sorted(os.listdir("runs/exp1/checkpoints")) == ["checkpoint_0", "checkpoint_1"]
with CheckpointManager("runs/exp1", read_only=True) as _m:
    for _c in _m.checkpoints():
        _m.verify(_c.step)
    assert len(_m.checkpoints()) == 2, _m.checkpoints()
