"""Same-run comparison of two versions of the library: save throughput and commit overhead.

A change that restructures the commit path must not make saves slower. This script
measures the version in this checkout ("head") and an earlier commit ("base", extracted
with ``git archive`` into a scratch directory) in ONE run, on the same machine, in
alternating order (base, head, head, base, ...), each round in a fresh process whose
``PYTHONPATH`` selects the version. It prints the medians and the head/base ratios:

* ``save``: seconds per synchronous ``CheckpointManager.save`` of a flat, transformer-like
  state of ``--size`` bytes (one process; the first save of each round is not counted);
* ``overhead``: the slowest rank's time in ``save()`` less the write and fsync of its
  data, over ``--ranks`` real processes in a gloo group, each saving a tiny state;
* ``calls``: Python function calls per save of a tiny state in one process (counted by
  ``cProfile``): the CPU work of the commit path, which does not vary with the load of
  the machine the way times do. With more ranks than cores, the overhead is CPU-bound.

Example (the figure issue 13 asks for; about 5 minutes on 2 cores)::

    python benchmarks/compare.py --base 9021ab4 --size 1G --rounds 4

Exit status: 0, or 1 if a round failed. The ratios are reported, not judged: a
benchmark prints what it measured (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _child(size: int, saves: int, ranks: int, scratch: str) -> dict[str, Any]:
    """One round in this process, with whichever version PYTHONPATH selected."""
    from benchmarks._bench import model_state, settle
    from benchmarks._ranks import commit_overhead

    import atomic_checkpoint
    from atomic_checkpoint import CheckpointManager, KeepLast

    state = model_state(size)
    times = []
    with CheckpointManager(os.path.join(scratch, "save"), retention=KeepLast(1)) as mgr:
        for step in range(saves + 1):
            settle()
            t = time.perf_counter()
            mgr.save(step, state)
            if step:
                times.append(time.perf_counter() - t)
    over = commit_overhead(ranks, os.path.join(scratch, "ranks"), saves=10)
    if not over["verified"]:
        raise RuntimeError("a rank's tiny checkpoint did not read back")
    return {
        "module": atomic_checkpoint.__file__,
        "save_s": statistics.median(times),
        "overhead_s": over["overhead_s"],
        "calls": _calls_per_save(os.path.join(scratch, "calls")),
    }


def _calls_per_save(root: str, saves: int = 50) -> float:
    """Python function calls per save of a tiny state, one process, after warm-up."""
    import cProfile
    import pstats

    import torch

    from atomic_checkpoint import CheckpointManager, KeepLast

    state = {"w": torch.zeros(16)}
    with CheckpointManager(root, retention=KeepLast(2)) as mgr:
        for step in range(3):
            mgr.save(step, state)
        profile = cProfile.Profile()
        profile.enable()
        for step in range(3, 3 + saves):
            mgr.save(step, state)
        profile.disable()
    return float(pstats.Stats(profile).total_calls) / saves  # type: ignore[attr-defined]


def _extract(rev: str, into: str) -> str:
    """``rev``'s src/ tree under ``into``; returns the directory to put on PYTHONPATH."""
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", rev, "src"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "src")


def _round(src: str, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, REPO]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--size", str(args.size)]
    cmd += ["--saves", str(args.saves), "--ranks", str(args.ranks), "--dir", scratch]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"round with {src} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # The editable install must not shadow the version under test.
    if not result["module"].startswith(src):
        raise RuntimeError(f"round meant for {src} imported {result['module']}")
    return result


def _parse_size(text: str) -> int:
    from benchmarks._bench import parse_size

    return parse_size(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="9021ab4", help="the earlier commit (default 9021ab4)")
    p.add_argument("--size", type=_parse_size, default=_parse_size("1G"), help="state size")
    p.add_argument("--rounds", type=int, default=4, help="rounds per version (default 4)")
    p.add_argument("--saves", type=int, default=3, help="timed saves per round (default 3)")
    p.add_argument("--ranks", type=int, default=4, help="processes for the overhead figure")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per round")
    p.add_argument("--json", help="write the raw figures here")
    p.add_argument("--dir", help="scratch directory")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.size, args.saves, args.ranks, args.dir)), flush=True)
        return 0

    with tempfile.TemporaryDirectory(prefix="compare-", dir=args.dir) as tmp:
        versions = {"base": _extract(args.base, tmp), "head": os.path.join(REPO, "src")}
        figures: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
        # ABBA order: a drift of the machine over the run falls on both versions alike.
        order = [("base", "head") if i % 2 == 0 else ("head", "base") for i in range(args.rounds)]
        started = time.perf_counter()
        for i, pair in enumerate(order, 1):
            for name in pair:
                scratch = tempfile.mkdtemp(prefix=f"{name}-", dir=tmp)
                figures[name].append(_round(versions[name], args, scratch))
                print(
                    f"round {i}/{args.rounds} {name}: save {figures[name][-1]['save_s']:.3f} s, "
                    f"overhead {figures[name][-1]['overhead_s'] * 1e3:.1f} ms, "
                    f"{figures[name][-1]['calls']:.0f} calls per save "
                    f"({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    print(f"base {args.base} vs head, {args.size / 2**30:g} GiB flat state, {args.ranks} ranks")
    print("| figure | base (median) | head (median) | head/base |")
    print("|---|---|---|---|")
    summary = {}
    for key, label, scale, unit, digits in (
        ("save_s", "sync save", 1.0, "s", 3),
        ("overhead_s", "commit overhead, slowest rank", 1e3, "ms", 3),
        ("calls", "Python calls per tiny save", 1.0, "", 0),
    ):
        base = statistics.median(f[key] for f in figures["base"])
        head = statistics.median(f[key] for f in figures["head"])
        summary[key] = head / base
        cells = (
            f"{base * scale:.{digits}f} {unit}".rstrip(),
            f"{head * scale:.{digits}f} {unit}".rstrip(),
            f"{head / base:.3f}",
        )
        print(f"| {label} | " + " | ".join(cells) + " |")
    mib_s = {
        n: args.size / statistics.median(f["save_s"] for f in figures[n]) / 2**20 for n in figures
    }
    print(f"save throughput: base {mib_s['base']:.0f} MiB/s, head {mib_s['head']:.0f} MiB/s")
    # Each round's pair (base and head run back to back): the median of their ratios is
    # what a drift of the machine over the run (page cache, memory) moves least.
    for key, label in (("save_s", "sync save"), ("overhead_s", "commit overhead")):
        pairs = [h[key] / b[key] for b, h in zip(figures["base"], figures["head"], strict=True)]
        summary[f"paired_{key}"] = statistics.median(pairs)
        print(f"{label}, median of the rounds' head/base: {statistics.median(pairs):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": args.base, "figures": figures, "ratios": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
