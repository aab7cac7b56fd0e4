"""Going back to an older checkpoint, on a real local filesystem (issue 11, defect 2;
DESIGN invariant 10).

Checkpoints are ordered by step. With 100 and 200 committed, a job that restores 100
and saves 110 used to get success while ``KeepLast(1)`` deleted 110 (and 100) in the
same save, keeping 200. Now a save below the newest committed step raises
``StepOrderError`` on every rank before anything is written, ``rollback(step)``
discards the newer checkpoints on purpose, and a save's own retention pass never
deletes the step it just committed.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import atomic_checkpoint as ac
from atomic_checkpoint import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    FencedError,
    KeepLast,
)
from atomic_checkpoint.layout import PENDING_DIR, TRASH_DIR

pytestmark = pytest.mark.timeout(60)

FAULTS = "ATOMIC_CHECKPOINT_FAULTS"
STRATEGIES = ["rename", "marker"]


def state(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "step": step}


def listed(root) -> list[int]:
    return [c.step for c in CheckpointManager(root, read_only=True).checkpoints()]


def tree(root) -> dict[str, tuple[int, int]]:
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def committed_100_and_200(root, strategy: str) -> None:
    with CheckpointManager(root, strategy=strategy) as mgr:
        mgr.save(100, state(100))
        mgr.save(200, state(200))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_restore_older_then_save_below_is_refused_not_silently_deleted(tmp_path, strategy):
    """The issue's scenario, in a restarted job: a save that would return success and
    then be deleted by its own retention pass is refused instead, before it writes."""
    root = tmp_path / "ckpt"
    committed_100_and_200(root, strategy)
    mgr = CheckpointManager(root, retention=KeepLast(1), strategy=strategy)
    assert mgr.restore(step=100)["step"] == 100
    before = tree(root)
    try:
        mgr.save(110, state(110))
    except CheckpointError as exc:
        refused: CheckpointError | None = exc
    else:
        refused = None
    after = [c.step for c in mgr.checkpoints()]  # after the save's retention pass
    assert refused is not None, f"save(110) returned success, then its own retention left {after}"
    assert isinstance(refused, ac.StepOrderError) and isinstance(refused, ValueError)
    assert (refused.step, refused.newest) == (110, 200)
    msg = str(refused)
    assert "step 200 is already committed" in msg and "rollback(" in msg
    assert tree(root) == before  # nothing written: no pending directory, nothing deleted
    assert listed(root) == [100, 200]
    mgr.close()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rollback_discards_the_newer_steps_then_saves_continue(tmp_path, strategy, caplog):
    root = tmp_path / "ckpt"
    committed_100_and_200(root, strategy)
    with CheckpointManager(root, strategy=strategy) as mgr:
        mgr.save(300, state(300))
    mgr = CheckpointManager(root, retention=KeepLast(2), strategy=strategy)
    resumed = mgr.restore(step=100)
    with caplog.at_level(logging.INFO, logger="atomic_checkpoint"):
        assert mgr.rollback(100) == [300, 200]  # newest first
    deleted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollback: ")]
    # Each names where (a tiered manager logs for two roots).
    assert deleted == [
        f"rollback: deleted {root / 'checkpoint-300'}",
        f"rollback: deleted {root / 'checkpoint-200'}",
    ]
    assert listed(root) == [100]
    assert mgr.rollback(100) == []  # nothing above: a no-op
    info = mgr.save(110, state(110))
    assert info.step == 110
    mgr.save(120, state(120))
    # KeepLast(2) applies to the new history (checkpoints() waits for the rotation).
    assert [c.step for c in mgr.checkpoints()] == [110, 120]
    assert mgr.restore(110)["step"] == 110
    assert torch.equal(mgr.restore()["w"], state(120)["w"])
    assert resumed["step"] == 100
    mgr.close()
    # Nothing left in .pending/ or .trash/ (marker: no stray attempt data either).
    for d in (PENDING_DIR, TRASH_DIR):
        assert not os.path.isdir(root / d) or os.listdir(root / d) == []
    assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == [
        "checkpoint-110",
        "checkpoint-120",
    ]


def test_every_save_api_refuses_below_the_newest_step_before_writing(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root)
    mgr.save(10, state(10))
    mgr.save(20, state(20))
    before = tree(root)
    with pytest.raises(ac.StepOrderError, match="cannot save step 15"):
        mgr.save(15, state(15))
    with pytest.raises(ac.StepOrderError, match="cannot save step 10"):
        mgr.save(10, state(10), overwrite=True)  # overwriting an older step is going back
    with pytest.raises(ac.StepOrderError, match="cannot save step 15"):
        mgr.save_async(15, state(15))  # raised by the call, not by the handle later
    with pytest.raises(ac.StepOrderError), mgr.saving(15) as d:
        (d / "never").write_text("the block never runs")
    assert tree(root) == before
    # The newest step itself keeps its old rules; later steps are fine.
    with pytest.raises(CheckpointExistsError):
        mgr.save(20, state(20))
    mgr.save(20, state(21), overwrite=True)
    mgr.save_async(30, state(30)).result()
    with pytest.raises(ac.StepOrderError, match="step 30 is already committed"):
        mgr.save(25, state(25))  # the async commit advanced the newest step
    mgr.close()
    assert listed(root) == [10, 20, 30]


def test_a_later_run_in_the_same_root_is_not_held_back(tmp_path):
    """Steps are ordered within a run: another run's checkpoints do not count."""
    root = tmp_path / "ckpt"
    with CheckpointManager(root, run_id="first") as mgr:
        mgr.save(500, state(500))
    with CheckpointManager(root, run_id="second") as mgr:
        mgr.save(1, state(1))
        assert mgr.rollback(0, allow_empty=True) == [1]  # never touches run "first"
    assert [
        c.step for c in CheckpointManager(root, read_only=True, run_id="first").checkpoints()
    ] == [500]


