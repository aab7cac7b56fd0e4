"""Preemption in real 4-rank jobs (gloo): a real signal sent by this test process to one
rank's pid, as a scheduler sends it, makes every rank save the same step once, with the
normal atomic commit, and exit cleanly (FAILURE_MODES E4, invariant I20); and when the
recent saves say the save cannot fit in the grace period, every rank stops without
starting it, the previous checkpoint intact.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, KeepLast
from atomic_checkpoint.layout import PENDING_DIR
from atomic_checkpoint.preemption import PreemptionGuard
from tests.dist import workers
from tests.dist.launcher import RankResult, ok_values, run_ranks
from tests.helpers import library_warnings

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORLD = 4
ELEMS = 1 << 12


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def w_train(
    rank: int, world: int, root: str, ctl: str, save_every: int, max_steps: int
) -> dict[str, Any]:
    """A training loop with a collective per step, periodic saves, and a preemption
    check at every step boundary. Reports what it saved and how it stopped."""
    import torch
    import torch.distributed as dist

    ctl_dir = Path(ctl)
    mgr = CheckpointManager(root, timeout_s=30, retention=KeepLast(2))
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    guard = PreemptionGuard(mgr)
    _write_atomic(ctl_dir / f"rank{rank}.pid", str(os.getpid()))
    saved: list[int] = []
    stopped_at = None
    for step in range(1, max_steps + 1):
        grad = torch.ones(1)
        dist.all_reduce(grad)  # the training's own collective: every rank must be here
        time.sleep(0.02)
        _write_atomic(ctl_dir / f"rank{rank}.step", str(step))
        stop = guard.should_save(step)
        if stop or step % save_every == 0:
            info = mgr.save(step, workers.make_state(step, rank, big_elems=ELEMS))
            saved.append(info.step)
        if stop:
            stopped_at = step
            break
    requested, signum, decided, by = (
        guard.requested,
        guard.signum,
        guard.decided_step,
        guard.requested_by,
    )
    guard.close()
    # Preempted: the closed guard's handler stays (it only records: the launcher's
    # SIGTERM to the remaining ranks must not kill a rank still closing its manager);
    # otherwise the handlers before it are back.
    restored = {
        s: (
            signal.getsignal(s) not in (signal.SIG_DFL, signal.SIG_IGN, before[s])
            if guard.stopping
            else signal.getsignal(s) == before[s]
        )
        for s in before
    }
    mgr.close()
    return {
        "saved": saved,
        "stopped_at": stopped_at,
        "requested": requested,
        "signum": signum,
        "decided": decided,
        "requested_by": by,
        "handlers_restored": restored,
    }


def _run_in_thread(fn: Callable[[], list[RankResult]]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.extend(fn()), daemon=True)
    t.start()
    return t, out


def _wait_for(what: str, cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _check_checkpoint(root: Path, step: int) -> None:
    """Complete (every byte verified) and restores every rank's state exactly."""
    reader = CheckpointManager(root, read_only=True)
    assert reader.latest() is not None and reader.latest().step == step
    reader.verify(step)
    for r in range(WORLD):
        state = reader.restore(step, rank=r)
        assert workers.states_equal(state, workers.make_state(step, r, big_elems=ELEMS))
    assert os.listdir(root / PENDING_DIR) == []


def test_sigterm_to_one_rank_makes_every_rank_save_the_same_step_and_exit(tmp_path):
    root, ctl = tmp_path / "ckpt", tmp_path / "ctl"
    ctl.mkdir()
    thread, results = _run_in_thread(
        lambda: run_ranks(
            w_train, WORLD, str(root), str(ctl), 5, 400, tmp_dir=str(tmp_path), timeout_s=120
        )
    )
    # Like a scheduler: SIGTERM to one process of the job (rank 2), mid-training.
    _wait_for("rank 2 to pass step 7", lambda: (_read_int(ctl / "rank2.step") or 0) >= 7, 60)
    pid = _read_int(ctl / "rank2.pid")
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    thread.join(150)
    assert not thread.is_alive()
    values = ok_values(results)
    stopped = {v["stopped_at"] for v in values}
    assert len(stopped) == 1 and None not in stopped, values  # one agreed step, all stopped
    step = stopped.pop()
    assert step >= 7
    # Only rank 2 got the signal; every rank saved that step (and the periodic ones).
    assert [v["requested"] for v in values] == [False, False, True, False]
    assert all(v["signum"] is None for i, v in enumerate(values) if i != 2)
    assert values[2]["signum"] == signal.SIGTERM
    assert all(v["decided"] == step and v["requested_by"] == (2,) for v in values)
    assert all(v["saved"] == values[0]["saved"] and v["saved"][-1] == step for v in values)
    assert all(
        v["handlers_restored"] == {signal.SIGTERM: True, signal.SIGUSR1: True} for v in values
    )
    _check_checkpoint(root, step)


