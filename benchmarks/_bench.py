"""The pieces the benchmark is made of: the state, every method, and the checks.

Every save method pays for durability the same way (BENCHMARKS.md "Fairness rules"):
its files are fsync'd, it renames into place where it has a rename, and the directory
that holds the result is fsync'd. Every save is read back and compared byte for byte
(not timed). Loads write every byte into real, preallocated tensors.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import shutil
import struct
import threading
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
    norm: 258 tensors from a few KiB to tens of MiB, about ``size_bytes`` in all.

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


def train_state(size_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A training state shaped like a mixed-precision run: bfloat16 model weights and an
    Adam optimizer's float32 moments (``exp_avg``, ``exp_avg_sq``) and ``step`` per
    parameter, as ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``.

    17 blocks (4 attention matrices, 3 MLP matrices, 2 norms), an embedding, a final
    norm and an output head: 156 parameters, 624 tensors from 4 bytes (``step``) and
    about 1 KiB (a norm) to about 64 MiB (the embedding's moments at 1 GiB), about
    ``size_bytes`` in all (10 bytes per parameter). Values are random.
    """
    layers = 17
    n_params = size_bytes // 10
    # Per block 4 h*h + 3 * 4h*h = 16 h^2 elements; the blocks take ~85 %, the rest goes
    # to the embedding and the head.
    hidden = max(8, int((n_params * 0.85 / (layers * 16)) ** 0.5) // 8 * 8)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        p = f"layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((f"{p}.self_attn.{name}.weight", (hidden, hidden)))
        shapes.append((f"{p}.mlp.gate_proj.weight", (4 * hidden, hidden)))
        shapes.append((f"{p}.mlp.up_proj.weight", (4 * hidden, hidden)))
        shapes.append((f"{p}.mlp.down_proj.weight", (hidden, 4 * hidden)))
        shapes.append((f"{p}.input_layernorm.weight", (hidden,)))
        shapes.append((f"{p}.post_attention_layernorm.weight", (hidden,)))
    used = sum(math.prod(s) for _, s in shapes) + hidden
    vocab = max(1, (n_params - used) // (2 * hidden))
    shapes.insert(0, ("embed_tokens.weight", (vocab, hidden)))
    shapes.append(("norm.weight", (hidden,)))
    shapes.append(("lm_head.weight", (vocab, hidden)))
    gen = torch.Generator().manual_seed(seed)

    def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32).normal_(generator=gen)
        return t if dtype == torch.float32 else t.to(dtype)

    model = {name: rand(shape, torch.bfloat16) for name, shape in shapes}
    masters = [torch.nn.Parameter(torch.empty(0)) for _ in shapes]
    opt = torch.optim.Adam(masters, lr=1e-4)
    for i, (_, shape) in enumerate(shapes):
        opt.state[masters[i]] = {
            "step": torch.tensor(float(i + 1)),
            "exp_avg": rand(shape, torch.float32),
            "exp_avg_sq": rand(shape, torch.float32).abs_(),
        }
    return {"model": model, "optimizer": opt.state_dict()}


def many_state(size_bytes: int, seed: int = 0) -> dict[str, Any]:
    """An optimizer state of many small parameters (a model of many experts or
    adapters): 6,667 float32 parameters of equal size, each with Adam's ``exp_avg``,
    ``exp_avg_sq`` and ``step``, as ``{"model": ..., "optimizer": opt.state_dict()}``:
    26,668 tensors, about ``size_bytes`` in all. What it measures is the cost per
    tensor, which the two other shapes hardly show."""
    n = 6667
    numel = max(1, size_bytes // (3 * 4 * n))
    gen = torch.Generator().manual_seed(seed)
    model = {f"experts.{i}.weight": torch.empty(numel).normal_(generator=gen) for i in range(n)}
    masters = [torch.nn.Parameter(torch.empty(0)) for _ in range(n)]
    opt = torch.optim.Adam(masters, lr=1e-4)
    for i in range(n):
        opt.state[masters[i]] = {
            "step": torch.tensor(float(i + 1)),
            "exp_avg": torch.empty(numel).normal_(generator=gen),
            "exp_avg_sq": torch.empty(numel).normal_(generator=gen).abs_(),
        }
    return {"model": model, "optimizer": opt.state_dict()}


STATE_SHAPES: dict[str, Callable[..., Any]] = {
    "flat": model_state,
    "train": train_state,
    "many": many_state,
}


def flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a state tree by dotted path, in walk order (the file's order)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def with_leaves(tree: Any, leaves: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """``tree`` with each tensor replaced by ``leaves[its path]`` (for ``into=``)."""
    if isinstance(tree, torch.Tensor):
        return leaves[prefix]
    if isinstance(tree, dict):
        return {
            k: with_leaves(v, leaves, f"{prefix}.{k}" if prefix else str(k))
            for k, v in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        return [
            with_leaves(v, leaves, f"{prefix}.{i}" if prefix else str(i))
            for i, v in enumerate(tree)
        ]
    return tree


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(state).values())


class Target:
    """What ``load_state_dict`` fills: a model whose parameters are shaped like the
    state's model part, and for a training state an Adam optimizer over float32 master
    parameters. Resident before any trial (a model that has been trained)."""

    def __init__(self, state: Any):
        model_sd = state["model"] if "optimizer" in state else state
        self.model = torch.nn.Module()
        for name, t in model_sd.items():
            owner = self.model
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.ones_like(t)))
        self.opt = None
        if "optimizer" in state:
            masters = [
                torch.nn.Parameter(torch.empty(0))
                for _ in state["optimizer"]["param_groups"][0]["params"]
            ]
            self.opt = torch.optim.Adam(masters, lr=1e-4)

    def reset(self) -> None:
        """Drop the optimizer state a previous load left (it holds the loaded moments)."""
        if self.opt is not None:
            self.opt.state.clear()

    def load(self, loaded: Any) -> None:
        if self.opt is None:
            self.model.load_state_dict(loaded)
        else:
            self.model.load_state_dict(loaded["model"])
            self.opt.load_state_dict(loaded["optimizer"])


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
    existing tensors, and of the raw read (the whole buffer). ``pin``: page-locked
    (CUDA's pinned memory, page-aligned), the target of device-to-host copies."""

    def __init__(self, state: dict[str, torch.Tensor], extra_bytes: int, pin: bool = False):
        offsets = []
        off = 0
        for t in state.values():
            offsets.append(off)
            off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        # Page-aligned: the direct-I/O baselines read and write it with O_DIRECT (one
        # buffer fewer of the state's size: at 4 GiB the benchmark must fit in 23 GB).
        raw = torch.empty(off + extra_bytes + _DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
        skip = -raw.data_ptr() % _DIRECT_ALIGN
        self.flat = raw[skip : skip + off + extra_bytes]
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


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(path: str) -> None:
    _fsync(path, os.O_RDWR)


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


_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DIRECT_ALIGN = 4096
_DIRECT_CHUNK = 32 * MiB
_DIRECT_DEPTH = 4


def _in_flight(op: Callable[[memoryview, int], int], image: Any) -> int:
    """Run ``op(view, offset)`` over ``image`` in chunks, ``_DIRECT_DEPTH`` at a time
    (threads: the device always has requests queued); the bytes done, in total, up to
    the first short transfer (the end of the file for reads)."""
    view = memoryview(image)
    chunks = [(off, view[off : off + _DIRECT_CHUNK]) for off in range(0, len(view), _DIRECT_CHUNK)]
    lock = threading.Lock()
    done = [0]
    errors: list[BaseException] = []

    def run() -> None:
        while True:
            with lock:
                if not chunks or errors:
                    return
                off, part = chunks.pop(0)
            try:
                n = op(part, off)
            except BaseException as exc:
                errors.append(exc)
                return
            with lock:
                done[0] += n

    workers = [threading.Thread(target=run) for _ in range(_DIRECT_DEPTH)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return done[0]


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

    def __init__(self, state: Any, work: str):
        self.state = state
        # Every tensor by path: what raw writes, host copies and peers that take a flat
        # dict of tensors (safetensors, DCP) save; the same bytes as ``state``.
        self.leaves = flatten(state)
        self.work = work
        self.size = state_bytes(state)
        self.mgr = CheckpointManager(os.path.join(work, "ours"))
        self.step = 0
        # Header room: the raw read reads our whole file (header + data) into it.
        self.host = HostBuffers(self.leaves, extra_bytes=4 * MiB)
        self.ref_step: int | None = None
        self.ref_path = ""
        self._target: Target | None = None
        self._image_size = 0  # the reference file's size, once image() has seen it
        self._layout: list[tuple[str, int, torch.dtype, tuple[int, ...], int]] | None = None

    def close(self) -> None:
        self.mgr.close()

    def _next_step(self) -> int:
        self.step += 1
        return self.step

    def _ours_path(self, step: int) -> str:
        return os.path.join(self.work, "ours", checkpoint_name(step))

    def _check_ours(self, step: int) -> None:
        self.host.scramble()
        self.mgr.restore(step, into=self.into())
        check_state(self.host.views, self.leaves, f"ours step {step}")

    def into(self) -> Any:
        """The state's structure with the host buffers as its tensors (for ``into=``)."""
        return with_leaves(self.state, self.host.views)

    # ---- saves
    def raw_write(self) -> Trial:
        path = os.path.join(self.work, "raw.bin")
        with timed() as t:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for tensor in self.leaves.values():
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
            for k, tensor in self.leaves.items():
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
            check_state(flatten(loaded), self.leaves, "torch.save")
            del loaded

        return Trial({"s": t[0]}, verify, [final, tmp])

    def safetensors_save(self) -> Trial:
        from safetensors.torch import save_file

        final = os.path.join(self.work, "model.safetensors")
        tmp = final + ".tmp"
        with timed() as t:
            save_file(self.leaves, tmp)
            fsync_file(tmp)  # save_file does not fsync
            os.rename(tmp, final)
            fsync_dir(self.work)

        def verify() -> None:
            from safetensors import safe_open

            with safe_open(final, "pt") as f:
                loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                check_state(loaded, self.leaves, "safetensors")

        return Trial({"s": t[0]}, verify, [final, tmp])

    def _dcp_verify(self, path: str) -> Callable[[], None]:
        def verify() -> None:
            import torch.distributed.checkpoint as dcp

            self.host.scramble()
            dest = dict(self.host.views)
            dcp.load(dest, storage_reader=dcp.FileSystemReader(path))
            check_state(dest, self.leaves, f"DCP {os.path.basename(path)}")

        return verify

    def dcp_save(self, threads: int = 1) -> Trial:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.work, f"dcp{threads}")
        with timed() as t:
            # sync_files=True (the default) fsyncs every file; DCP has no rename, and
            # never fsyncs its directory: we do, as every method must.
            dcp.save(self.leaves, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))
            fsync_dir(path)
            fsync_dir(self.work)
        return Trial({"s": t[0]}, self._dcp_verify(path), [path])

    def dcp_save_2threads(self) -> Trial:
        return self.dcp_save(threads=2)

    def dcp_async(self) -> Trial:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.work, "dcp_async")
        t0 = time.perf_counter()
        future = dcp.async_save(self.leaves, storage_writer=dcp.FileSystemWriter(path))
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
            for k, tensor in self.leaves.items():
                views[k].copy_(tensor)

        def verify() -> None:
            check_state(views, self.leaves, "host copy")

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
        dest = self.into()
        with timed() as t:
            self.mgr.restore(step, into=dest, verify=verify)

        def check() -> None:
            check_state(self.host.views, self.leaves, "load")

        return Trial({"s": t[0]}, check)

    load_cold = functools.partialmethod(_load, cold=True)
    load_warm = functools.partialmethod(_load, cold=False)
    load_warm_noverify = functools.partialmethod(_load, cold=False, verify=False)

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

    raw_read_cold = functools.partialmethod(_raw_read, cold=True)
    raw_read_warm = functools.partialmethod(_raw_read, cold=False)

    # ---- the default path: restore() into new tensors, then load_state_dict
    def layout(self) -> list[tuple[str, int, torch.dtype, tuple[int, ...], int]]:
        """(name, file offset, dtype, shape, bytes) of every tensor of the reference
        file, in file order, from its safetensors header."""
        if self._layout is None:
            self.ensure_reference()
            with open(self.ref_path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            rows = []
            for name, info in header.items():
                begin, end = info["data_offsets"]
                dtype = _TORCH_DTYPES[info["dtype"]]
                rows.append((name, 8 + n + begin, dtype, tuple(info["shape"]), end - begin))
            self._layout = sorted(rows, key=lambda r: r[1])
        return self._layout

    def _cache(self, cold: bool) -> None:
        if cold:
            drop_caches()
        else:
            warm_file(self.ref_path)

    def _raw_fresh(self, *, cold: bool, lsd: bool = False) -> Trial:
        """The floor of any load that returns new tensors: allocate each tensor
        (``torch.empty``) and read its bytes straight into it, in file order; with
        ``lsd``, then the same ``load_state_dict`` as ``restore_lsd``."""
        layout = self.layout()
        target = self._reset_target() if lsd else None
        self._cache(cold)
        out: dict[str, torch.Tensor] = {}
        with timed() as t, open(self.ref_path, "rb", buffering=0) as f:
            for name, offset, dtype, shape, _nbytes in layout:
                tensor = torch.empty(shape, dtype=dtype)
                out[name] = tensor
                view = memoryview(byte_view(tensor).numpy())
                f.seek(offset)
                while view:
                    view = view[f.readinto(view) :]
            if target is not None:
                target.load(with_leaves(self.state, out))

        def check() -> None:
            check_state(out, self.leaves, "raw read into fresh tensors")

        return Trial({"s": t[0]}, check)

    raw_fresh_cold = functools.partialmethod(_raw_fresh, cold=True)
    raw_fresh_warm = functools.partialmethod(_raw_fresh, cold=False)
    raw_fresh_lsd_cold = functools.partialmethod(_raw_fresh, cold=True, lsd=True)
    raw_fresh_lsd_warm = functools.partialmethod(_raw_fresh, cold=False, lsd=True)

    def _reset_target(self) -> Target:
        """The model and optimizer that ``load_state_dict`` fills, the previous trial's
        optimizer state dropped first (as the raw read's tensors are): every trial then
        allocates from the same freed memory."""
        if self._target is None:
            self._target = Target(self.state)
        self._target.reset()
        gc.collect()
        return self._target

    def _restore_lsd(self, *, cold: bool) -> Trial:
        """What the README's "On restart" does: ``state = mgr.restore(step)``, then
        ``model.load_state_dict`` (and ``optimizer.load_state_dict``)."""
        self.ensure_reference()
        target = self._reset_target()
        self._cache(cold)
        with timed() as t:
            loaded = self.mgr.restore(self.ref_step)
            target.load(loaded)
        del loaded

        def check() -> None:
            model_sd = self.state["model"] if target.opt is not None else self.state
            check_state(target.model.state_dict(), model_sd, "restore + load_state_dict")
            if target.opt is not None:
                got = flatten(target.opt.state_dict()["state"])
                check_state(got, flatten(self.state["optimizer"]["state"]), "optimizer")

        return Trial({"s": t[0]}, check)

    restore_lsd_cold = functools.partialmethod(_restore_lsd, cold=True)
    restore_lsd_warm = functools.partialmethod(_restore_lsd, cold=False)

    # ---- the device limit: direct I/O (no page cache), requests kept in flight
    def image(self, *, fill: bool) -> Any:
        """The host buffer as the reference file's page-aligned image, padded to whole
        pages; with ``fill``, holding the file's bytes (read untimed: other trials
        overwrite the buffer)."""
        self.ensure_reference()
        size = os.path.getsize(self.ref_path)
        padded = -(-size // _DIRECT_ALIGN) * _DIRECT_ALIGN
        flat = self.host.flat.numpy()
        if padded > flat.size:
            raise AssertionError(f"the host buffer holds {flat.size} bytes, the file {padded}")
        image = flat[:padded]
        if fill:
            image[size:] = 0
            with open(self.ref_path, "rb", buffering=0) as f:
                view = memoryview(image)[:size]
                while view:
                    view = view[f.readinto(view) :]
        self._image_size = size
        return image

    def direct_write(self) -> Trial:
        """``fio``-style: the same bytes as our file, O_DIRECT from aligned memory,
        ``_DIRECT_DEPTH`` writes in flight, then ftruncate, fsync, directory fsync."""
        image = self.image(fill=True)
        size = self._image_size
        path = os.path.join(self.work, "direct.bin")
        with timed() as t:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                _in_flight(lambda view, off: os.pwrite(fd, view, off), image)
                os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(self.work)

        def verify() -> None:
            import xxhash

            with open(path, "rb") as a, open(self.ref_path, "rb") as b:
                ha, hb = xxhash.xxh3_64(), xxhash.xxh3_64()
                while chunk := a.read(64 * MiB):
                    ha.update(chunk)
                while chunk := b.read(64 * MiB):
                    hb.update(chunk)
            if ha.digest() != hb.digest():
                raise AssertionError("direct write: the file differs from the reference")

        return Trial({"s": t[0]}, verify, [path])

    def direct_read(self) -> Trial:
        """``fio``-style: our file read with O_DIRECT into aligned memory, several reads
        in flight; the page cache plays no part, so it is the device's read limit."""
        image = self.image(fill=False)
        with timed() as t:
            fd = os.open(self.ref_path, os.O_RDONLY | os.O_DIRECT)
            try:
                got = _in_flight(lambda view, off: os.preadv(fd, [view], off), image)
            finally:
                os.close(fd)
        size = self._image_size

        def check() -> None:
            if got != size:
                raise AssertionError(f"direct read got {got} of {size} bytes")

        return Trial({"s": t[0]}, check)

    # ---- the first async save of a manager: with and without prepare_async
    def _first_async(self, *, prepared: bool) -> Trial:
        root = os.path.join(self.work, "first-async")
        mgr = CheckpointManager(root)
        try:
            if prepared:
                mgr.prepare_async(self.state)
            t0 = time.perf_counter()
            handle = mgr.save_async(1, self.state)
            blocked = time.perf_counter() - t0
            handle.result()
        finally:
            mgr.close()
        return Trial({"blocked_s": blocked, "s": blocked}, None, [root])

    async_first = functools.partialmethod(_first_async, prepared=False)
    async_first_prepared = functools.partialmethod(_first_async, prepared=True)

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
LOAD_METHODS = (
    "load_cold",
    "raw_read_cold",
    "load_warm",
    "raw_read_warm",
    "load_warm_noverify",
    "restore_lsd_cold",
    "raw_fresh_cold",
    "restore_lsd_warm",
    "raw_fresh_warm",
    "raw_fresh_lsd_cold",
    "raw_fresh_lsd_warm",
    "direct_read",
)
DEVICE_METHODS = ("direct_write",)
OTHER_METHODS = ("async_first", "async_first_prepared", "train_step_slowdown", "retention_block")
PEERS = ("torch_save", "safetensors_save", "dcp_save", "dcp_save_2threads")
