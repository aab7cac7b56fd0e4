"""Rank functions of the multi-rank tiered tests (run by ``tests/dist/launcher.py`` in
real gloo jobs). Every rank is its own "node": its own host name and its own local
directory as tier 0, as separate machines with local NVMe disks would have."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from tests.dist.workers import make_state, states_equal
from tests.helpers import ListHandler

from atomic_checkpoint import (
    CheckpointError,
    KeepLast,
    StorageFullError,
    Tier,
    TieredCheckpointManager,
)
from atomic_checkpoint.domains import HOST_ENV

ELEMS = 4096


def _node_manager(
    rank: int,
    base: str,
    slow: str,
    opts: dict[str, Any] | None,
    *,
    keep: int,
    timeout_s: float,
    retry_max_s: float,
    peers: int = 0,
    fast_keep: int = 1,
) -> tuple[str, TieredCheckpointManager]:
    """This rank as node ``node<rank>``: its tier 0 (``base/node<rank>``, the newest
    ``fast_keep`` steps) and its manager over that and the persistent tier ``slow`` (the
    newest ``keep`` steps). Returns tier 0's directory and the manager."""
    os.environ[HOST_ENV] = f"node{rank}"
    fast = os.path.join(base, f"node{rank}")
    mgr = TieredCheckpointManager(
        [
            Tier(fast, retention=KeepLast(fast_keep)),
            Tier(slow, retention=KeepLast(keep), storage_options=opts),
        ],
        timeout_s=timeout_s,
        retry_max_s=retry_max_s,
        fast_domains="per-host",
        peers=peers,
    )
    return fast, mgr


