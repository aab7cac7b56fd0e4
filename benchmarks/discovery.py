"""Discovery cost against the number of checkpoints in ROOT: ``latest()``,
``checkpoints()`` and a writable start (a job restart) against a full scan, on a local
filesystem and on the S3 server.

    python benchmarks/discovery.py [--sizes 10,1000,10000] [--backends local,s3]
                                   [--repeat 3] [--json PATH] [--dir DIR] [--quick]

For every backend and size N, a root of N real checkpoints of one run is made
(``tests/testbed/roots.py``: one saved by ``CheckpointManager``, the others copies of
it with their own manifests; on S3 put through boto3 into a fresh bucket of a local
moto server, started the way ``tests/testbed`` does). A read-only manager is opened on
it through a storage that counts manifest reads, then, in one run:

- full scan: ``catalog.committed(storage, run_id=...)``, what ``latest()`` and
  ``checkpoints()`` ran before discovery stopped reading the whole root (every
  manifest read, every file's size checked), taking its last entry as the answer;
- ``latest()``: newest first, stopping at the first valid checkpoint;
- ``checkpoints()`` cold (the manager's first listing: every manifest read, as a full
  scan, plus the tokens it keeps) and warm (a later listing, as the rotation after each
  save runs it: no manifest read; locally an ``lstat`` of each manifest and each file,
  on S3 one recursive listing of ROOT).

Then the writable start, as a restarted job opens ROOT (``CheckpointManager(root)``):

- start scan: ``catalog.scan(storage, run_id=..., cache=ManifestCache())``, the
  discovery every writable start ran before it read newest first (every manifest read
  and validated, the cache primed): the "before" figure;
- start walk: ``catalog.newest_valid``, the discovery a start runs now (newest first,
  stopping at the newest valid checkpoint);
- open: the whole writable open (run lock, sweep of abandoned saves, the walk; one
  storage domain), with its manifest reads; "open x" is the estimated open before
  (open - walk + scan) over the open now;
- sweep: what the open's sweep spends finding abandoned saves
  (``strategy.leftovers``, read-only; the marker strategy, on S3, lists every
  checkpoint directory);
- first rotation: a save of the next step with ``KeepLast(N + 1)`` and its retention
  pass (``save`` + ``wait``): retention needs every checkpoint of the run, so the first
  pass after a start reads the manifests the start did not (before, the start's scan
  had read them); timed once, as it changes ROOT.

Every answer is checked against the full scan's. Each time is the best of
``--repeat`` calls (one call for a full scan or cold listing of more than 1,000 S3
checkpoints: each takes minutes on moto). Ratios are full scan / new, from the same run.
``--quick``: sizes 10 and 1000, local only (seconds).
Exit status: 0, or 1 if an answer differed from the full scan's, or ``latest()`` or
a writable open read more than a handful (3) of manifests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402

from atomic_checkpoint import CheckpointManager, KeepLast, catalog  # noqa: E402
from atomic_checkpoint.layout import MANIFEST_NAME  # noqa: E402
from atomic_checkpoint.storage.fsspec import FsspecStorage  # noqa: E402
from atomic_checkpoint.storage.local import LocalStorage  # noqa: E402
from atomic_checkpoint.strategies import choose_strategy  # noqa: E402

_T = TypeVar("_T")
HANDFUL = 3


class _Counting:
    """Counts manifest reads (mixed into the real storage classes)."""

    manifest_reads = 0

    def read_bytes(self, path: str) -> bytes:
        if path.endswith(f"/{MANIFEST_NAME}"):
            self.manifest_reads += 1
        return super().read_bytes(path)  # type: ignore[misc]


class CountingLocal(_Counting, LocalStorage):
    pass


class CountingS3(_Counting, FsspecStorage):
    pass


def timed(storage: _Counting, fn: Callable[[], _T], repeat: int) -> tuple[float, int, _T]:
    """The best time of ``repeat`` calls, the manifest reads of the first, its answer."""
    best, reads, out = float("inf"), -1, None
    for i in range(max(1, repeat)):
        before = storage.manifest_reads
        t = time.perf_counter()
        got = fn()
        best = min(best, time.perf_counter() - t)
        if i == 0:
            reads, out = storage.manifest_reads - before, got
    return best, reads, out  # type: ignore[return-value]


def measure(storage: Any, backend: str, n: int, repeat: int) -> dict[str, Any]:
    mgr = CheckpointManager(storage, read_only=True)
    slow = 1 if backend == "s3" and n > 1000 else repeat
    full_s, full_reads, full = timed(
        storage, lambda: catalog.committed(storage, run_id=mgr.run_id), slow
    )
    latest_s, latest_reads, latest = timed(storage, mgr.latest, repeat)
    cold_s, cold_reads, cold = timed(storage, mgr.checkpoints, 1)  # fills the cache
    warm_s, warm_reads, warm = timed(storage, mgr.checkpoints, repeat)
    run_id = mgr.run_id
    mgr.close()
    steps = [m.step for m in full]
    start = measure_start(storage, run_id, slow, repeat)
    ok = (
        latest is not None
        and latest.step == steps[-1]
        and [c.step for c in cold] == steps
        and [c.step for c in warm] == steps
        and latest_reads <= HANDFUL
        and start.pop("start_newest") == steps[-1]
        and start["open_manifest_reads"] <= HANDFUL
        and start["start_scan_valid"] == len(steps)
    )
    return {
        **start,
        "backend": backend,
        "checkpoints": n,
        "full_scan_s": full_s,
        "full_scan_manifest_reads": full_reads,
        "latest_s": latest_s,
        "latest_manifest_reads": latest_reads,
        "latest_speedup": full_s / latest_s,
        "checkpoints_cold_s": cold_s,
        "checkpoints_cold_manifest_reads": cold_reads,
        "checkpoints_warm_s": warm_s,
        "checkpoints_warm_manifest_reads": warm_reads,
        "checkpoints_warm_speedup": full_s / warm_s,
        "answers_agree": ok,
    }


def measure_start(storage: Any, run_id: str, slow: int, repeat: int) -> dict[str, Any]:
    """A writable start on ROOT: the scan it ran before, the walk it runs now, the whole
    open, then the first rotation after it (see the module docstring)."""
    scan_s, scan_reads, entries = timed(
        storage,
        lambda: catalog.scan(storage, run_id=run_id, cache=catalog.ManifestCache()),
        slow,
    )
    walk_s, walk_reads, walk = timed(
        storage, lambda: catalog.newest_valid(storage, run_id=run_id), repeat
    )

    def open_close() -> int | None:
        mgr = CheckpointManager(storage, storage_domains="shared")
        newest = mgr._newest_step  # the step the start agreed: saves below it are refused
        mgr.close()
        return newest

    open_s, open_reads, newest = timed(storage, open_close, repeat)
    strategy = choose_strategy(storage)
    sweep_s, _, _ = timed(storage, lambda: strategy.leftovers(storage), repeat)
    n = sum(1 for e in entries if e.status == "ok")
    mgr = CheckpointManager(storage, storage_domains="shared", retention=KeepLast(n + 1))
    step = (newest if newest is not None else -1) + 1

    def first_rotation() -> None:
        mgr.save(step, {"w": np.zeros(256, dtype=np.float32)})
        mgr.wait()

    rot_s, rot_reads, _ = timed(storage, first_rotation, 1)
    mgr.close()
    return {
        "start_scan_s": scan_s,
        "start_scan_manifest_reads": scan_reads,
        "start_scan_valid": n,
        "start_walk_s": walk_s,
        "start_walk_manifest_reads": walk_reads,
        "open_s": open_s,
        "open_manifest_reads": open_reads,
        "open_speedup": (open_s - walk_s + scan_s) / open_s,
        "sweep_s": sweep_s,
        "first_rotation_s": rot_s,
        "first_rotation_manifest_reads": rot_reads,
        "start_newest": newest if walk.valid and walk.valid[0].step == newest else None,
    }


@contextlib.contextmanager
def s3_server(scratch: Path) -> Iterator[Any]:
    from tests.testbed import S3Server

    with S3Server(scratch / "moto") as server:
        yield server


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tests.testbed.roots import make_local_root, make_s3_root

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="discovery-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    with contextlib.ExitStack() as stack:
        server = None
        for backend in args.backends:
            for n in args.sizes:
                t = time.perf_counter()
                if backend == "local":
                    root = make_local_root(scratch / f"local-{n}", range(n))
                    storage: Any = CountingLocal(root)
                else:
                    if server is None:
                        server = stack.enter_context(s3_server(scratch))
                    bucket = server.create_bucket(f"discovery-{n}")
                    url = make_s3_root(server, bucket, "run", range(n), threads=args.threads)
                    storage = CountingS3(url, server.storage_options())
                made = time.perf_counter() - t
                print(f"{backend}: {n} checkpoints made in {made:.1f} s", file=sys.stderr)
                row = measure(storage, backend, n, args.repeat)
                row["setup_s"] = made
                rows.append(row)
                print(_row(TABLE, row), file=sys.stderr)
                print(_row(START_TABLE, row), file=sys.stderr)
                if backend == "local":
                    shutil.rmtree(scratch / f"local-{n}", ignore_errors=True)
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


#: The columns of the two tables, by the figure each shows: its header (as wide as it is
#: printed) and the format of its cells.
COLUMNS = {
    "backend": ("store", "{:<5}"),
    "checkpoints": ("ckpts ", "{:>6}"),
    "full_scan_s": ("full scan s", "{:>10.4f}"),
    "full_scan_manifest_reads": ("reads", "{:>6}"),
    "latest_s": ("latest() s", "{:>9.4f}"),
    "latest_manifest_reads": ("reads", "{:>5}"),
    "latest_speedup": ("latest x", "{:>8.0f}x"),
    "checkpoints_cold_s": ("list cold", "{:>9.3f}"),
    "checkpoints_warm_s": ("list warm", "{:>9.4f}"),
    "checkpoints_warm_manifest_reads": ("reads", "{:>5}"),
    "checkpoints_warm_speedup": ("list x", "{:>7.1f}x"),
    "start_scan_s": ("start scan s", "{:>12.4f}"),
    "start_scan_manifest_reads": ("reads", "{:>5}"),
    "start_walk_s": ("start walk s", "{:>12.4f}"),
    "start_walk_manifest_reads": ("reads", "{:>5}"),
    "open_s": ("open s  ", "{:>8.4f}"),
    "open_manifest_reads": ("reads", "{:>5}"),
    "open_speedup": ("open x ", "{:>6.1f}x"),
    "sweep_s": ("sweep s ", "{:>8.4f}"),
    "first_rotation_s": ("1st rot s", "{:>9.3f}"),
    "first_rotation_manifest_reads": ("reads ", "{:>6}"),
    "answers_agree": ("same", "{:<4}"),
}
#: Discovery: the full scan against latest() and checkpoints(), cold and warm.
TABLE = [
    "backend",
    "checkpoints",
    "full_scan_s",
    "full_scan_manifest_reads",
    "latest_s",
    "latest_manifest_reads",
    "latest_speedup",
    "checkpoints_cold_s",
    "checkpoints_warm_s",
    "checkpoints_warm_manifest_reads",
    "checkpoints_warm_speedup",
    "answers_agree",
]
#: The writable start, before and now.
START_TABLE = [
    "backend",
    "checkpoints",
    "start_scan_s",
    "start_scan_manifest_reads",
    "start_walk_s",
    "start_walk_manifest_reads",
    "open_s",
    "open_manifest_reads",
    "open_speedup",
    "sweep_s",
    "first_rotation_s",
    "first_rotation_manifest_reads",
    "answers_agree",
]


def _header(table: list[str]) -> str:
    """A markdown table's header line and the line under it."""
    heads = [COLUMNS[k][0] for k in table]
    rule = "|".join("-" * (len(h) + 2) for h in heads)
    return f"| {' | '.join(heads)} |\n|{rule}|"


