"""One node's side of a two-node torchrun job that checkpoints onto an sshfs mount.

Started by ``tests/netfs/test_two_node_netns.py`` once per network namespace::

    ip netns exec <ns> torchrun --nnodes=2 --node_rank=<n> --nproc_per_node=2 \\
        --master_addr=<node 0's address> --master_port=<port> two_node_job.py \\
        --root <this node's mount>/run --status <dir> --steps 1-5 --keep 3 [--resume]

Every rank saves ``--steps`` (states from ``tests.dist.workers.make_state``); with
``--resume`` it first restores the newest checkpoint and checks it bit for bit, its own
state and that of a rank on the other node. With ``--announce STEP`` each rank writes
``<status>/saving-<rank>`` just before saving STEP, with a larger state, so the test
can cut the link while that save is in flight. Each rank ends by writing
``<status>/result-<rank>.json`` (what it saw, or the error it raised and when) and
exits with status 0 without tearing down the process group.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def _steps(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, default=str))
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--status", required=True, type=Path)
    parser.add_argument("--steps", required=True, type=_steps)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--announce", type=int, default=None)
    parser.add_argument("--announce-elems", type=int, default=1 << 20)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()

    # A rank that overstays its bound can be asked where it is: kill -USR1 <pid>.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    result: dict[str, Any] = {"rank": rank, "ok": False, "started_unix": time.time()}
    try:
        import torch.distributed as dist
        from tests.dist.workers import make_state, states_equal

        from atomic_checkpoint import CheckpointManager, KeepLast

        small = {"n_big": 1, "big_elems": 1 << 10}
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        mgr = CheckpointManager(
            args.root,
            retention=KeepLast(args.keep),
            timeout_s=args.timeout,
            visibility_timeout_s=args.timeout,
        )
        d = mgr.domain
        result["domain"] = [d.index, d.leader, list(d.members), list(d.leaders)]
        result["storage"] = [mgr.storage.capabilities.name, mgr.storage.capabilities.coherent]
        if args.resume:
            latest = mgr.latest()
            if latest is None:
                raise RuntimeError("--resume: no checkpoint to resume from")
            peer = (rank + world // 2) % world
            result["resumed_from"] = latest.step
            result["restore_ok"] = states_equal(
                mgr.restore(), make_state(latest.step, rank, **small)
            )
            result["peer_restore_ok"] = states_equal(
                mgr.restore(rank=peer), make_state(latest.step, peer, **small)
            )
        saved: list[int] = []
        result["saved"] = saved  # what completed, also when a later save fails
        for step in args.steps:
            shape = small
            if step == args.announce:
                shape = {"n_big": 1, "big_elems": args.announce_elems}
                (args.status / f"saving-{rank}").write_text(str(time.time()))
            mgr.save(step, make_state(step, rank, **shape))
            saved.append(step)
        result["retained"] = [c.step for c in mgr.checkpoints()]
        mgr.close()
        result["ok"] = True
    except BaseException as exc:  # reported to the test, which judges it
        from atomic_checkpoint import CheckpointError

        result.update(
            error_type=type(exc).__name__,
            is_checkpoint_error=isinstance(exc, CheckpointError),
            message=str(exc)[:3000],
        )
    result["ended_unix"] = time.time()
    _write_json(args.status / f"result-{rank}.json", result)
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit 0 whatever happened (the result file says it): torchrun terminates a node's
    # other workers as soon as one exits non-zero, before they could report their own
    # error. No process-group teardown: with a dead peer it can block.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
