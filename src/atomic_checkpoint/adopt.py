"""Adopting checkpoints that a framework wrote without atomic-checkpoint.

A run that saved with the stock Hugging Face ``Trainer`` (``checkpoint-<N>/``) or with
Accelerate's automatic naming (``checkpoints/checkpoint_<i>/``) has folders without a
manifest: nothing tells a complete one from one torn by a crash. ``adopt`` checks each
with the framework's own completeness rule and records the complete ones as committed
checkpoints, so ``CheckpointManager``, the integrations and the CLI resume from them::

    from atomic_checkpoint import adopt

    result = adopt("out/")            # or: atomic-checkpoint adopt out/
    result.adopted                    # [2, 4]
    result.refused                    # {6: "trainer_state.json is missing: ..."}

What adopting one folder does (under the run lock, like a commit; nothing is moved or
deleted, ever)::

    before                                   after
    ROOT/checkpoint-4/                       ROOT/checkpoint-4/
      model.safetensors  optimizer.pt ...      model.safetensors  optimizer.pt ...
      trainer_state.json                       trainer_state.json
                                               checkpoint.manifest.json  (written last)

1. The framework's rule decides whether the folder is complete (for the Trainer:
   ``trainer_state.json``, which it writes last, and the model weights, every shard an
   index lists, each file whole). A folder that fails is refused, with the reason,
   and nothing is written for it.
2. Every file is read once for its checksum (taken now: the framework wrote no
   checksums) and fsync'd; then its directories and ROOT: the framework never fsyncs,
   and a manifest must never outlive the data it lists (DESIGN invariant 2).
3. The run lock's fencing token is checked, then the manifest, marked ``"adopted":
   true``, is created once (exclusive create: never over a manifest that appeared
   meanwhile) and the folder is fsync'd. On object stores this is the marker
   strategy's commit (a conditional PUT); no in-progress marker is written first, as
   the sweep would then treat the framework's files as an abandoned save of ours.

Adopting is idempotent (a folder with a valid manifest of the run is reported as
``already``), and a dry run reads and checks but writes nothing, not even the run file.
An Accelerate project keeps its names: the folders stay ``checkpoints/checkpoint_<i>``
and the run's own files go beside ``checkpoints/``, never into it (Accelerate lists and
digit-sorts that folder), through the project layout of ``storage.project``, which
adopting records.

Completeness rules are registered per framework (:func:`register_framework`): ``hf``
and ``accelerate`` are built in, ``generic`` (any readable files) is used only when
asked for, and an integration registers its own (Lightning's ``.ckpt`` files, whose
record is their sidecar manifest, through ``record=``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import importlib
import itertools
import json
import logging
import os
import posixpath
import re
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import catalog, layout
from ._checks import flag
from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LockError,
    LockHeldError,
    ResumeError,
    StorageError,
)
from .layout import MANIFEST_NAME, RUN_FILE
from .manifest import FileEntry, Hasher, Manifest, format_size
from .storage import open_storage, posix, storage_for
from .storage.base import Storage, renaming
from .storage.temps import parse_temp_name
from .strategies import choose_strategy, create_or_own

if TYPE_CHECKING:
    from .lock import RunLock

__all__ = [
    "AdoptResult",
    "CheckpointFolder",
    "Framework",
    "accelerate_is_complete",
    "adopt",
    "frameworks",
    "generic_is_complete",
    "hf_is_complete",
    "register_framework",
]

log = logging.getLogger("atomic_checkpoint")

#: The ``framework`` values with a meaning of their own.
AUTO = "auto"
GENERIC = "generic"

_CHUNK = 8 << 20
# JSON files larger than this are not parsed by the completeness checks (a tokenizer
# can be tens of MB; the rules only need the small ones).
_MAX_JSON_BYTES = 64 << 20
# safetensors caps its header at 100 MB; a larger length field is a torn or foreign file.
_MAX_SAFETENSORS_HEADER = 100 << 20
_STEP = r"(0|[1-9][0-9]{0,18})"


# ---------------------------------------------------------------------- the folder
class CheckpointFolder(str):
    """What a completeness rule is given: the folder's path as a ``str`` (its local
    path, or its URL on an object store), with read access through the root's storage
    for rules that must work on object stores too.

    Attributes:
        storage: the root's storage.
        rel: the folder, relative to the root (the protocol's name, ``checkpoint-<step>``).
        step: the step its name gives.
    """

    storage: Storage
    rel: str
    step: int

    def __new__(cls, storage: Storage, rel: str, step: int) -> CheckpointFolder:
        obj = super().__new__(cls, storage.local_path(rel) or storage.url(rel))
        obj.storage, obj.rel, obj.step = storage, rel, step
        obj._files = None
        obj._listings = {}
        return obj

    _files: dict[str, int] | None
    # Directory listings of the folder's siblings (see ``_missing_beside_siblings``),
    # shared by the folders of one adoption so that each sibling is listed once.
    _listings: dict[str, list[str]]

    def files(self) -> dict[str, int]:
        """Every file under the folder (relative path -> size). A symbolic link raises
        ``UnsafeCheckpointError``: a checkpoint holds regular files only. The temporary
        files of this library's own atomic writes (a manifest write killed before its
        rename: ``checkpoint.manifest.json.tmp-...``) are not the framework's and are
        left out."""
        if self._files is None:
            self._files = {
                n: size for n, size in self.storage.walk_files(self.rel) if not is_own_temporary(n)
            }
        return self._files

    def listing(self, rel: str) -> list[str]:
        """The names in directory ``rel`` of the root (read once per adoption)."""
        names = self._listings.get(rel)
        if names is None:
            names = self._listings[rel] = self.storage.listdir(rel)
        return names

    def read_head(self, name: str, n: int) -> bytes:
        """At most ``n`` bytes from the start of file ``name``."""
        with self.storage.open_read(f"{self.rel}/{name}") as f:
            return bytes(f.read(n))

    def read_json(self, name: str) -> Any:
        """File ``name`` parsed as JSON (bounded). Raises ``ValueError`` saying why not."""
        size = self.files().get(name)
        if size is None:
            raise ValueError(f"{name} is missing")
        if size > _MAX_JSON_BYTES:
            raise ValueError(f"{name} is {size} bytes, too large to check")
        data = self.read_head(name, size + 1)
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise ValueError(
                f"{name} is not valid JSON ({type(exc).__name__}: {exc}): torn by a crash "
                "mid-write, or not written whole"
            ) from None


def is_own_temporary(name: str) -> bool:
    """Whether ``name`` (a path relative to a checkpoint folder) is the temporary file
    of one of this library's own atomic writes in that folder (its manifest, a marker)
    that a killed process left: never a file of the checkpoint, so never recorded by
    adopting it (``atomic-checkpoint clean`` removes it once its writer is gone)."""
    if "/" in name:
        return False
    parsed = parse_temp_name(name)
    return parsed is not None and (
        parsed.final == MANIFEST_NAME or layout.parse_marker_name(parsed.final) is not None
    )


# ---------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Framework:
    """A framework's checkpoint naming and completeness rule (see ``register_framework``)."""

    name: str
    names: re.Pattern[str]
    is_complete: Callable[[CheckpointFolder], str | None]
    record: Callable[[CheckpointFolder], bool] | None = None
    auto: bool = True
    step_inside: Callable[[CheckpointFolder], int | str | None] | None = None

    def step_of(
        self, on_disk_name: str, folder: Callable[[], CheckpointFolder] | None = None
    ) -> int | None:
        """The step of the checkpoint named ``on_disk_name``: the one its name gives;
        for a name that matches without one (the step group takes no part), the one
        ``step_inside(folder())`` reads from it; None for no checkpoint of ours."""
        got = self.step_or_why(on_disk_name, folder)
        return got if isinstance(got, int) else None

    def step_or_why(
        self, on_disk_name: str, folder: Callable[[], CheckpointFolder] | None
    ) -> int | str | None:
        """``step_of``, or why a checkpoint whose name gives no step has no readable one
        inside (a torn ``last.ckpt``: ``step_inside`` says so)."""
        if not on_disk_name.isprintable():
            return None  # "checkpoint-3\n" matches a pattern ending in $: never a step
        m = self.names.match(on_disk_name)
        if m is None:
            return None
        text = m.group("step") if "step" in self.names.groupindex else m.group(1)
        if text is None:
            if self.step_inside is None or folder is None:
                return None
            got = self.step_inside(folder())
            if isinstance(got, str):
                return got
            text = None if got is None else str(got)
        try:
            return layout.validate_step(int(text))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None


