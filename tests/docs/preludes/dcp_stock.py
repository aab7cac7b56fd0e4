# A stock DCP run killed mid-save, as README.md's adoption sample assumes: dcp.save wrote
# ckpts/checkpoint-100 and ckpts/step-100 whole; the kill left ckpts/checkpoint-200 torn
# (its .metadata, which DCP writes last, missing). One gloo rank.
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.integrations import dcp as adcp
from atomic_checkpoint.integrations.dcp import load_dcp

with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0))
    _port = _s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port}", rank=0, world_size=1)
_saved = {"model": {"w": torch.arange(12.0).reshape(3, 4)}}
for _id in ("ckpts/checkpoint-100", "ckpts/checkpoint-200", "ckpts/step-100"):
    dcp.save(_saved, checkpoint_id=_id)
os.remove("ckpts/checkpoint-200/.metadata")
state_dict = {"model": {"w": torch.zeros(3, 4)}}
# --- sample ---
# Loaded step 100, the newest complete one, into the state dict; 200 was refused.
assert info.step == 100, info
assert torch.equal(state_dict["model"]["w"], _saved["model"]["w"])
assert [c.step for c in mgr.checkpoints()] == [100], mgr.checkpoints()
mgr.close()
dist.destroy_process_group()