def _row(table: list[str], r: dict[str, Any]) -> str:
    """The row of one backend and size: a bool (whether the answers agreed) as yes/NO."""
    cells = [
        COLUMNS[k][1].format(("yes" if r[k] else "NO") if isinstance(r[k], bool) else r[k])
        for k in table
    ]
    return f"| {' | '.join(cells)} |"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="10,1000,10000", help="checkpoint counts (comma-separated)")
    p.add_argument("--backends", default="local,s3", help="local, s3 or both (comma-separated)")
    p.add_argument("--repeat", type=int, default=3, help="calls per figure; the best is kept")
    p.add_argument("--threads", type=int, default=8, help="boto3 threads making an S3 root")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--dir", help="scratch directory for local roots (kept if given)")
    p.add_argument("--quick", action="store_true", help="10 and 1000 checkpoints, local only")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.backends = "10,1000", "local"
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.backends = [b for b in args.backends.split(",") if b]
    for b in args.backends:
        if b not in ("local", "s3"):
            p.error(f"unknown backend {b!r}: local or s3")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    print(_header(TABLE), file=sys.stderr)
    rows = run(args)
    print(
        f"\ndiscovery: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}; times in seconds (best of {args.repeat}; one "
        "call for S3 full scans and cold listings above 1,000)"
    )
    print(_header(TABLE))
    for r in rows:
        print(_row(TABLE, r))
    print("\nwritable start (start scan: before; start walk and open: now)")
    print(_header(START_TABLE))
    for r in rows:
        print(_row(START_TABLE, r))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["answers_agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
