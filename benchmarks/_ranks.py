"""Commit overhead across N real processes (a gloo process group, like torchrun).

The ranks are launched by the repository's one launcher, ``tests.dist.launcher``: the
parent hosts the TCPStore, as torchrun's agent does; each rank is a process forked from a
forkserver that imported torch once, so a launch costs well under a second.
Every rank saves a tiny state several times; the figures are the slowest rank's per save
(the next collective waits for it), the phase timings rank 0's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the launcher is the tests' (tests.dist.launcher)
    sys.path.insert(0, REPO)


def _tiny_state(rank: int, i: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((256,), float(rank * 1000 + i)), "step": i, "rank": rank}


def _rank_main(rank: int, world: int, root: str, saves: int) -> dict[str, Any]:
    import torch.distributed as dist

    from atomic_checkpoint import CheckpointManager
    from atomic_checkpoint.layout import checkpoint_name

    mgr = CheckpointManager(root, timeout_s=60)
    totals, overheads, fsyncs, cpus = [], [], [], []
    phases: dict[str, list[float]] = {}
    for i in range(saves + 1):  # the first save warms caches and is not counted
        # Every save starts together, as after a training step's gradient
        # all-reduce: without this, back-to-back saves bill each rank the previous
        # save's stragglers.
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        info = mgr.save(i, _tiny_state(rank, i))
        total = time.perf_counter() - t
        cpu = time.process_time() - c
        timings = info.timings_s
        data = float(timings.get("write", 0.0)) + float(timings.get("fsync", 0.0))
        if i:
            totals.append(total)
            overheads.append(total - data)
            fsyncs.append(float(timings.get("fsync", 0.0)))
            cpus.append(cpu)
            for key, value in timings.items():
                phases.setdefault(key, []).append(float(value))
    # Check every save landed, complete: restore our part of each.
    ok = True
    for i in range(saves + 1):
        state = mgr.restore(i)
        ok = ok and state["step"] == i and float(state["w"][0]) == float(rank * 1000 + i)
        ok = ok and os.path.isdir(os.path.join(root, checkpoint_name(i)))
    mgr.close()
    return {
        "totals_s": totals,
        "data_s": [t - o for t, o in zip(totals, overheads, strict=True)],
        "total_s": statistics.median(totals),
        "overhead_s": statistics.median(overheads),
        "data_fsync_s": statistics.median(fsyncs),
        "cpu_s": statistics.median(cpus),
        "phases_s": {k: statistics.median(v) for k, v in phases.items()},
        "verified": ok,
    }


def commit_overhead(world: int, root: str, saves: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """Launch ``world`` ranks that each save a tiny state ``saves`` times into ``root``;
    return the medians over saves of the slowest rank's time in ``save()`` (total) and
    of that less the write and fsync of the data (overhead); rank 0's phase timings."""
    from tests.dist.launcher import run_ranks

    tmp_dir = os.path.dirname(os.path.abspath(root))
    ranks = run_ranks(
        _rank_main, world, root, saves, tmp_dir=tmp_dir, timeout_s=timeout_s, pg_timeout_s=60
    )
    for r in ranks:
        where = f"commit benchmark: rank {r.rank} of {world}"
        if r.exitcode is None:
            raise RuntimeError(f"{where} still running at deadline")
        if r.error is not None:
            raise RuntimeError(f"{where} failed: {type(r.error).__name__}: {r.error}")
        if not r.ok:
            raise RuntimeError(f"{where} exited {r.exitcode}")
    results = [r.value for r in ranks]
    out = dict(results[0])
    out["verified"] = all(res["verified"] for res in results)
    # The training waits for the slowest rank (its next collective does): per save, the
    # longest time any rank was inside save(), less the data's write and fsync (the
    # slowest rank's, the same figure on every rank).
    per_save = [max(ts) for ts in zip(*(res["totals_s"] for res in results), strict=True)]
    data = results[0]["data_s"]
    slowest = [t - d for t, d in zip(per_save, data, strict=True)]
    out["rank0_overhead_s"] = out["overhead_s"]
    # CPU time of one save, all threads, summed over the ranks: on a machine with fewer
    # cores than ranks, the slowest rank cannot finish before that divided by the cores.
    out["cpu_all_ranks_s"] = sum(res["cpu_s"] for res in results)
    out["cores"] = os.cpu_count() or 1
    out["overhead_s"] = statistics.median(slowest)
    out["total_s"] = statistics.median(per_save)
    for key in ("totals_s", "data_s"):
        out.pop(key, None)
    return out


def small_fsync_s(directory: str, n: int = 5) -> float:
    """Median time to write 4 KiB into a new file and fsync it: the unit of the
    commit-overhead target."""
    times = []
    data = os.urandom(4096)
    for i in range(n):
        path = os.path.join(directory, f"fsync-probe-{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            t = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - t)
        finally:
            os.close(fd)
            os.unlink(path)
    return statistics.median(times)