def w_tiered(
    rank: int,
    world: int,
    base: str,
    slow: str,
    opts: dict[str, Any] | None,
    steps: list[int],
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Restore the newest step every rank can load (if any), save ``steps``, wait until
    the persistent tier has them, and report what each rank saw (and was warned of)."""
    warned: list[str] = []
    logging.getLogger("atomic_checkpoint").addHandler(ListHandler(warned))
    _, mgr = _node_manager(rank, base, slow, opts, keep=3, timeout_s=timeout_s, retry_max_s=0.5)
    latest = mgr.latest()
    out: dict[str, Any] = {
        "latest": None if latest is None else (latest.step, latest.tiers),
        "run_id": mgr.run_id,
        "warned": warned,
    }
    if latest is not None:
        state = mgr.restore()
        out["restored_ok"] = states_equal(state, make_state(latest.step, rank, big_elems=ELEMS))
        out["restored"] = (mgr.last_restored.step, mgr.last_restored.tiers)
    for s in steps:
        mgr.save(s, make_state(s, rank, big_elems=ELEMS))
    out["replicated"] = mgr.wait_replicated(timeout_s=60)
    listed = mgr.checkpoints()
    out["listed"] = [(c.step, c.tiers) for c in listed]
    out["node_copies"] = {c.step: c.node_copies for c in listed}
    out["left"] = mgr.close()
    return out


def bench_state(size: int, rank: int) -> dict[str, Any]:
    """``size`` bytes of float32 in 8 arrays, different for each rank."""
    import numpy as np

    n = max(1, size // 4 // 8)
    base = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    return {"rank": rank, "layers": {f"w{i}": base + np.float32(i) for i in range(8)}}


def w_bench(
    rank: int,
    world: int,
    base: str,
    slow: str,
    opts: dict[str, Any] | None,
    size: int,
    mode: str,
    peers: int = 0,
) -> dict[str, Any]:
    """``benchmarks/tiered.py --ranks N``: one save (``mode="save"``: the time it blocks,
    then the time until the persistent tier (and, with ``peers``, the peers) has it) or
    one timed ``restore()``. ``direct-save`` and ``direct-restore``: the same job with
    a plain ``CheckpointManager`` on the persistent tier (``slow``) alone."""
    import time

    from atomic_checkpoint import CheckpointManager

    os.environ[HOST_ENV] = f"node{rank}"
    state = bench_state(size, rank)

    def exact(got: dict[str, Any]) -> bool:
        return all(got["layers"][k].tobytes() == v.tobytes() for k, v in state["layers"].items())

    if mode.startswith("direct-"):
        plain = CheckpointManager(slow, storage_options=opts, timeout_s=600)
        t = time.perf_counter()
        if mode == "direct-save":
            plain.save(1, state)
            out = {"blocked_s": time.perf_counter() - t, "ok": True}
        else:
            got = plain.restore()
            out = {"restore_s": time.perf_counter() - t, "ok": exact(got)}
        plain.close()
        return out
    mgr = TieredCheckpointManager(
        [Tier(os.path.join(base, f"node{rank}")), Tier(slow, storage_options=opts)],
        timeout_s=600,
        fast_domains="per-host",
        peers=peers,
    )
    if mode == "save":
        t = time.perf_counter()
        mgr.save(1, state)
        blocked = time.perf_counter() - t
        ok = mgr.wait_peers(timeout_s=600) if peers else True
        peered = time.perf_counter() - t
        ok &= mgr.wait_replicated(timeout_s=600)
        out = {
            "blocked_s": blocked,
            "peered_s": peered,
            "replicated_s": time.perf_counter() - t,
            "ok": ok,
        }
    else:
        t = time.perf_counter()
        got = mgr.restore()
        dt = time.perf_counter() - t
        got_from = mgr.last_restored
        out = {
            "restore_s": dt,
            "tiers": got_from.tiers,
            "from_peers": got_from.from_peers,
            "ok": exact(got),
        }
    mgr.close()
    return out


def w_tiered_cut(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any], flag: str
) -> dict[str, Any]:
    """Save steps 2 and 3 while every request to the persistent tier fails; once every
    rank saw them held on its tier 0, rank 0 creates ``flag`` (the proxy lets requests
    through from then on) and every rank waits for replication to catch up."""
    import time

    import torch.distributed as dist

    from atomic_checkpoint import CheckpointManager

    fast, mgr = _node_manager(rank, base, slow, opts, keep=5, timeout_s=20, retry_max_s=0.2)
    mgr._slow_storage.fs.retries = 1  # s3fs' own retry loop, on top of botocore's
    for s in (2, 3):
        mgr.save(s, make_state(s, rank, big_elems=ELEMS))
    # Every rank's replicator has met the cut link (an agreed round failed alike).
    deadline = time.monotonic() + 30
    while mgr.last_replication_error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    out: dict[str, Any] = {"tried": mgr.last_replication_error is not None}
    out["waiting"] = mgr.wait_replicated(timeout_s=0)
    # Held past KeepLast(1): these steps exist nowhere else.
    out["held"] = [c.step for c in CheckpointManager(fast, read_only=True).checkpoints()]
    out["backlog"] = mgr.replication_backlog()
    dist.barrier()
    if rank == 0:
        with open(flag, "w"):
            pass
    out["replicated"] = mgr.wait_replicated(timeout_s=60)
    out["left"] = mgr.close()
    return out


def w_peers(
    rank: int,
    world: int,
    base: str,
    slow: str,
    opts: dict[str, Any] | None,
    peers: int,
    steps: list[int],
    held: list[int] = (),  # type: ignore[assignment]
    flag: str | None = None,
    settle: bool = False,
    peer_wait_s: float = 60.0,
    pause_s: float = 0.0,
    restore: bool = True,
) -> dict[str, Any]:
    """Restore the newest step every rank can load (if any), save ``steps`` and wait
    until the persistent tier and the peers have them; then (``flag``: rank 0 creates
    it once every rank got there, and the proxy in front of the persistent tier answers
    503, or holds every request, from then on) save ``held`` and wait for their peer
    copies only, ``peer_wait_s`` at most (``pause_s``: after each, wait for its peer
    copies, then that long, so that its tier 1 round has begun). ``settle``: with no
    ``steps``, wait all the same (for what this start found to do). ``restore``: False,
    nothing is restored (a start that only replicates what it found)."""
    import logging

    import torch.distributed as dist

    warned: list[str] = []
    logging.getLogger("atomic_checkpoint").addHandler(ListHandler(warned))
    _, mgr = _node_manager(
        rank, base, slow, opts, keep=3, timeout_s=30, retry_max_s=0.2, peers=peers
    )
    if hasattr(mgr._slow_storage, "fs"):
        mgr._slow_storage.fs.retries = 1  # s3fs' own retry loop, on top of botocore's
    latest = mgr.latest()
    out: dict[str, Any] = {"latest": None if latest is None else (latest.step, latest.tiers)}
    if latest is not None and restore:
        out["copies"] = latest.node_copies
        state = mgr.restore()
        out["restored_ok"] = states_equal(state, make_state(latest.step, rank, big_elems=ELEMS))
        got = mgr.last_restored
        out["restored"] = (got.step, got.tiers, got.from_peers)
    for s in steps:
        mgr.save(s, make_state(s, rank, big_elems=ELEMS))
    if steps or settle:
        out["replicated"] = mgr.wait_replicated(timeout_s=60)
        out["peered"] = mgr.wait_peers(timeout_s=60)
    if flag is not None:
        dist.barrier()
        if rank == 0:
            with open(flag, "w"):
                pass
    for s in held:
        mgr.save(s, make_state(s, rank, big_elems=ELEMS))
        if pause_s:
            mgr.wait_peers(s, timeout_s=peer_wait_s)
            time.sleep(pause_s)
    if held:
        out["peered_held"] = mgr.wait_peers(timeout_s=peer_wait_s)
    out["recoverable"] = mgr.peer_recoverable()
    out["listed"] = [(c.step, c.tiers, c.node_copies) for c in mgr.checkpoints()]
    out["left"] = mgr.close(timeout_s=1 if flag is not None else None)
    out["warnings"] = warned
    return out


def w_overlapped_restore(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any] | None
) -> dict[str, Any]:
    """Restore while node 1's tier 0 is wiped (its file comes from node 2's peer copy).
    Node 2, the sender, holds its own file on its tier 0: before it sends a byte, it
    waits (10 s at most) until its own load of that file has finished. Only a restore
    that loads that file while the fetch runs lets the sender go on at once."""
    import threading
    import time

    _, mgr = _node_manager(rank, base, slow, opts, keep=3, timeout_s=30, retry_max_s=0.2, peers=1)
    loaded = threading.Event()
    waited: list[float] = []
    load_mine, transfer = mgr._load_mine, mgr._transfer

    def load_and_tell(tier: Any, *args: Any, **kwargs: Any) -> Any:
        state = load_mine(tier, *args, **kwargs)
        if tier == 0:
            loaded.set()
        return state

    def transfer_after_load(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("send") is not None:
            t = time.monotonic()
            loaded.wait(10)
            waited.append(time.monotonic() - t)
        return transfer(*args, **kwargs)

    mgr._load_mine = load_and_tell  # type: ignore[method-assign]
    mgr._transfer = transfer_after_load  # type: ignore[method-assign]
    state = mgr.restore()
    got = mgr.last_restored
    out = {
        "restored_ok": states_equal(state, make_state(got.step, rank, big_elems=ELEMS)),
        "restored": (got.step, got.tiers, got.from_peers),
        "loaded_before_send": loaded.is_set() and bool(waited) and max(waited) < 5,
        "waited": waited,
    }
    mgr.close()
    return out


def w_counted_restore(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any] | None, steps: int
) -> dict[str, Any]:
    """Save steps 1..``steps`` (none if 0) and wait until tier 1 has them; else
    ``latest()`` and ``restore()``, counting on rank 0 the tier-1 manifests each reads."""
    import logging
    import threading

    from atomic_checkpoint import catalog

    warned: list[str] = []
    logging.getLogger("atomic_checkpoint").addHandler(ListHandler(warned))
    _, mgr = _node_manager(rank, base, slow, opts, keep=steps or 100, timeout_s=30, retry_max_s=0.2)
    if steps:
        for s in range(1, steps + 1):
            mgr.save(s, make_state(s, rank, big_elems=ELEMS))
        out: dict[str, Any] = {"replicated": mgr.wait_replicated(timeout_s=60)}
        mgr.close()
        return out
    reads = [0]
    read_manifest = catalog.read_manifest

    def counted(storage: Any, rel: str) -> Any:
        # The calling thread's reads only (and the bounded reads it waits for, on a
        # thread of their own): the replicator's start lists tier 1 too.
        here = threading.current_thread()
        caller = here is threading.main_thread() or here.name == "atomic-checkpoint-bounded"
        if caller and storage.url("").rstrip("/") == mgr._slow_storage.url("").rstrip("/"):
            reads[0] += 1
        return read_manifest(storage, rel)

    catalog.read_manifest = counted  # type: ignore[assignment]
    try:
        latest = mgr.latest()
        latest_reads, reads[0] = reads[0], 0
        state = mgr.restore()
    finally:
        catalog.read_manifest = read_manifest  # type: ignore[assignment]
    got = mgr.last_restored
    out = {
        "latest": None if latest is None else (latest.step, latest.tiers),
        "latest_reads": latest_reads,
        "restore_reads": reads[0],
        "restored": (got.step, got.tiers),
        "restored_ok": states_equal(state, make_state(got.step, rank, big_elems=ELEMS)),
        "warnings": warned,
    }
    mgr.close()
    return out


def w_tiered_disk_full(
    rank: int,
    world: int,
    base: str,
    slow: str,
    opts: dict[str, Any] | None,
    node1_dir: str,
    filler: str,
) -> dict[str, Any]:
    """Node 1's tier 0 is ``node1_dir`` on a small filesystem. Save step 1 and wait
    until it is replicated; then node 1's disk fills up (rank 1 writes ``filler`` until
    ENOSPC) and every rank saves step 2, which must fail alike; rank 1 frees the space
    and every rank saves step 3. Reports each save's outcome and what is where."""
    import errno

    import torch.distributed as dist

    from atomic_checkpoint import CheckpointManager

    os.environ[HOST_ENV] = f"node{rank}"
    fast = node1_dir if rank == 1 else os.path.join(base, f"node{rank}")
    mgr = TieredCheckpointManager(
        [
            Tier(fast, retention=KeepLast(1)),
            Tier(slow, retention=KeepLast(3), storage_options=opts),
        ],
        timeout_s=30,
        retry_max_s=0.5,
        fast_domains="per-host",
    )
    out: dict[str, Any] = {"saved": {}}
    mgr.save(1, make_state(1, rank, big_elems=ELEMS))
    out["replicated1"] = mgr.wait_replicated(timeout_s=60)
    dist.barrier()
    if rank == 1:
        with open(filler, "wb") as f:  # the disk is full from here on
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    dist.barrier()
    for s in (2, 3):
        try:
            mgr.save(s, make_state(s, rank, big_elems=ELEMS))
            out["saved"][s] = None
        except Exception as exc:  # every rank must get the same error
            # The README: a full disk is caught as StorageFullError, one rank or many.
            out["saved"][s] = [type(exc).__name__, str(exc), isinstance(exc, StorageFullError)]
        if s == 2 and rank == 1:
            os.remove(filler)  # space again
        dist.barrier()
    out["replicated"] = mgr.wait_replicated(timeout_s=60)
    out["listed"] = [(c.step, c.tiers) for c in mgr.checkpoints()]
    out["tier0"] = [c.step for c in CheckpointManager(fast, read_only=True).checkpoints()]
    out["left"] = mgr.close()
    return out


