"""Bad-checkpoint campaign: damaged and malicious checkpoints meet every reader.

Each case starts from a root holding two good checkpoints (steps 1 and 2) and damages
checkpoint 2: truncated, flipped, deleted or swapped files; a missing, mangled,
inconsistent or future manifest; a manifest naming files outside the checkpoint
(``..``, an absolute path, a symlink, a symlinked manifest); absurd sizes; special
files; a state file whose tree holds a pickle with a live payload; hand-crafted
safetensors headers (length bombs, overlapping or out-of-range offsets, shape and
nesting bombs, dunder attributes). Crafted state files come with a manifest that
matches them (size and checksum), so only the loader's own checks stand in the way.

Then every reader runs: ``latest()``/``checkpoints()`` (resume: the damaged one is
skipped with a warning naming it, or accepted only if it loads exactly),
``restore(2)`` and ``verify(2)`` (a precise error: the project's type, naming the
checkpoint and what is wrong), ``restore()`` (the newest valid checkpoint, exactly, or
a precise error), and the CLI's ``verify``/``inspect`` (no traceback, a non-zero exit
for a broken checkpoint).

Proofs, for every case: a payload that would create a marker file if executed never
does (and the same payload, loaded with ``allow_pickle=True`` at the end, does: it is
live); files outside the checkpoint are watched with inotify, and no reader ever opens
or reads them (so their content cannot reach a restored state); no reader blocks.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import pickle
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atomic_checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    SingleProcessCoordinator,
)
from atomic_checkpoint.layout import MANIFEST_NAME, rank_state_file
from atomic_checkpoint.manifest import Hasher, _body_checksum

from . import fresh_dir, run_module
from .checks import describe_error, expected_state, states_equal
from .inotify import OpenWatch
from .tally import Progress, Tally

SIZE = 1 << 10
STATE = rank_state_file(0)
#: Seconds any single reader call may take: a FIFO or a bomb must not block it.
CALL_TIMEOUT_S = 20.0


class Marker:
    """An object whose unpickling creates ``path``: proof that code from a checkpoint
    ran. ``pickle.loads`` calls ``exec`` with the code below."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"with open({self.path!r}, 'w') as f:\n    f.write('executed')",))


@dataclass
class Ctx:
    """Where a case works: the damaged checkpoint, the outside world, the proofs."""

    root: str
    ckpt: str  # ROOT/checkpoint-2
    outside: str  # a directory next to ROOT, never to be read
    secret: str  # a valid state file outside ROOT, with its own distinct content
    marker: str  # created if any payload runs

    def manifest(self) -> dict[str, Any]:
        with open(os.path.join(self.ckpt, MANIFEST_NAME), encoding="utf-8") as f:
            return json.load(f)

    def write_manifest(self, doc: Any, raw: bytes | None = None) -> None:
        """Write ``doc`` as the manifest (``raw``: these bytes instead). A manifest
        crafted with consistent fields is sealed as the library seals its own
        (``manifest_checksum``): the damage under test is in what it says, which a
        writer of hostile checkpoints can make self-consistent."""
        if raw is None and isinstance(doc, dict) and "manifest_checksum" in doc:
            doc = {k: v for k, v in doc.items() if k != "manifest_checksum"}
            try:
                doc["manifest_checksum"] = _body_checksum(doc, doc["checksum_algorithm"])
            except Exception:  # a manifest too broken to seal: written as it is
                pass
        data = raw if raw is not None else json.dumps(doc).encode()
        with open(os.path.join(self.ckpt, MANIFEST_NAME), "wb") as f:
            f.write(data)

    def replace_state(self, data: bytes) -> None:
        """Put ``data`` in place of the rank file, with a manifest that matches it."""
        with open(os.path.join(self.ckpt, STATE), "wb") as f:
            f.write(data)
        doc = self.manifest()
        h = Hasher(doc["checksum_algorithm"])
        h.update(data)
        for e in doc["files"]:
            if e["path"] == STATE:
                e["size"], e["checksum"] = len(data), h.hexdigest()
        self.write_manifest(doc)

    def state_bytes(self) -> bytes:
        with open(os.path.join(self.ckpt, STATE), "rb") as f:
            return f.read()


