"""Power loss at every point of a tiered save's replication and of cross-tier retention
(``reliability/crashstates.py``, scenarios ``tiered-*``): tier 0 and the persistent
tier are two directories of the recorded filesystem, and each sampled crash state is
recovered by reading both tiers as the crash left them, then starting the tiered job
again. A step acknowledged as persisted (``wait_replicated`` returned) is never lost;
a step acknowledged on tier 0 (``save`` returned) is always on some tier: tier 0's
retention never deletes the only copy of a step that has not been replicated. Once a
``rollback()`` returned, the steps it removed never come back on either tier, and the
job saves right above the step it went back to."""

from __future__ import annotations

import pytest
from reliability import crashstates

from tests.crash.recovery import every_state_recovers

TIERED = sorted(n for n in crashstates.scenarios() if n.startswith("tiered-"))
ROLLBACK = "tiered-rollback/local"
PER_CUT = 2
MAX_STATES = 30


def test_the_tiered_scenarios_are_registered():
    assert TIERED == ["tiered-replicate/local", "tiered-retention/local", "tiered-rollback/local"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in TIERED if n != ROLLBACK])
def test_every_crash_state_of_replication_recovers(name, tmp_path):
    res = every_state_recovers(name, tmp_path, per_cut=PER_CUT, max_states=MAX_STATES, floor=10)
    assert res.ops >= 25  # a tier 0 commit and a tier 1 commit, every fsync recorded


@pytest.mark.timeout(60)
def test_tier_0_holds_the_unreplicated_step_past_its_policy(tmp_path):
    # The recorded operation itself: KeepLast(1) on tier 0 meets step 4 before it
    # reached tier 1 (its replication fails until step 5 is saved). Tier 0 must not
    # move step 4 out before the persistent tier committed it.
    trace = crashstates.record_trace("tiered-retention/local", str(tmp_path))
    ops = [op.describe() for op in trace.ops]
    persisted_4 = next(i for i, d in enumerate(ops) if d.startswith("mark persisted {'step': 4"))
    slow_4 = next(i for i, d in enumerate(ops) if d.endswith("-> slow/checkpoint-4"))
    assert slow_4 < persisted_4
    gone_4 = [i for i, d in enumerate(ops) if d.startswith("rename fast/checkpoint-4 ")]
    assert all(i > slow_4 for i in gone_4), ops
    # Step 3, replicated before, does leave tier 0 at step 4's save: the policy applies.
    assert any(d.startswith("rename fast/checkpoint-3 -> fast/.trash/") for d in ops)


@pytest.mark.timeout(120)
def test_every_crash_state_of_a_tiered_rollback_recovers(tmp_path):
    res = every_state_recovers(ROLLBACK, tmp_path, per_cut=PER_CUT, max_states=MAX_STATES, floor=10)
    assert res.ops >= 20  # two un-commits and deletes per tier, each rename made durable


@pytest.mark.timeout(60)
def test_a_tiered_rollback_un_commits_tier_1_first_newest_first_and_durably(tmp_path):
    # Tier 1 (what a new node restores from) goes first: a crash between the tiers
    # leaves the newer steps on tier 0 only, where the restarted job replicates them
    # again (the rollback had not returned) or a new rollback() removes them. Newest
    # first, so a crash never leaves a gap below a step that is still there.
    ops = [op.describe() for op in crashstates.record_trace(ROLLBACK, str(tmp_path)).ops]
    gone = [(i, d.split()[1]) for i, d in enumerate(ops) if d.startswith("rename ")]
    assert [name for _, name in gone] == [
        "slow/checkpoint-3",
        "slow/checkpoint-2",
        "fast/checkpoint-3",
        "fast/checkpoint-2",
    ], ops
    marked = ops.index("mark rolled-back {'step': 1}")
    for i, name in gone:  # each un-commit is durable before the rollback returns
        tier = name.split("/")[0]
        assert any(d == f"dsync {tier}" for d in ops[i + 1 : marked]), (name, ops)
