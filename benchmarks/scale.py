"""Coordination and manifests at scale: the real commit path with up to 1024 ranks on
one machine, manifests of up to 4096 ranks, requests per save on the S3 test server.
docs/scale.md has the figures and what they mean for 4096 ranks.

    python benchmarks/scale.py [--ranks 1,8,64,256,1024] [--saves 3] [--per-domain K]
                               [--manifests 8,64,512,4096] [--files-per-rank 4]
                               [--s3 8,32,128] [--json PATH] [--plot PATH]
                               [--baseline JSON] [--dir DIR]

Ranks: every rank is a thread with its own client connection to one real TCPStore
server (in a process of its own, as torchrun's agent hosts it), its own
``TorchDistributedCoordinator`` and its own storage object, and runs ``commit.save``,
the code under ``CheckpointManager.save`` less the serialization: prepare, write one
tiny file (fsync'd), the write round, the leader's manifest, fsyncs and rename. Rank 0,
the leader, runs in this process; the others in child processes of up to 128 threads.
The files go to a tmpfs (/dev/shm) when there is one, so what is measured is
coordination and commit, not the disk. Each rank's store client is wrapped in a counter
of requests, keys touched and bytes (keys and values, both ways) through the store.

Per save, in steady state (the first saves warm up; keys of a save are deleted during
the next one, so counts are taken from one finished save to the next):

- requests, keys, bytes: through the store, all ranks together; requests and keys are
  exact and the same every save;
- leader time: from the moment the leader's wait for every rank's report returned to
  the moment its commit's outcome was written (collecting N reports, checking N files,
  the manifest, its fsyncs and the rename, while every other rank waits), as wall time
  and as the CPU time of the leader's process; growth exponents are fitted over N > 1
  (target <= 1.2);
- slowest-rank overhead: the longest time any rank spent in ``save`` less its own
  write and fsync (median over saves). With ranks as threads on a few cores, this
  includes waiting for the CPU behind every other rank: an upper bound on a real
  job's, where each rank has its own core.

``--per-domain K``: domains of K ranks, each committing its own copy (node-local
disks, ``storage_domains="per-host"``) under its own directory.

Manifests: a manifest of N ranks with ``--files-per-rank`` files each (model and
optimizer shards, RNG state, a per-rank metadata file; realistic names, sizes and
checksums): its size, and the time to write it (serialize, write, fsync), read it back
(read, parse, validate the schema), and validate the checkpoint against it (every
listed file present with its size, as ``latest()`` does), with the files really there.

S3 (``--s3``): saves by N ranks (threads) on the S3 test server (moto, from
tests/testbed), HTTP requests per save by kind, counted in the server's log.

``--baseline``: a JSON of an earlier run (e.g. of an older commit), drawn grey.

Exit status: 0, or 1 if a save failed or the counts per save were not the same every
save.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# -- counting store ------------------------------------------------------------------


class Counts:
    """Requests, keys and bytes through the store, by operation; wait time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.keys = 0
        self.bytes = 0
        self.wait_s = 0.0
        # (operation, keys, when it ended, this process's CPU time then)
        self.log: list[tuple[str, int, float, float]] = []

    def add(self, op: str, keys: int, nbytes: int) -> None:
        with self.lock:
            self.requests[op] = self.requests.get(op, 0) + 1
            self.keys += keys
            self.bytes += nbytes
            self.log.append((op, keys, time.perf_counter(), time.process_time()))

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": sum(self.requests.values()),
                "by_op": dict(self.requests),
                "keys": self.keys,
                "bytes": self.bytes,
                "wait_s": self.wait_s,
            }


def _n(b: Any) -> int:
    return len(b.encode() if isinstance(b, str) else b)


