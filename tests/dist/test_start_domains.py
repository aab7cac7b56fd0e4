"""Node-local disks at a writable start (issue 14): each domain leader reads its newest
few valid checkpoints, not its whole root, and every rank still agrees on the newest
step valid on every node, also when the nodes' newest steps differ by more than that
(the leaders then list every valid step, as every start did before)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, StepOrderError
from tests.dist.launcher import ok_values, run_ranks
from tests.helpers import CountingLocalStorage
from tests.testbed.roots import make_local_root

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

STEPS = 50


def w_open(rank: int, world: int, base: str) -> dict[str, Any]:
    """Two ranks per "node", each node with its own root: open, then report the
    manifests this rank read and the newest step agreed at open (a save of step 0 is
    refused naming it; nothing is written)."""
    from atomic_checkpoint.domains import HOST_ENV

    node = rank // 2
    os.environ[HOST_ENV] = f"node{node}"
    storage = CountingLocalStorage(os.path.join(base, f"node{node}"))
    mgr = CheckpointManager(storage, timeout_s=10)
    reads = storage.manifest_reads
    newest = None
    try:
        mgr.save(0, {"w": np.zeros(4, dtype=np.float32)})
    except StepOrderError as exc:
        newest = exc.newest
    mgr.close()
    return {"reads": reads, "newest": newest, "domains": mgr.domain.count}


def _two_nodes(base: Path, node1_newest: int) -> None:
    """Node 0 holds steps 0..STEPS-1 of one run; node 1 the same run up to
    ``node1_newest`` (its later saves failed there)."""
    node0 = make_local_root(base / "node0", range(STEPS))
    shutil.copytree(node0, base / "node1", symlinks=True)
    for step in range(node1_newest + 1, STEPS):
        shutil.rmtree(base / "node1" / f"checkpoint-{step}")


def test_leaders_read_their_newest_few_when_the_nodes_nearly_agree(tmp_path: Path) -> None:
    # A save that failed half way: node 0 committed the last step, node 1 did not.
    _two_nodes(tmp_path, STEPS - 2)
    values = ok_values(run_ranks(w_open, 4, str(tmp_path), tmp_dir=str(tmp_path)))
    assert [v["domains"] for v in values] == [2, 2, 2, 2]
    assert [v["newest"] for v in values] == [STEPS - 2] * 4
    # Base: every leader read its whole root (50 and 49 manifests).
    assert all(v["reads"] <= 3 for v in values), [v["reads"] for v in values]


def test_every_rank_agrees_when_the_nodes_differ_by_many_steps(tmp_path: Path) -> None:
    _two_nodes(tmp_path, STEPS - 11)
    values = ok_values(run_ranks(w_open, 4, str(tmp_path), tmp_dir=str(tmp_path)))
    assert [v["newest"] for v in values] == [STEPS - 11] * 4
    # Their newest few steps have none in common: each leader listed every valid step,
    # each manifest read once.
    assert [v["reads"] for v in values] == [STEPS, 0, STEPS - 10, 0]


def w_open_refused(rank: int, world: int, base: str) -> dict[str, Any]:
    """Two "nodes" with their own roots, node 1's held by another live job: every rank's
    start fails alike. Then node 0's root must be free again: a new job opens it without
    a takeover (node 0's leader took its lock before learning of node 1's refusal)."""
    from atomic_checkpoint.domains import HOST_ENV

    node = rank // 2
    os.environ[HOST_ENV] = f"node{node}"
    try:
        CheckpointManager(os.path.join(base, f"node{node}"), timeout_s=10, lease_s=5)
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    else:
        error = None
    return {"error": error}


def test_a_start_refused_on_one_node_leaves_no_lock_held_on_the_others(tmp_path: Path) -> None:
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    other = CheckpointManager(tmp_path / "node1", run_id="other-job")  # a live second job
    try:
        values = ok_values(run_ranks(w_open_refused, 4, str(tmp_path), tmp_dir=str(tmp_path)))
    finally:
        other.close()
    errors = {v["error"] for v in values}
    assert len(errors) == 1 and None not in errors, values  # one error, on every rank
    ((_kind, message),) = errors
    assert "other-job" in message or "lock" in message.lower(), message
    # Node 0's lock went with the failed start: a new job gets it at once, no takeover.
    again = CheckpointManager(tmp_path / "node0", timeout_s=10)
    again.close()
