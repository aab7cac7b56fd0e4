"""``torch.distributed.checkpoint`` (DCP) inside the commit of a ``CheckpointManager``.

Two lines, on every rank::

    from atomic_checkpoint.integrations.dcp import load_dcp, save_dcp

    info = load_dcp(mgr, state_dict, missing_ok=True)  # newest complete step, resharded
    save_dcp(mgr, step, state_dict)                    # instead of dcp.save(...)

``async_save_dcp(mgr, step, state_dict)`` is the counterpart of ``dcp.async_save``: it
returns once the state is staged in host memory, and writes and commits in the
background (``mgr.wait()``, the next save or ``mgr.close()`` raise its failure, once,
on every rank). Without a manager, :func:`save` and :func:`load` take
``checkpoint_id=PATH`` like ``dcp.save``/``dcp.load``, and make that one directory
atomic and verified (see "Path-style" below).

DCP plans and writes the shards (``FileSystemWriter``: one file per rank plus
``.metadata``); this module points it at the pending directory of
``mgr.saving(step)``, so atomicity, the manifest, retention and discovery are ours::

    ROOT/
      checkpoint-200/                    committed: found by mgr.latest(), load_dcp()
        .metadata                        DCP's global plan (written by DCP's rank 0)
        __0_0.distcp ... __3_0.distcp    one file per rank, fsync'd by DCP
        checkpoint.manifest.json         our commit record: every file, size, checksum
      .pending/checkpoint-300.<attempt>/ a DCP save in progress or killed: DCP's files,
                                         even a complete .metadata, but no manifest

Why: DCP on its own writes into the final directory, deletes the previous
``.metadata`` before renaming the new one into place, never fsyncs the directory, and
treats any directory holding ``.metadata`` as a checkpoint; and its
``CheckpointException`` derives from ``BaseException``, so ``except Exception`` misses
it (TESTBED "What the peers do"). Here a failure on any rank (a DCP error, a rank that
died) makes every surviving rank raise the same ``DistributedCheckpointError`` (an
``Exception``), and nothing of that save is ever discoverable.

Loading goes through DCP's planner, so the world size and the sharding may differ from
the save (a 4-rank DTensor save loads into a 2-rank mesh). Before DCP reads, the files
are checked against the manifest, each rank checksumming a share of them. A failed
load says so ("loading checkpoint step N failed ..."): nothing on storage changed, but
the state dict may be partly filled.

Async saves
-----------
``async_save_dcp`` stages the state dict with DCP's own stager (``DefaultStager``, the
one ``dcp.async_save`` uses: every tensor copied into host memory) on the calling
thread, then runs the commit above on the manager's background save thread. Two
things keep the background from colliding with training: our agreement goes through
the manager's cloned store connection (never a collective), and DCP's own collectives
(plan gathering, the final barrier) run on a gloo group created for the purpose by the
first ``async_save_dcp`` (or on the ``process_group`` passed in), never on the group
training uses: two threads issuing collectives on one group interleave them.

Path-style
----------
For a job without a manager, ``save(state_dict, checkpoint_id=PATH)`` writes DCP's
files into a sibling pending directory, checksums them into our manifest, and renames
it onto PATH (never replacing an existing PATH)::

    ckpts/
      step-100/                       committed: .metadata, shards, manifest
      .step-200.<token>.pending/      a save in progress, or killed: never loaded,
                                      removed once a later save commits step-200

``load(state_dict, checkpoint_id=PATH)`` verifies PATH against its manifest (each rank
a share of the checksums) before DCP reads it, and refuses a directory without one
(a stock ``dcp.save``: DCP calls any directory with ``.metadata`` complete) unless
asked to adopt it (below). Ranks agree through DCP's ``process_group``
(``all_gather_object``), as DCP itself does; no run lock, retention or discovery is
involved (that is what a manager is for).

Adopting a stock DCP run
------------------------
A run that saved with plain ``dcp.save(sd, checkpoint_id=ROOT/checkpoint-<step>)``
(``save_dcp``'s names) has directories without a manifest, and one a kill tore looks
like the others until DCP reads it. ``load_dcp(mgr, sd, adopt_existing=True)``, or
``atomic_checkpoint.adopt(ROOT, framework="dcp")`` before the job, checks each with
DCP's completeness rule (:func:`stock_checkpoint_problem`: ``.metadata``, written last,
reads with DCP's reader and every data file it references holds its bytes) and records
the complete ones (manifest marked adopted, checksums taken now; DCP's files are never
changed); a torn one is refused with the reason and never loaded. This module registers
the rule as ``"dcp"`` at import, applied only when named (the Trainer's folders have the
same names). ``load(sd, checkpoint_id=PATH, adopt=True)`` does the same for one path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import sys
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, SupportsFloat

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from .. import catalog
from .._checks import flag
from .._faults import fault_point
from .._params import parameters_of
from .._version import __version__
from ..adopt import set_aside_unmanifested
from ..async_save import SaveHandle
from ..coordination import shared_failures
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    RankFailure,
    ResumeError,
    StorageError,
)
from ..layout import (
    MANIFEST_NAME,
    checkpoint_name,
    parse_checkpoint_name,
    parse_sibling_pending,
    sibling_pending_name,
    validate_step,
)
from ..manager import CheckpointManager
from ..manifest import CheckpointInfo, FileEntry, Manifest, check_metadata
from ..rankfiles import report_files
from ..storage import is_url, posix
from ..storage.base import full_storage_error
from ..storage.local import LocalStorage

__all__ = [
    "DCP_METADATA_KEY",
    "async_save_dcp",
    "load",
    "load_dcp",
    "save",
    "save_dcp",
    "stock_checkpoint_problem",
]

log = logging.getLogger("atomic_checkpoint")

#: Key of the checkpoint metadata that marks a checkpoint written by ``save_dcp``.
DCP_METADATA_KEY = "torch.distributed.checkpoint"


class _PendingWriter(dcp.FileSystemWriter):
    """DCP's file writer aimed at our pending directory, with the ``mid_write`` fault
    point after this rank's shard files are written (before DCP's ``.metadata``)."""

    def __init__(self, path: str, *, rank: int, step: int, thread_count: int):
        # overwrite=False: the pending directory is fresh; anything there is a bug.
        super().__init__(path, sync_files=True, thread_count=thread_count, overwrite=False)
        self._rank = rank
        self._step = step

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        fut.wait()
        fault_point("mid_write", self._rank, self._step)
        return fut


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group, even when single-process use is
    intended; the warning names our frame (stacklevel=2), so say it once in the log."""
    if _is_distributed():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning
        )
        yield


