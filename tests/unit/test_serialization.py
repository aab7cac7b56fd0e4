"""State <-> safetensors file: exact round trips, safety, and strict header validation.

A resume that silently changes a value (an int key turned into a str, a tuple into a
list, a NaN into None, tied weights untied) or that loads a torn file is the failure
this module exists to prevent; each test pins one of those down.
"""

from __future__ import annotations

import collections
import gc
import io
import json
import math
import pickle
import random
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from atomic_checkpoint.errors import (
    CorruptCheckpointError,
    SerializationError,
    StateMismatchError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from atomic_checkpoint.serialization import (
    TREE_METADATA_KEY,
    StatePlan,
    load_state,
    plan_state,
    read_header,
)

safetensors = pytest.importorskip("safetensors")

SRC = str(Path(__file__).resolve().parents[2] / "src")


# -- helpers ---------------------------------------------------------------------------


def save(path: Path, state: Any, **kwargs: Any) -> StatePlan:
    plan = plan_state(state, **kwargs)
    with open(path, "wb", buffering=0) as f:
        for chunk in plan.iter_chunks():
            f.write(chunk)
    assert path.stat().st_size == plan.total_size_bytes
    return plan


def load(path: Path, **kwargs: Any) -> Any:
    with open(path, "rb", buffering=0) as f:
        return load_state(f, **kwargs)


def roundtrip(state: Any, *, through: str = "stream", **kwargs: Any) -> Any:
    """Save ``state`` and load it back: from an in-memory stream (one sequential pass)
    or, ``through="file"``, from a regular file (positioned reads, as a restore does)."""
    plan = plan_state(state, allow_pickle=kwargs.pop("allow_pickle_save", False))
    buf = io.BytesIO()
    for chunk in plan.iter_chunks(chunk_bytes=kwargs.pop("chunk_bytes", 1 << 20)):
        buf.write(chunk)
    assert buf.tell() == plan.total_size_bytes
    buf.seek(0)
    if through == "stream":
        return load_state(buf, **kwargs)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.safetensors"
        path.write_bytes(buf.getvalue())
        poison_small_allocations()
        return load(path, **kwargs)


def poison_small_allocations() -> None:
    """Fill the memory that numpy and torch hand out next for small arrays with 0xA5
    bytes: a value read before its bytes arrived shows as 0xA5..., never, by luck, as
    the value that a recent write of the same state left in freed memory."""
    junk = [np.full(n, 0xA5, dtype=np.uint8) for n in (1, 2, 4, 8, 16, 64, 256) * 200]
    junk += [torch.full((n,), 0xA5, dtype=torch.uint8) for n in (1, 4, 8, 16, 64) * 100]
    del junk


#: The two ways a state file is read: both must give the state that was saved.
THROUGH = pytest.mark.parametrize("through", ["stream", "file"])


def tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return bytes(t.detach().clone().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Strict structural equality: same types, same container kinds, same bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert tensor_bytes(a) == tensor_bytes(b), f"{path}: tensor bytes differ"
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: array bytes differ"
    elif isinstance(a, float):
        assert a.hex() == b.hex(), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert len(a) == len(b), f"{path}: {len(a)} keys != {len(b)} keys"
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{path} key")
            assert_same(va, vb, f"{path}[{ka!r}]")
        if isinstance(a, collections.OrderedDict):
            assert_same(dict(vars(a)), dict(vars(b)), f"{path} attributes")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def training_state() -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    cuda_rng = (
        torch.cuda.get_rng_state_all()
        if torch.cuda.is_available()
        else [torch.get_rng_state().clone(), torch.get_rng_state().clone()]
    )
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cuda": cuda_rng,
        },
        "step": 2,
    }
    return state, model, opt


# -- exact round trips -----------------------------------------------------------------


