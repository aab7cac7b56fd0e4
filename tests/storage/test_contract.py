"""One contract, every backend: what the commit protocol relies on from storage.

Each test runs against every backend people train on, each one real:

- ``memory``: ``MemoryStorage`` (unit tests of pure logic use it, so it must agree);
- ``local``: ``LocalStorage`` on the test's own directory;
- ``tmpfs``, ``ext4``, ``xfs``: ``LocalStorage`` on a freshly made small filesystem
  (XFS reports EEXIST where ext4 reports ENOTEMPTY);
- ``sshfs``: ``LocalStorage`` on an sshfs mount of a private sshd (default caching;
  capabilities read from the mount table: not coherent);
- ``fsspec-memory``, ``fsspec-file``, ``fsspec-s3``: ``FsspecStorage`` on
  ``memory://``, ``file://`` and ``s3://`` against a real moto S3 server.

Where a backend may legitimately differ, the test reads the capability and asserts the
behaviour that capability promises (e.g. no atomic directory rename: ``rename_dir``
must refuse, moving nothing).
"""

# Fixtures imported from tests.testbed are requested by parameter name.

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, KeepLast, LocalStorage, MemoryStorage
from atomic_checkpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    StorageFullError,
)
from atomic_checkpoint.storage.base import RenamingStorage, StorageCapabilities, renaming
from atomic_checkpoint.storage.detect import local_capabilities
from atomic_checkpoint.strategies import choose_strategy
from tests.testbed import S3Server, SmallDisk, SshfsExport
from tests.testbed.pytest_fixtures import require_facility

BACKENDS = [
    "memory",
    "local",
    "tmpfs",
    "ext4",
    "xfs",
    "sshfs",
    "fsspec-memory",
    "fsspec-file",
    "fsspec-s3",
]

_FACILITY = {"tmpfs": "tmpfs", "ext4": "ext4", "xfs": "xfs", "sshfs": "sshfs", "fsspec-s3": "moto"}


class _Services:
    """Module-wide services, started on first use: one small disk per kind, one sshd
    with one mount, one S3 server with one bucket. Each test gets a fresh root inside."""

    def __init__(self, base: Path):
        self.base = base
        self.stack = contextlib.ExitStack()
        self._disks: dict[str, Path] = {}
        self._sshfs: Path | None = None
        self._s3: tuple[S3Server, str] | None = None

    def disk(self, kind: str) -> Path:
        if kind not in self._disks:
            disk = self.stack.enter_context(SmallDisk(self.base / kind, 64, kind))
            self._disks[kind] = disk.path
        return self._disks[kind]

    def sshfs(self) -> Path:
        if self._sshfs is None:
            export = self.stack.enter_context(SshfsExport(self.base / "sshfs-srv"))
            self._sshfs = export.mount(self.base / "sshfs-mnt").path
        return self._sshfs

    def s3(self) -> tuple[S3Server, str]:
        if self._s3 is None:
            server = self.stack.enter_context(S3Server(self.base / "moto"))
            self._s3 = (server, server.create_bucket("contract"))
        return self._s3


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Services]:
    svc = _Services(tmp_path_factory.mktemp("contract-services"))
    with svc.stack:
        yield svc


def make_storage(kind: str, services: _Services, tmp_path: Path) -> Any:
    """A fresh, empty storage root of backend ``kind``."""
    if kind in _FACILITY:
        require_facility(_FACILITY[kind])
    fresh = uuid.uuid4().hex[:12]
    if kind == "memory":
        return MemoryStorage()
    if kind == "local":
        s = LocalStorage(tmp_path / "root")
    elif kind in ("tmpfs", "ext4", "xfs"):
        root = services.disk(kind) / fresh
        s = LocalStorage(root, capabilities=local_capabilities(root))
    elif kind == "sshfs":
        root = services.sshfs() / fresh
        s = LocalStorage(root, capabilities=local_capabilities(root))
        assert s.capabilities.name == "sshfs" and not s.capabilities.coherent
    else:
        from atomic_checkpoint.storage import FsspecStorage

        if kind == "fsspec-memory":
            return FsspecStorage(f"memory://contract-{fresh}/root")
        if kind == "fsspec-file":
            s = FsspecStorage(f"file://{tmp_path}/root")
        else:
            server, bucket = services.s3()
            # 5 MiB parts (the S3 minimum): the large-file tests become real multipart
            # uploads of several parts.
            return FsspecStorage(
                f"s3://{bucket}/{fresh}",
                storage_options=server.storage_options(),
                block_size_bytes=5 << 20,
            )
    s.makedirs("")
    return s


