"""Preemption in one process: signals armed before any guard exists, the grace period
and the measured save durations deciding whether a preemption save is started, the
requeue exit status. Real signals, real saves; a process's start-up is in
tests/faults/test_preemption_start.py, the multi-rank and torchrun cases in
tests/dist/test_preemption*.py."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atomic_checkpoint import REQUEUE_EXIT_CODE, CheckpointManager, PreemptionGuard, preemption

pytestmark = pytest.mark.timeout(60)

REPO = str(Path(__file__).resolve().parents[2])


def _sigterm(guard) -> None:
    """SIGTERM to this process, once the guard's handler has recorded it."""
    os.kill(os.getpid(), signal.SIGTERM)
    _until(lambda: guard.requested, "the guard's handler")


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)  # the handler runs between two bytecodes


@pytest.fixture
def clean_signals():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    preemption.disarm()
    for s, h in before.items():
        signal.signal(s, h)


def _a_root_whose_saves_took_1_s(tmp_path: Any, monkeypatch: Any) -> tuple[Any, Any]:
    """A manager whose one save so far took about 1 s (a delay in its write), and the
    state it saved."""
    monkeypatch.setenv("ATOMIC_CHECKPOINT_FAULTS", "mid_write@0=delay")
    mgr = CheckpointManager(tmp_path / "r")
    state = {"w": np.arange(1000, dtype=np.float32)}
    mgr.save(1, state)
    return mgr, state


def test_arm_records_the_guard_adopts_and_disarm_restores(tmp_path, clean_signals):
    before = signal.getsignal(signal.SIGTERM)
    preemption.arm()
    assert preemption.armed() == (None, None)
    os.kill(os.getpid(), signal.SIGUSR1)
    _until(lambda: preemption.armed()[0] is not None, "the armed handler")
    signum, at = preemption.armed()
    assert signum == signal.SIGUSR1 and at is not None
    mgr = CheckpointManager(tmp_path / "r")
    try:
        with PreemptionGuard(mgr) as guard:
            assert guard.requested and guard.signum == signal.SIGUSR1
            assert guard.should_save(3) is True and guard.exit_code == REQUEUE_EXIT_CODE
        # The guard puts the armed handler back, not the default action.
        assert signal.getsignal(signal.SIGTERM) == preemption._armed.handler
    finally:
        mgr.close()
    preemption.disarm()
    assert preemption.armed() is None
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_save_that_cannot_fit_in_the_grace_period_is_not_started(
    tmp_path, monkeypatch, caplog, clean_signals
):
    # The last save took over 1 s (a real save, held 1 s by a fault point mid-write);
    # with a grace period of 1 s, less than that is left when the ranks decide.
    mgr, _state = _a_root_whose_saves_took_1_s(tmp_path, monkeypatch)
    try:
        monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
        assert mgr.last_saved.timings_s["total"] >= 1.0
        with PreemptionGuard(mgr, grace_s=1.0) as guard:
            assert guard.should_save(2) is False and not guard.stopping
            _sigterm(guard)
            with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
                assert guard.should_save(3) is False
            assert guard.stopping and guard.decided_step == 3
            assert guard.exit_code == REQUEUE_EXIT_CODE
            assert "grace period" in (guard.skipped_save or "")
            assert guard.should_save(4) is False  # the same answer later
        assert [c.step for c in mgr.checkpoints()] == [1]  # the previous one, intact
        mgr.verify(1)
        text = caplog.text
        assert "WITHOUT saving" in text and "step 1" in text and "stays the newest" in text
    finally:
        mgr.close()