def test_training_state_round_trips_exactly(tmp_path: Path) -> None:
    state, model, _ = training_state()
    save(tmp_path / "s.safetensors", state)
    out = load(tmp_path / "s.safetensors")

    assert_same(state, out)
    assert list(out["optimizer"]["state"]) == [0, 1, 2, 3, 4, 5]  # int keys stay int
    assert out["optimizer"]["state"][0]["step"].shape == ()  # step tensors are 0-dim
    assert type(out["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert type(out["model"]) is collections.OrderedDict
    assert out["model"]._metadata == state["model"]._metadata  # BatchNorm version info
    assert type(out["rng"]["python"][1]) is tuple and len(out["rng"]["python"][1]) == 625

    # The loaded state drives a real resume: same weights, same next random numbers.
    model2 = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optimizer"])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    random.setstate(state["rng"]["python"])
    expected = random.random()
    random.setstate(out["rng"]["python"])
    assert random.random() == expected
    np.random.set_state(out["rng"]["numpy"])
    first = np.random.rand()
    np.random.set_state(state["rng"]["numpy"])
    assert np.random.rand() == first
    torch.set_rng_state(out["rng"]["torch"])
    first_t = torch.rand(3)
    torch.set_rng_state(state["rng"]["torch"])
    assert torch.equal(torch.rand(3), first_t)


TORCH_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,  # e.g. rotary-embedding buffers (freqs_cis)
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype``: every byte pattern, including NaN and subnormal floats."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(dtype: torch.dtype) -> None:
    t = random_tensor(dtype, (3, 5))
    out = roundtrip({"t": t, "scalar": random_tensor(dtype, ()), "empty": t[:0]})
    assert_same({"t": t, "scalar": t.reshape(-1)[0].clone(), "empty": t[:0]}["t"], out["t"])
    assert out["scalar"].shape == () and out["scalar"].dtype == dtype
    assert out["empty"].shape == (0, 5) and out["empty"].dtype == dtype


def test_complex64_tensors_and_arrays_round_trip_and_conjugate_views_keep_their_values(
    tmp_path: Path,
) -> None:
    # complex64 is the one complex dtype safetensors (our header) knows; a lazily
    # conjugated view (t.conj()) is stored with its values, not its conjugate bit.
    c = random_tensor(torch.complex64, (4, 3), seed=7)
    state = {
        "c": c,
        "conj": c.conj(),
        "t": c.t(),
        "np": np.arange(5, dtype=np.complex64) * (1 - 2j),
        "np_big": (np.arange(3) * 1j).astype(">c8"),
    }
    out = roundtrip(state)
    assert tensor_bytes(out["c"]) == tensor_bytes(c)
    assert not out["conj"].is_conj()
    assert torch.equal(out["conj"], c.conj().resolve_conj())
    assert torch.equal(out["t"], c.t())
    assert out["np"].dtype == np.complex64 and np.array_equal(out["np"], state["np"])
    assert np.array_equal(out["np_big"], state["np_big"])
    # A conjugated destination cannot take raw bytes: it is filled through a copy.
    save(tmp_path / "s.safetensors", state)
    into = {**state, "c": torch.zeros_like(c), "conj": torch.zeros_like(c).conj()}
    got = load(tmp_path / "s.safetensors", into=into)
    assert got["c"] is into["c"] and torch.equal(into["c"], c)
    assert torch.equal(into["conj"].resolve_conj(), c.conj().resolve_conj())


def test_zero_dim_and_empty_tensors() -> None:
    state = {
        "zero_dim": torch.tensor(3.25),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(4, 0, dtype=torch.bfloat16),
        "empty_int": torch.zeros(0, 3, dtype=torch.int64),
        "other_empty": torch.empty(0),
    }
    out = roundtrip(state)
    assert_same(state, out)
    assert out["zero_dim"].item() == 3.25
    # Distinct empty tensors share data_ptr 0; they must not collapse into one object.
    assert out["empty"] is not out["other_empty"]


def test_non_contiguous_tensors_are_written_contiguous() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "transposed": base.T,
        "strided": base[:, ::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),  # stride 0
        "negated": torch._neg_view(base),
        "bf16_t": base.to(torch.bfloat16).T,
        # One element: "contiguous" whatever its stride, so its flat view has stride 5.
        "one_strided": torch.arange(10.0)[::5][:1].reshape(1, 1),
    }
    plan = plan_state(state)
    assert plan.total_size_bytes == plan.header_size_bytes + (24 + 12 + 6 + 24 + 1) * 4 + 24 * 2
    out = roundtrip(state)
    for key, value in state.items():
        assert out[key].is_contiguous()
        assert torch.equal(out[key], value.resolve_neg().contiguous()), key


def test_tied_weights_are_stored_once_and_restored_tied() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    sd = Tied().state_dict()
    # state_dict() returns two distinct tensor objects viewing the same memory.
    assert sd["embed.weight"] is not sd["head.weight"]
    w = torch.randn(6, 6)
    state = {
        "model": sd,
        "same_object": [w, w],
        "overlapping": (w[:3], w[1:4]),  # overlapping but different views: two copies
    }
    plan = plan_state(state)
    names = [name for name, _ in plan.tensors()]
    assert names == [
        "model.embed.weight",
        "same_object.0",
        "overlapping.0",
        "overlapping.1",
    ]
    out = roundtrip(state)
    assert out["model"]["embed.weight"] is out["model"]["head.weight"]
    assert out["same_object"][0] is out["same_object"][1]
    assert out["overlapping"][0] is not out["overlapping"][1]
    assert torch.equal(out["overlapping"][1], w[1:4])


@THROUGH
def test_numpy_arrays_and_scalars_round_trip(through: str) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4))
    state = {
        "f64": a,
        "f32_fortran": np.asfortranarray(a.astype(np.float32)),
        "strided": a[:, ::2],
        "big_endian": a.astype(">f4"),
        "ints": [np.arange(5, dtype=dt) for dt in ("i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8")],
        "bool": rng.random(7) > 0.5,
        "f16_0d": np.array(1.5, dtype=np.float16),
        "scalars": (np.float32(0.1), np.int64(-3), np.bool_(True), np.uint8(255)),
        "same": [a, a],
        "empty": np.zeros((0, 2), dtype=np.int32),
    }
    out = roundtrip(state, through=through)
    assert_same(state, out)
    assert out["same"][0] is out["same"][1]
    assert out["big_endian"].dtype.str == ">f4"