def w_two_per_node_cut(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any], opened: str
) -> dict[str, Any]:
    """Two ranks per node (``node<rank // 2>``, its tier 0 ``base/node<n>``): once every
    rank opened the tiers, rank 0 creates ``opened`` (the proxy fails every request
    from then on); save steps 1-3 and end the job without waiting
    (``close(timeout_s=0)``): the steps stay on the nodes' tier 0 only."""
    import torch.distributed as dist

    node = rank // 2
    os.environ[HOST_ENV] = f"node{node}"
    mgr = TieredCheckpointManager(
        [
            Tier(os.path.join(base, f"node{node}"), retention=KeepLast(1)),
            Tier(slow, storage_options=opts),
        ],
        timeout_s=20,
        retry_max_s=0.2,
        fast_domains="per-host",
    )
    mgr._slow_storage.fs.retries = 1  # s3fs' own retry loop, on top of botocore's
    dist.barrier()
    if rank == 0:
        with open(opened, "w"):
            pass
    for s in (1, 2, 3):
        mgr.save(s, make_state(s, rank, big_elems=ELEMS))
    return {"left": mgr.close(timeout_s=0), "domain": mgr.fast.domain.members}


def w_close_one_by_one(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any], late_s: float, down: str
) -> dict[str, Any]:
    """Every rank its own node. Once every rank opened the tiers, rank 0 creates
    ``down`` (the proxy in front of the persistent tier answers errors from then on), so
    the replicators retry their rounds in lockstep. Save step 1, then rank 0 closes at
    once and the others ``late_s`` later. Reports how long each close took, what stayed
    on tier 0 and whether replication stopped on an exchange that timed out."""
    import torch.distributed as dist

    _, mgr = _node_manager(rank, base, slow, opts, keep=3, timeout_s=30, retry_max_s=0.2)
    mgr._slow_storage.fs.retries = 1  # s3fs' own retry loop, on top of botocore's
    dist.barrier()
    if rank == 0:
        with open(down, "w"):
            pass
    mgr.save(1, make_state(1, rank, big_elems=ELEMS))
    dist.barrier()
    if rank != 0:
        time.sleep(late_s)
    t0 = time.monotonic()
    left = mgr.close(timeout_s=0)
    return {"close_s": time.monotonic() - t0, "left": left, "fatal": repr(mgr._fatal)}