@dataclass(frozen=True)
class _DCPArgs:
    """The DCP arguments of one save, as the caller passed them (``thread_count``
    checked when made): what :meth:`write` hands to ``dcp.save``."""

    planner: Any
    process_group: Any
    thread_count: int

    def __post_init__(self) -> None:
        n = self.thread_count
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"thread_count must be an int of at least 1, got {n!r}")

    def write(
        self, directory: str, state_dict: Any, *, rank: int, step: int, background: bool = False
    ) -> None:
        """This rank's part of DCP's save into ``directory`` (DCP's collectives inside);
        raises what DCP raises, ``CheckpointException`` (a ``BaseException``) included.
        ``background``: on a thread of a background save, which does not filter DCP's
        single-process warning (``warnings.catch_warnings`` is not thread-safe)."""
        writer = _PendingWriter(directory, rank=rank, step=step, thread_count=self.thread_count)
        quiet = contextlib.nullcontext() if background else _single_process_quiet()
        with quiet:
            dcp.save(
                state_dict,
                storage_writer=writer,
                planner=self.planner,
                process_group=self.process_group,
                no_dist=not _is_distributed(),
            )


def _dcp_error(rank: int, phase: str, exc: BaseException) -> RankFailure:
    """This rank's failure of DCP's ``phase`` (``dcp_write``, ``dcp_read``), as the
    exchange shares it."""
    kind, message = _describe(exc)
    return RankFailure(rank, phase, kind, message)


def _describe(exc: BaseException) -> tuple[str, str]:
    """(error type, message) of a DCP failure, with the per-rank causes it carries."""
    if isinstance(exc, CheckpointException):
        parts = []
        for r, wrapped in sorted(exc.failures.items()):
            err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {r}: {type(err).__name__}: {err}")
        return "CheckpointException", "DCP reported " + ("; ".join(parts) or str(exc))
    return type(exc).__name__, str(exc) or repr(exc)


def _agree(
    mgr: CheckpointManager, key: str, phase: str, failure: RankFailure | None
) -> list[RankFailure]:
    """Every rank's failure of ``phase`` (empty: all succeeded); identical on every rank
    that gets an answer. A rank that does not report within ``mgr.timeout_s`` counts as
    failed. Collective."""
    try:
        failures = shared_failures(mgr.coordinator, key, failure, timeout_s=mgr.timeout_s)
    except CoordinationTimeoutError as exc:
        # The ranks named missing are the same on every rank; this rank's own failure
        # (often DCP's "connection closed" caused by the missing rank) is not, so it
        # stays the cause of the error rather than a part of it.
        failures = [
            RankFailure(
                r,
                phase,
                "CoordinationTimeoutError",
                f"did not report within {mgr.timeout_s:g} s (it crashed or hangs)",
            )
            for r in exc.missing_ranks
        ]
    return failures


def _resolved(state_dict: dict[str, Any]) -> tuple[dict[str, Any], Exception | None]:
    """``state_dict`` with each ``Stateful`` replaced by its ``state_dict()`` (what
    ``dcp.save`` would call inside its collective), or this rank's failure to make it.
    Made before the save's first exchange, a failure is shared at once: inside DCP's
    collective, the other ranks waited for this one for the process group's timeout."""
    try:
        return _state_dicts(state_dict), None
    except Exception as exc:
        return {}, exc


def _state_dicts(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each ``Stateful`` replaced by its ``state_dict()``."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a dict of names to tensors and Statefuls (what dcp.save "
            f"takes), got {type(state_dict).__name__}"
        )
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def _one_storage(mgr: CheckpointManager, step: int) -> None:
    """A DCP save needs every rank's files under one ROOT: DCP's coordinator writes the
    global ``.metadata`` alone, so on node-local disks no node's copy could be loaded
    (each node's commit succeeded, and every load failed). Refused on every rank alike
    (the domains are), before anything is written."""
    if mgr.domain.count > 1:
        raise CheckpointError(
            f"save_dcp step {step}: {mgr.root} is not shared by all ranks: they form "
            f"{mgr.domain.count} storage domains (led by ranks {list(mgr.domain.leaders)}), "
            "and a DCP checkpoint needs every rank's files in one place (DCP's coordinator "
            "writes the global .metadata alone, so no node's copy could be loaded). Save to "
            "a filesystem every rank mounts, or use mgr.save(), whose node-local copies "
            "each hold their own ranks' parts. Nothing was written"
        )


def _local_root(mgr: CheckpointManager) -> str:
    if not isinstance(mgr, CheckpointManager):
        raise TypeError(
            f"expected a CheckpointManager as the first argument, got {type(mgr).__name__} "
            f"{mgr!r}: create one per job, e.g. mgr = CheckpointManager(ROOT), and pass it "
            "(the path-style save(state_dict, checkpoint_id=...) takes paths)"
        )
    root = mgr.storage.local_path("")
    if root is None:
        raise CheckpointError(
            f"DCP checkpoints need a mounted filesystem; {mgr.root} is not one (DCP's "
            "FileSystemWriter writes files by OS path)"
        )
    return root


def _with_dcp_record(metadata: Mapping[str, Any] | None, world_size: int) -> dict[str, Any]:
    """The user's ``metadata`` plus, under ``DCP_METADATA_KEY``, the torch version and
    world size of the save: what marks a checkpoint as DCP's for the loaders."""
    meta = dict(metadata or {})
    meta[DCP_METADATA_KEY] = {"torch_version": torch.__version__, "world_size": world_size}
    return meta


def save_dcp(
    mgr: CheckpointManager,
    step: int,
    state_dict: dict[str, Any],
    *,
    metrics: Mapping[str, SupportsFloat] | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    planner: Any = None,
    process_group: Any = None,
    thread_count: int = 1,
) -> CheckpointInfo:
    """Save a (sharded) state dict with DCP as checkpoint ``step`` of ``mgr``. Collective.

    Every rank passes its own ``state_dict`` (DTensors, sharded or replicated tensors,
    plain values), as for ``dcp.save``.

    Args:
        mgr: the manager of ROOT (created on every rank, in the same order).
        step: the training step.
        state_dict: what ``dcp.save`` would get.
        metrics: recorded in the manifest, for ``KeepBest`` retention.
        metadata: JSON-serialisable user metadata.
        overwrite: replace a committed ``step`` atomically.
        planner: a DCP ``SavePlanner`` (default: DCP's).
        process_group: the group DCP's collectives use (default: the default group).
        thread_count: DCP's writer threads per rank.

    Returns:
        The committed checkpoint, identical on every rank.

    Raises:
        DistributedCheckpointError: DCP failed, or a rank did not finish, on any rank;
            every rank that is still alive raises it and nothing is committed.
        CheckpointExistsError: ``step`` is committed and ``overwrite`` is False.
        CheckpointError: ROOT is not shared by every rank (node-local disks): DCP's
            global ``.metadata`` would be on one node only; nothing is written.
    """
    _local_root(mgr)
    _one_storage(mgr, step)
    args = _DCPArgs(planner, process_group, thread_count)
    meta = _with_dcp_record(metadata, mgr.world_size)
    # A stock run's save torn by a crash (adoption refused it) is where this save
    # lands: the next step after the one resumed from. A complete one is refused.
    in_the_way = _clear_the_way(mgr, step, overwrite, "save_dcp")
    flat, unresolved = _resolved(state_dict)
    with mgr.saving(
        step,
        metrics=metrics,
        metadata=meta,
        overwrite=overwrite,
        failed=unresolved or in_the_way,
    ) as pending:
        failure: RankFailure | None = None
        cause: BaseException | None = None
        try:
            args.write(str(pending), flat, rank=mgr.rank, step=step)
        # CheckpointException derives from BaseException: name it, or it escapes as a
        # non-Exception that `except Exception` in the training loop never sees.
        except (CheckpointException, Exception) as exc:
            said = full_storage_error(mgr.storage, exc) or exc
            cause, failure = exc, _dcp_error(mgr.rank, "dcp_write", said)
        # DCP's own error reporting stops at its collectives: a rank that died leaves
        # the others with a bare gloo/NCCL error (or none). Share every rank's outcome
        # so all of them raise the same error, naming who failed.
        failures = _agree(mgr, f"save step {step}: dcp_write", "dcp_write", failure)
        if failures:
            raise DistributedCheckpointError(failures, step=step) from cause
    info = pending.info
    if info is None:  # pragma: no cover - saving() sets it on success
        raise CheckpointError(f"checkpoint step {step} was saved but returned no result")
    return info