def test_a_save_that_would_eat_the_exit_reserve_is_not_started(
    tmp_path, monkeypatch, caplog, clean_signals
):
    """Saves of about 1 s, x 1.25, fit in a 2 s grace period, but not in the 1 s left of
    it once the way out is kept (half of it): started, the save committed and the
    process was still exiting when the scheduler's SIGKILL came (137, not requeued). A
    4 s grace period keeps 2 s for the exit, and leaves room for the save."""
    mgr, _state = _a_root_whose_saves_took_1_s(tmp_path, monkeypatch)
    try:
        monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
        with PreemptionGuard(mgr, grace_s=2.0) as guard:
            _sigterm(guard)
            assert guard.should_save(2) is False and guard.stopping
            assert "less the 1 s kept for the exit" in (guard.skipped_save or "")
        with PreemptionGuard(mgr, grace_s=4.0) as guard:
            _sigterm(guard)
            assert guard.should_save(2) is True and guard.skipped_save is None
    finally:
        mgr.close()


def test_work_announced_before_the_save_is_kept_only_if_it_fits_with_the_save(
    tmp_path, monkeypatch, caplog, clean_signals
):
    """``should_save(step, work_s=)``: an evaluation (say) scheduled at the preemption
    step runs first only if it and the save fit in the grace period. Saves of about
    1 s, a 10 s grace period less its 3 s exit reserve: 3 s of work fits (1.25 x 4 s),
    5 s does not (1.25 x 6 s), and the save is made either way. The Trainer used to
    skip its evaluation there whatever the time left."""
    mgr, _state = _a_root_whose_saves_took_1_s(tmp_path, monkeypatch)
    try:
        monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
        with PreemptionGuard(mgr, grace_s=10.0) as guard:
            assert guard.should_save(2, work_s=3.0) is False and not guard.work_fits
            _sigterm(guard)
            with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
                assert guard.should_save(2, work_s=3.0) is True
            assert guard.work_fits and guard.skipped_work is None
            assert "of work announced before the save fits: it runs first" in caplog.text
        with PreemptionGuard(mgr, grace_s=10.0) as guard:
            _sigterm(guard)
            assert guard.should_save(2, work_s=5.0) is True and not guard.work_fits
            assert "1.25 x both must fit in it" in (guard.skipped_work or "")
        with PreemptionGuard(mgr) as guard:  # grace period unknown: the save comes first
            _sigterm(guard)
            assert guard.should_save(2, work_s=0.1) is True and not guard.work_fits
            assert "the grace period is unknown" in (guard.skipped_work or "")
        with PreemptionGuard(mgr, grace_s=10.0) as guard:  # nothing announced
            _sigterm(guard)
            assert guard.should_save(2) is True
            assert (guard.work_fits, guard.skipped_work) == (False, None)
            with pytest.raises(ValueError, match="work_s"):
                guard.should_save(2, work_s=-1.0)
    finally:
        mgr.close()


def test_an_async_save_in_flight_counts_against_the_grace_period(
    tmp_path, monkeypatch, caplog, clean_signals
):
    """A save started now first waits for the async save in flight: with saves of about
    1 s and a 2.4 s grace period, one save fits (1.25 x 1 s), but not the rest of the
    one in flight plus a new one. The guard used to start it, and the commit landed
    after the grace period (the scheduler's SIGKILL). Stopping without a save, it also
    says that the save in flight still commits."""
    mgr, state = _a_root_whose_saves_took_1_s(tmp_path, monkeypatch)
    try:
        with PreemptionGuard(mgr, grace_s=2.4) as guard:
            handle = mgr.save_async(2, state)
            assert mgr.async_in_flight is handle
            _sigterm(guard)
            with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
                assert guard.should_save(3) is False
            assert "after the async save in flight" in (guard.skipped_save or "")
            assert "or step 2 once its async save in flight commits" in caplog.text
            handle.result()
        assert mgr.async_in_flight is None
        assert [c.step for c in mgr.checkpoints()] == [1, 2]
    finally:
        monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
        mgr.close()