def test_signals_during_a_save_do_not_corrupt_it_and_the_next_boundary_stops(tmp_path):
    root, ctl = tmp_path / "ckpt", tmp_path / "ctl"
    ctl.mkdir()
    # Ranks 0 (the coordinator) and 3 pause in the middle of writing their file of
    # step 10 (first chunk written, the rest not): the signals land inside the save.
    faults = ",".join(f"mid_write@{r}=delay:10" for r in (0, 0, 3, 3))
    thread, results = _run_in_thread(
        lambda: run_ranks(
            w_train,
            WORLD,
            str(root),
            str(ctl),
            10,
            400,
            tmp_dir=str(tmp_path),
            faults=faults,
            timeout_s=120,
        )
    )

    def writing(rank: int) -> bool:
        pend = root / PENDING_DIR
        return any(
            (pend / d / f"rank-{rank:05d}.safetensors").exists()
            for d in (os.listdir(pend) if pend.is_dir() else [])
        )

    _wait_for("ranks 0 and 3 to be writing step 10", lambda: writing(0) and writing(3), 60)
    pids = {r: _read_int(ctl / f"rank{r}.pid") for r in (0, 3)}
    assert None not in pids.values()
    os.kill(pids[0], signal.SIGTERM)  # type: ignore[arg-type]
    os.kill(pids[3], signal.SIGUSR1)  # type: ignore[arg-type]
    thread.join(150)
    assert not thread.is_alive()
    values = ok_values(results)
    # The interrupted save of step 10 finished normally; the boundary after it stopped.
    assert all(v["saved"] == [10, 11] and v["stopped_at"] == 11 for v in values), values
    assert [v["signum"] for v in values] == [signal.SIGTERM, None, None, signal.SIGUSR1]
    assert all(v["requested_by"] == (0, 3) for v in values)
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [10, 11]
    for s in (10, 11):
        reader.verify(s)
    _check_checkpoint(root, 11)
    for r in range(WORLD):
        assert workers.states_equal(
            reader.restore(10, rank=r), workers.make_state(10, r, big_elems=ELEMS)
        )


def w_mismatched_boundaries(rank: int, world: int, root: str) -> dict[str, Any]:
    mgr = CheckpointManager(root, timeout_s=10)
    with PreemptionGuard(mgr, timeout_s=10) as guard:
        agreed = guard.should_save(3)
        try:
            guard.should_save(4 if rank != 1 else 5)  # rank 1 is one step ahead
            outcome = ("ok", "")
        except Exception as exc:
            outcome = (type(exc).__name__, str(exc))
    mgr.close()
    return {"agreed": agreed, "outcome": outcome}


def test_ranks_checking_at_different_steps_all_get_an_error(tmp_path):
    # A rank that checks at another step would save another step than the others (or
    # block in a different collective): every rank is told, none saves.
    results = run_ranks(
        w_mismatched_boundaries, WORLD, str(tmp_path / "ckpt"), tmp_dir=str(tmp_path)
    )
    values = ok_values(results)
    assert all(v["agreed"] is False for v in values)
    assert {v["outcome"][0] for v in values} == {"CheckpointError"}
    assert all("different steps" in v["outcome"][1] and "1: 5" in v["outcome"][1] for v in values)


def w_deadline(rank: int, world: int, root: str) -> dict[str, Any]:
    """Step 1's save takes over 1 s (rank 0 pauses 1 s mid-write, and the commit waits
    for it on every rank); with a grace period of 1 s, rank 2 is signalled just before
    the boundary of step 2."""
    seen = library_warnings()
    mgr = CheckpointManager(root, timeout_s=30)
    mgr.save(1, workers.make_state(1, rank, big_elems=ELEMS))
    os.environ.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    with PreemptionGuard(mgr, grace_s=1.0) as guard:
        if rank == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not guard.requested and time.monotonic() < deadline:
                time.sleep(0.001)
        save = guard.should_save(2)
        out = {
            "save": save,
            "stopping": guard.stopping,
            "decided": guard.decided_step,
            "requested_by": guard.requested_by,
            "skipped": guard.skipped_save,
            "exit_code": guard.exit_code,
            "warned": [m for m in seen.messages if "WITHOUT saving" in m],
            "time_left": guard.time_left_s,
        }
    mgr.close()
    return out


def test_a_save_that_cannot_fit_the_grace_period_is_skipped_on_every_rank_alike(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(
        w_deadline, WORLD, str(root), tmp_dir=str(tmp_path), faults="mid_write@0=delay:1"
    )
    values = ok_values(results)
    # One decision for all: stop at step 2 without saving, for the same stated reason.
    assert all(v["save"] is False and v["stopping"] and v["decided"] == 2 for v in values)
    assert all(v["requested_by"] == (2,) and v["exit_code"] == 75 for v in values)
    assert len({v["skipped"] for v in values}) == 1 and "grace period" in values[0]["skipped"]
    # The rank that was signalled says so, naming the checkpoint that stays.
    assert [bool(v["warned"]) for v in values] == [False, False, True, False]
    assert "previous checkpoint (step 1)" in values[2]["warned"][0]
    # What is left of the grace period is known on every rank once they stopped (it was
    # None where no signal came, so a close(timeout_s=time_left_s) waited for ever there
    # while the signalled rank gave up: a tiered close never ended).
    assert all(v["time_left"] is not None for v in values), values
    _check_checkpoint(root, 1)