class _DCPFailure(Exception):
    """DCP's failure on this rank, as an ``Exception`` the commit's exchange shares (DCP's
    ``CheckpointException`` is a ``BaseException``, which the exchange lets escape).
    Built by :func:`_dcp_failure` under the name of DCP's error type, so every rank
    reports it as the synchronous save does."""


_FAILURE_TYPES: dict[str, type[_DCPFailure]] = {}


def _dcp_failure(exc: BaseException) -> _DCPFailure:
    kind, message = _describe(exc)
    cls = _FAILURE_TYPES.get(kind)
    if cls is None:
        cls = _FAILURE_TYPES.setdefault(kind, type(kind, (_DCPFailure,), {"__module__": __name__}))
    return cls(message)


# The gloo group each manager's background saves run DCP's collectives on (see the
# module docstring, "Async saves"); created by the first async_save_dcp on every rank.
_BACKGROUND_GROUPS: weakref.WeakKeyDictionary[CheckpointManager, Any] = weakref.WeakKeyDictionary()


def _background_group(mgr: CheckpointManager, process_group: Any) -> Any:
    if process_group is not None or not _is_distributed():
        return process_group
    group = _BACKGROUND_GROUPS.get(mgr)
    if group is None:
        # Collective on the default group, so created here, on the calling thread, by
        # the first async_save_dcp (which every rank calls in the same order). Its
        # timeout bounds a collective that waits for a dead rank like our own waits.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=mgr.timeout_s))
        _BACKGROUND_GROUPS[mgr] = group
    return group


def _stage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A host-memory copy of ``state_dict`` that later in-place updates do not reach:
    DCP's ``DefaultStager``, configured as ``dcp.async_save`` configures it."""
    flat = _state_dicts(state_dict)
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # older torch: the stager its dcp.async_save used
        try:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager
        except ImportError as exc:
            raise CheckpointError(
                f"async_save_dcp needs DCP's staging (torch >= 2.3); this is torch "
                f"{torch.__version__}: use save_dcp, or upgrade torch"
            ) from exc
        return dict(BlockingAsyncStager().stage(flat))
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    try:
        staged = stager.stage(flat)
    finally:
        stager.close()
    if not isinstance(staged, dict):  # pragma: no cover - synchronous staging returns it
        raise CheckpointError("DCP's stager returned no state dict")
    return staged


@parameters_of(save_dcp)
def async_save_dcp(
    mgr, step, state_dict, *, metrics, metadata, overwrite, planner, process_group, thread_count
) -> SaveHandle:
    """Stage ``state_dict`` in host memory, then save it with DCP as checkpoint ``step``
    of ``mgr`` in the background: the counterpart of ``dcp.async_save``. Collective.

    Returns once every tensor is copied (training may then update them in place). The
    write and commit are those of :func:`save_dcp`, with its guarantees: nothing is
    visible until the manifest is committed, a failure on any rank (a DCP error, a rank
    that died) fails the save on every rank, and the previous checkpoints stay intact.
    At most one save of ``mgr`` is in flight: this call first waits for the previous
    one (``save_async`` or ``async_save_dcp``) and raises its failure if it was not
    raised yet.

    It takes the parameters of :func:`save_dcp`, with their meanings; two of them
    differ:

    Args:
        state_dict: what ``dcp.async_save`` would get (``Stateful`` values are asked
            for their ``state_dict()`` now).
        process_group: the group DCP's collectives use in the background; default: a
            gloo group over every rank, made by the first call (collective), so they
            never interleave with the training's collectives.

    Returns:
        A ``SaveHandle``: ``handle.result()`` is the committed ``CheckpointInfo``,
        identical on every rank. ``mgr.wait()`` waits for it too.

    Raises:
        CheckpointError: the previous async save failed (raised once, every rank).
        StepOrderError: ``step`` is below the newest committed step of this run.

    The save's own failure (``DistributedCheckpointError`` naming each failing rank,
    ``CoordinationTimeoutError`` naming a rank that died, ``CheckpointExistsError``)
    is raised by ``handle.result()``, and once by the next ``mgr.wait()``, save or
    ``mgr.close()``, on every rank.
    """
    _local_root(mgr)  # a mounted filesystem, checked before anything is staged
    _one_storage(mgr, step)
    args = _DCPArgs(planner, process_group, thread_count)
    t0 = time.perf_counter()
    mgr.wait()  # at most one save in flight; raises its failure once
    args = replace(args, process_group=_background_group(mgr, process_group))
    staged: dict[str, Any] | None = None
    problem: Exception | None = None
    try:
        staged = _stage(state_dict)
    except Exception as exc:  # shared with every rank in the first phase
        problem = CheckpointError(
            f"rank {mgr.rank}: DCP's stager could not copy the state dict of step "
            f"{step} into host memory: {type(exc).__name__}: {exc}"
        )
        problem.__cause__ = exc
    single = mgr.world_size == 1

    def write(directory: Path) -> None:
        try:
            args.write(str(directory), staged, rank=mgr.rank, step=step, background=True)
        except (CheckpointException, Exception) as exc:  # see save_dcp: BaseException
            said = full_storage_error(mgr.storage, exc) or exc
            if single:
                # One rank: the commit hands back this rank's own error; report it as
                # every multi-rank failure is reported.
                failure = _dcp_error(mgr.rank, "dcp_write", said)
                raise DistributedCheckpointError([failure], step=step) from exc
            raise _dcp_failure(said) from exc

    in_the_way = _clear_the_way(mgr, step, overwrite, "async_save_dcp")  # see save_dcp
    handle = mgr.saving_async(
        step,
        write,
        metrics=metrics,
        metadata=_with_dcp_record(metadata, mgr.world_size),
        overwrite=overwrite,
        failed=problem or in_the_way,
        phase="dcp_write",
    )
    handle.blocked_s = time.perf_counter() - t0  # the staging included
    return handle


