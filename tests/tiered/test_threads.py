"""A ``TieredCheckpointManager`` used from several threads of one process, as training
code does: ``close()`` from another thread than the saving one, from inside a save
(``on_commit``), interrupted by Ctrl-C, and ``on_commit(1, ...)`` callbacks that call
back into the manager."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atomic_checkpoint import CheckpointError, KeepLast, Tier, TieredCheckpointManager
from atomic_checkpoint import tiered as tiered_module

pytestmark = pytest.mark.timeout(120)


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": np.full(4096, step, dtype=np.float32)}


def tiers(tmp_path: Path, **options: Any) -> TieredCheckpointManager:
    (tmp_path / "slow").mkdir(exist_ok=True)
    return TieredCheckpointManager(
        [Tier(str(tmp_path / "fast"), retention=KeepLast(2)), Tier(str(tmp_path / "slow"))],
        timeout_s=20,
        **options,
    )


def on_tier_1(tmp_path: Path) -> list[int]:
    names = os.listdir(tmp_path / "slow")
    return sorted(int(n.split("-")[1]) for n in names if n.startswith("checkpoint-"))


def test_close_from_another_thread_waits_for_the_save_in_progress(tmp_path):
    # close() released tier 0's run lock under a saving() block of the training thread:
    # the save failed "the run lock ... is not held by this job" (or committed a step
    # after close() had returned, never replicated).
    mgr = tiers(tmp_path)
    mgr.save(1, state(1))
    inside, outcome = threading.Event(), {}

    def train() -> None:
        try:
            with mgr.saving(2) as d:
                inside.set()
                time.sleep(0.5)  # the block writes while close() is called
                (d / "weights.bin").write_bytes(b"2" * 1000)
            outcome["saved"] = d.info.step
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    assert inside.wait(10)
    t0 = time.monotonic()
    left = mgr.close()
    waited = time.monotonic() - t0
    thread.join(10)
    assert outcome == {"saved": 2}, outcome
    assert waited >= 0.3  # it waited for the block
    assert left == [] and on_tier_1(tmp_path) == [1, 2]  # and replicated what it committed
    assert mgr.close() == []  # a second close() returns what the first did


def test_close_in_on_commit_closes_after_the_save(tmp_path):
    seen: dict[str, Any] = {}

    def on_commit(tier: int, info: Any) -> None:
        if tier == 0 and info.step == 2:
            seen["returned"] = seen["mgr"].close()

    mgr = seen["mgr"] = tiers(tmp_path, on_commit=on_commit)
    mgr.save(1, state(1))
    assert mgr.save(2, state(2)).step == 2
    assert isinstance(seen["returned"], list)
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(3, state(3))
    assert on_tier_1(tmp_path) == [1, 2]  # closed once the save ended: drained


def test_ctrl_c_during_the_drain_of_close_stops_at_once(tmp_path, monkeypatch):
    # One Ctrl-C was held back until the drain ended (up to timeout_s); a second one
    # escaped close() with the replicator still copying and tier 1's lock held, and a
    # retried close() returned [] and stopped nothing.
    release = threading.Event()
    real = tiered_module.fault_point

    def stuck(where: str, rank: int, step: int) -> None:
        if where == "before_replica_commit" and step == 2:
            release.wait(30)  # an unreachable persistent tier
        real(where, rank, step)

    monkeypatch.setattr(tiered_module, "fault_point", stuck)
    # Other tests' managers may still run threads in this process: only this one's count.
    before = set(threading.enumerate())

    def ours() -> list[str]:
        return [
            t.name
            for t in threading.enumerate()
            if t not in before and t.name.startswith("atomic-checkpoint")
        ]

    mgr = tiers(tmp_path)
    mgr.save(1, state(1))
    assert mgr.wait_replicated(1, timeout_s=10)
    mgr.save(2, state(2))
    main = threading.get_ident()
    threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        mgr.close()
    assert time.monotonic() - t0 < 5  # not timeout_s (20 s)
    release.set()
    assert mgr.close() == [2]  # what did not reach tier 1, again
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        ours() or (tmp_path / "slow" / ".atomic-checkpoint" / "lock.json").exists()
    ):
        time.sleep(0.05)
    assert not ours()
    assert not (tmp_path / "slow" / ".atomic-checkpoint" / "lock.json").exists()
    assert on_tier_1(tmp_path) == [1]  # the copy in flight was discarded, never half done


def test_waiting_for_replication_in_on_commit_of_tier_1_is_refused_not_a_deadlock(tmp_path):
    # on_commit(1, info) runs on the replicator's thread: wait_replicated() there waited
    # for the replicator itself, and replication stopped for good.
    refused: list[str] = []
    holder: dict[str, TieredCheckpointManager] = {}

    def on_commit(tier: int, info: Any) -> None:
        if tier == 1:
            try:
                holder["mgr"].wait_replicated(info.step)
            except CheckpointError as exc:
                refused.append(str(exc))

    mgr = holder["mgr"] = tiers(tmp_path, on_commit=on_commit)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    assert mgr.wait_replicated(timeout_s=10)
    assert mgr.close() == [] and on_tier_1(tmp_path) == [1, 2]
    assert len(refused) == 2 and "on the replicator's thread" in refused[0], refused
