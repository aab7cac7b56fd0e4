"""The manifest (commit record), its JSON schema, and streaming checksums.

``checkpoint.manifest.json`` is written last in every save. A checkpoint is complete
exactly when its manifest exists, parses, validates against this schema, and every file
it lists exists with the listed size; a full verify also recomputes the checksums.

Checksums are xxh3-64 computed while the data is written (no second pass): at tens of
GB/s it is never the bottleneck next to a disk. ``crc32`` is accepted on read for
manifests written without xxhash.

The manifest checksums itself too (``manifest_checksum``, over the canonical JSON of
every other field): a flipped byte in its metrics or metadata (which no file checksum
covers, and which ``KeepBest`` and a resuming job act on) makes the manifest corrupt
instead of a wrong value read back. Manifests without the field (written before it)
are still read; readers that predate it ignore it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A declared dependency, imported up front: without it the package does not import (a
# checksum it could not compute read as a corrupt checkpoint, and verify called healthy
# ones CORRUPT). Checkpoints of the crc32 algorithm read with zlib.
import xxhash as _xxhash

from .errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedSchemaError
from .layout import parse_rank_state_file, rank_state_file, validate_relative_path, validate_step

SCHEMA_VERSION = 1
FORMAT_NAME = "atomic-checkpoint"
log = logging.getLogger("atomic_checkpoint")

MAX_FILE_SIZE = 1 << 50  # 1 PiB: anything larger in a manifest is corrupt, not a checkpoint
MAX_MANIFEST_BYTES = 64 << 20
# Integers in a manifest (commit sequence, world size, ranks, counts) are below this;
# a 400-digit number is corrupt, not a counter.
_MAX_INT = 1 << 63
#: The most ranks a manifest may record (over ten times the largest jobs run today).
MAX_WORLD_SIZE = 1 << 20
# created_unix is within this many seconds of the epoch (year ~33,000): a float like
# 1e300 would crash whatever formats it as a date.
_MAX_UNIX_S = 1e12

DEFAULT_ALGORITHM = "xxh3_64"


class Hasher:
    """Streaming checksum: ``update(bytes-like)`` then ``hexdigest()``."""

    __slots__ = ("_crc", "_h", "algorithm")

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM):
        self.algorithm = algorithm
        self._crc = 0
        if algorithm == "xxh3_64":
            self._h: Any = _xxhash.xxh3_64()
        elif algorithm == "crc32":
            self._h = None
        else:
            raise UnsupportedSchemaError(f"unknown checksum algorithm {algorithm!r}")

    def update(self, data: Any) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        if self._h is not None:
            return str(self._h.hexdigest())
        return f"{self._crc:08x}"

    def consume(
        self,
        reader: Any,
        view: memoryview,
        progress: Callable[[int], None] | None = None,
        done: int = 0,
    ) -> int:
        """Hash everything ``reader`` has left, read into the caller's buffer ``view``
        (``readinto``: no copy per chunk); the one loop that checksums a file, for the
        save, adoption and verification. Returns the bytes read.

        Args:
            reader: a file open for reading (``Storage.open_read`` or ``open``).
            view: the buffer each chunk is read into; its size is the chunk size.
            progress: called after each chunk with ``done`` plus the bytes read so far.
            done: what ``progress`` counts from (bytes of earlier files).
        """
        size = 0
        while n := reader.readinto(view):
            self.update(view[:n])
            size += n
            if progress is not None:
                progress(done + size)
        return size


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint, size, checksum."""

    path: str
    size_bytes: int
    checksum: str
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size_bytes, "checksum": self.checksum}
        if self.rank is not None:
            d["rank"] = self.rank
        return d


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as every rank sees it after ``save()``.

    Attributes:
        step: the training step.
        path: where the checkpoint lives (a local path or a storage URL).
        size_bytes: total bytes of its files.
        metrics: user metrics recorded with it (e.g. ``{"eval_loss": 0.31}``).
        created_unix: commit time (seconds since the epoch), from the manifest.
        run_id: the run that wrote it.
        commit_seq: commit number within ROOT, above that of every checkpoint there when
            it was committed. Numbers of checkpoints deleted since (a ``rollback``, then
            a restart) may be used again: a commit is ``(step, commit_seq,
            created_unix)``, not ``commit_seq`` alone.
        timings_s: per-phase durations of the save that produced it, in seconds (only
            on the ``CheckpointInfo`` a save returns): ``prepare``, ``write``, ``fsync``,
            ``gather``, ``commit``, ``publish`` and ``total``; ``snapshot`` (the copy
            into host memory) for an async save.
        metadata: the JSON metadata recorded with it (as JSON gives it back).
        adopted: written by a framework and recorded afterwards by ``adopt()``: its
            checksums were taken at adoption, not while the files were written.
        files_dir: for a checkpoint of files (``saving()``, the integrations) written in
            place by the marker strategy (object stores, s3fs-fuse mounts), the folder
            inside ``path`` that holds them (``attempt-<token>``); else ``""``. See
            ``files_path``.
    """

    step: int
    path: str
    size_bytes: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    created_unix: float = 0.0
    run_id: str = ""
    commit_seq: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # How long the save took is not what the checkpoint is: the info a save returns
    # equals the one latest() reads back (it did not: `info in mgr.checkpoints()` was
    # False for the checkpoint just saved).
    timings_s: Mapping[str, float] = field(default_factory=dict, compare=False)
    adopted: bool = False
    files_dir: str = ""

    @property
    def files_path(self) -> str:
        """Where the checkpoint's files are, for a framework that loads them by path
        (``from_pretrained``, DCP's reader): ``path`` itself, or, for files written in
        place by the marker strategy, its ``attempt-<token>`` folder (``files_dir``).
        The manifest is in ``path`` either way."""
        return f"{self.path.rstrip('/')}/{self.files_dir}" if self.files_dir else self.path


#: How many lowercase hexadecimal digits a checksum of each algorithm has.
_HEX_DIGITS = {"xxh3_64": 16, "crc32": 8}
_HEX = frozenset("0123456789abcdef")


def _is_hex(text: str, digits: int) -> bool:
    return len(text) == digits and set(text) <= _HEX


#: The manifest's checksum of its own other fields (see the module docstring).
_SELF_CHECKSUM = "manifest_checksum"


def _body_checksum(doc: Mapping[str, Any], algorithm: str) -> str:
    """The checksum of a manifest's fields ``doc`` (without ``_SELF_CHECKSUM``), over
    their canonical JSON: what a reader parses and dumps again gives the same bytes."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    h = Hasher(algorithm)
    h.update(text.encode("ascii"))
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    step: int
    run_id: str
    commit_seq: int
    world_size: int
    files: tuple[FileEntry, ...]
    state_kind: str  # "per_rank" | "replicated" | "files"
    created_unix: float = field(default_factory=time.time)
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    checksum_algorithm: str = DEFAULT_ALGORITHM
    strategy: str = "rename"
    schema_version: int = SCHEMA_VERSION
    library_version: str = ""
    # Node-local storage: the ranks whose files this domain's copy holds, and how many
    # domains must commit the step before it counts (see domains.py).
    domain_ranks: tuple[int, ...] | None = None
    domain_count: int = 1
    # Recorded by ``adopt()`` over files a framework wrote (checksums taken then). Written
    # only when true, as a key older readers ignore: schema version 1 still reads it.
    adopted: bool = False

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def belongs_to(self, run_id: str) -> bool:
        """Whether this is a checkpoint of run ``run_id``. One that records no run
        (``run_id == ""``: a path-style ``integrations.dcp.save(checkpoint_id=...)``
        made without a manager, or such a directory adopted by path) is the run's of
        whichever root holds it: a job that saved path-style and then opens a manager
        there resumes from those checkpoints."""
        return not self.run_id or self.run_id == run_id

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise CorruptCheckpointError(f"checkpoint step {self.step} has no file {path!r}")

    def to_json_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "schema_version": self.schema_version,
            "library_version": self.library_version,
            "step": self.step,
            "run_id": self.run_id,
            "commit_seq": self.commit_seq,
            "world_size": self.world_size,
            "state_kind": self.state_kind,
            "strategy": self.strategy,
            "created_unix": self.created_unix,
            "checksum_algorithm": self.checksum_algorithm,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
            "files": [f.to_json() for f in self.files],
        }
        if self.domain_count > 1:
            doc["domain"] = {"ranks": list(self.domain_ranks or ()), "count": self.domain_count}
        if self.adopted:
            doc["adopted"] = True
        doc[_SELF_CHECKSUM] = _body_checksum(doc, self.checksum_algorithm)
        data = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode("utf-8")
        if len(data) > MAX_MANIFEST_BYTES:
            # Indentation grows with nesting (deep metadata: ~9x): the compact form is
            # the same document, and readers parse either.
            compact = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
            data = compact.encode("utf-8")
        if len(data) > MAX_MANIFEST_BYTES:
            # Written, it would be a checkpoint that every reader refuses by its size:
            # a save that returned and is never listed.
            raise ValueError(
                f"the manifest of step {self.step} would be {len(data)} bytes, more than "
                f"the {MAX_MANIFEST_BYTES} bytes readers accept ({len(self.files)} files, "
                f"{len(self.metrics)} metrics): save fewer files (e.g. one per rank) or "
                "record less in metrics and metadata. Nothing was committed"
            )
        return data + b"\n"

    @classmethod
    def from_json_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest; every problem raises CorruptCheckpointError."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{where}: manifest is {len(data)} bytes, too large")
        try:
            text = data.decode("utf-8")
            doc = json.loads(text, parse_constant=_no_constant, object_pairs_hook=no_duplicate_keys)
        except RecursionError as exc:
            # Deeply nested arrays or objects: json recurses once per level.
            raise CorruptCheckpointError(
                f"{where}: manifest is not valid JSON (nested too deeply to parse)"
            ) from exc
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({exc})") from exc
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{where}: manifest is not a JSON object")
        if doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: not an atomic-checkpoint manifest")
        version = doc.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version >= _MAX_INT:
            raise CorruptCheckpointError(f"{where}: schema_version missing or not an int")
        if version > SCHEMA_VERSION:
            raise UnsupportedSchemaError(
                f"{where}: schema version {version} was written by a newer atomic-checkpoint "
                f"(this one reads up to {SCHEMA_VERSION}); upgrade atomic-checkpoint to load it"
            )
        try:
            step = validate_step(_get(doc, "step", int, where))
            files = []
            seen = set()
            raw_files = _get(doc, "files", list, where)
            for raw in raw_files:
                if not isinstance(raw, dict):
                    raise CorruptCheckpointError(f"{where}: a file entry is not an object")
                path = _get(raw, "path", str, where)
                try:
                    validate_relative_path(path)
                except ValueError as exc:
                    raise UnsafeCheckpointError(f"{where}: {exc}; refusing to load") from exc
                if path in seen:
                    raise CorruptCheckpointError(f"{where}: file {path!r} is listed twice")
                seen.add(path)
                size = _get(raw, "size", int, where)
                if size < 0 or size > MAX_FILE_SIZE:
                    raise CorruptCheckpointError(
                        f"{where}: file {path!r} has absurd size {_short(size)}"
                    )
                rank = raw.get("rank")
                if rank is not None and (
                    not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < _MAX_INT
                ):
                    raise CorruptCheckpointError(f"{where}: file {path!r} has invalid rank")
                files.append(FileEntry(path, size, _get(raw, "checksum", str, where), rank))
            metrics = _get(doc, "metrics", dict, where)
            for k, v in metrics.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise CorruptCheckpointError(f"{where}: metric {k!r} is not a number")
                if not (isinstance(v, float) or abs(v) < _MAX_INT) or not math.isfinite(v):
                    raise CorruptCheckpointError(
                        f"{where}: metric {k!r} is {_short(v)}, not a finite number"
                    )
            algorithm = _get(doc, "checksum_algorithm", str, where)
            if algorithm not in _HEX_DIGITS:
                raise UnsupportedSchemaError(f"{where}: unknown checksum algorithm {algorithm!r}")
            for f in files:
                # As the format says: lowercase hex of the algorithm's length. Anything
                # else can never match a file, and full verification then blamed the
                # (intact) file for the manifest's error.
                if not _is_hex(f.checksum, _HEX_DIGITS[algorithm]):
                    raise CorruptCheckpointError(
                        f"{where}: file {f.path!r} has checksum {f.checksum!r:.40}, not "
                        f"{_HEX_DIGITS[algorithm]} lowercase hex digits ({algorithm})"
                    )
            # ``rename``, ``marker`` or the name of a strategy object the user passed.
            strategy = _get(doc, "strategy", str, where)
            if not strategy:
                raise CorruptCheckpointError(f"{where}: the manifest names no strategy")
            world = _get(doc, "world_size", int, where)
            if not 1 <= world <= MAX_WORLD_SIZE:
                # Bounded: readers build per-rank lists (a hostile 2**62 hung them all).
                raise CorruptCheckpointError(
                    f"{where}: world_size {_short(world)} is not in 1..{MAX_WORLD_SIZE}"
                )
            for f in files:
                # The rank whose state a file holds (the format): one of the job's ranks,
                # and for a per-rank save's state file the one its name says (files of
                # saving() and the integrations are named by whoever wrote them).
                if f.rank is None:
                    continue
                if f.rank >= world:
                    raise CorruptCheckpointError(
                        f"{where}: file {f.path!r} records rank {f.rank}, but world_size is "
                        f"{world} (ranks 0..{world - 1})"
                    )
                named = parse_rank_state_file(f.path.rsplit("/", 1)[-1])
                if doc.get("state_kind") == "per_rank" and named not in (None, f.rank):
                    raise CorruptCheckpointError(
                        f"{where}: file {f.path!r} records rank {f.rank}, not the rank its "
                        "name says"
                    )
            domain_ranks: tuple[int, ...] | None = None
            domain_count = 1
            if "domain" in doc:
                dom = _get(doc, "domain", dict, where)
                ranks = _get(dom, "ranks", list, where)
                domain_count = _get(dom, "count", int, where)
                if not 1 <= domain_count < _MAX_INT or not all(
                    isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in ranks
                ):
                    raise CorruptCheckpointError(f"{where}: invalid storage-domain record")
                domain_ranks = tuple(ranks)
            adopted = doc.get("adopted", False)
            if not isinstance(adopted, bool):
                raise CorruptCheckpointError(f"{where}: manifest field 'adopted' is not a bool")
            kind = _get(doc, "state_kind", str, where)
            if kind not in ("per_rank", "replicated", "files"):
                raise CorruptCheckpointError(f"{where}: unknown state_kind {kind!r:.80}")
            if kind == "per_rank":
                # Every rank's file, or a checkpoint that lists rank 0's alone verified
                # and was listed, and restore(rank=1) failed on it.
                have = {f.path.rsplit("/", 1)[-1] for f in files}
                ranks = domain_ranks if domain_ranks is not None else range(world)
                # The first 9 lacking ranks, found within len(have) + 9 ranks whatever
                # world_size claims (a list over range(2**62) hung every reader).
                lacking = []
                for r in ranks:
                    if rank_state_file(r) not in have:
                        lacking.append(r)
                        if len(lacking) > 8:
                            break
                if lacking:
                    raise CorruptCheckpointError(
                        f"{where}: a per-rank checkpoint of {world} rank(s) that lists no "
                        f"file of rank(s) {lacking[:8]}{' ...' if len(lacking) > 8 else ''}"
                    )
            commit_seq = _get(doc, "commit_seq", int, where)
            if not 0 <= commit_seq < _MAX_INT:
                raise CorruptCheckpointError(
                    f"{where}: commit_seq {_short(commit_seq)} is not in 0..2**63-1"
                )
            created = _get(doc, "created_unix", (int, float), where)
            if not (isinstance(created, float) or abs(created) < _MAX_INT) or not (
                math.isfinite(created) and abs(created) <= _MAX_UNIX_S
            ):
                raise CorruptCheckpointError(
                    f"{where}: created_unix {_short(created)} is not a time (seconds since "
                    "the epoch)"
                )
            if _SELF_CHECKSUM in doc:
                recorded = _get(doc, _SELF_CHECKSUM, str, where)
                body = {k: v for k, v in doc.items() if k != _SELF_CHECKSUM}
                if _body_checksum(body, algorithm) != recorded:
                    raise CorruptCheckpointError(
                        f"{where}: the manifest does not match its own checksum (a field "
                        "such as its metrics or metadata changed after it was written): "
                        "it is corrupt"
                    )
            return cls(
                step=step,
                run_id=_get(doc, "run_id", str, where),
                commit_seq=commit_seq,
                world_size=world,
                files=tuple(files),
                state_kind=kind,
                created_unix=float(created),
                metrics={str(k): float(v) for k, v in metrics.items()},
                metadata=_get(doc, "metadata", dict, where),
                checksum_algorithm=algorithm,
                strategy=strategy,
                schema_version=version,
                library_version=str(doc.get("library_version", "")),
                domain_ranks=domain_ranks,
                domain_count=domain_count,
                adopted=adopted,
            )
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            # A check above that does not cover some hostile shape: still "corrupt",
            # never an error that stops discovery of the rest of ROOT.
            raise CorruptCheckpointError(f"{where}: {type(exc).__name__}: {exc}") from exc

    @property
    def files_dir(self) -> str:
        """The folder inside the checkpoint that holds every listed file: the marker
        strategy's ``attempt-<token>`` when all of them are in one, else ``""``."""
        heads = {f.path.partition("/")[0] for f in self.files if "/" in f.path}
        if len(heads) != 1 or any("/" not in f.path for f in self.files):
            return ""
        head = heads.pop()
        return head if head.startswith("attempt-") else ""

    def info(self, path: str) -> CheckpointInfo:
        """The public view of this checkpoint at ``path`` (its ``checkpoint-<step>``).
        A checkpoint of files (``saving()``, the integrations) written in place by the
        marker strategy keeps them in its ``attempt-<token>/`` folder: ``files_dir``
        (and ``CheckpointInfo.files_path``) names it."""
        return CheckpointInfo(
            files_dir=self.files_dir if self.state_kind == "files" else "",
            step=self.step,
            path=path,
            size_bytes=self.size_bytes,
            metrics=dict(self.metrics),
            created_unix=self.created_unix,
            run_id=self.run_id,
            commit_seq=self.commit_seq,
            metadata=dict(self.metadata),
            adopted=self.adopted,
        )


