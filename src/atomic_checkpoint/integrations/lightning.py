"""PyTorch Lightning and Lightning Fabric: atomic, fsync'd, verified ``.ckpt`` files.

Two lines::

    from atomic_checkpoint.integrations.lightning import AtomicCheckpointIO

    trainer = Trainer(..., plugins=[AtomicCheckpointIO()])  # or Fabric(plugins=[...])

``AsyncAtomicCheckpointIO()`` writes in the background instead. Both plugins exist for
the ``lightning`` package and for the standalone ``pytorch_lightning`` package:
:func:`checkpoint_io_classes` returns the pair for either (``PLAtomicCheckpointIO`` and
``PLAsyncAtomicCheckpointIO`` are the ``pytorch_lightning`` ones); the names
``AtomicCheckpointIO`` and ``AsyncAtomicCheckpointIO`` are bound to ``lightning`` when
it is installed, else to ``pytorch_lightning``. Lightning is imported when a plugin
class is first used, not when this module is.

Why atomic single files, not checkpoint directories
---------------------------------------------------
``ModelCheckpoint`` owns the names (``epoch=0-step=40.ckpt``, ``last.ckpt``,
``last-v1.ckpt``), the top-k bookkeeping and ``best_model_path``, all by file path, and
only global rank 0 calls the plugin. Everything downstream reads a ``.ckpt`` as one
``torch.save`` file *without* going through the plugin:
``LightningModule.load_from_checkpoint``, ``torch.load``, model registries. Mapping a
``.ckpt`` onto a ``checkpoint-<step>/`` directory of a ``CheckpointManager`` would break
all of those, and its collective commit cannot run from rank 0 alone. So each ``.ckpt``
stays a plain ``torch.save`` file, made atomic by a sibling pending file and one rename,
and verifiable by a small manifest beside it::

    ckpts/                                   during a save of last.ckpt (step 6)
      epoch=0-step=4.ckpt                    complete, untouched
      epoch=0-step=4.ckpt.manifest.json      size + checksum + step of the file
      last.ckpt                              still the complete step-4 version
      last.ckpt.manifest.json                lists step 6 and step 4 (both acceptable)
      .last.ckpt.<token>.pending             step 6 being written (never loaded)

What Lightning's own ``TorchCheckpointIO`` does differently (TESTBED "What the peers
do"): it stages in ``$TMPDIR`` (on HPC usually another filesystem than the checkpoint
directory, so the "rename" falls back to copying *in place*, and a crash truncates the
previous ``last.ckpt``), never fsyncs, and never verifies; ``AsyncCheckpointIO``
removes the previous checkpoint before the new one is written (Lightning #1150).

A save (global rank 0; from Lightning's thread, or the worker thread of the async
plugin):

1. ``torch.save`` streams into ``.<name>.<token>.pending`` in the destination
   directory (same filesystem, so the rename in 3 never degrades to a copy:
   FAILURE_MODES D5), hashing every byte as it is written; the file is fsync'd
   (``LocalStorage.open_write``).
2. The manifest is replaced atomically (``LocalStorage.write_bytes_atomic``: temp,
   fsync, rename, directory fsync) with one listing the new version first and the
   versions the file may still hold after it.
3. The pending file is renamed onto ``<name>`` (``LocalStorage.replace_file``: readers
   see the old or the new file, never a part) and the directory is fsync'd.
4. The manifest is replaced again, listing only the new version.

At every instant the file at ``<name>`` is one of the versions its manifest lists, so a
load can always tell "complete" from "torn". A crash leaves at most a pending file,
removed by the next save into that directory.

A load checks the file against its manifest: size, then (``verify=True``) the checksum,
before ``torch.load`` with ``weights_only=True`` unless the caller passes
``weights_only=False`` (loading pickle executes code from the file: DESIGN invariant 8).
A file without a manifest (written by another plugin) loads with a warning, or is
refused with ``require_manifest=True``. A symbolic link (``save_last="link"`` makes
``last.ckpt`` one) is verified through its target and the target's manifest.

Adopting a stock run
--------------------
A run saved with Lightning's own plugin has ``.ckpt`` files without manifests, and a
crash may have torn one (the in-place copy above). ``atomic_checkpoint.adopt(DIR,
framework="lightning")`` (or ``latest_checkpoint(DIR, adopt=True)``, or
``atomic-checkpoint adopt DIR --framework lightning``) checks each
``...step=<N>...ckpt`` (``<N>`` zero-padded or not) with Lightning's completeness rule
(a whole ``torch.save`` archive: its central directory, then every member's CRC-32;
then the ``global_step`` it records, read with ``weights_only=True``, must be ``<N>``)
and writes a manifest marked ``"adopted"`` beside each complete one, with the step the
file records; a torn, renamed or copied one is refused and gets none.
From then on those files verify like the plugin's own, and :func:`latest_checkpoint`
resumes from the newest complete one.

``remove_checkpoint`` unlinks the ``.ckpt`` first (after which nothing is loadable under
that name), then its manifest, and never touches a directory. The async plugin queues
removals behind the saves submitted before them and skips them when such a save
failed, so the previous checkpoint stays until the new one is committed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import importlib
import json
import logging
import os
import pickle
import re
import threading
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar, cast

import torch

from .._checks import flag
from .._faults import fault_point
from ..adopt import zip_members_problem
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SerializationError,
    StorageError,
    StorageFullError,
    UnsafeCheckpointError,
)
from ..layout import (
    LIGHTNING_DEPTH,
    LIGHTNING_MANIFEST_SUFFIX,
    parse_sibling_pending,
    sibling_pending_name,
)
from ..manifest import DEFAULT_ALGORITHM, Hasher
from ..storage import is_url, posix
from ..storage.local import LocalStorage
from ..storage.temps import parse_temp_name

__all__ = [
    "MANIFEST_SUFFIX",
    "AsyncAtomicCheckpointIO",
    "AtomicCheckpointIO",
    "CheckpointFile",
    "LightningClasses",
    "PreemptionCallback",
    "adopt_checkpoints",
    "checkpoint_io_classes",
    "latest_checkpoint",
    "preemption_callback_class",
    "stock_checkpoint_problem",
    "verify_checkpoint",
]

log = logging.getLogger("atomic_checkpoint")
_T = TypeVar("_T")

MANIFEST_SUFFIX = LIGHTNING_MANIFEST_SUFFIX
_FORMAT = "atomic-checkpoint/lightning-file"
_SCHEMA = 1
# Versions a manifest may list: the new one plus those the file may still hold. After
# a completed save it lists one; each save that crashed between steps 2 and 3 adds one.
_MAX_VERSIONS = 8
_READ_CHUNK = 8 << 20


# ---------------------------------------------------------------------- manifests
@dataclass(frozen=True)
class _Version:
    size_bytes: int
    checksum: str
    algorithm: str
    global_step: int | None
    epoch: int | None
    written_unix: float
    #: Saved with ``save_weights_only=True`` (no optimizer or callback state: it cannot
    #: resume a fit); None: not recorded (an older manifest, an adopted file, a state
    #: that is not a Trainer checkpoint).
    weights_only: bool | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {
            "size": self.size_bytes,
            "checksum": self.checksum,
            "algorithm": self.algorithm,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "written_unix": self.written_unix,
        }
        if self.weights_only is not None:
            doc["weights_only"] = self.weights_only
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str) -> _Version:
        try:
            size = doc["size"]
            checksum = doc["checksum"]
            algorithm = doc["algorithm"]
            step = doc.get("global_step")
            epoch = doc.get("epoch")
            written = float(doc.get("written_unix", 0.0))
            weights_only = doc.get("weights_only")
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where}: malformed version entry {doc!r}") from exc
        if not isinstance(size, int) or size < 0 or not isinstance(checksum, str):
            raise CorruptCheckpointError(f"{where}: malformed version entry {doc!r}")
        if not isinstance(algorithm, str) or weights_only not in (None, True, False):
            raise CorruptCheckpointError(f"{where}: malformed version entry {doc!r}")
        return cls(
            size,
            checksum,
            algorithm,
            _int_or_none(step),
            _int_or_none(epoch),
            written,
            weights_only,
        )


def _weights_only(fields: Mapping[str, Any]) -> bool | None:
    """Whether a Trainer checkpoint was saved with ``save_weights_only=True``: the model
    and loops without optimizer, scheduler or callback state (Lightning's
    ``dump_checkpoint``). None for a state that is not a Trainer checkpoint (Fabric's
    ``fabric.save`` of the user's own dict)."""
    if "state_dict" not in fields or "loops" not in fields:
        return None
    return "optimizer_states" not in fields and "callbacks" not in fields


@dataclass(frozen=True)
class CheckpointFile:
    """A ``.ckpt`` file as checked against its manifest.

    Attributes:
        path: the file.
        size_bytes: its size.
        global_step: the trainer's ``global_step`` recorded at save time (None when the
            file has no manifest).
        epoch: the epoch recorded at save time.
        checksum: the verified checksum (None when not computed).
        has_manifest: False for files written without this plugin (unverified).
        is_newest: False when the newest save of this path did not complete and the
            file is an earlier complete version.
        link: the symbolic link that was asked for (``save_last="link"``'s
            ``last.ckpt``), when ``path`` is its target; None otherwise.
        adopted: the manifest was written by adoption (checksum taken then, not
            while the file was written).
        written_unix: when the verified version's save committed (recorded in the
            manifest; None without one).
        weights_only: saved with ``ModelCheckpoint(save_weights_only=True)``: it loads
            weights but cannot resume a fit (no optimizer, scheduler or callback state).
            None where not recorded (no manifest, an adopted file, a manifest of an
            older version, a Fabric state).
    """

    path: str
    size_bytes: int
    global_step: int | None
    epoch: int | None
    checksum: str | None
    has_manifest: bool
    is_newest: bool = True
    link: str | None = None
    adopted: bool = False
    written_unix: float | None = None
    weights_only: bool | None = None


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    return None


def _manifest_path(path: str) -> str:
    return path + MANIFEST_SUFFIX


def _read_versions(path: str) -> list[_Version] | None:
    """The versions listed by the manifest of ``path``; None when it has no manifest.

    Raises:
        CorruptCheckpointError: the manifest exists but is unreadable.
    """
    found = _read_manifest(path)
    return None if found is None else found[0]


def _read_manifest(path: str) -> tuple[list[_Version], bool] | None:
    """(versions, adopted) from the manifest of ``path``; None when it has none."""
    where = _manifest_path(path)
    data = posix.read_head(where, 1 << 20)
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # untrusted: may nest too deeply to parse
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise CorruptCheckpointError(f"{where}: not an atomic-checkpoint file manifest")
    if not isinstance(doc.get("schema"), int) or doc["schema"] > _SCHEMA:
        raise CorruptCheckpointError(
            f"{where}: manifest schema {doc.get('schema')!r} is newer than this version "
            f"of atomic-checkpoint understands ({_SCHEMA}); upgrade atomic-checkpoint"
        )
    versions = doc.get("versions")
    if not isinstance(versions, list) or not versions:
        raise CorruptCheckpointError(f"{where}: the manifest lists no version")
    return [_Version.from_json(v, where) for v in versions], doc.get("adopted") is True


def _manifest_bytes(name: str, versions: list[_Version], *, adopted: bool = False) -> bytes:
    doc: dict[str, Any] = {
        "format": _FORMAT,
        "schema": _SCHEMA,
        "file": name,
        "versions": [v.to_json() for v in versions],
    }
    if adopted:
        # Written by adoption: the checksum was taken then, not while the file was
        # written (what it proves starts at adoption).
        doc["adopted"] = True
    return json.dumps(doc, indent=1).encode()


def _hash_file(path: str, algorithm: str) -> tuple[str, int]:
    h = Hasher(algorithm)
    size = posix.hash_file(path, h, _READ_CHUNK)
    return h.hexdigest(), size


def verify_checkpoint(
    path: str | os.PathLike[str], *, full: bool = True, require_manifest: bool = False
) -> CheckpointFile:
    """Check a ``.ckpt`` file against its manifest without loading it.

    Args:
        path: the ``.ckpt`` file.
        full: recompute the checksum (one sequential read); otherwise sizes only.
        require_manifest: refuse a file that has no manifest.

    A symbolic link (``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` one) is
    verified through its target, against the target's manifest: the returned ``path``
    is the target (load that, not the link, which Lightning may repoint meanwhile)
    and ``link`` the link.

    Raises:
        CheckpointNotFoundError: the file (or a link's target) does not exist.
        CorruptCheckpointError: it is not a version its manifest lists (torn,
            truncated or modified), or it has no manifest and one is required.
    """
    final = _local_path(path)
    if posix.is_link(final):
        target = posix.real_path(final)
        if not posix.lexists(target):
            raise CheckpointNotFoundError(
                f"checkpoint file {final!r} is a symbolic link to {target!r}, which does not "
                "exist (its target was removed); resume from another checkpoint"
            )
        resolved = verify_checkpoint(target, full=full, require_manifest=require_manifest)
        return dataclasses.replace(resolved, link=final)
    size_bytes = posix.file_size(final)
    if size_bytes is None:
        raise CheckpointNotFoundError(f"checkpoint file {final!r} does not exist")
    recorded = _read_manifest(final)
    versions = None if recorded is None else recorded[0]
    if versions is None:
        if require_manifest:
            raise CorruptCheckpointError(
                f"{final!r} has no manifest ({os.path.basename(_manifest_path(final))}): it "
                "was not written by AtomicCheckpointIO, so it cannot be verified; pass "
                "require_manifest=False to load it unverified"
            )
        return CheckpointFile(final, size_bytes, None, None, None, has_manifest=False)
    sized = [v for v in versions if v.size_bytes == size_bytes]
    if not sized:
        listed = ", ".join(str(v.size_bytes) for v in versions)
        raise CorruptCheckpointError(
            f"{final!r} is {size_bytes} bytes but its manifest records {listed}: the file "
            "is torn or truncated, or was modified after the save. Resume from another "
            "checkpoint (atomic_checkpoint.integrations.lightning.latest_checkpoint)"
        )
    match = sized[0]
    digest: str | None = None
    if full:
        digests: dict[str, str] = {}
        found = None
        for v in sized:
            if v.algorithm not in digests:
                digests[v.algorithm], _ = _hash_file(final, v.algorithm)
            if digests[v.algorithm] == v.checksum:
                found = v
                break
        if found is None:
            raise CorruptCheckpointError(
                f"{final!r}: checksum {next(iter(digests.values()))} matches none recorded "
                f"in its manifest ({', '.join(v.checksum for v in sized)}): the file is "
                "corrupt. Resume from another checkpoint"
            )
        match, digest = found, found.checksum
    newest = match is versions[0]
    if not newest:
        log.warning(
            "%s: the newest save of this file (step %s) did not complete; it holds the "
            "previous complete version (step %s)",
            final,
            versions[0].global_step,
            match.global_step,
        )
    return CheckpointFile(
        final,
        size_bytes,
        match.global_step,
        match.epoch,
        digest,
        True,
        is_newest=newest,
        adopted=recorded is not None and recorded[1],
        written_unix=match.written_unix,
        weights_only=match.weights_only,
    )


def _checkpoint_names(dirpath: str | os.PathLike[str]) -> list[str] | None:
    """The ``.ckpt`` files under ``dirpath``, as ``/``-separated paths relative to it,
    sorted: those at its top and, ``LIGHTNING_DEPTH`` levels down, those a ``/`` in a
    ``ModelCheckpoint`` filename put in sub-folders (hidden folders and links to
    folders are not entered). None: ``dirpath`` cannot be listed."""
    directory = _local_path(dirpath)
    top = posix.list_dir(directory)
    if top is None:
        return None
    found: list[str] = []
    level = [("", sorted(top))]
    for depth in range(LIGHTNING_DEPTH + 1):
        below = []
        for prefix, names in level:
            for name in names:
                rel = prefix + name
                path = os.path.join(directory, rel)
                if name.endswith(".ckpt") and not posix.is_dir(path):
                    found.append(rel)
                elif (
                    depth < LIGHTNING_DEPTH
                    and not name.startswith(".")
                    and posix.is_dir(path)
                    and not posix.is_link(path)
                ):
                    listed = posix.list_dir(path)
                    if listed:
                        below.append((rel + "/", sorted(listed)))
        level = below
    return sorted(found)


def latest_checkpoint(
    dirpath: str | os.PathLike[str],
    *,
    full: bool = False,
    adopt: bool = False,
    include_weights_only: bool = False,
) -> str | None:
    """The ``.ckpt`` file in ``dirpath`` with the highest recorded ``global_step`` that
    verifies against its manifest and can resume a fit; None if there is none.

    Use it to resume from the newest complete checkpoint whatever its name
    (``trainer.fit(model, ckpt_path=latest_checkpoint(dirpath))``). Steps come from the
    manifests, never from modification times or names. Among files of one step, the
    one whose save committed last wins (recorded in its manifest): e.g. the
    ``ModelCheckpoint`` file written after a ``PreemptionCallback`` file of the same
    step, its callback state holding that epoch's validation. A file whose state had
    no ``global_step`` (Lightning Fabric's ``fabric.save``) ranks by when its save
    committed, below any file with a step. Files without a
    manifest are not considered (a warning names them when nothing else is found, with
    ``adopt=True`` to take the complete ones); invalid ones are skipped with a warning
    that says what is wrong. Files a ``ModelCheckpoint(save_weights_only=True)`` wrote
    hold no optimizer, scheduler or callback state, and ``fit`` refuses them: they are
    passed over (a warning says so when one is newer than the file returned). Files in
    sub-folders (a ``/`` in a ``ModelCheckpoint`` filename, e.g. a metric named
    ``val/loss``) count, up to 3 levels down.

    Args:
        dirpath: ``ModelCheckpoint``'s directory.
        full: verify every candidate's checksums (a full read of each). By default
            every candidate's files are checked by size and only the one returned is
            read whole: one that fails its checksums is skipped with a warning and the
            next older one is returned, so a corrupt newest file never fails every
            restart of a requeued job.
        adopt: first adopt the complete ``.ckpt`` files a stock run left there
            (``atomic_checkpoint.adopt(dirpath, framework="lightning")``; torn ones are
            refused with a warning), so a stock run continued with this plugin resumes
            from its newest complete checkpoint. Only the process of global rank 0
            (``RANK``, else ``NODE_RANK`` and ``LOCAL_RANK``, 0 when unset) adopts: with
            Lightning's own DDP launcher the other ranks start after it has. Under
            ``torchrun``, adopt once before the job (``atomic-checkpoint adopt``).
        include_weights_only: also consider files saved with ``save_weights_only=True``
            (to load weights for evaluation or fine-tuning, not to resume a fit).

    Raises:
        LockHeldError: ``adopt`` and a job holds the run lock of ``dirpath``.
    """
    full, adopt = flag("full", full), flag("adopt", adopt)
    include_weights_only = flag("include_weights_only", include_weights_only)
    directory = _local_path(dirpath)
    if adopt and _launch_rank() == 0 and posix.is_dir(directory):
        adopt_checkpoints(directory)
    names = _checkpoint_names(directory)
    if names is None:
        return None
    candidates: list[tuple[bool, int, float, str]] = []
    unmanifested: list[str] = []
    weights: list[tuple[int, str]] = []  # (step, name): passed over, weights only
    for name in names:
        if not posix.exists(os.path.join(directory, name + MANIFEST_SUFFIX)):
            unmanifested.append(name)
            continue
        path = os.path.join(directory, name)
        try:
            info = verify_checkpoint(path, full=full, require_manifest=True)
        except CheckpointError as exc:
            log.warning("skipping %s: %s", path, exc)
            continue
        step = info.global_step
        if info.weights_only and not include_weights_only:
            weights.append((step or 0, name))
            continue
        # Files of one step, and files without a step: the last committed first. A
        # preemption file saved at a batch end is followed by that epoch's validation
        # and ModelCheckpoint's files of the same step, whose callback state knows the
        # new best; ranked by name, the resumed ModelCheckpoint lost it.
        when = info.written_unix or 0.0
        candidates.append((step is not None, step or 0, when, name))
    best: tuple[bool, int, float, str] | None = None
    for key in sorted(candidates, reverse=True):
        if not full:
            # The one returned is read whole and its checksums checked (the others were
            # checked by size): a corrupt newest would fail fit() at every requeue.
            path = os.path.join(directory, key[3])
            try:
                verify_checkpoint(path, full=True, require_manifest=True)
            except CheckpointError as exc:
                log.warning("skipping %s: %s; trying the next older checkpoint", path, exc)
                continue
        best = key
        break
    if best is not None and "last.ckpt" in unmanifested:
        # save_last=True with save_top_k=1: the newest state may be only in a stock
        # last.ckpt that was not adopted, and resuming from the older top-k file would
        # silently go back.
        last_t = posix.mtime(os.path.join(directory, "last.ckpt"))
        best_t = posix.mtime(os.path.join(directory, best[3]))
        if last_t is not None and best_t is not None and last_t > best_t:
            log.warning(
                "latest_checkpoint: %s has a last.ckpt written without a manifest after %s "
                "(the newest checkpoint found), not adopted (%s), so resuming from %s may "
                "go back%s",
                directory,
                best[3],
                "it is torn or records no global_step" if adopt else "adopt=False",
                best[3],
                ""
                if adopt
                else ". Pass adopt=True to adopt it by the global_step it records, if it is "
                "complete",
            )
    newer = [n for step, n in sorted(weights, reverse=True) if best is None or step > best[1]]
    if newer:
        log.warning(
            "latest_checkpoint: passing over %s in %s: saved with save_weights_only=True, "
            "it cannot resume a fit (no optimizer, scheduler or callback state)%s. Pass "
            "include_weights_only=True to load weights from it",
            ", ".join(newer[:3]) + (", ..." if len(newer) > 3 else ""),
            directory,
            "" if best is not None else "; no other checkpoint found: returning None",
        )
    if best is None and unmanifested:
        log.warning(
            "latest_checkpoint: %s holds %d .ckpt file(s) without a manifest (%s%s), written "
            "without AtomicCheckpointIO or torn, and no verified one: returning None, so a "
            "resume starts from scratch. To resume from the complete ones, pass adopt=True "
            "(or run `atomic-checkpoint adopt %s --framework lightning` once)",
            directory,
            len(unmanifested),
            ", ".join(unmanifested[:5]),
            ", ..." if len(unmanifested) > 5 else "",
            directory,
        )
    return os.path.join(directory, best[3]) if best is not None else None


# ---------------------------------------------------------------------- adoption
# The ``.ckpt`` names adoption considers: those carrying the step (Lightning's default
# ``{epoch}-{step}``, with its ``-v<n>`` version suffix, or more after it, such as
# ``{epoch}-{step}-{val_loss:.3f}``; zero-padded by ``{step:05d}``: the leading zeros
# are left out of the group); ``last.ckpt`` names none.
_CKPT_NAME_RE = re.compile(
    r"^(?:.*[^A-Za-z0-9])?step=0*(?P<step>0|[1-9][0-9]{0,18})(?![0-9])"
    r"(?:[^A-Za-z0-9].*)?\.ckpt\Z"
)
# What adoption considers: those, and ``last.ckpt`` (``save_last=True``; ``last-v<n>.ckpt``
# when a restarted run found the name taken), often the newest, by the step it records.
_ADOPT_NAME_RE = re.compile(r"^last(?:-v[1-9][0-9]{0,8})?\.ckpt\Z|" + _CKPT_NAME_RE.pattern[1:])
_EPOCH_RE = re.compile(r"(?:^|[^A-Za-z0-9])epoch=0*(0|[1-9][0-9]{0,18})(?:[^0-9]|$)")


def stock_checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """Lightning's completeness rule for a ``.ckpt`` written without this plugin: None
    when it is a whole ``torch.save`` archive, else why not (one sentence).

    Whole means: the zip central directory (written last) is there, every member lies
    inside the file, and every member's CRC-32 (recorded by ``torch.save``) matches its
    bytes; the archive holds ``data.pkl``. Then the ``global_step`` it records (read
    with ``weights_only=True``: no code from the file runs) must be the step its name
    gives (a copied or renamed file is refused); one that needs more than
    ``weights_only=True`` to read keeps the step of its name. A file this plugin wrote
    is judged by its manifest instead. Reads the whole file; never writes.
    """
    final = _local_path(path)
    try:
        if posix.exists(final + MANIFEST_SUFFIX):
            verify_checkpoint(final, full=False, require_manifest=True)
            return None
        size = posix.file_size(final)
    except StorageError as exc:
        return f"cannot be read: {exc}"
    except CheckpointError as exc:
        return str(exc)
    if size is None:
        return "cannot be read: it does not exist"
    if size == 0:
        return "it is empty (0 bytes): torn by a crash during the save (Lightning truncates first)"
    try:
        with zipfile.ZipFile(final) as archive:
            names = archive.namelist()
            if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
                return "it is a zip archive without data.pkl: not a torch.save file"
            problem = zip_members_problem(archive, size, "the archive")
            if problem is not None:
                return problem
            bad = archive.testzip()  # reads every member, checks its CRC-32
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
        return (
            f"it is not a whole torch.save archive ({exc}): truncated or torn by a crash "
            "during the save"
        )
    except OSError as exc:
        return f"cannot be read: {exc}"
    if bad is not None:
        return f"member {bad!r} does not match its CRC-32: the file is torn or corrupt"
    recorded = _recorded_step(final)
    if isinstance(recorded, str):
        return recorded
    named = _CKPT_NAME_RE.match(os.path.basename(final))
    if named is not None and recorded[0] is not None and recorded[0] != int(named["step"]):
        return (
            f"it records global_step {recorded[0]}, not {int(named['step'])}: a copied or "
            "renamed file?"
        )
    return None


def _recorded_step(path: str) -> tuple[int | None, int | None, bool | None] | str:
    """(``global_step``, ``epoch``, whether it was saved weights-only) that the whole
    ``torch.save`` file at ``path`` records (None for one it lacks), read with
    ``weights_only=True`` (no code from the file runs; tensors are mapped, not read);
    else why they cannot be read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        # Its hyper-parameters hold classes weights_only refuses (a dataclass, a
        # Namespace): whole by its archive, its step is then the one its name gives,
        # as before this check (no code from the file is ever run to read it).
        return None, None, None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        return f"torch.load cannot read it: {exc}"
    if not isinstance(state, Mapping):
        return None, None, None
    step, epoch = _int_or_none(state.get("global_step")), _int_or_none(state.get("epoch"))
    return step, epoch, _weights_only(state)


def _record_adopted(path: str) -> bool:
    """Write the manifest of a complete stock ``.ckpt`` (adoption's ``record``): its
    checksum taken now, the ``global_step`` and ``epoch`` the file records (for a file
    that records none, those its name gives), marked adopted. False when it has a
    manifest already."""
    final = _local_path(path)
    directory, name = os.path.split(final)
    if posix.exists(final + MANIFEST_SUFFIX):
        return False
    recorded = _recorded_step(final)
    if isinstance(recorded, str):
        raise CorruptCheckpointError(f"{final!r}: {recorded}")
    match = _CKPT_NAME_RE.match(name)
    epoch = _EPOCH_RE.search(name)
    digest, size = _hash_file(final, DEFAULT_ALGORITHM)
    posix.fsync_file(final)  # a stock save never fsyncs: the manifest must not outlive the data
    version = _Version(
        size,
        digest,
        DEFAULT_ALGORITHM,
        recorded[0] if recorded[0] is not None else int(match["step"]) if match else None,
        recorded[1] if recorded[1] is not None else int(epoch[1]) if epoch else None,
        time.time(),
        recorded[2],
    )
    store = LocalStorage(directory)
    store.fsync_dir("")
    store.write_bytes_atomic(name + MANIFEST_SUFFIX, _manifest_bytes(name, [version], adopted=True))
    return True


def adopt_checkpoints(dirpath: str | os.PathLike[str], *, dry_run: bool = False) -> Any:
    """Adopt the complete ``.ckpt`` files of a stock Lightning run in ``dirpath``:
    ``atomic_checkpoint.adopt(dirpath, framework="lightning")``, with each refused
    (torn) file named in a warning. Returns its ``AdoptResult`` (steps adopted,
    refused with the reason, already recorded).

    Raises:
        LockHeldError: a job holds the run lock of ``dirpath``.
    """
    from ..adopt import adopt

    result = adopt(_local_path(dirpath), framework="lightning", dry_run=dry_run)
    for step, why in sorted(result.refused.items()):
        log.warning("not adopting the checkpoint of step %d in %s: %s", step, dirpath, why)
    return result


def _launch_rank() -> int:
    """This process's global rank from the launcher's environment (before any process
    group exists): ``RANK``, else Lightning's ``NODE_RANK`` and ``LOCAL_RANK``."""
    rank = os.environ.get("RANK", "").strip()
    if rank.isdigit():
        return int(rank)
    node = os.environ.get("NODE_RANK", "0").strip()
    local = os.environ.get("LOCAL_RANK", "0").strip()
    return 0 if node in ("", "0") and local in ("", "0") else 1


def _register_adoption() -> None:
    """Make ``adopt(..., framework="lightning")`` know Lightning's rule and record."""
    try:
        from ..adopt import register_framework
    except ImportError:  # pragma: no cover - the adopt module is part of the package
        return
    register_framework(
        "lightning",
        _ADOPT_NAME_RE,
        stock_checkpoint_problem,
        record=_record_adopted,
        step_inside=_step_inside,
    )


def _step_inside(path: str) -> int | str | None:
    """The ``global_step`` a ``last.ckpt`` records (adoption's ``step_inside``); None
    when it records none; why, when it cannot be read (a torn file: refused, said)."""
    final = _local_path(path)
    recorded = _recorded_step(final)
    if isinstance(recorded, str):  # said as adoption says it of a torn step-named file
        return stock_checkpoint_problem(final) or recorded
    return recorded[0]


# ---------------------------------------------------------------------- file writes
def _local_path(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    if is_url(text):
        raise CheckpointError(
            f"AtomicCheckpointIO writes to mounted filesystems (local disk, NFS, Lustre, "
            f"sshfs, FUSE), not to {text!r}: point ModelCheckpoint(dirpath=...) at a "
            "mounted path, or save with CheckpointManager on an object-store root"
        )
    return os.path.abspath(text.removeprefix("file://"))


def _ensure_dir(directory: str) -> None:
    """Create ``directory`` and make every new entry durable (fsync of each parent)."""
    missing = []
    d = directory
    while not posix.is_dir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    if not missing:
        return
    LocalStorage(directory).makedirs("")
    for created in reversed(missing):
        LocalStorage(os.path.dirname(created)).fsync_dir("")


def _full_disk(exc: StorageFullError, final: str) -> StorageFullError:
    """``exc`` with the advice that works here: a Lightning directory is not a manager's
    root, so ``prune`` refuses it; ModelCheckpoint keeps and removes its files."""
    return StorageFullError(
        f"cannot save {final!r}: the storage is full "
        f"({os.strerror(exc.errno) if exc.errno else 'no space left'}). The previous "
        f"file by that name is untouched. Free space (or inodes: `df -i`): lower "
        "ModelCheckpoint(save_top_k=...), or delete old .ckpt files of that directory "
        f"together with their {LIGHTNING_MANIFEST_SUFFIX} files, or other files; then "
        "save again",
        errno=exc.errno,
        path=exc.filename,
    )


class _HashingSink:
    """What ``torch.save`` writes into: hashes and forwards every chunk.

    ``torch.save`` writes sequentially through ``write``/``flush`` only (its zip writer
    never seeks on a stream), so the checksum covers the file exactly. It also replaces
    an exception raised by ``write`` with a RuntimeError of its own: the original is
    kept here and raised instead.
    """

    def __init__(self, writer: Any, hasher: Hasher, *, rank: int, step: int | None):
        self._writer = writer
        self._hasher = hasher
        self._rank = rank
        self._step = step
        self.size_bytes = 0
        self.writes = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            view = memoryview(data)
            self._writer.write(view)
            self._hasher.update(view)
            n = view.nbytes
            self.size_bytes += n
            self.writes += 1
            if self.writes == 2:
                fault_point("mid_write", self._rank, self._step)
            return n
        except BaseException as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        return None


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


def _torch_load(path: str, map_location: Any, weights_only: bool | None) -> Any:
    safe = True if weights_only is None else bool(weights_only)
    try:
        return torch.load(path, map_location=map_location, weights_only=safe)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeCheckpointError(
            f"{path!r} needs more than tensors and plain containers to load ({first}), and "
            "loading arbitrary pickle executes code from the file, so it was refused. If you "
            "trust this file, pass weights_only=False (e.g. trainer.fit(..., "
            "weights_only=False)) or allowlist its classes with "
            "torch.serialization.add_safe_globals([...])"
        ) from exc
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint file {path!r} does not exist") from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path!r} cannot be read by torch.load: {exc}") from exc


def _default_map_location(storage: Any, loc: Any) -> Any:
    return storage


class _AtomicFileIO:
    """Lightning ``CheckpointIO`` whose every ``.ckpt`` is atomic, fsync'd and verified.

    Args:
        verify: on load, recompute the checksum of the file (one extra sequential read,
            usually from the page cache) before ``torch.load``; False checks sizes only.
        require_manifest: refuse to load a ``.ckpt`` that has no manifest (one written by
            another plugin); by default it loads with a warning.

    Called by Lightning on global rank 0 only (``save_checkpoint`` and
    ``remove_checkpoint``) and on every rank (``load_checkpoint``), from the training
    thread. Blocking; not safe for concurrent calls on the same path (the async plugin
    serialises them).
    """

    def __init__(self, *, verify: bool = True, require_manifest: bool = False):
        super().__init__()
        self.verify = flag("verify", verify)
        self.require_manifest = flag("require_manifest", require_manifest)
        self._swept: set[str] = set()
        self._warned_unverified: set[str] = set()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(verify={self.verify}, require_manifest={self.require_manifest})"
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically and durably (see the module doc).

        Raises:
            TypeError: ``storage_options`` was given (this plugin takes none).
            StorageError: the write failed (``StorageFullError`` on ENOSPC); the
                previous file at ``path`` is untouched.
            SerializationError: ``torch.save`` cannot serialise the checkpoint.
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint takes no storage_options "
                f"(got {storage_options!r})"
            )
        final = _local_path(path)
        if posix.is_dir(final):
            # Found before anything is written: the rename would fail after the new
            # manifest, which then called the directory a torn checkpoint file.
            raise StorageError(
                f"cannot save a checkpoint to {final!r}: it is a directory (nothing written)",
                errno=errno.EISDIR,
                path=final,
            )
        directory, name = os.path.split(final)
        _ensure_dir(directory)
        self._sweep(directory)
        store = LocalStorage(directory)
        rank = _rank()
        fields = checkpoint if isinstance(checkpoint, Mapping) else {}
        step = _int_or_none(fields.get("global_step"))
        epoch = _int_or_none(fields.get("epoch"))
        pending = sibling_pending_name(name)
        hasher = Hasher(DEFAULT_ALGORITHM)
        writer = store.open_write(pending)
        sink = _HashingSink(writer, hasher, rank=rank, step=step)
        try:
            torch.save(checkpoint, sink)  # type: ignore[arg-type]
            writer.close()
        except BaseException as exc:
            writer.abort()
            error = sink.error if sink.error is not None else exc
            if isinstance(error, StorageFullError):
                raise _full_disk(error, final) from exc
            if error is not exc:
                raise error from exc
            if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
                raise
            raise SerializationError(
                f"torch.save could not serialise the checkpoint for {final!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        new = _Version(
            sink.size_bytes,
            hasher.hexdigest(),
            hasher.algorithm,
            step,
            epoch,
            time.time(),
            _weights_only(fields),
        )
        try:
            previous = self._versions_on_disk(final)
            store.write_bytes_atomic(
                name + MANIFEST_SUFFIX, _manifest_bytes(name, [new, *previous][:_MAX_VERSIONS])
            )
            fault_point("after_manifest", rank, step)
            store.replace_file(pending, name)  # atomic rename, then the directory fsync
        except BaseException:
            with contextlib.suppress(CheckpointError):
                store.delete_file(pending)
            raise
        fault_point("after_rename", rank, step)
        # The file is now the new version: list it alone, so the manifest stays small.
        store.write_bytes_atomic(name + MANIFEST_SUFFIX, _manifest_bytes(name, [new]))
        log.info("saved %s (%d bytes, step %s)", final, new.size_bytes, step)

    def _versions_on_disk(self, final: str) -> list[_Version]:
        """The versions the file at ``final`` may hold now (it must stay loadable until
        the rename): its manifest's, or, for a file without one, its own checksum."""
        try:
            versions = _read_versions(final)
        except CorruptCheckpointError as exc:
            log.warning("%s: replacing an unreadable manifest: %s", final, exc)
            versions = None
        if versions is not None:
            return versions
        if posix.is_link(final) or not posix.is_file(final):
            # A link (``save_last="link"``, from before a resume: Lightning then saves a
            # full last.ckpt over it) is verified through its target's manifest until
            # the rename replaces the link itself; hashing it refused the save.
            return []
        digest, size = _hash_file(final, DEFAULT_ALGORITHM)
        return [_Version(size, digest, DEFAULT_ALGORITHM, None, None, 0.0)]

    def _sweep(self, directory: str) -> None:
        """Remove pending files left by crashed saves, once per directory.

        Saves into one directory come from one process (global rank 0), one at a time
        (the async plugin serialises them), so any pending file found before our first
        save there is abandoned.
        """
        if directory in self._swept:
            return
        self._swept.add(directory)
        store = LocalStorage(directory)
        for name in store.listdir(""):
            temp = parse_temp_name(name)  # a manifest's replace, killed half way
            if parse_sibling_pending(name) is not None or (
                temp is not None and temp.final.endswith(".ckpt" + MANIFEST_SUFFIX)
            ):
                try:
                    store.delete_file(name)
                    log.info("removed abandoned %s", os.path.join(directory, name))
                except CheckpointError as exc:
                    log.warning("could not remove abandoned %s: %s", name, exc)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable[..., Any] | Any = _default_map_location,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify ``path`` against its manifest, then ``torch.load`` it.

        ``weights_only=None`` means True: tensors and plain containers only. Pass
        False only for files you trust.

        Raises:
            CheckpointNotFoundError: no such file (a ``FileNotFoundError``).
            CorruptCheckpointError: the file is torn, truncated or corrupt.
            UnsafeCheckpointError: it needs pickle code execution and
                ``weights_only`` is not False.
        """
        info = verify_checkpoint(path, full=self.verify, require_manifest=self.require_manifest)
        if not info.has_manifest and info.path not in self._warned_unverified:
            self._warned_unverified.add(info.path)
            log.warning(
                "%s has no manifest (not written by AtomicCheckpointIO): loading it unverified",
                info.path,
            )
        return _torch_load(info.path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the ``.ckpt`` at ``path`` and its manifest; a missing file is fine.

        The data file goes first: from then on nothing is loadable under that name,
        so a crash half way leaves at most an orphan manifest (ignored everywhere).
        Directories are never removed (this plugin never writes one).
        """
        final = _local_path(path)
        directory, name = os.path.split(final)
        if posix.is_dir(final):
            log.warning(
                "not removing %s: it is a directory, and AtomicCheckpointIO only removes "
                "the .ckpt files it writes",
                final,
            )
            return
        store = LocalStorage(directory)
        store.delete_file(name)
        store.delete_file(name + MANIFEST_SUFFIX)
        if posix.is_dir(directory):
            store.fsync_dir("")
        log.info("removed %s", final)

    def teardown(self) -> None:
        """Nothing to release (every save finished before it returned)."""


# ---------------------------------------------------------------------- async
def _snapshot(obj: Any) -> Any:
    """Copy every tensor into host memory, on the calling thread; containers are
    rebuilt, other leaves are shared (they are immutable in a Lightning checkpoint)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        items = {k: _snapshot(v) for k, v in obj.items()}
        if type(obj) in (dict, OrderedDict):
            return type(obj)(items)
        try:  # dict subclasses (AttributeDict, defaultdict) keep their type
            rebuilt = copy.copy(obj)
            rebuilt.clear()
            rebuilt.update(items)
            return rebuilt
        except Exception:
            return items
    if isinstance(obj, Mapping):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        values = [_snapshot(v) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    return obj


class _AsyncAtomicFileIO:
    """``AtomicCheckpointIO`` in a background thread; the previous checkpoint stays
    until the new one is committed.

    ``save_checkpoint`` copies every tensor into host memory (the snapshot) and returns;
    one worker thread writes the snapshots in order. ``remove_checkpoint`` is queued
    behind the saves submitted before it, and skipped (with a warning) if one of them
    failed: Lightning's ``ModelCheckpoint`` removes the previous file right after
    asking for the new one, and Lightning's own ``AsyncCheckpointIO`` then deletes it
    while the new one is still being written. ``ModelCheckpoint(save_last="link")``'s
    link of ``last.ckpt`` to the new file is queued and skipped the same way, so
    ``last.ckpt`` never points at a file that is not committed.

    A failure of a background save is raised once, by the next ``save_checkpoint`` or by
    ``teardown`` (Lightning calls it at the end of ``fit``).

    Args:
        checkpoint_io: the synchronous plugin to run in the background (default: a new
            ``AtomicCheckpointIO``).
        verify: passed to the default ``AtomicCheckpointIO``.
        require_manifest: passed to the default ``AtomicCheckpointIO``.
    """

    _sync_cls: type[_AtomicFileIO] = _AtomicFileIO

    def __init__(
        self,
        checkpoint_io: _AtomicFileIO | None = None,
        *,
        verify: bool = True,
        require_manifest: bool = False,
    ):
        super().__init__()
        if checkpoint_io is not None and not isinstance(checkpoint_io, _AtomicFileIO):
            # Found here, not by the first background save (an AttributeError logged
            # there, and another from teardown()).
            raise TypeError(
                f"checkpoint_io must be an AtomicCheckpointIO (the plugin whose writes go "
                f"to the background), got {type(checkpoint_io).__name__} {checkpoint_io!r}: "
                "e.g. AsyncAtomicCheckpointIO(AtomicCheckpointIO(verify=True)), or none"
            )
        self.checkpoint_io = checkpoint_io or self._sync_cls(
            verify=verify, require_manifest=require_manifest
        )
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._save_failed = False  # the last finished save failed: removals are skipped

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.checkpoint_io!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Lightning's spawn launchers pickle the plugin: threads do not travel.
        state = self.__dict__.copy()
        state.update(_executor=None, _futures=[], _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="atomic-checkpoint-lightning"
            )
        fut = self._executor.submit(fn, *args)
        self._futures = [f for f in self._futures if not f.done()] + [fut]

    def _raise_pending_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _record(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` and queue its write; returns once tensors are copied.

        Raises:
            CheckpointError: an earlier background save failed (raised once).
        """
        self._raise_pending_error()
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint takes no storage_options "
                f"(got {storage_options!r})"
            )
        # The directory exists when this returns, not when the background write gets
        # there: ModelCheckpoint(save_last="link") links last.ckpt into it right after
        # this call, on this thread (it raised FileNotFoundError at the first save). A
        # path it cannot create (not a mounted filesystem, no permission) is left to the
        # background save, which reports it like any other failure.
        with contextlib.suppress(CheckpointError):
            _ensure_dir(os.path.dirname(_local_path(path)))
        self._submit(self._save_job, _snapshot(checkpoint), os.fspath(path))

    def _save_job(self, snapshot: dict[str, Any], path: str) -> None:
        try:
            self.checkpoint_io.save_checkpoint(snapshot, path)
            self._save_failed = False
        except BaseException as exc:
            self._save_failed = True
            log.error("background save of %s failed: %s", path, exc)
            self._record(exc)

    def remove_checkpoint(self, path: Any) -> None:
        """Queue the removal behind every save submitted before it."""
        self._submit(self._remove_job, os.fspath(path))

    def _remove_job(self, path: str) -> None:
        if self._save_failed:
            log.warning(
                "kept %s: the save queued before its removal failed, so it may be the "
                "newest complete checkpoint",
                path,
            )
            return
        try:
            self.checkpoint_io.remove_checkpoint(path)
        except BaseException as exc:
            self._record(exc)

    def link_checkpoint(self, target: Any, link: Any) -> None:
        """Queue ``ModelCheckpoint(save_last="link")``'s re-pointing of ``link``
        (``last.ckpt``) at ``target`` behind every save submitted before it, and skip it
        (with a warning) if one of them failed: ``link`` keeps pointing at the previous
        complete checkpoint until ``target`` is committed. Called on global rank 0 (see
        ``_link_after_saves``)."""
        self._submit(self._link_job, os.fspath(target), os.fspath(link))

    def _link_job(self, target: str, link: str) -> None:
        if self._save_failed:
            log.warning(
                "kept %s as it was: the save of %s queued before its link failed",
                link,
                target,
            )
            return
        directory, name = os.path.split(_local_path(link))
        try:
            LocalStorage(directory).replace_with_link(
                name, sibling_pending_name(name), os.path.relpath(target, directory)
            )
        except BaseException as exc:
            self._record(exc)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every queued save, link and removal has finished.

        Raises:
            TimeoutError: still running after ``timeout_s`` (the work goes on).
            CheckpointError: a background save failed (raised once).
        """
        futures = list(self._futures)
        _done, not_done = wait_futures(futures, timeout=timeout_s)
        if not_done:
            raise TimeoutError(
                f"{len(not_done)} background checkpoint operation(s) still running after "
                f"{timeout_s:g} s; they go on (call wait() again, or teardown())"
            )
        self._futures = []
        self._raise_pending_error()

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Wait for queued saves (so a path just saved is complete), then load with the
        wrapped plugin's ``load_checkpoint`` (same arguments, same checks)."""
        self.wait()
        return self.checkpoint_io.load_checkpoint(path, *args, **kwargs)

    def teardown(self) -> None:
        """Finish every queued save and removal, stop the worker, and raise a failure
        not reported yet."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._futures = []
        self.checkpoint_io.teardown()
        self._raise_pending_error()


# ---------------------------------------------------------------------- preemption
class _GuardHost:
    """What ``PreemptionGuard`` asks of a manager, for a job that has none: the
    coordinator that carries the vote, the bound on its waits, the last save (whose
    duration the guard's deadline check uses)."""

    def __init__(self, coordinator: Any, timeout_s: float):
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self.last_saved: Any = None


class _SaveTiming(NamedTuple):
    timings_s: dict[str, float]
    step: int  # the trainer's global_step when it saved


class _PreemptionCallback:
    """Lightning callback: SIGTERM/SIGUSR1 (to any rank) stops training at the next
    step boundary with one checkpoint of that step on every rank, then ``exit()``
    ends the process with 75 (requeue).

    Lightning's own handling does not do this: its SIGTERM handler stops the run
    without saving, and its SLURM requeue saves from inside the SIGUSR1 handler, at
    an arbitrary point of the step, on whichever rank got the signal. Here the
    handlers only record the signal (a ``PreemptionGuard``, installed when training
    starts, replacing Lightning's until it ends); at each batch end every rank takes
    part in one small vote through the launcher's key-value store (never a training
    collective); once any rank was signalled, all of them call
    ``trainer.save_checkpoint`` for the same step (atomic through
    ``AtomicCheckpointIO``) and stop. Call ``preemption.arm()`` at the top of the
    script so that a signal during start-up is recorded too.

    Args:
        dirpath: where the preemption checkpoint goes; default: ``ModelCheckpoint``'s
            directory, else the trainer's ``default_root_dir``. Its name,
            ``preempted-step=<N>.ckpt``, carries the step, so ``latest_checkpoint``
            and adoption order it with the others.
        grace_s: the scheduler's grace period (see ``PreemptionGuard``): a save that
            recent saves say cannot finish in time is not started.
        signals: the signals that mean "save and stop".
        timeout_s: bound on each vote's wait for the other ranks.
    """

    def __init__(
        self,
        *,
        dirpath: str | os.PathLike[str] | None = None,
        grace_s: float | None = None,
        signals: tuple[int, ...] | None = None,
        timeout_s: float = 600.0,
    ):
        super().__init__()
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.grace_s = grace_s
        self.signals = signals
        self.timeout_s = timeout_s
        self.guard: Any = None
        #: The preemption checkpoint written, when one was.
        self.saved_path: str | None = None
        self._host: _GuardHost | None = None
        self._unprotect: Callable[[], None] | None = None
        self._untime: Callable[[], None] = lambda: None

    def __getstate__(self) -> dict[str, Any]:
        # Spawn launchers pickle callbacks: the guard (handlers, locks) does not travel.
        return {
            **self.__dict__,
            "guard": None,
            "_host": None,
            "_unprotect": None,
            "_untime": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._untime = lambda: None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Every DataLoader the trainer builds from now on has workers that go on
        through the scheduler's SIGTERM (``preemption.protect_dataloaders``): SLURM
        signals every process of the job step, DataLoader workers included, and under
        torch's own worker handler they exit, and the next batch raises before the
        guard can save. Lightning hands each loader to ``Strategy.process_dataloader``
        after adding its sampler, before any worker starts: wrapped on this trainer's
        strategy until ``teardown``."""
        from ..preemption import protecting_loaders_of

        self._unprotect = protecting_loaders_of(trainer.strategy, "process_dataloader")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._unprotect is not None:
            self._unprotect()
            self._unprotect = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from ..coordination import default_coordinator
        from ..preemption import DEFAULT_SIGNALS, PreemptionGuard

        host = self._host = _GuardHost(default_coordinator(), self.timeout_s)
        self.guard = PreemptionGuard(
            self._host, signals=self.signals or DEFAULT_SIGNALS, grace_s=self.grace_s
        )
        # Every save's duration feeds the deadline check, ModelCheckpoint's included:
        # timing only this callback's own save, the guard had none before the first
        # preemption and started a save the grace period could not hold.
        save = trainer.save_checkpoint

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return save(*args, **kwargs)
            finally:
                took = time.monotonic() - t0
                host.last_saved = _SaveTiming({"total": took}, int(trainer.global_step))

        trainer.save_checkpoint = timed
        self._untime = lambda: setattr(trainer, "save_checkpoint", save)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self.guard
        if guard is None or self.saved_path is not None or guard.stopping:
            return
        step = int(trainer.global_step)
        if guard.should_save(step):
            directory = self._directory(trainer)
            path = os.path.join(directory, f"preempted-step={step}.ckpt")
            trainer.save_checkpoint(path)  # every rank; rank 0 writes, atomically (timed)
            self.saved_path = path
            _drop_older_preemption_files(trainer, directory, step)
        if guard.stopping:
            trainer.should_stop = True

    def _directory(self, trainer: Any) -> str:
        if self.dirpath is not None:
            return self.dirpath
        callback = getattr(trainer, "checkpoint_callback", None)
        directory = getattr(callback, "dirpath", None)
        return os.fspath(directory) if directory else os.fspath(trainer.default_root_dir)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._untime()
        if self.guard is not None:
            self.guard.close()  # Lightning's handlers are back; the decision stays

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._untime()
        if self.guard is not None:
            self.guard.close()

    @property
    def exit_code(self) -> int:
        """75 (``REQUEUE_EXIT_CODE``) once the ranks stopped for a preemption, else 0."""
        return 0 if self.guard is None else int(self.guard.exit_code)

    def exit(self) -> NoReturn:
        """End the process with :attr:`exit_code` (``raise SystemExit``): call it after
        ``trainer.fit`` returns, on every rank."""
        if self.guard is not None:
            self.guard.exit()  # ignores further preemption signals, then raises
        raise SystemExit(self.exit_code)


_PREEMPTED_RE = re.compile(r"preempted-step=([0-9]+)\.ckpt\Z")


def _drop_older_preemption_files(trainer: Any, directory: str, step: int) -> None:
    """Once the preemption checkpoint of ``step`` is committed, the earlier runs' ones in
    ``directory`` go (``trainer.strategy.remove_checkpoint``: rank 0, manifest and all):
    nothing else removes them (not ModelCheckpoint's top-k), and a job on spot
    instances kept one whole checkpoint per preemption."""
    for name in sorted(posix.list_dir(directory) or ()):
        found = _PREEMPTED_RE.fullmatch(name)
        if found is not None and int(found.group(1)) < step:
            trainer.strategy.remove_checkpoint(os.path.join(directory, name))


# ---------------------------------------------------------------------- namespaces
class LightningClasses(NamedTuple):
    """The two plugins, subclassing one namespace's ``CheckpointIO``."""

    AtomicCheckpointIO: type[_AtomicFileIO]
    AsyncAtomicCheckpointIO: type[_AsyncAtomicFileIO]


_BASES = {
    "lightning": ("lightning.fabric.plugins.io.checkpoint_io", "lightning"),
    "pytorch_lightning": ("lightning_fabric.plugins.io.checkpoint_io", "pytorch-lightning"),
}
_classes: dict[str, LightningClasses] = {}
_classes_lock = threading.Lock()


def _made_once(
    made: dict[str, _T], bases: Mapping[str, object], namespace: str, make: Callable[[str], _T]
) -> _T:
    """``make(namespace)``, cached in ``made``: made once per process, under a lock,
    because plugins and callbacks are matched by class identity (``isinstance``,
    pickle), and a second class of the same name would match neither."""
    if namespace not in bases:
        raise ValueError(f"namespace must be one of {sorted(bases)}, got {namespace!r}")
    with _classes_lock:
        found = made.get(namespace)
        if found is None:
            found = made[namespace] = make(namespace)
        return found


def _import_base(namespace: str, module_name: str, attr: str, subject: str) -> type:
    """``module_name.attr``, the class of ``namespace``'s package that ours subclass;
    the ImportError when that package is missing starts "the {namespace} {subject}"."""
    try:
        return cast(type, getattr(importlib.import_module(module_name), attr))
    except ImportError as exc:
        dist = _BASES[namespace][1]
        raise ImportError(
            f"the {namespace} {subject} the {dist!r} package: "
            f"pip install {dist} (or pip install 'atomic-checkpoint[lightning]')"
        ) from exc


def _bind(namespace: str, name: str, impl: type[_T], base: type, **attrs: Any) -> type[_T]:
    """``impl`` on ``base`` as a class named ``name`` (prefixed ``PL`` for the
    ``pytorch_lightning`` namespace), bound as an attribute of this module."""
    qualname = ("" if namespace == "lightning" else "PL") + name
    attrs.update({"__module__": __name__, "__qualname__": qualname, "__doc__": impl.__doc__})
    cls = type(qualname, (impl, base), attrs)
    # Pickle finds classes by module attribute: bind each under its own name.
    globals()[qualname] = cls
    return cls


def checkpoint_io_classes(namespace: str = "lightning") -> LightningClasses:
    """The plugins for ``namespace`` (``"lightning"`` or ``"pytorch_lightning"``).

    ``Trainer(plugins=[...])`` checks ``isinstance(plugin, CheckpointIO)`` against its
    own package's class, so each namespace needs plugins built on its ``CheckpointIO``.

    Raises:
        ValueError: unknown namespace.
        ImportError: that package is not installed (the message names the pip command).
    """
    return _made_once(_classes, _BASES, namespace, _make_plugins)


def _make_plugins(namespace: str) -> LightningClasses:
    base = _import_base(
        namespace, _BASES[namespace][0], "CheckpointIO", "plugins of atomic-checkpoint need"
    )
    sync = _bind(namespace, "AtomicCheckpointIO", _AtomicFileIO, base)
    # The async plugin's synchronous half is the same namespace's sync plugin.
    made = _bind(namespace, "AsyncAtomicCheckpointIO", _AsyncAtomicFileIO, base, _sync_cls=sync)
    _link_after_saves(namespace)
    return LightningClasses(sync, made)


def _link_after_saves(namespace: str) -> None:
    """Make ``ModelCheckpoint(save_last="link")`` link behind the async plugin's saves.

    ModelCheckpoint re-points ``last.ckpt`` itself, on the training thread, right after it
    asked for the save (``_link_checkpoint``: remove, then symlink; not through the
    plugin). With the async plugin the new file is not written then: a crash before its
    commit left ``last.ckpt`` dangling, and ``fit(ckpt_path="last")`` started over from
    step 0 with only a warning. When the trainer's plugin is our async one, the link is
    queued behind the save instead (``link_checkpoint``); any other plugin gets
    Lightning's own. A Lightning without that hook is left alone.
    """
    module = importlib.import_module(_CALLBACK_BASES[namespace])
    callback = getattr(module, "ModelCheckpoint", None)
    stock = getattr(callback, "__dict__", {}).get("_link_checkpoint")
    if not isinstance(stock, staticmethod) or getattr(stock.__func__, "_queued", False):
        return
    link = stock.__func__

    def link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        plugin = getattr(trainer.strategy, "checkpoint_io", None)
        if not isinstance(plugin, _AsyncAtomicFileIO):
            link(trainer, filepath, linkpath)
            return
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            plugin.link_checkpoint(filepath, linkpath)
        trainer.strategy.barrier()

    link_checkpoint._queued = True  # type: ignore[attr-defined]
    callback._link_checkpoint = staticmethod(link_checkpoint)  # type: ignore[union-attr]


_CALLBACK_BASES = {
    "lightning": "lightning.pytorch.callbacks",
    "pytorch_lightning": "pytorch_lightning.callbacks",
}
_callbacks: dict[str, type[_PreemptionCallback]] = {}


def preemption_callback_class(namespace: str = "lightning") -> type[_PreemptionCallback]:
    """The preemption callback for ``namespace`` (``"lightning"`` or
    ``"pytorch_lightning"``): ``PreemptionCallback`` / ``PLPreemptionCallback``.

    Raises:
        ValueError: unknown namespace.
        ImportError: that package is not installed (the message names the pip command).
    """
    return _made_once(_callbacks, _CALLBACK_BASES, namespace, _make_callback)


def _make_callback(namespace: str) -> type[_PreemptionCallback]:
    base = _import_base(
        namespace, _CALLBACK_BASES[namespace], "Callback", "callback of atomic-checkpoint needs"
    )
    return _bind(namespace, "PreemptionCallback", _PreemptionCallback, base)


def _default_classes() -> LightningClasses:
    for namespace in ("lightning", "pytorch_lightning"):
        with contextlib.suppress(ImportError):
            return checkpoint_io_classes(namespace)
    raise ImportError(
        "atomic_checkpoint.integrations.lightning needs PyTorch Lightning: pip install "
        "'atomic-checkpoint[lightning]' (or pip install lightning)"
    )


_LAZY = {
    "AtomicCheckpointIO": ("", 0),
    "AsyncAtomicCheckpointIO": ("", 1),
    "PLAtomicCheckpointIO": ("pytorch_lightning", 0),
    "PLAsyncAtomicCheckpointIO": ("pytorch_lightning", 1),
}

if TYPE_CHECKING:
    # What the built classes are: Lightning's CheckpointIO and Callback, with ours on
    # top, so that `Trainer(plugins=[AtomicCheckpointIO()])` type-checks.
    from lightning.pytorch.callbacks import Callback as _LightningCallback
    from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO

    class AtomicCheckpointIO(_AtomicFileIO, _LightningCheckpointIO): ...

    class AsyncAtomicCheckpointIO(_AsyncAtomicFileIO, _LightningCheckpointIO): ...

    class PreemptionCallback(_PreemptionCallback, _LightningCallback): ...

else:

    def __getattr__(name: str) -> Any:
        return _lazy_attribute(name)


def _lazy_attribute(name: str) -> Any:
    # The plugin classes are built on first use, so importing this module (for
    # verify_checkpoint, latest_checkpoint) does not import Lightning (~5 s).
    if name in ("PreemptionCallback", "PLPreemptionCallback"):
        namespace = "pytorch_lightning" if name.startswith("PL") else "lightning"
        return preemption_callback_class(namespace)
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    namespace, index = _LAZY[name]
    classes = checkpoint_io_classes(namespace) if namespace else _default_classes()
    cls = classes[index]
    globals()[name] = cls
    return cls


_register_adoption()