def test_small_entries_read_positionally_hold_their_own_bytes(tmp_path: Path) -> None:
    """A file of small entries (numpy scalars, small arrays and tensors, one tensor
    restored into two tied targets) is read with positioned reads: each small run into
    a scratch buffer, then copied out. A numpy scalar is taken, and a tied target
    filled, only after those copies: before, they held the memory the allocation
    happened to reuse (a resumed ``step`` counter of 4575657222473777152)."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "step": np.int64(25),
        "scalars": [np.int64(i * 7919 + 1) for i in range(32)]
        + [np.float32(i / 3) for i in range(32)],
        "flags": (np.bool_(True), np.uint8(200), np.float16(1.5)),
        "arrays": [np.full(3, i, dtype=np.int32) for i in range(8)],
        "tensors": [torch.full((2,), float(i)) for i in range(8)],
        "a": w,
        "b": w,
    }
    save(tmp_path / "state.safetensors", state)
    a, b = torch.zeros(3, 4), torch.zeros(3, 4)
    for into in (None, {"a": a, "b": b}):
        poison_small_allocations()
        out = load(tmp_path / "state.safetensors", into=into)
        expected = dict(state)
        if into is not None:
            assert out["a"] is a and out["b"] is b
            assert torch.equal(a, w) and torch.equal(b, w)
            expected.pop("a"), expected.pop("b"), out.pop("a"), out.pop("b")
        assert_same(expected, out)


def test_python_values_round_trip_exactly() -> None:
    state = {
        "floats": [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1 / 3, 1e308],
        "ints": [0, -1, 2**63 - 1, 2**63, -(2**63), 2**64 + 1, -(10**5000), 10**5000],
        "bools_are_not_ints": [True, False, 1, 0],
        "text": ["", "ünïcödé ✓", "\ud800 lone surrogate", "line\nbreak", '"quoted"'],
        "bytes": [b"", b"\x00\xff" * 10, bytearray(b"abc")],
        "torch_values": [torch.bfloat16, torch.device("cpu"), torch.Size([2, 0, 3])],
        "keys": {
            0: "int",
            "0": "str",
            1.5: "float",
            None: "none",
            True: "bool",
            (1, "a", (2.0, None)): "tuple",
            b"k": "bytes",
            -(2**70): "big int",
        },
        "nested": ((), [], {}, collections.OrderedDict(), [[[()]]]),
    }
    out = roundtrip(state)
    assert_same(state, out)
    assert list(out["keys"])[:2] == [0, "0"]


@pytest.mark.parametrize("state", [None, 7, "text", b"raw", [], ()], ids=repr)
def test_a_bare_value_round_trips_as_the_whole_state(state: Any) -> None:
    # The tree of a bare None is JSON null: it must not read as "no tree" (a foreign
    # safetensors file, loaded as a flat dict), which turned None into {}.
    out = roundtrip(state)
    assert type(out) is type(state) and out == state


def test_safetensors_safe_open_reads_our_tensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    # Mixed item sizes in tree order: the writer must still align every tensor.
    state = {
        f"{i}_{dtype}".replace("torch.", ""): random_tensor(dtype, (i + 1, 3), seed=i)
        for i, dtype in enumerate(reversed(TORCH_DTYPES))
    }
    state["nested"] = {"x": torch.randn(2, 2).T, "rng": torch.get_rng_state()}
    save(tmp_path / "s.safetensors", state)
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert keys == {*[k for k in state if k != "nested"], "nested.x", "nested.rng"}
        for key, value in state.items():
            if key != "nested":
                assert tensor_bytes(f.get_tensor(key)) == tensor_bytes(value), key
        assert torch.equal(f.get_tensor("nested.x"), state["nested"]["x"])
        assert torch.equal(f.get_tensor("nested.rng"), state["nested"]["rng"])
        assert f.metadata()["format"] == "pt"


def test_plain_safetensors_file_loads_as_flat_dict(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(3), "b": torch.arange(4, dtype=torch.int16)}
    save_file(tensors, str(tmp_path / "plain.safetensors"))
    out = load(tmp_path / "plain.safetensors")
    assert set(out) == {"a", "b"}
    assert torch.equal(out["a"], tensors["a"]) and torch.equal(out["b"], tensors["b"])


# -- safety ----------------------------------------------------------------------------


class Custom:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def test_a_module_or_optimizer_in_the_state_says_to_save_its_state_dict() -> None:
    # The hint was allow_pickle=True: the object came back, and load_state_dict()
    # refused it.
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2)
    for value, name in ((model, "linear"), (torch.optim.SGD(model.parameters(), lr=0.1), "sgd")):
        with pytest.raises(SerializationError) as info:
            plan_state({"x": value})
        assert f"{name}.state_dict()" in str(info.value) and "allow_pickle" not in str(info.value)


def test_unsupported_object_names_its_path_and_the_fix() -> None:
    state = {"optimizer": {"param_groups": [{"lr": 0.1, "foo": Custom(1)}]}}
    with pytest.raises(SerializationError) as info:
        plan_state(state)
    message = str(info.value)
    assert "state['optimizer']['param_groups'][0]['foo']" in message
    assert "Custom" in message and "allow_pickle=True" in message and "Convert" in message
    assert isinstance(info.value, TypeError)


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized creation is deprecated
        return torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: torch.zeros(2, dtype=torch.complex128), "complex128"),
        (lambda: torch.zeros(2, 2).to_sparse(), "layout"),
        (lambda: torch.empty(2, device="meta"), "meta"),
        (quantized, "quantized"),
        (lambda: np.zeros(2, dtype=np.complex128), "complex128"),
        (lambda: np.array(["a"], dtype=object), "object"),
        (lambda: collections.defaultdict(list), "defaultdict"),
        (lambda: frozenset([1]), "frozenset"),
        (lambda: {Custom(1)}, "set"),
    ],
    ids=[
        "complex",
        "sparse",
        "meta",
        "quantized",
        "np-complex",
        "np-object",
        "defaultdict",
        "frozenset",
        "set",
    ],
)
def test_unsupported_values_raise_serialization_error(make: Any, fragment: str) -> None:
    with pytest.raises(SerializationError, match=fragment) as info:
        plan_state({"a": [make()]})
    assert "state['a'][0]" in str(info.value)


def test_unsupported_key_and_cycle_raise() -> None:
    with pytest.raises(SerializationError, match=r"dict key of type .*Custom"):
        plan_state({"a": {Custom(1): 1}})
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(SerializationError, match=r"state\['x'\]\[1\].*cycle"):
        plan_state({"x": loop})


def test_pickle_is_refused_on_load_unless_allowed(tmp_path: Path) -> None:
    state = {"cfg": {"obj": Custom(7), Custom(3): "key"}, "w": torch.ones(2)}
    save(tmp_path / "s.safetensors", state, allow_pickle=True)

    with pytest.raises(UnsafeCheckpointError, match=r"allow_pickle=True") as info:
        load(tmp_path / "s.safetensors")
    assert "state['cfg']" in str(info.value)
    # Inspecting never unpickles.
    with open(tmp_path / "s.safetensors", "rb") as f:
        header = read_header(f)
    assert header.tensors["cfg.obj"][0] == "U8"

    out = load(tmp_path / "s.safetensors", allow_pickle=True)
    assert out["cfg"]["obj"] == Custom(7)
    assert list(out["cfg"].values()) == [Custom(7), "key"]
    assert torch.equal(out["w"], state["w"])


def test_complex_tensor_can_be_pickled_explicitly() -> None:
    state = {"c": torch.tensor([1 + 2j])}
    out = roundtrip(state, allow_pickle_save=True, allow_pickle=True)
    assert torch.equal(out["c"], state["c"])


# -- corrupt files ---------------------------------------------------------------------


def build_file(header: dict[str, Any], data: bytes, *, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def good_file() -> bytes:
    buf = io.BytesIO()
    for chunk in plan_state({"a": torch.arange(4.0), "b": torch.arange(2)}).iter_chunks():
        buf.write(chunk)
    return buf.getvalue()


def tree_meta(tree: Any) -> dict[str, str]:
    return {TREE_METADATA_KEY: json.dumps(tree)}


F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}

CORRUPT_FILES = {
    "empty file": (b"", "fewer than the 8-byte"),
    "cut inside header": (good_file()[:20], "runs past the end"),
    "cut inside data": (good_file()[:-3], "truncated"),
    "trailing bytes": (good_file() + b"xx", "unexpected bytes"),
    "huge header length": (struct.pack("<Q", 1 << 60) + b"{}", "outside 2.."),
    "header length past end": (build_file({}, b"", length=4096), "runs past the end"),
    "bad json": (struct.pack("<Q", 8) + b"{nope!!}", "not valid JSON"),
    "not utf-8": (struct.pack("<Q", 8) + b"\xff" * 8, "not UTF-8"),
    "json array": (build_file([], b""), "not an object"),  # type: ignore[arg-type]
    "duplicate key": (
        struct.pack("<Q", 16) + b'{"a":1 , "a":2 }',
        "duplicate key",
    ),
    "unknown dtype": (build_file({"a": {**F32_4, "dtype": "F128"}}, b"\0" * 16), "unknown dtype"),
    "shape vs offsets": (
        build_file({"a": {**F32_4, "shape": [5]}}, b"\0" * 16),
        "needs 20 bytes",
    ),
    "offsets past data": (
        build_file({"a": {**F32_4, "data_offsets": [0, 32], "shape": [8]}}, b"\0" * 16),
        "truncated",
    ),
    "overlapping": (
        build_file(
            {"a": F32_4, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
            b"\0" * 16,
        ),
        "overlap",
    ),
    "gap": (
        build_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16),
        "gap",
    ),
    "reversed offsets": (
        build_file({"a": {**F32_4, "data_offsets": [16, 0]}}, b"\0" * 16),
        "begin <= end",
    ),
    "negative shape": (build_file({"a": {**F32_4, "shape": [-4]}}, b"\0" * 16), "non-negative"),
    "absurd rank": (build_file({"a": {**F32_4, "shape": [1] * 65}}, b"\0" * 16), "at most 64"),
    "extra field": (build_file({"a": {**F32_4, "x": 1}}, b"\0" * 16), "exactly dtype"),
    "metadata not str": (build_file({"__metadata__": {"k": 1}}, b""), "str to str"),
    "tree bad json": (build_file({"__metadata__": {TREE_METADATA_KEY: "[1,"}}, b""), "tree"),
    "tree missing entry": (
        build_file({"__metadata__": tree_meta({"tensor": "zz"})}, b""),
        "header lacks",
    ),
    "tree unknown tag": (
        build_file({"__metadata__": tree_meta({"evil": "os.system"})}, b""),
        "unknown node tag",
    ),
    "tree raw float": (build_file({"__metadata__": tree_meta([1.5])}, b""), "unexpected JSON"),
    "tree bad dict": (
        build_file({"__metadata__": tree_meta({"dict": [[1]]})}, b""),
        "pairs",
    ),
    "tree duplicate dict key": (
        build_file({"__metadata__": tree_meta({"dict": [[1, 2], [1, 3]]})}, b""),
        "appears twice",
    ),
    "tree deep nesting": (
        build_file({"__metadata__": {TREE_METADATA_KEY: "[" * 5000 + "]" * 5000}}, b""),
        "nests deeper|not valid JSON",
    ),
    "tree unsafe attr": (
        build_file({"__metadata__": tree_meta({"odict": [], "attrs": [["__class__", 1]]})}, b""),
        "not allowed",
    ),
    "numpy view of bf16": (
        build_file(
            {
                "__metadata__": tree_meta({"ndarray": "a"}),
                "a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
            },
            b"\0" * 4,
        ),
        "cannot be a numpy array",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPT_FILES))
def test_corrupt_files_raise_corrupt_checkpoint_error(case: str) -> None:
    data, fragment = CORRUPT_FILES[case]
    with pytest.raises(CorruptCheckpointError, match=fragment):
        load_state(io.BytesIO(data))
    with pytest.raises(CorruptCheckpointError, match=fragment):
        read_header(io.BytesIO(data))


def test_header_length_is_bounded_by_given_size_bytes() -> None:
    data = good_file()
    with pytest.raises(CorruptCheckpointError, match="runs past the end"):
        load_state(io.BytesIO(data), size_bytes=12)
    assert torch.equal(load_state(io.BytesIO(data), size_bytes=len(data))["a"], torch.arange(4.0))


def test_newer_format_version_is_reported() -> None:
    data = build_file({"__metadata__": {"atomic_checkpoint.format_version": "99"}}, b"")
    with pytest.raises(UnsupportedSchemaError, match="upgrade atomic-checkpoint"):
        load_state(io.BytesIO(data))


# -- loading into existing tensors -----------------------------------------------------


def test_into_fills_existing_tensors_in_place(tmp_path: Path) -> None:
    state, _, _ = training_state()
    save(tmp_path / "s.safetensors", state)

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    into = {"model": model.state_dict(), "optimizer": opt.state_dict()}  # no optimizer state yet
    ptrs = {k: v.data_ptr() for k, v in into["model"].items()}
    out = load(tmp_path / "s.safetensors", into=into)

    for key, tensor in out["model"].items():
        assert tensor is into["model"][key]
        assert tensor.data_ptr() == ptrs[key]
        assert torch.equal(tensor, state["model"][key])
    for p, key in zip(model.parameters(), ["0.weight", "0.bias"], strict=False):
        assert torch.equal(p, state["model"][key])  # the live model sees the values
    assert_same(state["optimizer"], out["optimizer"])  # absent in into: loaded fresh


@THROUGH
def test_into_handles_non_contiguous_and_tied_targets(through: str) -> None:
    w = torch.randn(3, 4)
    state = {"t": w.T.contiguous(), "a": w, "b": w}
    target_t = torch.zeros(4, 3).T.contiguous().T  # non-contiguous (4, 3)... as a view
    assert not target_t.is_contiguous()
    a, b = torch.zeros(3, 4), torch.zeros(3, 4)
    one = torch.zeros(10)[::5][:1]  # one element with stride 5: filled through a flat view
    state["one"] = torch.tensor([7.0])
    out = roundtrip(state, through=through, into={"t": target_t, "a": a, "b": b, "one": one})
    assert out["one"] is one and one.item() == 7.0
    assert out["t"] is target_t and torch.equal(target_t, state["t"])
    assert out["a"] is a and out["b"] is b
    assert torch.equal(a, w) and torch.equal(b, w)


def test_into_rejects_shape_and_dtype_mismatch() -> None:
    state = {"model": {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4)}}
    with pytest.raises(StateMismatchError, match=r"state\['model'\]\['fc.weight'\].*\(3, 4\)"):
        roundtrip(state, into={"model": {"fc.weight": torch.zeros(3, 4)}})
    with pytest.raises(StateMismatchError, match=r"state\['model'\]\['fc.bias'\].*float16"):
        roundtrip(state, into={"model": {"fc.bias": torch.zeros(4, dtype=torch.float16)}})
    with pytest.raises(StateMismatchError, match="numpy array"):
        roundtrip(state, into={"model": {"fc.bias": np.zeros(4, dtype=np.float32)}})


def test_into_rejects_arrays_the_checkpoint_would_not_load() -> None:
    # A state dict filled in place must not keep stale values unnoticed: an array in
    # into= that the checkpoint lacks, or where it holds no array, is refused (like
    # load_state_dict's missing keys), naming each path; nothing is loaded.
    state = {"model": {"w": torch.ones(2)}, "step": 3, "groups": [torch.zeros(1)]}
    new_layer = {"model": {"w": torch.zeros(2), "new.bias": torch.zeros(2)}}
    with pytest.raises(StateMismatchError, match=r"state\['model'\]\['new.bias'\].*lacks"):
        roundtrip(state, into=new_layer)
    assert new_layer["model"]["w"].sum() == 0  # refused before anything was read
    with pytest.raises(StateMismatchError, match=r"state\['groups'\]\[1\], which"):
        roundtrip(state, into={"groups": [torch.zeros(1), np.zeros(2)]})
    with pytest.raises(StateMismatchError, match=r"state\['step'\]: into= has a tensor.*an int"):
        roundtrip(state, into={"step": torch.zeros(1)})
    with pytest.raises(StateMismatchError, match=r"^state: into= has a tensor.*a dict"):
        roundtrip(state, into=torch.zeros(2))
    many = {"model": {f"extra{i}": torch.zeros(1) for i in range(7)}}
    with pytest.raises(StateMismatchError, match="and 2 more"):
        roundtrip(state, into=many)
    # Another kind of container holding arrays: none of them would be loaded.
    t = torch.zeros(1)
    with pytest.raises(
        StateMismatchError, match=r"state\['groups'\]: into= has a dict of .*a list"
    ):
        roundtrip(state, into={"groups": {"0": t}})
    with pytest.raises(StateMismatchError, match=r"state\['model'\]: into= has a list of .*a dict"):
        roundtrip(state, into={"model": [torch.zeros(2)]})
    with pytest.raises(StateMismatchError, match=r"^state: into= has a list of .*a dict"):
        roundtrip(state, into=[t])
    assert t.sum() == 0
    # A tuple and a list are one kind here (into= may hold the one the state was not).
    out = roundtrip({"g": (torch.ones(1),)}, into={"g": [t]})
    assert out["g"][0] is t and t.item() == 1.0
    # Allowed: a part of the state (the rest is loaded fresh), entries without arrays
    # that the checkpoint lacks, and non-arrays where the checkpoint holds arrays.
    w = torch.zeros(2)
    out = roundtrip(state, into={"model": {"w": w}, "note": "mine", "groups": [None]})
    assert out["model"]["w"] is w and w.tolist() == [1.0, 1.0] and "note" not in out
    assert torch.equal(out["groups"][0], torch.zeros(1)) and out["step"] == 3


def test_into_tensors_that_cannot_be_filled_are_refused_saying_why() -> None:
    state = {"w": torch.ones(2, 3)}
    with pytest.raises(StateMismatchError, match=r"state\['w'\]: .*a meta tensor has no memory"):
        roundtrip(state, into={"w": torch.empty(2, 3, device="meta")})
    expanded = torch.zeros(3).expand(2, 3)
    with pytest.raises(StateMismatchError, match=r"state\['w'\]: .*share memory"):
        roundtrip(state, into={"w": expanded})
    assert expanded.sum() == 0


@THROUGH
def test_into_targets_that_share_memory_get_the_saved_values_or_are_refused(
    through: str,
) -> None:
    """Read straight in, one target's bytes silently overwrote another's where they
    share memory: a tensor tied in the new model but not in the checkpoint, a row view
    of another target. Now such targets are checked after the load."""
    saved = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([10.0, 20.0, 30.0])}
    saved["other"] = torch.tensor([5.0])
    tied, other = torch.zeros(3), torch.zeros(1)
    with pytest.raises(StateMismatchError, match=r"state\['a'\]: .*shares memory.*state\['b'\]"):
        roundtrip(saved, through=through, into={"a": tied, "b": tied, "other": other})
    # The error says what it could not: the other targets were filled already.
    assert float(other[0]) == 5.0
    with pytest.raises(StateMismatchError, match="every other target of into= holds"):
        roundtrip(saved, through=through, into={"a": tied, "b": tied, "other": other})
    full = torch.zeros(2, 2)
    with pytest.raises(StateMismatchError, match="shares memory"):
        roundtrip(
            {"full": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "row": torch.tensor([7.0, 8.0])},
            through=through,
            into={"full": full, "row": full[1]},
        )
    # Saved from the same layout, the values agree where the targets overlap: loaded.
    flat = torch.arange(12, dtype=torch.float32)
    state = {"flat": flat, "w": flat[:6].view(2, 3), "b": flat[6:]}
    into_flat = torch.zeros(12)
    into = {"flat": into_flat, "w": into_flat[:6].view(2, 3), "b": into_flat[6:]}
    out = roundtrip(state, through=through, into=into)
    assert out["w"] is into["w"] and torch.equal(into_flat, flat)
    # Columns of one matrix overlap in extent, not in elements: each gets its own values.
    m = torch.zeros(3, 4)
    cols = {"left": torch.full((3, 2), 1.0), "right": torch.full((3, 2), 2.0)}
    roundtrip(cols, through=through, into={"left": m[:, :2], "right": m[:, 2:]})
    assert m[:, :2].eq(1.0).all() and m[:, 2:].eq(2.0).all()
    # numpy arrays too, and a NaN that agrees bitwise is agreement.
    arr = np.zeros(4, dtype=np.float32)
    vals = np.array([np.nan, 1.0, 2.0, 3.0], dtype=np.float32)
    out = roundtrip({"x": vals, "y": vals[1:3].copy()}, into={"x": arr, "y": arr[1:3]})
    assert out["x"] is arr and np.isnan(arr[0]) and arr[1:].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(StateMismatchError, match="shares memory"):
        roundtrip({"x": vals, "y": np.zeros(2, np.float32)}, into={"x": arr, "y": arr[1:3]})


def test_into_targets_whose_elements_overlap_or_are_read_only_are_refused() -> None:
    state = {"w": torch.ones(2, 2), "n": np.ones((2, 2), dtype=np.float32)}
    rows = torch.zeros(3).as_strided((2, 2), (1, 1))  # rows overlap by one element
    with pytest.raises(StateMismatchError, match=r"state\['w'\]: .*as_strided"):
        roundtrip(state, into={"w": rows})
    base = np.zeros(3, dtype=np.float32)
    strided = np.lib.stride_tricks.as_strided(base, (2, 2), (4, 4))
    with pytest.raises(StateMismatchError, match=r"state\['n'\]: .*share memory"):
        roundtrip(state, into={"n": strided})
    # A read-only array kept its old values while a new one was returned at its path.
    frozen = np.zeros((2, 2), dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(StateMismatchError, match=r"state\['n'\]: .*read-only"):
        roundtrip(state, into={"n": frozen})
    # Transposes and steps do not overlap: still filled in place.
    t = torch.zeros(2, 2).T
    n = np.zeros((4, 2), dtype=np.float32)[::2]
    out = roundtrip(state, into={"w": t, "n": n})
    assert out["w"] is t and t.eq(1.0).all() and out["n"] is n and (n == 1.0).all()


def test_into_fills_numpy_arrays_in_place() -> None:
    state = {"rng": np.random.get_state(), "be": np.arange(3, dtype=">i4")}
    target = np.zeros(624, dtype=np.uint32)
    be = np.zeros(3, dtype=">i4")
    out = roundtrip(state, into={"rng": ("x", target), "be": be})
    assert out["rng"][1] is target and np.array_equal(target, state["rng"][1])
    assert out["be"] is be and be.tolist() == [0, 1, 2]


def test_device_argument_places_new_tensors() -> None:
    out = roundtrip({"w": torch.randn(3), "n": np.ones(2)}, device=torch.device("cpu"))
    assert out["w"].device.type == "cpu" and isinstance(out["n"], np.ndarray)


# -- the two-phase write API -----------------------------------------------------------


def test_iter_chunks_are_bounded_zero_copy_and_complete() -> None:
    big = torch.randn(1 << 18)  # 1 MiB
    small = [torch.tensor(float(i)) for i in range(100)]
    plan = plan_state({"big": big, "small": small, "name": "x"})
    assert plan.tensor_count == 101
    for chunk_bytes in (1, 4096, 100_000, 8 << 20):
        chunks = list(plan.iter_chunks(chunk_bytes=chunk_bytes))
        assert all(0 < len(c) <= chunk_bytes for c in chunks)
        data = b"".join(chunks)
        assert len(data) == plan.total_size_bytes
        assert_same(load_state(io.BytesIO(data))["big"], big)
    # The big tensor's chunks are views of its memory: a later change shows through.
    views = [c for c in plan.iter_chunks(chunk_bytes=1 << 20) if len(c) == 1 << 20]
    assert len(views) == 1 and isinstance(views[0], memoryview)
    big[0] = 123.0
    assert np.frombuffer(views[0], dtype=np.float32)[0] == 123.0
    with pytest.raises(ValueError):
        next(plan.iter_chunks(chunk_bytes=0))


def test_with_tensors_writes_replacements_under_the_same_header() -> None:
    state = {"a": torch.randn(3), "b": [torch.arange(4)], "p": {"k": 1}}
    plan = plan_state(state)
    assert [n for n, _ in plan.tensors()] == ["b.0", "a"]  # I64 before F32: alignment
    snapshot = plan.with_tensors([t.clone() + 1 for _, t in plan.tensors()])
    assert snapshot.total_size_bytes == plan.total_size_bytes
    out = load_state(io.BytesIO(b"".join(snapshot.iter_chunks())))
    assert torch.equal(out["a"], state["a"] + 1) and torch.equal(out["b"][0], state["b"][0] + 1)
    partial = plan.with_tensors({"a": np.zeros(3, dtype=np.float32)})
    assert torch.equal(load_state(io.BytesIO(b"".join(partial.iter_chunks())))["a"], torch.zeros(3))
    with pytest.raises(SerializationError, match="shape"):
        plan.with_tensors({"a": torch.zeros(4)})
    with pytest.raises(SerializationError, match="F32"):
        plan.with_tensors({"a": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(SerializationError, match="no tensor"):
        plan.with_tensors({"zz": torch.zeros(3)})


def test_tensor_changed_after_plan_is_detected() -> None:
    t = torch.zeros(4)
    plan = plan_state({"t": t})
    t.resize_(8)
    with pytest.raises(SerializationError, match="changed after plan_state"):
        b"".join(plan.iter_chunks())


def test_read_header_describes_the_file(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "opt": {0: {"step": torch.tensor(1.0)}}}
    plan = save(tmp_path / "s.safetensors", state)
    with open(tmp_path / "s.safetensors", "rb", buffering=0) as f:
        header = read_header(f)
    assert header.tensors == {"opt.0.step": ("F32", ()), "w": ("BF16", (2, 3))}
    assert header.tree == {
        "dict": [
            ["w", {"tensor": "w"}],
            ["opt", {"dict": [[0, {"dict": [["step", {"tensor": "opt.0.step"}]]}]]}],
        ]
    }
    assert header.header_size_bytes == plan.header_size_bytes
    assert header.header_size_bytes + header.data_size_bytes == plan.total_size_bytes
    assert header.header_size_bytes % 8 == 0


# -- property test ---------------------------------------------------------------------

ARRAY_DTYPES = ["f8", "f4", "f2", "i8", "i4", "i2", "i1", "u8", "u4", "u2", "u1", "?"]

arrays = hnp.arrays(
    dtype=st.sampled_from(ARRAY_DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
)


def to_bf16(a: np.ndarray) -> torch.Tensor:
    with np.errstate(over="ignore"):  # float64 -> float32 may overflow to inf: fine here
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)


def reversed_view(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(a.copy())
    return t.permute(tuple(reversed(range(t.dim()))))  # non-contiguous for 2+ dims


tensors = st.one_of(
    arrays.map(lambda a: torch.from_numpy(a.copy())),
    arrays.filter(lambda a: a.dtype.kind == "f").map(to_bf16),
    arrays.map(reversed_view),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    arrays,
    tensors,
    st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu"), np.float32(2.5)]),
)
keys = st.one_of(
    st.text(max_size=4),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.tuples(st.integers(), st.text(max_size=2)),
)


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=4).map(collections.OrderedDict),
    )


trees = st.recursive(leaves, containers, max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=trees,
    chunk_bytes=st.sampled_from([1, 7, 64, 1 << 20]),
    through=st.sampled_from(["stream", "file"]),
)
def test_property_any_supported_tree_round_trips_exactly(
    tree: Any, chunk_bytes: int, through: str
) -> None:
    out = roundtrip({"state": tree}, chunk_bytes=chunk_bytes, through=through)
    assert_same({"state": tree}, out)
    # And the bytes are a valid file for the reference reader.
    data = b"".join(plan_state({"state": tree}).iter_chunks())
    loaded = safetensors.deserialize(data)
    assert len(loaded) == plan_state({"state": tree}).tensor_count


def test_pickle_blob_is_a_plain_pickle() -> None:
    # The blob entry holds an ordinary pickle, so other tools can inspect it knowingly.
    plan = plan_state({"x": Custom(5)}, allow_pickle=True)
    data = b"".join(plan.iter_chunks())
    header = read_header(io.BytesIO(data))
    blob = data[header.header_size_bytes :]
    assert pickle.loads(blob) == Custom(5)


def test_planning_a_state_of_many_tensors_runs_no_garbage_collection() -> None:
    # The walk allocates tuples, dicts and entries that never form cycles; the cyclic
    # collections they triggered (each scanning every object of the process) took half
    # of the planning time, which an async save's caller waits for.
    state = {i: {"a": torch.zeros(2), "b": torch.zeros(3), "n": i} for i in range(3000)}
    started: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()  # nothing due from building the state
    gc.callbacks.append(on_gc)
    try:
        plan = plan_state(state)
        during = len(started)
    finally:
        gc.callbacks.remove(on_gc)
    # One: the collection the walk's allocations made due, at the first allocation
    # after collections are enabled again (before: 111 during the walk).
    assert during <= 1, started
    assert plan.tensor_count == 6000 and gc.isenabled()
    gc.disable()  # the user's choice is kept
    try:
        plan_state(state)
        assert not gc.isenabled()
    finally:
        gc.enable()

    # Loading it back builds the same tree (a third of a load's time went to collections).
    data = io.BytesIO(b"".join(plan.iter_chunks()))
    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        started.clear()
        loaded = load_state(data)
        during = len(started)
    finally:
        gc.callbacks.remove(on_gc)
    assert during <= 1, started
    assert len(loaded) == 3000 and torch.equal(loaded[2999]["b"], torch.zeros(3))


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


@pytest.mark.parametrize(
    "leaf", [torch.ones(2), np.arange(3), 1.5, b"x"], ids=["tensor", "ndarray", "float", "bytes"]
)
def test_a_leaf_under_the_deepest_container_allowed_round_trips(leaf: Any) -> None:
    # Save allowed MAX_DEPTH containers, but the loader counted the leaf as a level: a
    # tensor 199 dicts deep (inside the state's own dict) was saved and committed, and
    # then refused by every restore ("nests deeper than 200 levels").
    from atomic_checkpoint.serialization import MAX_DEPTH

    state = {"x": _nested(MAX_DEPTH - 1, leaf)}
    got = roundtrip(state)
    for _ in range(MAX_DEPTH):
        got = got["x" if "x" in got else "k"]
    if isinstance(leaf, torch.Tensor):
        assert torch.equal(got, leaf)
    elif isinstance(leaf, np.ndarray):
        assert np.array_equal(got, leaf)
    else:
        assert got == leaf
    with pytest.raises(SerializationError, match="nests deeper"):
        roundtrip({"x": _nested(MAX_DEPTH, leaf)})
