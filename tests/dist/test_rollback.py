"""Saves below the newest step, and ``rollback``, in real multi-process jobs (gloo):
every rank refuses the same save with the same ``StepOrderError`` before anything is
written, and ``rollback`` is one collective answer, on shared storage and on node-local
disks (one storage domain per node) alike (issue 11, defect 2).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, KeepLast
from tests.dist.launcher import ok_values, run_ranks
from tests.dist.workers import make_state, states_equal

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _state(step: int, rank: int) -> dict[str, Any]:
    return make_state(step, rank, n_big=1, big_elems=256)


def w_go_back(rank: int, world: int, base: str, node_local: bool) -> dict[str, Any]:
    root = base
    if node_local:
        from atomic_checkpoint.domains import HOST_ENV

        os.environ[HOST_ENV] = f"node{rank // 2}"
        root = os.path.join(base, f"node{rank // 2}")
    mgr = CheckpointManager(root, timeout_s=20, retention=KeepLast(2))
    mgr.save(100, _state(100, rank))
    mgr.save(200, _state(200, rank))
    out: dict[str, Any] = {"domains": mgr.domain.count}
    out["restored_100"] = states_equal(mgr.restore(100), _state(100, rank))
    refusals = []
    for call in (mgr.save, mgr.save_async):
        try:
            call(110, _state(110, rank))
            refusals.append(None)
        except Exception as exc:
            # Node-local disks: each node names its own root.
            refusals.append((type(exc).__name__, str(exc).replace(root, "ROOT")))
    out["refusals"] = refusals
    out["listed_before"] = [c.step for c in mgr.checkpoints()]
    out["removed"] = mgr.rollback(100)
    mgr.save(110, _state(110, rank))
    out["listed_after"] = [c.step for c in mgr.checkpoints()]
    out["restored_110"] = states_equal(mgr.restore(110), _state(110, rank))
    mgr.close()
    return out


@pytest.mark.parametrize("node_local", [False, True], ids=["shared", "node-local"])
def test_every_rank_refuses_the_same_save_and_rolls_back_together(tmp_path, node_local):
    base = tmp_path / "ckpt"
    results = run_ranks(w_go_back, 4, str(base), node_local, tmp_dir=str(tmp_path), timeout_s=150)
    values = ok_values(results)
    assert {v["domains"] for v in values} == {2 if node_local else 1}
    assert all(v["restored_100"] and v["restored_110"] for v in values)
    # save() and save_async() of step 110 were refused on every rank, identically.
    refusals = {tuple(v["refusals"]) for v in values}
    assert len(refusals) == 1
    for kind, message in refusals.pop():
        assert kind == "StepOrderError"
        assert "cannot save step 110: step 200 is already committed" in message
    assert all(v["listed_before"] == [100, 200] for v in values)
    assert all(v["removed"] == [200] for v in values)
    assert all(v["listed_after"] == [100, 110] for v in values)
    roots = [base / "node0", base / "node1"] if node_local else [base]
    for root in roots:
        names = sorted(n for n in os.listdir(root) if n.startswith("checkpoint-"))
        assert names == ["checkpoint-100", "checkpoint-110"], root


def w_undecided(rank: int, world: int, base: str) -> dict[str, Any]:
    from atomic_checkpoint import StepOrderError
    from atomic_checkpoint.domains import HOST_ENV

    os.environ[HOST_ENV] = f"node{rank}"
    root = os.path.join(base, f"node{rank}")
    mgr = CheckpointManager(root, timeout_s=20)
    for step in range(1, 10):
        mgr.save(step, _state(step, rank))
    if rank == 1:
        # Node 1's copies of steps 5-8 lose a file: its newest valid steps at or below 8
        # are 4, 3, 2, while node 0's are 8, 7, 6. Those views share no step, so the
        # rollback must list every valid step to find the newest one both have.
        for step in range(5, 9):
            os.unlink(os.path.join(root, f"checkpoint-{step}", "rank-00001.safetensors"))
    out: dict[str, Any] = {"removed": mgr.rollback(8)}
    try:
        mgr.save(3, _state(3, rank))
        out["refused"] = None
    except StepOrderError as exc:
        out["refused"] = exc.newest
    mgr.close()
    return out


def test_rollback_whose_domains_views_do_not_decide_lists_every_valid_step(tmp_path):
    results = run_ranks(
        w_undecided, 2, str(tmp_path / "ckpt"), tmp_dir=str(tmp_path), timeout_s=150
    )
    values = ok_values(results)
    assert all(v["removed"] == [9] for v in values)
    # The newest step valid in both domains is 4: a save of 3 is refused on every rank.
    assert all(v["refused"] == 4 for v in values), values