def test_time_left_keeps_the_way_out_of_the_grace_period(tmp_path, clean_signals):
    """What ``close(timeout_s=guard.time_left_s)`` may use: the grace period less the
    exit reserve (at most half of it), so the job still exits 75 before the SIGKILL."""
    mgr = CheckpointManager(tmp_path / "r")
    try:
        for grace, reserve in ((30.0, preemption.EXIT_RESERVE_S), (4.0, 2.0)):
            with PreemptionGuard(mgr, grace_s=grace) as guard:
                assert guard.time_left_s is None  # no signal yet
                os.kill(os.getpid(), signal.SIGTERM)
                _until(lambda: guard.requested, "the guard's handler")
                left = guard.time_left_s
                assert left is not None and grace - reserve - 1.0 < left <= grace - reserve
    finally:
        mgr.close()


def test_a_save_that_fits_is_started_and_the_grace_period_comes_from_the_environment(
    tmp_path, monkeypatch, caplog, clean_signals
):
    monkeypatch.setenv("ATOMIC_CHECKPOINT_GRACE_S", "60")
    mgr = CheckpointManager(tmp_path / "r")
    try:
        mgr.save(1, {"step": 1})
        with PreemptionGuard(mgr) as guard:
            assert guard.grace_s == 60.0 and guard.save_estimate_s is not None
            _sigterm(guard)
            with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
                assert guard.should_save(2) is True
            assert guard.skipped_save is None and guard.stopping
            mgr.save(2, {"step": 2})
        assert (
            "every rank saves step 2" in caplog.text and "of the grace period left" in caplog.text
        )
        for bad in ("soon", "inf", "nan", "-1"):
            monkeypatch.setenv("ATOMIC_CHECKPOINT_GRACE_S", bad)
            with pytest.raises(ValueError, match="ATOMIC_CHECKPOINT_GRACE_S"):
                PreemptionGuard(mgr)
        with pytest.raises(ValueError, match="grace_s"):
            PreemptionGuard(mgr, grace_s=0)
    finally:
        mgr.close()


def test_a_failed_async_save_does_not_cost_the_preemption_save(tmp_path, caplog, clean_signals):
    # The periodic async save of step 10 failed; SIGTERM came at step 11. mgr.save(11),
    # the first call after the failure, raised it: no preemption save, exit 1 (the
    # scheduler does not requeue), the newest checkpoint the one before step 10.
    mgr = CheckpointManager(tmp_path / "r")
    try:
        mgr.save(5, {"step": 5})
        mgr.save_async(10, {"step": object()})  # unsupported: fails in the background
        with PreemptionGuard(mgr, grace_s=60) as guard:
            _sigterm(guard)
            with caplog.at_level(logging.ERROR, logger="atomic_checkpoint"):
                assert guard.should_save(11) is True
            assert "the async save before step 11 failed" in caplog.text
            assert mgr.save(11, {"step": 11}).step == 11
        assert [c.step for c in mgr.checkpoints()] == [5, 11]
        assert guard.exit_code == REQUEUE_EXIT_CODE
    finally:
        mgr.close()


def test_an_uncatchable_signal_or_a_bad_number_installs_no_handler(tmp_path: Path) -> None:
    # signals=[SIGTERM, SIGKILL] raised a bare OSError after SIGTERM's handler was
    # installed: nothing could remove it, and SIGTERM no longer stopped the process.
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
            PreemptionGuard(mgr, signals=[signal.SIGTERM, signal.SIGKILL])
        assert signal.getsignal(signal.SIGTERM) == before
        for bad in ({"grace_s": float("nan")}, {"grace_s": float("inf")}, {"timeout_s": -1}):
            with pytest.raises(ValueError, match="must be a positive, finite number of seconds"):
                PreemptionGuard(mgr, **bad)
        with pytest.raises(TypeError, match="grace_s must be a number of seconds, got 'x'"):
            PreemptionGuard(mgr, grace_s="x")
        assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        preemption.arm([signal.SIGTERM, signal.SIGKILL])
    assert preemption.armed() is None and signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(TypeError, match="needs the job's CheckpointManager"):
        PreemptionGuard(None)


