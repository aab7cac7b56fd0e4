"""Discovery that does not read the whole root (issue 14), counted.

A root of 2,000 real checkpoints on the local filesystem; every manifest read and every
file size check goes through a ``LocalStorage`` that counts them. ``latest()`` must read
a handful of manifests, newest first; the rotation after a save must not read again
what it already validated. Every guarantee of the full scan stays: strict names, other
runs passed over, links never followed, corrupt ones skipped with a warning, and a
manifest changed behind the cache read again.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, KeepLast, catalog
from atomic_checkpoint.layout import MANIFEST_NAME
from tests.helpers import CountingLocalStorage
from tests.testbed.roots import make_local_root

#: Checkpoints in ``made_root`` and ``root`` (tests/unit/conftest.py): steps 0 to N-1.
N = 2000
#: "A handful": what latest() may read on a root whose newest checkpoint is valid.
HANDFUL = 2


def test_latest_reads_the_newest_manifest_only(made_root: Path) -> None:
    storage = CountingLocalStorage(made_root)
    mgr = CheckpointManager(storage, read_only=True)
    # A reader's start only asks whether there is a valid checkpoint: the newest.
    assert storage.manifest_reads <= HANDFUL, storage.manifest_reads
    storage.reset()
    got = mgr.latest()
    assert got is not None and got.step == N - 1
    assert storage.manifest_reads <= HANDFUL, storage.manifest_reads
    # One checkpoint's files are checked (one file here), not every checkpoint's.
    assert storage.size_checks <= HANDFUL, storage.size_checks
    # The same answer as the full scan.
    assert catalog.committed(storage, run_id=mgr.run_id)[-1].step == got.step


def test_restore_finds_its_checkpoint_newest_first(made_root: Path) -> None:
    storage = CountingLocalStorage(made_root)
    mgr = CheckpointManager(storage, read_only=True)
    storage.reset()
    state = mgr.restore()
    assert mgr.last_restored is not None and mgr.last_restored.step == N - 1
    assert state["w"].shape == (256,)
    # Finding it (1), resolving it (1), and the re-read that proves it was not replaced
    # while being read (1): not a listing of every checkpoint.
    assert storage.manifest_reads <= 3, storage.manifest_reads


def test_restore_falls_back_past_a_corrupt_newest_reading_a_handful_of_manifests(
    root: Path,
) -> None:
    # A newest checkpoint whose data fails its checksum (same size: only a full read
    # tells) made restore() fall back, then read every manifest of ROOT to record what
    # it had passed over: 2,000 here, 20 s on an object store.
    newest = root / f"checkpoint-{N - 1}"
    (state,) = [p for p in newest.iterdir() if p.name.endswith(".safetensors")]
    data = bytearray(state.read_bytes())
    data[-2] ^= 0xFF
    state.write_bytes(bytes(data))
    storage = CountingLocalStorage(root)
    mgr = CheckpointManager(storage, read_only=True)
    storage.reset()
    mgr.restore()
    assert mgr.last_restored is not None and mgr.last_restored.step == N - 2
    assert storage.manifest_reads <= 8, storage.manifest_reads


def test_latest_skips_corrupt_other_runs_and_links_newest_first(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_id = CheckpointManager(root, read_only=True).run_id
    # Newest: a torn manifest; then a missing state file; then another run's checkpoint;
    # then a link to a valid checkpoint outside ROOT; then strict-name impostors.
    (root / f"checkpoint-{N + 3}").mkdir()
    (root / f"checkpoint-{N + 3}" / MANIFEST_NAME).write_bytes(b'{"format": "atomic-ch')
    shutil.copytree(root / f"checkpoint-{N - 1}", root / f"checkpoint-{N + 2}")
    os.rename(root / f"checkpoint-{N - 1}", root / "moved-away")  # reused below
    make_local_root(tmp_path / "other", [N + 1], run_id="other-run")
    os.rename(tmp_path / "other" / f"checkpoint-{N + 1}", root / f"checkpoint-{N + 1}")
    shutil.copytree(root / "moved-away", tmp_path / "outside")
    os.symlink(tmp_path / "outside", root / f"checkpoint-{N}")
    shutil.copytree(root / "moved-away", root / f"checkpoint-0{N + 9}")
    shutil.copytree(root / "moved-away", root / f"checkpoint-{N + 9}.5")
    shutil.rmtree(root / "moved-away")
    data = [f for f in os.listdir(root / f"checkpoint-{N + 2}") if f != MANIFEST_NAME]
    os.unlink(root / f"checkpoint-{N + 2}" / data[0])

    storage = CountingLocalStorage(root)
    mgr = CheckpointManager(storage, read_only=True, run_id=run_id)
    storage.reset()
    caplog.set_level(logging.WARNING, logger="atomic_checkpoint")
    got = mgr.latest()
    assert got is not None and got.step == N - 2
    # N+3 (torn), N+2 (a file missing), N+1 (other run), N-2: the link is not read.
    assert storage.manifest_reads == 4, storage.manifest_reads
    warned = caplog.text
    assert f"checkpoint-{N + 3}" in warned and f"checkpoint-{N + 2}" in warned
    assert f"checkpoint-{N}" in warned and "symbolic link" in warned
    assert catalog.committed(storage, run_id=run_id)[-1].step == got.step


def test_latest_on_an_empty_root_is_none(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    mgr = CheckpointManager(empty)
    assert mgr.latest() is None
    mgr.close()


def test_rotation_reads_only_the_new_manifest(root: Path) -> None:
    storage = CountingLocalStorage(root)
    mgr = CheckpointManager(storage, retention=KeepLast(N))
    # A start reads the newest checkpoint only; the first listing reads every manifest
    # once (as the first rotation would: tests/unit/test_start_discovery.py), and from
    # then on the rotation knows every checkpoint it validated.
    mgr.checkpoints()
    for step in (N, N + 1, N + 2):
        storage.reset()
        mgr.save(step, {"w": np.full(64, step, dtype=np.float32)})
        mgr.wait()  # the rotation ran
        # Only the checkpoint just committed is read (and its step's existence checked
        # before the commit); the others' files are checked by one lstat each (not
        # through the storage); the one the policy dropped is gone.
        assert storage.manifest_reads <= HANDFUL, (step, storage.manifest_reads)
        assert storage.size_checks <= 2 * HANDFUL, (step, storage.size_checks)
        assert not (root / f"checkpoint-{step - N}").exists()
    storage.reset()
    listed = mgr.checkpoints()
    assert [c.step for c in listed] == list(range(3, N + 3))
    assert storage.manifest_reads == 0
    mgr.close()


def test_the_cache_never_hides_a_change(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = CountingLocalStorage(root)
    mgr = CheckpointManager(storage, retention=KeepLast(10 * N))
    mgr.save(N, {"w": np.zeros(4, dtype=np.float32)}, metrics={"loss": 1.0})
    assert mgr.checkpoints()[-1].metrics == {"loss": 1.0}
    # This manager's own overwrite: the cached manifest of step N is dropped.
    mgr.save(N, {"w": np.ones(4, dtype=np.float32)}, metrics={"loss": 0.5}, overwrite=True)
    assert mgr.checkpoints()[-1].metrics == {"loss": 0.5}
    # A manifest changed behind the manager's back (a disk error, an operator): its
    # token changed, so it is read again and found corrupt.
    victim = root / "checkpoint-7" / MANIFEST_NAME
    victim.write_bytes(victim.read_bytes()[:100])
    storage.reset()
    caplog.set_level(logging.WARNING, logger="atomic_checkpoint")
    steps = [c.step for c in mgr.checkpoints()]
    assert 7 not in steps and len(steps) == N
    assert storage.manifest_reads == 1
    assert "checkpoint-7" in caplog.text
    # A checkpoint removed behind its back leaves the list too.
    shutil.rmtree(root / "checkpoint-8")
    assert 8 not in [c.step for c in mgr.checkpoints()]
    # A state file damaged under an unchanged manifest: the listing checks sizes as a
    # full scan does, so it agrees with latest() (which reads the newest afresh).
    newest = root / f"checkpoint-{N}"
    data = next(f for f in os.listdir(newest) if f != MANIFEST_NAME)
    os.truncate(newest / data, 3)
    assert N not in [c.step for c in mgr.checkpoints()]
    assert mgr.latest().step == N - 1
    # A state file replaced by a link to a file of the same size outside ROOT: never
    # followed (DESIGN invariant 9), the checkpoint is not listed.
    ck = root / "checkpoint-9"
    data = next(f for f in os.listdir(ck) if f != MANIFEST_NAME)
    outside = root.parent / "outside.bin"
    shutil.copyfile(ck / data, outside)
    os.unlink(ck / data)
    os.symlink(outside, ck / data)
    caplog.clear()
    assert 9 not in [c.step for c in mgr.checkpoints()]
    assert "symbolic link" in caplog.text
    mgr.close()


def test_the_cache_holds_a_bounded_number_of_file_entries(tmp_path: Path) -> None:
    root = make_local_root(tmp_path / "root", range(10))
    storage = CountingLocalStorage(root)
    cache = catalog.ManifestCache(max_files=3)  # one state file per checkpoint here
    for _ in range(2):
        storage.reset()
        found = catalog.committed(storage, run_id=None, cache=cache)
        assert [m.step for m in found] == list(range(10))
    assert len(cache) == 3
    assert storage.manifest_reads == 7  # the three cached ones are not read again


def test_a_skipped_checkpoint_is_warned_once_not_at_every_call(tmp_path, caplog):
    """An evaluation job polling ``latest()`` beside a torn checkpoint: one warning
    that names it (its path once), not one per call for as long as it stays."""
    mgr = CheckpointManager(tmp_path / "r")
    for step in (1, 2):
        mgr.save(step, {"w": np.full(100, step)})
    torn = next((tmp_path / "r" / "checkpoint-2").glob("rank-*"))
    os.truncate(torn, 10)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        for _ in range(3):
            assert mgr.latest().step == 1
        assert [c.step for c in mgr.checkpoints()] == [1]
        reader = CheckpointManager(tmp_path / "r", read_only=True)
        assert reader.latest().step == 1
    warned = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warned) == 1, warned
    path = str(tmp_path / "r" / "checkpoint-2")
    assert warned[0].count(path) == 1 and "is 10 bytes" in warned[0], warned[0]
    mgr.close()


def _stat_calls_of_latest(monkeypatch: pytest.MonkeyPatch, root: Path, files: int) -> int:
    """stat/lstat calls of one latest() on a read-only manager of ``root``, whose one
    checkpoint holds ``files`` files."""
    with CheckpointManager(root) as mgr, mgr.saving(1) as d:
        for i in range(files):
            (d / f"part-{i:03d}.bin").write_bytes(b"x")
    reader = CheckpointManager(root, read_only=True)
    calls = [0]
    real_stat, real_lstat = os.stat, os.lstat

    def counted(real: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            calls[0] += 1
            return real(*args, **kwargs)  # type: ignore[operator]

        return call

    monkeypatch.setattr(os, "stat", counted(real_stat))
    monkeypatch.setattr(os, "lstat", counted(real_lstat))
    assert reader.latest() is not None
    monkeypatch.undo()
    reader.close()
    return calls[0]


def test_latest_checks_each_file_with_a_few_stats_however_deep_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README: latest() checks "every file present with its size (a stat per file)".
    # Resolving each file's path (os.path.realpath, three times per file) made it 24 to
    # 48 calls per file, growing with the depth of ROOT: 146 ms per latest() of a
    # 513-file checkpoint 13 directories deep.
    files = 60
    shallow = _stat_calls_of_latest(monkeypatch, tmp_path / "a", files)
    deep = _stat_calls_of_latest(monkeypatch, tmp_path.joinpath(*"bcdefghijklm"), files)
    assert shallow <= 5 * files, shallow
    assert deep <= shallow + 20, (shallow, deep)


def test_a_scan_of_an_object_store_reads_the_manifests_concurrently(tmp_path: Path) -> None:
    # Each manifest on an object store is a round trip: read one after the other, the
    # first listing of 2,000 checkpoints on an S3 server on loopback took 100 s. Here
    # the manifest reads meet at a barrier of 4: read one at a time, the first waits
    # alone until the barrier breaks.
    import threading

    from atomic_checkpoint.storage.fsspec import FsspecStorage

    class MeetingStorage(FsspecStorage):
        barrier: threading.Barrier | None = None

        def read_bytes(self, path: str) -> bytes:
            if self.barrier is not None and path.endswith(f"/{MANIFEST_NAME}"):
                self.barrier.wait()
            return super().read_bytes(path)

    url = f"memory://scan-threads-{tmp_path.name}/root"
    with CheckpointManager(url) as mgr:
        for step in range(8):
            mgr.save(step, {"w": np.full(4, step, dtype=np.float32)})
        run_id = mgr.run_id
    storage = MeetingStorage(url)
    storage.barrier = threading.Barrier(4, timeout=10)
    assert [m.step for m in catalog.committed(storage, run_id=run_id)] == list(range(8))
    assert not storage.barrier.broken
