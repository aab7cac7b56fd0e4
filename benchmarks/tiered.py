"""Tiered checkpoints: how long a save blocks training, and how long a restore takes,
from the fast tier and from the persistent tier (a local S3 server).

    python benchmarks/tiered.py [--size 256M] [--rounds 5] [--interval 2]
                                [--dir DIR] [--json PATH]
    python benchmarks/tiered.py --ranks N [--peers K] [--size 256M] [--rounds 3]
                                [--dir DIR] [--json PATH] [--plot PATH]

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

With ``--ranks N`` (N > 1): a real N-rank gloo job (``tests/dist/launcher.py``), each
rank its own "node" with its own tier 0 directory, tier 1 on the S3 server, ``--size``
per rank. One save (how long it blocks, how long until tier 1 has every rank's files),
then ``restore()`` by a new job after (a) a process crash (every node's tier 0 intact),
(b) node 1's tier 0 wiped (its ranks read from S3), (c) every tier 0 lost (all from
S3); the slowest rank's time, each compared with the saved state. Against them, first,
the same job saving directly to the persistent tier (a plain ``CheckpointManager`` on
S3): how long its save blocks, how long its restore takes. With ``--peers K``
(default 1; 0 skips it), a second job saves with ``peers=K`` and node 1's tier 0 is
wiped before each of ``--rounds`` pairs of restores, alternating: one with ``peers=K``
(node 1's files come from a peer over gloo, verified) and one without (node 1 reads
from S3): the peer restore against the persistent-tier restore, in one run. Target:
S3 / peers >= 3. Both restores pay the same fixed costs (the ranks' agreement, the
first touch of the state's memory in a new process), so the ratio grows with
``--size``: on 2 cores it passes 3 from 512M per rank (the README has the figures).
``--json PATH`` keeps every figure; ``--plot PATH`` draws them (a PNG, two panels:
the save's blocking time, the restores).

Exit status 0, or 1 when a restored state differs from the saved one.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

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
    ap.add_argument("--plot", default=None, help="--ranks N: draw the figures to this PNG")
    ap.add_argument("--ranks", type=int, default=1, help="N > 1: a multi-rank gloo job")
    ap.add_argument("--peers", type=int, default=1, help="--ranks N: peer copies (0: skip)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    size = parse_size(args.size)
    if args.ranks > 1:
        return multi_rank(args, size)

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


class Row(NamedTuple):
    key: str  # the JSON name
    text: str  # the table's
    value: float


def slowest(values: list[dict[str, Any]], key: str) -> float:
    """The slowest rank's figure ``key`` (every rank's figures from one job)."""
    return max(v[key] for v in values)


def peer_rows(args: argparse.Namespace, nodes: str, job: Any) -> tuple[list[Row], bool]:
    """Node 1 wiped: restore from a peer's copy (``peers=K``) against restore from S3
    (``peers=0``), alternating, ``--rounds`` pairs; medians of the slowest rank."""
    ok = True
    shutil.rmtree(nodes, ignore_errors=True)
    saved = job("save", args.peers)
    from_peer: list[float] = []
    from_s3: list[float] = []
    for _ in range(max(1, args.rounds)):
        for peers, into in ((args.peers, from_peer), (0, from_s3)):
            shutil.rmtree(Path(nodes) / "node1")  # its own peer copies and fetched files too
            got = job("restore", peers)
            into.append(slowest(got, "restore_s"))
            want = (1,) if peers else ()
            ok &= all(v["from_peers"] == want for v in got)
            ok &= all(v["tiers"] == ((0,) if peers else (0, 1)) for v in got)
    p, s = statistics.median(from_peer), statistics.median(from_s3)
    rows = [
        Row(
            "peer_blocked_s",
            f"save blocks training, peers={args.peers} (slowest rank)",
            slowest(saved, "blocked_s"),
        ),
        Row(
            "peer_held_s",
            f"save until {args.peers} peer(s) hold every node's files (slowest rank)",
            slowest(saved, "peered_s"),
        ),
        Row(
            "restore_wiped_peer_s",
            f"restore, node 1 wiped: from a peer (median of {len(from_peer)})",
            p,
        ),
        Row("restore_wiped_s3_s", f"restore, node 1 wiped: from S3 (median of {len(from_s3)})", s),
        Row("ratio_s3_over_peer", "  ratio S3 / peer (target >= 3)", s / p),
    ]
    return rows, ok


def multi_rank(args: argparse.Namespace, size: int) -> int:
    from tests.dist.launcher import run_ranks
    from tests.testbed import S3Server
    from tests.tiered import workers

    scratch = Path(tempfile.mkdtemp(prefix="bench-tiered-", dir=args.dir))
    rows: list[Row] = []
    ok = True
    try:
        with S3Server(scratch / "moto") as s3:
            bucket = s3.create_bucket("bench-tiered")
            url, direct_url = f"s3://{bucket}/run", f"s3://{bucket}/direct"
            # The peer rows' job: a run of its own (its nodes are wiped and it saves step
            # 1 again, which the first run's persistent tier, holding step 1, refuses).
            peers_url = f"s3://{bucket}/peers"
            opts = s3.storage_options()
            nodes = str(scratch / "nodes")

            def job(mode: str, peers: int = 0, root: str | None = None) -> list[dict[str, Any]]:
                nonlocal ok
                res = run_ranks(
                    workers.w_bench,
                    args.ranks,
                    nodes,
                    root or (direct_url if mode.startswith("direct-") else url),
                    opts,
                    size,
                    mode,
                    peers,
                    tmp_dir=str(scratch),
                    timeout_s=1200,
                )
                bad = [r for r in res if not r.ok]
                if bad:
                    raise RuntimeError(f"rank {bad[0].rank}: {bad[0].error_text}")
                ok &= all(r.value["ok"] for r in res)
                return [r.value for r in res]

            # The same job saving directly to the persistent tier, first (a cold S3
            # server favours neither side: the tiered job's replication warms it too).
            direct_blocked = slowest(job("direct-save"), "blocked_s")
            direct_restore = slowest(job("direct-restore"), "restore_s")
            saved = job("save")
            blocked = slowest(saved, "blocked_s")
            rows += [
                Row("tiered_blocked_s", "save blocks training, tiered (slowest rank)", blocked),
                Row(
                    "tiered_replicated_s",
                    "save until tier 1 has every rank",
                    slowest(saved, "replicated_s"),
                ),
                Row("direct_blocked_s", "save blocks training, directly to S3", direct_blocked),
                Row(
                    "ratio_direct_over_tiered_save",
                    "  ratio direct / tiered",
                    direct_blocked / blocked,
                ),
            ]
            crash = job("restore")
            ok &= all(v["tiers"] == (0,) for v in crash)
            shutil.rmtree(Path(nodes) / "node1")
            wiped = job("restore")
            ok &= all(v["tiers"] == (0, 1) for v in wiped)
            shutil.rmtree(nodes)
            lost = job("restore")
            ok &= all(v["tiers"] == (1,) for v in lost)
            a, b, c = (slowest(r, "restore_s") for r in (crash, wiped, lost))
            rows += [
                Row("restore_crash_s", "restore (a) process crash: every rank from tier 0", a),
                Row("restore_wiped_s", "restore (b) node 1 wiped: its rank from S3", b),
                Row("restore_lost_s", "restore (c) every tier 0 lost: all from S3", c),
                Row(
                    "restore_direct_s", "restore, the job that saved directly to S3", direct_restore
                ),
                Row("ratio_direct_over_crash", "  ratio direct / (a)", direct_restore / a),
                Row("ratio_direct_over_wiped", "  ratio direct / (b)", direct_restore / b),
                Row("ratio_direct_over_lost", "  ratio direct / (c)", direct_restore / c),
            ]
            if args.peers:
                more, peer_ok = peer_rows(args, nodes, functools.partial(job, root=peers_url))
                rows += more
                ok &= peer_ok
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{args.ranks} ranks, {size / MiB:.0f} MiB per rank, seconds (slowest rank)")
    print("| figure | value |\n|---|---|")
    for row in rows:
        print(f"| {row.text} | {row.value:.3f} |")
    print(f"restored states bit-exact on every rank, from the expected tiers: {ok}")
    doc = {
        "ranks": args.ranks,
        "size_bytes_per_rank": size,
        "rounds": args.rounds,
        "peers": args.peers,
        "cpus": os.cpu_count(),
        "bit_exact": ok,
        "figures": {row.key: row.value for row in rows},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)
        print(f"plot: {args.plot}")
    return 0 if ok else 1


def plot(doc: dict[str, Any], path: str) -> None:
    """Two panels from one run: how long a save blocks training, and how long a restore
    takes, each bar a median or a slowest rank's time (``--json`` has every figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = doc["figures"]
    saves = [
        ("tiered", f["tiered_blocked_s"]),
        ("directly\nto S3", f["direct_blocked_s"]),
    ]
    restores = [
        ("(a) crash:\ntier 0", f["restore_crash_s"]),
        ("(b) node\nwiped: S3", f["restore_wiped_s"]),
        ("(c) tier 0s\nlost: S3", f["restore_lost_s"]),
        ("saved\ndirectly\nto S3", f["restore_direct_s"]),
    ]
    if "restore_wiped_peer_s" in f:
        # The paired medians of the peer measurement, S3 and peer side by side.
        restores[1] = ("(b) node\nwiped: S3", f["restore_wiped_s3_s"])
        restores.insert(2, ("(b) node\nwiped: peer", f["restore_wiped_peer_s"]))
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [len(saves), len(restores)]}
    )
    for ax, bars, title in (
        (left, saves, "save: time training is blocked"),
        (right, restores, "restore after a failure"),
    ):
        names = [n for n, _ in bars]
        values = [v for _, v in bars]
        shown = ax.bar(
            names, values, color=["tab:green" if "S3" not in n else "tab:gray" for n in names]
        )
        ax.bar_label(shown, fmt="%.2f s", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("seconds (slowest rank)")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"tiered checkpoints: {doc['ranks']} ranks, "
        f"{doc['size_bytes_per_rank'] / MiB:.0f} MiB per rank, S3 server on loopback",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
