"""Run under torchrun: per-rank, replicated and files-mode saves, restored bit-exactly.

Prints one JSON line per rank: {"rank": r, ...results}.
"""

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from tests.dist import workers

root = sys.argv[1]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
out = workers.w_roundtrip(rank, world, os.path.join(root, "state"), [3, 6])
files = workers.w_files_mode(rank, world, os.path.join(root, "files"), 9)
line = json.dumps(
    {
        "rank": rank,
        "world": world,
        "restore_ok": out["restore_ok"],
        "replicated_ok": out["replicated_ok"],
        "latest": out["latest"],
        "files_step": files["step"],
        "infos": out["infos"],
    }
)
os.write(1, (line + "\n").encode())
dist.barrier()
dist.destroy_process_group()
