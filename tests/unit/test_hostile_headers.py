"""Hostile safetensors headers: every one is a ``CorruptCheckpointError`` (or
``UnsupportedSchemaError``/``UnsafeCheckpointError``, both of that family), found by
validating the whole header before anything is allocated.

Before the fix, shapes whose element count is 0 but whose sizes do not fit a tensor
(``[0, 2**63]``, ``[0, 2**40, 2**40]``), a ``torch.Size`` node of ``2**70`` and a float
node of ``0x1p99999`` passed validation and then failed inside ``torch.empty`` /
``numpy.empty`` / ``float.fromhex`` with TypeError, RuntimeError, ValueError or
OverflowError: errors that resume does not treat as a corrupt checkpoint. The
table-driven cases pin each shape; a Hypothesis fuzz throws random headers at the
reader with a fixed example budget.
"""

from __future__ import annotations

import io
import json
import re
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomic_checkpoint import CheckpointError, CorruptCheckpointError
from atomic_checkpoint.serialization import load_state, plan_state, read_header

pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

TREE_KEY = "atomic_checkpoint.tree"


def st_file(header: Any, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def one_tensor(tree: Any, dtype: str, shape: Any, data: bytes = b"", offsets: Any = None) -> bytes:
    header = {
        "__metadata__": {
            "format": "pt",
            "atomic_checkpoint.format_version": "1",
            TREE_KEY: json.dumps(tree),
        },
        "t": {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [0, len(data)] if offsets is None else offsets,
        },
    }
    return st_file(header, data)


def tree_only(tree_json: str) -> bytes:
    meta = {"format": "pt", "atomic_checkpoint.format_version": "1", TREE_KEY: tree_json}
    return st_file({"__metadata__": meta})


def plain(entries: dict[str, Any], data: bytes = b"") -> bytes:
    """A plain safetensors file (no tree): loads as a flat dict of tensors."""
    return st_file(entries, data)


# name -> (file bytes, fragment of the message). Each raised TypeError, RuntimeError,
# ValueError or OverflowError from torch/numpy/float before the fix, or passed.
CASES: dict[str, tuple[bytes, str]] = {
    "tensor [0, 2**63]": (one_tensor({"tensor": "t"}, "F32", [0, 2**63]), "below 2**63"),
    "tensor [0, 2**64]": (one_tensor({"tensor": "t"}, "F32", [0, 2**64]), "below 2**63"),
    "ndarray [0, 2**63]": (one_tensor({"ndarray": "t"}, "F32", [0, 2**63]), "below 2**63"),
    "tensor [0, 2**40, 2**40]": (
        one_tensor({"tensor": "t"}, "F32", [0, 2**40, 2**40]),
        "too large for any tensor",
    ),
    "ndarray [0, 2**31, 2**31, 2**2]": (
        one_tensor({"ndarray": "t"}, "U8", [0, 2**31, 2**31, 4]),
        "too large for any tensor",
    ),
    "plain [2**62, 0, 2]": (
        plain({"t": {"dtype": "I64", "shape": [2**62, 0, 2], "data_offsets": [0, 0]}}),
        "too large for any tensor",
    ),
    "plain [0, 2**63]": (
        plain({"t": {"dtype": "U8", "shape": [0, 2**63], "data_offsets": [0, 0]}}),
        "below 2**63",
    ),
    "torch.Size [2**70]": (tree_only(json.dumps({"size": [2**70]})), "torch.Size"),
    "torch.Size of 65 dims": (tree_only(json.dumps({"size": [1] * 65})), "torch.Size"),
    "float 0x1p99999": (tree_only(json.dumps({"float": "0x1p99999"})), "too large"),
    "format version '²'": (
        st_file({"__metadata__": {"format": "pt", "atomic_checkpoint.format_version": "²"}}),
        "format version",
    ),
    "dict key nested 300 tuples": (
        tree_only('{"dict": [[' + '{"tuple":[' * 300 + "1" + "]}" * 300 + ", 1]]}"),
        "nests deeper",
    ),
    # A dict key of 20,000 bits (a hex int has no digit limit) could not be shown in
    # the error (repr: "Exceeds the limit (4300 digits)"): a ValueError, no fallback.
    "dict key of 20,000 bits": (
        tree_only(json.dumps({"dict": [[{"int": "f" * 5000}, {"bogus": 1}]]})),
        "too large to show",
    ),
    # Looked up with getattr(torch, name), which imported the submodule it named.
    "dtype _dynamo": (tree_only(json.dumps({"dtype": "_dynamo"})), "is not a torch dtype"),
    # Already refused before the fix; kept as guards of the table.
    "negative dim": (one_tensor({"tensor": "t"}, "F32", [-4], b"\0" * 16), "non-negative"),
    "float dim": (one_tensor({"tensor": "t"}, "F32", [1.0], b"\0" * 4), "non-negative"),
    "bool dim": (one_tensor({"tensor": "t"}, "F32", [True], b"\0" * 4), "non-negative"),
    "string dim": (one_tensor({"tensor": "t"}, "F32", ["4"], b"\0" * 16), "non-negative"),
    "400-digit dim": (
        one_tensor({"tensor": "t"}, "U8", [int("9" * 400)], b"\0"),
        "non-negative",
    ),
    "unknown dtype": (one_tensor({"tensor": "t"}, "X99", [1], b"\0"), "unknown dtype"),
    "dtype not a string": (one_tensor({"tensor": "t"}, ["F32"], [1], b"\0" * 4), "dtype"),
    "offsets past the file": (
        one_tensor({"tensor": "t"}, "U8", [1], b"\0", offsets=[0, 2**40]),
        "data_offsets",
    ),
    "offsets 2**64": (
        one_tensor({"tensor": "t"}, "U8", [0], b"", offsets=[2**64, 2**64]),
        "data_offsets",
    ),
    "offsets reversed": (
        one_tensor({"tensor": "t"}, "U8", [0], b"", offsets=[4, 0]),
        "data_offsets",
    ),
    "huge product for the bytes": (
        one_tensor({"tensor": "t"}, "F32", [2**31, 2**31], b"\0" * 64),
        "too large for any tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_header_is_a_corrupt_checkpoint(case: str, monkeypatch) -> None:
    data, fragment = CASES[case]
    looked_up: list[str] = []
    real = type(torch).__getattribute__

    class Watched(type(torch)):  # type: ignore[misc]
        def __getattribute__(self, name: str) -> Any:
            looked_up.append(name)
            return real(self, name)

    monkeypatch.setattr(torch, "__class__", Watched)
    with pytest.raises(CorruptCheckpointError, match=re.escape(fragment)):
        load_state(io.BytesIO(data))
    monkeypatch.undo()
    assert "_dynamo" not in looked_up  # a name from the file is never looked up in torch
    if case.startswith(("torch.Size", "float", "dtype")):
        return  # torch/float objects are built only by a load, not by read_header
    with pytest.raises(CorruptCheckpointError):
        read_header(io.BytesIO(data))


def test_a_legal_empty_tensor_still_loads() -> None:
    """The bound is on strides, not on a 0: ``[0, 2**20]`` tensors are fine."""
    state = {"e": torch.empty(0, 2**20), "s": torch.Size([3, 2**40])}
    plan = plan_state(state)
    data = b"".join(bytes(c) for c in plan.iter_chunks())
    got = load_state(io.BytesIO(data))
    assert got["e"].shape == (0, 2**20) and got["s"] == torch.Size([3, 2**40])


# ------------------------------------------------------------------ fuzz

_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
_SIZES = st.sampled_from([0, 2**63, 1, 2**40, 0, 2**64, 3, 2**62, 2**31, 2**63 - 1])
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.integers(-(2**70), 2**70),
)


@st.composite
def headers(draw: Any) -> bytes:
    """A safetensors file with 0-2 entries, a tree that references them and data that
    fits: consistent (a known dtype, offsets that match the shape's byte count, often
    a 0 beside huge sizes), or, half of the time, with junk in any field."""

    junky = draw(st.booleans())  # else every field has the right type

    def maybe_junk(good: Any) -> Any:
        return draw(_JUNK) if junky and draw(st.sampled_from([False] * 7 + [True])) else good

    entries: dict[str, Any] = {}
    tree: list[Any] = []
    position = 0
    for i in range(draw(st.integers(0, 2))):
        name = f"t{i}"
        dtype = maybe_junk(draw(st.sampled_from([*sorted(_ITEM), "X1"])))
        shape = maybe_junk([maybe_junk(d) for d in draw(st.lists(_SIZES, max_size=3))])
        nbytes = None
        if isinstance(shape, list) and all(type(d) is int for d in shape) and dtype in _ITEM:
            n = _ITEM[dtype]
            for d in shape:
                n *= d
            nbytes = n if 0 <= n <= 64 else draw(st.integers(0, 64))
        if nbytes is not None:
            offsets: Any = maybe_junk([position, position + nbytes])
            position += nbytes
        else:
            offsets = maybe_junk([position, position + draw(st.integers(0, 64))])
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        tag = draw(st.sampled_from(["tensor", "tensor", "ndarray", "ndarray", "pickle", "size"]))
        tree.append({tag: name} if tag != "size" else {"size": shape})
    if draw(st.booleans()):
        entries["__metadata__"] = {
            "format": "pt",
            "atomic_checkpoint.format_version": "1",
            TREE_KEY: json.dumps(tree),
        }
    data = b"\0" * (position if draw(st.integers(0, 7)) else position + 8)
    return st_file(entries, data)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(headers())
def test_fuzzed_headers_load_or_raise_a_corrupt_checkpoint_error(data: bytes) -> None:
    for read in (read_header, load_state):
        try:
            read(io.BytesIO(data))
        except CheckpointError as exc:
            assert isinstance(exc, CorruptCheckpointError), repr(exc)
