"""A training state <-> one safetensors file, exactly and without executing code.

A *state* is a tree of dicts, lists and tuples whose leaves are torch tensors, numpy
arrays and plain Python values: ``model.state_dict()``, ``optimizer.state_dict()`` (int
keys), scheduler state, and RNG states (``torch.get_rng_state()``, ``random.getstate()``,
``numpy.random.get_state()``) in one dict. It is written as one file in the real
safetensors format, so ``safetensors.safe_open(path, "pt")`` reads every tensor::

    [8 bytes]  little-endian u64 N: length of the JSON header
    [N bytes]  JSON header, padded with spaces so data starts at a multiple of 64:
               {"__metadata__": {"format": "pt",
                                 "atomic_checkpoint.format_version": "1",
                                 "atomic_checkpoint.tree": "<the tree, as JSON>"},
                "model.fc.weight": {"dtype": "F32", "shape": [4, 3],
                                    "data_offsets": [0, 48]},
                ...}
    [data]     every tensor's bytes, contiguous, in data_offsets order

Every tensor starts at an offset aligned to its item size (safetensors' own rule;
``safe_open`` needs it to view the mapped bytes as the dtype), and tensors whose byte
length is a multiple of 64 (nearly all large ones) start at 64-aligned file offsets,
for fast copies between the page cache and tensor memory (see :func:`plan_state`).
Tensor names are the dotted tree paths (``optimizer.state.0.exp_avg``), made unique
with a ``#2`` suffix where two paths print alike.

The tree (``__metadata__["atomic_checkpoint.tree"]``) is JSON in which every JSON object
is a tagged node, so nothing is ambiguous::

    null, true, false, "str", 12          None, bool, str, int with |n| < 2**63
    [node, ...]                           list
    {"tuple": [node, ...]}                tuple
    {"dict": [[key, node], ...]}          dict, insertion order kept, any key type below
    {"odict": [[key, node], ...],         collections.OrderedDict; "attrs" (optional)
     "attrs": [["name", node], ...]}      keeps instance attributes such as the
                                          ``_metadata`` of ``Module.state_dict()``
    {"int": "-0x1f"}                      any other int (hex: exact at any size)
    {"float": "0x1.8p+1"}                 float via float.hex (inf, -0.0 exact; any
                                          NaN reads back as the canonical NaN: a
                                          Python float NaN's sign and payload are not
                                          kept, those of tensors and arrays are)
    {"bytes": "<base64>"}                 bytes (and "bytearray")
    {"size": [2, 3]}                      torch.Size
    {"dtype": "bfloat16"}                 torch.dtype
    {"device": "cuda:0"}                  torch.device
    {"tensor": "<name>"}                  a torch.Tensor stored as entry <name>
    {"ndarray": "<name>"}                 a numpy.ndarray (+ "byteorder": ">" if big-endian)
    {"npscalar": "<name>"}                a numpy scalar such as numpy.float32(1.5)
    {"pickle": "<name>"}                  a pickled object (U8 entry); only written with
                                          ``allow_pickle=True``, only read with it too

Saving is two-phase so the caller owns I/O and checksums: :func:`plan_state` walks the
tree without copying data and knows the exact file size; :meth:`StatePlan.iter_chunks`
then yields the header and zero-copy memoryviews of each tensor's memory. Loading
(:func:`load_state`) validates the header strictly, then reads each tensor straight
into its final memory (a new tensor, or the caller's existing one with ``into=``): from
a regular file with positioned reads (``os.preadv``) by several threads, so the device
has requests queued, feeding an optional digest the whole file in order as the chunks
come in; from any other file object with one sequential pass of ``readinto``.

Neither torch nor numpy is imported by this module; they are used only when the state
(or the file) holds their objects.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import functools
import gc
import inspect
import json
import math
import os
import pickle
import stat
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import device_staging
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    SerializationError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from .manifest import no_duplicate_keys

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "TREE_METADATA_KEY",
    "CheckpointHeader",
    "StatePlan",
    "load_state",
    "plan_state",
    "read_header",
]

FORMAT_VERSION = 1
TREE_METADATA_KEY = "atomic_checkpoint.tree"
VERSION_METADATA_KEY = "atomic_checkpoint.format_version"
DEFAULT_CHUNK_BYTES = 8 << 20

# safetensors refuses headers above 100 MB (MAX_HEADER_SIZE in its Rust reader); a
# larger length field is garbage, not a header, and must not drive an allocation.
MAX_HEADER_BYTES = 100_000_000
MAX_RANK = 64
# Real states nest fewer than ten levels; the bound keeps hostile or runaway trees far
# from Python's recursion limit on both save and load.
MAX_DEPTH = 200
# int values inside this range are stored as JSON numbers, others as hex strings:
# Python 3.11+ refuses to print or parse decimal ints of more than 4300 digits.
_JSON_INT_LIMIT = 1 << 63
# Tensors smaller than this are coalesced: one write (or read) syscall per tiny
# optimizer "step" tensor would dominate the time of a state with thousands of them.
_SMALL_ENTRY_BYTES = 1 << 16
# Tensor data is laid out at file offsets that are multiples of this where possible.
_FILE_ALIGN = 64
_SMALL_BATCH_BYTES = 1 << 20
# Positioned reads (see _read_pieces): the unit a worker reads from the page cache and
# then mostly hashes itself, small enough to be still in that core's L2 cache (1-2 MiB
# on current server CPUs). Measured warm at 1 GiB, 624 tensors (2 cores, L2 1 MiB), the
# worker hashing its own chunk: verified load / raw read 1.07 with 512 KiB, 1.04 with
# 1 MiB, 1.07 with 2 MiB; 1.36 when a separate thread hashed 8 MiB chunks after the
# readers. Files smaller than _THREADED_MIN_BYTES are read on the calling thread.
_READ_CHUNK_BYTES = 1 << 20
_THREADED_MIN_BYTES = 16 << 20
DEFAULT_READ_THREADS = 4

# safetensors dtype code -> (item size, torch dtype name, numpy dtype name or None).
# bfloat16 and the float8 formats have no numpy dtype: their bytes are moved through
# uint8 views and never converted.
_DTYPES: dict[str, tuple[int, str, str | None]] = {
    "F64": (8, "float64", "float64"),
    "F32": (4, "float32", "float32"),
    "F16": (2, "float16", "float16"),
    "BF16": (2, "bfloat16", None),
    "I64": (8, "int64", "int64"),
    "I32": (4, "int32", "int32"),
    "I16": (2, "int16", "int16"),
    "I8": (1, "int8", "int8"),
    "U64": (8, "uint64", "uint64"),
    "U32": (4, "uint32", "uint32"),
    "U16": (2, "uint16", "uint16"),
    "U8": (1, "uint8", "uint8"),
    "BOOL": (1, "bool", "bool"),
    "F8_E4M3": (1, "float8_e4m3fn", None),
    "F8_E5M2": (1, "float8_e5m2", None),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz", None),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz", None),
    "C64": (8, "complex64", "complex64"),
}
# numpy (kind, item size) -> dtype code; avoids importing numpy to build the table.
_NUMPY_CODES: dict[tuple[str, int], str] = {
    (kind, bits // 8): f"{code}{bits}"
    for kind, code, widths in (
        ("f", "F", (64, 32, 16)),
        ("i", "I", (64, 32, 16, 8)),
        ("u", "U", (64, 32, 16, 8)),
    )
    for bits in widths
}
_NUMPY_CODES[("b", 1)] = "BOOL"
_NUMPY_CODES[("c", 8)] = "C64"
_TORCH_CODES: dict[Any, str] = {}  # torch.dtype -> code, filled on first use

_CONVERT_HINT = (
    "Convert it to a supported type (torch.Tensor or numpy.ndarray of a supported dtype, "
    "int, float, bool, str, bytes, None, torch.dtype/device/Size, or a dict/list/tuple "
    "of these), or create the manager with CheckpointManager(..., allow_pickle=True) to "
    "pickle it (the manager that loads it needs allow_pickle=True too)"
)

_MISSING: Any = object()

# One step of a path through the tree: (is_index, key). Lists and tuples give indices,
# dicts give keys.
_PathPart = tuple[bool, Any]
_Path = tuple[_PathPart, ...]


@functools.lru_cache(maxsize=1)
def _torch_dtypes(torch: Any) -> dict[str, Any]:
    """torch's dtypes by the attribute names they have in ``torch`` (what a ``dtype``
    node records: ``str(dtype)`` without ``torch.``)."""
    return {
        name: value
        for name, value in vars(torch).items()
        if isinstance(value, torch.dtype) and not name.startswith("_")
    }


def _format_path(path: _Path) -> str:
    """Render a path the way a user would index the state: ``state['opt'][0]``."""
    return "state" + "".join(f"[{_shown(v, not is_index)}]" for is_index, v in path)


def _shown(value: Any, as_repr: bool = True) -> str:
    """``value`` for an error message: repr (or str) cut at 80 characters. An int
    of more than 4,300 digits cannot be rendered at all (Python's limit): a dict key of
    one in a hostile file turned the CorruptCheckpointError being built into a
    ValueError, which no fallback to an older checkpoint caught."""
    try:
        text = repr(value) if as_repr else str(value)
    except ValueError:
        text = f"<{type(value).__name__} too large to show>"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_array(x: Any) -> bool:
    """A torch tensor or a numpy array (checked without importing either)."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    return (torch is not None and isinstance(x, torch.Tensor)) or (
        np is not None and isinstance(x, np.ndarray)
    )


def _holds_array(x: Any, depth: int) -> bool:
    """Whether ``x`` is or contains (through dicts, lists and tuples) a tensor or array."""
    if _is_array(x):
        return True
    if depth >= MAX_DEPTH:
        return False
    if isinstance(x, Mapping):
        return any(_holds_array(v, depth + 1) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_array(v, depth + 1) for v in x)
    return False


def _array_kind(x: Any) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a numpy array of shape {tuple(x.shape)}"


def _node_kind(node: Any, tag: str | None) -> str:
    """What a tree node holds, for a message: ``dict``, ``list``, ``int`` ..."""
    if tag is None:
        return type(node).__name__
    return {"odict": "OrderedDict", "npscalar": "numpy scalar", "pickle": "pickled object"}.get(
        tag, tag
    )


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "this checkpoint holds torch tensors but torch is not installed: "
            "pip install 'atomic-checkpoint[torch]'"
        ) from exc
    return torch


def _import_numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise ImportError(
            "reading or writing tensor bytes needs numpy: pip install 'atomic-checkpoint[torch]'"
        ) from exc
    return numpy


def _torch_codes(torch: Any) -> dict[Any, str]:
    if not _TORCH_CODES:
        for code, (_, torch_name, _) in _DTYPES.items():
            dtype = getattr(torch, torch_name, None)
            if dtype is not None:
                _TORCH_CODES[dtype] = code
    return _TORCH_CODES


def _torch_dtype(torch: Any, code: str) -> Any:
    dtype = getattr(torch, _DTYPES[code][1], None)
    if dtype is None:
        raise CorruptCheckpointError(
            f"dtype {code} is not available in the installed torch {torch.__version__}; "
            "upgrade torch to load this checkpoint"
        )
    return dtype


def _numpy_code(dtype: Any) -> str | None:
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    return _NUMPY_CODES.get((dtype.kind, dtype.itemsize))


def is_big_endian(dtype: Any) -> bool:
    """Whether numpy ``dtype`` stores its items big-endian (the file holds them
    little-endian, with a ``"byteorder": ">"`` flag to give them back as they were)."""
    return dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big")


