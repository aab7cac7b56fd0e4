"""Symbolic links inside ROOT never lead the library outside it (DESIGN invariant 9).

``ROOT/checkpoint-5 -> OTHER/checkpoint-5`` (another root's checkpoint, of the same run
id: a copied or shared tree) was a checkpoint before the fix: ``restore()`` returned
OTHER's data, and retention deleted it through the link (the marker strategy removed
OTHER's manifest and data; the rename strategy moved the link into ``.trash``). A
``.pending`` linked elsewhere was swept through. Now an entry of ROOT that is a link is
listed as foreign ("unsafe: a symbolic link"), never read, counted or deleted, and the
storage refuses any path through a link. Every test checks OTHER byte for byte, and an
inotify watch proves its files are never even opened.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from reliability.inotify import OpenWatch

from atomic_checkpoint import (
    CheckpointManager,
    KeepLast,
    SingleProcessCoordinator,
    UnsafeCheckpointError,
)
from atomic_checkpoint.layout import MANIFEST_NAME, PENDING_DIR, marker_name
from tests.cli.helpers import run_cli, run_json

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

RUN = "run-shared"


def _state(step: int) -> dict:
    return {"w": np.full(64, step, dtype=np.float32), "step": step}


def _manager(storage, *, strategy: str | None, **kw) -> CheckpointManager:
    return CheckpointManager(
        storage, run_id=RUN, strategy=strategy, coordinator=SingleProcessCoordinator(), **kw
    )


def snapshot(top: Path) -> dict[str, object]:
    """Every entry under ``top``: links by target, files by content."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(dirpath, name)
            rel = str(p.relative_to(top))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = p.read_bytes()
    return out


def _files(top: Path) -> list[str]:
    return [str(p) for p in top.rglob("*") if p.is_file() and not p.is_symlink()]


@pytest.fixture
def roots(tmp_path):
    """(ROOT, OTHER): two roots side by side; ``_setup`` fills them."""
    return tmp_path / "root", tmp_path / "other"


def _setup(root: Path, other: Path, storage_of, strategy: str | None) -> None:
    """OTHER holds step 5 of run RUN; ROOT holds step 1 of RUN and links its
    checkpoint-5 to OTHER's."""
    mgr = _manager(storage_of(other), strategy=strategy)
    mgr.save(5, _state(5))
    mgr.close()
    mgr = _manager(storage_of(root), strategy=strategy)
    mgr.save(1, _state(1))
    mgr.close()
    os.symlink(other / "checkpoint-5", root / "checkpoint-5")


def _local(path: Path):
    return path


def _file_url(path: Path):
    from atomic_checkpoint.storage.fsspec import FsspecStorage

    return FsspecStorage(f"file://{path}")


BACKENDS = [
    pytest.param(_local, "rename", id="local-rename"),
    pytest.param(_local, "marker", id="local-marker"),
    pytest.param(_file_url, None, id="fsspec-file-marker"),
]