@dataclass(frozen=True)
class SharedManifest(Manifest):
    """A committed manifest as a rank other than its leader receives it: everything but
    the file list, or only the entries that rank reads (``files``; ``size_bytes`` is
    still the total of every file). So what the leader sends costs O(1) bytes per rank
    rather than N entries to each of N ranks. The manifest in storage has the list."""

    total_size_bytes: int = 0

    @classmethod
    def of(
        cls, manifest: Manifest, keep: Callable[[FileEntry], bool] | None = None
    ) -> SharedManifest:
        """``manifest`` without its files, or with those ``keep`` accepts."""
        fields = {f.name: getattr(manifest, f.name) for f in dataclasses.fields(Manifest)}
        fields["files"] = () if keep is None else tuple(f for f in manifest.files if keep(f))
        return cls(**fields, total_size_bytes=manifest.size_bytes)

    @property
    def size_bytes(self) -> int:
        return self.total_size_bytes


def format_size(size_bytes: float, *, digits: int = 1) -> str:
    """``size_bytes`` (or a rate in bytes/s) for a log line: ``"512 B"``, ``"1.5 GiB"``,
    with ``digits`` decimals above a KiB."""
    n = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} PiB"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` for untrusted documents: a key given twice
    raises ``ValueError``. Python keeps the last, other readers the first (a manifest
    with "files" twice verified here while another tool read another file list); the
    library never writes one."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r:.80}")
            seen.add(key)
    return out


