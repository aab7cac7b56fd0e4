"""``close()`` called inside a save on the save's own thread: a SIGTERM handler that
interrupts ``save``/``save_async`` (the signal is raised at an exact point of the save,
in this process), or ``on_commit``.

Closed at once, the manager released the run lock under the save, which went on when the
handler returned: it failed with "the run lock is not held by this job" (read as another
job having taken ROOT), or committed without the lock; inside ``save_async``'s copy,
close() waited ``timeout_s`` for bytes that only the interrupted thread could copy, then
abandoned the save. Now the save ends first, then the manager closes.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from atomic_checkpoint import CheckpointError, CheckpointManager, async_save, commit

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def closing_handler() -> Iterator[dict[str, Any]]:
    """SIGUSR1 runs ``seen["mgr"].close()``, as a SIGTERM handler would; ``seen`` says
    how long close() took and what it raised."""
    seen: dict[str, Any] = {}

    def handler(_signum: int, _frame: Any) -> None:
        t0 = time.monotonic()
        try:
            seen["mgr"].close()
        except BaseException as exc:  # reported, not raised into the save
            seen["raised"] = exc
        seen["close_s"] = time.monotonic() - t0

    previous = signal.signal(signal.SIGUSR1, handler)
    yield seen
    signal.signal(signal.SIGUSR1, previous)


def _reopened_latest(root: Any) -> int | None:
    # The lock was released (no takeover needed), and the committed step is there.
    with CheckpointManager(root, timeout_s=5) as again:
        info = again.latest()
        return None if info is None else info.step


@pytest.mark.parametrize("phase", ["before_write", "after_write"])
def test_a_signal_handler_that_closes_during_save_lets_the_save_commit_first(
    tmp_path, monkeypatch, closing_handler, phase, caplog
):
    real = commit.fault_point

    def signal_at(where: str, rank: int, step: int) -> None:
        if where == phase and step == 2:
            signal.raise_signal(signal.SIGUSR1)  # the handler runs here, inside the save
        real(where, rank, step)

    monkeypatch.setattr(commit, "fault_point", signal_at)
    mgr = closing_handler["mgr"] = CheckpointManager(tmp_path, timeout_s=10)
    mgr.save(1, {"w": torch.ones(8)})
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        info = mgr.save(2, {"w": torch.full((8,), 2.0)})
    assert info.step == 2  # committed with the run lock held, then closed
    assert "raised" not in closing_handler and closing_handler["close_s"] < 1.0
    assert "closes as soon as that save has ended" in caplog.text
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(3, {"w": torch.ones(8)})
    assert _reopened_latest(tmp_path) == 2
    assert "took over the run lock" not in caplog.text


def test_a_signal_handler_that_closes_during_the_async_copy_returns_at_once(
    tmp_path, monkeypatch, closing_handler
):
    real = async_save.Snapshot.copy

    def copy_interrupted(self: Any) -> None:
        signal.raise_signal(signal.SIGUSR1)  # as the copy begins: the writer waits for it
        real(self)

    monkeypatch.setattr(async_save.Snapshot, "copy", copy_interrupted)
    mgr = closing_handler["mgr"] = CheckpointManager(tmp_path, timeout_s=5)
    handle = mgr.save_async(1, {"w": torch.ones(1 << 16)})
    # close() waited timeout_s (5 s here, 600 by default) for the copy it interrupted,
    # then abandoned the save.
    assert "raised" not in closing_handler, closing_handler["raised"]
    assert closing_handler["close_s"] < 1.0, closing_handler
    assert handle.result(timeout=10).step == 1
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save_async(2, {"w": torch.ones(8)})
    assert _reopened_latest(tmp_path) == 1


def test_close_in_on_commit_of_a_synchronous_save_closes_after_it(tmp_path):
    seen: dict[str, Any] = {}

    def on_commit(info: Any) -> None:
        seen["mgr"].close()
        seen["held_in_callback"] = seen["mgr"]._lock is not None

    mgr = seen["mgr"] = CheckpointManager(tmp_path, on_commit=on_commit)
    assert mgr.save(1, {"w": torch.ones(8)}).step == 1
    # Released after the save's retention, not under it.
    assert seen["held_in_callback"] and mgr._lock is None
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(2, {"w": torch.ones(8)})
    assert _reopened_latest(tmp_path) == 1
