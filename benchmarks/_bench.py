"""The pieces the benchmark is made of: the state, every method, and the checks.

Every save method pays for durability the same way (BENCHMARKS.md "Fairness rules"):
its files are fsync'd, it renames into place where it has a rename, and the directory
that holds the result is fsync'd. Every save is read back and compared byte for byte
(not timed). Loads write every byte into real, preallocated tensors.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.layout import checkpoint_name, rank_state_file

MiB = 1 << 20
GiB = 1 << 30
_IO_CHUNK = 256 * MiB  # below the 2 GiB single-write limit
_ALIGN = 64


def parse_size(text: str) -> int:
    """``100M``, ``1G``, ``4G``, ``512K`` or plain bytes -> bytes (binary units)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_label(n: int) -> str:
    for unit, div in (("G", GiB), ("M", MiB), ("K", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


# -- the state ---------------------------------------------------------------------


def model_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat state dict shaped like a transformer: 32 blocks of attention, MLP and
    norm tensors (even blocks float32, odd blocks bfloat16), an embedding and a final
    norm: 262 tensors from a few KiB to tens of MiB, about ``size_bytes`` in all.

    The values are random (incompressible, no page is all zeros).
    """
    layers = 32
    # Per block: 4 h*h attention + 2 * 4h*h MLP = 12 h^2 elements; float32 and bfloat16
    # blocks alternate (3 bytes per element on average); the embedding takes ~1/8.
    hidden = max(8, int((size_bytes * 7 / 8 / (layers * 12 * 3)) ** 0.5) // 8 * 8)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}

    def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32).normal_(generator=gen)
        return t if dtype == torch.float32 else t.to(dtype)

    for i in range(layers):
        dt = torch.float32 if i % 2 == 0 else torch.bfloat16
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{p}.self_attn.{name}.weight"] = rand((hidden, hidden), dt)
        state[f"{p}.mlp.up_proj.weight"] = rand((4 * hidden, hidden), dt)
        state[f"{p}.mlp.down_proj.weight"] = rand((hidden, 4 * hidden), dt)
        state[f"{p}.input_layernorm.weight"] = rand((hidden,), torch.float32)
        state[f"{p}.post_attention_layernorm.weight"] = rand((hidden,), torch.float32)
    used = sum(t.numel() * t.element_size() for t in state.values())
    vocab = max(1, (size_bytes - used - hidden * 4) // (hidden * 4))
    state["model.embed_tokens.weight"] = rand((vocab, hidden), torch.float32)
    state["model.norm.weight"] = rand((hidden,), torch.float32)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and tuple(a.shape) == tuple(b.shape)
        and bool(torch.equal(byte_view(a.contiguous()), byte_view(b.contiguous())))
    )


def check_state(loaded: dict[str, Any], state: dict[str, torch.Tensor], what: str) -> None:
    if set(loaded) != set(state):
        raise AssertionError(f"{what}: keys differ from the saved state")
    for k, t in state.items():
        if not same_bytes(loaded[k], t):
            raise AssertionError(f"{what}: tensor {k!r} differs from the saved state")


class HostBuffers:
    """Preallocated host memory shaped like the state: one flat buffer, each tensor a
    64-byte aligned view into it. The target of the host-copy baseline, of loads into
    existing tensors, and of the raw read (the whole buffer)."""

    def __init__(self, state: dict[str, torch.Tensor], extra_bytes: int):
        offsets = []
        off = 0
        for t in state.values():
            offsets.append(off)
            off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.flat = torch.empty(off + extra_bytes, dtype=torch.uint8)
        self.flat.fill_(1)  # resident now, not at the first timed trial
        self.views: dict[str, torch.Tensor] = {}
        for (k, t), o in zip(state.items(), offsets, strict=True):
            n = t.numel() * t.element_size()
            self.views[k] = self.flat[o : o + n].view(t.dtype).view(t.shape)

    def scramble(self) -> None:
        """Overwrite the buffers so a load that skipped a byte is caught."""
        self.flat.fill_(0xA5)


def init_single_process_group() -> None:
    """A one-rank gloo group, so DCP's save and async_save run as in a real job (our
    manager sees world size 1 and coordinates nothing)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


# -- durability helpers ------------------------------------------------------------


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (for writers that do not fsync themselves)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(dirpath, name))


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def settle() -> None:
    """Let the previous trial's dirty pages and deletes drain (BENCHMARKS.md)."""
    os.sync()


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_file(path: str, buf: torch.Tensor) -> int:
    """Read ``path`` whole into ``buf`` (a flat uint8 tensor): the raw read."""
    view = memoryview(buf.numpy())
    done = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view[done : done + _IO_CHUNK])
            if not n:
                return done
            done += n