def _torch_problem(torch: Any, t: Any) -> str | None:
    """Why tensor ``t`` cannot be stored as raw bytes, or None if it can."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return (
            f"{type(t).__module__}.{type(t).__qualname__} (a torch.Tensor subclass) is not "
            "supported; save a plain tensor (e.g. DTensor.full_tensor() or its local shard)"
        )
    if t.is_meta:
        return "a meta tensor holds no data and cannot be saved"
    if t.is_nested:
        return (
            "a nested tensor is not supported (save its components: "
            "list(t.unbind()), or t.to_padded_tensor(0) with their lengths)"
        )
    if t.layout != torch.strided:
        return f"a tensor with layout {t.layout} is not supported (call .to_dense())"
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype}) is not supported (call .dequantize())"
    if t.dtype not in _torch_codes(torch):
        # safetensors, whose header our files use, knows only complex64 (C64).
        hint = " (use torch.view_as_real(), or complex64)" if t.dtype.is_complex else ""
        return f"a tensor of dtype {t.dtype} is not supported{hint}"
    return None


def _overlaps_itself(t: Any) -> bool:
    """Whether distinct elements of tensor or array ``t`` may share memory: a zero
    stride on a dimension of size > 1 (what ``expand()`` makes), or strides that make
    rows overlap (``as_strided``). Sorted by stride, each dimension must step past all
    the smaller ones (a layout that interleaves without overlapping fails this too: no
    tensor a framework makes has one)."""
    itemsize, strides = _byte_strides(t)
    extent = itemsize
    for st, n in sorted((abs(st), n) for st, n in zip(strides, t.shape, strict=True) if n > 1):
        if st < extent:
            return True
        extent = st * (n - 1) + extent
    return False


def _byte_strides(t: Any) -> tuple[int, tuple[int, ...]]:
    """Element size and strides in bytes of tensor or array ``t``."""
    if hasattr(t, "element_size"):  # torch
        size = int(t.element_size())
        return size, tuple(int(st) * size for st in t.stride())
    return int(t.itemsize), tuple(int(st) for st in t.strides)


def _extent(t: Any) -> tuple[str, int, int] | None:
    """The memory ``t`` spans: (address space, first byte, one past the last byte);
    None if it has no elements. torch CPU tensors and numpy arrays share one space."""
    if any(n == 0 for n in t.shape):
        return None
    itemsize, strides = _byte_strides(t)
    if hasattr(t, "element_size"):
        space, ptr = ("cpu" if t.device.type == "cpu" else str(t.device)), int(t.data_ptr())
    else:
        space, ptr = "cpu", int(t.__array_interface__["data"][0])
    lo = ptr + sum(st * (n - 1) for st, n in zip(strides, t.shape, strict=True) if st < 0)
    hi = ptr + sum(st * (n - 1) for st, n in zip(strides, t.shape, strict=True) if st > 0)
    return space, lo, hi + itemsize


def _bitwise_equal(a: Any, b: Any) -> bool:
    """Whether tensors (or arrays) ``a`` and ``b`` of one dtype and shape hold the same
    bits (NaNs included)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        as_int = ints.get(a.element_size())
        b = b.to(a.device)
        if as_int is not None:
            return bool(torch.equal(a.view(as_int), b.view(as_int)))
        return bool(torch.equal(a, b))
    np = sys.modules["numpy"]
    if a.itemsize in (1, 2, 4, 8):
        kind = np.dtype(f"u{a.itemsize}")
        return bool(np.array_equal(a.view(kind), b.view(kind)))
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _torch_bytes(torch: Any, t: Any) -> Any:
    """A 1-D uint8 numpy array over ``t``'s bytes: its own memory when it can be."""
    t = t.detach()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_conj():  # a lazily conjugated view (``t.conj()``): store its values
        t = t.resolve_conj()
    # Make it contiguous where it lives (a device-side copy for GPU tensors), then bring
    # it to the host: one temporary per tensor, never one for the whole state.
    if not t.is_contiguous():
        t = t.contiguous()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return _flat_bytes(torch, t).numpy()


def _plain(t: Any) -> bool:
    """Whether tensor ``t``'s memory holds its values as they are: contiguous, with no
    lazy negation or conjugation (its bytes can be copied in or out as one block)."""
    return bool(t.is_contiguous() and not t.is_neg() and not t.is_conj())


def _flat_bytes(torch: Any, t: Any) -> Any:
    """A 1-D uint8 view of contiguous tensor ``t``'s memory."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        # A one-element tensor counts as contiguous whatever its stride (e.g.
        # ``x[::5][:1]``), and its flat view keeps that stride, which view() rejects.
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _numpy_bytes(np: Any, a: Any) -> Any:
    """A 1-D uint8 numpy array over ``a``'s bytes, little-endian, C order."""
    a = np.asarray(a)
    if is_big_endian(a.dtype):
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


class _Entry(NamedTuple):
    """One data entry of the file: a tensor, an array or a pickle blob. A named tuple:
    an async save plans every leaf on the training thread, and a tuple is built several
    times faster than a frozen dataclass."""

    name: str
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int
    kind: str  # "torch" | "numpy" | "blob"
    source: Any

    @property
    def size_bytes(self) -> int:
        return self.end - self.begin


def _describe_array(x: Any, where: str) -> tuple[str, str, tuple[int, ...]]:
    """(kind, dtype code, shape) of a torch tensor or numpy array/scalar, or raise."""
    mod = type(x).__module__
    torch = sys.modules.get("torch")
    if torch is not None and mod.startswith("torch") and isinstance(x, torch.Tensor):
        problem = _torch_problem(torch, x)
        if problem is not None:
            raise SerializationError(f"{where}: {problem}")
        return "torch", _torch_codes(torch)[x.dtype], tuple(int(d) for d in x.shape)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, (np.ndarray, np.generic)):
        code = _numpy_code(x.dtype)
        if code is None:
            raise SerializationError(f"{where}: numpy dtype {x.dtype} is not supported")
        return "numpy", code, tuple(int(d) for d in x.shape)
    raise SerializationError(
        f"{where}: expected a torch.Tensor or numpy.ndarray, got {mod}.{type(x).__qualname__}"
    )


class StatePlan:
    """A state laid out as one safetensors file, ready to stream. Built by :func:`plan_state`.

    The plan holds references to the state's tensors, not copies: bytes are read from
    them when :meth:`iter_chunks` runs, so the tensors must not change in between (an
    async save swaps in its snapshot copies with :meth:`with_tensors`).

    Attributes:
        total_size_bytes: exact size of the file :meth:`iter_chunks` produces.
        header_size_bytes: size of the length prefix plus the padded JSON header.
        tensor_count: number of tensor and array entries (pickle blobs not included).
    """

    __slots__ = (
        "_entries",
        "_header",
        "_on_gpu",
        "header_size_bytes",
        "tensor_count",
        "total_size_bytes",
    )

    def __init__(self, header: bytes, entries: tuple[_Entry, ...]):
        self._header = header
        self._entries = entries
        self.header_size_bytes = len(header)
        self.total_size_bytes = len(header) + (entries[-1].end if entries else 0)
        self.tensor_count = sum(1 for e in entries if e.kind != "blob")
        self._on_gpu: bool | None = None

    def __repr__(self) -> str:
        return (
            f"StatePlan(tensor_count={self.tensor_count}, total_size_bytes={self.total_size_bytes})"
        )

    def tensors(self) -> list[tuple[str, Any]]:
        """The tensor and array leaves as ``(name, tensor)``, in file order.

        Tied tensors appear once. Pickle blobs are not listed: they were serialized when
        the plan was made and cannot change.
        """
        return [(e.name, e.source) for e in self._entries if e.kind != "blob"]

    def on_gpu(self) -> bool:
        """Whether a tensor of the plan lives on a CUDA device (its bytes reach the
        host by DMA: see ``iter_chunks(staging=)``)."""
        if self._on_gpu is None:  # asked once per save by each writer: 2 us a tensor
            self._on_gpu = any(e.kind == "torch" and e.source.is_cuda for e in self._entries)
        return self._on_gpu

    def image_layout(self) -> tuple[bytes, list[int], list[tuple[int, bytes]]]:
        """Where everything sits in the file, for writers that build the file's image in
        memory (an async save's snapshot buffer).

        Returns:
            ``(header, offsets, blobs)``: the header bytes (file offset 0); the file
            offset of each entry of :meth:`tensors`, in that order; and each pickle blob
            as ``(file offset, bytes)``. Tensor ``i`` occupies ``offsets[i]`` up to
            ``offsets[i]`` plus its byte length; the file is :attr:`total_size_bytes`
            long.
        """
        base = len(self._header)
        offsets = [base + e.begin for e in self._entries if e.kind != "blob"]
        blobs = [(base + e.begin, bytes(e.source)) for e in self._entries if e.kind == "blob"]
        return self._header, offsets, blobs

    def with_tensors(self, replacements: Mapping[str, Any] | Sequence[Any]) -> StatePlan:
        """A plan with the same header that writes the bytes of ``replacements`` instead.

        Args:
            replacements: either a mapping from entry name (as in :meth:`tensors`) to a
                replacement, which may cover only some entries, or a sequence with one
                replacement per entry of :meth:`tensors`, in that order. A replacement
                is a torch tensor or numpy array with the same dtype and shape as the
                entry it replaces; it may live anywhere (pinned host memory, GPU) and
                need not be contiguous.

        Returns:
            A new plan; this one is unchanged.

        Raises:
            SerializationError: a name is unknown, the count is wrong, or a replacement's
                dtype or shape differs from the entry's.
        """
        entries = list(self._entries)
        index = {e.name: i for i, e in enumerate(entries) if e.kind != "blob"}
        if isinstance(replacements, Mapping):
            pairs = list(replacements.items())
        else:
            seq = list(replacements)
            if len(seq) != len(index):
                raise SerializationError(
                    f"with_tensors() got {len(seq)} replacements for {len(index)} tensors"
                )
            pairs = list(zip(index, seq, strict=True))
        for name, new in pairs:
            i = index.get(name)
            if i is None:
                raise SerializationError(f"with_tensors(): the plan has no tensor {name!r}")
            old = entries[i]
            kind, code, shape = _describe_array(new, f"with_tensors()[{name!r}]")
            if code != old.code or shape != old.shape:
                raise SerializationError(
                    f"with_tensors()[{name!r}]: replacement is {code} of shape {shape}, "
                    f"the plan has {old.code} of shape {old.shape}"
                )
            entries[i] = old._replace(kind=kind, source=new)
        return StatePlan(self._header, tuple(entries))

    def _checked(self, entry: _Entry) -> str:
        """The source's kind ("torch" or "numpy"); raises if it changed since the plan."""
        where = f"tensor {entry.name!r}"
        kind, code, shape = _describe_array(entry.source, where)
        if code != entry.code or shape != entry.shape:
            raise SerializationError(
                f"{where} changed after plan_state(): it is now {code} of shape {shape}, "
                f"planned as {entry.code} of shape {entry.shape}; plan again after "
                "changing the state"
            )
        return kind

    def _entry_bytes(self, entry: _Entry) -> memoryview:
        if entry.kind == "blob":
            return memoryview(entry.source)
        kind = self._checked(entry)
        np = _import_numpy()
        if kind == "torch":
            arr = _torch_bytes(sys.modules["torch"], entry.source)
        else:
            arr = _numpy_bytes(np, entry.source)
        view = memoryview(arr)
        if view.nbytes != entry.size_bytes:  # pragma: no cover - guarded by the shape check
            raise SerializationError(
                f"tensor {entry.name!r}: {view.nbytes} bytes, planned {entry.size_bytes}"
            )
        return view

    def _device_bytes(self, entry: _Entry) -> Any:
        """The flat uint8 tensor over a GPU tensor's memory that can be copied to the
        host as it is (contiguous, no lazy negation or conjugation), else None."""
        src = entry.source
        if entry.kind != "torch" or src.device.type != "cuda" or not _plain(src):
            return None
        self._checked(entry)
        return _flat_bytes(sys.modules["torch"], src)

    def iter_chunks(
        self,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        staging: device_staging.DeviceStaging | None = None,
    ) -> Iterator[bytes | memoryview]:
        """Yield the whole file, in order, as chunks of at most ``chunk_bytes`` bytes.

        The header comes first, then each tensor's bytes. A contiguous CPU tensor's
        chunks are zero-copy memoryviews of its memory; a GPU, non-contiguous or
        big-endian one is copied to a contiguous host temporary first, one tensor at a
        time. Tensors under 64 KiB are joined into one ``bytes`` chunk so that a state
        of many tiny tensors does not cost one write per tensor. Each chunk stays valid
        after the next one is produced (nothing is reused), but chunks that view a
        tensor's memory change if the tensor does.

        With ``staging``, GPU tensors of 64 KiB and more come through its slots
        instead: each chunk is copied to a slot by DMA while the one before it is
        consumed, and is valid only until the next chunk is asked for. Only a caller
        that is done with each chunk before asking for the next may pass it.

        Args:
            chunk_bytes: upper bound on the size of each chunk; at least 1.
            staging: page-locked slots for GPU tensors' chunks (see above).

        Raises:
            ValueError: ``chunk_bytes`` is below 1.
            SerializationError: a tensor changed dtype or shape since the plan was made.
        """
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        small_limit = min(chunk_bytes, _SMALL_ENTRY_BYTES)
        pending: list[memoryview] = []
        pending_size = 0

        def flush() -> bytes | memoryview:
            nonlocal pending, pending_size
            out: bytes | memoryview = pending[0] if len(pending) == 1 else b"".join(pending)
            pending = []
            pending_size = 0
            return out

        def pieces() -> Iterator[memoryview | _OnDevice]:
            yield memoryview(self._header)
            for entry in self._entries:
                if not entry.size_bytes:
                    continue
                if staging is not None and entry.size_bytes >= small_limit:
                    flat = self._device_bytes(entry)
                    if flat is not None:
                        yield _OnDevice(flat)
                        continue
                yield self._entry_bytes(entry)

        for piece in pieces():
            if isinstance(piece, _OnDevice):
                if pending:
                    yield flush()
                assert staging is not None  # only made with staging
                yield from _device_chunks(piece.data, staging, chunk_bytes)
                continue
            size = piece.nbytes
            if size < small_limit:
                if pending_size + size > chunk_bytes:
                    yield flush()
                pending.append(piece)
                pending_size += size
                continue
            if pending:
                yield flush()
            for start in range(0, size, chunk_bytes):
                yield piece[start : start + chunk_bytes]
        if pending:
            yield flush()