_FRAMEWORKS: dict[str, Framework] = {}


def register_framework(
    name: str,
    names_regex: str | re.Pattern[str],
    is_complete: Callable[[CheckpointFolder], str | None],
    *,
    record: Callable[[CheckpointFolder], bool] | None = None,
    auto: bool = True,
    step_inside: Callable[[CheckpointFolder], int | str | None] | None = None,
) -> None:
    """Register (or replace) the completeness rule of a framework for ``adopt``.

    Args:
        name: what ``adopt(..., framework=name)`` and ``--framework`` call it.
        names_regex: matches the on-disk names of the framework's checkpoints (the last
            path component) and captures the step: the group named ``step``, else the
            first group. Example: ``r"^checkpoint-(0|[1-9][0-9]*)$"``. A folder is
            adopted in place, so it must be named ``checkpoint-<N>`` (what a manager
            lists); one of another name is refused with the rename to make.
        is_complete: ``(path) -> None`` when the checkpoint at ``path`` is complete,
            else the reason it is not (one sentence a user can act on). ``path`` is a
            :class:`CheckpointFolder`. Called without the run lock for dry runs, under
            it otherwise; it must not write.
        record: for checkpoints that are files, not folders (no manifest can go inside
            them): ``(path) -> bool`` writes the framework's own record of a complete
            checkpoint (e.g. a sidecar manifest) and returns False when it was already
            recorded. Called under the run lock, never for a dry run.
        auto: whether ``framework="auto"`` considers it. False for a framework whose
            names are another's too (DCP's ``checkpoint-<N>`` are the Trainer's): it is
            then applied only when asked for by name.
        step_inside: for checkpoints whose name may carry no step (``names_regex``
            matches with its step group taking no part, as Lightning's ``last.ckpt``):
            ``(path) -> step`` reads the step the checkpoint records (``path.step`` is
            0 then), or None to leave it out, or why it cannot be read (a str: the
            checkpoint is refused with it, e.g. a torn file). Files only (with
            ``record``); it must not write.

    Raises:
        ValueError: the name is reserved, or the regex is invalid or captures no step.
        TypeError: ``names_regex`` is not a str or pattern, or ``is_complete`` (or
            ``record``) is not callable.
    """
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"framework name must be a non-empty string other than {AUTO!r}")
    if not isinstance(names_regex, (str, re.Pattern)):
        raise TypeError(
            f"names_regex of framework {name!r} must be a str or a compiled pattern, got "
            f"{type(names_regex).__name__}"
        )
    try:
        pattern = re.compile(names_regex) if isinstance(names_regex, str) else names_regex
    except re.error as exc:
        raise ValueError(f"names_regex {names_regex!r} of framework {name!r}: {exc}") from None
    if "step" not in pattern.groupindex and pattern.groups < 1:
        raise ValueError(
            f"names_regex {pattern.pattern!r} of framework {name!r} captures no step: add a "
            "group, e.g. r'^checkpoint-(0|[1-9][0-9]*)$'"
        )
    if not callable(is_complete):
        raise TypeError(f"is_complete of framework {name!r} must be callable")
    if record is not None and not callable(record):
        raise TypeError(f"record of framework {name!r} must be callable, or None")
    if step_inside is not None and (not callable(step_inside) or record is None):
        raise TypeError(
            f"step_inside of framework {name!r} must be callable, for checkpoints that are "
            "files (with record), or None"
        )
    _FRAMEWORKS[name] = Framework(name, pattern, is_complete, record, auto, step_inside)


def frameworks() -> list[str]:
    """The names ``adopt(..., framework=...)`` accepts, besides ``"auto"``."""
    return sorted(_FRAMEWORKS)


# ---------------------------------------------------------------------- file checks
def _safetensors_problem(folder: CheckpointFolder, name: str, size: int) -> str | None:
    """A safetensors file is whole when its header parses and the tensors it lists end
    exactly at the end of the file (a truncated file ends early)."""
    if size < 8:
        return f"{name} is {size} bytes: truncated (not even a safetensors header)"
    head = folder.read_head(name, 8)
    n = int.from_bytes(head[:8], "little")
    if n > _MAX_SAFETENSORS_HEADER or 8 + n > size:
        return f"{name} is truncated or not a safetensors file (header of {n} bytes, file {size})"
    raw = folder.read_head(name, 8 + n)[8:]
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return f"{name}: its safetensors header is not valid JSON (torn or not safetensors)"
    if not isinstance(header, dict):
        return f"{name}: its safetensors header is not a JSON object"
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            return f"{name}: tensor {key!r:.80} has no valid data_offsets"
        end = max(end, offsets[1])
    if 8 + n + end != size:
        return (
            f"{name} is {size} bytes but its header says {8 + n + end}: "
            f"{'truncated' if size < 8 + n + end else 'trailing bytes after the data'}"
        )
    return None


#: How many times its size a torch.save archive may inflate to (it stores its members
#: uncompressed: 1).
_MAX_INFLATE = 64


def zip_members_problem(z: zipfile.ZipFile, size: int, name: str) -> str | None:
    """What makes the archive ``name`` of ``size`` bytes unfit to read, found from its
    directory alone (before ``testzip`` inflates every member): a member past the end,
    members that overlap (a 1 MB archive that lists one deflated GiB 2,000 times kept
    adoption inflating for hours), or members that inflate to more than
    ``_MAX_INFLATE`` times the file. None when there is none."""
    infos = z.infolist()
    end = 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        stop = info.header_offset + info.compress_size
        if stop > size:
            return f"{name} is truncated (member {info.filename!r} ends past the end)"
        if info.header_offset < end:
            return (
                f"{name}: member {info.filename!r} overlaps another member: not an archive "
                "torch.save writes (refused before inflating it)"
            )
        end = stop
    inflated = sum(i.file_size for i in infos)
    if inflated > _MAX_INFLATE * size + (1 << 20):
        return (
            f"{name}: its members inflate to {inflated} bytes, over {_MAX_INFLATE} times its "
            f"{size}: not an archive torch.save writes (refused before inflating it)"
        )
    return None


#: The first bytes of a zip archive (``torch.save``'s format).
_ZIP_MAGIC = b"PK\x03\x04"


def _zip_problem(folder: CheckpointFolder, name: str, size: int) -> str | None:
    """``torch.save`` files are zip archives: a truncated one has no end-of-archive
    record (written last), every member must lie inside the file, and every member's
    CRC-32 must match its bytes (a crash can leave blocks of zeros inside a file of
    the right size: never written back). Files in the legacy (non-zip) format cannot
    be checked beyond being non-empty and not starting with zeros."""
    if size == 0:
        return f"{name} is empty (0 bytes)"
    with folder.storage.open_read(f"{folder.rel}/{name}") as f:
        magic = f.read(4)
        if magic.strip(b"\x00") == b"":
            # No format starts so (zip: "PK"; a pickle: its protocol): a file whose
            # size was recorded by the crash but whose data never reached the disk.
            return f"{name} starts with zero bytes: its data never reached the disk (torn)"
        if magic != _ZIP_MAGIC:
            return None  # legacy torch format or another writer's: not checkable
        f.seek(0)
        try:
            with zipfile.ZipFile(f) as z:
                problem = zip_members_problem(z, size, name)
                if problem is not None:
                    return problem
                bad = z.testzip()  # reads every member, checks its CRC-32 (as Lightning's rule)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            return f"{name} is not a whole torch.save archive ({exc}): truncated or torn"
        if bad is not None:
            return f"{name}: member {bad!r} does not match its CRC-32: the file is torn or corrupt"
    return None


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl")