@pytest.fixture(params=BACKENDS)
def storage(request: pytest.FixtureRequest, services: _Services, tmp_path: Path) -> Any:
    return make_storage(request.param, services, tmp_path)


def _write(storage: Any, path: str, data: bytes) -> None:
    w = storage.open_write(path, size_hint=len(data))
    w.write(data)
    w.close()


def _create(storage: Any, path: str, data: bytes) -> None:
    """``path`` written with ``data``, its directory made first."""
    storage.makedirs(posixpath.dirname(path))
    _write(storage, path, data)


pytestmark = pytest.mark.timeout(60)


def test_write_read_size(storage):
    _create(storage, "a/b/f.bin", b"x" * 1000)
    assert storage.size("a/b/f.bin") == 1000
    assert storage.read_bytes("a/b/f.bin") == b"x" * 1000
    with storage.open_read("a/b/f.bin") as f:
        buf = bytearray(10)
        assert f.readinto(buf) == 10
    assert storage.walk_files("a") == [("b/f.bin", 1000)]
    assert storage.listdir("a") == ["b"]


def test_large_streamed_write_reads_back_exactly(storage):
    # 13 MiB in uneven pieces: on S3 this is a multipart upload of several parts, and
    # the read goes through ranged GETs (readahead for small reads, direct for large).
    data = os.urandom(1 << 20) * 13
    storage.makedirs("big")
    w = storage.open_write("big/f.bin", size_hint=len(data))
    view = memoryview(data)
    for start in range(0, len(data), 3 << 20):
        w.write(view[start : start + (3 << 20)])
    w.close()
    assert storage.size("big/f.bin") == len(data)
    with storage.open_read("big/f.bin") as f:
        head = f.read(8)
        out = bytearray(len(data) - 8)
        got = 0
        view_out = memoryview(out)
        while got < len(out):
            n = f.readinto(view_out[got:])
            assert n, "readinto returned 0 before the end"
            got += n
        assert f.readinto(bytearray(16)) == 0  # at the end
        assert head + bytes(out) == data
        f.seek(5 << 20)
        assert f.read(100) == data[5 << 20 : (5 << 20) + 100]


def test_missing_things(storage):
    assert storage.size("nope") is None
    storage.makedirs("a-dir/sub")
    assert storage.size("a-dir") is None  # not a file (local: was the directory's 4096)
    assert storage.listdir("nope") == []
    assert storage.walk_files("nope") == []
    with pytest.raises(CheckpointNotFoundError):
        storage.read_bytes("nope")
    with pytest.raises(CheckpointNotFoundError):
        storage.open_read("nope/deeper")
    storage.delete_file("nope")  # tolerated
    storage.delete_tree("nope")  # tolerated


def test_listdir_names_direct_children_sorted(storage):
    storage.makedirs("d/sub")
    for name in ("b", "a", "c10", "c9"):
        _write(storage, f"d/{name}", b"1")
    _write(storage, "d/sub/deep", b"1")
    assert storage.listdir("d") == ["a", "b", "c10", "c9", "sub"]
    assert storage.walk_files("d") == [
        ("a", 1),
        ("b", 1),
        ("c10", 1),
        ("c9", 1),
        ("sub/deep", 1),
    ]
    assert storage.is_dir("d/sub")
    assert not storage.is_dir("d/a")
    assert not storage.is_dir("nope")