def _device_chunks(
    flat: Any, ring: device_staging.DeviceStaging, chunk_bytes: int
) -> Iterator[memoryview]:
    """GPU bytes ``flat`` as host chunks through ``ring``'s slots, in turn: the copy of
    the next chunk runs while the caller consumes this one."""
    size = min(chunk_bytes, ring.slot_bytes)
    total = int(flat.numel())
    starts = range(0, total, size)
    count = len(ring.slots)
    # Asynchronous only into page-locked memory; a pageable slot's copy returns done.
    async_copy = ring.pinned

    def fetch(i: int) -> None:
        k = i % count
        ring.wait(k)  # the chunk last yielded from this slot is consumed
        n = min(size, total - starts[i])
        ring.slots[k][:n].copy_(flat[starts[i] : starts[i] + n], non_blocking=async_copy)
        ring.record(k, {flat.device})

    fetch(0)
    for i, start in enumerate(starts):
        if i + 1 < len(starts):
            fetch(i + 1)
        k = i % count
        ring.wait(k)
        yield ring.views[k][: min(size, total - start)]


class _Planner:
    """Walks a state once, encoding the tree and collecting the data entries."""

    def __init__(self, *, allow_pickle: bool):
        self.allow_pickle = allow_pickle
        self.entries: list[_Entry] = []
        self.names: set[str] = {"__metadata__"}
        self.by_id: dict[int, str] = {}  # id of a leaf in the state -> entry name
        self.by_view: dict[tuple[Any, ...], str] = {}  # identical views -> entry name
        self.active: set[int] = set()  # containers on the current path (cycle check)
        self.has_torch = False

    # -- leaves ------------------------------------------------------------------------

    def _name(self, path: _Path) -> str:
        parts = []
        for is_index, value in path:
            plain = is_index or type(value) is str or type(value) is int
            parts.append(str(value) if plain else repr(value))
        base = ".".join(parts) or "state"
        if not base.isascii():
            # Lone surrogates cannot appear in a header that serde_json (safetensors'
            # reader) accepts, so they are written as their backslash escapes.
            base = base.encode("utf-8", "backslashreplace").decode("utf-8")
        name, n = base, 1
        while name in self.names:
            n += 1
            name = f"{base}#{n}"
        self.names.add(name)
        return name

    def _add(self, path: _Path, code: str, shape: tuple[int, ...], kind: str, src: Any) -> str:
        size = math.prod(shape) * _DTYPES[code][0]
        name = self._name(path)
        self.entries.append(_Entry(name, code, shape, 0, size, kind, src))
        return name

    def _pickle(self, x: Any, path: _Path, what: str) -> dict[str, Any]:
        try:
            blob = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise SerializationError(
                f"cannot save {_format_path(path)}: {what}, and pickling "
                f"it failed ({type(exc).__name__}: {exc}); convert it to a supported type"
            ) from exc
        return {"pickle": self._add(path, "U8", (len(blob),), "blob", blob)}

    def _unsupported(
        self, x: Any, path: _Path, what: str, name_path: _Path | None = None
    ) -> dict[str, Any]:
        if self.allow_pickle:
            return self._pickle(x, path if name_path is None else name_path, what)
        if callable(getattr(x, "state_dict", None)) and not isinstance(x, type):
            # A module or optimizer: its state dict is what to save (pickled, it comes
            # back as an object that load_state_dict does not take).
            raise SerializationError(
                f"cannot save {_format_path(path)}: {what}. Save its state instead: "
                f"{type(x).__name__.lower()}.state_dict() (and on restore, "
                "load_state_dict() with what comes back)"
            )
        raise SerializationError(f"cannot save {_format_path(path)}: {what}. {_CONVERT_HINT}.")

    def _tensor(self, torch: Any, x: Any, path: _Path) -> dict[str, Any]:
        name = self.by_id.get(id(x))
        if name is not None:
            return {"tensor": name}
        problem = _torch_problem(torch, x)
        if problem is not None:
            return self._unsupported(x, path, problem)
        self.has_torch = True
        key = None
        shape = tuple(x.shape)  # torch.Size holds ints
        if x.numel() > 0:
            # Distinct empty tensors all report data_ptr 0; they are never merged.
            key = (
                "torch",
                x.data_ptr(),
                shape,
                x.stride(),
                x.dtype,
                x.device,
                x.is_neg(),
                x.is_conj(),
            )
            name = self.by_view.get(key)
        if name is None:
            name = self._add(path, _torch_codes(torch)[x.dtype], shape, "torch", x)
            if key is not None:
                self.by_view[key] = name
        self.by_id[id(x)] = name
        return {"tensor": name}

    def _numpy(self, np: Any, x: Any, path: _Path) -> dict[str, Any] | None:
        is_array = type(x) is np.ndarray or isinstance(x, np.memmap)
        if not is_array and not isinstance(x, np.generic):
            return None
        tag = "ndarray" if is_array else "npscalar"
        node: dict[str, Any] = {tag: ""}
        if is_array and is_big_endian(x.dtype):
            node["byteorder"] = ">"
        name = self.by_id.get(id(x))
        if name is None:
            code = _numpy_code(x.dtype)
            if code is None:
                what = f"numpy.{type(x).__name__} of dtype {x.dtype} is not supported"
                return self._unsupported(x, path, what)
            key = None
            if is_array and x.size > 0:
                iface = x.__array_interface__
                key = ("numpy", iface["data"][0], x.shape, x.strides, x.dtype.str)
                name = self.by_view.get(key)
            if name is None:
                name = self._add(path, code, tuple(int(d) for d in x.shape), "numpy", x)
                if key is not None:
                    self.by_view[key] = name
            self.by_id[id(x)] = name
        node[tag] = name
        return node

    # -- tree --------------------------------------------------------------------------

    def encode(self, x: Any, path: _Path, depth: int) -> Any:
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if -_JSON_INT_LIMIT < x < _JSON_INT_LIMIT else {"int": hex(x)}
        if t is float:
            return {"float": x.hex()}
        if t is bytes:
            return {"bytes": base64.b64encode(x).decode("ascii")}
        if t is bytearray:
            return {"bytearray": base64.b64encode(x).decode("ascii")}
        if t is list or t is tuple or t is dict or t is collections.OrderedDict:
            return self._container(x, path, depth)
        mod = t.__module__
        if mod.startswith("torch"):
            torch = sys.modules.get("torch")
            if torch is not None:
                if isinstance(x, torch.Tensor):
                    return self._tensor(torch, x, path)
                if t is torch.Size:
                    return {"size": [int(d) for d in x]}
                if t is torch.dtype:
                    return {"dtype": str(x).removeprefix("torch.")}
                if t is torch.device:
                    return {"device": str(x)}
        elif mod == "numpy" or mod.startswith("numpy."):
            np = sys.modules.get("numpy")
            if np is not None:
                node = self._numpy(np, x, path)
                if node is not None:
                    return node
        what = f"an object of type {mod}.{t.__qualname__} is not supported"
        return self._unsupported(x, path, what)

    def _container(self, x: Any, path: _Path, depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise SerializationError(
                f"cannot save {_format_path(path)}: the state nests deeper than {MAX_DEPTH} "
                "levels; flatten it"
            )
        if id(x) in self.active:
            raise SerializationError(
                f"cannot save {_format_path(path)}: the {type(x).__name__} contains itself "
                "(a reference cycle); break the cycle"
            )
        self.active.add(id(x))
        try:
            if type(x) is list:
                return [self.encode(v, (*path, (True, i)), depth + 1) for i, v in enumerate(x)]
            if type(x) is tuple:
                items = [self.encode(v, (*path, (True, i)), depth + 1) for i, v in enumerate(x)]
                return {"tuple": items}
            pairs = [
                [self._key(k, path, depth + 1), self.encode(v, (*path, (False, k)), depth + 1)]
                for k, v in x.items()
            ]
            if type(x) is dict:
                return {"dict": pairs}
            node: dict[str, Any] = {"odict": pairs}
            attrs = getattr(x, "__dict__", None)
            if attrs:
                node["attrs"] = [
                    [self._attr_name(a, path), self.encode(v, (*path, (False, a)), depth + 1)]
                    for a, v in attrs.items()
                ]
            return node
        finally:
            self.active.discard(id(x))

    def _key(self, k: Any, path: _Path, depth: int) -> Any:
        t = type(k)
        if k is None or t in (bool, str, int, float, bytes):
            return self.encode(k, path, 0)
        if t is tuple:
            if depth >= MAX_DEPTH:  # the loader refuses deeper keys (recursion bound)
                raise SerializationError(
                    f"cannot save {_format_path(path)}: a dict key nests tuples deeper than "
                    f"{MAX_DEPTH} levels"
                )
            return {"tuple": [self._key(e, path, depth + 1) for e in k]}
        what = f"a dict key of type {t.__module__}.{t.__qualname__} ({_shown(k)}) is not supported"
        return self._unsupported(k, path, what, (*path, (True, "key")))

    @staticmethod
    def _attr_name(name: Any, path: _Path) -> str:
        if not _is_safe_attr(name):
            raise SerializationError(
                f"cannot save {_format_path(path)}: OrderedDict attribute {name!r} cannot be "
                "restored safely; delete it or convert the OrderedDict to a dict"
            )
        return str(name)


def _is_safe_attr(name: Any) -> bool:
    # Restoring an attribute must never shadow an OrderedDict method or touch a dunder
    # (``__class__``): only plain data attributes such as ``_metadata`` round-trip.
    return (
        type(name) is str
        and name.isidentifier()
        and not name.startswith("__")
        and not hasattr(collections.OrderedDict, name)
    )


def plan_state(state: Any, *, allow_pickle: bool = False) -> StatePlan:
    """Lay out ``state`` as one safetensors file without copying any tensor data.

    Args:
        state: the tree to save: dicts (any key of type str, int, float, bool, None,
            bytes or tuple), OrderedDicts, lists and tuples of torch tensors, numpy
            arrays and scalars, int, float, bool, None, str, bytes, torch.dtype,
            torch.device and torch.Size. The same tensor object, or two tensors that are
            the same view of the same memory, are stored once and loaded as one object.
        allow_pickle: pickle objects that are otherwise unsupported into a blob entry,
            instead of raising. The file then needs ``allow_pickle=True`` to load.

    Returns:
        The plan; stream it with :meth:`StatePlan.iter_chunks`.

    Raises:
        SerializationError: the state holds something that cannot be saved safely (its
            message names the path, e.g. ``state['optimizer']['param_groups'][0]['foo']``,
            and the type), nests too deeply, contains a cycle, or its structure
            needs a header larger than safetensors allows (100 MB).
    """
    with without_gc():
        return _plan(state, allow_pickle)


@contextlib.contextmanager
def without_gc() -> Iterator[None]:
    """No cyclic garbage collection inside: walking a state of many tensors allocates
    tuples, dicts and entries that never form cycles, and the collections they trigger
    (each scanning every tracked object of the process, the training's included) took
    half of the planning time (20,000 tensors: 430 ms, 225 ms without). It is enabled
    again on exit, unless it was off before (the user's choice); a collection pending
    runs at the next allocation after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _plan(state: Any, allow_pickle: bool) -> StatePlan:
    planner = _Planner(allow_pickle=allow_pickle)
    tree = planner.encode(state, (), 0)
    # Data starts at a file offset that is a multiple of 64 (the header is padded so),
    # and so does every tensor whose byte length is a multiple of 64: those come first,
    # in tree order. The kernel copies between the page cache and a tensor's memory
    # (64-byte aligned) at full speed only when both sides share their offset within a
    # cache line: measured on this project's VMs, 11 GB/s aligned, 8 GB/s at an 8-byte
    # skew, 2.7 GB/s at some skews. The other tensors follow, largest item size first,
    # which keeps each aligned to its item size (safetensors' rule): every byte length
    # before them is a multiple of 64, and of the item sizes that follow.
    # Planned entries begin at 0, so their end is their size.
    first = [e for e in planner.entries if e.end % _FILE_ALIGN == 0]
    rest = [e for e in planner.entries if e.end % _FILE_ALIGN]
    ordered = first + sorted(rest, key=lambda e: -_DTYPES[e.code][0])
    header_doc: dict[str, Any] = {
        "__metadata__": {
            "format": "pt" if planner.has_torch else "np",
            VERSION_METADATA_KEY: str(FORMAT_VERSION),
            TREE_METADATA_KEY: json.dumps(tree, separators=(",", ":"), allow_nan=False),
        }
    }
    entries = []
    offset = 0
    for name, code, shape, _, size, kind, src in ordered:  # planned with begin 0
        end = offset + size
        entries.append(_Entry(name, code, shape, offset, end, kind, src))
        header_doc[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header_doc, separators=(",", ":")).encode("ascii")
    raw += b" " * (-(8 + len(raw)) % _FILE_ALIGN)  # data starts 64-aligned (see above)
    if len(raw) > MAX_HEADER_BYTES:
        raise SerializationError(
            f"the state's structure needs a {len(raw)}-byte header, above the "
            f"{MAX_HEADER_BYTES}-byte safetensors limit; store large non-tensor data "
            "(e.g. long lists of numbers) as tensors or arrays"
        )
    return StatePlan(struct.pack("<Q", len(raw)) + raw, tuple(entries))


# -- loading ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CheckpointHeader:
    """The validated header of a state file, as :func:`read_header` returns it.

    Attributes:
        tensors: entry name -> (safetensors dtype code such as ``"BF16"``, shape), in
            file order. Pickle blobs are ``U8`` entries referenced by ``pickle`` nodes.
        tree: the state's structure in the tagged JSON form described in this module's
            docstring, or None for a safetensors file written by another tool.
        metadata: the other ``__metadata__`` entries (str -> str).
        header_size_bytes: the length prefix plus the JSON header.
        data_size_bytes: bytes of tensor data after the header.
    """

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    tree: Any
    metadata: dict[str, str]
    header_size_bytes: int
    data_size_bytes: int


@dataclass(frozen=True)
class _Header:
    entries: tuple[_Entry, ...]  # file order; source unused
    metadata: dict[str, str]
    tree: Any  # _MISSING for a file without our tree
    data_start: int
    raw: bytes = b""  # the length prefix and header exactly as read (for digests)


def _strict_json(text: str, what: str) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{what} is not valid JSON: {exc}") from exc


def _read_upto(f: Any, n: int) -> bytes:
    parts = []
    while n > 0:
        got = f.read(n)
        if not got:
            break
        parts.append(got)
        n -= len(got)
    return b"".join(parts)


def _file_size(f: Any) -> int | None:
    try:
        return int(os.fstat(f.fileno()).st_size)
    except (AttributeError, OSError, ValueError):
        pass
    try:
        size = int(f.seek(0, 2))
    except (AttributeError, OSError, ValueError):
        return None
    return size


def _parse_header(f: Any, size_bytes: int | None) -> _Header:
    size = _file_size(f) if size_bytes is None else size_bytes
    f.seek(0)
    prefix = _read_upto(f, 8)
    if len(prefix) < 8:
        raise CorruptCheckpointError(
            f"truncated: the file has {len(prefix)} bytes, fewer than the 8-byte header length"
        )
    (n,) = struct.unpack("<Q", prefix)
    if n < 2 or n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"header length {n} is outside 2..{MAX_HEADER_BYTES}: not a safetensors file, "
            "or its first 8 bytes are corrupt"
        )
    if size is not None and 8 + n > size:
        raise CorruptCheckpointError(
            f"header length {n} runs past the end of the {size}-byte file: truncated or corrupt"
        )
    raw = _read_upto(f, n)
    if len(raw) < n:
        raise CorruptCheckpointError(
            f"truncated: the header should be {n} bytes, the file ends after {len(raw)}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"header is not UTF-8: {exc}") from exc
    doc = _strict_json(text, "header")
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"header is a JSON {type(doc).__name__}, not an object")
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError("header __metadata__ is not a map of str to str")
    entries = []
    for name, info in doc.items():
        entries.append(_parse_entry(name, info))
    entries.sort(key=lambda e: (e.begin, e.end))
    position = 0
    previous = None
    for e in entries:
        if e.begin < position:
            raise CorruptCheckpointError(
                f"tensor {e.name!r} data_offsets [{e.begin}, {e.end}] overlap tensor "
                f"{previous!r}, which ends at {position}"
            )
        if e.begin > position:
            raise CorruptCheckpointError(
                f"tensor {e.name!r} starts at {e.begin}, leaving a gap after byte {position}: "
                "safetensors data must be contiguous"
            )
        position = e.end
        previous = e.name
    data_start = 8 + n
    if size is not None and data_start + position != size:
        held = size - data_start
        if held < position:
            raise CorruptCheckpointError(
                f"truncated: the header lists {position} bytes of tensor data, "
                f"the file holds {held}"
            )
        raise CorruptCheckpointError(
            f"{held - position} unexpected bytes after the tensor data (file of {size} bytes)"
        )
    version = meta.get(VERSION_METADATA_KEY)
    if version is not None:
        # ASCII digits only: "²".isdigit() is True, and int() refuses it.
        if not (version.isascii() and version.isdigit() and len(version) < 19):
            raise CorruptCheckpointError(f"format version {version!r} is not an integer")
        if int(version) > FORMAT_VERSION:
            raise UnsupportedSchemaError(
                f"the state file has format version {version}, this atomic-checkpoint reads "
                f"up to {FORMAT_VERSION}; upgrade atomic-checkpoint to load it"
            )
    tree_json = meta.pop(TREE_METADATA_KEY, None)
    # _MISSING: no tree (another tool's safetensors file); a saved None is the tree null.
    tree = _MISSING if tree_json is None else _strict_json(tree_json, "the state tree")
    return _Header(tuple(entries), meta, tree, data_start, prefix + raw)


def _brief(value: Any) -> str:
    """A header value for an error message, at most 80 characters: a hostile one can
    hold ints of thousands of digits (which Python refuses to print past 4300)."""
    if isinstance(value, list):
        return "[" + ", ".join(_brief(v) for v in value[:4]) + (", ...]" if len(value) > 4 else "]")
    if type(value) is int and abs(value) >= 1 << 64:
        return f"<{value.bit_length()}-bit int>"
    return f"{value!r:.80}"


def _parse_entry(name: str, info: Any) -> _Entry:
    where = f"tensor {name!r:.80}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CorruptCheckpointError(
            f"{where}: entry must be an object with exactly dtype, shape and data_offsets"
        )
    code = info["dtype"]
    if not isinstance(code, str) or code not in _DTYPES:
        raise CorruptCheckpointError(f"{where}: unknown dtype {_brief(code)}")
    shape = info["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise CorruptCheckpointError(f"{where}: shape must be a list of at most {MAX_RANK} sizes")
    if not all(type(d) is int and 0 <= d < _JSON_INT_LIMIT for d in shape):
        raise CorruptCheckpointError(
            f"{where}: shape {_brief(shape)} must hold non-negative ints below 2**63"
        )
    # torch and numpy lay a tensor out with int64 strides and byte counts, whatever its
    # element count: the product of the sizes (a 0 counting as 1) times the item size
    # must fit, or torch.empty/numpy.empty fail with RuntimeError/ValueError/TypeError
    # (e.g. [0, 2**63], or [0, 2**40, 2**40]), after the header passed as valid.
    if math.prod(max(d, 1) for d in shape) * _DTYPES[code][0] >= _JSON_INT_LIMIT:
        raise CorruptCheckpointError(
            f"{where}: shape {_brief(shape)} of {code} is too large for any tensor (its byte "
            "strides overflow 64 bits)"
        )
    offsets = info["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and 0 <= o < _JSON_INT_LIMIT for o in offsets)
        or not offsets[0] <= offsets[1]
    ):
        raise CorruptCheckpointError(
            f"{where}: data_offsets {_brief(offsets)} must be [begin, end] with "
            "0 <= begin <= end < 2**63"
        )
    begin, end = offsets
    expected = math.prod(shape) * _DTYPES[code][0]
    if expected != end - begin:
        raise CorruptCheckpointError(
            f"{where}: shape {shape} of {code} needs {expected} bytes but data_offsets "
            f"[{begin}, {end}] span {end - begin}"
        )
    return _Entry(name, code, tuple(shape), begin, end, "", None)


class _Loader:
    """Decodes a tree and reads its entries.

    The tree is walked twice: ``collect`` validates every node, matches tensor leaves
    with ``into`` and records where each entry's bytes go, so the data can then be read
    in one sequential pass in file order; ``build`` constructs the state.
    """

    def __init__(self, header: _Header, *, allow_pickle: bool, device: Any, for_load: bool):
        self.entries = {e.name: e for e in header.entries}
        self.allow_pickle = allow_pickle
        self.device = device
        self.for_load = for_load  # False: only validate (read_header), import nothing
        self.building = False
        self.kinds: dict[str, tuple[str, bool]] = {}  # name -> (leaf tag, big-endian)
        self.targets: dict[str, list[Any]] = {}  # name -> into tensors, in walk order
        self.target_paths: list[tuple[str, _Path, Any]] = []  # (name, path, target)
        # into= targets that share memory with another entry's: read into memory of
        # their own, then copied in and checked (``check_aliases``, ``settle_aliases``).
        self.aliased: list[tuple[str, _Path, Any]] = []
        self.partners: dict[int, list[_Path]] = {}  # id(target) -> paths it overlaps
        self.leaf_targets: list[Any] = []  # per tensor leaf, in walk order
        self.leaf_index = 0
        self.values: dict[str, Any] = {}  # name -> loaded object
        self.torch: Any = None
        self.np: Any = None
        self.every_byte = False  # read entries the tree does not use too (for a digest)
        self.views: dict[str, memoryview] = {}  # name -> byte view of its into= target
        self.staged = False  # some bytes go to device memory, through device_staging

    # Treat CPU tensors as device memory: runs the staged path (read_positional) on
    # machines without a GPU, for its tests.
    stage_host = False

    def collect(self, node: Any, into: Any) -> None:
        self.building = False
        self.walk_node(node, into, (), 0)
        self.check_aliases()

    def check_aliases(self) -> None:
        """Find the into= targets whose memory overlaps another entry's target (one
        tensor passed at two paths where the checkpoint holds two tensors, a view of
        another target, columns of one matrix). Read straight in, the later entry's
        bytes silently overwrote the earlier's; these are read into memory of their
        own instead, and ``settle_aliases`` copies them in and checks the result."""
        spans = []
        for i, (_, _, target) in enumerate(self.target_paths):
            extent = _extent(target)
            if extent is not None:
                spans.append((extent, i))
        spans.sort()
        partners: dict[int, set[int]] = {}
        active: list[tuple[tuple[str, int, int], int]] = []
        for extent, i in spans:
            active = [(e, j) for e, j in active if e[0] == extent[0] and e[2] > extent[1]]
            name, _, target = self.target_paths[i]
            for _, j in active:
                other_name, _, other = self.target_paths[j]
                if other_name == name and _same_memory(other, target):
                    continue  # one entry into one tensor twice (tied weights): fine
                partners.setdefault(i, set()).add(j)
                partners.setdefault(j, set()).add(i)
            active.append((extent, i))
        if not partners:
            return
        self.aliased = [self.target_paths[i] for i in sorted(partners)]
        self.partners = {
            id(self.target_paths[i][2]): [self.target_paths[j][1] for j in sorted(js)]
            for i, js in partners.items()
        }
        for name, _, target in self.aliased:
            kept = [t for t in self.targets[name] if t is not target]
            if kept:
                self.targets[name] = kept
            else:
                del self.targets[name]

    def settle_aliases(self) -> None:
        """Copy the entries of aliased targets in (in walk order), then check that each
        target holds its entry's values: true only if the checkpoint's values agree
        where the targets share memory (it was saved from the same layout)."""
        for name, _, target in self.aliased:
            self.assign(target, self.values[name])
        for name, path, target in self.aliased:
            if not _bitwise_equal(target, self.values[name]):
                others = [_format_path(p) for p in self.partners.get(id(target), [])]
                raise StateMismatchError(
                    f"{_format_path(path)}: into= has a tensor there that shares memory "
                    f"with another target ({', '.join(others[:3])}), but the checkpoint "
                    "holds different values for them, so one would overwrite the other: "
                    "pass tensors with memory of their own (untie them, as they were "
                    "when saved), or load without into=. Only this could not be checked "
                    "before reading: every other target of into= holds the checkpoint's "
                    "values now, and these ones a mix of both"
                )

    def build(self, node: Any, into: Any) -> Any:
        self.building = True
        self.leaf_index = 0
        return self.walk_node(node, into, (), 0)

    # -- nodes -------------------------------------------------------------------------

    def corrupt(self, path: _Path, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"state tree at {_format_path(path)}: {message}")

    def walk_node(self, node: Any, into: Any, path: _Path, depth: int) -> Any:
        t = type(node)
        if self.for_load and not self.building and into is not _MISSING:
            self.check_into(node, into, path)
        if node is None or t is bool or t is str or t is int:
            return node
        if t is list:
            self.check_depth(path, depth)
            return self.sequence(node, into, path, depth, list)
        if t is not dict or not node:
            raise self.corrupt(path, f"unexpected JSON {t.__name__} {node!r:.60}")
        tag = next(iter(node))
        if tag in ("tuple", "dict", "odict"):
            self.check_depth(path, depth)
        allowed = {"ndarray": {"ndarray", "byteorder"}, "odict": {"odict", "attrs"}}
        if not set(node) <= allowed.get(tag, {tag}):
            raise self.corrupt(path, f"unexpected fields {sorted(node)} in a {tag!r} node")
        value = node[tag]
        if tag == "tuple":
            return self.sequence(self.expect(value, list, path, tag), into, path, depth, tuple)
        if tag in ("dict", "odict"):
            return self.mapping(node, tag, into, path, depth)
        if tag in ("tensor", "ndarray", "npscalar", "pickle"):
            return self.leaf(node, tag, into, path)
        return self.scalar(tag, value, path)

    def check_depth(self, path: _Path, depth: int) -> None:
        """Containers nest at most ``MAX_DEPTH`` levels (the recursion's bound), as at
        save; a leaf (a tensor, a float) may sit under the deepest one: a tensor 199
        dicts deep was saved, then refused by every restore."""
        if depth >= MAX_DEPTH:
            raise self.corrupt(path, f"nests deeper than {MAX_DEPTH} levels")

    def expect(self, value: Any, t: type, path: _Path, tag: str) -> Any:
        if type(value) is not t:
            raise self.corrupt(path, f"a {tag!r} node needs a JSON {t.__name__}, got {value!r:.60}")
        return value

    def scalar(self, tag: str, value: Any, path: _Path) -> Any:
        try:
            if tag == "int":
                return int(self.expect(value, str, path, tag), 16)
            if tag == "float":
                return float.fromhex(self.expect(value, str, path, tag))
            if tag in ("bytes", "bytearray"):
                data = base64.b64decode(self.expect(value, str, path, tag), validate=True)
                return data if tag == "bytes" else bytearray(data)
        except (ValueError, OverflowError) as exc:  # binascii.Error is a ValueError;
            # float.fromhex("0x1p99999") overflows
            raise self.corrupt(path, f"bad {tag!r} value {value!r:.60}: {exc}") from exc
        if tag == "size":
            dims = self.expect(value, list, path, tag)
            if len(dims) > MAX_RANK or not all(
                type(d) is int and -_JSON_INT_LIMIT <= d < _JSON_INT_LIMIT for d in dims
            ):
                raise self.corrupt(
                    path, f"torch.Size {_brief(dims)} must hold at most {MAX_RANK} int64s"
                )
            return self.torch_value(lambda torch: torch.Size(dims))
        if tag == "dtype":
            name = self.expect(value, str, path, tag)

            def to_dtype(torch: Any) -> Any:
                # Looked up among torch's dtypes only: getattr(torch, name) with a name
                # from the file imported the submodules it named (torch._dynamo, ...).
                dtype = _torch_dtypes(torch).get(name)
                if dtype is None:
                    raise self.corrupt(path, f"{_shown(name)} is not a torch dtype")
                return dtype

            return self.torch_value(to_dtype)
        if tag == "device":
            spec = self.expect(value, str, path, tag)

            def to_device(torch: Any) -> Any:
                try:
                    return torch.device(spec)
                except (RuntimeError, ValueError) as exc:
                    raise self.corrupt(path, f"bad torch device {spec!r:.60}") from exc

            return self.torch_value(to_device)
        raise self.corrupt(path, f"unknown node tag {tag!r:.60}")

    def torch_value(self, make: Any) -> Any:
        # Validation alone (read_header) must work without torch; only a load that
        # builds a torch object needs it.
        if not self.for_load:
            return None
        if self.torch is None:
            self.torch = _import_torch()
        return make(self.torch)

    def sequence(self, items: list[Any], into: Any, path: _Path, depth: int, t: type) -> Any:
        has_into = isinstance(into, (list, tuple))
        if has_into and not self.building and len(into) > len(items):
            extra = [(True, i) for i in range(len(items), len(into))]
            self.check_unloaded(into, extra, path)
        out = []
        for i, item in enumerate(items):
            sub = into[i] if has_into and i < len(into) else _MISSING
            out.append(self.walk_node(item, sub, (*path, (True, i)), depth + 1))
        return t(out) if self.building else None

    def pairs(self, value: Any, path: _Path, tag: str) -> list[Any]:
        self.expect(value, list, path, tag)
        for pair in value:
            if type(pair) is not list or len(pair) != 2:
                raise self.corrupt(path, f"{tag!r} items must be [key, value] pairs")
        return value

    def mapping(self, node: dict[str, Any], tag: str, into: Any, path: _Path, depth: int) -> Any:
        out: dict[Any, Any] = {} if tag == "dict" else collections.OrderedDict()
        has_into = isinstance(into, Mapping)
        for raw_key, raw_value in self.pairs(node[tag], path, tag):
            key = self.key(raw_key, path, depth + 1)
            try:
                sub = into.get(key, _MISSING) if has_into else _MISSING
                duplicate = key in out
            except TypeError as exc:
                raise self.corrupt(path, f"dict key {_shown(key)} is not hashable") from exc
            if duplicate:
                raise self.corrupt(path, f"dict key {_shown(key)} appears twice")
            out[key] = self.walk_node(raw_value, sub, (*path, (False, key)), depth + 1)
        if has_into and not self.building:
            try:
                missing = [(False, k) for k in into if k not in out]
            except TypeError:  # an unhashable key in into=: it matches nothing
                missing = []
            self.check_unloaded(into, missing, path)
        if "attrs" in node:
            for name, raw_value in self.pairs(node["attrs"], path, "attrs"):
                if not _is_safe_attr(name):
                    raise self.corrupt(path, f"OrderedDict attribute {name!r:.60} is not allowed")
                sub = getattr(into, name, _MISSING) if has_into else _MISSING
                value = self.walk_node(raw_value, sub, (*path, (False, name)), depth + 1)
                if self.building:
                    setattr(out, name, value)
        return out if self.building else None

    # -- into= checks (the collect pass of a load; nothing is read yet) --------------------

    def check_into(self, node: Any, into: Any, path: _Path) -> None:
        """An array in ``into`` where the checkpoint holds no array: it would be left as
        it is, not loaded (a state dict filled in place would keep stale values); nor a
        container of arrays where the checkpoint holds another kind of container (a
        dict where it holds a list): none of them would be loaded."""
        tag = next(iter(node)) if type(node) is dict and node else None
        if _is_array(into):
            if tag in ("tensor", "ndarray"):
                return
            what = _array_kind(into)
        elif isinstance(into, Mapping) or type(into) in (list, tuple):
            if tag in ("dict", "odict") if isinstance(into, Mapping) else tag == "tuple":
                return
            if type(node) is list and not isinstance(into, Mapping):
                return
            if not _holds_array(into, 0):
                return
            what = f"a {type(into).__name__} of tensors or arrays"
        else:
            _check_fillable(into, path)
            return
        kind = _node_kind(node, tag)
        holds = "None" if node is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
        raise StateMismatchError(
            f"{_format_path(path)}: into= has {what} there, but the checkpoint holds "
            f"{holds}: {'it' if _is_array(into) else 'they'} would not be loaded. Pass "
            "into= with the structure of the saved state (or restore() without into= and "
            "pick what you need)"
        )

    def check_unloaded(self, into: Any, extra: list[tuple[bool, Any]], path: _Path) -> None:
        """Entries of ``into`` (``extra``: their path steps) that the checkpoint lacks
        and that hold an array: they would not be loaded, and a caller filling a state
        dict in place would not know (``torch``'s ``load_state_dict`` calls these missing
        keys)."""
        unloaded = [_format_path((*path, step)) for step in extra if _holds_array(into[step[1]], 0)]
        if unloaded:
            more = len(unloaded) - 5
            shown = ", ".join(unloaded[:5]) + (f" and {more} more" if more > 0 else "")
            raise StateMismatchError(
                f"into= holds {shown}, which the checkpoint lacks: "
                f"{'it' if len(unloaded) == 1 else 'they'} would not be loaded. Was the "
                "checkpoint saved from another model or state layout? Pass into= only what "
                "the checkpoint holds, or restore() without into="
            )

    def key(self, raw: Any, path: _Path, depth: int) -> Any:
        t = type(raw)
        if raw is None or t in (bool, str, int):
            return raw
        if t is dict and len(raw) == 1:
            tag, value = next(iter(raw.items()))
            if tag == "tuple":
                if depth >= MAX_DEPTH:
                    raise self.corrupt(path, f"a dict key nests deeper than {MAX_DEPTH} levels")
                items = self.expect(value, list, path, tag)
                return tuple([self.key(k, path, depth + 1) for k in items])
            if tag in ("int", "float", "bytes"):
                return self.scalar(tag, value, path)
            if tag == "pickle":
                if self.building:
                    return self.leaf(raw, tag, _MISSING, path)
                # Validate now; a unique placeholder keeps distinct pickled keys apart.
                self.leaf(raw, tag, _MISSING, path)
                return object()
        raise self.corrupt(path, f"unsupported dict key {raw!r:.60}")

    # -- leaves ------------------------------------------------------------------------

    def leaf(self, node: dict[str, Any], tag: str, into: Any, path: _Path) -> Any:
        name = node[tag]
        entry = self.entries.get(name) if type(name) is str else None
        if entry is None:
            raise self.corrupt(path, f"refers to entry {name!r:.80}, which the header lacks")
        if self.building:
            return self.built_leaf(tag, name, into)
        big = node.get("byteorder") == ">"
        if node.get("byteorder", ">") != ">":
            raise self.corrupt(path, f"unknown byteorder {node['byteorder']!r:.20}")
        if self.kinds.setdefault(name, (tag, big)) != (tag, big):
            raise self.corrupt(path, f"entry {name!r} is referenced as two different kinds")
        if tag == "pickle":
            if entry.code != "U8" or len(entry.shape) != 1:
                raise self.corrupt(path, f"pickle entry {name!r} must be 1-D U8")
            if self.for_load and not self.allow_pickle:
                raise UnsafeCheckpointError(
                    f"{_format_path(path)} is a pickled object (entry {name!r}); unpickling "
                    "can run arbitrary code from the file, so it is refused. Create the "
                    "manager with CheckpointManager(..., allow_pickle=True) only if you "
                    "trust where this checkpoint came from"
                )
            return None
        if tag != "tensor" and _DTYPES[entry.code][2] is None:
            raise self.corrupt(path, f"entry {name!r} of {entry.code} cannot be a numpy array")
        if tag == "npscalar" and entry.shape:
            raise self.corrupt(path, f"numpy scalar entry {name!r} must have shape []")
        target = None
        if self.for_load:
            if tag == "tensor" and self.torch is None:
                self.torch = _import_torch()
            if tag != "tensor" and self.np is None:
                self.np = _import_numpy()
            if tag != "npscalar" and into is not _MISSING:
                target = self.match(tag, entry, big, into, path)
            if target is not None:
                self.targets.setdefault(name, []).append(target)
                self.target_paths.append((name, path, target))
        self.leaf_targets.append(target)
        return None

    def built_leaf(self, tag: str, name: str, into: Any) -> Any:
        if tag == "pickle":
            try:
                return pickle.loads(self.values[name])
            except Exception as exc:
                raise CorruptCheckpointError(
                    f"unpickling entry {name!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
        target = self.leaf_targets[self.leaf_index]
        self.leaf_index += 1
        return self.values[name] if target is None else target

    def match(self, tag: str, entry: _Entry, big: bool, into: Any, path: _Path) -> Any:
        """The ``into`` array to fill for this leaf, None to allocate, or raise."""
        torch = sys.modules.get("torch")
        np = sys.modules.get("numpy")
        is_tensor = torch is not None and isinstance(into, torch.Tensor)
        is_array = np is not None and isinstance(into, np.ndarray)
        if not is_tensor and not is_array:
            return None
        if is_array and not into.flags.writeable and tag == "ndarray":
            # Left alone, the caller's array kept its old values while the returned
            # state held the new ones: a caller who relies on in-place filling (the
            # point of into=) would go on with stale data.
            raise StateMismatchError(
                f"{_format_path(path)}: into= has a read-only numpy array there "
                "(flags.writeable is False, e.g. one over bytes or a memory map opened "
                "read-only), which cannot be filled in place; pass a writable array "
                "(np.array(a) copies it), or load without into="
            )
        want = (
            f"{entry.code} {'tensor' if tag == 'tensor' else 'numpy array'} of shape {entry.shape}"
        )
        if is_tensor:
            problem = _torch_problem(torch, into)
            if into.is_meta:
                problem = "a meta tensor has no memory to load into (materialize the model first)"
            elif problem is None and _overlaps_itself(into):
                problem = (
                    "its elements share memory (an expand()ed or as_strided view), so it "
                    "cannot hold distinct values"
                )
            if tag == "tensor" and problem is not None:
                raise StateMismatchError(
                    f"{_format_path(path)}: into= has a tensor that cannot be filled: "
                    f"{problem}; pass a tensor with memory of its own there (e.g. "
                    "torch.empty(...) on the device you want), or load without into="
                )
            ok = (
                tag == "tensor"
                and into.dtype == _torch_dtype(torch, entry.code)
                and tuple(into.shape) == entry.shape
            )
            have = f"a tensor of {into.dtype} and shape {tuple(into.shape)}"
        else:
            if tag == "ndarray" and _overlaps_itself(into):
                raise StateMismatchError(
                    f"{_format_path(path)}: into= has a numpy array whose elements share "
                    "memory (an as_strided view), so it cannot hold distinct values; "
                    "pass an array with memory of its own there, or load without into="
                )
            ok = (
                tag == "ndarray"
                and _numpy_code(into.dtype) == entry.code
                and is_big_endian(into.dtype) == big
                and tuple(into.shape) == entry.shape
            )
            have = f"a numpy array of {into.dtype} and shape {tuple(into.shape)}"
        if not ok:
            raise StateMismatchError(
                f"{_format_path(path)}: the checkpoint holds a {want} but into= has {have}; "
                "load into a state of the same structure (same model and optimizer "
                "configuration), or load without into="
            )
        return into

    # -- data --------------------------------------------------------------------------

    def allocate(self, tag: str, entry: _Entry, big: bool) -> Any:
        if tag == "tensor":
            torch = self.torch
            device = self.device if self.device is not None else "cpu"
            return torch.empty(entry.shape, dtype=_torch_dtype(torch, entry.code), device=device)
        dtype = self.np.dtype(_DTYPES[entry.code][2])
        if big:
            dtype = dtype.newbyteorder(">")
        return self.np.empty(entry.shape, dtype=dtype)

    def direct_view(self, dest: Any) -> memoryview | None:
        """A writable byte view of ``dest``'s memory, if bytes can be read straight in."""
        torch = self.torch
        if torch is not None and isinstance(dest, torch.Tensor):
            if dest.device.type != "cpu" or not _plain(dest):
                return None
            return memoryview(_flat_bytes(torch, dest).numpy())
        if dest.flags.c_contiguous and not is_big_endian(dest.dtype):
            return memoryview(dest.reshape(-1).view(self.np.uint8))
        return None

    def store(self, entry: _Entry, fill: Any) -> None:
        """Put the entry's bytes, produced by ``fill(view)``, where they belong."""
        if entry.name not in self.kinds:  # not referenced by the tree: skip its bytes
            # ... unless a digest needs every byte of the file.
            fill(memoryview(bytearray(entry.size_bytes)) if self.every_byte else None)
            return
        tag, big = self.kinds[entry.name]
        if tag == "pickle":
            buf = bytearray(entry.size_bytes)
            fill(memoryview(buf))
            self.values[entry.name] = buf
            return
        targets = self.targets.get(entry.name, [])
        dest = targets[0] if targets else self.allocate(tag, entry, big)
        if entry.size_bytes:
            view = self.direct_view(dest)
            if view is not None:
                fill(view)
            else:
                # GPU, non-contiguous or big-endian destinations: read into a host
                # temporary of this one tensor, then let torch/numpy copy it over.
                tmp = self.allocate(tag, entry, False) if tag != "tensor" else None
                if tmp is None:
                    tmp = self.torch.empty(entry.shape, dtype=dest.dtype)
                fill(self.direct_view(tmp))
                self.assign(dest, tmp)
        for other in targets[1:]:
            if not _same_memory(other, dest):
                self.assign(other, dest)
        self.values[entry.name] = dest[()] if tag == "npscalar" else dest

    def assign(self, dest: Any, src: Any) -> None:
        torch = self.torch
        if torch is not None and isinstance(dest, torch.Tensor):
            with torch.no_grad():
                dest.copy_(src)
        else:
            dest[...] = src

    def on_device(self, dest: Any) -> bool:
        """Whether ``dest`` is device memory that staged reads can fill: a contiguous
        torch tensor off the CPU (``stage_host``: on it too)."""
        torch = self.torch
        return (
            torch is not None
            and isinstance(dest, torch.Tensor)
            and (dest.device.type != "cpu" or self.stage_host)
            and _plain(dest)
        )

    def can_read_positionally(self) -> bool:
        """Whether every entry's bytes can be read with positioned reads: no big-endian
        array, every ``into`` target contiguous memory. Targets in device memory (and
        tensors placed there with ``device=``) set ``staged``: their bytes go through
        page-locked host buffers (:meth:`read_positional`)."""
        torch = self.torch
        placed = torch is not None and self.device is not None
        if placed and (torch.device(self.device).type != "cpu" or self.stage_host):
            self.staged = True
        for name, (tag, big) in self.kinds.items():
            if big:
                return False
            targets = self.targets.get(name)
            if tag != "pickle" and targets:
                if self.on_device(targets[0]):
                    self.staged = True
                    continue
                view = self.direct_view(targets[0])
                if view is None:
                    return False
                self.views[name] = view
        if self.stage_host and any(t == "tensor" for t, _ in self.kinds.values()):
            self.staged = True
        return True

    def destination(
        self, entry: _Entry, after: list[Callable[[], None]]
    ) -> memoryview | _OnDevice | None:
        """Where ``entry``'s bytes go (allocating its tensor), or None if nowhere: host
        memory, or (when ``staged``) device memory. What must wait until the bytes are
        in (aliases, numpy scalars) is added to ``after``."""
        if entry.name not in self.kinds:
            return None
        tag, big = self.kinds[entry.name]
        if tag == "pickle":
            buf = bytearray(entry.size_bytes)
            self.values[entry.name] = buf
            return memoryview(buf)
        targets = self.targets.get(entry.name, [])
        dest = targets[0] if targets else self.allocate(tag, entry, big)
        for other in targets[1:]:
            if not _same_memory(other, dest):
                after.append(functools.partial(self.assign, other, dest))
        if tag == "npscalar":
            after.append(functools.partial(self.set_scalar, entry.name, dest))
        else:
            self.values[entry.name] = dest
        if not entry.size_bytes:
            return None
        view = self.views.get(entry.name)
        if view is not None:
            return view
        if self.staged and self.on_device(dest):
            return _OnDevice(_flat_bytes(self.torch, dest))
        return self.direct_view(dest)

    def set_scalar(self, name: str, array: Any) -> None:
        self.values[name] = array[()]  # a numpy scalar: a copy, taken once the bytes are in

    def read_positional(
        self, fd: int, header: _Header, digest: Any, threads: int, direct: bool
    ) -> None:
        """Read every entry with positioned reads, ``threads`` at a time, straight into
        its final memory; feed ``digest`` (if any) the whole file in order.

        Where some bytes go to device memory (``staged``), the file is read in batches:
        each batch's device-bound bytes are read into one slot of a
        :class:`~.device_staging.DeviceStaging` ring, then copied to the device
        asynchronously from there while the next batch is read into the other slot. A
        tensor larger than what is left of a slot is split across batches. Host-bound
        entries are read straight into their memory, in the batch they fall in, so the
        digest still sees the file in order. With nothing staged there is one batch.
        """
        with contextlib.ExitStack() as stack:
            ring = None
            if self.staged:
                pin = bool(self.torch.cuda.is_available())
                ring = stack.enter_context(device_staging.borrowed(self.torch, pin))
            batches, after = self.read_batches(header, ring)
            if digest is not None:
                digest.update(header.raw)
            total = sum(_piece_bytes(b.pieces, digest) for b in batches)
            reads = _direct_reads(fd, total, direct)
            if reads is not None:
                stack.callback(reads.close)
            for b in batches:
                if ring is not None:
                    ring.wait(b.slot)  # its previous copies have left it
                _read_pieces(fd, b.pieces, digest=digest, threads=threads, reads=reads)
                if ring is not None:
                    _copy_out(ring, b)
        # After every queued copy is done (the ring is handed back above).
        for action in after:
            action()

    def read_batches(
        self, header: _Header, ring: device_staging.DeviceStaging | None
    ) -> tuple[list[_Batch], list[Callable[[], None]]]:
        """The reads and copies of ``read_positional``, in file order, one batch per
        slot fill of ``ring`` (one batch without a ring: nothing goes to a device); and
        what must wait until every byte is in."""
        after: list[Callable[[], None]] = []
        # Copies out of the scratch buffers of small entries: they run before ``after``,
        # whose scalars and aliases read the memory these copies fill.
        copies: list[Callable[[], None]] = []
        size = _SMALL_BATCH_BYTES if ring is None else ring.slot_bytes
        if size < _SMALL_ENTRY_BYTES:  # a small entry is never split
            raise ValueError(f"staging slots of {size} bytes: at least {_SMALL_ENTRY_BYTES}")
        batches: list[_Batch] = [_Batch(0)]
        used = 0
        base = header.data_start
        entries = header.entries

        def room(n: int) -> _Batch:
            """The batch with ``n`` bytes of slot left (a new one if need be)."""
            nonlocal used
            if used + n > size:
                assert ring is not None  # only device-bound bytes take room
                batches.append(_Batch(len(batches) % len(ring.slots)))
                used = 0
            return batches[-1]

        i = 0
        while i < len(entries):
            entry = entries[i]
            start = base + entry.begin
            if entry.size_bytes >= _SMALL_ENTRY_BYTES:
                dest = self.destination(entry, after)
                if not isinstance(dest, _OnDevice):
                    batches[-1].pieces.append((start, entry.size_bytes, dest, entry.name))
                    i += 1
                    continue
                assert ring is not None  # only staged loads have device destinations
                done = 0
                while done < entry.size_bytes:
                    b = room(1)
                    n = min(entry.size_bytes - done, size - used)
                    view = ring.views[b.slot][used : used + n]
                    b.pieces.append((start + done, n, view, entry.name))
                    b.device.append((dest.data[done : done + n], used, n))
                    used += n
                    done += n
                i += 1
                continue
            # A run of small entries: one read into a slot (device-bound ones among
            # them) or a scratch buffer, then copies.
            j, total = _small_run(entries, i, limit=size)
            dests = [(e, self.destination(e, after)) for e in entries[i:j]]
            if ring is not None and any(isinstance(d, _OnDevice) for _, d in dests):
                b = room(total)
                b.pieces.append((start, total, ring.views[b.slot][used : used + total], entry.name))
                for e, d in dests:
                    off = used + e.begin - entry.begin
                    if isinstance(d, _OnDevice):
                        b.device.append((d.data, off, e.size_bytes))
                    elif d is not None:
                        b.host.append((d, off, e.size_bytes))
                used += total
            else:
                scratch = memoryview(bytearray(total))
                for e, d in dests:
                    if isinstance(d, memoryview):
                        chunk = scratch[e.begin - entry.begin : e.end - entry.begin]
                        copies.append(functools.partial(_copy_into, d, chunk))
                batches[-1].pieces.append((start, total, scratch, entry.name))
            i = j
        return batches, copies + after

    def read_data(self, f: Any, header: _Header) -> None:
        entries = header.entries
        position = header.data_start
        f.seek(position)
        i = 0
        while i < len(entries):
            entry = entries[i]
            if entry.size_bytes >= _SMALL_ENTRY_BYTES:
                if entry.name not in self.kinds and not self.every_byte:
                    i += 1
                    continue
                start = header.data_start + entry.begin
                if position != start:
                    f.seek(start)
                self.store(entry, lambda view, e=entry: _readinto_exact(f, view, e, header))
                position = header.data_start + entry.end
                i += 1
                continue
            # A run of small entries: one read into a scratch buffer, then copies.
            j, total = _small_run(entries, i)
            start = header.data_start + entry.begin
            if position != start:
                f.seek(start)
            scratch = memoryview(bytearray(total))
            _readinto_exact(f, scratch, entry, header)
            position = start + total
            for e in entries[i:j]:
                chunk = scratch[e.begin - entry.begin : e.end - entry.begin]
                self.store(e, lambda view, c=chunk: None if view is None else _copy_into(view, c))
            i = j


class _OnDevice(NamedTuple):
    """A destination in device memory: the tensor's bytes, as a flat uint8 tensor."""

    data: Any


_Piece = tuple[int, int, "memoryview | None", str]  # file offset, size, where to, entry name


@dataclass
class _Batch:
    """One slot fill of a staged read: the pieces to read (some into slot ``slot``),
    then the copies out of that slot: ``(host view, slot offset, size)`` and
    ``(device bytes, slot offset, size)``."""

    slot: int
    pieces: list[_Piece] = field(default_factory=list)
    host: list[tuple[memoryview, int, int]] = field(default_factory=list)
    device: list[tuple[Any, int, int]] = field(default_factory=list)


def _copy_out(ring: device_staging.DeviceStaging, b: _Batch) -> None:
    """Batch ``b``'s bytes, just read into its slot, to where they go: host memory at
    once, device memory queued (``ring.record``: the slot's next fill waits for it)."""
    slot_bytes = ring.views[b.slot]
    for view, off, n in b.host:
        view[:] = slot_bytes[off : off + n]
    slot = ring.slots[b.slot]
    devices = set()
    for dst, off, n in b.device:
        # Asynchronous only from page-locked memory to a CUDA device, where the slot's
        # event tells when the copy has read it; any other copy returns once the slot
        # may be refilled.
        dst.copy_(slot[off : off + n], non_blocking=ring.pinned and dst.device.type == "cuda")
        devices.add(dst.device)
    ring.record(b.slot, devices)


def _small_run(entries: Sequence[Any], i: int, limit: int = _SMALL_BATCH_BYTES) -> tuple[int, int]:
    """The end index and byte count of the run of small entries from ``i``: read with
    one request into a scratch buffer (at most ``_SMALL_BATCH_BYTES``, and ``limit``;
    at least one entry), then copied."""
    j = i
    total = 0
    limit = min(limit, _SMALL_BATCH_BYTES)
    while (
        j < len(entries)
        and entries[j].size_bytes < _SMALL_ENTRY_BYTES
        and (j == i or total + entries[j].size_bytes <= limit)
    ):
        total += entries[j].size_bytes
        j += 1
    return j, total


def _check_fillable(into: Any, path: _Path) -> None:
    """Refuse what ``into=`` cannot fill but a user means to: a module or optimizer
    (anything with ``load_state_dict``), or ``model.state_dict`` not called. Passed
    over, the weights stayed as they were, without a word."""
    if inspect.ismethod(into) and getattr(into, "__name__", "") == "state_dict":
        owner = type(into.__self__).__name__
        raise StateMismatchError(
            f"{_format_path(path)}: into= has the method {owner}.state_dict there, not "
            f"called: pass {owner.lower()}.state_dict() (its tensors are filled in place)"
        )
    if callable(getattr(into, "load_state_dict", None)) and not isinstance(into, type):
        name = type(into).__name__
        raise StateMismatchError(
            f"{_format_path(path)}: into= has a {name} there, which restore() cannot fill "
            f"(nothing would be loaded into it): pass its state_dict() (a module's "
            "tensors are filled in place), or restore() without into= and call "
            f"{name}.load_state_dict() with what it returns"
        )


def _copy_into(view: memoryview, chunk: memoryview) -> None:
    view[:] = chunk


def _positional_fd(f: Any) -> int | None:
    """The descriptor of ``f`` if it is a regular file that positioned reads work on."""
    if not hasattr(os, "preadv"):
        return None
    try:
        fd = f.fileno()
        if type(fd) is not int or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
    except (AttributeError, OSError, ValueError):  # BytesIO, fsspec files
        return None
    return fd


_DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of this
_DIRECT_CHUNK_BYTES = 32 << 20


class _DirectReads:
    """Reads a file that the page cache does not hold with O_DIRECT.

    A buffered read of a file that is not cached goes through the page cache: the
    kernel allocates and fills cache pages, then copies them out, and on a VM that
    tops out far below the device (measured here at 1 GiB: 0.68 s buffered, 0.37 s
    with O_DIRECT, four 32 MiB reads in flight). So a load of a file that is mostly not
    cached (``_cached_fraction``, which reads nothing) reads it with O_DIRECT into a
    page-aligned buffer per reader thread and copies each chunk into place (numpy's
    copy releases the GIL); a cached file is read with buffered reads, a memory copy.
    O_DIRECT reads are coherent with the page cache: the kernel writes dirty cached
    pages back first. Where O_DIRECT is refused (EINVAL) reads fall back to buffered
    ones. (A buffered probe with ``RWF_NOWAIT`` is no way to tell cached ranges: it
    starts readahead of what it misses, which then competes with the direct reads.)
    """

    def __init__(self, fd: int):
        # The same open file, a second description with O_DIRECT (the caller's stays
        # buffered); through /proc, so a name replaced meanwhile does not matter.
        self.fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        self.np = _import_numpy()
        self.enabled = True
        self._local = threading.local()

    def close(self) -> None:
        os.close(self.fd)

    def _staging(self, n: int) -> Any:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n:
            raw = self.np.empty(n + _DIRECT_ALIGN, dtype=self.np.uint8)
            skip = -raw.ctypes.data % _DIRECT_ALIGN
            buf = self._local.buf = raw[skip : skip + n]
        return buf

    def read(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from file ``offset``; the bytes filled (fewer only at the end
        of the file, or where direct reads are refused: the caller reads the rest)."""
        size = view.nbytes
        done = 0
        np = self.np
        while done < size and self.enabled:
            start = offset + done
            lead = start % _DIRECT_ALIGN
            end = -(-(offset + size) // _DIRECT_ALIGN) * _DIRECT_ALIGN
            buf = self._staging(_DIRECT_CHUNK_BYTES + 2 * _DIRECT_ALIGN)[: end - start + lead]
            try:
                got = os.preadv(self.fd, [buf], start - lead)
            except OSError:  # e.g. EINVAL: this filesystem or device refuses O_DIRECT
                self.enabled = False
                break
            n = min(got - lead, size - done)
            if n <= 0:
                break  # the end of the file
            np.copyto(np.frombuffer(view[done : done + n], dtype=np.uint8), buf[lead : lead + n])
            done += n
        return done


def _cached_fraction(fd: int) -> float | None:
    """How much of the file the page cache holds (``mincore`` over a mapping of it,
    which reads nothing), or None where that cannot be told.

    A large file is sampled: ``_MINCORE_WINDOWS`` evenly spaced windows of
    ``_MINCORE_WINDOW_PAGES`` pages. Asking about every page of a 1 GiB file took 18 ms,
    8 % of a warm verified load, to decide only whether more or less than half of it is
    cached."""
    try:
        import ctypes
        import mmap

        size = os.fstat(fd).st_size
        if size == 0:
            return None
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            page = mmap.PAGESIZE
            pages = -(-size // page)
            span = _MINCORE_WINDOWS * _MINCORE_WINDOW_PAGES
            if pages <= 4 * span:
                windows = [(0, pages)]
            else:
                stride = pages // _MINCORE_WINDOWS
                windows = [(i * stride, _MINCORE_WINDOW_PAGES) for i in range(_MINCORE_WINDOWS)]
            vec = (ctypes.c_ubyte * max(n for _, n in windows))()
            seen = resident = 0
            for first, n in windows:
                length = min(n * page, size - first * page)
                if libc.mincore(addr + first * page, length, vec) != 0:
                    return None
                count = -(-length // page)
                resident += count - bytes(vec)[:count].count(0)  # the kernel sets bit 0 only
                seen += count
            return resident / seen
        finally:
            libc.munmap(addr, size)
    except (ImportError, OSError, AttributeError, ValueError):
        return None


_MINCORE_WINDOWS = 64
_MINCORE_WINDOW_PAGES = 64


@functools.cache
def _libc() -> Any:
    """libc through ctypes, with the signatures ``_cached_fraction`` calls."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _pread_chunk(
    fd: int, chunk: tuple[int, int, memoryview | None, str], direct: _DirectReads | None = None
) -> memoryview:
    offset, size, view, name = chunk
    if view is None:  # bytes no one keeps, read for the digest only
        view = memoryview(bytearray(size))
    done = 0 if direct is None else direct.read(view, offset)
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise CorruptCheckpointError(
                f"truncated: the file ends at byte {offset + done}, inside tensor {name!r}"
            )
        done += got
    return view


def _piece_bytes(pieces: list[_Piece], digest: Any) -> int:
    """The bytes that reading ``pieces`` reads (those without a destination only for
    a digest)."""
    return sum(size for _, size, view, _ in pieces if view is not None or digest is not None)


def _direct_reads(fd: int, total: int, direct: bool) -> _DirectReads | None:
    """O_DIRECT reads for a read of ``total`` bytes of ``fd`` if ``direct`` and the
    page cache holds less than half of the file; else None (buffered reads)."""
    if direct and total >= _THREADED_MIN_BYTES and hasattr(os, "O_DIRECT"):
        cached = _cached_fraction(fd)
        if cached is not None and cached < 0.5:
            try:
                return _DirectReads(fd)
            except (OSError, ImportError):  # no O_DIRECT here: buffered reads
                return None
    return None


def _read_pieces(
    fd: int, pieces: list[_Piece], *, digest: Any, threads: int, reads: _DirectReads | None
) -> None:
    """Read ``(file offset, size, destination, entry name)`` pieces with ``os.preadv``.

    Pieces are cut into chunks of ``_READ_CHUNK_BYTES`` that ``threads`` workers (the
    calling thread and helpers) take in file order, so the device always has several
    requests queued (one synchronous read at a time leaves it idle between requests)
    and, for fresh tensors, the page faults of first touching their memory are spread
    over the cores. A worker that has read a chunk feeds ``digest`` the chunks that are
    in, in file order, unless another worker is doing so (see :func:`_read_chunks`): the
    checksum mostly reads bytes from the cache of the core that just wrote them. A piece
    without a destination is read into a throwaway buffer if there is a digest, else
    skipped. ``preadv`` and the digests used here (xxhash, zlib.crc32) release the GIL.
    With ``reads`` (:func:`_direct_reads`), what the page cache does not hold is read
    with O_DIRECT (see :class:`_DirectReads`).
    """
    total = _piece_bytes(pieces, digest)
    # Direct reads go to the device in large requests, ``threads`` of them in flight;
    # buffered ones copy from the cache in chunks that fit a core's L2 cache, where the
    # same worker then mostly hashes them (see _read_chunks), one worker per core (more only
    # contend for memory bandwidth).
    step = _READ_CHUNK_BYTES if reads is None else _DIRECT_CHUNK_BYTES
    workers = threads
    if reads is None and threads > 1:
        workers = max(1, min(threads, os.cpu_count() or 1))
    chunks: list[tuple[int, int, memoryview | None, str]] = []
    for offset, size, view, name in pieces:
        if view is None and digest is None:
            continue
        for start in range(0, size, step):
            n = min(step, size - start)
            part = None if view is None else view[start : start + n]
            chunks.append((offset + start, n, part, name))
    _read_chunks(
        fd, chunks, total, digest=digest, threads=workers, direct=reads, inline=threads <= 1
    )


def _read_chunks(
    fd: int,
    chunks: list[tuple[int, int, memoryview | None, str]],
    total: int,
    *,
    digest: Any,
    threads: int,
    direct: _DirectReads | None,
    inline: bool,
) -> None:
    if inline or len(chunks) < 2 or total < _THREADED_MIN_BYTES:
        for chunk in chunks:
            data = _pread_chunk(fd, chunk, direct)
            if digest is not None:
                digest.update(data)
        return
    count = len(chunks)
    # Every worker (the calling thread is one, with ``threads - 1`` helpers) takes the
    # next chunk in file order and reads it; then, unless another worker is hashing,
    # it hashes every chunk that is in, in file order, starting with the next one due.
    # So no worker ever waits for another (the device keeps ``threads`` requests
    # queued), the digest sees the file in order, and a chunk is mostly hashed by the
    # worker that just read it, while its bytes are still in that core's cache: one
    # pass over memory, not the reads and then a second pass of the digest over memory
    # the reads have long evicted (warm, 1 GiB, 624 tensors on 2 cores: 1.33x the raw
    # read with a separate hashing thread, about 1.0x this way).
    cond = threading.Condition()
    ready: list[memoryview | None] = [None] * count  # read, not yet hashed
    due = [0, False]  # the next chunk to hash; whether a worker is hashing
    errors: list[BaseException] = []
    cursor = [0]
    stop = threading.Event()

    def hash_ready() -> None:
        """Hash the chunks that are in, from the one due, unless someone else does."""
        with cond:
            if due[1] or due[0] >= count or ready[due[0]] is None:
                return
            due[1] = True
        while True:
            with cond:
                i = due[0]
                data = ready[i]
                if data is None or stop.is_set():
                    due[1] = False  # released under the lock that stores chunks:
                    return  # a chunk stored after the check finds the role free
                ready[i] = None
            digest.update(data)
            with cond:
                due[0] = i + 1
                if due[0] == count:
                    due[1] = False
                    return

    def work() -> None:
        while not stop.is_set():
            with cond:
                i = cursor[0]
                cursor[0] += 1
            if i >= count:
                return
            try:
                data = _pread_chunk(fd, chunks[i], direct)
                if digest is not None:
                    with cond:
                        ready[i] = data
                    hash_ready()
            except BaseException as exc:  # raised by the calling thread below
                errors.append(exc)
                stop.set()
                return

    helpers = [
        threading.Thread(target=work, name="atomic-checkpoint-read", daemon=True)
        for _ in range(min(threads, count) - 1)
    ]
    for w in helpers:
        w.start()
    try:
        work()
    except BaseException as exc:  # e.g. KeyboardInterrupt: stop the helpers, then raise
        errors.append(exc)
        stop.set()
        raise
    finally:
        for w in helpers:
            w.join()
    if errors:
        raise errors[0]
    if digest is not None and due[0] != count:  # pragma: no cover - a broken hand-over
        raise CheckpointError(f"load: {count - due[0]} chunks read were never hashed")


class _DigestReader:
    """Feeds ``digest`` every byte read through it, in file order (the sequential path
    of :func:`load_state`, which then reads every byte in order)."""

    def __init__(self, f: Any, digest: Any, position: int):
        self._f = f
        self._digest = digest
        self.position = position
        self.in_order = True

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b) or 0
        self._digest.update(memoryview(b).cast("B")[:n])
        self.position += n
        return n

    def read(self, n: int = -1) -> bytes:
        data = bytes(self._f.read(n) or b"")
        self._digest.update(data)
        self.position += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        new = int(self._f.seek(pos, whence))
        self.in_order = self.in_order and new == self.position
        self.position = new
        return new


