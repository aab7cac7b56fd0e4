"""A rank that timed out waiting for the outcome of a commit, with the coordination
store out of reach, decides from the storage: success only if the committed checkpoint
is this very attempt's (issue 11, defect 14). The store-side paths (the outcome read
through a new connection, a frozen rank) run in real jobs in
``tests/dist/test_agreement.py``; this is the storage fallback, on a real directory.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, CoordinationTimeoutError, catalog
from atomic_checkpoint.commit import RankReport, SaveContext, _settle_outcome
from atomic_checkpoint.strategies import RenameStrategy


class _CutOff:
    """Rank 1 of 2, whose store does not answer: ``settle`` cannot tell."""

    rank = 1
    world_size = 2

    def settle(self, key: str, *, src: int, timeout_s: float) -> tuple[str, None]:
        return ("unknown", None)


def _timeout() -> CoordinationTimeoutError:
    return CoordinationTimeoutError(
        "rank 1: the coordination store did not answer at 'save step 3: commit'",
        key="save step 3: commit",
    )


@pytest.fixture
def committed(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, {"w": np.arange(64, dtype=np.float32)})
    ctx = SaveContext(
        storage=mgr.storage,
        coord=_CutOff(),  # type: ignore[arg-type]
        run_id=mgr.run_id,
        timeout_s=1.0,
        strategy=RenameStrategy(),
    )
    yield ctx, catalog.read_manifest(mgr.storage, "checkpoint-3")
    mgr.close()


def test_own_committed_attempt_is_reported_as_success(committed):
    ctx, manifest = committed
    mine = RankReport(manifest.files, 0.0, 0.0)  # the files this rank wrote, as listed
    staged = ".pending/checkpoint-3.0123456789abcdef"  # renamed away by the commit
    verdict = _settle_outcome(ctx, 3, staged, mine, _timeout())
    # As the leader publishes it: ("ok", (manifest, its domain view, publish_s), combined).
    assert verdict[0] == "ok" and verdict[1][0].step == 3
    assert verdict[1][0].commit_seq == manifest.commit_seq


def test_another_copy_of_the_step_is_not_this_attempts_success(committed):
    ctx, manifest = committed
    other = tuple(dataclasses.replace(f, checksum="0" * 16) for f in manifest.files)
    staged = ".pending/checkpoint-3.0123456789abcdef"
    with pytest.raises(CoordinationTimeoutError, match="may have committed checkpoint step 3"):
        _settle_outcome(ctx, 3, staged, RankReport(other, 0.0, 0.0), _timeout())


def test_an_attempt_still_pending_is_not_committed(committed, tmp_path):
    ctx, manifest = committed
    staged = ".pending/checkpoint-3.0123456789abcdef"
    (tmp_path / staged).mkdir(parents=True)  # still there: the rename never happened
    with pytest.raises(CoordinationTimeoutError, match="may have committed"):
        _settle_outcome(ctx, 3, staged, RankReport(manifest.files, 0.0, 0.0), _timeout())