def _files_problem(folder: CheckpointFolder) -> str | None:
    """Each file whole by its own format: safetensors headers against sizes, torch.save
    archives, JSON that parses; files of other kinds are only read (checksummed)."""
    for name, size in sorted(folder.files().items()):
        base = posixpath.basename(name)
        if base.endswith(".safetensors"):
            problem = _safetensors_problem(folder, name, size)
        elif base.endswith((".bin", ".pt", ".pth", ".pkl")):
            problem = _zip_problem(folder, name, size)
        elif base.endswith(".json") and size <= _MAX_JSON_BYTES:
            try:
                folder.read_json(name)
                problem = None
            except ValueError as exc:
                problem = str(exc)
        else:
            problem = None
        if problem is not None:
            return problem
    return None


def _index_problem(folder: CheckpointFolder, index: str) -> str | None:
    """A sharded checkpoint's index lists every shard: each must be there."""
    try:
        doc = folder.read_json(index)
    except ValueError as exc:
        return str(exc)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return f"{index} has no weight_map: not a sharded-checkpoint index"
    prefix = posixpath.dirname(index)
    files = folder.files()
    missing = sorted(
        {
            str(shard)
            for shard in weight_map.values()
            if posixpath.join(prefix, str(shard)) not in files
        }
    )
    if missing:
        return (
            f"{index} lists {len(set(map(str, weight_map.values())))} shard(s) and "
            f"{', '.join(missing[:5])} {'is' if len(missing) == 1 else 'are'} missing"
        )
    return None


def _weights_problem(folder: CheckpointFolder, stems: tuple[str, ...], what: str) -> str | None:
    """Whether the model weights are there: a single file, a sharded index with every
    shard, or a torch.distributed.checkpoint folder (FSDP) with its ``.metadata``
    (written last)."""
    files = folder.files()
    tops = {n for n in files if "/" not in n}
    indexes = sorted(n for n in tops if n.endswith((".safetensors.index.json", ".bin.index.json")))
    for index in indexes:
        problem = _index_problem(folder, index)
        if problem is not None:
            return problem
    if indexes:
        return None
    pattern = re.compile(
        r"^(?:" + "|".join(map(re.escape, stems)) + r")(?:_[0-9]+)?\.(?:safetensors|bin)\Z"
    )
    if any(pattern.match(n) for n in tops):
        return None
    dcp = re.compile(r"^(?:pytorch_model_fsdp|model)_[0-9]+/\.metadata\Z")
    if any(dcp.match(n) for n in files):
        return None
    if any(re.match(r"^global_step[0-9]+/", n) for n in files):
        return None  # DeepSpeed's own folder (its engine checks it when loading)
    return (
        f"no {what} weights ({', '.join(s + '.safetensors' for s in stems)}, a sharded "
        "index, or an FSDP folder): the save stopped before the model was written"
    )


def _contiguous(folder: CheckpointFolder, pattern: str, what: str) -> str | None:
    """Per-process files numbered 0..n-1 (one per rank): none missing in between."""
    regex = re.compile(pattern)
    found = sorted(int(m.group(1)) for n in folder.files() if (m := regex.match(n)))
    if found and found != list(range(found[-1] + 1)):
        missing = sorted(set(range(found[-1] + 1)) - set(found))
        return f"{what} of process(es) {missing} missing (found {found})"
    return None


#: A sibling checkpoint folder of the same root (either spelling: a rule may be called
#: on a plain root, an Accelerate project view, or the ``checkpoints/`` folder itself).
_SIBLING_RE = re.compile(rf"^checkpoint[-_]{_STEP}\Z")


def _missing_beside_siblings(
    folder: CheckpointFolder,
    per_process: re.Pattern[str],
    finished: str,
    why: str,
    torn: Callable[[set[str]], bool] = lambda held: False,
) -> str | None:
    """The per-process (or per-object) files that every other adoptable sibling has and
    this folder lacks, as the reason it is torn; None when it lacks none.

    The rule: the siblings are the other checkpoint folders beside this one (the same
    run's or project's), and an adoptable one holds ``finished`` (the file the framework
    writes once the rest is there). A file matching ``per_process`` that *every* one of
    them holds and this folder lacks was not written here: a process killed mid-save
    (``random_states_1.pkl`` of rank 1), or a save stopped before its last files
    (``custom_checkpoint_<i>.pkl``, which Accelerate writes after the RNG states). A
    file only some siblings hold proves nothing (a run restarted with fewer processes
    or objects), and a folder with no adoptable sibling is judged on its own.
    ``torn(held)``: whether a sibling's per-process files alone show it torn (it then
    tells nothing about the others), or that it is of another layout than this folder
    (a run resized between restarts); such siblings are passed over."""
    parent = posixpath.dirname(folder.rel)
    own = posixpath.basename(folder.rel)
    common: set[str] | None = None
    others = 0
    for name in folder.listing(parent):
        if name == own or not _SIBLING_RE.match(name):
            continue
        rel = posixpath.join(parent, name) if parent else name
        if catalog.is_link(folder.storage, rel):
            continue
        try:
            names = folder.listing(rel)  # [] for a file
        except CheckpointError:
            continue  # unreadable: not a sibling that tells anything
        if finished not in names:
            continue  # torn itself, or not the framework's
        held = {n for n in names if per_process.match(n)}
        if torn(held):
            continue
        common = held if common is None else common & held
        others += 1
    if not common:
        return None
    missing = sorted(common - set(folder.files()))
    if not missing:
        return None
    return (
        f"{', '.join(missing[:5])} {'is' if len(missing) == 1 else 'are'} missing, which "
        f"every other complete checkpoint beside it has ({others} folder(s)): {why}"
    )


# ---------------------------------------------------------------------- built-in rules
_TRAINER_STATE = "trainer_state.json"
#: Files only the Trainer's own saves hold beside its model weights: a folder with one of
#: them and no ``trainer_state.json`` is a Trainer save that did not finish.
_TRAINER_FILES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")