def _assign(files: tuple[FileEntry, ...], world: int) -> list[list[FileEntry]]:
    """Split files across ranks for verification: largest first, to the least loaded
    rank (deterministic, so every rank computes the same split)."""
    shares: list[list[FileEntry]] = [[] for _ in range(world)]
    loads = [0] * world
    for f in sorted(files, key=lambda f: (-f.size_bytes, f.path)):
        r = min(range(world), key=lambda i: (loads[i], i))
        shares[r].append(f)
        loads[r] += f.size_bytes
    return shares


def _verify(mgr: CheckpointManager, info: CheckpointInfo) -> list[RankFailure]:
    """Checksum every file of ``info``, each rank a share; every rank's failures."""
    failure = None
    rel = checkpoint_name(info.step)
    try:
        manifest = catalog.read_manifest(mgr.storage, rel)
        share = _assign(manifest.files, mgr.world_size)[mgr.rank]
        catalog.validate(mgr.storage, rel, replace(manifest, files=tuple(share)), full=True)
    except Exception as exc:
        failure = RankFailure(mgr.rank, "verify", type(exc).__name__, str(exc))
    return _agree(mgr, f"load step {info.step}: verify", "verify", failure)


# ---------------------------------------------------------------------- unpickling
#: What DCP's ``.metadata`` pickle may name: its metadata classes, ``torch.Size``, dtypes
#: and layouts, paths. Anything else (a ``__reduce__`` that calls ``exec``) is refused
#: unless the loader is told ``allow_pickle=True``.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    *(("builtins", n) for n in ("set", "frozenset", "slice", "complex", "range")),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath")),
    ("pathlib", "PureWindowsPath"),
}


def _metadata_class(module: str, name: str) -> bool:
    if (module, name) in _METADATA_NAMES:
        return True
    if module in _METADATA_MODULES:
        return isinstance(getattr(sys.modules.get(module), name, None), type)
    if module == "torch":
        value = getattr(torch, name, None) if name in vars(torch) else None
        return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _metadata_class(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint's {_DCP_METADATA_FILE} names {module}.{name}, which is not part "
            "of DCP's metadata: refused (a pickle that names other code runs it on load). "
            "If you trust the checkpoint, load it with allow_pickle=True"
        )