def _assert_rename_refused(storage, src: str, dst: str, before: dict[str, bytes]) -> None:
    """No atomic directory rename: an object store is not a ``RenamingStorage`` (a
    prefix "move" there is copy-then-delete and can stop half way), so nothing can ask
    it to rename, and asking through ``renaming`` says why; nothing moved."""
    assert not isinstance(storage, RenamingStorage) and not hasattr(storage, "rename_dir")
    with pytest.raises(StorageError, match="no atomic directory rename") as err:
        renaming(storage).rename_dir(src, dst)
    assert err.value.errno == errno.ENOTSUP
    with pytest.raises(StorageError, match="no atomic directory rename"):
        choose_strategy(storage, "rename")  # refused when the manager opens, not at a commit
    for path, data in before.items():
        assert storage.read_bytes(path) == data


def test_rename_dir_never_replaces(storage):
    _create(storage, "src/f", b"1")
    _create(storage, "dst/g", b"2")
    if not storage.capabilities.atomic_dir_rename:
        _assert_rename_refused(storage, "src", "dst", {"src/f": b"1", "dst/g": b"2"})
        return
    with pytest.raises(CheckpointExistsError):
        storage.rename_dir("src", "dst")
    assert storage.read_bytes("dst/g") == b"2"
    assert storage.read_bytes("src/f") == b"1"


def test_rename_dir_onto_empty_dir_does_not_replace_it(storage):
    # POSIX rename(2) silently replaces an empty directory: a commit must not.
    _create(storage, "src/f", b"1")
    storage.makedirs("dst")
    if not storage.capabilities.atomic_dir_rename:
        _assert_rename_refused(storage, "src", "dst", {"src/f": b"1"})
        return
    with pytest.raises(CheckpointExistsError):
        storage.rename_dir("src", "dst")


def test_rename_dir_moves_everything(storage):
    _create(storage, "p/sub/f", b"abc")
    if not storage.capabilities.atomic_dir_rename:
        _assert_rename_refused(storage, "p", "q", {"p/sub/f": b"abc"})
        assert storage.size("q/sub/f") is None
        return
    storage.rename_dir("p", "q")
    assert storage.read_bytes("q/sub/f") == b"abc"
    assert storage.size("p/sub/f") is None


def test_exchange_swaps_when_supported(storage):
    _create(storage, "a/x", b"A")
    _create(storage, "b/x", b"B")
    if not isinstance(storage, RenamingStorage):
        assert not hasattr(storage, "exchange_dirs")  # an object store: nothing to ask
        return
    if storage.exchange_dirs("a", "b"):
        assert storage.read_bytes("a/x") == b"B"
        assert storage.read_bytes("b/x") == b"A"
    else:
        assert storage.read_bytes("a/x") == b"A"
        assert storage.read_bytes("b/x") == b"B"


def test_write_bytes_atomic_replaces_whole(storage):
    storage.write_bytes_atomic("m.json", b"old")
    storage.write_bytes_atomic("m.json", b"new content")
    assert storage.read_bytes("m.json") == b"new content"
    assert [n for n in storage.listdir("") if "tmp" in n] == []


def test_write_bytes_atomic_readers_never_see_a_part(storage):
    # A reader racing the writer sees the old or the new content, whole: the manifest
    # and the run lock depend on it (sshfs: a reader on another client can open a file
    # between its creation and its first write). Measured on sshfs with default
    # caching: the replaced name is briefly missing (ENOENT) for a reader on the same
    # mount, about 1 open in 20-100 while replaces run (none with caching off); so a
    # missing name is tolerated only where the backend does not claim coherence.
    old, new = b"A" * 300_000, b"B" * 200_000
    storage.write_bytes_atomic("m", old)
    stop = threading.Event()
    seen: set[tuple[int, bytes]] = set()
    bad: list[int] = []
    missing: list[int] = []

    def read() -> None:
        for _ in range(10_000):
            if stop.is_set():
                return
            try:
                data = storage.read_bytes("m")
            except CheckpointNotFoundError:
                missing.append(1)
                continue
            if data not in (old, new):
                bad.append(len(data))
            seen.add((len(data), data[:1]))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(20):
            storage.write_bytes_atomic("m", new if i % 2 == 0 else old)
    finally:
        stop.set()
        reader.join(timeout=30)
    assert not reader.is_alive()
    assert bad == [], f"reader saw partial content: sizes {bad[:10]}"
    if storage.capabilities.coherent:
        assert missing == [], f"the name was missing {len(missing)} time(s) during replaces"
    assert seen, "the reader never read"


