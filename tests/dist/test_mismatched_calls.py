"""A four-rank job whose ranks make different checkpoint calls at the same point (the
bug of a call under ``if rank == 0:``): every rank raises ``CollectiveMismatchError``
naming both calls, at once rather than at the timeout, nothing is lost, and the calls
made alike afterwards work. Before, a rank read another call's value ("too many values
to unpack") and the others waited for the timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, CollectiveMismatchError, KeepLast
from tests.dist import workers
from tests.dist.launcher import ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORLD = 4
TIMEOUT_S = 20.0

# (what ranks 0 and 2 call, what ranks 1 and 3 call, the keys the error names). Pair i
# saves step 10 * (i + 1) if it saves; the calls made alike after it save that step + 1.
PAIRS = [
    ("save", "restore", ("save step 10: prepare", "restore: next candidate")),
    ("save", "latest", ("save step 20: prepare", "'latest'")),
    ("restore", "checkpoints", ("restore: next candidate", "'list'")),
    ("latest", "apply_retention", ("'latest'", "apply retention")),
    ("save", "rollback", ("save step 50: prepare", "'rollback'")),
]


def w_mismatched(rank: int, world: int, root: str) -> list[Any]:
    import torch

    mgr = CheckpointManager(root, timeout_s=TIMEOUT_S, retention=KeepLast(3))
    mgr.save(1, workers.make_state(1, rank, big_elems=64))
    step = 0
    calls = {
        "save": lambda: mgr.save(step, {"w": torch.full((4,), float(rank))}),
        "restore": mgr.restore,
        "latest": mgr.latest,
        "checkpoints": mgr.checkpoints,
        "apply_retention": mgr.apply_retention,
        "rollback": lambda: mgr.rollback(1),
    }
    out = []
    for i, (even, odd, _) in enumerate(PAIRS):
        step = 10 * (i + 1)
        t0 = time.monotonic()
        try:
            calls[even if rank % 2 == 0 else odd]()
            got: tuple[str, str] = ("ok", "")
        except Exception as exc:
            got = (type(exc).__name__, str(exc))
        took = time.monotonic() - t0
        # The same calls on every rank work again, and see every committed step.
        step += 1
        mgr.save(step, {"w": torch.full((4,), float(step + rank))})
        back = mgr.restore(step)["w"].tolist()
        out.append((got, took, back == [float(step + rank)] * 4, mgr.latest().step))
    mgr.close()
    return out


def test_ranks_in_different_calls_all_raise_the_mismatch_at_once_and_go_on(tmp_path):
    root = tmp_path / "ckpt"
    v = ok_values(run_ranks(w_mismatched, WORLD, str(root), tmp_dir=str(tmp_path), timeout_s=150))
    for i, (_, _, keys) in enumerate(PAIRS):
        for rank in range(WORLD):
            (kind, msg), took, restored, latest = v[rank][i]
            assert kind == CollectiveMismatchError.__name__, (PAIRS[i], rank, kind, msg)
            assert all(k in msg for k in keys), (PAIRS[i], rank, msg)
            assert "in the same order" in msg
            assert took < TIMEOUT_S / 2, (PAIRS[i], rank, took)  # not a timeout
            assert restored and latest == 10 * (i + 1) + 1, (PAIRS[i], rank)
    # Nothing was committed by the mismatched calls (steps 10, 20, 50), and the
    # rollback to step 1 never ran (the steps above 1 are still there).
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [31, 41, 51]
