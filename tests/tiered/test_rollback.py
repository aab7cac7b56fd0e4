"""Going back to an older checkpoint with tiers: ``TieredCheckpointManager.rollback``
removes this run's newer checkpoints from both tiers (and from the peers), so that the
run continues from the older step and a resume never loads the abandoned trajectory;
a save below the persistent tier's newest step (a wiped tier 0) is refused before it
is written, as a single root refuses a save below its newest step.

Real parts: tier 0 is a local directory, tier 1 a local directory or the real S3
server (moto on 127.0.0.1) behind the fault-injecting proxy that cuts the link; the
multi-rank case is a real 3-rank gloo job, each rank its own node with peer copies."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import shutil
import textwrap

import pytest
from tests.dist.launcher import ok_values, run_ranks
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import Rule, S3Proxy
from tests.tiered import workers
from tests.tiered.test_tiered import (  # noqa: F401
    fast_root,
    killed_job,
    s3_link_cut,
    same,
    state,
    steps_on,
)

from atomic_checkpoint import (
    CheckpointError,
    CheckpointManager,
    KeepLast,
    StepOrderError,
    Tier,
    TieredCheckpointManager,
    catalog,
)
from atomic_checkpoint.layout import checkpoint_name


@pytest.mark.timeout(60)
def test_a_wiped_tier_0_refuses_a_save_below_the_persistent_tiers_newest_until_rollback(
    fast_root, tmp_path
):
    slow = tmp_path / "persistent"
    tiers = [Tier(fast_root, retention=KeepLast(1)), Tier(slow, retention=KeepLast(3))]
    with TieredCheckpointManager(tiers) as mgr:
        for s in (100, 200):
            mgr.save(s, state(s))
        assert mgr.wait_replicated(timeout_s=30)
    shutil.rmtree(fast_root)  # a replaced node: tier 0 is empty, tier 1 holds 100, 200

    with TieredCheckpointManager(tiers) as mgr:
        # Saved as is, step 50 would be the first one tier 1's retention drops, never
        # replicated (below tier 1's newest), and a resume would load step 200.
        with pytest.raises(StepOrderError, match=r"rollback\(<that step>\)") as err:
            mgr.save(50, state(50))
        assert (err.value.step, err.value.newest) == (50, 200)
        with pytest.raises(StepOrderError):
            mgr.save(200, state(200))  # another copy of step 200: refused too
        assert same(mgr.restore(100), state(100))
        assert mgr.last_restored.tiers == (1,)
        assert mgr.rollback(100) == [200]
        mgr.save(150, state(150))
        assert mgr.wait_replicated(timeout_s=30)
        assert [c.step for c in mgr.checkpoints()] == [100, 150]
    reader = CheckpointManager(slow, read_only=True)
    assert steps_on(reader) == [100, 150]
    with TieredCheckpointManager(tiers) as mgr:
        assert same(mgr.restore(), state(150))
        assert mgr.last_restored.step == 150


@pytest.mark.timeout(60)
def test_rollback_removes_newer_steps_from_both_tiers_and_the_run_goes_on(fast_root, tmp_path):
    slow = tmp_path / "persistent"
    tiers = [Tier(fast_root, retention=KeepLast(2)), Tier(slow, retention=KeepLast(5))]
    with TieredCheckpointManager(tiers) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, state(s))
        assert mgr.wait_replicated(timeout_s=30)
        # Below every checkpoint of both tiers: refused, as CheckpointManager does (it
        # removed them all, the persistent tier's included, with no error).
        with pytest.raises(CheckpointError, match=r"would remove every checkpoint .* both"):
            mgr.rollback(0)
        assert [c.step for c in mgr.checkpoints()] == [1, 2, 3, 4]
        assert mgr.rollback(2) == [4, 3]
        assert max(steps_on(mgr.fast)) == 2  # step 1 too, if its replication came late
        # A new step 3, from another trajectory: replicated afresh, never mistaken for
        # the step 3 that tier 1 held before.
        mgr.save(3, state(30))
        assert mgr.wait_replicated(timeout_s=30)
        assert mgr.replication_failures() == {}
        listed = [(c.step, c.tiers) for c in mgr.checkpoints()]
        assert listed == [(1, (1,)), (2, (0, 1)), (3, (0, 1))]
    on_slow = CheckpointManager(slow, read_only=True)
    assert catalog.load_checkpoint(on_slow.storage, 3, full=True).step == 3
    shutil.rmtree(fast_root)
    with TieredCheckpointManager(tiers) as mgr:
        assert same(mgr.restore(), state(30))  # from tier 1: the new step 3


@pytest.mark.netfs
@pytest.mark.timeout(120)
def test_rollback_while_the_persistent_tier_is_unreachable_touches_neither_tier(
    s3_server, s3_bucket, fast_root
):
    with s3_link_cut(s3_server, s3_bucket, fast_root, (2, 3, 4), retention=KeepLast(5)) as link:
        mgr = link.mgr
        with pytest.raises(CheckpointError, match=r"call rollback\(2\) again"):
            mgr.rollback(2)
        # Nothing removed anywhere: the steps above 2 are still on tier 0, still held
        # for replication.
        assert steps_on(mgr.fast) == [2, 3, 4]
        assert mgr.replication_backlog() == [2, 3, 4]
        link.proxy.remove(link.cut)
        assert mgr.rollback(2) == [4, 3]
        assert steps_on(mgr.fast) == [2]
        assert mgr.wait_replicated(timeout_s=60)
        assert mgr.replication_backlog() == []
        assert mgr.close() == []
        opts = s3_server.storage_options()
        reader = CheckpointManager(link.url, storage_options=opts, read_only=True)
        # Steps 3 and 4 never reach tier 1, whether or not they were copied before the
        # rollback: the replicator forgot them.
        assert steps_on(reader) == [1, 2]


@pytest.mark.netfs
@pytest.mark.timeout(180)
def test_a_rollback_that_gave_up_on_a_stalled_tier_1_loses_nothing_when_it_lands_late(
    s3_server, s3_bucket, fast_root
):
    """S3 stalls (requests held, not refused): rollback(1) gives up after timeout_s and
    raises that nothing was rolled back. Its requests were in flight, and once S3
    answered the replicator carried the rollback out on tier 1 and forgot steps 2 and
    3. The user then kept step 2 (rollback(2)): it was left on the node-local tier only,
    while replication_backlog() was [] and close() returned [] (and rollback(2)
    returned the late rollback's answer, [3, 2]). Now what the late rollback removed
    from tier 1 is replicated again from tier 0, where it is still valid."""
    url = f"s3://{s3_bucket}/run"
    with S3Proxy(s3_server, lifetime_s=150) as proxy:
        tiers = [
            Tier(fast_root, retention=KeepLast(5)),
            Tier(url, storage_options=proxy.storage_options()),
        ]
        mgr = TieredCheckpointManager(tiers, timeout_s=3, retry_max_s=0.2)
        for s in (1, 2, 3):
            mgr.save(s, state(s))
        assert mgr.wait_replicated(timeout_s=60)
        stall = proxy.add(Rule("delay", times=None))  # held until released
        with pytest.raises(
            CheckpointError, match=r"was not rolled back .* call rollback\(1\) again"
        ):
            mgr.rollback(1)
        assert steps_on(mgr.fast) == [1, 2, 3]
        proxy.remove(stall)
        stall.release.set()  # S3 answers: the held rollback lands now
        assert mgr.rollback(2) == [3]  # the user keeps step 2 instead
        assert mgr.wait_replicated(timeout_s=60) and mgr.replication_backlog() == []
        assert mgr.close() == []
    reader = CheckpointManager(url, storage_options=s3_server.storage_options(), read_only=True)
    assert steps_on(reader) == [1, 2]  # step 2 is on tier 1 again, whole
    assert same(reader.restore(2), state(2))
    assert steps_on(CheckpointManager(fast_root, read_only=True)) == [1, 2]


@pytest.mark.timeout(60)
def test_a_rollback_that_gave_up_removes_nothing_that_only_the_persistent_tier_holds(
    s3_server, s3_bucket, fast_root
):
    """Tier 0 keeps the newest step only (the README's own example), so steps 1 and 2
    are on the persistent tier alone. S3 stalls, rollback(1) gives up and says nothing
    was rolled back; once S3 answered, the replicator rolled tier 1 back anyway: steps
    2 and 3 went from tier 1, step 3 came back from tier 0, and step 2 was on no tier.
    Now a rollback whose caller gave up removes nothing more."""
    url = f"s3://{s3_bucket}/run"
    with S3Proxy(s3_server, lifetime_s=150) as proxy:
        tiers = [
            Tier(fast_root, retention=KeepLast(1)),
            Tier(url, storage_options=proxy.storage_options(), retention=KeepLast(5)),
        ]
        mgr = TieredCheckpointManager(tiers, timeout_s=3, retry_max_s=0.2)
        for s in (1, 2, 3):
            mgr.save(s, state(s))
            assert mgr.wait_replicated(timeout_s=60)
        assert steps_on(mgr.fast) == [3]
        stall = proxy.add(Rule("delay", times=None))  # held until released
        with pytest.raises(CheckpointError, match=r"was not rolled back .* nothing was removed"):
            mgr.rollback(1)
        proxy.remove(stall)
        stall.release.set()  # S3 answers: the held request of the rollback goes through
        assert mgr.rollback(3) == []  # served after it: the replicator is done with it
        assert mgr.close() == []
    reader = CheckpointManager(url, storage_options=s3_server.storage_options(), read_only=True)
    assert steps_on(reader) == [1, 2, 3]
    assert same(reader.restore(2), state(2))
    assert steps_on(CheckpointManager(fast_root, read_only=True)) == [3]


@pytest.mark.netfs
@pytest.mark.timeout(120)
def test_rollback_to_a_step_only_the_unreachable_tier_holds_says_it_did_not_answer(
    s3_server, s3_bucket, fast_root
):
    # Tier 1 holds step 1 (tier 0 let it go once replicated), tier 0 the unreplicated
    # steps 2 and 3. With tier 1 unreachable, its steps were not counted: "rollback(1)
    # would remove every checkpoint ... pass allow_empty=True to remove them all".
    with s3_link_cut(s3_server, s3_bucket, fast_root, (2, 3)) as link:
        mgr = link.mgr
        assert steps_on(mgr.fast) == [2, 3]
        with pytest.raises(CheckpointError) as err:
            mgr.rollback(1)
        assert "call rollback(1) again" in str(err.value), str(err.value)
        assert "allow_empty" not in str(err.value)
        assert steps_on(mgr.fast) == [2, 3]
        link.proxy.remove(link.cut)
        assert mgr.rollback(1) == [3, 2]
        assert mgr.close() == []


@pytest.mark.timeout(60)
def test_a_rollback_that_fails_on_tier_0_after_tier_1_says_it_is_half_done(
    fast_root, tmp_path, monkeypatch
):
    # Tier 1 rolled back, then tier 0 refused (remounted read-only): the error said
    # only tier 0's problem, and a restart without a second rollback replicated tier
    # 0's steps above the target back to tier 1, and restore() loaded one of them.
    from atomic_checkpoint import StoragePermissionError

    mgr = TieredCheckpointManager([Tier(str(fast_root)), Tier(str(tmp_path / "slow"))])
    for step in (1, 2, 3):
        mgr.save(step, state(step))
    assert mgr.wait_replicated(timeout_s=30)

    def read_only(step, **kwargs):
        raise StoragePermissionError("rename ... failed: Read-only file system", errno=30)

    monkeypatch.setattr(mgr.fast, "rollback", read_only)
    with pytest.raises(StoragePermissionError) as err:  # its type and errno are kept
        mgr.rollback(1)
    said = str(err.value)
    assert "rollback(1) is half done" in said and "Read-only file system" in said, said
    assert "steps [3, 2] removed" in said and "Call rollback(1) again" in said, said
    assert err.value.errno == 30
    monkeypatch.undo()
    assert mgr.rollback(1) == [3, 2]  # called again, as it says: done
    assert steps_on(mgr.fast) == [1]
    assert mgr.close() == []


@pytest.mark.timeout(60)
def test_rollback_while_a_mounted_persistent_tier_is_gone_touches_neither_tier(fast_root, tmp_path):
    """All replicated, the replicator idle; then tier 1's directory is replaced by a
    file (an unmount). Its listing read as empty, "nothing above the step" counted as
    rolled back, tier 0 lost steps 2 and 3 while tier 1 kept them, and a node
    replaced later resumed from the rolled-back step 3."""
    slow = tmp_path / "slow"
    mgr = TieredCheckpointManager([Tier(str(fast_root)), Tier(str(slow))], retry_max_s=0.3)
    for step in (1, 2, 3):
        mgr.save(step, state(step))
    assert mgr.wait_replicated(timeout_s=30)
    slow.rename(tmp_path / "away")
    slow.write_text("not a directory")
    with pytest.raises(CheckpointError, match="is not a directory any more"):
        mgr.rollback(1)
    assert steps_on(mgr.fast) == [1, 2, 3]
    slow.unlink()
    (tmp_path / "away").rename(slow)
    assert mgr.rollback(1) == [3, 2]
    assert mgr.close() == []
    with CheckpointManager(slow, read_only=True) as reader:
        assert steps_on(reader) == [1]


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_rollback_in_a_multi_node_job_removes_tier_1_tier_0_and_peer_copies_alike(tmp_path):
    base, slow = tmp_path / "nodes", tmp_path / "persistent"
    got = ok_values(
        run_ranks(workers.w_rollback, 3, str(base), str(slow), None, 1, tmp_dir=str(tmp_path))
    )
    assert all(v["replicated"] and v["peered"] for v in got), got
    assert all(v["removed"] == [3, 2] for v in got), got
    assert all(v["replicated_again"] and v["peered_again"] for v in got), got
    # The new step 2 is on both tiers and on the peers; the old step 3 nowhere.
    # (Tier 0 keeps its newest two: steps 1 and the new 2.)
    assert all(v["listed"] == [(1, (0, 1)), (2, (0, 1))] for v in got), got
    assert all(v["recoverable"][-1] == 2 for v in got), [v["recoverable"] for v in got]
    assert all(v["restored"] == 2 and v["restored_ok"] for v in got), got
    assert all(v["failures"] == [] and v["left"] == [] for v in got), got
    reader = CheckpointManager(slow, read_only=True)
    assert steps_on(reader) == [1, 2]
    tier1_step2 = catalog.load_checkpoint(reader.storage, 2, full=True)
    for node in range(3):
        tier0 = CheckpointManager(base / f"node{node}", read_only=True)
        own = catalog.load_checkpoint(tier0.storage, 2)
        assert {f.checksum for f in own.files} <= {f.checksum for f in tier1_step2.files}
        assert not list(base.glob(f"node{node}/.peers/*/{checkpoint_name(3)}"))
        assert list(base.glob(f"node{node}/.peers/*/{checkpoint_name(2)}"))


ROLLBACK_CHILD = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_tiered import state
    from atomic_checkpoint import KeepLast, Tier, TieredCheckpointManager

    cfg = json.loads(os.environ["TIERED_CFG"])
    mgr = TieredCheckpointManager(
        [Tier(cfg["fast"], retention=KeepLast(2)), Tier(cfg["slow"], retention=KeepLast(5))]
    )
    for s in (1, 2, 3, 4):
        mgr.save(s, state(s))
    assert mgr.wait_replicated(timeout_s=60)
    print("replicated", flush=True)
    mgr.rollback(2)  # killed on tier 1, after step 4 went, before step 3 goes
    print("rolled back", flush=True)
    """
)


@pytest.mark.timeout(90)
def test_a_rollback_killed_midway_leaves_whole_checkpoints_and_is_finished_by_calling_it_again(
    fast_root, tmp_path
):
    """A SIGKILL inside ``rollback(2)``, on tier 1, with step 4 removed there and step 3
    not yet: every checkpoint listed on either tier is whole; the next start sees the
    rollback as not done (tier 0 still holds step 4, which is replicated again, so a
    resume loads 4, as before the call), and calling ``rollback(2)`` again finishes it."""
    slow = tmp_path / "persistent"
    child = killed_job(
        ROLLBACK_CHILD, "before_uncommit@0=kill:3", 60, fast=str(fast_root), slow=str(slow)
    )
    assert "replicated" in child.stdout and "rolled back" not in child.stdout
    on_slow = CheckpointManager(slow, read_only=True)
    assert steps_on(on_slow) == [1, 2, 3]
    for s in (1, 2, 3):
        assert same(on_slow.restore(s), state(s))
    assert {3, 4} <= set(steps_on(CheckpointManager(fast_root, read_only=True)))  # untouched
    tiers = [Tier(fast_root, retention=KeepLast(2)), Tier(slow, retention=KeepLast(5))]
    with TieredCheckpointManager(tiers) as mgr:
        assert mgr.wait_replicated(timeout_s=30)
        assert [c.step for c in mgr.checkpoints()] == [1, 2, 3, 4]
        assert same(mgr.restore(), state(4))
        assert mgr.rollback(2) == [4, 3]
        assert [c.step for c in mgr.checkpoints()] == [1, 2]
    assert steps_on(on_slow) == [1, 2]
