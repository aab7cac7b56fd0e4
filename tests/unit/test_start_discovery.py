"""A writable start that does not read the whole root (issue 14), counted.

Restarting a job on a root of many checkpoints must not read every manifest before
training resumes: the start reads this run's newest valid checkpoint (and whatever is
newer than it) and stops. Every decision of the full scan it replaces stays the same:
the resume modes on roots holding only corrupt checkpoints, a corrupt newest one,
other runs' checkpoints and directories that are not ours; the next commit number above
every copy a save can replace; retention, whose first pass reads the rest once.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atomic_checkpoint import (
    CheckpointManager,
    CheckpointNotFoundError,
    KeepLast,
    ResumeError,
    StepOrderError,
    catalog,
)
from atomic_checkpoint.layout import MANIFEST_NAME
from atomic_checkpoint.storage.local import LocalStorage
from tests.helpers import CountingLocalStorage
from tests.testbed.roots import make_local_root

pytestmark = pytest.mark.timeout(120)

#: Checkpoints in ``made_root`` and ``root`` (tests/unit/conftest.py): steps 0 to N-1.
N = 200
#: What a start may read on a root whose newest checkpoint is valid: its manifest (and,
#: for a checkpoint damaged above it, one more).
HANDFUL = 2


def _damage(root: Path, step: int) -> None:
    """Make checkpoint ``step`` corrupt, its manifest still readable: a data file goes."""
    d = root / f"checkpoint-{step}"
    data = sorted(f for f in os.listdir(d) if f != MANIFEST_NAME)
    os.unlink(d / data[0])


def _tear(root: Path, step: int) -> None:
    """Make checkpoint ``step`` corrupt with a manifest that does not parse."""
    (root / f"checkpoint-{step}" / MANIFEST_NAME).write_bytes(b'{"step": ')


def _seq(root: Path, step: int) -> int:
    return int(json.loads((root / f"checkpoint-{step}" / MANIFEST_NAME).read_bytes())["commit_seq"])


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(16, step, dtype=np.float32)}


def _newest_step(mgr: CheckpointManager) -> int | None:
    """The newest committed step the manager agreed at open, as a user meets it: a save
    of step 0 is refused naming it (nothing is written)."""
    try:
        mgr.save(0, _state(0))
    except StepOrderError as exc:
        return exc.newest
    raise AssertionError("a save of step 0 was accepted")


# ---------------------------------------------------------------------- reads
def test_a_writable_start_reads_a_handful_of_manifests(root: Path) -> None:
    storage = CountingLocalStorage(root)
    mgr = CheckpointManager(storage)
    # Base: 200 (every manifest in ROOT was read and validated at open).
    assert storage.manifest_reads <= HANDFUL, storage.manifest_reads
    assert storage.size_checks <= HANDFUL, storage.size_checks
    assert mgr.run_id == catalog.recorded_run_id(LocalStorage(root))
    assert _newest_step(mgr) == N - 1
    info = mgr.save(N, _state(N))
    assert info.commit_seq > _seq(root, N - 1)
    mgr.close()


def test_the_start_reads_down_to_the_newest_valid_checkpoint_only(root: Path) -> None:
    _damage(root, N - 1)
    _tear(root, N - 2)
    storage = CountingLocalStorage(root)
    mgr = CheckpointManager(storage, resume="must")
    # Two corrupt ones above the newest valid one: three checkpoints read, not 200 (a
    # damaged one's manifest is read again, to tell damage from a concurrent overwrite
    # or delete).
    assert storage.manifest_reads <= 6, storage.manifest_reads
    assert _newest_step(mgr) == N - 3
    mgr.close()


def test_the_first_rotation_reads_the_rest_once_then_only_what_changed(root: Path) -> None:
    storage = CountingLocalStorage(root)
    mgr = CheckpointManager(storage, retention=KeepLast(N))
    storage.reset()
    # Retention needs every checkpoint of the run: the first pass (on the rotation
    # thread, after the save returned) reads the manifests the start did not.
    mgr.save(N, _state(N))
    mgr.wait()
    assert storage.manifest_reads <= N + HANDFUL, storage.manifest_reads  # each one once
    assert not (root / "checkpoint-0").exists()
    for step in (N + 1, N + 2):
        storage.reset()
        mgr.save(step, _state(step))
        mgr.wait()
        assert storage.manifest_reads <= HANDFUL, (step, storage.manifest_reads)
        assert not (root / f"checkpoint-{step - N}").exists()
    storage.reset()
    assert [c.step for c in mgr.checkpoints()] == list(range(3, N + 3))
    assert storage.manifest_reads == 0
    mgr.close()


# ---------------------------------------------------------------------- resume modes
def test_only_corrupt_checkpoints(root: Path) -> None:
    for step in range(N):
        (_damage if step % 2 else _tear)(root, step)
    # Nothing valid: every manifest is read, and the corrupt ones are counted as before.
    with pytest.raises(ResumeError, match=f"holds {N} checkpoint.*none is valid"):
        CheckpointManager(root)
    with pytest.raises(ResumeError, match=f"no valid checkpoint.*{N} corrupt ones were skipped"):
        CheckpointManager(root, resume="must")
    # "never": nothing of this run to resume, so a start is allowed, as before.
    mgr = CheckpointManager(root, resume="never")
    assert mgr.latest() is None
    mgr.close()


def test_newest_corrupt_and_older_valid(root: Path) -> None:
    _damage(root, N - 1)
    with CheckpointManager(root) as mgr:
        assert mgr.latest().step == N - 2
        assert _newest_step(mgr) == N - 2
    with CheckpointManager(root, resume="must") as mgr:
        assert mgr.latest().step == N - 2
    # Refused, with the count the full scan gave (the walk stopped at step N-2).
    with pytest.raises(ResumeError, match=f"already has {N - 1} checkpoint"):
        CheckpointManager(root, resume="never")


def test_other_runs_checkpoints_are_not_ours_to_resume(
    root: Path, tmp_path: Path, caplog: Any
) -> None:
    # Another run's checkpoints, newer than all of ours.
    other = make_local_root(tmp_path / "other", [N + 5, N + 6], run_id="run-b")
    for step in (N + 5, N + 6):
        os.rename(other / f"checkpoint-{step}", root / f"checkpoint-{step}")
    storage = CountingLocalStorage(root)
    with (
        caplog.at_level(logging.WARNING, logger="atomic_checkpoint"),
        CheckpointManager(storage) as mgr,
    ):
        assert storage.manifest_reads == 3, storage.manifest_reads  # two foreign, one ours
        assert _newest_step(mgr) == N - 1
    # A restart without run_id continues the run the run file names: the newer steps
    # of a run started beside it were ignored in silence.
    assert (
        f"holds newer checkpoints of other runs than step {N - 1} of run" in caplog.text
        and f"run 'run-b' (newest step {N + 6})" in caplog.text
    ), caplog.text
    caplog.clear()
    with CheckpointManager(storage) as mgr:
        info = mgr.save(N, _state(N))
        # Above every manifest read: the other run's too, as the full scan had it.
        assert info.commit_seq > max(_seq(root, N + 6), _seq(root, N - 1))
    # A new run on the same root: the checkpoints are not its own.
    with CheckpointManager(root, run_id="run-c", resume="never") as mgr:
        assert mgr.latest() is None
    # ... and says whose checkpoints are there, instead of a silent fresh start.
    with pytest.raises(ResumeError, match=r"no valid checkpoint of run 'run-d'; it holds") as e:
        CheckpointManager(root, run_id="run-d", resume="must")
    assert f"run 'run-b' (newest step {N + 6})" in str(e.value)
    with (
        caplog.at_level(logging.WARNING, logger="atomic_checkpoint"),
        CheckpointManager(root, run_id="run-e") as mgr,  # auto: a fresh start
    ):
        assert mgr.latest() is None
    assert "run 'run-e' has no checkpoint in" in caplog.text
    assert "this run starts from scratch beside them" in caplog.text


def test_directories_that_are_not_checkpoints(tmp_path: Path, caplog: Any) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "checkpoint-5").mkdir()  # no manifest: foreign, not corrupt
    (root / "checkpoint-5" / "notes.txt").write_text("mine")
    (root / "tensorboard").mkdir()
    (root / "checkpoint-07").mkdir()  # not a strict checkpoint name
    os.symlink(tmp_path, root / "checkpoint-9")  # a link: never a checkpoint
    with pytest.raises(ResumeError, match=r"no valid checkpoint of run 'r'; .*\(checkpoint-5\)"):
        CheckpointManager(root, run_id="r", resume="must")
    logs = caplog.at_level(logging.WARNING, logger="atomic_checkpoint")
    with logs, CheckpointManager(root, run_id="r") as mgr:  # auto: nothing ours, a fresh start
        assert mgr.latest() is None
        mgr.save(10, _state(10))
    # The start says which folders it does not resume from, and how to adopt them.
    [warned] = [r.getMessage() for r in caplog.records if "without a manifest" in r.getMessage()]
    assert "1 checkpoint folder(s) without a manifest (checkpoint-5)" in warned
    assert "atomic-checkpoint adopt" in warned
    assert (root / "checkpoint-5" / "notes.txt").read_text() == "mine"
    caplog.clear()
    logs = caplog.at_level(logging.WARNING, logger="atomic_checkpoint")
    with logs, CheckpointManager(root, run_id="r") as mgr:  # resumes from step 10: no warning
        assert mgr.latest().step == 10
    assert not [r for r in caplog.records if "without a manifest" in r.getMessage()]
    with pytest.raises(CheckpointNotFoundError, match=r"in .*; it holds 1 checkpoint folder"):
        CheckpointManager(root, run_id="other", read_only=True).restore()


# ---------------------------------------------------------------------- commit numbers
def test_an_overwrite_gets_a_number_above_the_copy_it_replaces(root: Path) -> None:
    old = _seq(root, N - 1)
    with CheckpointManager(root) as mgr:
        info = mgr.save(N - 1, _state(1), overwrite=True)
    assert info.commit_seq > old
    assert _seq(root, N - 1) == info.commit_seq


def test_a_corrupt_newest_copy_is_replaced_with_a_higher_number(root: Path) -> None:
    _damage(root, N - 1)
    corrupt = _seq(root, N - 1)
    with CheckpointManager(root) as mgr:
        # Its number is above the newest valid one's: only the walk down to the newest
        # valid checkpoint knows it.
        assert corrupt > _seq(root, N - 2)
        info = mgr.save(N - 1, _state(N - 1), overwrite=True)
    assert info.commit_seq > corrupt


def test_rollback_then_save_numbers_above_every_removed_copy(root: Path) -> None:
    removed_seqs = [_seq(root, s) for s in range(101, N)]
    with CheckpointManager(root) as mgr:
        assert mgr.rollback(100) == list(range(N - 1, 100, -1))
        info = mgr.save(150, _state(150))
    assert info.commit_seq > max(removed_seqs)
    with CheckpointManager(root) as mgr:
        again = mgr.save(151, _state(151))
    assert again.commit_seq > info.commit_seq