def hf_is_complete(path: str) -> str | None:
    """The Hugging Face ``Trainer``'s ``checkpoint-<N>``: ``trainer_state.json`` (the
    Trainer writes it after the model, optimizer, scheduler and RNG states) for step
    N, the model weights (every shard of a sharded index), and every file whole. A
    folder is torn, too, if it lacks an ``rng_state.pth`` / ``rng_state_<p>.pth`` that
    every other adoptable sibling ``checkpoint-<M>`` of its layout (one holding
    ``trainer_state.json``; one process writes ``rng_state.pth``, several
    ``rng_state_<p>.pth``) has, or holds ``rng_state_0.pth`` without
    ``rng_state_1.pth``: a process of a multi-process save killed before it wrote its
    RNG state."""
    folder = _folder(path)
    files = folder.files()
    if not files:
        return "the folder is empty"
    if _TRAINER_STATE not in files:
        if _looks_like_dcp(files):
            other = (
                " (or the folder is not a Trainer checkpoint: a torch.distributed.checkpoint "
                "(DCP) folder: adopt it with --framework dcp, which checks DCP's own "
                "completeness)"
            )
        elif any(n in files for n in _TRAINER_FILES):
            other = ""  # it is the Trainer's: --framework generic would take a torn one
        else:
            other = " (or the folder is not a Trainer checkpoint: try --framework generic)"
        return (
            f"{_TRAINER_STATE} is missing: the Trainer writes it last, so this save did not "
            f"finish{other}"
        )
    try:
        state = folder.read_json(_TRAINER_STATE)
    except ValueError as exc:
        return str(exc)
    step = state.get("global_step") if isinstance(state, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and step != folder.step:
        return f"{_TRAINER_STATE} records global_step {step}, not {folder.step}: a copied folder?"
    own = {n for n in files if _HF_RNG.match(n)}
    return (
        _weights_problem(folder, ("model", "pytorch_model", "adapter_model"), "model")
        or _contiguous(folder, r"^rng_state_([0-9]+)\.pth\Z", "rng_state_<i>.pth")
        or _hf_rng_problem(own)
        or _missing_beside_siblings(
            folder,
            _HF_RNG,
            _TRAINER_STATE,
            "a process of this save was killed before it wrote its RNG state",
            # Judged against whole siblings of its own layout (any, if it holds no RNG
            # file): a run resized between restarts leaves one-process folders
            # (rng_state.pth) beside multi-process ones (rng_state_<p>.pth).
            torn=lambda held: (
                _hf_rng_problem(held) is not None
                or (bool(own) and ("rng_state.pth" in held) != ("rng_state.pth" in own))
            ),
        )
        or _files_problem(folder)
    )


#: The Trainer's RNG state files: ``rng_state.pth`` from a one-process run, one
#: ``rng_state_<p>.pth`` per process from a run of several.
_HF_RNG = re.compile(r"^rng_state(?:_[0-9]+)?\.pth\Z")


def _hf_rng_problem(held: set[str]) -> str | None:
    """What the RNG files ``held`` alone show torn: the Trainer writes
    ``rng_state_<p>.pth`` only when it runs on two processes or more (one process writes
    ``rng_state.pth``), so ``rng_state_0.pth`` without ``rng_state_1.pth`` is a save
    whose other processes were killed before they wrote theirs."""
    if "rng_state_0.pth" in held and "rng_state_1.pth" not in held:
        return (
            "rng_state_1.pth is missing: the Trainer writes one rng_state_<p>.pth per "
            "process only when it runs on two or more, so a process of this save was "
            "killed before it wrote its RNG state"
        )
    return None


def accelerate_is_complete(path: str) -> str | None:
    """Accelerate's ``checkpoint_<i>`` (``save_state``): the model weights, the
    optimizer state and the RNG states of process 0 (``random_states_0.pkl``, written
    after the models, optimizers, schedulers and samplers), with one RNG file per
    process and every file whole. A folder is torn, too, if it lacks a
    ``random_states_<p>.pkl`` or ``custom_checkpoint_<i>.pkl`` (the objects registered
    with ``register_for_checkpointing``, written last) that every other adoptable
    sibling folder of the project has (one holding ``random_states_0.pkl``): the files
    every other adoptable sibling has, that this one lacks, were never written here."""
    folder = _folder(path)
    files = folder.files()
    if not files:
        return "the folder is empty"
    problem = _weights_problem(folder, ("model", "pytorch_model"), "model")
    if problem is not None:
        return problem
    tops = {n for n in files if "/" not in n}
    if not any(re.match(r"^optimizer(?:_[0-9]+)?\.bin\Z", n) for n in tops) and not any(
        re.match(r"^optimizer_[0-9]+/\.metadata\Z", n) for n in files
    ):
        return "no optimizer state (optimizer.bin): the save stopped after the model"
    if "random_states_0.pkl" not in tops:
        return (
            "random_states_0.pkl is missing: Accelerate writes the RNG states after the "
            "model, optimizer and scheduler, so this save did not finish"
        )
    return (
        _contiguous(folder, r"^random_states_([0-9]+)\.pkl\Z", "random_states_<i>.pkl")
        or _contiguous(folder, r"^custom_checkpoint_([0-9]+)\.pkl\Z", "custom_checkpoint_<i>.pkl")
        or _missing_beside_siblings(
            folder,
            re.compile(r"^(?:random_states|custom_checkpoint)_[0-9]+\.pkl\Z"),
            "random_states_0.pkl",
            "this save did not finish (a process killed before it wrote its RNG state, or "
            "the save stopped before the objects registered with register_for_checkpointing, "
            "which Accelerate writes last)",
        )
        or _files_problem(folder)
    )


def _looks_like_dcp(files: Iterable[str]) -> bool:
    """A ``torch.distributed.checkpoint`` folder at the top (``dcp.save``'s own layout):
    ``*.distcp`` data files or its ``.metadata``, with no Trainer state."""
    tops = [n for n in files if "/" not in n]
    return any(n.endswith(".distcp") or n == ".metadata" for n in tops)


def generic_is_complete(path: str) -> str | None:
    """No framework rule: any folder whose files can all be read (checked by reading
    the first bytes of each; the checksum pass reads the rest) and are not all empty
    (0-byte files only: a copy cut short before any data arrived). A file that starts
    as a zip archive does (``torch.save``'s format, whatever its name) must be a whole
    one: its end-of-archive record there, every member inside the file and matching
    its CRC-32 (the check of the framework rules), else the folder is torn. A DCP folder is refused:
    readable files say nothing of whether DCP finished it (``.metadata``, written last),
    and only the ``dcp`` rule records it so that ``load_dcp`` loads it."""
    folder = _folder(path)
    files = folder.files()
    if not files:
        return "the folder is empty"
    if _looks_like_dcp(files):
        return (
            "a torch.distributed.checkpoint (DCP) folder: adopt it with --framework dcp "
            '(framework="dcp"), which checks that DCP finished it'
        )
    ours = sorted(n for n in files if layout.is_state_file(posixpath.basename(n)))
    if ours:
        # A checkpoint of this library without its manifest: a copy that left it out
        # (or was cut before it), or a save that never committed. Its files say nothing
        # of whether they are complete, and adopted, it would be a "files" checkpoint
        # that restore() cannot load and does not fall back from.
        return (
            f"it holds atomic-checkpoint's own state files ({', '.join(ours[:3])}) but no "
            f"{layout.MANIFEST_NAME}: a copy that lost its manifest, or a save that never "
            "committed, so nothing tells whether they are complete. Copy the checkpoint "
            "again with its manifest (or delete it); it is never adopted"
        )
    if not any(files.values()):
        # The typical torn state of a copy or a save cut short (docs/faq.md): the files
        # were created, none of their bytes arrived.
        return (
            f"every file in it is empty ({len(files)} file(s) of 0 bytes: "
            f"{', '.join(sorted(files)[:3])}): a copy or save cut short before any data "
            "arrived, not a checkpoint. Copy it again (or delete it); it is not adopted"
        )
    for name, size in sorted(files.items()):
        if folder.read_head(name, 4) == _ZIP_MAGIC:
            # A zip archive (what torch.save writes, whatever the file is called): whole
            # by the check the framework rules apply (a truncated one lacks its
            # end-of-archive record, a torn one fails a member's CRC-32).
            problem = _zip_problem(folder, name, size)
            if problem is not None:
                return problem
    return None


def _folder(path: str) -> CheckpointFolder:
    if isinstance(path, CheckpointFolder):
        return path
    # Called directly on a local path (tests, other tools): a root of one folder.
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    storage = open_storage(parent)
    m = re.search(_STEP + r"\Z", name)
    return CheckpointFolder(storage, name, int(m.group(1)) if m else 0)


register_framework("hf", rf"^checkpoint-{_STEP}\Z", hf_is_complete)
register_framework("accelerate", rf"^checkpoint_{_STEP}\Z", accelerate_is_complete)
register_framework(GENERIC, rf"^checkpoint[-_]{_STEP}\Z", generic_is_complete)


# ---------------------------------------------------------------------- the result
@dataclass(frozen=True)
class AdoptResult:
    """What ``adopt`` did (or, for a dry run, would do).

    Attributes:
        root: the root, as a path or URL.
        run_id: the run the checkpoints were recorded under (for a dry run, the run they
            would be recorded under; None when that run does not exist yet).
        adopted: steps recorded now (dry run: that would be), ascending.
        refused: step -> why it is not adopted (torn, unreadable, ...); nothing was
            written for those.
        unreadable: name -> why, for checkpoints whose name gives no step and whose
            own record of it cannot be read (a torn ``last.ckpt``): refused too.
        already: steps that were committed checkpoints of the run already (nothing
            written: adopting is idempotent).
        frameworks: step -> the framework whose rule accepted it (adopted steps).
        seconds: step -> time spent checksumming and recording it (adopted steps).
        size_bytes: step -> its size (adopted steps).
        dry_run: nothing was written.
    """

    root: str
    run_id: str | None
    adopted: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    already: list[int] = field(default_factory=list)
    frameworks: dict[int, str] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    size_bytes: dict[int, int] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        """Nothing was refused."""
        return not self.refused and not self.unreadable


#: A ``_Candidate``'s step when the checkpoint's name gives none and its own record of
#: it cannot be read (``AdoptResult.unreadable``).
_NO_STEP = -1


@dataclass
class _Candidate:
    step: int
    name: str  # the protocol's name in the storage
    framework: Framework | None = None
    problem: str | None = None
    already: bool = False


# ---------------------------------------------------------------------- adopt
def adopt(
    root: str | os.PathLike[str] | Storage,
    steps: Iterable[int] | int | None = None,
    *,
    framework: str = AUTO,
    run_id: str | None = None,
    dry_run: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[str], object] | None = None,
) -> AdoptResult:
    """Record a framework's existing checkpoints under ``root`` as committed checkpoints.

    Not collective: call it on one process, before any ``CheckpointManager`` of the job
    opens ``root`` (it takes the run lock, which a live job holds).

    Args:
        root: the run's checkpoint root (the Trainer's ``output_dir``, Accelerate's
            ``project_dir`` or its ``checkpoints/`` folder, a URL such as
            ``s3://bucket/run``), or a ``Storage``.
        steps: only these steps (each must be adoptable or already committed, else it
            is refused); default: every checkpoint folder found.
        framework: whose completeness rule applies: ``"auto"`` (the framework whose
            names the folder has: ``checkpoint-<N>`` is the Trainer's, Accelerate's
            ``checkpoint_<i>``; never ``generic``), ``"hf"``, ``"accelerate"``,
            ``"lightning"`` and ``"dcp"`` (registered by their integrations; ``dcp``
            only when named: its ``checkpoint-<N>`` are the Trainer's names too),
            ``"generic"`` (no rule beyond readable files), or any registered name.
        run_id: the run to record them under; default: the run recorded in ``root``, else
            the one run its committed checkpoints carry, else a new one. A ``run_id``
            other than the recorded one is an error.
        dry_run: check and report, write nothing (no lock, no run file).
        storage_options: for URL roots, fsspec's options.
        progress: called with one line of text per checkpoint as it is settled
            (adopted, already committed, or refused), for long adoptions.

    Returns:
        What was adopted, refused (with the reason) or already committed.

    Raises:
        LockHeldError: a live job (or a ``CheckpointManager`` of this process) holds the
            run lock on ``root``: adopt before it opens, or after it closes.
        ValueError: ``framework`` is unknown; a step is not a valid step.
        CheckpointError: ``run_id`` differs from the recorded run; storage errors (a
            full disk). When one stops an adoption half way, its ``adopt_result``
            attribute holds what was adopted, refused or already committed before it.
    """
    t0 = time.monotonic()
    _check_framework(framework)
    dry_run = flag("dry_run", dry_run)
    if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
        raise ValueError("run_id must be a non-empty string")
    wanted = _wanted_steps(steps)
    storage = storage_for(root, storage_options)
    local = storage.local_path("")
    if local is not None and not posix.is_dir(local):
        # Never created by adopting (a typo would otherwise become an empty root).
        raise CheckpointNotFoundError(
            f"checkpoint root {local!r} does not exist or is not a directory: pass the "
            "directory that holds the framework's checkpoint folders"
        )
    if (
        framework == AUTO
        and local is not None
        and "lightning" not in _FRAMEWORKS
        and any(n.endswith(".ckpt") for n in storage.listdir(""))
    ):
        # A Lightning ModelCheckpoint directory: its rule comes with its integration.
        _load_integration_rule("lightning")
    storage, record_layout = _accelerate_project(storage, framework)
    say = progress or (lambda line: None)
    ours = (layout.META_DIR, layout.PENDING_DIR, layout.TRASH_DIR)
    if dry_run or not _names_a_candidate(storage, framework, ours):
        # Nothing there to adopt (ROOT one checkpoint folder itself, say: its entries
        # are model files): report it without a lock, run file or layout record left
        # behind (the same answer as a dry run).
        rid = _run_id_for(storage, run_id, create=False)
        result = _classify(storage, framework, wanted, rid)
        return dataclasses.replace(_dry_result(storage, rid, result, say), dry_run=dry_run)
    rid = _run_id_for(storage, run_id, create=False) or layout.new_run_id()
    lock = _acquire(storage, rid)
    try:
        # Under the lock: the run file is created (or matched) once, by the holder.
        had_run_file = storage.size(RUN_FILE) is not None
        rid = _run_id_for(storage, run_id, create=True, new=rid) or rid
        if record_layout is not None:
            record_layout()
        last_seq, valid = _committed_in(storage)
        seqs = itertools.count(last_seq + 1)
        out = AdoptResult(storage.url(""), rid)
        try:
            adopt_held(
                storage,
                rid,
                lock,
                wanted,
                framework=framework,
                next_seq=seqs.__next__,
                progress=say,
                valid=valid,
                into=out,
            )
        except CheckpointError as exc:
            exc.adopt_result = out  # type: ignore[attr-defined]  # what it did before
            raise
        if not out.adopted and not had_run_file and not valid:
            # Nothing recorded: the run file made for this call goes too, or the job
            # started later with its own run_id was refused, and the CLI (prune, list)
            # took the root for a run that holds nothing. No run exists, so none is
            # reported (the next adopt makes another).
            storage.delete_file(RUN_FILE)
            storage.fsync_dir(layout.META_DIR)
            out = dataclasses.replace(out, run_id=None)
    finally:
        lock.release()
    log.debug("adopt %s: %.2f s", storage.url(""), time.monotonic() - t0)
    return out


