"""One contract, every backend: what the commit protocol relies on from storage."""

from __future__ import annotations

import errno

import pytest

from atomic_checkpoint import LocalStorage, MemoryStorage
from atomic_checkpoint.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    StorageFullError,
)


@pytest.fixture(params=["memory", "local"])
def storage(request, tmp_path):
    if request.param == "memory":
        return MemoryStorage()
    s = LocalStorage(tmp_path / "root")
    s.makedirs("")
    return s


def _write(storage, path, data):
    w = storage.open_write(path, size_hint=len(data))
    w.write(data)
    w.close()


def test_write_read_size(storage):
    storage.makedirs("a/b")
    _write(storage, "a/b/f.bin", b"x" * 1000)
    assert storage.size("a/b/f.bin") == 1000
    assert storage.read_bytes("a/b/f.bin") == b"x" * 1000
    with storage.open_read("a/b/f.bin") as f:
        buf = bytearray(10)
        assert f.readinto(buf) == 10
    assert storage.walk_files("a") == [("b/f.bin", 1000)]
    assert storage.listdir("a") == ["b"]


def test_missing_things(storage):
    assert storage.size("nope") is None
    assert storage.listdir("nope") == []
    with pytest.raises(CheckpointNotFoundError):
        storage.read_bytes("nope")
    storage.delete_file("nope")  # tolerated
    storage.delete_tree("nope")  # tolerated


def test_rename_dir_never_replaces(storage):
    storage.makedirs("src")
    _write(storage, "src/f", b"1")
    storage.makedirs("dst")
    _write(storage, "dst/g", b"2")
    with pytest.raises(CheckpointExistsError):
        storage.rename_dir("src", "dst")
    assert storage.read_bytes("dst/g") == b"2"
    assert storage.read_bytes("src/f") == b"1"


def test_rename_dir_onto_empty_dir_does_not_replace_it(storage):
    # POSIX rename(2) silently replaces an empty directory: a commit must not.
    storage.makedirs("src")
    _write(storage, "src/f", b"1")
    storage.makedirs("dst")
    with pytest.raises(CheckpointExistsError):
        storage.rename_dir("src", "dst")


def test_rename_dir_moves_everything(storage):
    storage.makedirs("p/sub")
    _write(storage, "p/sub/f", b"abc")
    storage.rename_dir("p", "q")
    assert storage.read_bytes("q/sub/f") == b"abc"
    assert storage.size("p/sub/f") is None


def test_exchange_swaps_when_supported(storage):
    storage.makedirs("a")
    storage.makedirs("b")
    _write(storage, "a/x", b"A")
    _write(storage, "b/x", b"B")
    if storage.exchange_dirs("a", "b"):
        assert storage.read_bytes("a/x") == b"B"
        assert storage.read_bytes("b/x") == b"A"


def test_write_bytes_atomic_replaces_whole(storage):
    storage.write_bytes_atomic("m.json", b"old")
    storage.write_bytes_atomic("m.json", b"new content")
    assert storage.read_bytes("m.json") == b"new content"
    assert [n for n in storage.listdir("") if "tmp" in n] == []


def test_create_exclusive_has_one_winner(storage):
    assert storage.create_exclusive("lock", b"me")
    assert not storage.create_exclusive("lock", b"you")
    assert storage.read_bytes("lock") == b"me"


def test_delete_tree(storage):
    storage.makedirs("t/u")
    _write(storage, "t/u/f", b"1")
    _write(storage, "t/g", b"1")
    storage.delete_tree("t")
    assert storage.walk_files("t") == []
    assert storage.size("t/g") is None


def test_abort_leaves_nothing(storage):
    storage.makedirs("d")
    w = storage.open_write("d/f")
    w.write(b"partial")
    w.abort()
    assert storage.size("d/f") is None


def test_fsync_dir_of_existing_dir(storage):
    storage.makedirs("d")
    storage.fsync_dir("d")
    storage.fsync_dir("")


def test_memory_faults_map_to_error_tree():
    s = MemoryStorage()
    s.makedirs("d")
    s.inject("write", "f", OSError(errno.ENOSPC, "No space left on device"))
    w = s.open_write("d/f")
    with pytest.raises(StorageFullError, match="Free space"):
        w.write(b"x")
    w.write(b"y")  # one-time fault
    w.close()
    assert s.read_bytes("d/f") == b"y"


def test_local_root_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    s = LocalStorage(f)
    with pytest.raises(StorageError):
        s.makedirs("a")


def test_local_files_get_umask_permissions_not_0600(tmp_path):
    import os

    s = LocalStorage(tmp_path)
    old = os.umask(0o022)
    try:
        _write(s, "f", b"1")
        s.write_bytes_atomic("g", b"1")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "g").st_mode & 0o777 == 0o644