def w_restore_states(
    rank: int,
    world: int,
    base: str,
    slow: str,
    pristine: str,
    steps: int,
    scenarios: list[dict[str, Any]],
) -> dict[str, Any]:
    """With ``scenarios`` empty: save steps 1..``steps`` (tier 0 keeps 3, tier 1 all of
    them, one peer copy of each node's files) and wait until tier 1 and the peers have
    them. Else, for each scenario: rank 0 resets ``base`` and ``slow`` to the copies in
    ``pristine``, removes the scenario's ``wipe`` nodes' tier 0 and flips a byte in each
    of its ``rot`` files; then every rank opens its manager and restores. Reports each
    restore's step, tiers and exactness, or its error's type and text."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist
    from tests.cli.helpers import flip_byte

    from atomic_checkpoint import CheckpointError

    def manager() -> TieredCheckpointManager:
        return _node_manager(
            rank,
            base,
            slow,
            None,
            keep=steps,
            timeout_s=30,
            retry_max_s=0.2,
            peers=1,
            fast_keep=3,
        )[1]

    if not scenarios:
        mgr = manager()
        for s in range(1, steps + 1):
            mgr.save(s, make_state(s, rank, big_elems=ELEMS))
        done = {"replicated": mgr.wait_replicated(timeout_s=60)}
        done["peered"] = mgr.wait_peers(timeout_s=60)
        mgr.close()
        return done
    outcomes: list[Any] = []
    for sc in scenarios:
        dist.barrier()
        if rank == 0:
            for live, kept in ((base, "nodes"), (slow, "persistent")):
                shutil.rmtree(live)
                shutil.copytree(os.path.join(pristine, kept), live)
            for node in sc["wipe"]:
                shutil.rmtree(os.path.join(base, f"node{node}"))
            for path in sc["rot"]:
                flip_byte(Path(path))
        dist.barrier()
        mgr = manager()
        try:
            state = mgr.restore()
            got = mgr.last_restored
            exact = states_equal(state, make_state(got.step, rank, big_elems=ELEMS))
            outcomes.append(("ok", got.step, list(got.tiers), exact))
        except CheckpointError as exc:
            outcomes.append((type(exc).__name__, str(exc)[:300]))
        finally:
            mgr.close()
    return {"outcomes": outcomes}


def w_replicator_bug(rank: int, world: int, base: str, slow: str) -> dict[str, Any]:
    """A bug in rank 0's replicator (reading its peer copy raises ValueError) during the
    peer round of step 1: how long each rank's ``wait_peers`` and ``wait_replicated``
    take to end, and what they report."""
    from atomic_checkpoint import CheckpointError, tiered

    if rank == 0:

        def broken(*_args: Any, **_kwargs: Any) -> Any:
            raise ValueError("a bug in the sender")

        tiered._read_chunks = broken  # type: ignore[assignment]
    # 10 s: the bound of every exchange, the first save's too, which a loaded 2-core
    # machine starting 3 ranks can keep rank 0 from reaching within 5 s.
    _, mgr = _node_manager(rank, base, slow, None, keep=3, timeout_s=10, retry_max_s=0.2, peers=1)
    mgr.save(1, make_state(1, rank, big_elems=ELEMS))
    t = time.monotonic()
    out: dict[str, Any] = {"peered": mgr.wait_peers(timeout_s=60)}
    out["peers_s"] = time.monotonic() - t
    try:
        out["replicated"] = mgr.wait_replicated(timeout_s=60)
    except CheckpointError as exc:
        out["replicated"] = f"{type(exc).__name__}: {exc}"
    out["waited_s"] = time.monotonic() - t
    out["last_error"] = repr(mgr.last_replication_error)
    try:
        mgr.close()
    except CheckpointError as exc:
        out["close"] = f"{type(exc).__name__}: {exc}"
    return out


def w_rollback(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any] | None, peers: int
) -> dict[str, Any]:
    """Save steps 1-3 (replicated and peer copied), roll back to step 1 on every rank,
    save another step 2 (the state of "step 20") and report what each rank then sees
    and restores."""
    _, mgr = _node_manager(
        rank, base, slow, opts, keep=5, timeout_s=30, retry_max_s=0.2, peers=peers, fast_keep=2
    )
    for s in (1, 2, 3):
        mgr.save(s, make_state(s, rank, big_elems=ELEMS))
    out: dict[str, Any] = {"replicated": mgr.wait_replicated(timeout_s=60)}
    out["peered"] = mgr.wait_peers(timeout_s=60)
    out["removed"] = mgr.rollback(1)
    mgr.save(2, make_state(20, rank, big_elems=ELEMS))
    out["replicated_again"] = mgr.wait_replicated(timeout_s=60)
    out["peered_again"] = mgr.wait_peers(timeout_s=60)
    out["listed"] = [(c.step, c.tiers) for c in mgr.checkpoints()]
    out["recoverable"] = mgr.peer_recoverable()
    state = mgr.restore()
    out["restored"] = mgr.last_restored.step
    out["restored_ok"] = states_equal(state, make_state(20, rank, big_elems=ELEMS))
    out["failures"] = sorted(mgr.replication_failures())
    out["left"] = mgr.close()
    return out


def w_tiered_restore_outcome(
    rank: int, world: int, base: str, slow: str, opts: Any, part: int | None = None
) -> tuple[str, str]:
    """``restore()`` on this rank's node (``restore(rank=part)`` when ``part`` is
    given): ("ok", the restored step) or (the error's type, its message)."""
    _, mgr = _node_manager(rank, base, slow, opts, keep=3, timeout_s=30.0, retry_max_s=0.5)
    try:
        mgr.restore() if part is None else mgr.restore(rank=part)
        got = ("ok", str(mgr.last_restored.step))
    except Exception as exc:
        got = (type(exc).__name__, str(exc))
    mgr.close()
    return got


def _flag_after_step_1(
    rank: int, base: str, slow: str, opts: dict[str, Any], flag: str, *, timeout_s: float
) -> tuple[TieredCheckpointManager, bool]:
    """Save step 1 and wait for the persistent tier to have it; then rank 0 creates
    ``flag`` (the test's proxy holds the persistent tier's requests from then on) and
    every rank saves step 2. The manager, and whether step 1 was replicated."""
    import torch.distributed as dist

    _fast, mgr = _node_manager(rank, base, slow, opts, keep=5, timeout_s=timeout_s, retry_max_s=0.2)
    mgr.save(1, make_state(1, rank, big_elems=ELEMS))
    replicated = mgr.wait_replicated(timeout_s=60)
    dist.barrier()
    if rank == 0:
        with open(flag, "w"):
            pass
    dist.barrier()
    mgr.save(2, make_state(2, rank, big_elems=ELEMS))
    return mgr, replicated


def w_close_within_its_timeout(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any], flag: str
) -> dict[str, Any]:
    """Step 1 replicated; then rank 0 creates ``flag`` (the proxy holds every request
    to the persistent tier from then on, unanswered), step 2 is saved, and every rank
    calls ``close(timeout_s=3)`` with the manager's ``timeout_s`` at 20: how long each
    took, and what it left on tier 0."""

    mgr, replicated = _flag_after_step_1(rank, base, slow, opts, flag, timeout_s=20)
    t = time.monotonic()
    left = mgr.close(timeout_s=3)
    return {"replicated": replicated, "took": time.monotonic() - t, "left": left}


