"""Lifecycle campaign: the lifecycle model test (``tests/model/lifecycle.py``) run with
fresh random seeds for a time budget, on the three storages it knows (local with
``RENAME_EXCHANGE``, the rename strategy without exchange, the marker strategy).

Each trial is one random sequence of saves, async saves, overwrites, restores,
rollbacks, retention changes, closes (also while an async save is slow), reopens, lock
takeovers by a restarted job, saves SIGKILLed at a fault point, corrupted files and
copied roots, checked against the reference model after every step (trials: the
sequences; faults: the kills that landed and the corruptions). A failure is shrunk
by Hypothesis to a short sequence of rules, recorded in the details; replay it as a
test in ``tests/model/test_lifecycle_regressions.py``.

    python reliability/run.py --campaign lifecycle --full     # an hour (20 min a storage)
    LIFECYCLE_SECONDS=600 python reliability/run.py --campaign lifecycle --full
"""

from __future__ import annotations

import os
import shutil

from .tally import Progress, Tally

#: Seconds per storage kind (``LIFECYCLE_SECONDS`` overrides); the quick size is a
#: smoke run, CI's fixed budget is ``tests/model/test_lifecycle.py``.
SIZES = {"quick": 6.0, "full": 1200.0}


def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    from tests.model import lifecycle

    tally = Tally("lifecycle")
    seconds = float(os.environ.get("LIFECYCLE_SECONDS", SIZES[size]))
    base = os.path.join(workdir, "lifecycle")
    os.makedirs(base, exist_ok=True)
    lifecycle.WORKDIR = base
    try:
        for i, kind in enumerate(lifecycle.KINDS_ORDER):
            res = lifecycle.explore(kind, seconds, seed * 1000 + i * 100)
            tally.trials += res["sequences"]
            tally.faults += sum(res["kills"].values()) + sum(res["corruptions"].values())
            tally.count("steps", kind, res["steps"])
            tally.count("replays diverged (not failures)", kind, res["replays_diverged"])
            for rule_name, n in res["rules"].items():
                tally.count("rules", rule_name, n)
            for phase, n in res["kills"].items():
                tally.count("kills", phase, n)
            for how, n in res["corruptions"].items():
                tally.count("corruptions", how, n)
            for text in res["failures"]:
                tally.violate(lifecycle.classify(text), f"{kind}: {text}")
            progress(
                f"lifecycle {kind}: {res['sequences']} sequences, {res['steps']} steps, "
                f"{len(res['failures'])} failures"
            )
    finally:
        lifecycle.WORKDIR = None
        shutil.rmtree(base, ignore_errors=True)
    return tally.finish()