def _check_framework(framework: str) -> None:
    """Raise ``ValueError`` unless ``framework`` is ``"auto"`` or a registered rule (the
    integrations' rules are imported on demand)."""
    if framework != AUTO and framework not in _FRAMEWORKS:
        _load_integration_rule(framework)
    if framework != AUTO and framework not in _FRAMEWORKS:
        raise ValueError(
            f"unknown framework {framework!r}: one of "
            f"{sorted({AUTO, *frameworks(), *_ON_DEMAND})} (integrations register theirs "
            "with atomic_checkpoint.register_framework)"
        )


def _names_a_candidate(storage: Storage, framework: str, ours: tuple[str, ...]) -> bool:
    """Whether some entry of ROOT is named as a checkpoint of ``framework`` (any, for
    ``AUTO``) would name it: the cheap test before anything is written."""
    rules = (
        [f for n, f in _FRAMEWORKS.items() if n != GENERIC and f.auto]
        if framework == AUTO
        else [_FRAMEWORKS[framework]]
    )
    for name in storage.listdir(""):
        if name in ours:
            continue
        disk = _on_disk_name(storage, name)
        folder = functools.partial(CheckpointFolder, storage, name, 0)
        if any(f.step_of(disk, folder) is not None for f in rules):
            return True
    return False


