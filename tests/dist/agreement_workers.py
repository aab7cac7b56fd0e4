"""Rank functions for the agreement tests (``test_agreement.py``): collective answers of
``restore()`` and of a save's outcome, run in real multi-process gloo jobs."""

from __future__ import annotations

import os
import time
from typing import Any

from atomic_checkpoint import CheckpointManager
from tests.dist.workers import make_state, states_equal
from tests.helpers import library_warnings

SMALL = 1 << 10


def w_save(rank: int, world: int, root: str, steps: list[int]) -> list[int]:
    """Save ``steps`` in order with small states; return them."""
    mgr = CheckpointManager(root, timeout_s=20)
    for s in steps:
        mgr.save(s, make_state(s, rank, big_elems=SMALL))
    mgr.close()
    return steps


def w_resume_with_corrupt(rank: int, world: int, root: str, newest: int) -> dict[str, Any]:
    """Resume (``restore()``), then ask for the corrupt ``newest`` by step, then one more
    collective: every answer is recorded, nothing is allowed to escape."""
    seen = library_warnings()
    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, timeout_s=20)
    latest = mgr.latest()
    out["latest"] = latest.step if latest else None
    try:
        state = mgr.restore()
        out["resumed_step"] = state["step"]
        out["resumed_exact"] = states_equal(state, make_state(state["step"], rank, big_elems=SMALL))
        out["last_restored"] = mgr.last_restored.step if mgr.last_restored else None
    except Exception as exc:
        out["resume_error"] = f"{type(exc).__name__}: {exc}"
    out["warnings"] = list(seen.messages)
    try:
        mgr.restore(step=newest)
        out["by_step"] = None
    except Exception as exc:
        out["by_step"] = (type(exc).__name__, str(exc))
    # Every rank is still in step with the others: this collective completes.
    out["after"] = [c.step for c in mgr.checkpoints()]
    mgr.close()
    return out


def w_timed_save_then_list(
    rank: int, world: int, root: str, step: int, timeout_s: float
) -> dict[str, Any]:
    """Save ``step - 1``, then ``step`` (the fault strikes here); report the outcome of
    the second save as data, and what the storage shows afterwards."""
    mgr = CheckpointManager(root, timeout_s=timeout_s)
    mgr.save(step - 1, make_state(step - 1, rank, big_elems=SMALL))
    t = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        info = mgr.save(step, make_state(step, rank, big_elems=SMALL))
        out["saved"] = info.step
    except Exception as exc:
        out["error"] = (type(exc).__name__, str(exc))
    out["elapsed_s"] = time.monotonic() - t
    return out


def overwrite_state(it: int, rank: int) -> dict[str, Any]:
    """The state of step 5 as saved by overwrite number ``it``: same sizes every time,
    so only the contents (and the checksums) tell the copies apart."""
    import torch

    return {"it": it, "rank": rank, "w": torch.full((4096,), float(it))}


def _wait_for(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write("x")


def w_overwriter(rank: int, world: int, root: str, gates: str, rounds: list[int]) -> list[int]:
    """Save step 5 again with ``overwrite=True`` once per round, each time when the reader
    says it is about to open a file (``go-<it>``), then say so (``done-<it>``)."""
    mgr = CheckpointManager(root, timeout_s=30)
    for it in rounds:
        if rank == 0:
            _wait_for(os.path.join(gates, f"go-{it}"))
        mgr.checkpoints()  # collective: every rank waits for the reader's signal
        mgr.save(5, overwrite_state(it, rank), overwrite=True)
        if rank == 0:
            _touch(os.path.join(gates, f"done-{it}"))
    mgr.close()
    return rounds


def _gate_opens(gates: str, plan: dict[str, list[int]]) -> None:
    """Make this process's first open of each file named in ``plan`` wait for one
    overwrite: announce ``go-<it>``, wait for ``done-<it>``, then open. The reader has
    read the manifest of the old copy by then; the file it opens is the new copy's."""
    from atomic_checkpoint.storage.local import LocalStorage

    real = LocalStorage.open_read

    def gated(self: Any, path: str) -> Any:
        for suffix, its in plan.items():
            if path.endswith(suffix) and its:
                it = its.pop(0)
                _touch(os.path.join(gates, f"go-{it}"))
                _wait_for(os.path.join(gates, f"done-{it}"))
        return real(self, path)

    LocalStorage.open_read = gated  # type: ignore[method-assign]


def w_gated_reader(rank: int, world: int, root: str, gates: str) -> dict[str, Any]:
    """A separate read-only job of the same world size, racing the overwriter:

    1. ``restore(5, verify=False)``: rank 1 opens its file after overwrite 2, rank 0
       before (a mix of copies unless the ranks notice);
    2. ``restore(5)`` (verified): rank 1 opens after overwrite 3 (a false checksum
       failure unless it notices);
    3. rank 0 alone: ``verify(5)`` opens after overwrite 4, ``atomic-checkpoint verify``
       after overwrite 5.
    """
    from atomic_checkpoint.cli import main as cli_main

    mine = f"rank-{rank:05d}.safetensors"
    plan: dict[str, list[int]] = {mine: []}
    _gate_opens(gates, plan)
    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, read_only=True, timeout_s=60)
    for name, verify, it in (("unverified", False, 2), ("verified", True, 3)):
        plan[mine] = [it] if rank == 1 else []
        try:
            out[name] = mgr.restore(5, verify=verify)["it"]
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        plan[mine] = [4]
        try:
            out["verify"] = mgr.verify(5).step
        except Exception as exc:
            out["verify"] = f"{type(exc).__name__}: {exc}"
        plan[mine] = [5]
        out["cli_verify"] = cli_main(["verify", root, "5", "--quiet"])
    mgr.checkpoints()  # collective: both ranks are done reading
    return out


