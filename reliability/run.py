"""Run the fault campaigns and print what they found.

    python reliability/run.py --quick                 # minutes: what CI runs
    python reliability/run.py --full --json out.json  # the large mode, with figures
    python reliability/run.py --campaign kill-local --campaign libfiu --seed 7

Exit status 1 if any campaign saw a violation (torn, lost, hangs, unclear, leaks,
split, stuck, unsafe: see ``reliability.tally.VIOLATIONS``), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

if __package__ in (None, ""):  # run by its path: make the repository importable
    import _repo_on_path  # noqa: F401  (reliability/_repo_on_path.py)

from reliability.tally import (
    PRINTED_DETAILS,
    VIOLATIONS,
    Progress,
    Tally,
    figures,
    table,
    write_json,
)

Campaign = Callable[[str, int, Progress, str], Tally]


def _campaign(module: str, **options: str) -> Campaign:
    """``reliability.<module>.run`` with ``options``; the module is imported only when
    the campaign runs (campaigns pull in torch, the test bed and their services)."""

    def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
        campaign = importlib.import_module(f"reliability.{module}")
        return campaign.run(size, seed, progress, workdir, **options)

    return run


CAMPAIGNS: dict[str, Campaign] = {
    "kill-local": _campaign("kill", fs="local"),
    "kill-sshfs": _campaign("kill", fs="sshfs"),
    "kill-s3": _campaign("kill", fs="s3"),
    "kill-s3fs": _campaign("kill", fs="s3fs"),
    "libfiu": _campaign("iofaults"),
    "libfiu-s3fs": _campaign("iofaults", fs="s3fs"),
    "disk-full": _campaign("diskfull"),
    "hang": _campaign("hang"),
    "bad-input": _campaign("badinput"),
    "crash-states": _campaign("crashstates"),
    "s3-faults": _campaign("s3faults"),
    "lifecycle": _campaign("lifecycle"),
    "preemption": _campaign("preemption"),
    "tiered": _campaign("tiered"),
}


def run_campaigns(
    names: list[str], size: str, seed: int, progress: Progress, workdir: str | None = None
) -> list[Tally]:
    """Run ``names`` in order; a campaign that crashes counts as one ``stuck``."""
    own = workdir is None
    base = workdir or tempfile.mkdtemp(prefix="ac-reliability-")
    tallies = []
    try:
        for i, name in enumerate(names):
            progress(f"[{i + 1}/{len(names)}] {name} ({size}) ...")
            t = time.monotonic()
            try:
                tally = CAMPAIGNS[name](size, seed + i, progress, base)
            except Exception as exc:
                import traceback

                tally = Tally(name)
                tally.violate("stuck", f"the campaign itself failed: {type(exc).__name__}: {exc}")
                tally.stats["traceback"] = traceback.format_exc()
                tally.elapsed_s = time.monotonic() - t
            progress(
                f"[{i + 1}/{len(names)}] {name}: {tally.trials} trials, {tally.faults} faults, "
                f"{tally.violations} violations in {tally.elapsed_s:.1f} s"
            )
            tallies.append(tally)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fault campaigns for atomic-checkpoint: kills, libfiu I/O errors, full "
        "disks, hung ranks and bad checkpoints, with the invariants checked after "
        "every trial."
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="size", const="quick")
    mode.add_argument("--full", action="store_const", dest="size", const="full")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--campaign",
        action="append",
        choices=sorted(CAMPAIGNS),
        help="run only this campaign (repeatable; default: all)",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    parser.add_argument(
        "--verbose", action="store_true", help="show the library's log lines of the checks"
    )
    args = parser.parse_args(argv)
    # The checks start managers that log what they clean up and take over; those lines
    # are expected here, so they are shown only on request.
    lib_log = logging.getLogger("atomic_checkpoint")
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="      %(levelname)s %(message)s")
    else:
        lib_log.addHandler(logging.NullHandler())
        lib_log.propagate = False
    size = args.size or "quick"
    names = args.campaign or list(CAMPAIGNS)
    t0 = time.monotonic()

    def progress(line: str) -> None:
        print(f"{time.monotonic() - t0:7.1f}s  {line}", flush=True)

    tallies = run_campaigns(names, size, args.seed, progress, args.workdir)
    total = time.monotonic() - t0
    print()
    print(table(tallies, total))
    print()
    print("figures:")
    print(figures(tallies))
    bad = [t for t in tallies if t.violations]
    for t in bad:
        for line in t.details[:PRINTED_DETAILS]:
            print(line)
        if len(t.details) > PRINTED_DETAILS:
            print(f"... {t.violations - PRINTED_DETAILS} more for {t.name} (see --json)")
    if args.json:
        write_json(args.json, tallies, total, ["python", "reliability/run.py", *sys.argv[1:]])
    print()
    if bad:
        print(f"VIOLATIONS in {', '.join(t.name for t in bad)}")
        return 1
    print(f"all {len(tallies)} campaign(s) clean: " + ", ".join(f"0 {k}" for k in VIOLATIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