def test_an_async_save_in_flight_past_the_time_left_means_no_preemption_save(
    tmp_path, monkeypatch, caplog, clean_signals
):
    """Saves took 1 s; the async save in flight takes 4 s (more than the estimate
    assumed). At the signal a save fits (1 s + the 1 s left of the one in flight, x 1.25,
    within 6 s less the 3 s kept for the exit); but the one in flight has not ended when
    the time left for it (the grace period less the way out) is spent: the preemption
    save is not started. It was, and committed after the grace period (the SIGKILL); and
    an async save that never ended held the rank in should_save past it."""
    mgr, state = _a_root_whose_saves_took_1_s(tmp_path, monkeypatch)
    try:
        monkeypatch.setenv("ATOMIC_CHECKPOINT_FAULTS", ",".join(["mid_write@0=delay"] * 4))
        with PreemptionGuard(mgr, grace_s=6) as guard:
            mgr.save_async(2, state)
            _sigterm(guard)
            t = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
                assert guard.should_save(3) is False
            assert time.monotonic() - t < 3.5  # the time left, not the save's 4 s
            assert "had not ended within the 6 s grace period" in (guard.skipped_save or "")
            assert "WITHOUT saving" in caplog.text
            assert guard.stopping and guard.exit_code == REQUEUE_EXIT_CODE
            assert guard.time_left_s is not None and guard.time_left_s < 1.0
    finally:
        monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
        mgr.close()  # without a bound: the save in flight commits
    assert [c.step for c in CheckpointManager(tmp_path / "r", read_only=True).checkpoints()] == [
        1,
        2,
    ]


def test_once_preempted_the_closed_guard_ignores_further_signals(tmp_path, clean_signals):
    """The launcher SIGTERMs every rank as soon as one has exited: a rank still closing
    its manager after the guard's block (retention, the run lock's release) died of it
    (exit -15, its run lock left behind) unless arm() had been called."""
    mgr = CheckpointManager(tmp_path / "r")
    try:
        with PreemptionGuard(mgr) as guard:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # not preempted: put back
        with PreemptionGuard(mgr) as guard:
            os.kill(os.getpid(), signal.SIGUSR1)
            _until(lambda: guard.requested, "the guard's handler")
            assert guard.should_save(5) is True
            mgr.save(5, {"w": np.zeros(4)})
        for s in (signal.SIGTERM, signal.SIGUSR1):  # the guard's: it only records
            assert signal.getsignal(s) not in (signal.SIG_DFL, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded: this test process goes on
        time.sleep(0.01)
        assert guard.exit_code == REQUEUE_EXIT_CODE
    finally:
        mgr.close()


def test_a_slow_retention_is_waited_for_within_the_grace_period_only(
    tmp_path, monkeypatch, caplog, clean_signals
):
    # The last save's retention was deleting on slow storage (6 s) when SIGTERM came,
    # with a 4 s grace period: should_save waited for it to the end, and the job was
    # killed past its grace period instead of exiting 75 in it. wait(timeout_s=) bounded
    # the async save only, not its retention.
    from atomic_checkpoint import KeepLast, strategies

    release = time.monotonic() + 6.0

    def slow_delete(phase: str, rank: int, step: int | None = None) -> None:
        if phase == "after_uncommit":
            time.sleep(max(0.0, release - time.monotonic()))

    mgr = CheckpointManager(tmp_path / "r", retention=KeepLast(1))
    try:
        mgr.save(1, {"step": 1})
        monkeypatch.setattr(strategies, "fault_point", slow_delete)
        release = time.monotonic() + 6.0
        mgr.save(2, {"step": 2})  # its retention deletes step 1, slowly, behind
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"retention .* is still running"):
            mgr.wait(timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
        with PreemptionGuard(mgr, grace_s=4) as guard:
            _sigterm(guard)
            signalled = time.monotonic()
            with caplog.at_level(logging.ERROR, logger="atomic_checkpoint"):
                guard.should_save(3)
            assert time.monotonic() - signalled < 3.5, "should_save took the grace period"
            assert "(or its retention) has not ended within the grace period" in caplog.text
    finally:
        mgr.close()
    assert [c.step for c in CheckpointManager(tmp_path / "r", read_only=True).checkpoints()] == [2]