class _SafeReader(dcp.FileSystemReader):
    """DCP's reader, with ``.metadata`` unpickled through the allow-list above (torch
    unpickles it whole: the checksums of a manifest prove the bytes are the ones
    listed, not that they are safe to run)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:  # as DCP's own read_metadata
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _reader(path: str, allow_pickle: bool) -> Any:
    return dcp.FileSystemReader(path) if allow_pickle else _SafeReader(path)


def _planner(planner: Any, allow_pickle: bool) -> Any:
    """The planner of a load: the user's, or DCP's default with its values that are not
    tensors (saved with ``torch.save``) loaded ``weights_only`` unless ``allow_pickle``."""
    if planner is not None or allow_pickle:
        return planner
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise pickle.UnpicklingError(
                    f"{read_item.dest_index.fqn}: {exc}. Values other than plain data are "
                    "loaded only with allow_pickle=True (a pickle runs the code it names: "
                    "trusted checkpoints only)"
                ) from exc
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return _WeightsOnlyPlanner()


def load_dcp(
    mgr: CheckpointManager,
    state_dict: dict[str, Any],
    step: int | None = None,
    *,
    verify: bool = True,
    missing_ok: bool = False,
    adopt_existing: bool = False,
    planner: Any = None,
    process_group: Any = None,
    allow_pickle: bool = False,
) -> CheckpointInfo | None:
    """Load checkpoint ``step`` (default: the newest that verifies) into ``state_dict``
    in place, with DCP's resharding. Collective.

    ``state_dict`` describes the target layout, as for ``dcp.load``: DTensors on this
    job's mesh (any world size), tensors, plain values.

    Args:
        mgr: the manager of ROOT.
        state_dict: filled in place.
        step: a committed step; None picks the newest checkpoint written by
            ``save_dcp`` that verifies (an invalid one is skipped with a warning; as
            after ``restore()``, retention then neither counts nor deletes one skipped
            for its checksums, and a save of its step replaces it).
        verify: checksum every file first, each rank a share (one extra read of
            the checkpoint, spread over the ranks); False checks sizes only.
        missing_ok: return None instead of raising when there is no checkpoint (a
            first run). Folders without a manifest in ROOT (a stock ``dcp.save`` run's)
            still raise ``ResumeError``: adopt them, or move them away.
        adopt_existing: first adopt the ``checkpoint-<step>`` directories that a stock
            ``dcp.save(sd, checkpoint_id=ROOT/checkpoint-<step>)`` run left in ROOT:
            each complete one (:func:`stock_checkpoint_problem`: ``.metadata`` and
            every data file it references, whole) gets a manifest marked adopted, with
            checksums taken now; a torn one is never adopted, nor loaded (a warning
            says why). Then the newest is loaded as usual.
        planner: a DCP ``LoadPlanner`` (default: DCP's, which reshards).
        process_group: the group DCP's collectives use.
        allow_pickle: unpickle the checkpoint without limits, as ``dcp.load`` does.
            By default DCP's ``.metadata`` may name only DCP's metadata classes, and
            values that are not tensors are loaded ``weights_only`` (plain data); a
            pickle that names other code is refused, as it would run that code. Pass
            True only for checkpoints you trust (a custom ``planner`` loads those
            values itself).

    Returns:
        The loaded checkpoint (identical on every rank), or None (``missing_ok``).

    Raises:
        CheckpointNotFoundError: no (such) checkpoint.
        CorruptCheckpointError: ``step`` does not verify.
        ResumeError: ``step`` is None and no checkpoint can be loaded (none was
            written by ``save_dcp``, or none verifies, or ROOT holds only folders
            without a manifest).
        DistributedCheckpointError: DCP failed to load on some rank (every rank
            raises it).
    """
    _local_root(mgr)
    verify, missing_ok = flag("verify", verify), flag("missing_ok", missing_ok)
    adopt_existing = flag("adopt_existing", adopt_existing)
    allow_pickle = flag("allow_pickle", allow_pickle)
    if step is not None:
        step = validate_step(step)
    if adopt_existing:
        _adopt_existing(mgr)
    infos = mgr.checkpoints()
    if step is not None:
        candidates = [i for i in infos if i.step == step]
        if not candidates:
            steps = [i.step for i in infos]
            raise CheckpointNotFoundError(
                f"no valid checkpoint of step {step} in {mgr.root} (valid steps: {steps})"
            )
    else:
        candidates = list(reversed(infos))
        if not candidates:
            _refuse_unadopted(mgr)
            if missing_ok:
                return None
            raise CheckpointNotFoundError(
                f"no valid checkpoint of run {mgr.run_id!r} in {mgr.root} to load with DCP"
            )
    chosen: CheckpointInfo | None = None
    problems: list[str] = []
    corrupt: list[int] = []  # newer ones that failed verification, skipped on every rank
    for info in candidates:
        if not _written_for_dcp(info):
            problem = f"checkpoint step {info.step} was not written by save_dcp"
            if step is not None:
                raise CheckpointError(
                    f"{problem} ({info.path}): load it with mgr.restore() or read its files"
                )
            log.warning("load_dcp: skipping %s: %s", info.path, problem)
            problems.append(problem)
            continue
        if verify:
            failures = _verify(mgr, info)
            if failures:
                detail = "; ".join(str(f) for f in failures)
                if step is not None:
                    raise CorruptCheckpointError(
                        f"checkpoint step {info.step} at {info.path} does not verify: {detail}"
                    )
                log.warning("load_dcp: skipping %s: %s", info.path, detail)
                problems.append(f"step {info.step}: {detail}")
                if all(f.error_type == "CorruptCheckpointError" for f in failures):
                    corrupt.append(info.step)  # not an I/O error: its files are bad
                continue
        chosen = info
        break
    if chosen is None:
        raise ResumeError(
            f"none of the {len(candidates)} checkpoint(s) in {mgr.root} can be loaded with "
            f"DCP: {' | '.join(problems)}"
        )
    failure: RankFailure | None = None
    cause: BaseException | None = None
    try:
        with _single_process_quiet():
            dcp.load(
                state_dict,
                storage_reader=_reader(chosen.files_path, allow_pickle),
                planner=_planner(planner, allow_pickle),
                process_group=process_group,
                no_dist=not _is_distributed(),
            )
    except (CheckpointException, Exception) as exc:  # see save_dcp: BaseException
        cause, failure = exc, _dcp_error(mgr.rank, "dcp_read", exc)
    failures = _agree(mgr, f"load step {chosen.step}: dcp_read", "dcp_read", failure)
    if failures:
        raise DistributedCheckpointError(failures, step=chosen.step, operation="load") from cause
    # As after restore(): retention leaves the corrupt newer ones alone, and a save of
    # one of their steps replaces it.
    mgr.resumed_from(chosen, corrupt=corrupt)
    return chosen


# ---------------------------------------------------------------------- path-style
def _checkpoint_dir(checkpoint_id: str | os.PathLike[str]) -> tuple[str, str]:
    """(parent directory, name) of a path-style checkpoint."""
    text = os.fspath(checkpoint_id)
    if is_url(text):
        raise CheckpointError(
            f"path-style DCP checkpoints live on mounted filesystems (DCP's FileSystemWriter "
            f"writes by OS path), not at {text!r}: use a CheckpointManager on an "
            "object-store root, or a mounted path"
        )
    text = text.removeprefix("file://")
    final = os.path.abspath(text)
    parent, name = os.path.split(final)
    if not name or name in (".", "..") or name.startswith("."):
        raise ValueError(
            f"checkpoint_id must name a directory whose name does not start with '.' "
            f"(pending saves use such names), got {text!r}"
        )
    return parent, name


def _group_rank(group: Any) -> int:
    return int(dist.get_rank(group)) if _is_distributed() else 0


def _exchange(what: str, obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (indexed by rank in ``group``), as DCP exchanges its plans:
    ``all_gather_object`` on ``group``. A rank that died fails this on every survivor
    (gloo: the connection drops; otherwise the group's timeout)."""
    if not _is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:  # a gloo/NCCL error: a peer died or the group timed out
        raise CheckpointError(
            f"rank {dist.get_rank()}: the ranks could not exchange {what} over the process "
            f"group ({type(exc).__name__}: {exc}): a rank died or hangs. Nothing was "
            "committed; restart the job"
        ) from exc
    return out


def _raise_agreed(failures: list[RankFailure], step: int | None, operation: str) -> NoReturn:
    if len(failures) == 1 and failures[0].error_type == "CheckpointExistsError":
        raise CheckpointExistsError(failures[0].message)
    raise DistributedCheckpointError(failures, step=step, operation=operation)


def _prepare_path(parent: str, name: str) -> str:
    """On the first rank: the pending directory beside ``name``, created."""
    posix.make_dirs(parent)
    storage = LocalStorage(parent)
    if posix.lexists(os.path.join(parent, name)):
        raise CheckpointExistsError(
            f"{os.path.join(parent, name)!r} already exists: a path-style save never "
            "replaces a checkpoint; choose a new checkpoint_id"
        )
    pending = sibling_pending_name(name)
    storage.makedirs(pending)
    storage.fsync_dir("")
    return pending


def _path_step(name: str, step: int | None) -> int:
    """The step a path-style save records: ``checkpoint-<N>`` is step N to every
    manager of its directory (a manifest saying otherwise is corrupt there)."""
    named = parse_checkpoint_name(name)
    if step is None:
        return 0 if named is None else named
    step = validate_step(step)
    if named is not None and named != step:
        raise ValueError(
            f"checkpoint_id {name!r} names step {named} but step={step} was passed: a "
            f"CheckpointManager of its directory would list it as step {named} and refuse "
            f"it as corrupt. Pass step={named} (or leave it out), or name it "
            f"{checkpoint_name(step)}"
        )
    return step


def _root_run(parent: str) -> str:
    """The run recorded in ``parent`` (a manager's root), which a path-style
    ``checkpoint-<N>`` saved there joins; "" where none is recorded or it is unreadable
    (the checkpoint still loads by path)."""
    try:
        return catalog.recorded_run_id(LocalStorage(parent)) or ""
    except CheckpointError:
        return ""


def _commit_path(
    parent: str,
    name: str,
    pending: str,
    world: int,
    step: int,
    meta: dict[str, Any],
    run_id: str = "",
) -> Manifest:
    """On the first rank, after every rank wrote: checksum and fsync DCP's files, write
    the manifest last, rename the pending directory onto ``name``, fsync the parent."""
    storage = LocalStorage(parent)
    report = report_files(storage, pending, 0)
    manifest = Manifest(
        step=step,
        run_id=run_id if parse_checkpoint_name(name) is not None else "",
        commit_seq=0,
        world_size=world,
        files=tuple(FileEntry(f.path, f.size_bytes, f.checksum) for f in report.files),
        state_kind="files",
        metadata=meta,
        library_version=__version__,
    )
    storage.write_bytes_atomic(f"{pending}/{MANIFEST_NAME}", manifest.to_json_bytes())
    storage.fsync_dir(pending)
    fault_point("after_manifest", 0, step)
    storage.rename_dir(pending, name)  # never replaces: CheckpointExistsError
    storage.fsync_dir("")
    _sweep_doomed(storage)
    return manifest


def _sweep_doomed(storage: LocalStorage) -> None:
    """Remove the pending directories beside committed checkpoints whose name now
    exists: saves of those names killed (or failed) before their rename, which can
    never commit now (a path-style save never replaces). Nothing else looked at them,
    so each crash left one for good."""
    for entry in storage.listdir(""):
        final = parse_sibling_pending(entry)
        if final is None or not posix.lexists(os.path.join(storage.root, final)):
            continue
        try:
            storage.delete_tree(entry)
            log.info("removed %s: an abandoned save of %s", storage.url(entry), final)
        except CheckpointError as exc:
            log.warning("could not remove the abandoned DCP save %s: %s", entry, exc)


def _discard_pending(parent: str, pending: str) -> None:
    try:
        LocalStorage(parent).delete_tree(pending)
    except CheckpointError as exc:
        log.warning(
            "could not remove the pending DCP save %s: %s (never loaded; delete it by hand)",
            os.path.join(parent, pending),
            exc,
        )


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    planner: Any = None,
    process_group: Any = None,
    thread_count: int = 1,
) -> CheckpointInfo:
    """``dcp.save(state_dict, checkpoint_id=PATH)``, atomic and verifiable. Collective
    over ``process_group`` (every rank, as for ``dcp.save``).

    A PATH named ``checkpoint-<step>`` is a checkpoint of the directory it is in, as a
    ``CheckpointManager`` of that directory lists them: its manifest records that step
    and the run recorded there (if any), so the manager resumes from it.

    DCP's files go to a pending directory beside PATH; once every rank has written
    them, the first rank checksums them into a manifest and renames the directory onto
    PATH. A failure on any rank raises the same error on every rank and leaves PATH
    absent.

    Args:
        state_dict: what ``dcp.save`` would get.
        checkpoint_id: the checkpoint directory; it must not exist yet.
        step: recorded in the manifest (shown by ``atomic-checkpoint inspect``);
            default: the step of a PATH named ``checkpoint-<step>``, else 0.
        metadata: JSON-serialisable user metadata for the manifest.
        planner: a DCP ``SavePlanner``.
        process_group: the group DCP and the agreement use (default: the default).
        thread_count: DCP's writer threads per rank.

    Returns:
        The committed checkpoint (``path`` is PATH), identical on every rank.

    Raises:
        CheckpointExistsError: PATH exists (every rank; nothing written).
        DistributedCheckpointError: DCP or the commit failed on some rank (every rank).
        CheckpointError: a rank died (the survivors; nothing committed).
        ValueError: PATH is named ``checkpoint-<N>`` and ``step`` is not N.
    """
    parent, name = _checkpoint_dir(checkpoint_id)
    step = _path_step(name, step)
    args = _DCPArgs(planner, process_group, thread_count)
    user_meta = check_metadata(metadata)
    group = process_group
    rank = _group_rank(group)
    world = dist.get_world_size(group) if _is_distributed() else 1
    meta = _with_dcp_record(user_meta, world)

    # 1. the first rank makes the pending directory; every rank learns it (or why not).
    pending: str | None = None
    failure: RankFailure | None = None
    if rank == 0:
        try:
            pending = _prepare_path(parent, name)
        except Exception as exc:
            failure = RankFailure(rank, "prepare", type(exc).__name__, str(exc))
    agreed, failure = _exchange(f"the pending directory of {name}", (pending, failure), group)[0]
    if failure is not None:
        _raise_agreed([failure], step, "save")
    if not isinstance(agreed, str):  # pragma: no cover - rank 0 sends one of the two
        raise CheckpointError(f"the first rank sent no pending directory for {name}")
    pending = agreed

    # 2. every rank writes its shards (DCP's own collectives inside).
    failure, cause = None, None
    try:
        args.write(os.path.join(parent, pending), state_dict, rank=rank, step=step)
    except (CheckpointException, Exception) as exc:  # see save_dcp: BaseException
        cause, failure = exc, _dcp_error(rank, "dcp_write", exc)
    try:
        failures = [f for f in _exchange(f"the outcome of writing {name}", failure, group) if f]
    except CheckpointError:
        if rank == 0:
            _discard_pending(parent, pending)
        raise
    if failures:
        if rank == 0:
            _discard_pending(parent, pending)
        raise DistributedCheckpointError(failures, step=step) from cause

    # 3. the first rank commits; every rank learns the outcome.
    outcome: Manifest | RankFailure | None = None
    if rank == 0:
        try:
            outcome = _commit_path(parent, name, pending, world, step, meta, _root_run(parent))
        except Exception as exc:
            _discard_pending(parent, pending)
            outcome = RankFailure(rank, "commit", type(exc).__name__, str(exc))
    result = _exchange(f"the commit of {name}", outcome, group)[0]
    if isinstance(result, RankFailure):
        _raise_agreed([result], step, "save")
    if not isinstance(result, Manifest):  # pragma: no cover - rank 0 sends one of the two
        raise CheckpointError(f"the commit of {name} returned no result")
    return result.info(os.path.join(parent, name))


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    verify: bool = True,
    adopt: bool = False,
    planner: Any = None,
    process_group: Any = None,
    allow_pickle: bool = False,
) -> CheckpointInfo:
    """``dcp.load(state_dict, checkpoint_id=PATH)`` after checking PATH against its
    manifest (written by :func:`save`). Collective over ``process_group``.

    The world size and sharding may differ from the save (DCP reshards).

    Args:
        state_dict: filled in place, as by ``dcp.load``.
        checkpoint_id: a directory written by :func:`save`.
        verify: checksum every file first, each rank a share; False checks sizes only.
        adopt: PATH may be a stock ``dcp.save`` directory: when it has no manifest and
            is complete by :func:`stock_checkpoint_problem`, the first rank records
            one (marked adopted, checksums taken now); a torn one is refused and
            nothing is written.
        planner: a DCP ``LoadPlanner``.
        process_group: the group DCP and the agreement use.
        allow_pickle: unpickle without limits, as ``dcp.load`` does (see
            :func:`load_dcp`; by default only DCP's metadata classes and plain data).

    Returns:
        What the manifest records (``step``, ``metadata``, ``size_bytes``).

    Raises:
        CheckpointNotFoundError: PATH does not exist (every rank).
        CorruptCheckpointError: PATH has no manifest (a stock ``dcp.save``, or a save
            that did not finish; with ``adopt``: a torn one), or a file does not match
            it (every rank).
        DistributedCheckpointError: DCP failed to read on some rank (every rank);
            nothing on storage changed, ``state_dict`` may be partly filled.
    """
    parent, name = _checkpoint_dir(checkpoint_id)
    group = process_group
    rank = _group_rank(group)
    world = dist.get_world_size(group) if _is_distributed() else 1
    final = os.path.join(parent, name)
    manifest: Manifest | None = None
    failure: RankFailure | None = None
    if adopt:
        if rank == 0:
            try:
                _adopt_path(parent, name)
            except Exception as exc:
                failure = RankFailure(rank, "adopt", type(exc).__name__, str(exc))
        adopted = [f for f in _exchange(f"the adoption of {name}", failure, group) if f]
        if adopted:
            if adopted[0].error_type == "CheckpointNotFoundError":
                raise CheckpointNotFoundError(adopted[0].message)
            raise CorruptCheckpointError(f"nothing was loaded: {adopted[0].message}")
    try:
        if not posix.is_dir(final):
            raise CheckpointNotFoundError(f"no checkpoint at {final!r}")
        storage = LocalStorage(parent)
        if storage.size(f"{name}/{MANIFEST_NAME}") is None:
            raise CorruptCheckpointError(
                f"{final!r} has no {MANIFEST_NAME}: it was not committed by "
                "atomic_checkpoint.integrations.dcp.save (a stock dcp.save, or a save that "
                "did not finish), so nothing proves it complete. Pass adopt=True to check it "
                "with DCP's completeness rule and record it"
            )
        manifest = catalog.read_manifest(storage, name)
        share = _assign(manifest.files, world)[rank]
        catalog.validate(storage, name, replace(manifest, files=tuple(share)), full=verify)
    except Exception as exc:
        failure = RankFailure(rank, "verify", type(exc).__name__, str(exc))
    failures = [f for f in _exchange(f"the verification of {name}", failure, group) if f]
    if failures:
        if all(f.error_type == "CheckpointNotFoundError" for f in failures):
            raise CheckpointNotFoundError(failures[0].message)
        detail = "; ".join(f"rank {f.rank}: {f.message}" for f in failures)
        raise CorruptCheckpointError(f"{final!r} does not verify, nothing was loaded: {detail}")
    if manifest is None:  # pragma: no cover - set when this rank reported no failure
        raise CheckpointError(f"{final!r}: no manifest was read")
    failure, cause = None, None
    try:
        with _single_process_quiet():
            dcp.load(
                state_dict,
                storage_reader=_reader(final, allow_pickle),
                planner=_planner(planner, allow_pickle),
                process_group=group,
                no_dist=not _is_distributed(),
            )
    except (CheckpointException, Exception) as exc:  # see save_dcp: BaseException
        cause, failure = exc, _dcp_error(rank, "dcp_read", exc)
    failures = [f for f in _exchange(f"the outcome of loading {name}", failure, group) if f]
    if failures:
        raise DistributedCheckpointError(failures, step=manifest.step, operation="load") from cause
    return manifest.info(final)


