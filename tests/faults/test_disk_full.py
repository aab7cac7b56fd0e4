# The fixture is imported from tests.testbed.pytest_fixtures and requested by parameter
# name, which pyflakes reads as a redefinition of the import.
# ruff: noqa: F811

"""Real full filesystems (tmpfs, ext4 ``-m 0``, xfs) under one process.

The 3-rank version (every rank gets the ENOSPC inside the distributed error, the
failed save gives back its space, the next save succeeds; also over sshfs) is the
disk-full campaign, ``reliability.diskfull``, which ``test_campaigns.py`` runs. Here:
what one process sees, the start-up on a full disk, and that retention never deletes
old checkpoints to make room for a save that does not fit.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from reliability.checks import expected_state, states_equal

from atomic_checkpoint import CheckpointManager, KeepLast, StorageFullError
from atomic_checkpoint.layout import MANIFEST_NAME, META_DIR
from tests.testbed import fill_until_enospc
from tests.testbed.pytest_fixtures import small_disk  # noqa: F401 - fixture used by name

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

KINDS = ["tmpfs", "ext4", "xfs"]
SMALL = 1 << 10


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_that_does_not_fit_fails_cleanly_and_keeps_every_checkpoint(small_disk, kind):
    disk = small_disk(48 if kind == "xfs" else 32, kind)
    root = disk.path / "root"
    mgr = CheckpointManager(root, retention=KeepLast(1))
    mgr.save(1, expected_state(1, 0, SMALL))
    filler = disk.path / "filler"
    # Leave 4 MiB; the next state needs 16 MiB. Deleting step 1 would not help, and
    # retention must not try: it runs only after a commit (DESIGN invariant 5).
    fill_to = max(0, free_bytes(disk.path) - (4 << 20))
    with open(filler, "wb") as f:
        f.write(b"\0" * fill_to)
        f.flush()
        os.fsync(f.fileno())
    before = free_bytes(disk.path)
    big = expected_state(2, 0, 2 << 20)
    with pytest.raises(StorageFullError) as err:
        mgr.save(2, big)
    e = err.value
    assert e.errno == errno.ENOSPC
    assert "rank-00000.safetensors" in str(e) and "errno 28" in str(e)
    assert "Free space" in str(e)  # it says what to do
    # ... in the running job (prune is refused while the job holds the lock, and with
    # --force it costs the job its lock: both said).
    assert "mgr.apply_retention()" in str(e) and "needs --force" in str(e)
    assert os.listdir(root / ".pending") == []
    # Nothing of the failed save keeps running (its checksum helper included: it used
    # to start before the reservation failed, and waited out its idle timeout).
    assert not [t for t in threading.enumerate() if t.name == "atomic-checkpoint-hash"]
    assert free_bytes(disk.path) >= before - (256 << 10)  # the failed save gave it back
    assert [c.step for c in mgr.checkpoints()] == [1]
    assert states_equal(mgr.restore(), expected_state(1, 0, SMALL))
    filler.unlink()
    info = mgr.save(2, big)  # the same manager, once there is room
    assert info.step == 2 and states_equal(mgr.restore(2), big)
    mgr.close()
    assert [c.step for c in CheckpointManager(root, read_only=True).checkpoints()] == [2]


@pytest.mark.timeout(180)
def test_a_full_disk_behind_sshfs_is_a_full_disk_not_an_io_error(small_disk, tmp_path):
    """SFTP has no "disk full" status, and sshfs reports the server's full disk as EIO:
    the save failed with a bare StorageError ("Input/output error") and none of the
    full-disk advice, and `except StorageFullError:` missed it. The export lives on a
    real 32 MiB tmpfs, filled from the server's side."""
    from tests.testbed import SshfsExport

    disk = small_disk(32, "tmpfs")
    with SshfsExport(disk.path / "srv") as export:
        root = export.mount(tmp_path / "mnt").path / "root"
        mgr = CheckpointManager(root, retention=KeepLast(1))
        mgr.save(1, expected_state(1, 0, SMALL))
        filler = export.export / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free_bytes(disk.path) - (4 << 20)))
        big = expected_state(2, 0, 2 << 20)  # 16 MiB
        with pytest.raises(StorageFullError) as err:
            mgr.save(2, big)
        e = err.value
        assert e.errno == errno.ENOSPC and "errno 5" in str(e) and "sshfs" in str(e), e
        assert "Free space" in str(e) and "rank-00000.safetensors" in str(e)
        assert [c.step for c in mgr.checkpoints()] == [1]
        assert states_equal(mgr.restore(), expected_state(1, 0, SMALL))
        filler.unlink()
        assert mgr.save(2, big).step == 2 and states_equal(mgr.restore(2), big)
        mgr.close()