def w_rollback_late(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any], flag: str
) -> dict[str, Any]:
    """Steps 1-3 replicated (tier 0 keeps the newest only: step 3; the persistent tier
    keeps 5); then rank 0 creates ``flag`` (the proxy
    holds each request to the persistent tier 8 s while it exists, twice the manager's
    ``timeout_s`` of 4) and every rank calls ``rollback(1)``, which gives up waiting for
    the persistent tier. Rank 0 removes the flag; once the held rollback has landed on
    the persistent tier, every rank keeps step 2 with ``rollback(2)``. What each rank
    saw, and whether the persistent tier caught up."""
    import torch.distributed as dist

    _fast, mgr = _node_manager(rank, base, slow, opts, keep=5, timeout_s=4, retry_max_s=0.2)
    for s in (1, 2, 3):
        mgr.save(s, make_state(s, rank, big_elems=ELEMS))
        mgr.wait_replicated(timeout_s=60)  # then tier 0's retention drops the step before
    out: dict[str, Any] = {"replicated": mgr.wait_replicated(timeout_s=60)}
    dist.barrier()
    if rank == 0:
        with open(flag, "w"):
            pass
    dist.barrier()
    try:
        out["first"] = f"returned {mgr.rollback(1)}"
    except CheckpointError as exc:
        out["first"] = str(exc)
    out["tier0_after_first"] = [c.step for c in mgr.fast.checkpoints()]
    dist.barrier()
    if rank == 0:
        os.remove(flag)
    time.sleep(8)  # the held request is answered 8 s after it was made
    out["removed"] = mgr.rollback(2)
    out["caught_up"] = mgr.wait_replicated(timeout_s=60)
    out["backlog"] = mgr.replication_backlog()
    out["left"] = mgr.close(timeout_s=30)
    return out


