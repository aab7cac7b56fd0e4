"""What the ranks of a :class:`reliability.jobs.ForkJob` run (importable by the
forkserver's children)."""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

from atomic_checkpoint import CheckpointManager, KeepLast

from .checks import describe_error, expected_state, states_equal
from .jobs import mark, set_epoch


def w_save_loop(
    rank: int,
    world: int,
    roots: list[str],
    steps: list[int],
    size: int,
    timeout_s: float,
    keep_last: int,
    use_async: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Start (resume from the newest checkpoint, checking it restores exactly), then
    save ``steps`` in order with ``KeepLast(keep_last)``; report how far it got.
    ``storage_options``: fsspec's options for URL roots (``s3://...``).

    With ``use_async`` the saves are ``save_async`` (snapshot, then write and commit in
    the background); a step counts as done once a later call returned without raising
    its failure (the next ``save_async`` waits for it, ``wait`` for the last one).

    Every failure is reported as data, so the parent can judge each rank's error.
    """
    out: dict[str, Any] = {"done": [], "error": None, "latest": None, "restored": None}
    try:
        mark("startup")
        mgr = CheckpointManager(
            roots[rank],
            retention=KeepLast(keep_last),
            timeout_s=timeout_s,
            storage_options=storage_options,
        )
        mark("resume")
        latest = mgr.latest()
        if latest is not None:
            out["latest"] = latest.step
            out["restored"] = states_equal(mgr.restore(), expected_state(latest.step, rank, size))
        for i, s in enumerate(steps):
            mark("prepare")
            if use_async:
                mgr.save_async(s, expected_state(s, rank, size))
                out["done"] = steps[:i]  # save_async first waited for the previous one
            else:
                mgr.save(s, expected_state(s, rank, size))
                out["done"].append(s)
        if use_async:
            mark("wait")
            mgr.wait()
            out["done"] = list(steps)
        mark("close")
        mgr.close()
        mark("idle")
    except Exception as exc:
        out["error"] = describe_error(exc)
        out["traceback"] = traceback.format_exc()
    return out


def w_timed_save(
    rank: int,
    world: int,
    roots: list[str],
    step: int,
    size: int,
    sizes: dict[int, int],
    timeout_s: float,
    frozen_at_outcome: int | None = None,
) -> dict[str, Any]:
    """Save ``step - 1`` (all ranks healthy), then ``step`` with rank-specific tensor
    sizes (``sizes``), timing how long the save of ``step`` takes to return or raise.

    Rank ``frozen_at_outcome`` freezes (SIGSTOP, from its exchange thread) when it is
    about to wait for the outcome of the commit of ``step``, its main thread waiting for
    that thread; the hang campaign wakes it."""
    if rank == frozen_at_outcome:
        _freeze_at_outcome(step)
    out: dict[str, Any] = {"error": None, "elapsed_s": None, "first": None}
    try:
        mgr = CheckpointManager(roots[rank], timeout_s=timeout_s)
        mgr.save(step - 1, expected_state(step - 1, rank, size))
        out["first"] = step - 1
        set_epoch("timed:")
        mark("ready")
        t = time.monotonic()
        out["t_start"] = t
        try:
            mgr.save(step, expected_state(step, rank, sizes.get(rank, size)))
        except Exception as exc:
            out["error"] = describe_error(exc)
        # CLOCK_MONOTONIC is one clock for every process of the machine: the parent
        # compares these with the moment it froze a rank.
        out["t_end"] = time.monotonic()
        out["elapsed_s"] = out["t_end"] - t
        mark("saved")
        mgr.close()
    except Exception as exc:
        out["error"] = out["error"] or describe_error(exc)
        out["setup_error"] = True
    return out


def _freeze_at_outcome(step: int) -> None:
    from atomic_checkpoint.coordination import TorchDistributedCoordinator

    real = TorchDistributedCoordinator._publish

    def frozen(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        if key == f"save step {step}: commit":
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, key, *args, **kwargs)

    TorchDistributedCoordinator._publish = frozen  # type: ignore[method-assign]


def w_disk_full(
    rank: int,
    world: int,
    root: str,
    small: int,
    big: dict[int, int],
    filler: str,
    leave_free: int,
) -> dict[str, Any]:
    """Disk-full sequence on a small filesystem.

    1. save step 1 with ``small`` tensors (fits);
    2. the coordinator fills the disk with ``filler`` until ``leave_free`` bytes are
       free;
    3. save step 2 with ``big[rank]`` tensors (does not fit): must fail on every rank,
       leave step 1 as the newest checkpoint and give back the space it took;
    4. the coordinator removes ``filler``; save step 2 again with the same manager
       (must succeed) and restore it.
    """
    out: dict[str, Any] = {"error": None, "retry_error": None, "restored": None}
    mine = big.get(rank, small)
    mgr = CheckpointManager(root, timeout_s=60)
    mgr.save(1, expected_state(1, rank, small))
    if mgr.is_coordinator:
        _fill(filler, max(0, _free(root) - leave_free))
        out["free_before"] = _free(root)
    mgr.checkpoints()  # collective: nobody saves before the disk is full
    t = time.monotonic()
    try:
        mgr.save(2, expected_state(2, rank, mine))
        out["saved_full"] = True
    except Exception as exc:
        out["error"] = describe_error(exc)
    out["fail_s"] = time.monotonic() - t
    out["steps_after"] = [c.step for c in mgr.checkpoints()]
    if mgr.is_coordinator:
        out["free_after"] = _free_settled(root, out["free_before"] - (256 << 10))
        out["pending_after"] = sorted(os.listdir(os.path.join(root, ".pending")))
        os.unlink(filler)
    mgr.checkpoints()  # collective: nobody retries before the space is freed
    try:
        mgr.save(2, expected_state(2, rank, mine))
        out["restored"] = states_equal(mgr.restore(2), expected_state(2, rank, mine))
    except Exception as exc:
        out["retry_error"] = describe_error(exc)
    mgr.close()
    return out


def _fill(path: str, n: int) -> None:
    chunk = b"\0" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = n
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _free_settled(path: str, target: int, timeout_s: float = 5.0) -> int:
    """Free bytes once deletes have settled: XFS frees the blocks of unlinked inodes in
    the background (deferred inode inactivation), so ``statvfs`` right after a delete
    can still count them as used. Polls, with a sync, until ``target`` bytes are free
    again or ``timeout_s`` passes; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    free = _free(path)
    while free < target and time.monotonic() < deadline:
        os.sync()
        time.sleep(0.05)
        free = _free(path)
    return free
