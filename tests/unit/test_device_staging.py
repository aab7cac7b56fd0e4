"""Loads into device memory through the staging ring (``device_staging``).

On a machine without a GPU the staged path runs with ``_Loader.stage_host``: CPU
tensors stand for device memory and the ring's slots are pageable, so everything but
the CUDA events (tested in ``test_async_save.py`` where a GPU is present) is covered
here: batches cut at slot boundaries, tensors split across slots, runs of small
tensors, host-bound entries among device-bound ones, the digest in file order, and
the ring handed back after a failure.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from atomic_checkpoint import CheckpointManager, device_staging, serialization
from atomic_checkpoint.errors import CorruptCheckpointError
from atomic_checkpoint.layout import checkpoint_name, rank_state_file
from atomic_checkpoint.manifest import Hasher
from atomic_checkpoint.serialization import _Loader, load_state, plan_state

SLOT = 1 << 16  # the smallest slot: a run of small tensors is never split


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Stage every tensor load through 64 KiB slots; the list counts the batches."""
    monkeypatch.setattr(_Loader, "stage_host", True)
    monkeypatch.setattr(device_staging, "SLOT_BYTES", SLOT)
    batches: list[int] = []
    real = _Loader.read_batches

    def counting(self: _Loader, header: Any, ring: Any) -> Any:
        out = real(self, header, ring)
        if ring is not None:
            batches.append(len(out[0]))
        return out

    monkeypatch.setattr(_Loader, "read_batches", counting)
    return batches


def mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randn(300, generator=g)
    return {
        # Larger than a slot, and not a multiple of it: split over four batches.
        "big": torch.randn(3 * SLOT // 4 + 1001, generator=g),
        "bf": torch.randn(SLOT // 2 + 3, generator=g).bfloat16(),
        # Runs of small tensors, read into a slot as one piece.
        "small": [torch.randn(n, generator=g) for n in (1, 7, 300, 4000)],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "tied": [shared, shared],
        # Host-bound leaves among device-bound ones: arrays and an int.
        "array": np.arange(20000, dtype=np.int32),
        "tiny_array": np.arange(5, dtype=np.float64),
        "step": 11,
    }


def write(path: Path, state: Any) -> Path:
    plan = plan_state(state)
    with open(path, "wb") as f:
        for chunk in plan.iter_chunks():
            f.write(chunk)
    return path


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


def test_a_staged_load_splits_tensors_over_slots_and_keeps_every_byte(
    tmp_path: Path, staged: list[int]
) -> None:
    state = mixed_state()
    path = write(tmp_path / "s", state)
    h_plain = Hasher()
    with open(path, "rb", buffering=0) as f:
        out = load_state(f, digest=h_plain)
    assert staged and staged[0] >= 4  # ~1.3 MiB of tensors through 64 KiB slots
    assert same(out, state)
    assert out["tied"][0] is out["tied"][1]
    # The digest saw the file in order: the same as hashing the file.
    h_file = Hasher()
    h_file.update(path.read_bytes())
    assert h_plain.hexdigest() == h_file.hexdigest()


def test_a_staged_load_fills_into_targets_in_place(tmp_path: Path, staged: list[int]) -> None:
    state = mixed_state()
    path = write(tmp_path / "s", state)
    into = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
    }
    blank = torch.zeros(300)
    into["small"] = [torch.zeros_like(t) for t in state["small"]]
    into["tied"] = [blank, blank]
    into["array"] = np.zeros(20000, dtype=np.int32)
    ptrs = {k: into[k].data_ptr() for k in ("big", "bf", "scalar")}
    with open(path, "rb", buffering=0) as f:
        out = load_state(f, into=into, threads=3)
    assert staged
    assert same(out, state)
    assert all(out[k] is into[k] and into[k].data_ptr() == ptrs[k] for k in ptrs)
    assert out["array"] is into["array"] and out["tied"][0] is blank is out["tied"][1]


def test_a_staged_restore_catches_a_flipped_byte_and_hands_the_ring_back(
    tmp_path: Path, staged: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    rings: list[device_staging.DeviceStaging] = []
    real_acquire = device_staging.acquire

    def acquire(torch_mod: Any, pin: bool) -> device_staging.DeviceStaging:
        ring = real_acquire(torch_mod, pin)
        rings.append(ring)
        return ring

    monkeypatch.setattr(device_staging, "acquire", acquire)
    mgr = CheckpointManager(tmp_path)
    state = mixed_state()
    mgr.save(1, state)
    assert same(mgr.restore(1), state)
    path = tmp_path / checkpoint_name(1) / rank_state_file(0)
    raw = bytearray(path.read_bytes())
    raw[-5000] ^= 0xFF  # inside the array near the end: read in the last batch
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        mgr.restore(1)
    mgr.close()
    # A read that fails inside a batch (EIO on the second one): the error reaches the
    # caller and the ring is handed back all the same.
    real_read = serialization._read_pieces
    reads: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> None:
        reads.append(1)
        if len(reads) == 2:
            raise OSError(errno.EIO, "Input/output error")
        real_read(*args, **kwargs)

    monkeypatch.setattr(serialization, "_read_pieces", failing)
    path = write(tmp_path / "s", state)
    with open(path, "rb", buffering=0) as f, pytest.raises(OSError, match="Input/output"):
        load_state(f)
    assert len(rings) == 3 and len(reads) == 2
    for ring in rings:
        assert ring.try_acquire()  # released after each load, failed or not
        ring.release()


def test_device_placement_goes_through_the_ring(tmp_path: Path, staged: list[int]) -> None:
    # device= names where new tensors go; with stage_host the CPU stands in for it.
    state = {"w": torch.arange(40000, dtype=torch.float32), "n": np.ones(3)}
    path = write(tmp_path / "s", state)
    with open(path, "rb", buffering=0) as f:
        out = load_state(f, device="cpu")
    assert staged == [3]  # 160,000 bytes through 64 KiB slots
    assert same(out, state)


def test_slots_smaller_than_a_small_tensor_are_refused(
    tmp_path: Path, staged: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_staging, "SLOT_BYTES", 4096)
    path = write(tmp_path / "s", {"w": torch.ones(10)})
    with open(path, "rb", buffering=0) as f, pytest.raises(ValueError, match="at least"):
        load_state(f)


def test_without_staging_a_cpu_load_takes_the_direct_path(tmp_path: Path) -> None:
    calls: list[int] = []
    real_acquire = device_staging.acquire
    real_batches = _Loader.read_batches

    def acquire(*args: Any) -> device_staging.DeviceStaging:
        calls.append(1)
        return real_acquire(*args)

    def batches(self: _Loader, header: Any, ring: Any) -> Any:
        out = real_batches(self, header, ring)
        assert ring is None and len(out[0]) == 1  # one batch, straight into memory
        return out

    path = write(tmp_path / "s", mixed_state())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_staging, "acquire", acquire)
        mp.setattr(_Loader, "read_batches", batches)
        with open(path, "rb", buffering=0) as f:
            out = load_state(f)
    assert same(out, mixed_state()) and calls == []


def test_a_ring_that_cannot_be_locked_falls_back_to_pageable_memory_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoLocking:
        """torch, whose driver refuses to lock host memory."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        def empty(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
            if pin_memory:
                raise RuntimeError("cudaHostAlloc: out of memory")
            return torch.empty(*args, **kwargs)

    monkeypatch.setattr(device_staging, "_shared", None)
    monkeypatch.setattr(device_staging, "_pin_failed", False)
    monkeypatch.setattr(device_staging, "SLOT_BYTES", SLOT)
    with caplog.at_level("WARNING", logger="atomic_checkpoint.device_staging"):
        rings = [device_staging.acquire(NoLocking(), pin=True) for _ in range(2)]
    assert [r.pinned for r in rings] == [False, False]
    assert [r.message for r in caplog.records] == [caplog.records[0].message]
    assert "could not lock" in caplog.records[0].message and "out of memory" in caplog.text
    for ring in rings:
        ring.release()


# -- saves: GPU bytes to the host through the slots --------------------------------------


def test_device_chunks_come_through_the_slots_in_turn() -> None:
    ring = device_staging.DeviceStaging(torch, slot_bytes=SLOT, pin=False)
    flat = torch.arange(3 * SLOT + 100, dtype=torch.int64).view(torch.uint8)[: 2 * SLOT + 77]
    chunks = serialization._device_chunks(flat, ring, chunk_bytes=SLOT)
    got = [bytes(c) for c in chunks]  # each consumed before the next is asked for
    assert [len(c) for c in got] == [SLOT, SLOT, 77]
    assert b"".join(got) == flat.numpy().tobytes()
    # A chunk is valid only until the next one: the third reuses the first's slot.
    held = list(serialization._device_chunks(flat, ring, chunk_bytes=SLOT))
    assert bytes(held[0][:77]) == bytes(held[2]) != flat.numpy()[:77].tobytes()


def test_a_plan_with_staging_and_no_gpu_tensor_yields_the_same_file(tmp_path: Path) -> None:
    state = mixed_state()
    plan = plan_state(state)
    assert not plan.on_gpu()
    ring = device_staging.DeviceStaging(torch, slot_bytes=SLOT, pin=False)
    staged_bytes = b"".join(bytes(c) for c in plan.iter_chunks(1 << 15, staging=ring))
    assert staged_bytes == b"".join(bytes(c) for c in plan.iter_chunks(1 << 15))


# -- on a GPU --------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_gpu_loads_share_one_pinned_ring_and_concurrent_loads_stay_correct(
    tmp_path: Path,
) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    # 80 MiB of float32: more than both 32 MiB slots, so slots are refilled while
    # their earlier copies may still be running.
    state = {
        "w": torch.randn(20 << 20, device="cuda", generator=g),
        "b": torch.randn(999, device="cuda", generator=g).half(),
        "cpu": torch.arange(10, dtype=torch.int64),
    }
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    mgr.restore(1, into=into)
    ring = device_staging._shared
    assert ring is not None and ring.pinned and all(s.is_pinned() for s in ring.slots)
    assert all(torch.equal(into[k], state[k]) for k in state)
    placed = mgr.restore(1, device="cuda")
    assert device_staging._shared is ring  # locked once, reused
    assert all(torch.equal(placed[k].cpu(), state[k].cpu()) for k in state)
    # Two loads at once: one takes the pinned ring, the other a private pageable one.
    outs: list[Any] = [None, None]
    errors: list[BaseException] = []

    def load(i: int) -> None:
        try:
            outs[i] = mgr.restore(1, device="cuda")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out in outs:
        assert all(torch.equal(out[k].cpu(), state[k].cpu()) for k in state)
    assert ring.try_acquire()  # handed back
    ring.release()
    mgr.close()


@cuda
def test_gpu_tensors_are_saved_through_the_pinned_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator(device="cuda").manual_seed(9)
    state = {
        "w": torch.randn(12 << 20, device="cuda", generator=g),  # 48 MiB: slots reused
        "h": torch.randn(5000, device="cuda", generator=g).half(),
        "t": torch.randn(64, 64, device="cuda", generator=g).t(),  # not contiguous
        "small": torch.randn(7, device="cuda", generator=g),
        "cpu": torch.arange(100_000, dtype=torch.int32),
    }
    plan = plan_state(state)
    assert plan.on_gpu()
    with device_staging.borrowed(torch, pin=True) as ring:
        staged_file = b"".join(bytes(c) for c in plan.iter_chunks(8 << 20, staging=ring))
    assert staged_file == b"".join(bytes(c) for c in plan.iter_chunks(8 << 20))
    # Through the manager: a sync save whose rank file is written with O_DIRECT (where
    # this filesystem takes it) uses the ring; whatever the path, the bytes are exact.
    acquired: list[bool] = []
    real = device_staging.acquire

    def spy(torch_mod: Any, pin: bool) -> device_staging.DeviceStaging:
        ring = real(torch_mod, pin)
        acquired.append(ring.pinned)
        return ring

    monkeypatch.setattr(device_staging, "acquire", spy)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    print(f"rings taken by the save and the load: {acquired}")
    out = mgr.restore(1)
    assert all(torch.equal(out[k], state[k].cpu()) for k in state)
    mgr.close()