def _short(value: Any) -> str:
    """``value`` for an error message, at most 40 characters (a hostile number can have
    thousands of digits; Python refuses to print ints of more than 4300)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _MAX_INT:
        return f"a {value.bit_length()}-bit integer"
    return f"{value!r:.40}"


def _get(doc: Mapping[str, Any], key: str, typ: Any, where: str) -> Any:
    if key not in doc:
        raise CorruptCheckpointError(f"{where}: manifest field {key!r} is missing")
    value = doc[key]
    if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
        raise CorruptCheckpointError(f"{where}: manifest field {key!r} has the wrong type")
    return value


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """Validate user metrics: a flat mapping of names to numbers. A value that is not
    finite (a diverged loss: NaN, inf; an int too large for a float) is left out with a
    warning, never a reason to lose the save: a checkpoint without the metric is never
    among ``KeepBest``'s best.

    Raises:
        TypeError: ``metrics`` is not a mapping, a name is not a string, or a value is
            not a number.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(
            "metrics must be a mapping of names to numbers, e.g. metrics={'eval_loss': "
            f"0.31}}, got {type(metrics).__name__}"
        )
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metric names must be strings, got {k!r}")
        if hasattr(v, "detach"):  # a tensor (with requires_grad, float() would warn)
            v = v.detach()
        try:
            if isinstance(v, (str, bytes)):  # float("0.5") works, but is a mistake here
                raise TypeError
            value = float(v)  # numbers, numpy scalars, one-element tensors
        except OverflowError:
            value = math.inf
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} must be a number, got {type(v).__name__}") from None
        if not math.isfinite(value):
            log.warning(
                "metric %r is %s: not recorded in the checkpoint (metrics are finite "
                "numbers; KeepBest never counts a checkpoint without it among the best)",
                k,
                value,
            )
            continue
        out[k] = value
    size = sum(len(k) + 24 for k in out)  # as JSON: the name, a float, punctuation
    if size > MAX_METADATA_BYTES:
        raise ValueError(
            f"metrics are about {size} bytes as JSON ({len(out)} names), more than the "
            f"{MAX_METADATA_BYTES} a manifest may hold: record a few numbers to rank "
            "checkpoints by, and the rest in the saved state"
        )
    return out