class CountingStore:
    """A TCPStore client that counts what goes through it. Only the operations the
    coordinator uses are forwarded: any other raises, so none goes uncounted."""

    def __init__(self, store: Any, counts: Counts | None = None):
        self._s = store
        self.counts = counts if counts is not None else Counts()

    def set(self, key: str, value: Any) -> None:
        self.counts.add("set", 1, _n(key) + _n(value))
        self._s.set(key, value)

    def append(self, key: str, value: Any) -> None:
        self.counts.add("append", 1, _n(key) + _n(value))
        self._s.append(key, value)

    def get(self, key: str) -> bytes:
        value = self._s.get(key)
        self.counts.add("get", 1, _n(key) + len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._s.multi_get(keys)
        self.counts.add("multi_get", len(keys), sum(map(_n, keys)) + sum(map(len, values)))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.counts.add("multi_set", len(keys), sum(map(_n, keys)) + sum(map(_n, values)))
        self._s.multi_set(keys, values)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = self._s.compare_set(key, expected, desired)
        self.counts.add("compare_set", 1, _n(key) + _n(expected) + _n(desired) + len(value))
        return value

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        t = time.perf_counter()
        try:
            self._s.wait(keys, timeout)
        finally:
            with self.counts.lock:
                self.counts.wait_s += time.perf_counter() - t
            self.counts.add("wait", len(keys), sum(map(_n, keys)))

    def check(self, keys: list[str]) -> bool:
        self.counts.add("check", len(keys), sum(map(_n, keys)))
        return bool(self._s.check(keys))

    def delete_key(self, key: str) -> bool:
        self.counts.add("delete_key", 1, _n(key))
        return bool(self._s.delete_key(key))

    def clone(self) -> CountingStore:
        return CountingStore(self._s.clone(), self.counts)


# -- ranks as threads ------------------------------------------------------------------


def _scratch_dir(parent: str | None) -> str:
    if parent is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        parent = "/dev/shm"
    return tempfile.mkdtemp(prefix="ac-scale-", dir=parent)


def _raise_fd_limit(need: int) -> None:
    """Every rank holds a client socket and the server one more per rank."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


@dataclass(frozen=True)
class Job:
    """What every rank of one ``run_saves`` shares: ``total`` saves by ``world`` ranks,
    each a client of the store at ``port``, into ``root``."""

    world: int
    port: int
    root: str
    total: int
    timeout_s: float
    storage_options: dict[str, Any] | None = None
    #: Ranks per storage domain (node-local disks, as ``storage_domains="per-host"``
    #: finds them): each domain of that many consecutive ranks commits its own copy
    #: under ``root/node-<index>``. None: one domain (a shared filesystem).
    per_domain: int | None = None


def _run_ranks(
    ranks: list[int], job: Job, step_sync: Callable[[int, str], None]
) -> dict[int, dict[str, Any]]:
    """Run ``job``'s saves on ``ranks`` (threads of this process), each with its own
    client of the store; ``step_sync(i, "start"|"end")`` is called by this process's
    main thread around each save, once its own ranks are ready / done.

    Returns, per rank: the counts after each save (its deferred deletes included), the
    wall time of each save, its own write+fsync time, and (rank 0) the store log."""
    import torch.distributed as dist

    from atomic_checkpoint import commit
    from atomic_checkpoint.commit import RankReport, SaveContext
    from atomic_checkpoint.coordination import TorchDistributedCoordinator
    from atomic_checkpoint.domains import Domain
    from atomic_checkpoint.manifest import FileEntry, Hasher
    from atomic_checkpoint.storage import open_storage
    from atomic_checkpoint.strategies import choose_strategy

    _raise_fd_limit(2 * len(ranks) + 256)
    barrier = threading.Barrier(len(ranks) + 1)
    out: dict[int, dict[str, Any]] = {r: {"counts": [], "wall": [], "data": []} for r in ranks}
    errors: dict[int, BaseException] = {}
    payload = os.urandom(256)
    digest = Hasher()
    digest.update(payload)
    checksum = digest.hexdigest()

    def rank_main(rank: int) -> None:
        mine = out[rank]
        try:
            client = dist.TCPStore(
                "127.0.0.1", job.port, 1, False, timeout=timedelta(seconds=job.timeout_s)
            )
            store = CountingStore(client)
            coord = TorchDistributedCoordinator(
                store, rank=rank, world_size=job.world, namespace=f"scale{job.world}"
            )
            root, domain = job.root, None
            if job.per_domain:
                k = job.per_domain
                leaders = tuple(range(0, job.world, k))
                index = rank // k
                members = tuple(range(index * k, min(index * k + k, job.world)))
                domain = Domain(index, leaders[index], members, leaders)
                root = f"{job.root}/node-{index}"
            storage = open_storage(root, job.storage_options)
            ctx = SaveContext(
                storage=storage,
                coord=coord,
                run_id="scale",
                timeout_s=job.timeout_s,
                strategy=choose_strategy(storage),
                domain=domain,
            )
        except BaseException as exc:  # reported by the caller
            errors[rank] = exc
            barrier.abort()
            return
        rel = f"rank-{rank:05d}.bin"

        def write(pending: str) -> RankReport:
            t = time.perf_counter()
            w = storage.open_write(f"{pending}/{rel}", size_hint=len(payload))
            w.write(payload)
            t_write = time.perf_counter() - t
            t = time.perf_counter()
            w.close()  # fsync
            t_fsync = time.perf_counter() - t
            mine["data"].append(t_write + t_fsync)  # this rank's own (timings has the max)
            return RankReport((FileEntry(rel, len(payload), checksum, rank),), t_write, t_fsync)

        for i in range(job.total):
            try:
                barrier.wait()  # every save starts together, as after a training step
                n0 = len(store.counts.log)
                t = time.perf_counter()
                pending = commit.begin(ctx, i)
                written = write(pending.location)
                commit.finish(ctx, pending, written, state_kind="per_rank", metrics={}, metadata={})
                mine["wall"].append(time.perf_counter() - t)
                # The deferred deletes of this save's exchange, so the counts are exact.
                coord._worker.run(lambda: None, job.timeout_s)
                mine["counts"].append(store.counts.snapshot())
                if rank == 0:
                    mine.setdefault("log", []).append(store.counts.log[n0:])
                barrier.wait()
            except BaseException as exc:  # reported by the caller
                errors[rank] = exc
                barrier.abort()
                return

    old_stack = threading.stack_size(1 << 20)
    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True) for r in ranks
    ]
    threading.stack_size(old_stack)
    for th in threads:
        th.start()
    try:
        for i in range(job.total):
            step_sync(i, "start")
            barrier.wait()
            barrier.wait()
            step_sync(i, "end")
    except threading.BrokenBarrierError:
        barrier.abort()
    for th in threads:
        th.join(job.timeout_s)
    if errors:
        rank, exc = min(errors.items())
        raise RuntimeError(f"scale: rank {rank} of {job.world} failed: {exc!r}") from exc
    return out


def _child(ranks: list[int], job: Job, sync: Any, conn: Any) -> None:
    """A process of ranks: ``_run_ranks``, in step with the parent through ``sync``."""
    result: Any
    try:
        result = _run_ranks(ranks, job, lambda i, what: sync.wait(job.timeout_s))
    except BaseException as exc:
        sync.abort()
        result = f"{type(exc).__name__}: {exc}"
    conn.send(result)
    conn.close()


def run_saves(
    world: int,
    saves: int,
    root: str,
    *,
    timeout_s: float = 600.0,
    warmup: int = 2,
    procs: int | None = None,
    progress: Callable[[str], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    on_save_end: Callable[[int], None] | None = None,
    per_domain: int | None = None,
) -> dict[str, Any]:
    """``warmup + saves`` saves by ``world`` ranks through one real TCPStore; returns
    the counts of each counted save (all ranks together) and per-save timings.

    Rank 0, the leader, runs in this process with the store server; the other ranks run
    as threads of ``procs`` child processes (default: one per 128 ranks, at most 8), so
    that the leader's time is not spent waiting for the interpreter lock behind a
    thousand threads. ``procs=0`` runs every rank in this process (the counts are the
    same; the times are not).

    Counts of save i are taken between the end of save i-1 and the end of save i, once
    every rank's deferred store requests (deletes) have run, so they are exact.

    ``per_domain``: ranks per storage domain (each domain commits its own copy, as on
    node-local disks); None: one domain."""
    import multiprocessing as mp

    import torch.distributed as dist

    if "://" not in root:
        os.makedirs(root, exist_ok=True)
        for d in range(math.ceil(world / per_domain) if per_domain else 0):
            os.makedirs(f"{root}/node-{d}", exist_ok=True)
    total = warmup + saves
    others = list(range(1, world))
    if procs is None:
        procs = min(8, math.ceil(len(others) / 128))
    procs = min(procs, len(others))
    groups = [others[k::procs] for k in range(procs)] if procs else []
    _raise_fd_limit(2 * world + 256)
    ctx = mp.get_context("spawn")
    server: Any = None
    if procs:
        # The store server in a process of its own, as torchrun's agent: its thread
        # would otherwise count in the leader's CPU time.
        server_end, serving = ctx.Pipe()
        server_proc = ctx.Process(target=_serve, args=(serving, timeout_s), daemon=True)
        server_proc.start()
        port = server_end.recv()
    else:
        server = dist.TCPStore(
            "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        port = server.port
    job = Job(world, port, root, total, timeout_s, storage_options, per_domain)
    sync = ctx.Barrier(procs + 1)
    children = []
    for group in groups:
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(group, job, sync, child_end), daemon=True)
        proc.start()
        child_end.close()
        children.append((proc, parent_end))

    def step_sync(i: int, what: str) -> None:
        if procs:
            sync.wait(timeout_s)
        if what == "end" and on_save_end is not None:
            on_save_end(i)
        if what == "end" and progress:
            progress(f"  {world} ranks: save {i + 1}/{total} done")

    here = [0] if procs else list(range(world))
    failed: str | None = None
    try:
        ranks = _run_ranks(here, job, step_sync)
    except (RuntimeError, threading.BrokenBarrierError) as exc:
        sync.abort()
        ranks, failed = {}, str(exc)
    for proc, conn in children:
        got = conn.recv() if conn.poll(timeout_s) else "no answer"
        proc.join(10)
        if isinstance(got, str):
            failed = failed or f"a process of ranks failed: {got}"
        else:
            ranks.update(got)
    if procs:
        server_end.close()
        server_proc.join(10)
    if failed:
        raise RuntimeError(f"scale, {world} ranks: {failed}")
    return _figures(world, warmup, total, ranks)


def _figures(
    world: int, warmup: int, total: int, ranks: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    per_save = []
    zero: dict[str, Any] = {"requests": 0, "keys": 0, "bytes": 0, "by_op": {}}
    for i in range(warmup, total):
        d = {}
        for r in range(world):
            a, b = ranks[r]["counts"][i], ranks[r]["counts"][i - 1] if i else zero
            d[r] = {k: a[k] - b[k] for k in ("requests", "keys", "bytes")} | {
                "by_op": {op: n - b["by_op"].get(op, 0) for op, n in a["by_op"].items()}
            }
        by_op: dict[str, int] = {}
        for v in d.values():
            for op, n in v["by_op"].items():
                if n:
                    by_op[op] = by_op.get(op, 0) + n
        per_save.append(
            {k: sum(v[k] for v in d.values()) for k in ("requests", "keys", "bytes")}
            | {
                "by_op": dict(sorted(by_op.items())),
                "leader_requests": d[0]["requests"],
                "leader_keys": d[0]["keys"],
                "max_other_requests": max((d[r]["requests"] for r in range(1, world)), default=0),
                "max_other_keys": max((d[r]["keys"] for r in range(1, world)), default=0),
                "max_other_bytes": max((d[r]["bytes"] for r in range(1, world)), default=0),
            }
        )
    exact = ("requests", "keys", "by_op")
    leader = [_leader_time(ranks[0]["log"][i], world) for i in range(warmup, total)]
    slowest_s = [
        max(ranks[r]["wall"][i] - ranks[r]["data"][i] for r in range(world))
        for i in range(warmup, total)
    ]
    first = per_save[0]
    return {
        "world": world,
        "per_save": per_save,
        # Requests and keys are exact; bytes vary by a few with what the values hold.
        "deterministic": all(
            {k: p[k] for k in exact} == {k: first[k] for k in exact} for p in per_save
        ),
        **{k: v for k, v in first.items()},
        "leader_s": statistics.median(t for t, _ in leader),
        "leader_cpu_s": statistics.median(c for _, c in leader),
        "slowest_overhead_s": statistics.median(slowest_s),
    }


def _leader_time(log: list[tuple[str, int, float, float]], world: int) -> tuple[float, float]:
    """From the moment the leader's wait for every report returned to the moment its
    commit's outcome was written (its collection of N reports, the manifest, fsyncs and
    rename, while every other rank waits): wall time, and the CPU time of the leader's
    process (its own work, without the time it waited for a core)."""
    if world == 1:
        return 0.0, 0.0
    ready = next(e for e in log if e[0] == "wait" and e[1] >= world - 1)
    done = max((e for e in log if e[0] == "compare_set"), key=lambda e: e[2])
    return done[2] - ready[2], done[3] - ready[3]


def _serve(conn: Any, timeout_s: float) -> None:
    """A TCPStore server until the parent closes ``conn``."""
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    conn.send(server.port)
    try:
        conn.recv()
    except EOFError:
        pass


# -- on the S3 server -----------------------------------------------------------------

_REQUEST = re.compile(r'"(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP/[0-9.]+" (\d+)')


def _s3_kind(method: str, target: str) -> str:
    """A request's kind, as S3 bills and rate-limits it."""
    path, _, query = target.partition("?")
    if method == "GET" and (path.count("/") <= 1 or "list-type" in query or "prefix=" in query):
        return "LIST"
    if method == "GET" and "uploads" in query:
        return "LIST"  # multipart uploads in progress
    return method