# ---------------------------------------------------------------------- adoption
# The folders a stock DCP run is adopted from: ``checkpoint-<step>``, the names
# ``save_dcp`` gives (so a job that switches to a manager keeps its layout). They are
# the Trainer's names too, so the rule applies only when named (``framework="dcp"``).
_DCP_NAME_RE = re.compile(r"^checkpoint-(?P<step>0|[1-9][0-9]{0,18})\Z")
_DCP_METADATA_FILE = ".metadata"
_ADOPTED_BY = "dcp"


def _clear_the_way(
    mgr: CheckpointManager, step: int, overwrite: bool, label: str
) -> CheckpointExistsError | None:
    """On the coordinator, before a save of ``step``: a ``checkpoint-<step>`` without a
    manifest that ``dcp.save`` wrote *complete* is the user's checkpoint: the error
    that refuses the save (on every rank, through ``saving``'s ``failed``), unless
    ``overwrite``. A torn one is moved aside (``set_aside_unmanifested``)."""
    if not mgr.is_coordinator:
        return None
    name = checkpoint_name(step)
    local = mgr.storage.local_path(name)
    if not overwrite and local is not None and mgr.storage.is_dir(name):
        try:
            catalog.read_manifest(mgr.storage, name)
        except CheckpointNotFoundError:
            if stock_checkpoint_problem(local) is None:
                return CheckpointExistsError(
                    f"{label}: {mgr.storage.url(name)} is a complete checkpoint that "
                    f"dcp.save wrote (it has no manifest); not replacing it with step "
                    f"{step}. Resume from it with load_dcp(mgr, state, "
                    "adopt_existing=True) (the next save then follows it), record it with "
                    "`atomic-checkpoint adopt ROOT --framework dcp`, or pass "
                    "overwrite=True to replace it"
                )
        except CheckpointError:
            pass  # ours, unreadable: set_aside_unmanifested says it is replaced
    set_aside_unmanifested(mgr.storage, step, label)
    return None