def test_a_rollback_that_would_leave_nothing_is_refused_unless_asked_for(tmp_path):
    # KeepLast(2) had already deleted step 300: rollback(300) used to delete 400 and
    # 500 too, leaving nothing to continue from, with an INFO line as the only notice.
    root = tmp_path / "ckpt"
    with CheckpointManager(root, retention=KeepLast(2)) as mgr:
        for s in (100, 200, 300, 400, 500):
            mgr.save(s, state(s))
        assert [c.step for c in mgr.checkpoints()] == [400, 500]
        with pytest.raises(CheckpointError, match=r"would remove every checkpoint") as err:
            mgr.rollback(300)
        assert "rollback(400) keeps step 400" in str(err.value)
        assert "allow_empty=True" in str(err.value)
        assert [c.step for c in mgr.checkpoints()] == [400, 500]  # nothing removed
        assert mgr.rollback(450) == [500]  # a step between two: the older one stays
        assert mgr.rollback(0, allow_empty=True) == [400]  # start over, when asked
        assert mgr.checkpoints() == []
        mgr.save(10, state(10))
    assert listed(root) == [10]


def test_own_retention_pass_never_deletes_the_step_it_committed(tmp_path):
    """Defence in depth: even when a higher step of this run appears behind the job's
    back (here: copied in from a backup, so the job does not know it), the save's own
    retention keeps the step it just committed."""
    root = tmp_path / "ckpt"
    backup = tmp_path / "backup"
    with CheckpointManager(root, run_id="r") as mgr:
        mgr.save(200, state(200))
    shutil.copytree(root / "checkpoint-200", backup / "checkpoint-200")
    shutil.rmtree(root / "checkpoint-200")
    mgr = CheckpointManager(root, run_id="r", retention=KeepLast(1))
    mgr.save(100, state(100))
    shutil.copytree(backup / "checkpoint-200", root / "checkpoint-200")
    info = mgr.save(110, state(110))  # the job only knows step 100
    mgr.close()
    assert info.step == 110
    assert 110 in listed(root), f"save(110) returned success, then left {listed(root)}"
    assert listed(root) == [110, 200]
    assert CheckpointManager(root, read_only=True).restore(110)["step"] == 110


