"""The load path reads with positioned reads in parallel and hashes every byte on the
way: the digest sees the whole file in order whichever path reads it, a failed read in
one reader thread fails the load (nothing half-read is returned), plain ``restore()``
builds the same state as ``restore(into=)``; and ``prepare_async`` allocates the async
snapshot buffers up front, so the first ``save_async`` allocates nothing.
"""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
import torch
import xxhash

from atomic_checkpoint import CheckpointManager, CorruptCheckpointError
from atomic_checkpoint.layout import checkpoint_name, rank_state_file
from atomic_checkpoint.manifest import Hasher
from atomic_checkpoint.serialization import _cached_fraction, load_state, plan_state

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0) -> dict:
    """~34 MiB (past the threaded-read threshold), mixed sizes and dtypes, tied and
    tiny tensors, a numpy array and plain values, like a model plus its optimizer."""
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.randn(512, 1024, generator=g) for i in range(8)}
    model["norm.weight"] = torch.randn(1024, generator=g).to(torch.bfloat16)
    model["head.weight"] = model["layer0.weight"]  # tied: loaded as one tensor again
    optim = {
        "state": {
            i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(1000 + i, generator=g)}
            for i in range(40)
        },
        "param_groups": [{"lr": 1e-3, "params": list(range(40))}],
    }
    extra = {"odd": torch.randn(1_000_003, generator=g), "np": np.arange(70_000, dtype=np.int64)}
    return {"model": model, "optim": optim, "extra": extra, "epoch": 3}


def _write(path, state) -> bytes:
    data = b"".join(bytes(c) for c in plan_state(state).iter_chunks())
    path.write_bytes(data)
    return data


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("kind", ["file", "bytesio", "big-endian"])
def test_digest_sees_every_byte_in_order_on_every_read_path(tmp_path, threads, kind):
    state = _state()
    if kind == "big-endian":
        # A big-endian array is converted after reading: the sequential path.
        state["extra"]["be"] = np.arange(20_000, dtype=">i4")
    path = tmp_path / "s.safetensors"
    data = _write(path, state)
    digest = Hasher("xxh3_64")
    if kind == "bytesio":
        out = load_state(io.BytesIO(data), digest=digest, threads=threads)
    else:
        with open(path, "rb", buffering=0) as f:
            out = load_state(f, digest=digest, threads=threads)
    assert digest.hexdigest() == xxhash.xxh3_64(data).hexdigest()
    _same(out, state)
    assert out["model"]["head.weight"] is out["model"]["layer0.weight"]


def test_the_read_workers_hash_the_chunks_themselves_in_file_order(tmp_path, monkeypatch):
    # One pass over memory: a worker that has read a chunk hashes the chunks that are
    # in, in file order, mostly its own while its bytes are in its core's cache. No
    # separate thread hashes every chunk again after the readers (a second pass over
    # memory long evicted from the cache).
    path = tmp_path / "s.safetensors"
    data = _write(path, _state())
    readers: set[int] = set()
    preadv = os.preadv

    def recording_preadv(fd, buffers, offset, *args):
        readers.add(threading.get_ident())
        return preadv(fd, buffers, offset, *args)

    class RecordingDigest:
        def __init__(self):
            self.inner = xxhash.xxh3_64()
            self.threads: list[int] = []

        def update(self, b):
            self.threads.append(threading.get_ident())
            self.inner.update(b)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    digest = RecordingDigest()
    with open(path, "rb", buffering=0) as f:
        out = load_state(f, digest=digest, threads=4)
    assert digest.inner.hexdigest() == xxhash.xxh3_64(data).hexdigest()  # in file order
    _same(out, _state())
    hashers = set(digest.threads[1:])  # the first update is the header, read before
    assert len(digest.threads) > 8
    assert hashers <= readers, "a thread that read no chunk hashed chunks"