def _until_main_thread_waits() -> None:
    """Return once the main thread is blocked waiting for this exchange thread, with a
    timeout (``Condition.wait`` at its timed ``acquire``, called from the exchange's
    ``run``): a freeze from here on finds the main thread's deadline already running,
    as a freeze at any later moment of a long wait would. Seen there twice, 20 ms
    apart (this thread sleeping in between), so it is not merely about to block."""
    import linecache
    import sys
    import threading

    def blocked() -> bool:
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is None or frame.f_code.co_name != "wait":
            return False
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        return "acquire(True, timeout)" in line and "run" in names

    for _ in range(10_000):
        if blocked():
            time.sleep(0.02)
            if blocked():
                return
        time.sleep(0.001)
    raise AssertionError("the main thread never waited for the exchange")


def _until_woken() -> None:
    """Return once this process has been stopped and continued: a signal sent to
    oneself may take effect a moment after ``kill`` returned. A short sleep that ends
    much later than asked is the freeze."""
    for _ in range(10_000):
        t = time.monotonic()
        time.sleep(0.01)
        if time.monotonic() - t > 1.0:
            return
    raise AssertionError("this process was never stopped")


def _stall_outcome_wait(rank: int, victim: int, step: int, how: str) -> None:
    """On ``victim``: stall the exchange thread that waits for the published outcome of
    the save of ``step``, while the main thread waits for that thread. ``stop``: the
    whole process freezes (SIGSTOP, every thread) until the test sends SIGCONT; ``hang``:
    that thread never returns (a store connection that hangs)."""
    if rank != victim:
        return
    import signal

    from atomic_checkpoint.coordination import TorchDistributedCoordinator

    real = TorchDistributedCoordinator._publish

    def stalled(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        if key == f"save step {step}: commit":
            if how == "stop":
                _until_main_thread_waits()
                os.kill(os.getpid(), signal.SIGSTOP)
                _until_woken()
                # Woken: this thread gets the CPU after the main thread, as on a loaded
                # machine (the campaign's case), so the main thread sees its deadline
                # passed first. Any value works with the fix: the frozen time does not
                # count against the deadline, and the exchange then completes.
                time.sleep(0.5)
            else:
                time.sleep(3600)
        return real(self, key, *args, **kwargs)

    TorchDistributedCoordinator._publish = stalled  # type: ignore[method-assign]


def w_stalled_outcome(
    rank: int, world: int, root: str, step: int, timeout_s: float, victim: int, how: str
) -> dict[str, Any]:
    """``w_timed_save_then_list`` with ``victim`` stalled at the outcome of ``step``."""
    _stall_outcome_wait(rank, victim, step, how)
    return w_timed_save_then_list(rank, world, root, step, timeout_s)


def w_mismatched_flags(rank: int, world: int, root: str) -> dict[str, Any]:
    """Saves whose ``replicated=`` or ``overwrite=`` differs by rank (rank 0 passes
    True, the others False), then a save passed alike: each outcome, with its time."""
    import numpy as np

    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, timeout_s=30)
    mgr.save(1, {"w": np.full(4, rank)})

    def attempt(name: str, call: Any) -> None:
        t = time.monotonic()
        try:
            out[name] = ("ok", call(), time.monotonic() - t)
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - t)

    def in_a_block() -> int:
        with mgr.saving(1, overwrite=rank == 0) as d:
            (d / f"rank-{rank}.txt").write_text("x")
        return 1

    first = rank == 0
    attempt("replicated", lambda: mgr.save(2, {"w": np.full(4, rank)}, replicated=first).step)
    attempt("overwrite", lambda: mgr.save(1, {"w": np.full(4, 10 + rank)}, overwrite=first).step)
    attempt("saving", in_a_block)
    attempt("next", lambda: mgr.save(3, {"w": np.full(4, rank)}).step)
    out["restored_1"] = mgr.restore(1)["w"].tolist()
    out["steps"] = [c.step for c in mgr.checkpoints()]
    mgr.close()
    return out
