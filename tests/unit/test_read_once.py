"""Rollback, and a start on a root without a run file, read what they need (issue 14).

``rollback(step)`` reads the manifests above ``step`` (what it deletes) and, below it,
down to the newest valid checkpoint (what the next save must be above), not every
manifest in ROOT. A writable start on a root that holds checkpoints but no run file must
read every manifest once, to learn which run they belong to, and not once more for the
start's own view. Each decision stays that of a full scan: other runs' checkpoints are
never deleted, corrupt ones of this run are, and the newest valid step left is the one
saves are ordered against.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, StepOrderError, catalog
from atomic_checkpoint.layout import MANIFEST_NAME, RUN_FILE
from atomic_checkpoint.storage.local import LocalStorage
from tests.helpers import CountingLocalStorage
from tests.testbed.roots import make_local_root

pytestmark = pytest.mark.timeout(120)

#: Checkpoints in ``made_root`` and ``root`` (tests/unit/conftest.py): steps 0 to N-1.
N = 200


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(16, step, dtype=np.float32)}


def _newest_step(mgr: CheckpointManager) -> int | None:
    """The newest committed step the manager holds saves against: a save of step 0 is
    refused naming it (nothing is written)."""
    try:
        mgr.save(0, _state(0))
    except StepOrderError as exc:
        return exc.newest
    raise AssertionError("a save of step 0 was accepted")


def _damage(root: Path, step: int) -> None:
    """Make checkpoint ``step`` corrupt, its manifest still readable: a data file goes."""
    d = root / f"checkpoint-{step}"
    os.unlink(d / sorted(f for f in os.listdir(d) if f != MANIFEST_NAME)[0])


def _steps(root: Path) -> list[int]:
    return [m.step for m in catalog.committed(LocalStorage(root), run_id=None, warn=False)]


def test_a_rollback_by_a_few_steps_reads_a_few_manifests(root: Path) -> None:
    storage = CountingLocalStorage(root)
    with CheckpointManager(storage) as mgr:
        storage.reset()
        assert mgr.rollback(N - 3) == [N - 1, N - 2]
        # Base: 200 (every manifest in ROOT). Now: the two removed, and the one it
        # keeps as the newest; each removal reads its manifest once more to un-commit it.
        assert storage.manifest_reads <= 6, storage.manifest_reads
        assert _newest_step(mgr) == N - 3
        mgr.save(N - 2, _state(N - 2))
    assert _steps(root) == [*range(N - 2), N - 2]


def test_a_rollback_passes_a_corrupt_checkpoint_below_the_step(root: Path) -> None:
    _damage(root, N - 3)
    with CheckpointManager(root) as mgr:
        assert mgr.rollback(N - 3) == [N - 1, N - 2]
        # The newest valid step left is below the corrupt one, as a full scan says.
        assert _newest_step(mgr) == N - 4
    # A corrupt checkpoint at the step itself is not above it: left for the user.
    assert (root / f"checkpoint-{N - 3}").is_dir()


def test_a_rollback_deletes_a_corrupt_checkpoint_of_its_run_above_the_step(root: Path) -> None:
    _damage(root, N - 1)
    with CheckpointManager(root, resume="auto") as mgr:
        assert mgr.rollback(N - 4) == [N - 1, N - 2, N - 3]
        assert _newest_step(mgr) == N - 4
    assert not (root / f"checkpoint-{N - 1}").exists()


def test_a_rollback_never_deletes_another_runs_checkpoint(tmp_path: Path) -> None:
    root = make_local_root(tmp_path / "root", range(10), run_id="ours")
    make_local_root(tmp_path / "other", [20], run_id="theirs")
    os.rename(tmp_path / "other" / "checkpoint-20", root / "checkpoint-20")
    with CheckpointManager(root, run_id="ours") as mgr:
        assert mgr.rollback(5) == [9, 8, 7, 6]
        assert _newest_step(mgr) == 5
    assert (root / "checkpoint-20").is_dir()


def test_a_start_without_a_run_file_reads_each_manifest_once(root: Path) -> None:
    recorded = catalog.recorded_run_id(LocalStorage(root))
    os.unlink(root / RUN_FILE)
    storage = CountingLocalStorage(root)
    with CheckpointManager(storage) as mgr:
        # Base: 201 (every manifest to learn the run, then the newest again).
        assert storage.manifest_reads <= N, storage.manifest_reads
        assert mgr.run_id == recorded
        assert _newest_step(mgr) == N - 1
    assert catalog.recorded_run_id(LocalStorage(root)) == recorded


def test_adopt_reads_each_committed_manifest_once(root: Path) -> None:
    # A Trainer run adopted again at each start (adopt_existing=True): the committed
    # checkpoints are settled from the one scan that also numbers the new commits, not
    # read a second time each (base: 2 reads per checkpoint, 400 here).
    from atomic_checkpoint import adopt

    stock = root / "checkpoint-500"  # a stock Trainer folder, complete by its rule
    stock.mkdir()
    (stock / "model.safetensors").write_bytes(_safetensors_bytes())
    (stock / "trainer_state.json").write_text('{"global_step": 500}')
    storage = CountingLocalStorage(root)
    result = adopt(storage, framework="hf")
    assert result.adopted == [500], result.refused
    assert sorted(result.already) == list(range(N))
    # Each committed manifest once; the stock folder's (absent) manifest is looked for
    # by the scan and again just before adopting it.
    assert storage.manifest_reads <= N + 2, storage.manifest_reads
    with CheckpointManager(root, read_only=True) as mgr:
        mgr.verify(500)
        assert mgr.latest().step == 500


def _safetensors_bytes() -> bytes:
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return struct.pack("<Q", len(header)) + header + np.zeros(2, dtype=np.float32).tobytes()


def test_an_adopt_that_adopts_nothing_records_no_run(tmp_path: Path) -> None:
    # Every folder refused (a Trainer save torn by a crash): adopt said "nothing was
    # written for them" but created the run file, so the job started next with its own
    # run_id was refused, and prune took the root for a run that holds nothing.
    from atomic_checkpoint import adopt

    torn = tmp_path / "checkpoint-500"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(_safetensors_bytes()[:-10])
    (torn / "trainer_state.json").write_text('{"global_step": 500}')
    result = adopt(tmp_path, framework="hf")
    assert result.adopted == [] and list(result.refused) == [500]
    assert catalog.recorded_run_id(LocalStorage(str(tmp_path))) is None
    with CheckpointManager(tmp_path, run_id="exp") as mgr:
        assert mgr.run_id == "exp"
    assert catalog.recorded_run_id(LocalStorage(str(tmp_path))) == "exp"