def test_the_cached_share_of_a_large_file_is_sampled_and_still_right(tmp_path):
    # Past 64 MiB mincore asks about evenly spaced windows, not every page.
    path = tmp_path / "big.bin"
    size = 96 << 20
    path.write_bytes(os.urandom(1 << 20) * 96)
    _uncached(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _cached_fraction(fd) == 0.0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past the reads
        done = 0
        while done < int(size * 0.4):
            done += len(os.pread(fd, 1 << 20, done))
        share = _cached_fraction(fd)
        if share is None or share == 0.0:
            pytest.skip("the page cache did not keep the pages just read")
        assert 0.3 <= share <= 0.5, share
        while done < size:
            done += len(os.pread(fd, 1 << 20, done))
        # Under memory pressure (other jobs on the machine) the kernel may evict a page
        # between the read and the question; read it all again, a few times at most.
        shares = [_cached_fraction(fd)]
        while shares[-1] != 1.0 and len(shares) < 4:
            done = 0
            while done < size:
                done += len(os.pread(fd, 1 << 20, done))
            shares.append(_cached_fraction(fd))
        assert shares[-1] == 1.0, shares
    finally:
        os.close(fd)


def test_a_read_that_fails_in_a_reader_thread_fails_the_load_and_stops_the_readers(tmp_path):
    path = tmp_path / "s.safetensors"
    data = _write(path, _state())
    with open(path, "r+b") as f:
        f.truncate(len(data) - (3 << 20))  # cut inside the last large tensor
    before = {t.ident for t in threading.enumerate()}
    with (
        open(path, "rb", buffering=0) as f,
        pytest.raises(CorruptCheckpointError, match="truncated: the file ends at byte"),
    ):
        # The size the manifest promised: the header passes, a reader hits the end.
        load_state(f, digest=Hasher("xxh3_64"), threads=4, size_bytes=len(data))
    left = [t for t in threading.enumerate() if t.ident not in before]
    assert not [t for t in left if t.name == "atomic-checkpoint-read"]


def test_plain_restore_and_restore_into_agree_and_a_flipped_byte_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)
    state = _state(1)
    mgr.save(1, state)
    plain = mgr.restore(1)
    _same(plain, state)
    into = {
        "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
        "optim": {"state": {i: {"exp_avg": torch.empty(1000 + i)} for i in range(40)}},
    }
    ptr = into["model"]["layer3.weight"].data_ptr()
    out = mgr.restore(1, into=into)
    _same(out, state)
    assert out["model"]["layer3.weight"].data_ptr() == ptr
    # One byte flipped in the last chunk that a reader thread reads: no state returned.
    path = tmp_path / checkpoint_name(1) / rank_state_file(0)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    for kwargs in ({}, {"into": into}):
        with pytest.raises(CorruptCheckpointError, match=r"checksum .* does not match"):
            mgr.restore(1, **kwargs)
    mgr.close()


def test_prepare_async_allocates_the_snapshot_buffers_before_the_first_save(tmp_path):
    mgr = CheckpointManager(tmp_path)
    state = _state(2)
    size = mgr.prepare_async(state)
    pool = mgr._snapshots
    assert pool is not None and pool.allocations == 1
    assert size == pool.capacity_bytes >= plan_state(state).total_size_bytes
    ptr = pool.data_ptr
    handle = mgr.save_async(1, state)
    handle.result()
    # The first save copied into the buffers prepared above: nothing was allocated.
    assert (pool.allocations, pool.data_ptr) == (1, ptr)
    _same(mgr.restore(1), state)
    mgr.close()


def _uncached(path) -> None:
    """Drop ``path`` from the page cache (clean pages: no root needed), or skip."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _cached_fraction(fd) != 0.0:
            pytest.skip("the page cache kept the file after POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


def _direct_io_ok(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("cached_share", [0.0, 0.4])
def test_an_uncached_file_is_read_with_direct_io_and_still_hashed_in_order(tmp_path, cached_share):
    path = tmp_path / "s.safetensors"
    data = _write(path, _state(3))
    if not _direct_io_ok(path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT (e.g. tmpfs)")
    _uncached(path)
    with open(path, "rb", buffering=0) as f:
        if cached_share:  # some of it cached (no readahead past it): still under half
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            f.read(int(len(data) * cached_share))
            if not 0.3 <= _cached_fraction(f.fileno()) < 0.5:
                pytest.skip("could not leave 30-50 % of the file cached")
        digest = Hasher("xxh3_64")
        out = load_state(f, digest=digest, direct=True)
        # The reads went around the page cache (buffered ones would have filled it).
        assert _cached_fraction(f.fileno()) < 0.5
    assert digest.hexdigest() == xxhash.xxh3_64(data).hexdigest()
    _same(out, _state(3))


def test_a_flipped_byte_in_an_uncached_file_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)
    state = _state(4)
    mgr.save(1, state)
    path = tmp_path / checkpoint_name(1) / rank_state_file(0)
    if not _direct_io_ok(path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT (e.g. tmpfs)")
    _uncached(path)
    _same(mgr.restore(1), state)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 3)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    _uncached(path)
    with pytest.raises(CorruptCheckpointError, match=r"checksum .* does not match"):
        mgr.restore(1)
    mgr.close()