def _readinto_exact(f: Any, view: memoryview | None, entry: _Entry, header: _Header) -> None:
    if view is None:
        return
    done = 0
    total = view.nbytes
    while done < total:
        got = f.readinto(view[done:])
        if not got:
            at = header.data_start + entry.begin + done
            raise CorruptCheckpointError(
                f"truncated: the file ends at byte {at}, inside tensor {entry.name!r} "
                f"(data_offsets [{entry.begin}, {entry.end}])"
            )
        done += got


def _same_memory(a: Any, b: Any) -> bool:
    if type(a).__module__.startswith("torch") and type(b).__module__.startswith("torch"):
        return bool(
            a.device == b.device
            and a.data_ptr() == b.data_ptr()
            and a.stride() == b.stride()
            and a.dtype == b.dtype
            and a.shape == b.shape
        )
    if hasattr(a, "__array_interface__") and hasattr(b, "__array_interface__"):
        ia, ib = a.__array_interface__, b.__array_interface__
        return bool(
            ia["data"] == ib["data"]
            and a.shape == b.shape
            and a.strides == b.strides
            and a.dtype == b.dtype
        )
    return False


def _flat_tree(header: _Header) -> Any:
    # A safetensors file from another writer: load it as a flat dict of tensors (numpy
    # arrays when torch is missing and the dtype allows).
    use_torch = True
    try:
        _import_torch()
    except ImportError:
        use_torch = False
    pairs = []
    for e in header.entries:
        tag = "tensor" if use_torch or _DTYPES[e.code][2] is None else "ndarray"
        pairs.append([e.name, {tag: e.name}])
    return {"dict": pairs}