def warm_file(path: str) -> None:
    """Bring ``path`` into the page cache (untimed), for warm-cache loads."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * MiB):
            pass


# -- trials ------------------------------------------------------------------------


@dataclass
class Trial:
    """What one timed run of a method reports."""

    figures: dict[str, float]
    verify: Callable[[], None] | None = None
    cleanup: list[str] = field(default_factory=list)


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    out: list[float] = []
    t = time.perf_counter()
    yield out
    out.append(time.perf_counter() - t)


class Methods:
    """Every method of one size, sharing one state, one host buffer and one directory."""

    def __init__(self, state: dict[str, torch.Tensor], work: str):
        self.state = state
        self.work = work
        self.size = state_bytes(state)
        self.mgr = CheckpointManager(os.path.join(work, "ours"))
        self.step = 0
        # Header room: the raw read reads our whole file (header + data) into it.
        self.host = HostBuffers(state, extra_bytes=4 * MiB)
        self.ref_step: int | None = None
        self.ref_path = ""

    def close(self) -> None:
        self.mgr.close()

    def _next_step(self) -> int:
        self.step += 1
        return self.step

    def _ours_path(self, step: int) -> str:
        return os.path.join(self.work, "ours", checkpoint_name(step))

    def _check_ours(self, step: int) -> None:
        self.host.scramble()
        self.mgr.restore(step, into=dict(self.host.views))
        check_state(self.host.views, self.state, f"ours step {step}")

    # ---- saves
    def raw_write(self) -> Trial:
        path = os.path.join(self.work, "raw.bin")
        with timed() as t:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for tensor in self.state.values():
                    view = memoryview(byte_view(tensor).numpy())
                    while view:
                        view = view[os.write(fd, view[:_IO_CHUNK]) :]
                os.fsync(fd)
            finally:
                os.close(fd)

        def verify() -> None:
            buf = self.host.flat
            n = read_file(path, buf)
            if n != self.size:
                raise AssertionError(f"raw write: {n} bytes on disk, expected {self.size}")
            off = 0
            for k, tensor in self.state.items():
                size = tensor.numel() * tensor.element_size()
                if not torch.equal(buf[off : off + size], byte_view(tensor)):
                    raise AssertionError(f"raw write: bytes of {k!r} differ")
                off += size

        return Trial({"s": t[0]}, verify, [path])

    def ours_sync(self) -> Trial:
        step = self._next_step()
        with timed() as t:
            info = self.mgr.save(step, self.state)
        timings = dict(info.timings_s)
        figures = {"s": t[0]}
        figures.update({f"phase_{k}_s": v for k, v in timings.items()})
        return Trial(figures, lambda: self._check_ours(step), [self._ours_path(step)])

    def ours_async(self) -> Trial:
        step = self._next_step()
        t0 = time.perf_counter()
        handle = self.mgr.save_async(step, self.state)
        blocked = time.perf_counter() - t0
        info = handle.result()
        durable = time.perf_counter() - t0
        figures = {"blocked_s": blocked, "durable_s": durable, "s": durable}
        figures["snapshot_s"] = float(info.timings_s.get("snapshot", 0.0))
        return Trial(figures, lambda: self._check_ours(step), [self._ours_path(step)])

    def torch_save(self) -> Trial:
        final = os.path.join(self.work, "torch.pt")
        tmp = final + ".tmp"
        with timed() as t:
            with open(tmp, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, final)
            fsync_dir(self.work)

        def verify() -> None:
            loaded = torch.load(final, weights_only=True, mmap=True)
            check_state(loaded, self.state, "torch.save")
            del loaded

        return Trial({"s": t[0]}, verify, [final, tmp])

    def safetensors_save(self) -> Trial:
        from safetensors.torch import save_file

        final = os.path.join(self.work, "model.safetensors")
        tmp = final + ".tmp"
        with timed() as t:
            save_file(self.state, tmp)
            fsync_file(tmp)  # save_file does not fsync
            os.rename(tmp, final)
            fsync_dir(self.work)

        def verify() -> None:
            from safetensors import safe_open

            with safe_open(final, "pt") as f:
                loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                check_state(loaded, self.state, "safetensors")

        return Trial({"s": t[0]}, verify, [final, tmp])

    def _dcp_verify(self, path: str) -> Callable[[], None]:
        def verify() -> None:
            import torch.distributed.checkpoint as dcp

            self.host.scramble()
            dest = dict(self.host.views)
            dcp.load(dest, storage_reader=dcp.FileSystemReader(path))
            check_state(dest, self.state, f"DCP {os.path.basename(path)}")

        return verify

    def dcp_save(self, threads: int = 1) -> Trial:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.work, f"dcp{threads}")
        with timed() as t:
            # sync_files=True (the default) fsyncs every file; DCP has no rename, and
            # never fsyncs its directory: we do, as every method must.
            dcp.save(self.state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))
            fsync_dir(path)
            fsync_dir(self.work)
        return Trial({"s": t[0]}, self._dcp_verify(path), [path])

    def dcp_save_2threads(self) -> Trial:
        return self.dcp_save(threads=2)

    def dcp_async(self) -> Trial:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.work, "dcp_async")
        t0 = time.perf_counter()
        future = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(path))
        blocked = time.perf_counter() - t0
        future.result()
        fsync_dir(path)
        fsync_dir(self.work)
        durable = time.perf_counter() - t0
        figures = {"blocked_s": blocked, "durable_s": durable, "s": durable}
        return Trial(figures, self._dcp_verify(path), [path])

    def host_copy(self) -> Trial:
        views = self.host.views
        with timed() as t, torch.no_grad():
            for k, tensor in self.state.items():
                views[k].copy_(tensor)

        def verify() -> None:
            check_state(views, self.state, "host copy")

        return Trial({"s": t[0]}, verify)

    # ---- loads
    def ensure_reference(self) -> None:
        """The checkpoint that every load reads (saved once per size, untimed)."""
        if self.ref_step is None:
            self.ref_step = self._next_step()
            self.mgr.save(self.ref_step, self.state)
            self._check_ours(self.ref_step)
            self.ref_path = os.path.join(self._ours_path(self.ref_step), rank_state_file(0))

    def _load(self, *, cold: bool, verify: bool = True) -> Trial:
        self.ensure_reference()
        step = self.ref_step
        self.host.scramble()
        if cold:
            drop_caches()
        else:
            warm_file(self.ref_path)
        dest = dict(self.host.views)
        with timed() as t:
            self.mgr.restore(step, into=dest, verify=verify)

        def check() -> None:
            check_state(self.host.views, self.state, "load")

        return Trial({"s": t[0]}, check)

    def load_cold(self) -> Trial:
        return self._load(cold=True)

    def load_warm(self) -> Trial:
        return self._load(cold=False)

    def load_warm_noverify(self) -> Trial:
        return self._load(cold=False, verify=False)

    def _raw_read(self, *, cold: bool) -> Trial:
        self.ensure_reference()
        if cold:
            drop_caches()
        else:
            warm_file(self.ref_path)
        with timed() as t:
            n = read_file(self.ref_path, self.host.flat)
        size = os.path.getsize(self.ref_path)

        def check() -> None:
            if n != size:
                raise AssertionError(f"raw read got {n} of {size} bytes")

        return Trial({"s": t[0], "bytes": float(n)}, check)

    def raw_read_cold(self) -> Trial:
        return self._raw_read(cold=True)

    def raw_read_warm(self) -> Trial:
        return self._raw_read(cold=False)

    # ---- training-step slowdown while an async save writes
    def train_step_slowdown(self) -> Trial:
        """A compute-bound step (matmuls) timed alone, then while our async save writes
        in the background; reports the ratio of the median step times."""
        a = torch.randn(384, 384)
        b = torch.randn(384, 384)

        def step() -> float:
            t = time.perf_counter()
            for _ in range(8):
                torch.mm(a, b)
            return time.perf_counter() - t

        for _ in range(3):
            step()
        alone = sorted(step() for _ in range(30))[15]
        s = self._next_step()
        handle = self.mgr.save_async(s, self.state)
        during = []
        deadline = time.monotonic() + 600
        while not handle.done() and time.monotonic() < deadline:
            during.append(step())
        handle.result()
        during.sort()
        med = during[len(during) // 2] if during else alone
        figures = {"step_alone_s": alone, "step_during_s": med, "ratio": med / alone}
        figures["steps_during"] = float(len(during))
        return Trial(figures, lambda: self._check_ours(s), [self._ours_path(s)])

    # ---- retention: what deleting an old checkpoint costs the training thread
    def retention_block(self) -> Trial:
        """Save with KeepLast(1) over an existing full-size checkpoint: the time the
        training thread spends starting the rotation (the delete runs in the
        background); the delete's own duration is reported too."""
        from atomic_checkpoint import KeepLast

        root = os.path.join(self.work, "retention")
        mgr = _TimedRotationManager(root, retention=KeepLast(1))
        try:
            mgr.save(1, self.state)
            mgr.wait()
            settle()
            mgr.save(2, {"tiny": torch.zeros(4)})  # rotation deletes step 1
            blocked = mgr.rotation_start_s
            t = time.perf_counter()
            mgr.wait()
            delete = time.perf_counter() - t
            left = [c.step for c in mgr.checkpoints()]
        finally:
            mgr.close()

        def check() -> None:
            if left != [2]:
                raise AssertionError(f"retention kept {left}, expected [2]")

        return Trial({"blocked_s": blocked, "delete_wait_s": delete}, check, [root])


class _TimedRotationManager(CheckpointManager):
    """Measures the training-thread cost of starting a rotation."""

    rotation_start_s = 0.0

    def _start_rotation(self, newest: int) -> None:
        t = time.perf_counter()
        super()._start_rotation(newest)
        self.rotation_start_s = time.perf_counter() - t


SAVE_METHODS = (
    "raw_write",
    "ours_sync",
    "ours_async",
    "torch_save",
    "safetensors_save",
    "dcp_save",
    "dcp_save_2threads",
    "dcp_async",
    "host_copy",
)
LOAD_METHODS = ("load_cold", "raw_read_cold", "load_warm", "raw_read_warm", "load_warm_noverify")
OTHER_METHODS = ("train_step_slowdown", "retention_block")
PEERS = ("torch_save", "safetensors_save", "dcp_save", "dcp_save_2threads")