#: Metadata may take at most this many bytes as JSON: the manifest holding it must stay
#: readable (``MAX_MANIFEST_BYTES``) beside its list of files.
MAX_METADATA_BYTES = 16 << 20


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate user metadata: a mapping that JSON can hold, of a bounded size.

    Raises:
        TypeError: not a mapping, or not JSON-serialisable.
        ValueError: larger than ``MAX_METADATA_BYTES`` as JSON.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(
            "metadata must be a mapping (a dict of JSON values, e.g. metadata={'epoch': 3}), "
            f"got {type(metadata).__name__}"
        )
    try:
        # As the manifest writes it (sorted keys): a dict with keys of mixed types
        # cannot be sorted, and is refused here rather than at the commit.
        text = json.dumps(dict(metadata), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"metadata must be JSON-serialisable, with string keys (or keys of one "
            f"type in each dict): {exc}"
        ) from exc
    if len(text) > MAX_METADATA_BYTES:
        raise ValueError(
            f"metadata is {len(text)} bytes as JSON, more than the {MAX_METADATA_BYTES} a "
            "manifest may hold: put large data in the saved state, not in metadata"
        )
    # What the manifest records and every reader gets back (int keys become strings,
    # tuples lists), so that the CheckpointInfo of the save says the same as latest().
    doc: dict[str, Any] = json.loads(text)
    return doc