def read_header(fileobj: Any, *, size_bytes: int | None = None) -> CheckpointHeader:
    """Read and validate a state file's header without reading tensor data.

    Imports neither torch nor numpy; meant for ``atomic-checkpoint inspect``.

    Args:
        fileobj: a binary file object with ``read`` and ``seek``, positioned anywhere.
        size_bytes: the file's size, if known (e.g. from the manifest); otherwise it is
            taken from ``fstat`` or by seeking to the end.

    Returns:
        The tensors, tree and metadata of the file.

    Raises:
        CorruptCheckpointError: the header or tree is malformed or inconsistent.
        UnsupportedSchemaError: the file was written by a newer format version.
    """
    header = _parse_header(fileobj, size_bytes)
    if header.tree is not _MISSING:
        _Loader(header, allow_pickle=True, device=None, for_load=False).collect(
            header.tree, _MISSING
        )
    return CheckpointHeader(
        tensors={e.name: (e.code, e.shape) for e in header.entries},
        tree=None if header.tree is _MISSING else header.tree,
        metadata=dict(header.metadata),
        header_size_bytes=header.data_start,
        data_size_bytes=header.entries[-1].end if header.entries else 0,
    )


def load_state(
    fileobj: Any,
    *,
    allow_pickle: bool = False,
    into: Any = None,
    device: Any = None,
    size_bytes: int | None = None,
    digest: Any = None,
    threads: int = DEFAULT_READ_THREADS,
    direct: bool = False,
) -> Any:
    """Load a state written through :func:`plan_state`, exactly as it was saved.

    The header is validated before any data is read. Every tensor is allocated once
    (``torch.empty``/``numpy.empty``) and its bytes are read directly into its memory,
    with no copy in between. From a regular file (``fileobj.fileno()``) the reads are
    positioned (``os.preadv``), ``threads`` at a time, so a fast device has requests
    queued; otherwise they are one sequential pass of ``readinto``. Tensors that were
    one object (or the same view) when saved are one object again. A plain safetensors
    file from another writer loads as a flat dict of tensors.

    Args:
        fileobj: a binary file object with ``readinto``, ``read`` and ``seek``, the
            state file starting at offset 0; an unbuffered ``open(path, "rb",
            buffering=0)`` is fastest. ``OSError`` from it propagates unchanged.
        allow_pickle: unpickle objects that were saved with ``allow_pickle=True``.
            Unpickling runs code from the file: only for files you trust.
        into: an existing state of the same structure (e.g. ``{"model":
            model.state_dict(), ...}``). Each saved tensor whose path holds a tensor or
            array in ``into`` is read straight into it, in place, and that object is
            returned at that path; this is the fast path for resuming. Paths that are
            missing from ``into`` get new tensors.
        device: where new torch tensors are placed (e.g. ``"cuda:0"``). Bytes bound
            for GPU memory (here or in ``into``) are read into page-locked host buffers
            and copied from there while the next ones are read (see
            :mod:`~atomic_checkpoint.device_staging`). Tensors filled through ``into``
            stay where they are.
        size_bytes: the file's size, if known, to bound the header before reading it.
        digest: an object with ``update(bytes-like)`` (e.g. ``manifest.Hasher``): it is
            fed every byte of the file, header included, in file order, before this
            returns, so the caller can compare its checksum before handing the state on.
        threads: reader threads for positioned reads (1: read on the calling thread).
        direct: read what the page cache does not hold with O_DIRECT (Linux, files of
            16 MiB and more; falls back to buffered reads where it is refused).

    Returns:
        The state: new containers in the saved structure, holding the loaded tensors.

    Raises:
        CorruptCheckpointError: the file is truncated, malformed or inconsistent, or a
            tensor in ``into`` has a different dtype or shape (the message names the path).
        UnsafeCheckpointError: the file holds a pickled object and ``allow_pickle`` is False.
        UnsupportedSchemaError: the file was written by a newer format version.
        ImportError: the file holds torch tensors and torch is not installed.
    """
    with without_gc():  # a tree of many tensors: see without_gc (a third of the time)
        header = _parse_header(fileobj, size_bytes)
        tree = header.tree if header.tree is not _MISSING else _flat_tree(header)
        loader = _Loader(header, allow_pickle=allow_pickle, device=device, for_load=True)
        root_into = _MISSING if into is None else into
        loader.collect(tree, root_into)
        fd = _positional_fd(fileobj)
        if fd is not None and loader.can_read_positionally():
            loader.read_positional(fd, header, digest, threads, direct)
        elif digest is None:
            loader.read_data(fileobj, header)
        else:
            digest.update(header.raw)
            loader.every_byte = True
            reader = _DigestReader(fileobj, digest, header.data_start)
            fileobj.seek(header.data_start)
            loader.read_data(reader, header)
            if not reader.in_order:  # pragma: no cover - read_data reads in order
                raise RuntimeError("load_state: the digest missed bytes (reads out of order)")
        loader.settle_aliases()
        return loader.build(tree, root_into)
