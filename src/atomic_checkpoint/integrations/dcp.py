"""``torch.distributed.checkpoint`` (DCP) inside the commit of a ``CheckpointManager``.

Two lines, on every rank::

    from atomic_checkpoint.integrations.dcp import load_dcp, save_dcp

    info = load_dcp(mgr, state_dict, missing_ok=True)  # newest complete step, resharded
    save_dcp(mgr, step, state_dict)                    # instead of dcp.save(...)

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
are checked against the manifest, each rank checksumming a share of them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import catalog
from .._faults import fault_point
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    RankFailure,
    ResumeError,
)
from ..layout import checkpoint_name
from ..manager import CheckpointManager
from ..manifest import CheckpointInfo, FileEntry

__all__ = ["DCP_METADATA_KEY", "load_dcp", "save_dcp"]

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
        outcomes = mgr.coordinator.all_gather(key, failure, timeout_s=mgr.timeout_s)
    except CoordinationTimeoutError as exc:
        failures = [failure] if failure is not None else []
        failures += [
            RankFailure(
                r,
                phase,
                "CoordinationTimeoutError",
                f"did not report within {mgr.timeout_s:g} s (it crashed or hangs)",
            )
            for r in exc.missing_ranks
            if r != mgr.rank
        ]
        return failures
    return [f for f in outcomes if f is not None]


def _local_root(mgr: CheckpointManager) -> str:
    root = mgr.storage.local_path("")
    if root is None:
        raise CheckpointError(
            f"DCP checkpoints need a mounted filesystem; {mgr.root} is not one (DCP's "
            "FileSystemWriter writes files by OS path)"
        )
    return root


def save_dcp(
    mgr: CheckpointManager,
    step: int,
    state_dict: dict[str, Any],
    *,
    metrics: Mapping[str, float] | None = None,
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
    """
    _local_root(mgr)
    meta = dict(metadata or {})
    meta[DCP_METADATA_KEY] = {"torch_version": torch.__version__, "world_size": mgr.world_size}
    with mgr.saving(step, metrics=metrics, metadata=meta, overwrite=overwrite) as pending:
        failure: RankFailure | None = None
        cause: BaseException | None = None
        writer = _PendingWriter(str(pending), rank=mgr.rank, step=step, thread_count=thread_count)
        try:
            with _single_process_quiet():
                dcp.save(
                    state_dict,
                    storage_writer=writer,
                    planner=planner,
                    process_group=process_group,
                    no_dist=not _is_distributed(),
                )
        # CheckpointException derives from BaseException: name it, or it escapes as a
        # non-Exception that `except Exception` in the training loop never sees.
        except (CheckpointException, Exception) as exc:
            cause = exc
            kind, message = _describe(exc)
            failure = RankFailure(mgr.rank, "dcp_write", kind, message)
        # DCP's own error reporting stops at its collectives: a rank that died leaves
        # the others with a bare gloo/NCCL error (or none). Share every rank's outcome
        # so all of them raise the same error, naming who failed.
        failures = _agree(mgr, f"save step {step}: dcp_write", "dcp_write", failure)
        if failures:
            raise DistributedCheckpointError(failures, step=step) from cause
    info = mgr.last_saved
    if info is None:  # pragma: no cover - saving() sets it on success
        raise CheckpointError(f"checkpoint step {step} was saved but returned no result")
    return info


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


def load_dcp(
    mgr: CheckpointManager,
    state_dict: dict[str, Any],
    step: int | None = None,
    *,
    verify: bool = True,
    missing_ok: bool = False,
    planner: Any = None,
    process_group: Any = None,
) -> CheckpointInfo | None:
    """Load checkpoint ``step`` (default: the newest that verifies) into ``state_dict``
    in place, with DCP's resharding. Collective.

    ``state_dict`` describes the target layout, as for ``dcp.load``: DTensors on this
    job's mesh (any world size), tensors, plain values.

    Args:
        mgr: the manager of ROOT.
        state_dict: filled in place.
        step: a committed step; None picks the newest checkpoint written by
            ``save_dcp`` that verifies (an invalid one is skipped with a warning).
        verify: checksum every file first, each rank a share (one extra read of
            the checkpoint, spread over the ranks); False checks sizes only.
        missing_ok: return None instead of raising when there is no checkpoint.
        planner: a DCP ``LoadPlanner`` (default: DCP's, which reshards).
        process_group: the group DCP's collectives use.

    Returns:
        The loaded checkpoint (identical on every rank), or None (``missing_ok``).

    Raises:
        CheckpointNotFoundError: no (such) checkpoint.
        CorruptCheckpointError: ``step`` does not verify.
        ResumeError: ``step`` is None and no checkpoint can be loaded (none was
            written by ``save_dcp``, or none verifies).
        DistributedCheckpointError: DCP failed to load on some rank (every rank
            raises it).
    """
    _local_root(mgr)
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
            if missing_ok:
                return None
            raise CheckpointNotFoundError(
                f"no valid checkpoint of run {mgr.run_id!r} in {mgr.root} to load with DCP"
            )
    chosen: CheckpointInfo | None = None
    problems: list[str] = []
    for info in candidates:
        if DCP_METADATA_KEY not in info.metadata:
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
                storage_reader=dcp.FileSystemReader(chosen.path),
                planner=planner,
                process_group=process_group,
                no_dist=not _is_distributed(),
            )
    except (CheckpointException, Exception) as exc:  # see save_dcp: BaseException
        cause = exc
        kind, message = _describe(exc)
        failure = RankFailure(mgr.rank, "dcp_read", kind, message)
    failures = _agree(mgr, f"load step {chosen.step}: dcp_read", "dcp_read", failure)
    if failures:
        raise DistributedCheckpointError(failures, step=chosen.step) from cause
    return chosen