# ------------------------------------------------------------------ crafting files


def safetensors(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file from a header (an object, or raw JSON bytes)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def tree_file(tree: Any, entries: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A state file with our tree metadata and the given entries (name -> dtype,
    shape, bytes), laid out contiguously."""
    header: dict[str, Any] = {
        "__metadata__": {
            "format": "pt",
            "atomic_checkpoint.format_version": "1",
            "atomic_checkpoint.tree": json.dumps(tree),
        }
    }
    data = b""
    for name, (dtype, shape, blob) in entries.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(blob)],
        }
        data += blob
    return safetensors(header, data)


def _edit_header(ctx: Ctx, fn: Callable[[dict[str, Any]], None]) -> None:
    data = ctx.state_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    fn(header)
    ctx.replace_state(safetensors(header, data[8 + n :]))


def _nested(depth: int) -> str:
    return '{"tuple":[' * depth + "1" + "]}" * depth


# ------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One damage. ``expect``:

    - ``skip``: resume must skip step 2 with a warning containing ``problem``, and
      ``restore(2)`` must raise it;
    - ``absent``: step 2 is not a checkpoint any more (no manifest);
    - ``refuse``: discovery may list step 2 (sizes match), but loading or verifying it
      raises an error containing ``problem``.

    ``crafted``: the damaged state file comes with a manifest that matches it, so
    ``verify`` (an integrity check against the manifest) may pass; only loading it
    must fail.
    """

    name: str
    damage: Callable[[Ctx], None]
    expect: str
    problem: str
    crafted: bool = False


def _truncate(n: int) -> Callable[[Ctx], None]:
    def f(ctx: Ctx) -> None:
        p = os.path.join(ctx.ckpt, STATE)
        os.truncate(p, n if n >= 0 else os.path.getsize(p) + n)

    return f


def _flip(where: str) -> Callable[[Ctx], None]:
    def f(ctx: Ctx) -> None:
        data = bytearray(ctx.state_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        i = {"data": len(data) - 5, "header": 8 + n // 2, "length": 2}[where]
        data[i] ^= 0x01
        with open(os.path.join(ctx.ckpt, STATE), "wb") as fh:
            fh.write(data)

    return f


def _manifest_edit(fn: Callable[[dict[str, Any], Ctx], Any]) -> Callable[[Ctx], None]:
    def f(ctx: Ctx) -> None:
        doc = ctx.manifest()
        fn(doc, ctx)
        ctx.write_manifest(doc)

    return f


def _set_file(key: str, value: Any) -> Callable[[dict[str, Any], Ctx], None]:
    def f(doc: dict[str, Any], ctx: Ctx) -> None:
        v = value(ctx) if callable(value) else value
        doc["files"][0][key] = v

    return f


def _symlink_state_out(ctx: Ctx) -> None:
    p = os.path.join(ctx.ckpt, STATE)
    os.unlink(p)
    os.symlink(ctx.secret, p)
    # The manifest is made to match the secret, so following the link would "work".
    with open(ctx.secret, "rb") as f:
        data = f.read()
    doc = ctx.manifest()
    h = Hasher(doc["checksum_algorithm"])
    h.update(data)
    doc["files"][0].update(size=len(data), checksum=h.hexdigest())
    ctx.write_manifest(doc)


def _escape_to_secret(kind: str) -> Callable[[Ctx], None]:
    def f(ctx: Ctx) -> None:
        with open(ctx.secret, "rb") as fh:
            data = fh.read()
        doc = ctx.manifest()
        h = Hasher(doc["checksum_algorithm"])
        h.update(data)
        rel = os.path.relpath(ctx.secret, ctx.ckpt) if kind == "dotdot" else ctx.secret
        doc["files"][0].update(path=rel, size=len(data), checksum=h.hexdigest())
        ctx.write_manifest(doc)

    return f


def _symlink_manifest_out(ctx: Ctx) -> None:
    # A manifest outside the checkpoint, valid in every way, reached through a symlink.
    outside_manifest = os.path.join(ctx.outside, "manifest.json")
    shutil.copyfile(os.path.join(ctx.ckpt, MANIFEST_NAME), outside_manifest)
    os.unlink(os.path.join(ctx.ckpt, MANIFEST_NAME))
    os.symlink(outside_manifest, os.path.join(ctx.ckpt, MANIFEST_NAME))


def _manifest_sparse(ctx: Ctx) -> None:
    # A 10 TiB manifest with no blocks: read whole before its size was checked, it was
    # a MemoryError that stopped discovery of the whole root (issue 11, defect 5).
    os.truncate(os.path.join(ctx.ckpt, MANIFEST_NAME), 10 << 40)


def _checkpoint_linked_out(ctx: Ctx) -> None:
    # Step 2 moved out of ROOT and linked back: a link is never a checkpoint (issue 11,
    # defect 9: restore read, and retention deleted, whatever it pointed to).
    moved = os.path.join(ctx.outside, "checkpoint-2")
    os.rename(ctx.ckpt, moved)
    os.symlink(moved, ctx.ckpt)


def _fifo_state(ctx: Ctx) -> None:
    p = os.path.join(ctx.ckpt, STATE)
    os.unlink(p)
    os.mkfifo(p)
    doc = ctx.manifest()
    h = Hasher(doc["checksum_algorithm"])
    doc["files"][0].update(size=0, checksum=h.hexdigest())
    ctx.write_manifest(doc)


def _dir_state(ctx: Ctx) -> None:
    p = os.path.join(ctx.ckpt, STATE)
    os.unlink(p)
    os.mkdir(p)


def _pickle_payload(ctx: Ctx) -> None:
    blob = pickle.dumps(Marker(ctx.marker))
    ctx.replace_state(tree_file({"pickle": "obj"}, {"obj": ("U8", [len(blob)], blob)}))


def _pickle_key(ctx: Ctx) -> None:
    blob = pickle.dumps(Marker(ctx.marker))
    tree = {"dict": [[{"pickle": "k"}, 1]]}
    ctx.replace_state(tree_file(tree, {"k": ("U8", [len(blob)], blob)}))


def _future_format(ctx: Ctx) -> None:
    _edit_header(
        ctx, lambda h: h["__metadata__"].update({"atomic_checkpoint.format_version": "99"})
    )


def _header_length(n: int) -> Callable[[Ctx], None]:
    def f(ctx: Ctx) -> None:
        data = ctx.state_bytes()
        ctx.replace_state(struct.pack("<Q", n) + data[8:])

    return f


def _offsets_out_of_range(ctx: Ctx) -> None:
    def f(h: dict[str, Any]) -> None:
        name = next(k for k in h if k != "__metadata__")
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b, e + (1 << 40)]

    _edit_header(ctx, f)


def _offsets_overlap(ctx: Ctx) -> None:
    def f(h: dict[str, Any]) -> None:
        names = [k for k in h if k != "__metadata__"]
        a, b = sorted(names, key=lambda k: h[k]["data_offsets"][0])[:2]
        h[b]["data_offsets"] = [
            h[a]["data_offsets"][0],
            h[a]["data_offsets"][0] + (h[b]["data_offsets"][1] - h[b]["data_offsets"][0]),
        ]

    _edit_header(ctx, f)


def _shape_bomb(ctx: Ctx) -> None:
    # 2**31 x 2**31 float32 elements claimed for a 64-byte entry: must not allocate.
    tree = {"tensor": "t"}
    entries = {"t": ("F32", [1 << 31, 1 << 31], b"\0" * 64)}
    ctx.replace_state(tree_file(tree, entries))


def _zero_size_overflow(shape: list[int]) -> Callable[[Ctx], None]:
    # No elements, so no bytes: the sizes still overflow torch's int64 strides (issue 11,
    # defect 10: TypeError/RuntimeError from torch.empty instead of a corrupt checkpoint).
    def f(ctx: Ctx) -> None:
        ctx.replace_state(tree_file({"tensor": "t"}, {"t": ("F32", shape, b"")}))

    return f


def _nesting_bomb_tree(ctx: Ctx) -> None:
    # A tree nested deeper than any state: JSON parsers recurse.
    raw_tree = _nested(100_000)
    header = {
        "__metadata__": {
            "format": "pt",
            "atomic_checkpoint.format_version": "1",
            "atomic_checkpoint.tree": raw_tree,
        }
    }
    ctx.replace_state(safetensors(header))


def _nesting_bomb_header(ctx: Ctx) -> None:
    raw = b'{"__metadata__": {"format": "pt"}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    ctx.replace_state(safetensors(raw))


def _dunder_attrs(ctx: Ctx) -> None:
    tree = {"odict": [["a", 1]], "attrs": [["__class__", {"tuple": []}], ["__reduce_ex__", 1]]}
    ctx.replace_state(tree_file(tree, {}))


def _unknown_dtype(ctx: Ctx) -> None:
    ctx.replace_state(tree_file({"tensor": "t"}, {"t": ("X99", [2], b"\0" * 8)}))


def _missing_entry(ctx: Ctx) -> None:
    ctx.replace_state(tree_file({"tensor": "nope"}, {"t": ("F32", [2], b"\0" * 8)}))


def _duplicate_keys(ctx: Ctx) -> None:
    raw = (
        b'{"__metadata__": {"format": "pt"}, "t": {"dtype": "F32", "shape": [1], '
        b'"data_offsets": [0, 4]}, "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    )
    ctx.replace_state(safetensors(raw, b"\0" * 8))


def _not_utf8(ctx: Ctx) -> None:
    ctx.replace_state(safetensors(b'{"__metadata__": {"format": "\xff\xfe"}}'))


def _nan_in_tree(ctx: Ctx) -> None:
    header = {
        "__metadata__": {
            "format": "pt",
            "atomic_checkpoint.format_version": "1",
            "atomic_checkpoint.tree": '{"float": NaN}',
        }
    }
    ctx.replace_state(safetensors(header))


CASES: list[Case] = [
    Case("truncate-state", _truncate(-10), "skip", "bytes"),
    Case("truncate-state-to-0", _truncate(0), "skip", "bytes"),
    Case(
        "truncate-manifest",
        lambda c: os.truncate(os.path.join(c.ckpt, MANIFEST_NAME), 40),
        "skip",
        "JSON",
    ),
    Case(
        "empty-manifest",
        lambda c: os.truncate(os.path.join(c.ckpt, MANIFEST_NAME), 0),
        "skip",
        "JSON",
    ),
    Case("flip-data", _flip("data"), "refuse", "checksum"),
    Case("flip-header", _flip("header"), "refuse", ""),
    Case("flip-length", _flip("length"), "refuse", ""),
    Case("wrong-checksum", _manifest_edit(_set_file("checksum", "0" * 16)), "refuse", "checksum"),
    Case("delete-state", lambda c: os.unlink(os.path.join(c.ckpt, STATE)), "skip", "missing"),
    Case("delete-manifest", lambda c: os.unlink(os.path.join(c.ckpt, MANIFEST_NAME)), "absent", ""),
    Case("mangle-manifest", lambda c: c.write_manifest(None, b"{not json"), "skip", "JSON"),
    Case("manifest-is-a-list", lambda c: c.write_manifest([1, 2]), "skip", "object"),
    Case("manifest-size-string", _manifest_edit(_set_file("size", "12")), "skip", "type"),
    Case("manifest-no-files", _manifest_edit(lambda d, c: d.pop("files")), "skip", "files"),
    Case(
        "manifest-nesting-bomb",
        lambda c: c.write_manifest(None, b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "skip",
        "nested too deeply",
    ),
    Case(
        "manifest-400-digit-time",
        _manifest_edit(lambda d, c: d.update(created_unix=10**400)),
        "skip",
        "created_unix",
    ),
    Case("manifest-sparse-10TiB", _manifest_sparse, "skip", f"{10 << 40} bytes"),
    Case("checkpoint-linked-out", _checkpoint_linked_out, "skip", "symbolic link"),
    Case("manifest-step-mismatch", _manifest_edit(lambda d, c: d.update(step=7)), "skip", "step"),
    Case(
        "manifest-file-twice",
        _manifest_edit(lambda d, c: d["files"].append(dict(d["files"][0]))),
        "skip",
        "twice",
    ),
    Case(
        "manifest-bad-algorithm",
        _manifest_edit(lambda d, c: d.update(checksum_algorithm="md5")),
        "skip",
        "algorithm",
    ),
    Case(
        "future-schema", _manifest_edit(lambda d, c: d.update(schema_version=999)), "skip", "newer"
    ),
    Case("escape-dotdot", _escape_to_secret("dotdot"), "skip", ".."),
    Case("escape-absolute", _escape_to_secret("absolute"), "skip", "absolute"),
    Case(
        "escape-backslash", _manifest_edit(_set_file("path", "..\\..\\secret")), "skip", "backslash"
    ),
    Case("escape-nul", _manifest_edit(_set_file("path", "rank\x00.safetensors")), "skip", "NUL"),
    Case("symlink-state-out", _symlink_state_out, "skip", "outside"),
    Case("symlink-manifest-out", _symlink_manifest_out, "skip", "outside"),
    Case("absurd-size-huge", _manifest_edit(_set_file("size", 1 << 60)), "skip", "absurd"),
    Case("absurd-size-negative", _manifest_edit(_set_file("size", -1)), "skip", "absurd"),
    Case(
        "size-off-by-one",
        _manifest_edit(
            _set_file("size", lambda c: os.path.getsize(os.path.join(c.ckpt, STATE)) + 1)
        ),
        "skip",
        "bytes",
    ),
    Case("state-is-a-fifo", _fifo_state, "skip", "regular"),
    Case("state-is-a-directory", _dir_state, "skip", ""),
    Case("pickle-payload", _pickle_payload, "refuse", "pickle", crafted=True),
    Case("pickle-payload-as-key", _pickle_key, "refuse", "pickle", crafted=True),
    Case("future-format-version", _future_format, "refuse", "format version 99", crafted=True),
    Case("header-length-2**63", _header_length(1 << 63), "refuse", "header length", crafted=True),
    Case(
        "header-length-past-end", _header_length(1 << 20), "refuse", "header length", crafted=True
    ),
    Case("offsets-out-of-range", _offsets_out_of_range, "refuse", "", crafted=True),
    Case("offsets-overlap", _offsets_overlap, "refuse", "overlap", crafted=True),
    Case("shape-bomb", _shape_bomb, "refuse", "", crafted=True),
    Case("shape-[0,2**63]", _zero_size_overflow([0, 1 << 63]), "refuse", "2**63", crafted=True),
    Case(
        "shape-[0,2**40,2**40]",
        _zero_size_overflow([0, 1 << 40, 1 << 40]),
        "refuse",
        "too large",
        crafted=True,
    ),
    Case("tree-nesting-bomb", _nesting_bomb_tree, "refuse", "", crafted=True),
    Case("header-nesting-bomb", _nesting_bomb_header, "refuse", "", crafted=True),
    Case("dunder-attributes", _dunder_attrs, "refuse", "not allowed", crafted=True),
    Case("unknown-dtype", _unknown_dtype, "refuse", "X99", crafted=True),
    Case("tree-names-missing-entry", _missing_entry, "refuse", "lacks", crafted=True),
    Case("duplicate-header-keys", _duplicate_keys, "refuse", "", crafted=True),
    Case("header-not-utf8", _not_utf8, "refuse", "UTF-8", crafted=True),
    Case("nan-in-tree", _nan_in_tree, "refuse", "", crafted=True),
]

#: Error types a reader may raise for a bad checkpoint.
PRECISE = (
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "CheckpointNotFoundError",
    "StorageError",
)


# ------------------------------------------------------------------ running readers


def _call(fn: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", value)``, ``("error", exc)`` or ``("hang", None)`` within the bound."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["ok"] = fn()
        except BaseException as exc:  # a reader must never raise anything else either
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(CALL_TIMEOUT_S)
    if t.is_alive():
        return "hang", t
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("ok")


def _release_fifo(ctx: Ctx, thread: threading.Thread) -> None:
    """A reader blocked opening a FIFO wakes up when a writer opens and closes it."""
    p = os.path.join(ctx.ckpt, STATE)
    for _ in range(3):
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
        thread.join(2)
        if not thread.is_alive():
            return


def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    tally = Tally("bad-input")
    base = fresh_dir(os.path.join(workdir, "bad-input"))
    use_cli = True
    for i, case in enumerate(CASES):
        _run_case(tally, case, os.path.join(base, f"{i:02d}-{case.name}"), use_cli)
    progress(f"bad-input: {len(CASES)} cases, {tally.violations} violations")
    return tally.finish()


def _setup(where: str) -> Ctx:
    root = os.path.join(where, "root")
    outside = os.path.join(where, "outside")
    os.makedirs(outside)
    mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
    mgr.save(1, expected_state(1, 0, SIZE))
    mgr.save(2, expected_state(2, 0, SIZE))
    mgr.close()
    # The secret: a valid state file of another step, outside the root; reading it
    # would restore step 99's state in place of step 2's.
    other = os.path.join(where, "other")
    om = CheckpointManager(other, coordinator=SingleProcessCoordinator())
    om.save(99, expected_state(99, 0, SIZE))
    om.close()
    secret = os.path.join(outside, "secret.safetensors")
    shutil.copyfile(os.path.join(other, "checkpoint-99", STATE), secret)
    shutil.rmtree(other)
    return Ctx(
        root, os.path.join(root, "checkpoint-2"), outside, secret, os.path.join(where, "EXECUTED")
    )


def _run_case(tally: Tally, case: Case, where: str, use_cli: bool) -> None:
    tally.trials += 1
    tally.faults += 1
    ctx = _setup(where)
    case.damage(ctx)
    label = case.name
    log = logging.getLogger("atomic_checkpoint")
    warned = logging.handlers.BufferingHandler(capacity=sys.maxsize)  # keeps every record
    warned.setLevel(logging.WARNING)
    log.addHandler(warned)
    watch = OpenWatch([ctx.secret, ctx.outside])
    outcomes: dict[str, tuple[str, Any]] = {}
    try:
        mgr = CheckpointManager(ctx.root, read_only=True, coordinator=SingleProcessCoordinator())
        calls: dict[str, Callable[[], Any]] = {
            "latest": mgr.latest,
            "restore(2)": lambda: mgr.restore(2),
            "verify(2)": lambda: mgr.verify(2),
            "restore()": mgr.restore,
            "restore(2, verify=False)": lambda: mgr.restore(2, verify=False),
        }
        for what, fn in calls.items():
            kind, value = outcomes[what] = _call(fn)
            if kind == "hang":
                tally.violate("hangs", f"{label}: {what} blocked for {CALL_TIMEOUT_S:g} s")
                _release_fifo(ctx, value)
        if use_cli:
            for cmd in (["verify", ctx.root, "2"], ["inspect", ctx.root, "2"], ["list", ctx.root]):
                _cli(tally, label, case, cmd)
        seen = watch.events()
    finally:
        watch.close()
        log.removeHandler(warned)
    if seen:
        tally.violate(
            "unsafe", f"{label}: a reader opened or read outside the checkpoint: {seen[:3]}"
        )
    if os.path.exists(ctx.marker):
        tally.violate("unsafe", f"{label}: code from the checkpoint ran (marker file created)")
    _judge(tally, label, case, outcomes, [r.getMessage() for r in warned.buffer])
    if case.name.startswith("pickle-payload"):
        # The proof is only a proof if the payload is live: with allow_pickle=True
        # (trusting the checkpoint) it runs.
        trusted = CheckpointManager(
            ctx.root, read_only=True, allow_pickle=True, coordinator=SingleProcessCoordinator()
        )
        _call(lambda: trusted.restore(2))
        if not os.path.exists(ctx.marker):
            tally.violate("stuck", f"{label}: the payload is not live: the proof proves nothing")
        tally.count("live_payload_ran_when_trusted", label)


def _judge(
    tally: Tally,
    label: str,
    case: Case,
    outcomes: dict[str, tuple[str, Any]],
    warnings: list[str],
) -> None:
    good1 = expected_state(1, 0, SIZE)
    good2 = expected_state(2, 0, SIZE)
    kind, latest = outcomes["latest"]
    if kind == "error":
        _precise(tally, label, "latest", latest, case)
    elif kind == "ok":
        listed = latest.step if latest is not None else None
        if case.expect in ("skip", "absent") and listed != 1:
            tally.violate("torn", f"{label}: resume picked step {listed}, not the valid step 1")
        if case.expect == "skip" and not any("checkpoint-2" in w for w in warnings):
            tally.violate("unclear", f"{label}: step 2 was skipped without a warning naming it")
        elif case.expect == "skip" and not any(case.problem in w for w in warnings):
            tally.violate(
                "unclear", f"{label}: the warning does not say {case.problem!r}: {warnings}"
            )
    for what in ("restore(2)", "verify(2)"):
        kind, value = outcomes[what]
        if kind == "ok":
            if what == "restore(2)" and states_equal(value, good2):
                tally.count("loaded_exactly_anyway", label)
                continue
            if what == "verify(2)" and case.crafted:
                continue  # the bytes match their manifest: only loading can object
            tally.violate("torn", f"{label}: {what} accepted the damaged checkpoint")
        elif kind == "error":
            _precise(tally, label, what, value, case)
    kind, value = outcomes["restore()"]
    if kind == "ok" and not (states_equal(value, good1) or states_equal(value, good2)):
        tally.violate("torn", f"{label}: restore() returned a state that was never saved")
    elif kind == "error":
        _precise(tally, label, "restore()", value, case)
    kind, value = outcomes["restore(2, verify=False)"]
    if kind == "ok" and not states_equal(value, good2):
        # Without checksums a flipped data byte goes through: the user asked for that.
        # Anything the manifest or the header says must still be enforced.
        if not case.name.startswith("flip"):
            tally.violate("torn", f"{label}: restore(verify=False) returned a damaged state")
    elif kind == "error":
        _precise(tally, label, "restore(2, verify=False)", value, case)


def _precise(tally: Tally, label: str, what: str, exc: Any, case: Case) -> None:
    desc = describe_error(exc)
    tally.count("errors", desc["type"])
    if not isinstance(exc, CheckpointError):
        tally.violate("unclear", f"{label}: {what} raised {desc['type']}: {desc['message'][:200]}")
        return
    if isinstance(exc, CheckpointNotFoundError) and case.expect != "absent" and what != "restore()":
        tally.violate("unclear", f"{label}: {what} says not found instead of what is wrong: {exc}")
        return
    msg = desc["message"]
    if "checkpoint-2" not in msg and STATE not in msg and what != "restore()":
        tally.violate(
            "unclear", f"{label}: {what} does not name the checkpoint or file: {msg[:200]}"
        )
    named = what == "restore(2)" or (what == "verify(2)" and case.expect != "refuse")
    if case.problem and case.problem not in msg and named:
        tally.violate("unclear", f"{label}: {what} does not say {case.problem!r}: {msg[:200]}")


def _cli(tally: Tally, label: str, case: Case, cmd: list[str]) -> None:
    try:
        done = run_module("atomic_checkpoint", *cmd, timeout_s=CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        tally.violate("hangs", f"{label}: atomic-checkpoint {cmd[0]} blocked")
        return
    out = done.stdout + done.stderr
    if "Traceback" in out:
        tally.violate("unclear", f"{label}: atomic-checkpoint {cmd[0]} crashed: {out[-300:]}")
    tally.count(f"cli_{cmd[0]}_exit", str(done.returncode))
    if cmd[0] == "verify" and not case.crafted and done.returncode == 0:
        tally.violate("torn", f"{label}: atomic-checkpoint verify passed a broken checkpoint")