def _s3_counts(log_path: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _REQUEST.search(line)
            if m:
                kind = _s3_kind(m.group(1), m.group(2))
                counts[kind] = counts.get(kind, 0) + 1
    return counts


def _settled_counts(log_path: str) -> dict[str, int]:
    """The server logs a request just after answering it: wait for the log to settle."""
    last = None
    for _ in range(50):
        now = os.path.getsize(log_path)
        if now == last:
            break
        last = now
        time.sleep(0.05)
    return _s3_counts(log_path)


def s3_saves(
    world: int, saves: int, work: str, server: Any = None, bucket: str = "scale"
) -> dict[str, Any]:
    """HTTP requests per save on the S3 test server (moto), by kind, with ranks as
    threads each with its own ``FsspecStorage``: the marker strategy, as on S3.
    ``server``: a running ``tests.testbed.s3.S3Server`` with a ``log_dir`` and
    ``bucket`` (default: a new one)."""
    with contextlib.ExitStack() as stack:
        if server is None:
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            if here not in sys.path:
                sys.path.insert(0, here)
            from tests.testbed.s3 import S3Server

            server = stack.enter_context(S3Server(log_dir=os.path.join(work, f"moto-{world}")))
            server.create_bucket(bucket)
        log_path = os.path.join(server.log_dir, f"moto-{server.port}.log")
        after: list[dict[str, int]] = []
        row = run_saves(
            world,
            saves,
            f"s3://{bucket}/n{world}",
            procs=0,
            timeout_s=300,
            storage_options=server.storage_options(),
            on_save_end=lambda i: after.append(_settled_counts(log_path)),
        )
    per_save = [
        {k: n - after[i - 1].get(k, 0) for k, n in after[i].items() if n - after[i - 1].get(k, 0)}
        for i in range(len(after) - saves, len(after))
    ]
    return {"world": world, "http_per_save": per_save, "store_requests": row["requests"]}


# -- manifests -----------------------------------------------------------------------


def _realistic_files(world: int, per_rank: int) -> list[Any]:
    """Per rank: a model shard, an optimizer shard, RNG state, a small metadata file
    (then more optimizer shards if ``per_rank`` > 4), with names, sizes and checksums as
    a sharded job writes them."""
    import random

    from atomic_checkpoint.manifest import FileEntry

    rng = random.Random(world)
    kinds = [
        "model-{r:05d}-of-{w:05d}.safetensors",
        "optim-{r:05d}-of-{w:05d}.safetensors",
        "rng-{r:05d}.pt",
        "meta-{r:05d}.json",
    ]
    files = []
    for r in range(world):
        for k in range(per_rank):
            name = kinds[k] if k < len(kinds) else f"optim-{{r:05d}}-part{k}.safetensors"
            size = (
                rng.randrange(1 << 28, 1 << 31)
                if k < 2
                else rng.randrange(1 << 10, 1 << 16)
                if k < 4
                else rng.randrange(1 << 26, 1 << 29)
            )
            files.append(
                FileEntry(
                    f"rank-{r:05d}/" + name.format(r=r, w=world),
                    size,
                    f"{rng.getrandbits(64):016x}",
                    r,
                )
            )
    return files


def manifest_figures(world: int, per_rank: int, work: str, repeat: int = 3) -> dict[str, Any]:
    """Size and write / read / validate times of one manifest of ``world`` ranks."""
    from atomic_checkpoint import catalog
    from atomic_checkpoint.manifest import Manifest
    from atomic_checkpoint.storage.local import LocalStorage

    files = _realistic_files(world, per_rank)
    root = os.path.join(work, f"manifest-{world}")
    rel = "checkpoint-1"
    ckpt = os.path.join(root, rel)
    # The listed files, really there with their sizes (sparse: no data written).
    for f in files:
        path = os.path.join(ckpt, *f.path.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.truncate(f.size_bytes)
    storage = LocalStorage(root)
    manifest = Manifest(
        step=1,
        run_id="scale",
        commit_seq=1,
        world_size=world,
        files=tuple(files),
        # Each rank's files in its own folder, as a saving() block or DCP writes them:
        # a per-rank checkpoint lists rank-<r>.safetensors for every rank.
        state_kind="files",
        strategy="rename",
    )
    write_s, read_s, validate_s = [], [], []
    size = 0
    for _ in range(repeat):
        t = time.perf_counter()
        data = manifest.to_json_bytes()
        storage.write_bytes_atomic(f"{rel}/checkpoint.manifest.json", data)
        write_s.append(time.perf_counter() - t)
        size = len(data)
        t = time.perf_counter()
        back = catalog.read_manifest(storage, rel)
        read_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        catalog.validate(storage, rel, back)
        validate_s.append(time.perf_counter() - t)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "world": world,
        "files": len(files),
        "size_bytes": size,
        "write_s": statistics.median(write_s),
        "read_s": statistics.median(read_s),
        "validate_s": statistics.median(validate_s),
    }


# -- report --------------------------------------------------------------------------


def growth_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (y ~ x^k)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    multi = [r for r in rows if r["world"] > 1]
    xs = [float(r["world"]) for r in multi]
    return {
        "leader_s": growth_exponent(xs, [r["leader_s"] for r in multi]),
        "leader_cpu_s": growth_exponent(xs, [r["leader_cpu_s"] for r in multi]),
        "requests": growth_exponent(xs, [float(r["requests"]) for r in multi]),
        "keys": growth_exponent(xs, [float(r["keys"]) for r in multi]),
        "bytes": growth_exponent(xs, [float(r["bytes"]) for r in multi]),
        "slowest_overhead_s": growth_exponent(xs, [r["slowest_overhead_s"] for r in multi]),
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def print_report(results: dict[str, Any]) -> None:
    print("\nCoordination per save (all ranks together; steady state)")
    print(
        f"{'ranks':>6} {'requests':>9} {'req/rank':>8} {'keys':>9} {'bytes':>10} "
        f"{'leader req':>10} {'leader ms':>10} {'leader cpu':>10} {'slowest ms':>11}"
    )
    for r in results["saves"]:
        print(
            f"{r['world']:>6} {r['requests']:>9} {r['requests'] / r['world']:>8.2f} "
            f"{r['keys']:>9} {_fmt_bytes(r['bytes']):>10} {r['leader_requests']:>10} "
            f"{r['leader_s'] * 1e3:>10.2f} {r['leader_cpu_s'] * 1e3:>10.2f} "
            f"{r['slowest_overhead_s'] * 1e3:>11.1f}"
        )
    ex = results.get("exponents", {})
    if ex:
        print(
            "growth exponents (fit over N > 1): "
            + ", ".join(f"{k} {v:.2f}" for k, v in ex.items() if v is not None)
        )
    for row in results.get("s3", []):
        print(f"S3 server, {row['world']} ranks: HTTP requests per save {row['http_per_save']}")
    if results.get("manifests"):
        print("\nManifests")
        print(
            f"{'ranks':>6} {'files':>7} {'size':>10} {'write ms':>9} {'read ms':>8} "
            f"{'validate ms':>11}"
        )
        for m in results["manifests"]:
            print(
                f"{m['world']:>6} {m['files']:>7} {_fmt_bytes(m['size_bytes']):>10} "
                f"{m['write_s'] * 1e3:>9.1f} {m['read_s'] * 1e3:>8.1f} "
                f"{m['validate_s'] * 1e3:>11.1f}"
            )


def plot(results: dict[str, Any], path: str, baseline: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["saves"] if r["world"] > 1]
    ns = [r["world"] for r in rows]

    def before(ax: Any, key: str, label: str, scale: float = 1) -> None:
        """The baseline's figure ``key`` (times ``scale``), grey and dashed."""
        if baseline:
            brows = [r for r in baseline["saves"] if r["world"] > 1]
            xs, ys = [r["world"] for r in brows], [r[key] * scale for r in brows]
            ax.loglog(xs, ys, "o--", color="grey", label=label)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    ax.loglog(ns, [r["keys"] for r in rows], "o-", label="keys touched")
    ax.loglog(ns, [r["requests"] for r in rows], "s-", label="requests")
    before(ax, "keys", "keys touched, all-gather on every rank (before)")
    ax.loglog(
        ns, [ns[0] and rows[0]["keys"] * n / ns[0] for n in ns], ":", color="k", label="linear"
    )
    ax.set_xlabel("ranks")
    ax.set_title("store operations per save")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.loglog(ns, [r["bytes"] for r in rows], "o-", label="bytes through the store")
    before(ax, "bytes", "before")
    ax.set_xlabel("ranks")
    ax.set_title("bytes per save")
    ax.legend(fontsize=8)
    ax = axes[2]
    ex = results.get("exponents", {})
    k, kc = ex.get("leader_s"), ex.get("leader_cpu_s")
    ax.loglog(
        ns,
        [r["leader_s"] * 1e3 for r in rows],
        "o-",
        label=f"leader, wall (exponent {k:.2f})" if k else "leader, wall",
    )
    ax.loglog(
        ns,
        [r["leader_cpu_s"] * 1e3 for r in rows],
        "^-",
        label=f"leader, CPU (exponent {kc:.2f})" if kc else "leader, CPU",
    )
    ax.loglog(
        ns,
        [r["slowest_overhead_s"] * 1e3 for r in rows],
        "s-",
        label="slowest rank's overhead (threads on shared cores)",
    )
    before(ax, "leader_s", "leader time, before", scale=1e3)
    ax.set_xlabel("ranks")
    ax.set_ylabel("ms per save")
    ax.set_title("time per save")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", default="1,8,64,256,1024", help="comma-separated rank counts")
    p.add_argument("--saves", type=int, default=3, help="counted saves per rank count")
    p.add_argument(
        "--manifests",
        default="8,64,512,4096",
        help="comma-separated rank counts of the manifest figures ('' for none)",
    )
    p.add_argument("--files-per-rank", type=int, default=4, help="files per rank in a manifest")
    p.add_argument("--s3", default="", help="rank counts to save on the S3 test server (moto)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--plot", help="write a PNG here")
    p.add_argument("--baseline", help="a JSON of an earlier run, drawn for comparison")
    p.add_argument("--dir", help="scratch directory (default: a new one on /dev/shm)")
    p.add_argument(
        "--per-domain",
        type=int,
        help="ranks per storage domain (node-local disks: each domain commits its own "
        "copy); default: one domain",
    )
    args = p.parse_args(argv)
    # One store connection per rank: the store server's log line per connection (it
    # cannot resolve the loopback client's name) would drown the report.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    work = _scratch_dir(args.dir)
    ok = True
    results: dict[str, Any] = {"saves": [], "manifests": []}
    try:
        for world in [int(x) for x in args.ranks.split(",") if x]:
            t = time.monotonic()
            row = run_saves(
                world,
                args.saves,
                os.path.join(work, f"ranks-{world}"),
                progress=lambda s: print(s, file=sys.stderr, flush=True),
                per_domain=args.per_domain,
            )
            shutil.rmtree(os.path.join(work, f"ranks-{world}"), ignore_errors=True)
            ok = ok and row["deterministic"]
            results["saves"].append(row)
            print(
                f"{world} ranks: {row['requests']} requests, {row['keys']} keys, "
                f"{row['bytes']} bytes per save; leader {row['leader_s'] * 1e3:.2f} ms "
                f"({time.monotonic() - t:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        results["exponents"] = summarize(results["saves"])
        for world in [int(x) for x in args.manifests.split(",") if x]:
            results["manifests"].append(manifest_figures(world, args.files_per_rank, work))
        results["s3"] = []
        for world in [int(x) for x in args.s3.split(",") if x]:
            try:
                results["s3"].append(s3_saves(world, 2, work))
            except Exception as exc:  # reported; the other figures stand
                print(f"scale: S3 server, {world} ranks: {exc!r}", file=sys.stderr)
                ok = False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        baseline = None
        if args.baseline:
            with open(args.baseline) as f:
                baseline = json.load(f)
        plot(results, args.plot, baseline)
    if not ok:
        print("scale: the counts differed between saves", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
