# What README.md's Accelerate functions assume: an Accelerator with automatic checkpoint
# naming, and a tiny model and optimizer it prepared. After the sample, a second run's
# load_state resumes from the checkpoint it saved.
# ruff: noqa: F821  (the sample uses these names, or defines them)
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

_config = ProjectConfiguration(project_dir="runs/exp1", automatic_checkpoint_naming=True)
accelerator = Accelerator(project_config=_config)
_model = torch.nn.Linear(8, 1)
model, optimizer = accelerator.prepare(_model, torch.optim.SGD(_model.parameters(), lr=0.1))
# --- sample ---
assert os.listdir("runs/exp1/checkpoints") == ["checkpoint_0"]
_saved = model.weight.detach().clone()
with torch.no_grad():
    model.weight.zero_()
load_state(accelerator)
assert torch.equal(model.weight, _saved)