def test_create_exclusive_has_one_winner(storage):
    assert storage.create_exclusive("lock", b"me")
    assert not storage.create_exclusive("lock", b"you")
    assert storage.read_bytes("lock") == b"me"


def test_create_exclusive_racing_threads_one_winner(storage):
    # Against a real S3 server this is the conditional PUT (If-None-Match: *): the
    # commit of the marker strategy depends on it.
    if not storage.capabilities.exclusive_create:
        pytest.fail(f"{storage!r} claims no exclusive create; every backend here has one")

    def race(i: int, path: str, barrier: threading.Barrier, wins: list[int]) -> None:
        barrier.wait(timeout=10)
        if storage.create_exclusive(path, f"writer {i}".encode()):
            wins.append(i)

    for round_ in range(5):
        barrier = threading.Barrier(6)
        wins: list[int] = []
        threads = [
            threading.Thread(target=race, args=(i, f"race-{round_}", barrier, wins))
            for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(wins) == 1, f"round {round_}: winners {wins}"
        assert storage.read_bytes(f"race-{round_}") == f"writer {wins[0]}".encode()


def test_delete_tree(storage):
    _create(storage, "t/u/f", b"1")
    _write(storage, "t/g", b"1")
    storage.delete_tree("t")
    assert storage.walk_files("t") == []
    assert storage.size("t/g") is None


def test_delete_tree_spares_names_sharing_a_prefix(storage):
    # Object stores delete by key prefix: deleting checkpoint-1 must never touch
    # checkpoint-10 or checkpoint-1x.
    for d in ("checkpoint-1", "checkpoint-10"):
        _create(storage, f"{d}/f", b"1")
    _write(storage, "checkpoint-1x", b"2")
    storage.delete_tree("checkpoint-1")
    assert storage.size("checkpoint-1/f") is None
    assert storage.read_bytes("checkpoint-10/f") == b"1"
    assert storage.read_bytes("checkpoint-1x") == b"2"


def test_delete_file(storage):
    _create(storage, "d/f", b"1")
    storage.delete_file("d/f")
    assert storage.size("d/f") is None
    storage.delete_file("d/f")  # twice: tolerated


def test_abort_leaves_nothing(storage):
    storage.makedirs("d")
    w = storage.open_write("d/f")
    w.write(b"partial")
    w.abort()
    assert storage.size("d/f") is None


def test_abort_of_a_large_write_leaves_nothing(storage):
    # Large enough that S3 has already uploaded parts of a multipart upload.
    storage.makedirs("d")
    w = storage.open_write("d/big")
    w.write(b"x" * (12 << 20))
    w.abort()
    assert storage.size("d/big") is None
    assert storage.walk_files("d") == []


def test_fsync_dir_of_existing_dir(storage):
    storage.makedirs("d")
    storage.fsync_dir("d")
    storage.fsync_dir("")


def test_errors_are_in_the_error_tree(storage):
    # Reading a directory as a file: every backend answers with one of our errors,
    # never a raw OSError or a backend exception.
    _create(storage, "dir/f", b"1")
    with pytest.raises(CheckpointError):
        storage.read_bytes("dir")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", [None, "marker"])
def test_manager_round_trip(storage, strategy):
    """The whole protocol on this backend: save, rotate, restore, verify, under the
    automatic strategy and under the marker strategy forced."""
    np = pytest.importorskip("numpy")
    mgr = CheckpointManager(storage, retention=KeepLast(2), strategy=strategy)
    expected = "marker" if strategy or not storage.capabilities.atomic_dir_rename else "rename"
    assert mgr.commit_strategy == expected
    for step in (1, 2, 3):
        info = mgr.save(step, {"w": np.full(1000, step, dtype=np.float32), "step": step})
        assert info.step == step
    mgr.close()
    reader = CheckpointManager(storage, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [2, 3]
    state = reader.restore()
    assert state["step"] == 3 and float(state["w"].sum()) == 3000.0
    assert reader.restore(step=2)["step"] == 2
    assert reader.verify(3).step == 3
    # Rotation deleted step 1 entirely: no manifest, no data, nothing pending.
    assert storage.walk_files("checkpoint-1") == []
    assert [n for n in storage.listdir("") if n.startswith("checkpoint-")] == [
        "checkpoint-2",
        "checkpoint-3",
    ]
    reader.close()


def test_memory_faults_map_to_error_tree():
    s = MemoryStorage()
    s.makedirs("d")
    s.inject("write", "f", OSError(errno.ENOSPC, "No space left on device"))
    w = s.open_write("d/f")
    # What frees space: retention runs only after a save commits, so "lower retention"
    # alone freed nothing; prune (it works on a full disk) or apply_retention() do.
    with pytest.raises(StorageFullError, match=r"Free space.*atomic-checkpoint prune ROOT"):
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
    s = LocalStorage(tmp_path)
    old = os.umask(0o022)
    try:
        _write(s, "f", b"1")
        s.write_bytes_atomic("g", b"1")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "g").st_mode & 0o777 == 0o644


_MOUNTINFO = "\n".join(
    [
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw",
        "30 22 0:30 / /data rw,relatime shared:5 - xfs /dev/vdb rw",
        "31 30 0:31 / /data/s3 rw,nosuid - fuse.s3fs s3fs rw,user_id=0",
        "32 30 0:32 / /data/gcs rw - fuse.gcsfuse my-bucket rw",
        "33 30 0:33 / /data/mp rw - fuse.mountpoint-s3 mountpoint-s3 rw",
        "34 30 0:34 / /data/old rw - fuse goofys rw",
        r"35 30 0:35 / /data/with\040space rw - fuse.sshfs host:/x rw",
        "36 30 0:36 / /data/nfs rw - nfs4 srv:/export rw",
        # Stacked on the same mount point: the later one is on top.
        "37 31 0:37 / /data/s3 rw - tmpfs tmpfs rw",
        "garbage line",
    ]
)


@pytest.mark.parametrize(
    ("path", "fstype", "copy_delete"),
    [
        ("/data/run1", "xfs", False),
        ("/data/s3x/run", "xfs", False),  # a sibling sharing a prefix is not inside
        ("/data/s3/run", "tmpfs", False),  # tmpfs stacked over the s3fs mount
        ("/data/gcs/deep/run", "fuse.gcsfuse", True),
        ("/data/mp/run", "fuse.mountpoint-s3", True),
        ("/data/old/run", "fuse", True),  # no subtype: the source names the daemon
        ("/data/with space/run", "fuse.sshfs", False),
        ("/data/nfs", "nfs4", False),
        ("/elsewhere", "ext4", False),
    ],
)
def test_mount_detection_from_the_mount_table(path, fstype, copy_delete):
    from atomic_checkpoint.storage.detect import mount_of

    mount = mount_of(path, table=_MOUNTINFO)
    assert mount is not None and mount.fstype == fstype
    assert mount.is_copy_delete is copy_delete


def test_mount_detection_of_this_machine(tmp_path):
    from atomic_checkpoint.storage.detect import mount_of

    # A path that does not exist yet lives on the mount of its nearest parent.
    assert mount_of(tmp_path / "not" / "yet") == mount_of(tmp_path)
    assert local_capabilities(tmp_path).atomic_dir_rename


@pytest.mark.timeout(60)
def test_strategy_override_and_refusal(tmp_path, caplog):
    from atomic_checkpoint.storage import FsspecStorage

    with pytest.raises(ValueError, match="strategy must be one of"):
        CheckpointManager(tmp_path / "a", strategy="copy")
    assert CheckpointManager(tmp_path / "b", strategy="marker").commit_strategy == "marker"
    # Forcing rename on an object store, which has no directory rename at all, is
    # refused when the manager opens (not at its first commit), and leaves no lock.
    store = FsspecStorage(f"memory://override-{uuid.uuid4().hex[:8]}/root")
    with pytest.raises(StorageError, match="no atomic directory rename"):
        CheckpointManager(store, strategy="rename")
    mgr = CheckpointManager(store)
    assert mgr.commit_strategy == "marker" and mgr.save(1, {"x": 1}).step == 1
    mgr.close()
    # A mounted filesystem whose rename is not atomic (a copy+delete FUSE mount): allowed,
    # with a warning.
    fuse_like = LocalStorage(
        tmp_path / "d", capabilities=StorageCapabilities(name="fuse.s3fs", atomic_dir_rename=False)
    )
    (tmp_path / "d").mkdir()
    mgr = CheckpointManager(fuse_like, strategy="rename")
    assert mgr.commit_strategy == "rename"
    assert "whose directory rename is not atomic" in caplog.text
    mgr.close()
    with pytest.raises(ValueError, match="storage_options apply to URL roots"):
        CheckpointManager(tmp_path / "c", storage_options={"key": "k"})


def test_a_name_replaced_between_open_and_fstat_reads_as_missing(tmp_path, monkeypatch):
    # sshfs answers fstat by path, so a name that another writer replaces just after
    # our open() gives ENOENT there (seen under load in the race test above). That is
    # the same transient "not there" as a missed open, not an I/O error: readers that
    # tolerate a missing name during replaces (the catalog, the lock) must get
    # CheckpointNotFoundError. The race itself cannot be forced, so fstat is made to
    # answer as sshfs did.
    storage = LocalStorage(tmp_path)
    storage.write_bytes_atomic("m", b"x")
    real = os.fstat

    def fstat_as_sshfs(fd: int) -> Any:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    fds = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fstat", fstat_as_sshfs)
    with pytest.raises(CheckpointNotFoundError, match="vanished while being opened"):
        storage.read_bytes("m")
    monkeypatch.setattr(os, "fstat", real)
    assert set(os.listdir("/proc/self/fd")) <= fds, "the failed open leaked its descriptor"
    assert storage.read_bytes("m") == b"x"


def test_read_bytes_is_bounded(storage, monkeypatch):
    """``read_bytes`` refuses a file larger than ``MAX_READ_BYTES`` (local: from its
    size, before reading; object stores: one ranged GET of one byte more), and still
    reads an empty file (S3 refuses a range on an empty object)."""
    from atomic_checkpoint.errors import CorruptCheckpointError
    from atomic_checkpoint.storage import base, fsspec, memory

    # The local storage reads the bound from base; the others hold their own copy.
    for module in (base, fsspec, memory):
        monkeypatch.setattr(module, "MAX_READ_BYTES", 1000)
    _create(storage, "d/empty", b"")
    _write(storage, "d/full", b"x" * 1000)
    _write(storage, "d/big", b"x" * 1001)
    assert storage.read_bytes("d/empty") == b""
    assert storage.read_bytes("d/full") == b"x" * 1000
    with pytest.raises(CorruptCheckpointError, match="refusing to read it"):
        storage.read_bytes("d/big")


def test_no_operation_goes_through_a_symbolic_link(storage, tmp_path):
    """Mounted backends: a link inside the root is never read, written, listed or
    deleted through (DESIGN invariant 9); what it points to stays intact."""
    from atomic_checkpoint.errors import UnsafeCheckpointError

    root = storage.local_path("")
    if root is None:
        pytest.skip(f"{storage.url()} has no symbolic links (not a mounted filesystem)")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"outside")
    os.symlink(outside, os.path.join(root, "link"))
    os.symlink(outside / "f", os.path.join(root, "flink"))
    for op in (
        lambda: storage.read_bytes("link/f"),
        lambda: storage.read_bytes("flink"),
        lambda: storage.open_read("flink"),
        lambda: storage.size("link/f"),
        lambda: storage.open_write("link/g"),
        lambda: storage.write_bytes_atomic("link/g", b"x"),
        lambda: storage.makedirs("link/sub"),
        lambda: storage.delete_file("link/f"),
        lambda: storage.delete_tree("link"),
        lambda: storage.walk_files("link"),
    ):
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            op()
    assert storage.listdir("link") == [] and not storage.is_dir("link")
    assert sorted(os.listdir(outside)) == ["f"] and (outside / "f").read_bytes() == b"outside"
    storage.delete_file("flink")  # the link itself may go; never what it points to
    assert (outside / "f").read_bytes() == b"outside"