def adopt_held(
    storage: Storage,
    rid: str,
    lock: RunLock,
    wanted: list[int] | None = None,
    *,
    framework: str = AUTO,
    next_seq: Callable[[], int],
    strategy: str | None = None,
    progress: Callable[[str], object] | None = None,
    valid: Mapping[str, Manifest] | None = None,
    into: AdoptResult | None = None,
) -> AdoptResult:
    """What :func:`adopt` does once it holds the run lock, for a caller that holds it
    already (an open ``CheckpointManager``: ``CheckpointManager.adopt_existing``):
    record each adoptable checkpoint of ``storage`` under run ``rid``, numbering each
    commit with ``next_seq()``, every write fenced by ``lock``. Returns what was
    adopted, refused or already committed. Not collective; one process.

    ``valid``: the checkpoints of ROOT already read and validated under this lock
    (``_committed_in``), by name: settled without reading their manifests again.
    ``into``: the result to fill in as it goes (what was done before an error)."""
    _check_framework(framework)
    say = progress or (lambda line: None)
    out = AdoptResult(storage.url(""), rid) if into is None else into
    strategy = strategy or choose_strategy(storage).name
    for c in _classify(storage, framework, wanted, rid, valid):
        shown = _shown(storage, c.name)
        if c.step == _NO_STEP:
            out.unreadable[c.name] = str(c.problem)
            say(f"REFUSED {shown}: {c.problem}")
            continue
        if c.already:
            _once(out.already, c.step)
            say(f"already {shown}: a committed checkpoint of run {rid} (nothing written)")
            continue
        if c.problem is not None or c.framework is None:
            out.refused[c.step] = c.problem or "no framework rule applies"
            say(f"REFUSED {shown}: {out.refused[c.step]}")
            continue
        lock.check()
        t = time.monotonic()
        try:
            if c.framework.record is not None:
                written = c.framework.record(CheckpointFolder(storage, c.name, c.step))
                size = storage.size(c.name) or 0
                n_files = 1
            else:
                written, size, n_files = _record(
                    storage, c, rid, next_seq(), strategy, fence=lock.check
                )
        except LockError:
            raise  # fenced: another job took ROOT over; stop writing at once
        except CheckpointError as exc:
            if isinstance(exc, StorageError) and not _is_content_error(exc):
                raise
            out.refused[c.step] = str(exc)
            say(f"REFUSED {shown}: {exc}")
            continue
        if not written:
            _once(out.already, c.step)
            say(f"already {shown}: recorded meanwhile (nothing written)")
            continue
        took = time.monotonic() - t
        _once(out.adopted, c.step)  # several files of one step: listed once, summed
        out.frameworks[c.step] = c.framework.name
        out.seconds[c.step] = out.seconds.get(c.step, 0.0) + took
        out.size_bytes[c.step] = out.size_bytes.get(c.step, 0) + size
        say(
            f"adopted {shown} ({c.framework.name}): {format_size(size)} in {n_files} "
            f"file(s), checksummed and recorded in {took:.2f} s"
            + (f" ({format_size(size / took)}/s)" if took > 0 else "")
        )
        log.info("adopted %s (%s) into run %r", storage.url(c.name), c.framework.name, rid)
    return out


#: Rules that integrations register when their module is imported (it imports torch).
_ON_DEMAND = ("dcp", "lightning")


def _load_integration_rule(framework: str) -> None:
    """``framework="lightning"`` or ``"dcp"``: its rule is registered by its
    integration module, imported on demand (it imports torch)."""
    if framework not in _ON_DEMAND:
        return
    with contextlib.suppress(ImportError):
        importlib.import_module(f"{__package__}.integrations.{framework}")


def _wanted_steps(steps: Iterable[int] | int | None) -> list[int] | None:
    if steps is None:
        return None
    if isinstance(steps, int):
        return [layout.validate_step(steps)]  # a bool raises there
    return sorted({layout.validate_step(s) for s in steps})


def _dry_result(
    storage: Storage, rid: str | None, found: list[_Candidate], say: Callable[[str], object]
) -> AdoptResult:
    out = AdoptResult(storage.url(""), rid, dry_run=True)
    for c in found:
        shown = _shown(storage, c.name)
        if c.step == _NO_STEP:
            out.unreadable[c.name] = str(c.problem)
            say(f"would refuse {shown}: {c.problem}")
        elif c.already:
            _once(out.already, c.step)
            say(f"already {shown}: a committed checkpoint (nothing to do)")
        elif c.problem is not None or c.framework is None:
            out.refused[c.step] = c.problem or "no framework rule applies"
            say(f"would refuse {shown}: {out.refused[c.step]}")
        else:
            _once(out.adopted, c.step)  # several files of one step: listed once
            out.frameworks[c.step] = c.framework.name
            size = sum(_tree_sizes(storage, c.name))
            out.size_bytes[c.step] = out.size_bytes.get(c.step, 0) + size
            say(f"would adopt {shown} ({c.framework.name}): complete, {format_size(size)}")
    return out


def _once(steps: list[int], step: int) -> None:
    """Add ``step`` to a result's list unless there: a framework whose checkpoints are
    files may hold several at one step (Lightning's ``-v1`` copies)."""
    if step not in steps:
        steps.append(step)


def _tree_sizes(storage: Storage, rel: str) -> list[int]:
    """Sizes of the files under ``rel`` (a file: its own size)."""
    if storage.is_dir(rel):
        return [s for n, s in storage.walk_files(rel) if not is_own_temporary(n)]
    return [storage.size(rel) or 0]


def _is_content_error(exc: StorageError) -> bool:
    # A file the folder lists that vanished or cannot be read is the folder's problem
    # (refused, with the reason); ROOT itself failing is the caller's (raised).
    return exc.errno in (errno.ENOENT, errno.EACCES, errno.EISDIR)


# ---------------------------------------------------------------------- classification
def _shown(storage: Storage, name: str) -> str:
    """``name`` as the user sees it on disk, relative to the root they gave
    (``checkpoints/checkpoint_3`` in an Accelerate project)."""
    base, url = storage.url("").rstrip("/"), storage.url(name)
    return url[len(base) + 1 :] if url.startswith(base + "/") else name


def _on_disk_name(storage: Storage, name: str) -> str:
    """The last component of ``name`` as it is on disk (Accelerate's project view names
    ``checkpoints/checkpoint_<i>`` as ``checkpoint-<i>``)."""
    return posixpath.basename(storage.url(name).rstrip("/"))


def _classify(
    storage: Storage,
    framework: str,
    wanted: list[int] | None,
    rid: str | None,
    valid: Mapping[str, Manifest] | None = None,
) -> list[_Candidate]:
    """Every candidate of ROOT (or of ``wanted``), ascending by step, with its verdict.
    ``valid``: see ``adopt_held``."""
    rules = (
        [f for n, f in sorted(_FRAMEWORKS.items()) if n != GENERIC and f.auto]
        if framework == AUTO
        else [_FRAMEWORKS[framework]]
    )
    by_step: dict[int, list[tuple[str, list[Framework]]]] = {}
    misnamed: dict[int, tuple[str, str]] = {}
    out_unreadable: list[_Candidate] = []
    for name in storage.listdir(""):
        if name in layout.OWN_DIRS:
            continue
        disk = _on_disk_name(storage, name)
        folder = functools.partial(CheckpointFolder, storage, name, 0)
        # One read per rule: a name that gives no step (last.ckpt) is read for it.
        read = [(f, f.step_or_why(disk, folder)) for f in rules]
        found = [(f, got) for f, got in read if isinstance(got, int)]
        if not found:
            why = next((got for _f, got in read if isinstance(got, str)), None)
            if why is not None and wanted is None:
                # Said, not skipped: a torn last.ckpt is often the newest state, and a
                # silent "0 refused" sent the job back to an older step.
                out_unreadable.append(
                    _Candidate(_NO_STEP, name, problem=f"its step cannot be read: {why}")
                )
            continue
        matching, step = [f for f, _ in found], found[0][1]
        if wanted is not None and step not in wanted:
            continue
        if matching[0].record is None and layout.parse_checkpoint_name(name) != step:
            # ``checkpoint_400`` in a plain root (``generic`` matches both spellings):
            # adopted, it would be a checkpoint no manager of this root ever lists.
            misnamed[step] = (
                name,
                (
                    f"{name} is not named as the checkpoints of {storage.url('')} are "
                    f"({layout.checkpoint_name(step)}), so no CheckpointManager there would ever "
                    f"find it: rename it to {layout.checkpoint_name(step)} first"
                    + (
                        " (Accelerate's checkpoint_<i> folders are adopted from their project "
                        "directory, with --framework accelerate)"
                        if name.startswith("checkpoint_")
                        else ""
                    )
                ),
            )
            continue
        by_step.setdefault(step, []).append((name, matching))
    out: list[_Candidate | None] = list(out_unreadable)
    listings: dict[str, list[str]] = {}  # shared by the rules: each sibling listed once
    judge = functools.partial(_judge, storage, explicit=wanted is not None, listings=listings)
    for step, (name, why) in sorted(misnamed.items()):
        if step not in by_step:
            out.append(_Candidate(step, name, problem=why))
    for step in sorted(set(by_step) | set(wanted or ())):
        if step in misnamed and step not in by_step:
            continue  # said above
        entries = by_step.get(step)
        if not entries:
            names = ", ".join(f.names.pattern for f in rules)
            out.append(
                _Candidate(
                    step,
                    f"step {step}",
                    problem=f"no folder for step {step} under {storage.url('')} (names "
                    f"matching {names})",
                )
            )
            continue
        if len(entries) > 1 and all(m and all(f.record for f in m) for _, m in entries):
            # Checkpoints that are files, each with its own record (Lightning's
            # epoch=0-step=10.ckpt and the -v1 copy a restarted run writes beside it):
            # several at one step do not collide; each is judged on its own.
            out.extend(judge(name, step, matching, rid) for name, matching in entries)
            continue
        if len(entries) > 1:
            names = ", ".join(n for n, _ in entries)
            out.append(
                _Candidate(
                    step,
                    entries[0][0],
                    problem=f"several entries hold step {step} ({names}): adopt with "
                    "--framework naming the one that wrote it",
                )
            )
            continue
        ((name, matching),) = entries
        out.append(judge(name, step, matching, rid, valid=(valid or {}).get(name)))
    return sorted((c for c in out if c is not None), key=lambda c: c.step)


