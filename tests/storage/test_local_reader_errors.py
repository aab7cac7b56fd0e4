"""A reader of a local (or FUSE-mounted) file whose mount went away: the read fails
(EIO), and so does the close that follows (sshfs: ENOTCONN). The close's bare OSError
replaced the read's StorageError, so ``restore()`` on a node whose ssh transport was
killed raised an ``OSError`` outside the error tree, with no path."""

from __future__ import annotations

import errno
import io

import pytest

from atomic_checkpoint.errors import CheckpointError, StorageError
from atomic_checkpoint.storage.local import LocalStorage


class _GoneFile(io.FileIO):
    """A real file whose reads and close fail as on a FUSE mount whose server died."""

    def read(self, size: int = -1, /) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    def close(self) -> None:
        super().close()
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")


@pytest.fixture
def gone_reader(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"x" * 64)
    storage = LocalStorage(str(tmp_path))
    reader = storage.open_read("f.bin")
    real = reader._f
    reader._f = _GoneFile(real.fileno(), "rb", closefd=False)
    yield reader
    real.close()


def test_a_failing_read_is_the_error_raised_not_the_close_after_it(gone_reader):
    with pytest.raises(StorageError) as err, gone_reader as f:
        f.read(8)
    assert err.value.errno == errno.EIO and "f.bin" in str(err.value)


def test_a_failing_close_is_a_storage_error_naming_the_file(gone_reader):
    with pytest.raises(CheckpointError) as err:
        gone_reader.close()
    assert isinstance(err.value, StorageError) and err.value.errno == errno.ENOTCONN
    assert "f.bin" in str(err.value)


def test_a_file_removed_between_open_and_read_is_not_found(tmp_path):
    # s3fs-fuse fetches an object at the first read: one another node's retention
    # deleted after the open failed the read with ENOENT, raised as a StorageError
    # that a reader's `except CheckpointNotFoundError` (list again) did not catch.
    from atomic_checkpoint.errors import CheckpointNotFoundError

    class _Removed(io.FileIO):
        def read(self, size: int = -1, /) -> bytes:
            raise OSError(errno.ENOENT, "No such file or directory")

    (tmp_path / "f.bin").write_bytes(b"x" * 64)
    reader = LocalStorage(str(tmp_path)).open_read("f.bin")
    real = reader._f
    reader._f = _Removed(real.fileno(), "rb", closefd=False)
    try:
        with pytest.raises(CheckpointNotFoundError, match="removed while being read"):
            reader.read(8)
    finally:
        real.close()


def test_replace_with_link_swaps_the_entry_in_one_step(tmp_path):
    # Lightning's save_last="link": last.ckpt is never absent, and a temporary name
    # that cannot be made (taken) fails inside the error tree and leaves the link alone.
    (tmp_path / "a.ckpt").write_bytes(b"a")
    (tmp_path / "b.ckpt").write_bytes(b"b")
    (tmp_path / "last.ckpt").symlink_to("a.ckpt")
    storage = LocalStorage(str(tmp_path))
    storage.replace_with_link("last.ckpt", ".last.ckpt.t1.pending", "b.ckpt")
    assert (tmp_path / "last.ckpt").read_bytes() == b"b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "b.ckpt", "last.ckpt"]
    (tmp_path / ".last.ckpt.t2.pending").write_bytes(b"taken")
    with pytest.raises(StorageError):
        storage.replace_with_link("last.ckpt", ".last.ckpt.t2.pending", "a.ckpt")
    assert (tmp_path / "last.ckpt").read_bytes() == b"b"
