# What the DCP samples of README.md assume: a process group (gloo, one rank, as on a CPU
# node), a manager, the step, and a state dict of a tiny model and its optimizer.
# ruff: noqa: F401  (the sample uses these names, or defines them)
import os
import socket

import torch
import torch.distributed as dist

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.integrations import dcp as adcp
from atomic_checkpoint.integrations.dcp import load_dcp, save_dcp

with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    _port = _s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
state_dict = {"model": model.state_dict(), "optim": optimizer.state_dict()}
mgr = CheckpointManager("ckpt")
step = 100
# --- sample ---
# The sample's save is committed; a path-style save is a checkpoint of its own.
mgr.wait()
assert mgr.latest().step == step, mgr.latest()
if os.path.isdir("ckpts/step-100"):
    _back = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    adcp.load(_back, checkpoint_id="ckpts/step-100")
    assert torch.equal(_back["model"]["weight"], model.weight.detach())
mgr.close()
dist.destroy_process_group()