def _fill(path) -> None:
    """Fill the disk at ``path``: a large file, then the remaining small allocations
    (directories need a block each on ext4)."""
    fill_until_enospc(path / "filler")
    n = 0
    while n < 10_000:
        try:
            (path / f"d{n}").mkdir()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            break
        n += 1


def test_starting_on_a_full_disk_says_so(small_disk):
    disk = small_disk(8, "ext4")
    _fill(disk.path)
    with pytest.raises(StorageFullError) as err:
        CheckpointManager(disk.path / "root")
    assert err.value.errno == errno.ENOSPC and str(disk.path / "root") in str(err.value)
    (disk.path / "filler").unlink()
    mgr = CheckpointManager(disk.path / "root")
    assert mgr.save(1, {"x": 1}).step == 1
    mgr.close()


def test_a_restart_on_a_full_disk_says_how_to_free_it(small_disk):
    # The job saved until the disk filled, then restarted: taking the run lock failed
    # with "Free space ... or lower retention, then save again" (nothing was being
    # saved, and retention needs a manager). prune works on the full disk; say so.
    disk = small_disk(8, "ext4")
    root = disk.path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": np.zeros(1 << 18, dtype=np.float32)})
    _fill(disk.path)
    with pytest.raises(StorageFullError, match="cannot take the run lock") as err:
        CheckpointManager(root)
    assert "atomic-checkpoint prune" in str(err.value) and err.value.errno == errno.ENOSPC
    (disk.path / "filler").unlink()
    with CheckpointManager(root) as mgr:
        assert mgr.latest().step == 1


def _three_checkpoints(root) -> None:
    with CheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full(1 << 18, step, dtype=np.float32)})


@pytest.mark.parametrize("pending", [True, False], ids=["saved-here", "adopted"])
def test_prune_frees_a_full_disk_as_the_full_disk_errors_advise(small_disk, pending):
    # "atomic-checkpoint prune ROOT --keep-last N (it works on a full disk)" failed with
    # "create directory 'ROOT/.trash' failed: No space left on device": the un-commit
    # renamed into .trash/, which needs a block of its own on ext4. It then went to
    # .pending/, which a root of adopted checkpoints (never saved to here) lacks too.
    from tests.cli.helpers import run_cli

    disk = small_disk(8, "ext4")
    root = disk.path / "root"
    _three_checkpoints(root)
    assert not (root / ".trash").exists()
    if not pending:
        (root / ".pending").rmdir()
    _fill(disk.path)
    proc = run_cli("prune", root, "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-3"
    ]
    assert free_bytes(disk.path) > 2 * 4 * (1 << 18)  # the two checkpoints' space is back
    with CheckpointManager(root) as mgr:  # the start sweeps what the prune left
        assert os.listdir(root / ".pending") == []
        assert not [n for n in os.listdir(root / META_DIR) if n.startswith("checkpoint-")]
        assert (mgr.restore()["x"] == 3).all()
        assert mgr.save(4, {"x": np.zeros(1 << 18, dtype=np.float32)}).step == 4


def test_apply_retention_frees_a_full_disk_inside_the_job(small_disk):
    # The job's save failed on the full disk; "apply_retention() of a manager with a
    # lower retention, then save again" failed on .trash/ as prune did, with a plain
    # StorageError where the full disk is a StorageFullError.
    disk = small_disk(8, "ext4")
    root = disk.path / "root"
    _three_checkpoints(root)
    with CheckpointManager(root) as mgr:
        _fill(disk.path)
        with pytest.raises(StorageFullError):
            mgr.save(4, {"x": np.zeros(1 << 18, dtype=np.float32)})
        mgr.retention = KeepLast(1)
        assert mgr.apply_retention() == [1, 2]
        assert mgr.save(4, {"x": np.zeros(1 << 18, dtype=np.float32)}).step == 4
        assert [c.step for c in mgr.checkpoints()] == [4]  # KeepLast(1) after the save


