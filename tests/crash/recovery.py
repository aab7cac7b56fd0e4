"""What the crash-state tests of the library's operations share: run one scenario of
``reliability/crashstates.py`` and check that every sampled crash state recovers."""

from __future__ import annotations

import threading
from pathlib import Path

from reliability import crashstates


def every_state_recovers(
    name: str, tmp_path: Path, *, per_cut: int, max_states: int, floor: int
) -> crashstates.ScenarioResult:
    """Run scenario ``name`` and assert that no sampled crash state breaks a guarantee,
    that at least ``floor`` distinct states were explored (a recorder that stopped
    seeing the library's writes cannot pass quietly) and that every crash point was
    cut. Returns the result, for the caller's own checks."""
    # Two forked checkers, unless a thread of another test is still running here (a
    # fork copies locks that thread may hold).
    jobs = 2 if threading.active_count() == 1 else 1
    res = crashstates.run_scenario(
        name, str(tmp_path), per_cut=per_cut, max_states=max_states, jobs=jobs
    )
    ex = res.exploration
    bad = list(ex.violations)
    assert bad == [], "\n".join(str(v) for v in bad[:10])
    assert ex.states >= floor, f"only {ex.states} states explored"
    assert ex.cuts == res.ops + 1
    return res