@pytest.mark.parametrize(("storage_of", "strategy"), BACKENDS)
def test_a_linked_checkpoint_is_never_discovered_or_restored(roots, storage_of, strategy, caplog):
    root, other = roots
    _setup(root, other, storage_of, strategy)
    with OpenWatch(_files(other)) as watch:
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            reader = _manager(storage_of(root), strategy=strategy, read_only=True)
            assert reader.latest().step == 1
            assert [c.step for c in reader.checkpoints()] == [1]
            assert reader.restore()["step"] == 1
            with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
                reader.restore(step=5)
            reader.close()
        assert watch.events() == []
    assert any(
        "checkpoint-5" in r.getMessage() and "symbolic link" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(("storage_of", "strategy"), BACKENDS)
def test_retention_never_deletes_through_a_linked_checkpoint(roots, storage_of, strategy):
    root, other = roots
    _setup(root, other, storage_of, strategy)
    before = snapshot(other)
    with OpenWatch(_files(other)) as watch:
        # Keep one: retention deletes 1 and 6, and never touches the link.
        mgr = _manager(storage_of(root), strategy=strategy, retention=KeepLast(1))
        mgr.save(6, _state(6))
        mgr.save(7, _state(7))
        mgr.close()
        opened = watch.events()
    assert snapshot(other) == before
    assert os.readlink(root / "checkpoint-5") == str(other / "checkpoint-5")
    assert opened == []
    assert not (root / "checkpoint-1").exists() and not (root / "checkpoint-6").exists()
    assert (root / "checkpoint-7" / MANIFEST_NAME).is_file()


@pytest.mark.parametrize("url", [False, True], ids=["local", "file-url"])
def test_the_cli_lists_the_link_as_unsafe_and_never_reads_or_deletes_through_it(roots, url):
    root, other = roots
    _setup(root, other, _local, None)
    # OTHER also has a save in progress (marker strategy: a marker, an attempt, no
    # manifest) that ROOT links: a sweep through the link would delete OTHER's work.
    busy = other / "checkpoint-8"
    (busy / "attempt-0123456789abcdef").mkdir(parents=True)
    (busy / "attempt-0123456789abcdef" / "rank-00000.safetensors").write_bytes(b"x" * 100)
    (busy / marker_name("0123456789abcdef")).write_text("{}")
    os.symlink(busy, root / "checkpoint-8")
    before = snapshot(other)
    where = f"file://{root}" if url else str(root)
    with OpenWatch(_files(other)) as watch:
        entries = {e["name"]: e for e in run_json("list", where)["entries"]}
        for name in ("checkpoint-5", "checkpoint-8"):
            assert entries[name]["status"] == "foreign", entries[name]
            assert "symbolic link" in entries[name]["problem"]
        assert entries["checkpoint-1"]["status"] == "ok"
        # verify does not follow the links either, and fails on them: a checkpoint name
        # that is no checkpoint of ROOT must not pass `verify && upload`.
        doc = run_json("verify", where, expect_rc=1)
        checked = {c["name"]: c["status"] for c in doc["checkpoints"]}
        assert checked == {
            "checkpoint-1": "ok",
            "checkpoint-5": "not_a_checkpoint",
            "checkpoint-8": "not_a_checkpoint",
        }
        proc = run_cli("clean", where)
        assert proc.returncode == 0, proc.stderr
        proc = run_cli("prune", where, "--keep-last", "1", "--run-id", RUN)
        assert proc.returncode == 0, proc.stderr
        assert watch.events() == []
    assert (root / "checkpoint-1").is_dir()  # the newest real checkpoint: kept
    assert os.path.islink(root / "checkpoint-5") and os.path.islink(root / "checkpoint-8")
    assert snapshot(other) == before


def test_a_linked_pending_directory_is_never_swept_through(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    mgr = _manager(root, strategy=None)
    mgr.save(1, _state(1))
    mgr.close()
    (elsewhere / "checkpoint-3.0123456789abcdef").mkdir(parents=True)
    (elsewhere / "checkpoint-3.0123456789abcdef" / "precious").write_bytes(b"keep me")
    (elsewhere / "notes").write_text("keep me too")
    os.rmdir(root / PENDING_DIR)
    os.symlink(elsewhere, root / PENDING_DIR)
    before = snapshot(elsewhere)
    # A writable start would sweep .pending/ (and then write into it): refused, naming
    # the link; nothing behind it is touched.
    with pytest.raises(UnsafeCheckpointError, match=r"\.pending.*symbolic link"):
        _manager(root, strategy=None)
    assert run_cli("clean", root).returncode == 0
    reader = _manager(root, strategy=None, read_only=True)
    assert reader.restore()["step"] == 1
    reader.close()
    assert snapshot(elsewhere) == before


def test_files_inside_a_checkpoint_are_never_read_through_links(tmp_path):
    """A link inside a checkpoint, even to a valid file inside the same checkpoint, is
    not followed: a checkpoint holds regular files only."""
    root = tmp_path / "root"
    mgr = _manager(root, strategy=None)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    mgr.close()
    ckpt = root / "checkpoint-2"
    doc = json.loads((ckpt / MANIFEST_NAME).read_text())
    name = doc["files"][0]["path"]
    os.rename(ckpt / name, ckpt / "real.bin")
    os.symlink("real.bin", ckpt / name)  # resolves inside the checkpoint
    reader = _manager(root, strategy=None, read_only=True)
    assert reader.latest().step == 1
    with pytest.raises(UnsafeCheckpointError, match="symbolic link that resolves inside") as err:
        reader.restore(step=2)
    assert "cp -rL" in str(err.value)  # what makes such a copy readable
    reader.close()


def test_a_directory_inside_a_checkpoint_replaced_by_a_link_is_never_read_through(tmp_path):
    # The walk from the checkpoint down (one lstat per component) must refuse a linked
    # directory on the way, not only a linked file: here it leads out of ROOT to a copy
    # with the same bytes, which every size and checksum would accept.
    root = tmp_path / "root"
    mgr = _manager(root, strategy=None)
    for step in (1, 2):
        with mgr.saving(step) as d:
            (d / "model").mkdir()
            (d / "model" / "weights.bin").write_bytes(bytes([step]) * 64)
    mgr.close()
    outside = tmp_path / "outside"
    shutil.move(str(root / "checkpoint-2" / "model"), outside)
    os.symlink(outside, root / "checkpoint-2" / "model")
    reader = _manager(root, strategy=None, read_only=True)
    assert reader.latest().step == 1
    with pytest.raises(UnsafeCheckpointError, match="symbolic link that resolves outside"):
        reader.verify(2)
    reader.close()


def test_a_saving_block_that_writes_a_link_fails_before_the_commit(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    mgr = _manager(root, strategy=None)
    try:
        with (
            pytest.raises(UnsafeCheckpointError, match="symbolic link"),
            mgr.saving(3) as d,
        ):
            Path(d, "weights.bin").write_bytes(b"w" * 10)
            os.symlink(outside, Path(d, "config.json"))
        assert mgr.checkpoints() == []
    finally:
        mgr.close()
    assert outside.read_bytes() == b"secret"