def test_a_framework_writer_on_a_full_disk_is_reported_as_a_full_disk(small_disk):
    # torch.save (what the Trainer, Accelerate and Lightning write with) reports a full
    # disk as "RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos",
    # without ENOSPC: the integrations' users got that, not the advice a full disk has.
    import torch

    disk = small_disk(4, "tmpfs")
    root = disk.path / "root"
    with CheckpointManager(root) as mgr:
        with mgr.saving(1) as d:
            torch.save({"w": torch.zeros(1000)}, d / "small.pt")
        with pytest.raises(StorageFullError, match="its filesystem is full") as err:
            with mgr.saving(2) as d:
                torch.save({"w": torch.zeros(2 << 20)}, d / "model.pt")  # 8 MiB
        assert err.value.errno == errno.ENOSPC
        assert "atomic-checkpoint prune" in str(err.value)
        assert not isinstance(err.value.__cause__, OSError)  # torch's own error, kept
        assert [c.step for c in mgr.checkpoints()] == [1]
        mgr.verify(1)
    # A block that fails for another reason on a disk with room keeps its own error.
    # (Another disk: torch's writer, held by the traceback, keeps the first one full.)
    with CheckpointManager(small_disk(4, "tmpfs").path / "root") as mgr, pytest.raises(KeyError):
        with mgr.saving(3):
            raise KeyError("mine")


def test_adopt_json_that_fills_the_disk_half_way_still_says_what_it_adopted(small_disk):
    # adopt --json whose disk filled after some checkpoints were recorded exited 2
    # with nothing on stdout: a script could not tell which ones this run adopted.
    # The disk is freed a little at a time until a run adopts some and then fails.
    import json

    from tests.cli.helpers import run_cli

    disk = small_disk(8, "ext4")
    root = disk.path / "root"
    for step in range(1, 9):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        (root / f"checkpoint-{step}" / "weights.bin").write_bytes(os.urandom(3000))
    _fill(disk.path)
    spare = sorted(disk.path.glob("d*"), key=lambda p: int(p.name[1:]))

    def manifests() -> int:
        return sum((root / f"checkpoint-{s}" / MANIFEST_NAME).exists() for s in range(1, 9))

    for _ in range(60):
        if spare:
            spare.pop().rmdir()  # one block more
        else:
            os.truncate(disk.path / "filler", (disk.path / "filler").stat().st_size - 4096)
        before = manifests()
        proc = run_cli("adopt", root, "--framework", "generic", "--json")
        assert proc.returncode in (0, 2), proc.stderr
        if proc.returncode == 2 and manifests() > before:
            doc = json.loads(proc.stdout)
            assert len(doc["adopted"]) == manifests() - before, doc
            assert "No space left" in doc["problem"] or "full" in doc["problem"], doc
            break
        assert proc.returncode == 2, "adopted everything at once: no half-way failure seen"
    else:
        pytest.fail("no run adopted some checkpoints and then ran out of space")


def test_a_full_disk_inside_dcp_s_error_is_reported_with_the_full_disk_advice(tmp_path):
    # DCP wraps each rank's OSError(ENOSPC) in a CheckpointException ({rank: (error,
    # trace)}), without an errno of its own: on a disk with room left after the failed
    # write, the DCP integration said "No space left" without how to free it.
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from atomic_checkpoint import LocalStorage
    from atomic_checkpoint.storage.base import full_storage_error

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("dcp", {1: (full, traceback.StackSummary())})
    said = full_storage_error(LocalStorage(tmp_path), wrapped)
    assert isinstance(said, StorageFullError) and said.errno == errno.ENOSPC
    assert "atomic-checkpoint prune" in str(said) and said.__cause__ is wrapped
    other = CheckpointException("dcp", {0: (ValueError("x"), traceback.StackSummary())})
    assert full_storage_error(LocalStorage(tmp_path), other) is None


@pytest.mark.timeout(120)
def test_a_disk_full_for_longer_than_the_lease_lets_the_job_save_again(small_disk, caplog):
    # The lease's renewals fail while the disk is full; past 5/6 of the lease the job
    # fenced itself for good, though no other job had touched ROOT: "free space, then
    # save again" did not work after a full disk of more than 50 s (lease 60 s). Here
    # the lease is 3 s and the disk stays full for 5 s.
    import time

    disk = small_disk(8, "ext4")
    root = disk.path / "root"
    with CheckpointManager(root, lease_s=3) as mgr:
        mgr.save(1, {"x": np.ones(16)})
        _fill(disk.path)
        with pytest.raises(StorageFullError):
            mgr.save(2, {"x": np.zeros(1 << 18, dtype=np.float32)})
        time.sleep(5)  # the heartbeat's renewals fail the whole time: the lease lapses
        os.unlink(disk.path / "filler")
        with caplog.at_level("WARNING", logger="atomic_checkpoint"):
            assert mgr.save(2, {"x": np.zeros(1 << 18, dtype=np.float32)}).step == 2
        assert "no other job took ROOT over: it holds the lock again" in caplog.text
        assert [c.step for c in mgr.checkpoints()] == [1, 2]
