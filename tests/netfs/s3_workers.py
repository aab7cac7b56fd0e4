"""Child processes for the object-store tests: real writers and readers of one root.

Run as ``python s3_workers.py ROLE JSON_ARGS``; each prints one JSON object per line
(one ``os.write`` each, so lines never interleave) and exits 0 when its work is done.

Roles:
    saver   save ``steps`` (``elems`` float32 each, or ``elems_by_step[step]``) through a
            CheckpointManager; ``ATOMIC_CHECKPOINT_FAULTS`` in the environment kills it
            where a test wants.
    poller  a read-only manager polling ``latest()`` / ``restore()`` and scanning the
            root until ``stop_file`` exists; reports reads, vanished and torn reads.
    racer   one of two writers racing for the same steps through the commit protocol
            itself (no run lock), aligned by barrier files so both have passed the
            "not yet committed" check and written all their data before either
            creates its manifest.
    ddp     one rank of a real gloo job saving and restoring per-rank state.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from atomic_checkpoint import CheckpointManager, KeepLast, catalog, commit
from atomic_checkpoint.commit import RankReport, SaveContext
from atomic_checkpoint.coordination import SingleProcessCoordinator
from atomic_checkpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from atomic_checkpoint.layout import rank_state_file
from atomic_checkpoint.manifest import FileEntry, Hasher
from atomic_checkpoint.serialization import plan_state
from atomic_checkpoint.storage import FsspecStorage
from atomic_checkpoint.strategies import MarkerStrategy


def emit(**fields: Any) -> None:
    os.write(1, (json.dumps(fields, sort_keys=True) + "\n").encode())


def state_for(step: int, elems: int, tag: int = 0) -> dict[str, Any]:
    """A state whose every element says which step (and writer) produced it."""
    return {
        "step": step,
        "tag": tag,
        "w": np.full(elems, step * 1000 + tag, dtype=np.float32),
    }


def state_is_consistent(state: dict[str, Any], step: int) -> bool:
    w = state["w"]
    return int(state["step"]) == step and bool((w == w[0]).all()) and int(w[0]) // 1000 == step


def saver(args: dict[str, Any]) -> None:
    mgr = CheckpointManager(
        args["url"],
        storage_options=args.get("storage_options"),
        retention=KeepLast(args["keep"]) if args.get("keep") else None,
    )
    emit(event="open", strategy=mgr.commit_strategy)
    big = {int(k): v for k, v in args.get("elems_by_step", {}).items()}
    for step in args["steps"]:
        t = time.perf_counter()
        info = mgr.save(step, state_for(step, big.get(step, args["elems"])))
        emit(event="saved", step=info.step, seconds=time.perf_counter() - t)
    mgr.close()
    emit(event="done")


def poller(args: dict[str, Any]) -> None:
    mgr = CheckpointManager(
        args["url"], storage_options=args.get("storage_options"), read_only=True
    )
    stop = Path(args["stop_file"])
    deadline = time.monotonic() + args["deadline_s"]
    counts = {"polls": 0, "reads_ok": 0, "vanished": 0, "torn": 0, "corrupt_listed": 0}
    steps_seen: set[int] = set()
    last = -1
    regressions = 0
    problems: list[str] = []
    while not stop.exists() and time.monotonic() < deadline:
        counts["polls"] += 1
        # Nothing a reader can discover may be torn: every entry listed as a
        # checkpoint must validate (pending ones are never offered as checkpoints).
        for entry in catalog.scan(mgr.storage):
            if entry.status == "corrupt":
                counts["corrupt_listed"] += 1
                problems.append(f"listed corrupt: {entry.name}: {entry.problem}")
        try:
            info = mgr.latest()
        except CheckpointError as exc:
            problems.append(f"latest(): {type(exc).__name__}: {exc}")
            continue
        if info is None:
            continue
        if info.step < last:
            regressions += 1
        last = max(last, info.step)
        try:
            state = mgr.restore(step=info.step)
        except CheckpointNotFoundError:
            counts["vanished"] += 1  # rotated away between latest() and the read
            continue
        except CorruptCheckpointError as exc:
            counts["torn"] += 1
            problems.append(f"restore({info.step}): {exc}")
            continue
        if state_is_consistent(state, info.step):
            counts["reads_ok"] += 1
            steps_seen.add(info.step)
        else:
            counts["torn"] += 1
            problems.append(f"restore({info.step}) returned step {state['step']}")
    emit(
        event="report",
        **counts,
        distinct_steps=len(steps_seen),
        regressions=regressions,
        problems=problems[:20],
        timed_out=not stop.exists(),
    )


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier file {path} did not appear within {timeout_s} s")
        time.sleep(0.005)


def racer(args: dict[str, Any]) -> None:
    storage = FsspecStorage(args["url"], args.get("storage_options"))
    me = int(args["writer"])
    barrier = Path(args["barrier_dir"])
    ctx = SaveContext(
        storage=storage,
        coord=SingleProcessCoordinator(),
        run_id="race",
        timeout_s=60.0,
        strategy=MarkerStrategy(),
    )
    for step in args["steps"]:
        plan = plan_state(state_for(step, args["elems"], tag=me))

        def write(pending: str, step: int = step, plan: Any = plan) -> RankReport:
            rel = rank_state_file(0)
            w = storage.open_write(f"{pending}/{rel}", size_hint=plan.total_size_bytes)
            h = Hasher()
            size = 0
            for chunk in plan.iter_chunks():
                h.update(chunk)
                w.write(chunk)
                size += memoryview(chunk).nbytes
            w.close()
            # Both writers have checked "not committed" and written everything: now
            # let both create their manifest at once.
            (barrier / f"ready-{step}-{me}").touch()
            _wait_for(barrier / f"go-{step}", 60.0)
            return RankReport((FileEntry(rel, size, h.hexdigest(), 0),), 0.0, 0.0)

        try:
            pending = commit.begin(ctx, step)
            manifest = commit.finish(
                ctx,
                pending,
                commit.attempt("write", functools.partial(write, pending.location)),
                state_kind="per_rank",
                metrics={},
                metadata={"writer": me},
            ).manifest
        except CheckpointExistsError as exc:
            emit(event="lost", step=step, writer=me, error=type(exc).__name__, message=str(exc))
        except CheckpointError as exc:
            emit(event="error", step=step, writer=me, error=type(exc).__name__, message=str(exc))
        else:
            emit(event="won", step=step, writer=me, files=[f.path for f in manifest.files])
    emit(event="done", writer=me)


def ddp(args: dict[str, Any]) -> None:
    """One rank of a gloo job (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment):
    every rank saves its own state to the object store, then restores it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    mgr = CheckpointManager(
        args["url"],
        storage_options=args.get("storage_options"),
        retention=KeepLast(2),
        timeout_s=60.0,
    )
    for step in args["steps"]:
        mgr.save(step, {"rank": rank, "w": torch.full((args["elems"],), step * 10.0 + rank)})
    latest = mgr.latest()
    state = mgr.restore()
    ok = state["rank"] == rank and bool((state["w"] == latest.step * 10.0 + rank).all())
    emit(
        event="report",
        rank=rank,
        strategy=mgr.commit_strategy,
        checkpoints=[c.step for c in mgr.checkpoints()],
        latest=latest.step,
        restored_own_state=ok,
    )
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    role, raw = sys.argv[1], sys.argv[2]
    {"saver": saver, "poller": poller, "racer": racer, "ddp": ddp}[role](json.loads(raw))