def _judge(
    storage: Storage,
    name: str,
    step: int,
    matching: list[Framework],
    rid: str | None,
    *,
    explicit: bool,
    valid: Manifest | None = None,
    listings: dict[str, list[str]] | None = None,
) -> _Candidate | None:
    c = _Candidate(step, name)
    if catalog.is_link(storage, name):
        c.problem = "a symbolic link: never adopted (links are never followed)"
        return c
    fw = matching[0]
    if len(matching) > 1:
        c.problem = (
            f"its name fits the checkpoints of {[f.name for f in matching]}: pass the "
            "framework that wrote it"
        )
        return c
    if fw.record is None:
        if not storage.is_dir(name):
            c.problem = "not a folder"
            return c
        settled = _existing_manifest(storage, name, rid, valid)
        if settled is not None:
            kind, text = settled
            if kind == "foreign" and not explicit:
                return None  # another run's checkpoint: not a candidate unless asked for
            if kind == "already":
                c.already = True
            else:
                c.problem = text
            return c
    folder = CheckpointFolder(storage, name, step)
    if listings is not None:
        folder._listings = listings
    try:
        problem = fw.is_complete(folder)
    except CheckpointError as exc:
        problem = str(exc)
    except Exception as exc:  # a registered rule's failure refuses its folder only
        problem = f"the {fw.name} completeness rule failed: {type(exc).__name__}: {exc}"
    if problem is not None and not isinstance(problem, str):
        # A rule returning True for "complete" refused every complete folder with the
        # reason "True" (and False: "no framework rule applies").
        raise TypeError(
            f"the completeness rule of framework {fw.name!r} returned {problem!r} for "
            f"{storage.url(name)}: it must return None when the folder is complete, else "
            "the reason it is not (a str)"
        )
    c.framework = fw
    c.problem = problem
    return c


def _existing_manifest(
    storage: Storage, name: str, rid: str | None, valid: Manifest | None = None
) -> tuple[str, str] | None:
    """A folder that already holds a manifest (or our in-progress marker) is never
    adopted: ``("already", ...)`` for a valid checkpoint of the run, else
    ``("refused", why)``. None: no manifest, a candidate. ``valid``: its manifest, read
    and validated already (under the same run lock): not read again."""
    if valid is not None:
        return _settled(valid, rid)
    try:
        manifest = catalog.read_manifest(storage, name)
    except CheckpointNotFoundError:
        names = storage.listdir(name)
        if any(
            layout.parse_marker_name(n) is not None or layout.parse_attempt_dir(n) is not None
            for n in names
        ):
            return (
                "refused",
                "an interrupted atomic-checkpoint save (marker strategy), not a framework's "
                "checkpoint: `atomic-checkpoint clean` removes it",
            )
        return None
    except CheckpointError as exc:
        return (
            "refused",
            f"it has a manifest that does not validate ({exc}); adoption never replaces a "
            "manifest: see `atomic-checkpoint verify`",
        )
    try:
        catalog.validate(storage, name, manifest)
    except CheckpointError as exc:
        return (
            "refused",
            f"it is committed but does not validate ({exc}); adoption never replaces a "
            "manifest: see `atomic-checkpoint verify`",
        )
    return _settled(manifest, rid)


def _settled(manifest: Manifest, rid: str | None) -> tuple[str, str]:
    """A valid committed checkpoint: ours (``already``), or another run's."""
    if rid is not None and not manifest.belongs_to(rid):
        return (
            "foreign",
            f"already a checkpoint of run {manifest.run_id!r}, not of run {rid!r}",
        )
    return ("already", "")


# ---------------------------------------------------------------------- recording
def _record(
    storage: Storage,
    c: _Candidate,
    run_id: str,
    seq: int,
    strategy: str,
    *,
    fence: Callable[[], None],
) -> tuple[bool, int, int]:
    """Checksum and fsync every file of ``c``, then write its manifest once. Returns
    (written, size in bytes, number of files)."""
    files = checksum_and_sync(storage, c.name)
    # The framework never fsyncs: the folder's own entry in ROOT must be durable before
    # a manifest inside it is (else a power cut loses the folder with its manifest).
    storage.fsync_dir("")
    metrics, metadata = _describe(storage, c)
    manifest = Manifest(
        step=c.step,
        run_id=run_id,
        commit_seq=seq,
        world_size=1,
        files=files,
        state_kind="files",
        metrics=metrics,
        metadata=metadata,
        strategy=strategy,
        library_version=__version__,
        adopted=True,
    )
    fence()
    data = manifest.to_json_bytes()
    path = f"{c.name}/{MANIFEST_NAME}"
    if not create_or_own(storage, path, data, c.step):
        settled = _existing_manifest(storage, c.name, run_id)
        if settled is not None and settled[0] == "already":
            return False, manifest.size_bytes, len(files)
        raise CheckpointError(
            f"{storage.url(c.name)}: a manifest appeared there while it was being adopted "
            f"({settled[1] if settled else 'unreadable'}); left as it is"
        )
    storage.fsync_dir(c.name)
    return True, manifest.size_bytes, len(files)


def _say_replaced(storage: Storage, name: str, label: str, why: Exception) -> None:
    log.warning(
        "%s: this save replaces %s, which is not a valid checkpoint (%s); a resume skipped "
        "it for an older one",
        label,
        storage.url(name),
        why,
    )


def set_aside_unmanifested(storage: Storage, step: int, label: str) -> None:
    """On the coordinator, before a save of ``step`` by an integration: move a
    ``checkpoint-<step>`` without a manifest (torn by a crash of the framework's own
    save, which adoption refused) out of the way, as the framework's own save of that
    step would have overwritten it. A committed or corrupt one of ours stays: the
    commit replaces it atomically (overwrite) or refuses.

    Best effort: if it cannot be moved, the commit protocol refuses the save and every
    rank gets that error. One of ours that is not valid (its manifest unreadable, a file
    missing or cut short: what a resume skipped for an older step) is replaced by the
    save, and said: the framework saves that step again, where a ``save()`` of the core
    API would refuse to replace an unreadable one unasked.
    """
    name = layout.checkpoint_name(step)
    try:
        manifest = catalog.read_manifest(storage, name)
    except CheckpointNotFoundError:
        pass
    except CheckpointError as exc:
        _say_replaced(storage, name, label, exc)
        return
    else:
        try:
            catalog.validate(storage, name, manifest)
        except CheckpointNotFoundError:
            pass  # replaced or removed meanwhile: nothing to say
        except CheckpointError as exc:
            _say_replaced(storage, name, label, exc)
        return
    entries = storage.listdir(name)
    if not entries or any(
        layout.parse_marker_name(e) is not None or layout.parse_attempt_dir(e) is not None
        for e in entries
    ):
        return  # empty, or marker-strategy leftovers that the commit protocol owns
    trash = f"{layout.TRASH_DIR}/{name}.{layout.new_attempt_token()}"
    try:
        storage.makedirs(layout.TRASH_DIR)
        renaming(storage).rename_dir(name, trash)
    except CheckpointError as exc:
        log.warning("%s: could not move the torn %s aside: %s", label, name, exc)
        return
    log.warning(
        "%s: %s had no manifest (a save torn by a crash, or written without "
        "atomic-checkpoint): replaced by this save",
        label,
        storage.url(name),
    )
    try:
        storage.delete_tree(trash)
    except CheckpointError as exc:  # the next start-up sweeps .trash/
        log.warning("%s: could not delete %s: %s", label, storage.url(trash), exc)


