"""Ranks that make different collective calls at the same point of a job (one saves
while another restores, a call under ``if rank == 0:``): every round carries its call's
key, so they meet, every rank raises ``CollectiveMismatchError`` naming the calls at
once instead of reading another call's value or waiting for its timeout, and the next
calls made alike on every rank work again.

Ranks are threads, each with its own client of one real TCPStore (the coordination a
torchrun job uses).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest

from atomic_checkpoint import CollectiveMismatchError, CoordinationTimeoutError
from tests.helpers import on_store_threads

dist = pytest.importorskip("torch.distributed")

TIMEOUT_S = 8.0  # a mismatch must be raised long before this


def _on_ranks(world: int, body: Callable[[Any, int], Any]) -> list[tuple[str, Any, float]]:
    return on_store_threads(world, body)


def _outcome_and_seconds(call: Callable[[], Any]) -> tuple[Any, float]:
    """What ``call()`` raised ("no error" if nothing), and how long it took."""
    t0 = time.monotonic()
    try:
        call()
        got: Any = "no error"
    except Exception as exc:
        got = exc
    return got, time.monotonic() - t0


def _then_agree(first: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    """``first``, whose error is kept, then an all-gather made alike on every rank."""

    def body(coord: Any, rank: int) -> tuple[Any, list[int]]:
        try:
            first(coord, rank)
            outcome: Any = "no error"
        except Exception as exc:
            outcome = exc
        return outcome, coord.all_gather("after", rank, timeout_s=TIMEOUT_S)

    return body


def _check_all_raised_the_mismatch(results, world: int, *calls: str) -> None:
    for rank, (kind, (err, after), _) in enumerate(results):
        assert kind == "ok", err
        assert isinstance(err, CollectiveMismatchError), (rank, err)
        for call in calls:
            assert repr(call) in str(err), (rank, str(err))
        assert "same order" in str(err)
        # ... and the job goes on: the next call made alike on every rank works.
        assert after == list(range(world)), (rank, after)
    # Found at once, not at the timeout.
    assert max(r[2] for r in results) < TIMEOUT_S / 2, [r[2] for r in results]


def test_gathers_of_different_calls_fail_every_rank_naming_each_call():
    def first(coord, rank):
        key = "save step 10: write" if rank % 2 == 0 else "restore: next candidate"
        return coord.all_gather(key, rank, timeout_s=TIMEOUT_S)

    results = _on_ranks(4, _then_agree(first))
    _check_all_raised_the_mismatch(results, 4, "save step 10: write", "restore: next candidate")
    err = results[0][1][0]
    saving, restoring = "save step 10: write", "restore: next candidate"
    assert err.calls == {0: saving, 1: restoring, 2: saving, 3: restoring}
    assert "ranks 0, 2 in 'save step 10: write'" in str(err)
    assert pickle.loads(pickle.dumps(err)).calls == err.calls  # crosses ranks intact


def test_a_publisher_that_does_not_wait_still_fails_with_the_others():
    """Rank 0 publishes (it does not wait for anyone) while the others gather: they
    find its value is another call's and fill the next round with the mismatch, where
    rank 0 meets it."""

    def first(coord, rank):
        if rank == 0:
            coord.publish("save step 3: prepare", "plan", src=0, timeout_s=TIMEOUT_S)
            return coord.all_gather("save step 3: write", rank, timeout_s=TIMEOUT_S)
        return coord.all_gather("latest", rank, timeout_s=TIMEOUT_S)

    results = _on_ranks(3, _then_agree(first))
    _check_all_raised_the_mismatch(results, 3, "save step 3: prepare", "latest")


def test_a_gatherer_whose_round_a_publisher_took_fails_with_it():
    """Ranks 0 and 2 wait for rank 1's answer to a broadcast, in the key where rank 1,
    in another call, publishes."""

    def first(coord, rank):
        if rank == 1:
            coord.publish("rollback: plan", "plan", src=1, timeout_s=TIMEOUT_S)
            return coord.all_gather("rollback: done", rank, timeout_s=TIMEOUT_S)
        return coord.broadcast("list", rank, src=1, timeout_s=TIMEOUT_S)

    results = _on_ranks(3, _then_agree(first))
    _check_all_raised_the_mismatch(results, 3, "rollback: plan", "list")


def test_the_same_call_with_other_numbers_is_no_mismatch():
    """Ranks saving different steps are in the same call: its own check of the steps
    speaks (the values reach the collecting rank)."""

    def body(coord, rank):
        return coord.all_gather(f"save step {10 + rank}: prepare", rank, timeout_s=TIMEOUT_S)

    results = _on_ranks(3, body)
    assert [r[:2] for r in results] == [("ok", [0, 1, 2])] * 3


def test_calls_that_each_wait_for_a_message_the_other_never_sends_meet_at_once(monkeypatch):
    # Rank 0 collects the arguments of a rollback (it waits for rank 1's key); rank 1
    # waits for its leader's answer in a save (rank 0's key). Neither reads anything
    # of the other's, so before both waited out timeout_s (600 s by default). Both still
    # waiting after SLOW_ROUND_S (60 s by default) announce their call; the later
    # announcer finds the other call and wakes both.
    from atomic_checkpoint import coordination

    monkeypatch.setattr(coordination, "SLOW_ROUND_S", 1.0)

    def first(coord, rank):
        if rank == 0:
            coord.all_gather("'rollback(): arguments'", 1, timeout_s=TIMEOUT_S)
        else:
            coord.publish("save step 7: prepare", None, src=0, timeout_s=TIMEOUT_S)

    results = _on_ranks(2, _then_agree(first))
    _check_all_raised_the_mismatch(results, 2, "'rollback(): arguments'", "save step 7: prepare")
    assert min(r[2] for r in results) >= 1.0  # at SLOW_ROUND_S, not before


def test_rollback_on_rank_0_alone_while_the_others_save_is_a_mismatch_long_before_timeout(
    tmp_path, monkeypatch
):
    import os

    import torch

    from atomic_checkpoint import CheckpointManager, coordination

    monkeypatch.setattr(coordination, "SLOW_ROUND_S", 2.0)

    def body(coord, rank):
        with CheckpointManager(tmp_path, coordinator=coord, timeout_s=60) as mgr:
            for s in (1, 2):
                mgr.save(s, {"x": torch.full((2,), float(s))})
            got, took = _outcome_and_seconds(
                (lambda: mgr.rollback(1))
                if rank == 0
                else lambda: mgr.save(3, {"x": torch.zeros(2)})
            )
            on_disk = sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-"))
            mgr.save(4, {"x": torch.full((2,), 4.0)})  # made alike: works again
            return got, took, on_disk, [c.step for c in mgr.checkpoints()]

    results = _on_ranks(2, body)
    for rank, (kind, value, _) in enumerate(results):
        assert kind == "ok", value
        err, took, on_disk, after = value
        assert isinstance(err, CollectiveMismatchError), (rank, err)
        assert "rollback()" in str(err) and "save step 3" in str(err), str(err)
        assert took < 20, took  # at SLOW_ROUND_S (2 s here), not at timeout_s (60 s)
        assert on_disk == ["checkpoint-1", "checkpoint-2"]  # nothing deleted or committed
        assert after == [1, 2, 4]


def test_a_first_save_async_on_some_ranks_while_the_others_save_is_a_mismatch(
    tmp_path, monkeypatch
):
    # save_async on rank 0, save on rank 1: the background save talks through its own
    # store connection, made at the first save_async, so the two never met. Both waited
    # out timeout_s, and as rank 1 made no connection, every later call of the two
    # ranks failed too. The first save_async now agrees on the main connection.
    import torch

    from atomic_checkpoint import CheckpointManager, coordination

    monkeypatch.setattr(coordination, "SLOW_ROUND_S", 2.0)

    def body(coord, rank):
        with CheckpointManager(tmp_path, coordinator=coord, timeout_s=60) as mgr:
            mgr.save(1, {"x": torch.full((2,), 1.0)})
            got, took = _outcome_and_seconds(
                (lambda: mgr.save_async(3, {"x": torch.zeros(2)}).result())
                if rank == 0
                else lambda: mgr.save(3, {"x": torch.zeros(2)})
            )
            mgr.save(4, {"x": torch.full((2,), 4.0)})  # made alike: works again
            mgr.save_async(5, {"x": torch.full((2,), 5.0)}).result()  # and async too
            return got, took, [c.step for c in mgr.checkpoints()]

    results = _on_ranks(2, body)
    for rank, (kind, value, _) in enumerate(results):
        assert kind == "ok", value
        err, took, after = value
        assert isinstance(err, CollectiveMismatchError), (rank, err)
        assert "save_async" in str(err) and "save step 3" in str(err), str(err)
        assert took < 20, took  # at SLOW_ROUND_S (2 s here), not at timeout_s (60 s)
        assert after == [1, 4, 5]


def test_a_rank_that_makes_no_call_is_still_a_timeout_naming_it():
    def body(coord, rank):
        if rank == 2:
            return None
        return coord.all_gather("save step 1: write", rank, timeout_s=1.0)

    results = _on_ranks(3, body)
    for kind, err, _ in results[:2]:
        assert kind == "error" and isinstance(err, CoordinationTimeoutError)
        assert err.missing_ranks == (2,)


def test_a_save_on_rank_0_only_is_logged_long_before_its_timeout(tmp_path, monkeypatch, caplog):
    # `if rank == 0: mgr.save(...)`: rank 0 waited in silence for timeout_s (600 s by
    # default). Past SLOW_ROUND_S its log names the ranks missing and says why.
    import logging

    import torch

    from atomic_checkpoint import CheckpointManager, coordination

    monkeypatch.setattr(coordination, "SLOW_ROUND_S", 0.5)
    caplog.set_level(logging.WARNING, logger="atomic_checkpoint")

    def body(coord, rank):
        with CheckpointManager(tmp_path, coordinator=coord, timeout_s=4) as mgr:
            mgr.save(1, {"x": torch.zeros(2)})  # alike on both ranks: nothing logged
            assert not [r for r in caplog.records if "still waiting" in r.getMessage()]
            if rank == 0:
                mgr.save(2, {"x": torch.zeros(2)})

    results = _on_ranks(2, body)
    kind, err, seconds = results[0]
    assert kind == "error" and isinstance(err, CoordinationTimeoutError), err
    said = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(said) == 1, said  # once per round, by the rank that collects it
    assert said[0].startswith("rank 0: still waiting for rank(s) [1] at 'save step 2: ")
    assert "1 of 2 arrived; giving up at timeout_s=4 s" in said[0]
    assert "not only the rank under `if rank == 0:`" in said[0]
    assert seconds < 4 + 3  # the warning does not lengthen the wait

    # A timeout under twice SLOW_ROUND_S is short enough: nothing is logged before it.
    caplog.clear()
    monkeypatch.setattr(coordination, "SLOW_ROUND_S", 3.0)
    results = _on_ranks(2, lambda coord, rank: rank or coord.all_gather("k", 0, timeout_s=1))
    assert results[0][0] == "error"  # rank 0 collects; rank 1 made no call
    assert not [r for r in caplog.records if "still waiting" in r.getMessage()]


def test_a_manager_opened_on_rank_0_only_says_to_open_it_on_every_rank(tmp_path):
    # The single-writer habit: `if rank == 0: mgr = CheckpointManager(...)`. Its first
    # collective waits for the others, then says what to do, not only who is missing.
    from atomic_checkpoint import CheckpointManager

    def body(coord, rank):
        if rank == 0:
            CheckpointManager(tmp_path, coordinator=coord, timeout_s=2)

    results = _on_ranks(2, body)
    kind, err, _ = results[0]
    assert kind == "error" and isinstance(err, CoordinationTimeoutError), err
    assert err.missing_ranks == (1,)
    assert "create it on every rank" in str(err) and "if rank == 0:" in str(err)
    assert results[1][0] == "ok"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_collective_call_inside_on_commit_is_refused_there_not_a_stall(tmp_path, how):
    # on_commit runs on the coordinator only: checkpoints() there waited timeout_s for
    # ranks that never called it, then every later save failed on both ranks.
    from atomic_checkpoint import CheckpointManager

    def body(coord, rank):
        seen: list[str] = []

        def on_commit(info):
            try:
                mgr.checkpoints()
                seen.append("returned")
            except Exception as exc:
                seen.append(str(exc))

        mgr = CheckpointManager(tmp_path, coordinator=coord, on_commit=on_commit, timeout_s=20)
        for step in (1, 2):
            getattr(mgr, how)(step, {"w": [float(rank)]})
        mgr.wait()
        steps = [c.step for c in mgr.checkpoints()]
        mgr.close()
        return seen, steps

    results = _on_ranks(2, body)
    for kind, value, seconds in results:
        assert kind == "ok", value
        assert value[1] == [1, 2] and seconds < 15
    seen = results[0][1][0]
    assert len(seen) == 2 and all("made from on_commit" in s for s in seen), seen


def test_another_jobs_lock_is_a_lock_held_error_on_every_rank(tmp_path):
    # With one process it is a LockHeldError, as the docs say; with several it came as a
    # DistributedCheckpointError ("... no partial checkpoint is visible"), so `except
    # LockHeldError:` never fired under torchrun.
    from atomic_checkpoint import CheckpointManager, LockError, LockHeldError
    from atomic_checkpoint.lock import RunLock
    from atomic_checkpoint.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path))
    storage.makedirs(".atomic-checkpoint")
    other = RunLock(storage, run_id="other-job", host="node-b", heartbeat=False)
    other.acquire()

    def body(coord, rank):
        CheckpointManager(tmp_path, coordinator=coord, timeout_s=TIMEOUT_S)

    results = _on_ranks(2, body)
    for kind, err, _ in results:
        assert kind == "error" and isinstance(err, LockHeldError), err
        assert isinstance(err, LockError)
        assert "rank 0 in phase" in str(err) and "'other-job' on host 'node-b'" in str(err)
        assert "no partial checkpoint" not in str(err).lower()
    assert str(results[0][1]) == str(results[1][1])


def test_ctrl_c_in_one_ranks_save_async_fails_that_save_on_every_rank_alike(tmp_path, monkeypatch):
    # An interrupt while one rank planned its snapshot (allocating the first call's
    # buffers takes a while) was raised on that rank alone: it never joined the save,
    # and from then on the ranks were one call apart for the rest of the job (every
    # later save a CommitError, nothing committed).
    import torch

    from atomic_checkpoint import CheckpointError, CheckpointManager, serialization

    class Interrupted(dict):
        """The state whose planning Ctrl-C interrupts."""

    real_plan = serialization.plan_state

    def plan_state(state, **kw):
        if isinstance(state, Interrupted):
            raise KeyboardInterrupt
        return real_plan(state, **kw)

    monkeypatch.setattr(serialization, "plan_state", plan_state)

    def body(coord, rank):
        out = []
        with CheckpointManager(tmp_path, coordinator=coord, timeout_s=TIMEOUT_S) as mgr:
            for step in (1, 2, 3, 4, 5):
                state = Interrupted() if (rank, step) == (1, 2) else {"w": torch.ones(4) * step}
                try:
                    mgr.save_async(step, state)
                    out.append("ok")
                except KeyboardInterrupt:
                    out.append("interrupted")
                except CheckpointError as exc:
                    out.append(type(exc).__name__)
            mgr.wait()
            return out, [c.step for c in mgr.checkpoints()]

    results = _on_ranks(2, body)
    assert [r[0] for r in results] == ["ok", "ok"], results
    (out0, steps0), (out1, steps1) = results[0][1], results[1][1]
    assert out1[1] == "interrupted" and out0[1] == "ok"
    assert out0[2:] == out1[2:], (out0, out1)  # in step again: the same call raises
    assert steps0 == steps1 and 5 in steps0 and 2 not in steps0, steps0


def test_a_store_whose_host_died_is_named_as_such():
    # A rank 0 that hosts the TCPStore (a job launched without torchrun's agent) and is
    # SIGKILLed left the survivors "coordination store failed at ...: Failed to recv,
    # got 0 bytes", naming nobody.
    from atomic_checkpoint.coordination import _store_failed

    gone = _store_failed(1, "save step 2: prepare", RuntimeError("Failed to recv, got 0 bytes"))
    assert "rank 1: coordination store failed at 'save step 2: prepare'" in str(gone)
    assert "the store's host went away (rank 0" in str(gone)
    other = _store_failed(1, "k", ValueError("bad value"))
    assert "host went away" not in str(other)
