"""Shrunk counterexamples of the lifecycle model, replayed exactly.

Each test is a sequence Hypothesis found and shrank (``tests/model/test_lifecycle.py``),
written out as plain calls of the machine's rules, each followed by the invariant
check, as Hypothesis replays it. The docstring names the defect and what went wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .lifecycle import ExchangeMachine, LifecycleMachine, MarkerMachine, NoExchangeMachine

__all__ = ["ExchangeMachine", "MarkerMachine", "NoExchangeMachine"]


@contextmanager
def machine(cls: type[LifecycleMachine]) -> Iterator[LifecycleMachine]:
    state = cls()
    try:
        yield state
    finally:
        state.teardown()


class Replay:
    """The rules of one machine, each call followed by the invariant check, as
    Hypothesis replays a step."""

    def __init__(self, state: LifecycleMachine) -> None:
        self._state = state

    def __getattr__(self, rule: str) -> Callable[..., None]:
        run = getattr(self._state, rule)

        def step(**kwargs: Any) -> None:
            run(**kwargs)
            self._state.check()

        return step


@contextmanager
def replay(cls: type[LifecycleMachine]) -> Iterator[Replay]:
    with machine(cls) as state:
        yield Replay(state)


def test_copied_checkpoint_is_adopted_by_the_new_root() -> None:
    """Issue 11 defect 6. One checkpoint rsynced into a new root (no
    ``.atomic-checkpoint/``): the manager started there minted a new run id, so the
    copy was foreign and the job started from scratch silently."""
    with replay(ExchangeMachine) as state:
        state.start(policy=0)
        state.save_next(rel=1)
        state.copy_elsewhere(pick=0, two=False)


def test_save_below_the_newest_step_is_refused_and_rollback_goes_back() -> None:
    """Issue 11 defect 2. With steps 5 and 10 committed, ``save(0)`` returned success
    and ``KeepLast(2)`` then counted it as the oldest; now it raises ``StepOrderError``
    naming step 10 and ``rollback()``, and ``rollback(5)`` removes 10 so that saving
    above 5 works."""
    with replay(ExchangeMachine) as state:
        state.start(policy=2)
        state.save_next(rel=1)
        state.save_next(rel=1)
        state.save(rel=-2, overwrite=False)
        state.rollback(pick=0)
        state.save_next(rel=1)


def test_close_during_a_slow_async_save_tells_the_truth() -> None:
    """Issue 11 defect 3. ``close()`` while an async save is past its last fence (slow
    after its manifest) and ``timeout_s`` is shorter: close raised "not committed",
    released the lock, and the save committed afterwards. Now close waits for it and
    returns (committed), and ROOT does not change after close."""
    with replay(NoExchangeMachine) as state:
        state.start(policy=1)
        state.save_next(rel=1)
        state.close_during_slow_async(phase="after_manifest", rel=1, skip=0)
        state.reopen(policy=1)


def test_restore_skips_a_corrupt_newest_checkpoint() -> None:
    """Issue 11 defect 4 (single rank). The newest checkpoint fails its checksum (one
    flipped byte; sizes intact, so it is still listed): ``restore()`` raised
    ``CorruptCheckpointError`` instead of loading the next older checkpoint."""
    with replay(MarkerMachine) as state:
        state.start(policy=0)
        state.save_next(rel=1)
        state.save_next(rel=1)
        state.corrupt(pick=1, how="flip-data")
        state.restore_newest(verify=True)


def test_async_failure_seen_by_the_handle_is_raised_again_by_wait() -> None:
    """Issue 11 defect 12 (one rank's view of it). An async save fails (its step
    exists); ``handle.result()`` shows it; ``wait()`` returned None, so in a job whose
    other ranks had not looked at their handles, this rank went on alone. Now the
    manager raises the failure at the next ``wait``/``save``/``close`` regardless."""
    with replay(ExchangeMachine) as state:
        state.start(policy=0)
        state.save_next(rel=1)
        state.save_async(rel=0, overwrite=False)
        state.result()
        state.wait()


def test_listing_while_an_async_save_starts_its_rotation() -> None:
    """New find of the lifecycle model (sequence ``save_async``, ``restore_newest``):
    ``restore()``/``checkpoints()``/``latest()`` on the training thread while the async
    save's thread commits could join the rotation thread between its creation and its
    ``start()`` (``RuntimeError: cannot join thread before it is started``, not even a
    ``CheckpointError``), and could forget a rotation started meanwhile, which then ran
    on after ``close()``. The race window is a few instructions wide, so the sequence
    is repeated (bounded) instead of shrunk to one run."""
    import threading

    from .kinds import METRIC, make_state, metric_of, open_manager

    with machine(ExchangeMachine) as state:
        mgr = open_manager("exchange", state.root, (("last", 1),))
        try:
            for i in range(100):
                handle = mgr.save_async(i, make_state(i, i), metrics={METRIC: metric_of(i)})
                while not handle.done():  # ends with the save (bounded by its timeout_s)
                    mgr.checkpoints()  # raised RuntimeError in the race
            mgr.close()
            left = [t.name for t in threading.enumerate() if t.name == "atomic-checkpoint-rotation"]
            assert not left, f"rotation still running after close(): {left}"
        finally:
            mgr.close()


def test_a_taken_over_manager_raises_its_earlier_async_failure_first() -> None:
    """A model defect, found with seed 9127 (marker strategy). An async save of a step
    that exists fails (``CheckpointExistsError``), ``handle.result()`` shows it, then
    the job is restarted while the old process lives. The old manager's next ``save``
    raises that earlier failure first, as every manager does (DESIGN invariant 11: a
    failed save is raised once, at the next call, on every rank), and only the save
    after it ``FencedError``. The model expected ``FencedError`` at once; on the
    strategies that refuse the step at the call it never saw a pending failure here."""
    for cls in (MarkerMachine, ExchangeMachine):
        with replay(cls) as state:
            state.start(policy=0)
            state.save_async(rel=1, overwrite=False)
            state.save_async(rel=0, overwrite=False)
            state.result()
            state.takeover_by_restart(rel=1)


def test_a_restore_fallback_during_an_async_save_takes_steps_out_of_its_rotation() -> None:
    """Not a library defect: the model lagged behind a change. A ``restore()`` that
    skips corrupt checkpoints now takes them out of retention (it must not delete the
    one restored while keeping a corrupt newest). Here it ran while ``save_async(10)``
    was in flight, after both older checkpoints were damaged: the model predicted the
    async save's rotation with the steps still counted (deleting 5), the rotation ran
    after the restore and kept it, and the listing showed step 5 where the model said
    absent. The model now learns the skipped steps and, for a rotation in flight,
    accepts both orders."""
    with replay(ExchangeMachine) as state:
        state.start(policy=0)
        state.close()
        state.reopen(policy=0)
        state.latest()
        state.overwrite_newest()
        state.wait()
        state.save_async_next(rel=1)
        state.close()
        state.reopen(policy=0)
        state.close()
        state.corrupt(how="flip-data", pick=0)
        state.reopen(policy=0)
        state.close()
        state.reopen(policy=0)
        state.close()
        state.corrupt(how="flip-data", pick=0)
        state.reopen(policy=8)
        state.save_async_next(rel=1)
        state.restore_newest(verify=True)
        state.close()


def test_an_async_save_asked_to_stop_after_its_marker_commit_is_reported_committed() -> None:
    """Found while adding the fence check after a marker commit (a manifest PUT that
    lands after a takeover raises ``FencedError``). That check first went through the
    save's own fence, which also raises when ``close()`` has asked the async save to
    stop: a save whose manifest was already published was reported abandoned ("NOT a
    checkpoint") while it was listed. The check after the commit asks the lock only."""
    with replay(MarkerMachine) as state:
        state.start(policy=0)
        state.close()
        state.reopen(policy=0)
        state.close_during_slow_async(phase="after_manifest", rel=0, skip=0)
