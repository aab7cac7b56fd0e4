"""``restore()`` without a step skips a checkpoint that fails its checksum and loads the
next older one; ``restore(step=N)`` of it raises ``CorruptCheckpointError`` (DESIGN
invariants 6 and 11; the multi-rank agreement is in ``tests/dist/test_agreement.py``).
"""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from atomic_checkpoint import (
    CheckpointExistsError,
    CheckpointManager,
    CorruptCheckpointError,
    KeepLast,
    StateMismatchError,
    StorageError,
    catalog,
)


def _state(step: int) -> dict:
    return {"step": step, "w": np.full(4096, float(step), dtype=np.float32)}


def _flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restore_falls_back_past_checksum_failures_and_says_which(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    for s in (10, 20, 30):
        mgr.save(s, _state(s))
    bad = [str(tmp_path / f"checkpoint-{s}" / "rank-00000.safetensors") for s in (20, 30)]
    for path in bad:
        _flip_middle_byte(path)

    # latest() checks sizes only (cheap): both corrupt checkpoints still look complete.
    assert mgr.latest().step == 30
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        state = mgr.restore()
    assert state["step"] == 10 and float(state["w"][0]) == 10.0
    assert mgr.last_restored is not None and mgr.last_restored.step == 10
    skipped = [
        r.getMessage() for r in caplog.records if "skipping checkpoint step" in r.getMessage()
    ]
    assert len(skipped) == 2
    assert bad[1] in skipped[0] and bad[0] in skipped[1]

    with pytest.raises(CorruptCheckpointError, match="checksum") as info:
        mgr.restore(step=30)
    assert bad[1] in str(info.value)
    mgr.close()


def test_restore_with_nothing_that_verifies_is_an_error_listing_what_was_skipped(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    _flip_middle_byte(str(tmp_path / "checkpoint-1" / "rank-00000.safetensors"))
    # Never a silent fresh start: the error says what was found and why it was refused.
    with pytest.raises(CorruptCheckpointError, match=r"step 1: .*checksum"):
        mgr.restore()
    mgr.close()


def test_training_goes_on_after_a_fallback_without_losing_the_restored_checkpoint(tmp_path, caplog):
    """After ``restore()`` skipped a corrupt newest checkpoint (30) and loaded 20, the
    loop goes on: retention must not count the corrupt one as "the newest" (KeepLast(2)
    deleted 20, the only valid one training came from, and kept 30), and the loop's
    save of step 30 replaces the corrupt copy instead of raising CheckpointExistsError."""
    from atomic_checkpoint import KeepLast

    with CheckpointManager(tmp_path) as first:
        for s in (10, 20, 30):
            first.save(s, _state(s))
    _flip_middle_byte(str(tmp_path / "checkpoint-30" / "rank-00000.safetensors"))

    mgr = CheckpointManager(tmp_path, retention=KeepLast(2))
    assert mgr.restore()["step"] == 20
    mgr.save(25, _state(25))
    mgr.wait()
    # 10 rotated out; 20 and 25 kept; the corrupt 30 neither counted nor deleted.
    assert [c.step for c in mgr.checkpoints()] == [20, 25, 30]
    _save_replaces_30_then(mgr, caplog, 35, tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_newest_checkpoint_with_a_torn_file_is_replaced_by_the_save_of_its_step(
    tmp_path, caplog, damage
):
    """A file of the newest checkpoint cut short or gone (sizes, not checksums): the
    start's walk skips it, so no restore() ever tried it. The resumed job's save of
    that step raised CheckpointExistsError ("already committed") at every restart; it
    replaces it, as it replaces one that failed its checksums."""
    with CheckpointManager(tmp_path) as first:
        for s in (10, 20, 30):
            first.save(s, _state(s))
    path = str(tmp_path / "checkpoint-30" / "rank-00000.safetensors")
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 10)
    else:
        os.remove(path)

    mgr = CheckpointManager(tmp_path, retention=KeepLast(2))
    assert mgr.latest().step == 20
    assert mgr.restore()["step"] == 20
    _save_replaces_30_then(mgr, caplog, 40, tmp_path)


def test_a_saving_block_replaces_a_torn_checkpoint_of_its_step_too(tmp_path, caplog):
    """The same rule for a job that saves with saving() (files it writes itself): its
    save of the torn step was refused as "already committed" at every restart."""
    with CheckpointManager(tmp_path) as first:
        for s in (1, 2):
            with first.saving(s) as d:
                (d / "weights.txt").write_text(f"weights of step {s}")
    (tmp_path / "checkpoint-2" / "weights.txt").write_text("weig")  # cut short
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest().step == 1
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"), mgr.saving(2) as d:
        (d / "weights.txt").write_text("weights of step 2, again")
    assert "replaces checkpoint checkpoint-2" in caplog.text
    assert d.info is not None and d.info.step == 2
    mgr.close()
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [1, 2]
        assert reader.verify(2).step == 2  # raises if it does not match its manifest
    assert (tmp_path / "checkpoint-2" / "weights.txt").read_text() == "weights of step 2, again"


def _save_replaces_30_then(mgr, caplog, then: int, root) -> None:
    """The resumed loop saves step 30 (replacing the skipped copy, with a warning), then
    ``then``; both are listed, and 30 restores the new copy."""
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr.save(30, _state(30))
    assert "replaces checkpoint checkpoint-30" in caplog.text
    mgr.save(then, _state(then))
    mgr.close()
    with CheckpointManager(root, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [30, then]
        assert float(reader.restore(30)["w"][0]) == 30.0  # the new copy verifies


def test_apply_retention_never_deletes_the_last_checkpoint_that_restores(tmp_path, caplog):
    """``mgr.retention = KeepLast(1)`` then ``apply_retention()`` on a root whose newest
    checkpoint rotted (sizes intact, checksums not): it used to keep the corrupt newest
    and delete the only one that restores. The newest kept is verified first unless
    this manager committed or restored it; a corrupt one is neither kept nor deleted."""
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    _flip_middle_byte(str(tmp_path / "checkpoint-3" / "rank-00000.safetensors"))
    with CheckpointManager(tmp_path) as mgr:
        mgr.retention = KeepLast(1)
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            assert mgr.apply_retention() == [1]
        assert "checkpoint-3 fails verification" in caplog.text
        assert [c.step for c in mgr.checkpoints()] == [2, 3]
        assert mgr.restore()["step"] == 2
        # What this manager restored (or saved) is not read again: a new save's
        # rotation, and a later apply_retention, keep the new newest step only.
        mgr.save(4, _state(4))
        assert mgr.apply_retention() == []
        assert [c.step for c in mgr.checkpoints()] == [3, 4]


def test_a_failed_restore_into_says_the_targets_hold_unverified_data(tmp_path, caplog):
    """restore(into=) reads straight into the caller's arrays and knows the checksum
    only once every byte is in: a failure has overwritten them, and the error says so
    (a caller that caught it and trained on used data that failed verification)."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(10, {"w": np.full(64, 1.0, dtype=np.float32)})  # another layout
        mgr.save(20, _state(20))
    _flip_middle_byte(str(tmp_path / "checkpoint-20" / "rank-00000.safetensors"))
    target = {"step": 0, "w": np.zeros(4096, dtype=np.float32)}
    with CheckpointManager(tmp_path) as mgr, caplog.at_level(logging.WARNING):
        # step 20 fails its checksum; the fallback to 10 does not fit ``target``
        with pytest.raises(StateMismatchError, match="reinitialise them"):
            mgr.restore(into=target)
        with pytest.raises(CorruptCheckpointError, match="may hold data of a checkpoint"):
            mgr.restore(20, into=target)
        # Nothing read, nothing to say: a plain mismatch is not called a clobbering.
        with pytest.raises(StateMismatchError) as plain:
            mgr.restore(10, into=target)
        assert "reinitialise" not in str(plain.value)
        assert mgr.restore(10)["w"][0] == 1.0  # without into=: fine


def test_resumed_from_records_a_fallback_that_the_users_own_loader_made(tmp_path):
    """Files written with saving() and read back by the user's code: the loader skipped
    the corrupt steps 3 and 2 and loaded 1. resumed_from() makes the manager go on as
    after restore() made that choice: saves above 1 are not a rollback, a save of 2
    replaces the corrupt copy, and retention neither counts nor deletes 3."""
    mgr = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        with mgr.saving(step) as d:
            (d / "weights.bin").write_bytes(bytes([step]) * 64)
    mgr.close()
    mgr = CheckpointManager(tmp_path, retention=KeepLast(2))
    infos = {c.step: c for c in mgr.checkpoints()}
    with pytest.raises(ValueError, match=r"corrupt steps \[1\] are not above"):
        mgr.resumed_from(infos[2], corrupt=[3, 1])
    mgr.resumed_from(infos[1], corrupt=[3, 2])
    assert mgr.last_restored == infos[1]
    with mgr.saving(2) as d:  # replaces the corrupt copy; before: CheckpointExistsError
        (d / "weights.bin").write_bytes(b"\x22" * 64)
    mgr.wait()
    # KeepLast(2) over 1 and the new 2: nothing deleted, and 3 neither counted nor deleted.
    assert sorted(os.listdir(tmp_path / "checkpoint-2")) == sorted(
        ["weights.bin", "checkpoint.manifest.json"]
    )
    assert (tmp_path / "checkpoint-2" / "weights.bin").read_bytes() == b"\x22" * 64
    assert {p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")} == {
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
    }
    with pytest.raises(TypeError, match="CheckpointInfo"):
        mgr.resumed_from(1)  # type: ignore[arg-type]
    mgr.close()


def test_a_torn_checkpoint_below_a_corrupt_newest_is_replaced_by_the_save_of_its_step(
    tmp_path, caplog
):
    """The newest checkpoint fails its checksums and the one below it has a file cut
    short: restore() reads the newest, skips it, passes the torn one over by its sizes
    alone and loads the third. The save of the torn one's step raised
    CheckpointExistsError at every restart; it replaces it, as it does the newest."""
    with CheckpointManager(tmp_path) as first:
        for s in (10, 20, 30):
            first.save(s, _state(s))
    _flip_middle_byte(str(tmp_path / "checkpoint-30" / "rank-00000.safetensors"))
    torn = str(tmp_path / "checkpoint-20" / "rank-00000.safetensors")
    os.truncate(torn, os.path.getsize(torn) - 100)

    with CheckpointManager(tmp_path, retention=KeepLast(2)) as mgr:
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            assert mgr.restore()["step"] == 10
            for s in (20, 30):
                mgr.save(s, _state(s))
        assert "saving step 20 replaces checkpoint checkpoint-20" in caplog.text
        assert [c.step for c in mgr.checkpoints()] == [20, 30]
        assert mgr.restore(20)["step"] == 20


def test_restore_of_files_written_in_place_names_the_folder_that_holds_them(tmp_path):
    # The marker strategy (object stores, s3fs-fuse mounts) writes a saving() block's
    # files into checkpoint-N/attempt-<token>/: restore()'s error named checkpoint-N,
    # which holds only the manifest.
    from atomic_checkpoint import CheckpointError

    with CheckpointManager(tmp_path, strategy="marker") as mgr:
        with mgr.saving(1) as d:
            (d / "model.bin").write_bytes(b"weights")
        info = d.info
        assert info.files_path != info.path and "attempt-" in info.files_path
        with pytest.raises(CheckpointError) as err:
            mgr.restore(1)
        assert f"read its files from {info.files_path} " in str(err.value)
        assert os.path.exists(os.path.join(info.files_path, "model.bin"))


def test_a_root_of_newer_format_checkpoints_says_to_upgrade(tmp_path):
    # Every checkpoint written by a newer version: the start said "none is valid ...
    # Repair them", a read-only restore() "no valid checkpoint", neither naming the
    # cause that only an upgrade fixes.
    import json

    from atomic_checkpoint import CheckpointNotFoundError, ResumeError
    from atomic_checkpoint.manifest import _body_checksum

    with CheckpointManager(tmp_path) as first:
        for s in (1, 2):
            first.save(s, _state(s))
    for s in (1, 2):
        path = tmp_path / f"checkpoint-{s}" / "checkpoint.manifest.json"
        doc = json.loads(path.read_text())
        doc["schema_version"] = 2
        doc.pop("manifest_checksum")
        doc["manifest_checksum"] = _body_checksum(doc, doc["checksum_algorithm"])
        path.write_text(json.dumps(doc))
    with pytest.raises(ResumeError) as err:
        CheckpointManager(tmp_path)
    assert "2 of them (checkpoint-1, checkpoint-2) were written by a newer version" in str(
        err.value
    )
    assert "Upgrade atomic-checkpoint" in str(err.value)
    with pytest.raises(CheckpointNotFoundError, match="newer version of atomic-checkpoint"):
        CheckpointManager(tmp_path, read_only=True).restore()
    # Nothing was touched.
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


@pytest.mark.parametrize("strategy", ["rename", "marker"])
def test_the_running_job_replaces_a_torn_checkpoint_of_the_step_it_saves_again(
    tmp_path, caplog, strategy
):
    """A save that failed after its manifest landed (an object store that processed a
    timed-out manifest PUT late) leaves a manifest without its files. The job retries
    the step: it raised CheckpointExistsError ("already committed") while its own
    checkpoints() and latest() skipped that step. It replaces it; an intact step still
    refuses."""
    mgr = CheckpointManager(tmp_path, strategy=strategy)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    [path] = [
        os.path.join(d, n)
        for d, _, names in os.walk(tmp_path / "checkpoint-2")
        for n in names
        if n.startswith("rank-")
    ]
    os.remove(path)
    assert [c.step for c in mgr.checkpoints()] == [1]
    caplog.set_level(logging.WARNING, logger="atomic_checkpoint")
    assert mgr.save(2, _state(22)).step == 2
    assert "saving step 2 replaces it" in caplog.text and "is missing" in caplog.text
    assert [c.step for c in mgr.checkpoints()] == [1, 2]
    assert mgr.restore(2)["step"] == 22
    with pytest.raises(CheckpointExistsError):
        mgr.save(2, _state(2))
    mgr.close()


@pytest.mark.parametrize("read_only", [False, True])
def test_an_io_error_on_the_read_that_ends_a_restore_is_a_storage_error(
    tmp_path, monkeypatch, read_only
):
    # The manifest is read again once every file was read (an overwrite racing the
    # reader): an EIO there raised UnboundLocalError ('now'), not the storage's error,
    # and on several ranks the others then blamed the user's code for a mismatch.
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": np.arange(4.0)})
    reader = CheckpointManager(tmp_path, read_only=read_only)

    def failing(storage, name):
        raise StorageError(f"read '{name}' failed: I/O error", errno=errno.EIO, path=name)

    monkeypatch.setattr(catalog, "manifest_now", failing)
    with pytest.raises(StorageError, match="I/O error") as err:
        reader.restore()
    assert err.value.errno == errno.EIO
    monkeypatch.undo()
    assert reader.restore(1)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]  # and it reads again
    reader.close()
