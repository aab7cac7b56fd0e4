"""What a campaign counts, and the summary table a user reads."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: Violation counters; every one of them must be 0.
VIOLATIONS: dict[str, str] = {
    "torn": "a discoverable checkpoint that is incomplete or does not restore bit-exactly",
    "lost": "a checkpoint committed before the fault is gone or unreadable",
    "hangs": "a rank that neither returned nor raised within its bound",
    "unclear": "an error that does not say what failed (type, rank, phase, path, errno)",
    "leaks": "pending or trash data that outlived the next start",
    "split": "ranks disagree: a rank reported success for a commit that failed, or the reverse",
    "stuck": "the next save or start after the fault cleared did not succeed",
    "unsafe": "code from a checkpoint ran, or a file outside the checkpoint was read",
}

#: How many violation details each campaign keeps (the JSON has them all, the printed
#: summary the first PRINTED_DETAILS).
MAX_DETAILS = 200
PRINTED_DETAILS = 25

Progress = Callable[[str], None]


@dataclass
class Tally:
    """The counts of one campaign.

    Attributes:
        name: campaign name (``kill-local``, ``libfiu``, ...).
        trials: trials run.
        faults: faults that actually hit the library (a kill that landed on a live rank
            in the middle of its work, a libfiu point that fired, a disk that filled).
        counts: violation counters (keys of :data:`VIOLATIONS`).
        details: the first violations, as text.
        stats: campaign-specific figures (where kills landed, errors seen, ...).
        elapsed_s: wall time of the campaign.
    """

    name: str
    trials: int = 0
    faults: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def violate(self, kind: str, detail: str) -> None:
        """Record one violation of ``kind`` (a key of :data:`VIOLATIONS`)."""
        if kind not in VIOLATIONS:
            raise ValueError(f"unknown violation kind {kind!r}")
        self.counts[kind] += 1
        if len(self.details) < MAX_DETAILS:
            self.details.append(f"[{self.name} trial {self.trials}] {kind}: {detail}")

    def count(self, stat: str, key: str, n: int = 1) -> None:
        """Add ``n`` to histogram ``stat`` under ``key`` (e.g. where a kill landed)."""
        hist = self.stats.setdefault(stat, {})
        hist[key] = hist.get(key, 0) + n

    def finish(self) -> Tally:
        self.elapsed_s = time.monotonic() - self._t0
        return self

    @property
    def violations(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"trials": self.trials, "faults": self.faults}
        doc.update({k: self.counts.get(k, 0) for k in VIOLATIONS})
        doc["elapsed_s"] = round(self.elapsed_s, 2)
        doc["stats"] = self.stats
        doc["details"] = self.details
        return doc


def table(tallies: Iterable[Tally], total_s: float) -> str:
    """The summary: one row per campaign, totals, every violation column."""
    rows = list(tallies)
    cols = ["trials", "faults", *VIOLATIONS]
    name_w = max([len("campaign"), len("total"), *(len(t.name) for t in rows)])
    head = f"{'campaign':<{name_w}}  " + "  ".join(f"{c:>7}" for c in cols) + "  time_s"
    lines = [head, "-" * len(head)]

    def row(name: str, values: list[int], secs: float) -> str:
        return f"{name:<{name_w}}  " + "  ".join(f"{v:>7}" for v in values) + f"  {secs:>6.1f}"

    for t in rows:
        vals = [t.trials, t.faults, *(t.counts.get(k, 0) for k in VIOLATIONS)]
        lines.append(row(t.name, vals, t.elapsed_s))
    lines.append("-" * len(head))
    totals = [sum(t.trials for t in rows), sum(t.faults for t in rows)]
    totals += [sum(t.counts.get(k, 0) for t in rows) for k in VIOLATIONS]
    lines.append(row("total", totals, total_s))
    return "\n".join(lines)


def figures(tallies: Iterable[Tally], max_keys: int = 12) -> str:
    """The campaigns' figures: small histograms in full, number lists as
    min / median / max, large histograms as their size."""
    lines = []
    for t in tallies:
        for name, value in t.stats.items():
            if (
                isinstance(value, dict)
                and value
                and all(isinstance(v, (int, float)) for v in value.values())
            ):
                if len(value) <= max_keys:
                    body = ", ".join(f"{k}: {v}" for k, v in sorted(value.items(), key=str))
                else:
                    body = f"{len(value)} kinds, {sum(value.values())} in all (see --json)"
            elif isinstance(value, dict) and value:
                body = ", ".join(f"{k}: {v}" for k, v in value.items())
            elif (
                isinstance(value, list)
                and value
                and all(isinstance(v, (int, float)) for v in value)
            ):
                ordered = sorted(value)
                body = (
                    f"n={len(ordered)} min {ordered[0]:g} median "
                    f"{ordered[len(ordered) // 2]:g} max {ordered[-1]:g}"
                )
            elif isinstance(value, (int, float, str)):
                body = str(value)
            else:
                continue
            lines.append(f"  {t.name:<11} {name}: {body}")
    return "\n".join(lines)


def write_json(path: str, tallies: Iterable[Tally], total_s: float, argv: list[str]) -> None:
    """``{"campaigns": {name: {...}}, "total_s": ..., "command": ...}``."""
    doc = {
        "campaigns": {t.name: t.to_json() for t in tallies},
        "total_s": round(total_s, 2),
        "command": " ".join(argv),
        "violation_kinds": VIOLATIONS,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
