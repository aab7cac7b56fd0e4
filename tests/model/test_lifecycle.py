"""The lifecycle model test on three storages (see ``tests/model/lifecycle.py``).

CI runs a fixed, derandomized budget per storage. The long mode runs the same machine
with fresh random seeds until a time budget is spent (20 minutes per storage)::

    python reliability/run.py --campaign lifecycle --full
    LIFECYCLE_SECONDS=300 python reliability/run.py --campaign lifecycle --full

Here, ``LIFECYCLE_EXAMPLES`` sets the sequences per storage (default 25) and
``LIFECYCLE_SEED`` replaces the fixed seed by a given one. A failure prints the shrunk
sequence of rules; it becomes a plain test in ``test_lifecycle_regressions.py``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import seed

from atomic_checkpoint import CheckpointManager

from . import lifecycle

EXAMPLES = int(os.environ.get("LIFECYCLE_EXAMPLES", "25"))
SEED = os.environ.get("LIFECYCLE_SEED")
#: Rules the fixed budget must exercise on every storage: a model that silently stopped
#: driving one of them would pass with nothing tested.
MUST_RUN = {"save", "save_async", "restore", "rollback", "close", "reopen", "kill", "corrupt"}


@pytest.mark.parametrize("kind", list(lifecycle.MACHINES))
def test_lifecycle_model(kind: str) -> None:
    # rollback() is part of the contract the model checks (a save below the newest step
    # is refused; rollback() is the way back): its absence is a failure, not a skip.
    assert hasattr(CheckpointManager, "rollback"), "CheckpointManager.rollback is missing"
    machine = lifecycle.MACHINES[kind]
    if SEED is not None:
        machine = seed(int(SEED))(type(f"{machine.__name__}Seeded", (machine,), {}))
    before = dict(lifecycle.STATS)
    del lifecycle.VIOLATIONS_SEEN[:]
    try:
        lifecycle.run_machine(
            machine, examples=EXAMPLES, steps=30, derandomize=SEED is None, print_blob=True
        )
    except Exception as exc:
        if lifecycle.harness_only(exc):
            return  # every sequence run held the invariants (see harness_only)
        # A failure that depends on timing does not replay: Hypothesis then reports only
        # that it was flaky. The first violation, with the rules that led to it, says what.
        if lifecycle.VIOLATIONS_SEEN and lifecycle.VIOLATIONS_SEEN[0] not in str(exc):
            raise AssertionError(
                f"{type(exc).__name__}: {exc}\nfirst violation seen:\n"
                + lifecycle.VIOLATIONS_SEEN[0]
            ) from exc
        raise
    ran = {
        k[5:] for k, v in lifecycle.STATS.items() if k.startswith("rule:") and v > before.get(k, 0)
    }
    assert ran >= MUST_RUN, f"rules never exercised: {sorted(MUST_RUN - ran)}"