def w_tier1_stalls(
    rank: int, world: int, base: str, slow: str, opts: dict[str, Any], flag: str
) -> dict[str, Any]:
    """Step 1 replicated; then rank 0 creates ``flag`` (the proxy holds each request to
    the persistent tier 8 s, twice the manager's ``timeout_s`` of 4), step 2 is saved,
    and 7 s later rank 0 removes the flag. What each rank saw meanwhile, and whether
    step 2 reached the persistent tier afterwards on every rank."""

    import torch.distributed as dist

    mgr, first = _flag_after_step_1(rank, base, slow, opts, flag, timeout_s=4)
    out: dict[str, Any] = {"first": first}
    time.sleep(7)
    out["during"] = repr(mgr.last_replication_error)
    dist.barrier()
    if rank == 0:
        os.remove(flag)
    try:
        out["caught_up"] = mgr.wait_replicated(2, timeout_s=60)
    except Exception as exc:
        out["caught_up"] = f"{type(exc).__name__}: {exc}"
    out["after"] = repr(mgr.last_replication_error)
    out["backlog"] = mgr.replication_backlog()
    out["left"] = mgr.close(timeout_s=30)
    return out


def w_tiered_resized(
    rank: int, world: int, base: str, slow: str, opts: Any, save: int | None
) -> dict[str, Any]:
    """A job of ``world`` ranks, each its own node: save step ``save`` and wait for the
    persistent tier; or (``save`` None) restore, then ``rollback`` to the step restored
    and save the next one, as the restore's warning advises."""
    warned: list[str] = []
    logging.getLogger("atomic_checkpoint").addHandler(ListHandler(warned))
    _, mgr = _node_manager(rank, base, slow, opts, keep=3, timeout_s=30.0, retry_max_s=0.5)
    out: dict[str, Any] = {"warned": warned}
    try:
        if save is not None:
            mgr.save(save, make_state(save, rank, big_elems=ELEMS))
        else:
            state = mgr.restore()
            step = out["restored"] = mgr.last_restored.step
            out["restored_ok"] = states_equal(state, make_state(step, rank, big_elems=ELEMS))
            mgr.rollback(step)
            mgr.save(step + 1, make_state(step + 1, rank, big_elems=ELEMS))
        out["replicated"] = mgr.wait_replicated(timeout_s=60)
        out["listed"] = [c.step for c in mgr.checkpoints()]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    mgr.close()
    return out


def w_settings_differ(rank: int, world: int, base: str, slow: str) -> dict[str, Any]:
    """Each rank passes peers=its rank; the last rank also another persistent tier."""
    where = f"{slow}-other" if rank == world - 1 else slow
    try:
        _node_manager(rank, base, where, None, keep=3, timeout_s=20, retry_max_s=0.2, peers=rank)
    except CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}
