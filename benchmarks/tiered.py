"""Tiered checkpoints: how long a save blocks training, and how long a restore takes,
from the fast tier and from the persistent tier (a local S3 server).

    python benchmarks/tiered.py [--size 256M] [--rounds 5] [--interval 2]
                                [--dir DIR] [--json PATH]

One run, interleaved, medians:

- blocked: the time ``save()`` takes on a ``TieredCheckpointManager`` (tier 0 a local
  directory under ``--dir``, tier 1 ``s3://`` on a moto server started here on
  127.0.0.1) against a plain ``CheckpointManager`` on a sibling directory of the same
  filesystem. Each round saves with both (in alternating order), each save followed by
  ``--interval`` s of sleep (training): replication runs in the background meanwhile,
  as it would during training; the table says how many tiered saves met a replication
  still in flight.
  Neither local root has a retention policy, so no delete is timed on either side.
  Target: tiered / plain <= 1.05.
- restore: ``restore()`` of the newest step by a ``TieredCheckpointManager`` whose tier 0
  holds it (a process restart), against one whose tier 0 is empty (a replaced node:
  it loads from S3). Both verify every byte; both are compared with the saved state.

Exit status 0, or 1 when a restored state differs from the saved one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402

from atomic_checkpoint import (  # noqa: E402
    CheckpointManager,
    KeepLast,
    Tier,
    TieredCheckpointManager,
)

MiB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def make_state(size: int, step: int) -> dict[str, Any]:
    """``size`` bytes of float32 in 16 arrays, different for each step."""
    n = max(1, size // 4 // 16)
    rng = np.random.default_rng(step)
    base = rng.standard_normal(n).astype(np.float32)
    return {"step": step, "layers": {f"w{i}": base + np.float32(i) for i in range(16)}}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(
        a["layers"][k].tobytes() == b["layers"][k].tobytes() for k in b["layers"]
    )


def timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M", help="state size (K/M/G binary units)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds of 'training'")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write every raw figure here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    size = parse_size(args.size)

    from tests.testbed import S3Server

    scratch = Path(tempfile.mkdtemp(prefix="bench-tiered-", dir=args.dir))
    try:
        with S3Server(scratch / "moto") as s3:
            bucket = s3.create_bucket("bench-tiered")
            url = f"s3://{bucket}/run"
            opts = s3.storage_options()

            # No retention on the local roots: a delete on the training thread's path
            # (the next save joins the previous rotation) would be timed for whichever
            # root deletes, and tier 0 deletes less often (it holds unreplicated steps).
            def tiers(fast: Path) -> list[Tier]:
                return [Tier(fast), Tier(url, retention=KeepLast(2), storage_options=opts)]

            plain = CheckpointManager(scratch / "plain")
            tiered = TieredCheckpointManager(tiers(scratch / "fast"))
            states = {s: make_state(size, s) for s in range(1, args.rounds + 2)}
            # Warm-up (first-touch costs, the S3 client's connections), not timed.
            plain.save(0, make_state(size, 0))
            tiered.save(0, make_state(size, 0))
            tiered.wait_replicated(timeout_s=600)
            blocked_tiered, blocked_plain, in_flight = [], [], 0
            for s in range(1, args.rounds + 1):
                # ABBA: every other round the plain save goes first, so neither side
                # always follows the other's writes.
                order = ("tiered", "plain") if s % 2 else ("plain", "tiered")
                for which in order:
                    if which == "tiered":
                        in_flight += bool(tiered.replication_backlog())
                        dt, _ = timed(lambda s=s: tiered.save(s, states[s]))
                        blocked_tiered.append(dt)
                    else:
                        dt, _ = timed(lambda s=s: plain.save(s, states[s]))
                        blocked_plain.append(dt)
                    time.sleep(args.interval)
            t_drain, drained = timed(lambda: tiered.wait_replicated(timeout_s=600))
            newest = args.rounds
            plain.close()
            tiered.close()

            ok = drained
            restore_fast, restore_slow = [], []
            for r in range(args.rounds):
                mgr = TieredCheckpointManager(tiers(scratch / "fast"))
                dt, state = timed(mgr.restore)
                ok &= same(state, states[newest]) and mgr.last_restored.tiers == (0,)
                restore_fast.append(dt)
                mgr.close()
                wiped = scratch / f"wiped-{r}"
                mgr = TieredCheckpointManager(tiers(wiped))
                dt, state = timed(mgr.restore)
                ok &= same(state, states[newest]) and mgr.last_restored.tiers == (1,)
                restore_slow.append(dt)
                mgr.close()
                shutil.rmtree(wiped, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = statistics.median
    rows = [
        ("save, plain CheckpointManager (local)", med(blocked_plain)),
        ("save, TieredCheckpointManager (blocks training)", med(blocked_tiered)),
        ("  ratio tiered / plain (target <= 1.05)", med(blocked_tiered) / med(blocked_plain)),
        ("restore from tier 0 (local, verified)", med(restore_fast)),
        ("restore from tier 1 (S3 server, verified)", med(restore_slow)),
        ("  ratio tier 1 / tier 0", med(restore_slow) / med(restore_fast)),
    ]
    print(f"\n{size / MiB:.0f} MiB state, {args.rounds} rounds, medians (seconds)")
    print("| figure | value |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.3f} |")
    print(
        f"tiered saves that met a replication in flight: {in_flight}/{args.rounds}; "
        f"drain after the last save: {t_drain:.2f} s; restored states bit-exact: {ok}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "size_bytes": size,
                    "rounds": args.rounds,
                    "interval_s": args.interval,
                    "blocked_plain_s": blocked_plain,
                    "blocked_tiered_s": blocked_tiered,
                    "restore_tier0_s": restore_fast,
                    "restore_tier1_s": restore_slow,
                    "in_flight": in_flight,
                    "drain_s": t_drain,
                    "bit_exact": ok,
                    "cpus": os.cpu_count(),
                },
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