def stock_checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """DCP's completeness rule for a directory ``dcp.save`` wrote without this library:
    None when it is complete, else why not (one sentence).

    DCP's ``FileSystemWriter`` writes every rank's data files (``__<rank>_<n>.distcp``),
    then, on the coordinator, ``.metadata`` (written to ``.metadata.tmp`` and renamed),
    which maps every saved item to ``(relative_path, offset, length)`` in those files.
    So a directory is complete when ``.metadata`` parses with DCP's own reader
    (``FileSystemReader.read_metadata``) and every file it references exists and holds
    at least ``offset + length`` bytes of each item. A save killed before ``.metadata``
    (or a data file lost or truncated since) is refused. Reading ``.metadata`` unpickles
    it, as ``dcp.load`` does: adopt only directories you would load. Never writes.

    Not provable here (DCP records no checksums): a stock save killed while it rewrote
    an existing directory (``dcp.save`` to the same path again) can leave the old
    ``.metadata`` over data files of the new save with the same layout.
    """
    text = os.fspath(path)
    if is_url(text):
        return (
            "not on a mounted filesystem: DCP's FileSystemReader reads by OS path, so its "
            "checkpoints are adopted from a mounted path"
        )
    local = text.removeprefix("file://")
    if not posix.is_dir(local):
        return "not a directory (DCP writes a directory per checkpoint)"
    if not posix.is_file(os.path.join(local, _DCP_METADATA_FILE)):
        tmp = posix.exists(os.path.join(local, _DCP_METADATA_FILE + ".tmp"))
        return (
            f"{_DCP_METADATA_FILE} is missing"
            + (f" (only {_DCP_METADATA_FILE}.tmp)" if tmp else "")
            + ": DCP writes it last, after every rank's data files, so this save did not "
            "finish (or the directory is not a DCP checkpoint)"
        )
    try:
        metadata = _SafeReader(local).read_metadata()
    except Exception as exc:  # unpickling a torn file raises anything
        return (
            f"{_DCP_METADATA_FILE} cannot be read by DCP ({type(exc).__name__}: {exc}): torn, "
            "or not written by torch.distributed.checkpoint"
        )
    storage_data = getattr(metadata, "storage_data", None)
    if not isinstance(storage_data, Mapping) or (
        not storage_data and getattr(metadata, "state_dict_metadata", None)
    ):
        return f"{_DCP_METADATA_FILE} maps no item to a data file: not a FileSystemWriter save"
    needed: dict[str, int] = {}
    for index, info in storage_data.items():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (
            not isinstance(rel, str)
            or not rel
            or os.path.isabs(rel)
            or ".." in rel.replace("\\", "/").split("/")
            or not all(isinstance(n, int) and n >= 0 for n in (offset, length))
        ):
            return (
                f"{_DCP_METADATA_FILE} has an invalid location for {getattr(index, 'fqn', index)!r}"
                f" ({rel!r}, {offset!r}, {length!r})"
            )
        needed[rel] = max(needed.get(rel, 0), int(offset) + int(length))  # type: ignore[arg-type]
    missing, short = [], []
    for rel, end in sorted(needed.items()):
        try:
            size = posix.file_size(os.path.join(local, rel))
        except StorageError as exc:
            return f"{rel} cannot be read: {exc}"
        if size is None:
            missing.append(rel)
            continue
        if size < end:
            short.append(f"{rel} ({size} of at least {end} bytes)")
    if missing:
        return (
            f"{_DCP_METADATA_FILE} references {len(needed)} data file(s) and "
            f"{', '.join(missing[:5])} {'is' if len(missing) == 1 else 'are'} missing"
        )
    if short:
        return f"truncated data file(s): {', '.join(short[:5])}"
    return None