def test_rollback_removes_newest_first_and_a_failure_leaves_a_valid_prefix(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root)
    for s in (100, 200, 300, 400):
        mgr.save(s, state(s))
    # The removal of step 200 fails (an injected EIO before its un-commit): 400 and 300
    # are gone, 200 and 100 are intact, and every later answer agrees with ROOT.
    monkeypatch.setenv(FAULTS, "before_uncommit@0=raise:200")
    with pytest.raises(OSError, match="injected fault at before_uncommit"):
        mgr.rollback(100)
    monkeypatch.delenv(FAULTS)
    assert listed(root) == [100, 200]
    with pytest.raises(ac.StepOrderError, match="step 400 is already committed"):
        mgr.save(150, state(150))  # unchanged until a rollback succeeds
    assert mgr.rollback(100) == [200]  # called again: finishes the job
    mgr.save(150, state(150))
    mgr.close()
    assert listed(root) == [100, 150]


def test_rollback_by_a_job_that_lost_the_lock_deletes_nothing(tmp_path):
    root = tmp_path / "ckpt"
    old = CheckpointManager(root, run_id="r", lease_s=3600)
    old.save(100, state(100))
    old.save(200, state(200))
    new = CheckpointManager(root, run_id="r", takeover=True)  # fences the old job
    with pytest.raises(FencedError):
        old.rollback(100)
    assert listed(root) == [100, 200]
    new.close()


def test_rollback_needs_a_writable_manager(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, state(1))
    with pytest.raises(ac.ReadOnlyError):
        CheckpointManager(root, read_only=True).rollback(0)
    assert listed(root) == [1]


def test_plan_deletions_never_plans_a_protected_step():
    from atomic_checkpoint.manifest import CheckpointInfo
    from atomic_checkpoint.retention import plan_deletions

    infos = [
        CheckpointInfo(step=s, path=f"checkpoint-{s}", size_bytes=0, metrics={}, created_unix=0)
        for s in (100, 110, 200)
    ]
    assert [i.step for i in plan_deletions(KeepLast(1), infos)] == [100, 110]
    assert [i.step for i in plan_deletions(KeepLast(1), infos, protect=(110,))] == [100]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resuming_past_a_corrupt_newest_checkpoint_can_save_again(tmp_path, strategy, caplog):
    """A resume that falls back past a checkpoint failing its checksum continues from
    the older step: the corrupt one (still on disk) must not make the next save a
    refused rollback, and the new save survives its own retention pass."""
    root = tmp_path / "ckpt"
    committed_100_and_200(root, strategy)
    mgr = CheckpointManager(root, strategy=strategy, retention=KeepLast(1))
    path = root / "checkpoint-200"
    rank_file = next(p for p in path.rglob("rank-*") if p.is_file())
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        restored = mgr.restore()
    assert restored["step"] == 100
    assert mgr.last_restored is not None and mgr.last_restored.step == 100
    assert any("skipping checkpoint step 200" in r.getMessage() for r in caplog.records)
    info = mgr.save(110, state(110))
    assert info.step == 110
    mgr.close()
    assert 110 in listed(root)
    with CheckpointManager(root, strategy=strategy) as again:
        assert again.restore()["step"] == 110


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_apply_retention_applies_a_new_policy_now_and_never_the_newest(tmp_path, strategy):
    root = tmp_path / "root"
    with CheckpointManager(root, strategy=strategy) as mgr:
        for s in (1, 2, 3, 4, 5):
            mgr.save(s, state(s), metrics={"loss": float(s)})  # the newest is the worst
        assert mgr.apply_retention() == []  # no policy: nothing to do
        mgr.retention = ac.KeepBest(1, metric="loss")
        # The best (step 1) and the newest (step 5, never deleted) stay.
        assert mgr.apply_retention() == [2, 3, 4]
        assert [c.step for c in mgr.checkpoints()] == [1, 5]
        assert mgr.apply_retention() == []  # nothing more to do
        mgr.save(6, state(6), metrics={"loss": 6.0})
    assert listed(root) == [1, 6]
    with pytest.raises(CheckpointError, match="closed"):
        mgr.apply_retention()
    with pytest.raises(CheckpointError, match="read-only"):
        CheckpointManager(root, read_only=True).apply_retention()