def checksum_and_sync(storage: Storage, rel: str) -> tuple[FileEntry, ...]:
    """Read every file once for its checksum and fsync it; then fsync every directory,
    deepest first. A file whose size changes meanwhile (a writer still at work) makes
    the folder refused: adopting it would record a torn state. The temporary files of
    this library's own writes there (``is_own_temporary``) are neither read nor listed."""
    listed = [(n, s) for n, s in storage.walk_files(rel) if not is_own_temporary(n)]
    local = storage.local_path(rel)
    entries = []
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for name, listed_size in listed:
        h = Hasher()
        with storage.open_read(f"{rel}/{name}") as f:
            size = h.consume(f, view)
            if local is not None:
                posix.fsync_file(os.path.join(local, *name.split("/")), f)
        if size != listed_size or storage.size(f"{rel}/{name}") != size:
            raise CheckpointError(
                f"{storage.url(rel)}: {name} changed size while it was read ({listed_size} "
                f"-> {size} bytes): is a job still writing this checkpoint? Adopt it once "
                "that job has stopped"
            )
        entries.append(FileEntry(name, size, h.hexdigest(), 0))
    if local is not None:
        dirs = {posixpath.dirname(n) for n, _ in listed}
        for d in list(dirs):
            while d:
                d = posixpath.dirname(d)
                dirs.add(d)
        for d in sorted(dirs, key=lambda d: (d.count("/"), d), reverse=True):
            storage.fsync_dir(f"{rel}/{d}" if d else rel)
    return tuple(entries)


def _describe(storage: Storage, c: _Candidate) -> tuple[dict[str, float], dict[str, Any]]:
    """Metrics and metadata recorded with an adopted checkpoint: for the Trainer, its
    evaluation metrics at that step (``KeepBest(metric="eval_loss")`` works on adopted
    checkpoints too) and its step and epoch, as the Trainer integration records them."""
    fw = c.framework.name if c.framework is not None else GENERIC
    metadata: dict[str, Any] = {"adoption": {"framework": fw, "adopted_unix": time.time()}}
    metrics: dict[str, float] = {}
    if fw != "hf":
        return metrics, metadata
    try:
        state = CheckpointFolder(storage, c.name, c.step).read_json(_TRAINER_STATE)
    except (ValueError, CheckpointError):
        return metrics, metadata
    if not isinstance(state, dict):
        return metrics, metadata
    for entry in state.get("log_history") or ():
        if not isinstance(entry, dict) or entry.get("step") != c.step:
            continue
        for key, value in entry.items():
            if (
                isinstance(key, str)
                and key.startswith("eval_")
                and not key.endswith(("_runtime", "_per_second"))
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and abs(value) < float("inf")
            ):
                metrics[key] = float(value)
    epoch = state.get("epoch")
    metadata["trainer"] = {
        "global_step": c.step,
        "epoch": float(epoch) if isinstance(epoch, (int, float)) else 0.0,
    }
    return metrics, metadata


def _committed_in(storage: Storage) -> tuple[int, dict[str, Manifest]]:
    """One scan of ROOT: the highest commit sequence number of any manifest in it, and
    the valid checkpoints (of any run) by name, which adopting then settles without
    reading their manifests again."""
    entries = catalog.scan(storage)
    seqs = [e.manifest.commit_seq for e in entries if e.manifest is not None]
    valid = {e.name: e.manifest for e in entries if e.status == "ok" and e.manifest is not None}
    return max(seqs, default=0), valid


# ---------------------------------------------------------------------- run and lock
def _recorded_run_id(storage: Storage) -> str | None:
    try:
        return catalog.recorded_run_id(storage)
    except CorruptCheckpointError:
        raise CheckpointError(
            f"{storage.url(RUN_FILE)} is empty or damaged: open a CheckpointManager on "
            f"{storage.url('')} once (it repairs the run file), then adopt"
        ) from None


def _run_id_for(
    storage: Storage, run_id: str | None, *, create: bool, new: str | None = None
) -> str | None:
    """The run the adopted checkpoints belong to: the recorded one (which an explicit
    ``run_id`` must match), else the one run of the committed checkpoints, else
    ``run_id`` or ``new``, recorded in the run file (``create``)."""
    recorded = _recorded_run_id(storage)
    if recorded is not None:
        if run_id is not None and run_id != recorded:
            raise CheckpointError(
                f"{storage.url('')} records run {recorded!r} ({storage.url(RUN_FILE)}), not "
                f"{run_id!r}: checkpoints adopted into another run would be foreign to the "
                "job that resumes there. Omit run_id, or pass the recorded one"
            )
        return recorded
    runs = sorted(catalog.runs_of(catalog.committed(storage, run_id=None, warn=False)))
    if run_id is None and len(runs) > 1:
        raise ResumeError(
            f"{storage.url('')} has no run file and holds checkpoints of {len(runs)} runs "
            f"({', '.join(map(repr, runs))}): pass run_id= with the run to adopt into"
        )
    rid = run_id or (runs[0] if runs else None) or None  # "": checkpoints of no run
    if not create:
        return rid
    rid = rid or new or layout.new_run_id()
    storage.makedirs(layout.META_DIR)
    storage.fsync_dir("")
    if not storage.create_exclusive(RUN_FILE, layout.run_doc(rid)):
        return _run_id_for(storage, run_id, create=False) or rid
    return rid


def _acquire(storage: Storage, run_id: str) -> RunLock:
    """Take the run lock. A holder that is this very process (an open
    ``CheckpointManager``) is refused rather than taken over: taking it would fence
    that manager in the middle of its run."""
    from .lock import RunLock, read_lock_holder

    storage.makedirs(layout.META_DIR)
    storage.fsync_dir("")
    holder = read_lock_holder(storage)
    if holder is not None and holder.is_this_process() and holder.is_live():
        raise LockHeldError(
            f"the run lock on {storage.url('')} is held by this process (an open "
            "CheckpointManager or integration): adopt before opening it, or close it first"
        )
    lock = RunLock(storage, run_id=run_id)
    lock.acquire()
    return lock


def _accelerate_project(
    storage: Storage, framework: str
) -> tuple[Storage, Callable[[], None] | None]:
    """Accelerate keeps its checkpoints in ``<project>/checkpoints/checkpoint_<i>`` and
    lists that folder itself, so nothing of ours may go there: a root that is such a
    project (or its ``checkpoints/`` folder) is adopted through the project view
    (``storage.project``), and the layout is recorded (not for a dry run) so that every
    later tool sees the same names. Returns the storage to use and the recorder."""
    fw = _FRAMEWORKS.get(framework)
    if fw is not None and fw.record is not None:
        return storage, None  # checkpoints that are files: their framework's own layout
    try:
        from .layout import ACCELERATE_DIR, parse_accelerate_name
        from .storage.project import ProjectStorage, record_layout
    except ImportError:  # pragma: no cover - the project layout is part of the package
        return storage, None
    if isinstance(storage, ProjectStorage):
        return storage, None
    local = storage.local_path("")
    if local is None:
        return storage, None

    def has_steps(path: str) -> bool:
        return any(parse_accelerate_name(n) is not None for n in posix.list_names(path))

    project: str | None = None
    if has_steps(os.path.join(local, ACCELERATE_DIR)):
        project = local
    elif (
        os.path.basename(local) == ACCELERATE_DIR
        and has_steps(local)
        and not posix.lexists(os.path.join(local, layout.META_DIR))
    ):
        project = os.path.dirname(local)
    if project is None:
        return storage, None
    base = open_storage(project)
    if isinstance(base, ProjectStorage):
        return base, None
    view = ProjectStorage(base)
    log.info("%s is an Accelerate project: adopting %s/checkpoint_<i>", project, ACCELERATE_DIR)
    return view, lambda: record_layout(base)


# ``adopt.register_framework(...)`` reads naturally where ``adopt`` is the function
# imported from the package.
adopt.register_framework = register_framework  # type: ignore[attr-defined]