def _adopt_held(mgr: CheckpointManager) -> dict[int, str]:
    """On the coordinator, under the run lock ``mgr`` holds: record each complete stock
    ``checkpoint-<step>`` of ROOT (``stock_checkpoint_problem``) as ``adopt`` does
    (checksums taken now, every file and directory fsync'd, the manifest created once,
    marked adopted). Returns the refused steps with the reason."""
    if mgr.read_only:
        raise CheckpointError(
            f"load_dcp(adopt_existing=True) writes manifests, and this manager of {mgr.root} "
            "is read-only: open it writable, or run `atomic-checkpoint adopt ROOT "
            "--framework dcp` first"
        )
    result = mgr.adopt_existing(framework=_ADOPTED_BY)
    for step in result.adopted:
        log.info(
            "load_dcp: adopted the stock DCP checkpoint %s", mgr.storage.url(checkpoint_name(step))
        )
    return dict(result.refused)


def _adopt_existing(mgr: CheckpointManager) -> None:
    """Collective: the coordinators adopt the complete stock DCP checkpoints of ROOT;
    every rank raises the same error if that failed, and warns about the torn ones."""
    refused: dict[int, str] = {}
    failure: RankFailure | None = None
    cause: BaseException | None = None
    if mgr.is_coordinator:
        try:
            refused = _adopt_held(mgr)
        except Exception as exc:
            cause = exc
            failure = RankFailure(mgr.rank, "adopt", type(exc).__name__, str(exc))
    failures = _agree(mgr, "load: adopt stock DCP checkpoints", "adopt", failure)
    if failures:
        detail = "; ".join(f"rank {f.rank}: {f.error_type}: {f.message}" for f in failures)
        raise CheckpointError(
            f"load_dcp: adopting the stock DCP checkpoints in {mgr.root} failed ({detail}). "
            "Nothing was loaded; the checkpoints recorded before the failure stay adopted "
            "(adopting again skips them)"
        ) from cause
    for step, why in sorted(refused.items()):
        log.warning(
            "load_dcp: not adopting the stock checkpoint %s in %s (never loaded): %s",
            checkpoint_name(step),
            mgr.root,
            why,
        )


def _refuse_unadopted(mgr: CheckpointManager) -> None:
    """Collective. ROOT holds no checkpoint of this run to load, but ``checkpoint-<step>``
    folders without a manifest (a stock ``dcp.save`` run, or another tool's): raise
    ``ResumeError`` on every rank, even with ``missing_ok``, rather than start from
    scratch over them (and have the first save collide with one), saying how to adopt
    the complete ones. The coordinator looks; every rank gets its answer."""
    failure: RankFailure | None = None
    if mgr.is_coordinator:
        try:
            entries = catalog.scan(mgr.storage, run_id=mgr.run_id or None)
        except CheckpointError:
            entries = []
        names = [e.name for e in entries if e.unmanifested]
        if names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            failure = RankFailure(mgr.rank, "discover", "ResumeError", shown)
    failures = _agree(mgr, "load: folders without a manifest", "discover", failure)
    found = [f.message for f in failures if f.error_type == "ResumeError"]
    if failures and not found:  # a rank that did not report
        raise DistributedCheckpointError(failures, step=None, operation="load")
    if found:
        raise ResumeError(
            f"load_dcp: {mgr.root} holds no checkpoint of run {mgr.run_id!r}, but checkpoint "
            f"folders without a manifest ({found[0]}): a stock dcp.save run's, or torn. "
            "Starting from scratch over them is refused. To load the complete ones, adopt "
            "them: load_dcp(..., adopt_existing=True), or `atomic-checkpoint adopt "
            f"{mgr.root} --framework dcp` once; to start from scratch, move them away"
        )


def _written_for_dcp(info: CheckpointInfo) -> bool:
    """Saved by ``save_dcp``/``async_save_dcp``, or a stock DCP checkpoint adopted."""
    if DCP_METADATA_KEY in info.metadata:
        return True
    adoption = info.metadata.get("adoption")
    return isinstance(adoption, dict) and adoption.get("framework") == _ADOPTED_BY


def _adopt_path(parent: str, name: str) -> None:
    """On the first rank: give the stock DCP directory ``parent/name`` a manifest
    marked adopted (checksums taken now), or raise why not. A directory with a
    manifest is left as it is (its manifest is verified by the load)."""
    from ..adopt import checksum_and_sync

    final = os.path.join(parent, name)
    if not posix.is_dir(final):
        raise CheckpointNotFoundError(f"no checkpoint at {final!r}")
    storage = LocalStorage(parent)
    if storage.size(f"{name}/{MANIFEST_NAME}") is not None:
        return
    problem = stock_checkpoint_problem(final)
    if problem is not None:
        raise CorruptCheckpointError(
            f"{final!r} is not a complete DCP checkpoint, so it is not adopted (nothing "
            f"written): {problem}"
        )
    files = checksum_and_sync(storage, name)
    storage.fsync_dir("")  # DCP never fsyncs the directory's entry in its parent
    m = re.search(r"(0|[1-9][0-9]{0,18})\Z", name)
    manifest = Manifest(
        step=int(m.group(1)) if m else 0,
        run_id="",
        commit_seq=0,
        world_size=1,
        files=files,
        state_kind="files",
        metadata={"adoption": {"framework": _ADOPTED_BY, "adopted_unix": time.time()}},
        library_version=__version__,
        adopted=True,
    )
    # Created once: never over a manifest that appeared meanwhile.
    if not storage.create_exclusive(f"{name}/{MANIFEST_NAME}", manifest.to_json_bytes()):
        return
    storage.fsync_dir(name)
    log.info("adopted the stock DCP checkpoint %s (checksums taken now)", final)


def _register_adoption() -> None:
    """Make ``adopt(..., framework="dcp")`` (and ``atomic-checkpoint adopt --framework
    dcp``) know DCP's rule; never under ``"auto"`` (the Trainer's names)."""
    try:
        from ..adopt import register_framework
    except ImportError:  # pragma: no cover - the adopt module is part of the package
        return
    register_framework(_ADOPTED_BY, _DCP_NAME_RE, stock_checkpoint_problem, auto=False)


_register_adoption()
