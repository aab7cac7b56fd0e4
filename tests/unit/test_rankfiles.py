"""One rank's files (``rankfiles``): what ``write_plan`` and ``report_files`` report is
what is on disk, and O_DIRECT is used only where the storage declares it.

Real files in a temp dir; the only stand-ins are storages that refuse to be asked for
direct I/O, and a plan that fails after its first chunk.
"""

from __future__ import annotations

import ast
import threading
from dataclasses import replace
from pathlib import Path

import pytest

import atomic_checkpoint
from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.layout import checkpoint_name, rank_state_file
from atomic_checkpoint.manifest import Hasher
from atomic_checkpoint.rankfiles import RankReport, Staging, report_files, write_plan
from atomic_checkpoint.serialization import load_state, plan_state
from atomic_checkpoint.storage.base import StorageCapabilities, direct_io
from atomic_checkpoint.storage.local import LocalStorage
from atomic_checkpoint.storage.memory import MemoryStorage
from atomic_checkpoint.storage.project import ProjectStorage

np = pytest.importorskip("numpy", reason="state files of arrays need numpy")

PACKAGE = Path(atomic_checkpoint.__file__).parent


def _state(mib: int = 1) -> dict:
    rng = np.random.default_rng(7)
    # Odd sizes: the file ends mid-page.
    return {
        "w": rng.standard_normal((mib << 20) // 8, dtype=np.float64),
        "b": rng.integers(0, 255, 12_345, dtype=np.uint8),
        "step": 3,
    }


def _file_digest(path: Path) -> str:
    h = Hasher()
    h.update(path.read_bytes())
    return h.hexdigest()


def test_write_plan_reports_the_size_and_checksum_of_the_file_it_leaves(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.makedirs("pending")
    state = _state()
    plan = plan_state(state)

    report = write_plan(storage, "pending/rank.safetensors", "rank.safetensors", plan, 0, 1)

    assert isinstance(report, RankReport)
    (entry,) = report.files
    path = tmp_path / "pending" / "rank.safetensors"
    assert (entry.path, entry.rank) == ("rank.safetensors", 0)
    assert entry.size_bytes == path.stat().st_size == plan.total_size_bytes
    assert entry.checksum == _file_digest(path)
    assert report.write_s >= 0 and report.fsync_s >= 0
    # Read back with verification: every byte hashed on the way in, state identical.
    digest = Hasher()
    with storage.open_read("pending/rank.safetensors") as f:
        loaded = load_state(f, size_bytes=entry.size_bytes, digest=digest)
    assert digest.hexdigest() == entry.checksum
    assert np.array_equal(loaded["w"], state["w"]) and np.array_equal(loaded["b"], state["b"])
    assert loaded["step"] == 3


def test_write_plan_through_staging_writes_the_same_bytes_as_the_page_cache(tmp_path):
    # 5 MiB: above the O_DIRECT threshold, so where the filesystem takes O_DIRECT the
    # staged path runs; the report must describe the file either way.
    plan = plan_state(_state(5))
    files = {}
    for direct in (True, False):
        storage = LocalStorage(tmp_path / f"direct-{direct}")
        storage.direct_io = direct
        storage.makedirs("p")
        report = write_plan(storage, "p/f", "f", plan, 0, 1, Staging())
        (entry,) = report.files
        path = tmp_path / f"direct-{direct}" / "p" / "f"
        assert entry.size_bytes == path.stat().st_size == plan.total_size_bytes
        assert entry.checksum == _file_digest(path)
        files[direct] = path.read_bytes()
    assert files[True] == files[False]


class _FailsAfterFirstChunk:
    """A real plan whose stream breaks after its first chunk (a tensor that cannot be
    read, say)."""

    def __init__(self, plan):
        self._plan = plan
        self.total_size_bytes = plan.total_size_bytes

    def iter_chunks(self, *args):
        for i, chunk in enumerate(self._plan.iter_chunks(*args)):
            if i == 1:
                raise RuntimeError("the plan broke")
            yield chunk


def test_a_failed_write_leaves_no_file_and_no_hashing_thread(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.direct_io = False  # the page-cache path, hashed on a helper thread
    storage.makedirs("p")
    plan = _FailsAfterFirstChunk(plan_state(_state(20)))  # over the 16 MiB pipeline size
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="the plan broke"):
        write_plan(storage, "p/f", "f", plan, 0, 1)
    assert not (tmp_path / "p" / "f").exists()
    left = [t for t in set(threading.enumerate()) - before if t.name == "atomic-checkpoint-hash"]
    assert not left


def test_report_files_checksums_what_another_writer_left(tmp_path):
    storage = LocalStorage(tmp_path)
    (tmp_path / "pending" / "model" / "shards").mkdir(parents=True)
    (tmp_path / "pending" / "config.json").write_bytes(b'{"a": 1}')
    (tmp_path / "pending" / "model" / "shards" / "w.bin").write_bytes(b"x" * 100_003)

    report = report_files(storage, "pending", 2)

    by_path = {e.path: e for e in report.files}
    assert sorted(by_path) == ["config.json", "model/shards/w.bin"]
    for rel, entry in by_path.items():
        path = tmp_path / "pending" / rel
        assert entry.size_bytes == path.stat().st_size
        assert entry.checksum == _file_digest(path)
        assert entry.rank == 2


# -- direct I/O is a declared capability ----------------------------------------------


def test_local_and_project_storage_declare_direct_io(tmp_path):
    local = LocalStorage(tmp_path / "a")
    told = LocalStorage(tmp_path / "b", capabilities=StorageCapabilities(name="local"))
    project = ProjectStorage(LocalStorage(tmp_path / "c"))
    for storage in (local, told, project):
        assert storage.capabilities.direct_io is True, storage
        assert direct_io(storage) is storage


def test_memory_and_fsspec_storage_do_not_declare_direct_io(tmp_path):
    assert MemoryStorage().capabilities.direct_io is False
    assert direct_io(MemoryStorage()) is None
    pytest.importorskip("fsspec", reason="FsspecStorage needs fsspec")
    from atomic_checkpoint.storage.fsspec import FsspecStorage

    for url in ("memory://rankfiles-test", tmp_path.as_uri()):
        storage = FsspecStorage(url)
        assert storage.capabilities.direct_io is False, url
        assert direct_io(storage) is None


class _Undeclared(LocalStorage):
    """A local disk whose capabilities do not declare direct I/O, but whose own setting
    asks for it: the declaration decides, so neither method may be called."""

    def __init__(self, root):
        super().__init__(root)
        self.capabilities = replace(self.capabilities, direct_io=False)
        self.direct_io = True

    def open_write_direct(self, path, *, size_hint=None):
        raise AssertionError(f"asked for a direct writer of {path} (direct_io not declared)")

    def direct_io_enabled(self):
        raise AssertionError("asked whether direct I/O is enabled (direct_io not declared)")


def test_a_storage_without_direct_io_is_never_asked_for_it(tmp_path):
    pytest.importorskip("torch", reason="async saves snapshot torch tensors")
    import torch

    storage = _Undeclared(tmp_path)
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(3 << 20, generator=g)}  # 12 MiB: above the O_DIRECT threshold
    with CheckpointManager(storage) as mgr:
        mgr.save(1, state)  # write_plan, with staging
        mgr.save_async(2, state).result()  # write_image
        mgr.wait()
        for step in (1, 2):
            assert torch.equal(mgr.restore(step)["w"], state["w"])  # the restore path
    for step in (1, 2):
        assert (tmp_path / checkpoint_name(step) / rank_state_file(0)).stat().st_size > 12 << 20


def test_project_storage_opens_direct_writers_under_the_mapped_name(tmp_path):
    opened = []

    class Recording(LocalStorage):
        def open_write_direct(self, path, *, size_hint=None):
            writer = super().open_write_direct(path, size_hint=size_hint)
            opened.append((path, writer is not None))
            return writer

    base = Recording(tmp_path)
    base.direct_io = True
    project = ProjectStorage(base)
    assert direct_io(project) is project
    project.makedirs("checkpoint-4")
    writer = direct_io(project).open_write_direct("checkpoint-4/f", size_hint=4096)
    if writer is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    writer.abort()
    assert opened == [("checkpoints/checkpoint_4/f", True)]


def test_no_module_probes_for_direct_io_by_name():
    """The capability is declared (``capabilities.direct_io``): no ``getattr`` or
    ``hasattr`` with the method names anywhere in the package."""
    names = {"open_write_direct", "direct_io_enabled"}
    probes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                probes.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not probes, probes


def test_rankfiles_imports_neither_the_manager_nor_os():
    """The rank-file writer sits below the manager and the commit, and reaches files
    only through the storage layer."""
    tree = ast.parse((PACKAGE / "rankfiles.py").read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert not imported & {".manager", ".commit", "os", "shutil"}, imported


def _fds_under(path: Path) -> list[str]:
    import os

    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


@pytest.mark.parametrize("where", ["fsync", "hash helper", "io thread start"])
def test_an_interrupt_in_a_save_leaves_no_file_open(tmp_path, monkeypatch, where):
    # Ctrl-C (or a signal handler's SystemExit) inside a save: the descriptor of the
    # partial file stayed open after it was deleted (its blocks in use until the
    # process ended), with I/O threads blocked for ever.
    import numpy as np

    from atomic_checkpoint import rankfiles
    from atomic_checkpoint.storage import local

    mgr = CheckpointManager(tmp_path)
    big = {"w": np.ones(8 << 20, dtype=np.uint8)}  # O_DIRECT-sized on a local disk
    mgr.save(1, big)
    armed = [True]

    def interrupt_once(real):
        def call(*args, **kwargs):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        return call

    if where == "fsync":
        import os
        import stat

        real_fsync = os.fsync

        def fsync(fd):  # the rank file's, not a directory's nor a lease renewal's
            lease = threading.current_thread().name == "atomic-checkpoint-lease"
            if armed[0] and not lease and stat.S_ISREG(os.fstat(fd).st_mode):
                armed[0] = False
                raise KeyboardInterrupt
            return real_fsync(fd)

        monkeypatch.setattr(local.os, "fsync", fsync)
        state = {"w": np.ones(16, dtype=np.uint8)}  # through the page cache
    elif where == "hash helper":
        monkeypatch.setattr(rankfiles, "_HashPipe", interrupt_once(rankfiles._HashPipe))
        state = {"w": np.ones(16, dtype=np.uint8)}
    else:
        monkeypatch.setattr(local.threading.Thread, "start", interrupt_once(threading.Thread.start))
        state = big
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, state)
    assert _fds_under(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name == "atomic-checkpoint-io"]
    monkeypatch.undo()
    mgr.save(2, state)  # the next save goes ahead
    assert [c.step for c in mgr.checkpoints()] == [1, 2]
    mgr.close()
