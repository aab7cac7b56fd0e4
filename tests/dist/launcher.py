"""Launch real multi-process jobs (gloo process groups) for tests.

Like torchrun, the parent hosts the TCPStore (torchrun's agent does the same), and each
rank is a separate OS process with its own ``torch.distributed`` process group, so a
SIGKILLed rank is a real dead process. Ranks are forked from a forkserver that has
imported torch once: a trial costs a fraction of a second instead of the ~10 s of a
torchrun launch on two cores (a few tests still go through real torchrun).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "torch.distributed.checkpoint",
                "torch.distributed.tensor",
                "atomic_checkpoint",
                "atomic_checkpoint.serialization",
                "tests.dist.workers",
            ]
        )
    return _CTX


@dataclass
class RankResult:
    rank: int
    exitcode: int | None  # None: killed by the launcher at the deadline
    value: Any = None
    error: BaseException | None = None
    error_text: str = ""

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None

    @property
    def killed(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out_path: str,
    env: dict[str, str],
    pg_timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s)
    )
    result: dict[str, Any]
    try:
        result = {"value": fn(rank, world, *args)}
    except BaseException as exc:  # shipped to the parent for assertions
        result = {"error": exc, "text": traceback.format_exc()}
    try:
        data = pickle.dumps(result)
    except Exception:
        data = pickle.dumps({"error": RuntimeError(repr(result)), "text": repr(result)})
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    # Skip process-group teardown: with dead peers it can block.
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    tmp_dir: str,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 10.0,
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return per-rank results.

    Every process is killed at the deadline; its result then has ``exitcode=None``.
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore(
        "127.0.0.1", 0, world + 1, True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    outs = [os.path.join(tmp_dir, f"rank{r}.{time.monotonic_ns()}.pkl") for r in range(world)]
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world, store.port, outs[r], dict(env or {}), pg_timeout_s, args),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
            results.append(RankResult(r, None, error_text="killed at the launcher deadline"))
            continue
        res = RankResult(r, p.exitcode)
        if os.path.exists(outs[r]):
            with open(outs[r], "rb") as f:
                data = pickle.loads(f.read())
            res.value = data.get("value")
            res.error = data.get("error")
            res.error_text = data.get("text", "")
            os.unlink(outs[r])
        results.append(res)
    del store
    return results
