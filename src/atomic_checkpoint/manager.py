"""``CheckpointManager``: the facade users touch. It composes storage, coordination,
the commit protocol, serialization and retention; it owns no I/O of its own.

Two lines in a torchrun script::

    mgr = CheckpointManager("/ckpt/run1", retention=KeepLast(3) | KeepBest(1, "eval_loss"))
    mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})

Every public method that a distributed job calls is collective: call it on every rank,
in the same order. The coordinator (rank 0 of the storage domain) decides, the others
follow its broadcast decision (DESIGN invariant 3).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from . import catalog
from ._faults import fault_point
from .commit import RankReport, RenameStrategy, SaveContext, run_phase
from .commit import save as commit_save
from .coordination import Coordinator, default_coordinator
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ReadOnlyError,
    ResumeError,
    StorageError,
)
from .layout import (
    META_DIR,
    PENDING_DIR,
    REPLICATED_STATE_FILE,
    TRASH_DIR,
    checkpoint_name,
    new_attempt_token,
    rank_state_file,
    validate_step,
)
from .manifest import CheckpointInfo, FileEntry, Hasher, Manifest, check_metadata, check_metrics
from .storage.base import Storage
from .storage.local import LocalStorage

log = logging.getLogger("atomic_checkpoint")

RUN_FILE = f"{META_DIR}/run.json"
_RESUME_MODES = ("auto", "must", "never")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


class _Aborted(Exception):
    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class CheckpointManager:
    """Saves, discovers, restores and rotates the checkpoints of one run under ``root``.

    Args:
        root: a directory (local, NFS, sshfs, ...) or a ``Storage``.
        retention: a policy such as ``KeepLast(3) | KeepBest(1, metric="eval_loss")``;
            None keeps everything. The newest checkpoint is never deleted.
        run_id: identity of the run; checkpoints of other runs in ``root`` are never
            counted, resumed from or deleted. Default: the run recorded in ``root``
            (so a restarted job continues its run), or a new one.
        coordinator: how ranks agree; default: torch.distributed when a process group
            is initialised, else single process.
        timeout_s: bound on every wait for other ranks.
        read_only: never write, lock or delete (safe while a job runs).
        resume: "auto" (resume if there is a valid checkpoint; error if there are
            checkpoints but none is valid), "must" (error if nothing valid), "never"
            (error if this run already has checkpoints: start a new run instead).
        on_commit: called on the coordinator with each ``CheckpointInfo`` after its
            commit is durable (for uploaders: never a pending path).
        allow_pickle: allow saving/loading objects that need pickle. Loading pickle
            executes code from the checkpoint: only for checkpoints you trust.
        visibility_timeout_s: bound on waits for network filesystems to show changes.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        retention: Any = None,
        run_id: str | None = None,
        coordinator: Coordinator | None = None,
        timeout_s: float = 600.0,
        read_only: bool = False,
        resume: str = "auto",
        on_commit: Callable[[CheckpointInfo], None] | None = None,
        allow_pickle: bool = False,
        visibility_timeout_s: float = 30.0,
    ):
        if resume not in _RESUME_MODES:
            raise ValueError(f"resume must be one of {_RESUME_MODES}, got {resume!r}")
        if retention is not None and not hasattr(retention, "keep"):
            raise TypeError(
                f"retention must be a policy such as KeepLast(3), got {type(retention).__name__}"
            )
        if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
            raise ValueError("run_id must be a non-empty string")
        self.storage: Storage = (
            root if not isinstance(root, (str, os.PathLike)) else _open_storage(root)
        )
        self.coordinator = coordinator or default_coordinator()
        self.retention = retention
        self.timeout_s = float(timeout_s)
        self.read_only = read_only
        self.on_commit = on_commit
        self.allow_pickle = allow_pickle
        self.visibility_timeout_s = visibility_timeout_s
        self._strategy = RenameStrategy()
        self._closed = False
        self._rotation: threading.Thread | None = None
        self._rotation_error: BaseException | None = None
        self._last_seq = 0
        setup = self._collective(
            "open", self._setup_coordinator if self.is_coordinator else None, run_id=run_id
        )
        self.run_id: str = setup["run_id"]
        self._last_seq = setup["last_seq"]
        self._ctx = SaveContext(
            storage=self.storage,
            coord=self.coordinator,
            run_id=self.run_id,
            timeout_s=self.timeout_s,
            strategy=self._strategy,
            next_commit_seq=self._next_seq,
            visibility_timeout_s=visibility_timeout_s,
        )
        self._check_resume_mode(resume, setup)

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator.rank == 0

    @property
    def root(self) -> str:
        return self.storage.url("")

    def __repr__(self) -> str:
        where = f"rank={self.rank}/{self.world_size}"
        return f"CheckpointManager({self.root!r}, run_id={self.run_id!r}, {where})"

    # ------------------------------------------------------------------ set-up
    def _collective(self, phase: str, fn: Callable[..., Any] | None, **kwargs: Any) -> Any:
        """Run ``fn`` on the coordinator and broadcast its result or its failure."""
        try:
            return run_phase(
                self._ctx_or_bootstrap(),
                -1,
                phase,
                (lambda: fn(**kwargs)) if fn is not None else None,
            )[0]
        except Exception as exc:
            error = getattr(exc, "error", None)
            if error is not None:
                raise error from None
            raise

    def _ctx_or_bootstrap(self) -> SaveContext:
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            return ctx
        return SaveContext(
            storage=self.storage,
            coord=self.coordinator,
            run_id="",
            timeout_s=self.timeout_s,
            strategy=self._strategy,
        )

    def _setup_coordinator(self, run_id: str | None) -> dict[str, Any]:
        local = self.storage.local_path("")
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise StorageError(
                f"checkpoint root {local!r} is a file, not a directory: pass a directory path",
                path=local,
            )
        if self.read_only:
            recorded = self._recorded_run_id()
            manifests = catalog.committed(self.storage, run_id=run_id or recorded, warn=False)
            return {
                "run_id": run_id or recorded or "",
                "last_seq": 0,
                "n_valid": len(manifests),
                "n_corrupt": 0,
            }
        self.storage.makedirs(META_DIR)
        self.storage.makedirs(PENDING_DIR)
        if not os.access(local, os.W_OK) if local is not None else False:
            raise StorageError(
                f"checkpoint root {local!r} is not writable by this user", path=local
            )
        recorded = self._recorded_run_id()
        if run_id is None:
            run_id = recorded
            if run_id is None:
                run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
                doc = {"run_id": run_id, "created_unix": time.time(), "host": socket.gethostname()}
                if not self.storage.create_exclusive(RUN_FILE, json.dumps(doc).encode()):
                    run_id = self._recorded_run_id() or run_id
        self._sweep()
        entries = catalog.scan(self.storage, run_id=run_id)
        seqs = [e.manifest.commit_seq for e in entries if e.manifest is not None]
        return {
            "run_id": run_id,
            "last_seq": max(seqs, default=0),
            "n_valid": sum(1 for e in entries if e.status == "ok"),
            "n_corrupt": sum(1 for e in entries if e.status == "corrupt"),
        }

    def _recorded_run_id(self) -> str | None:
        try:
            doc = json.loads(self.storage.read_bytes(RUN_FILE))
        except CheckpointNotFoundError:
            return None
        except (ValueError, CheckpointError) as exc:
            raise CorruptCheckpointError(
                f"{self.storage.url(RUN_FILE)} is unreadable: {exc}"
            ) from exc
        rid = doc.get("run_id") if isinstance(doc, dict) else None
        return rid if isinstance(rid, str) and rid else None

    def _sweep(self) -> None:
        """Remove pending and trash data left by crashed saves and rotations.

        Only the coordinator of a writing manager sweeps, at start-up, before any save
        of this job exists.
        """
        for d in (PENDING_DIR, TRASH_DIR):
            for name in self.storage.listdir(d):
                try:
                    self.storage.delete_tree(f"{d}/{name}")
                    log.info("removed abandoned %s", self.storage.url(f"{d}/{name}"))
                except CheckpointError as exc:
                    log.warning(
                        "could not remove abandoned %s: %s", self.storage.url(f"{d}/{name}"), exc
                    )

    def _check_resume_mode(self, resume: str, setup: Mapping[str, Any]) -> None:
        if resume == "must" and setup["n_valid"] == 0:
            raise ResumeError(
                f"resume='must' but {self.root} has no valid checkpoint of run {self.run_id!r}"
                + (
                    f" ({setup['n_corrupt']} corrupt ones were skipped)"
                    if setup["n_corrupt"]
                    else ""
                )
            )
        if resume == "auto" and setup["n_valid"] == 0 and setup["n_corrupt"] > 0:
            raise ResumeError(
                f"{self.root} holds {setup['n_corrupt']} checkpoint(s) of run {self.run_id!r} but "
                "none is valid (see `atomic-checkpoint verify`); refusing to start from scratch "
                "over them. Repair or move them, or pass resume='never' with a new run_id"
            )
        if resume == "never" and setup["n_valid"] > 0:
            raise ResumeError(
                f"resume='never' but {self.root} already has {setup['n_valid']} checkpoint(s) of "
                f"run {self.run_id!r}; pass a new run_id to start a separate run there"
            )

    def _next_seq(self) -> int:
        self._last_seq += 1
        return self._last_seq

    # ------------------------------------------------------------------ saving
    def _check_writable(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")
        if self.read_only:
            raise ReadOnlyError(f"this CheckpointManager on {self.root} is read-only")

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        replicated: bool = False,
        overwrite: bool = False,
    ) -> CheckpointInfo:
        """Save this rank's ``state`` as part of checkpoint ``step``; collective.

        ``state`` is nested dicts/lists/tuples of tensors, arrays, numbers and strings
        (a model + optimizer + scheduler + RNG state). With ``replicated=True`` every
        rank holds the same state and only the coordinator writes it.

        Returns:
            The committed checkpoint, identical on every rank, with ``timings_s``.
        """
        from .serialization import plan_state

        self._check_writable()
        step = validate_step(step)
        metrics_d, metadata_d = check_metrics(metrics), check_metadata(metadata)
        writes = not replicated or self.is_coordinator
        rel = REPLICATED_STATE_FILE if replicated else rank_state_file(self.rank)
        plan: Any = None

        def check_input() -> None:
            # Planning walks the tree and finds unsupported objects before anything is
            # written; it runs inside the first phase so its failure reaches every rank.
            nonlocal plan
            if writes:
                plan = plan_state(state, allow_pickle=self.allow_pickle)

        def write(pending: str) -> RankReport:
            if plan is None:
                return RankReport((), 0.0, 0.0)
            return _write_plan(self.storage, f"{pending}/{rel}", rel, plan, self.rank, step)

        return self._save(
            step,
            write,
            "replicated" if replicated else "per_rank",
            metrics_d,
            metadata_d,
            overwrite,
            check_input,
        )

    @contextlib.contextmanager
    def saving(
        self,
        step: int,
        *,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> Iterator[Path]:
        """Yield a pending directory that every rank writes files into; committed on
        exit, discarded if the block raises on any rank. Collective.

        Example::

            with mgr.saving(step) as d:
                if mgr.is_coordinator:
                    model.save_pretrained(d)
                torch.save(optim.state_dict(), d / f"optim-{mgr.rank}.pt")
            info = mgr.last_saved
        """
        self._check_writable()
        step = validate_step(step)
        metrics_d, metadata_d = check_metrics(metrics), check_metadata(metadata)
        gen = _SavingBlock(self, step, metrics_d, metadata_d, overwrite)
        with gen as path:
            yield path
        self.last_saved = gen.info

    last_saved: CheckpointInfo | None = None

    def _save(
        self,
        step: int,
        write: Callable[[str], RankReport],
        kind: str,
        metrics: dict[str, float],
        metadata: dict[str, Any],
        overwrite: bool,
        check_input: Callable[[], None] | None = None,
    ) -> CheckpointInfo:
        self._finish_rotation()
        manifest, timings = commit_save(
            self._ctx,
            step,
            write,
            state_kind=kind,
            metrics=metrics,
            metadata=metadata,
            overwrite=overwrite,
            check_input=check_input,
        )
        return self._after_commit(manifest, timings)

    def _after_commit(self, manifest: Manifest, timings: dict[str, float]) -> CheckpointInfo:
        info = _with_timings(
            manifest.info(self.storage.url(checkpoint_name(manifest.step))), timings
        )
        self.last_saved = info
        if self.is_coordinator:
            total = timings.get("total", 0.0)
            log.info(
                "committed %s: %d rank(s), %s in %.3f s (%s/s; write %.3f s, commit %.3f s)",
                checkpoint_name(manifest.step),
                manifest.world_size,
                _fmt_bytes(manifest.size_bytes),
                total,
                _fmt_bytes(manifest.size_bytes / total if total > 0 else 0.0),
                timings.get("write", 0.0),
                timings.get("commit", 0.0),
            )
            if self.retention is not None:
                self._start_rotation(manifest.step)
            if self.on_commit is not None:
                self.on_commit(info)
        log.debug("rank %d: step %d timings %s", self.rank, manifest.step, timings)
        return info

    # ------------------------------------------------------------------ retention
    def _start_rotation(self, newest: int) -> None:
        """Rotation after a durable commit, on the coordinator, off the training thread.

        The next save (and ``close``) waits for it, so a delete never races a save.
        """
        self._rotation = threading.Thread(
            target=self._rotate, args=(newest,), name="atomic-checkpoint-rotation", daemon=True
        )
        self._rotation.start()

    def _rotate(self, newest: int) -> None:
        from .retention import plan_deletions

        try:
            manifests = catalog.committed(self.storage, run_id=self.run_id, warn=False)
            infos = [m.info(self.storage.url(checkpoint_name(m.step))) for m in manifests]
            if newest not in {i.step for i in infos}:
                return  # our own commit is not visible: decide nothing on a stale view
            for victim in plan_deletions(self.retention, infos):
                self._delete_checkpoint(victim.step)
        except BaseException as exc:  # reported at the next save or close
            self._rotation_error = exc

    def _delete_checkpoint(self, step: int) -> None:
        """Un-commit first (leave the discoverable namespace), then delete the data."""
        name = checkpoint_name(step)
        fault_point("before_uncommit", self.rank, step)
        self.storage.makedirs(TRASH_DIR)
        trash = f"{TRASH_DIR}/{name}.{new_attempt_token()}"
        try:
            self.storage.rename_dir(name, trash)
        except CheckpointNotFoundError:
            return  # already gone: deletes tolerate ENOENT
        self.storage.fsync_dir("")
        fault_point("after_uncommit", self.rank, step)
        fault_point("mid_delete", self.rank, step)
        self.storage.delete_tree(trash)
        log.info("retention: deleted %s", name)

    def _finish_rotation(self) -> None:
        t = self._rotation
        if t is not None:
            t.join()
            self._rotation = None
        err, self._rotation_error = self._rotation_error, None
        if err is not None:
            log.warning(
                "retention after the previous save failed: %s (the checkpoints it "
                "meant to delete are still there; the next rotation retries)",
                err,
            )

    # ------------------------------------------------------------------ discovery
    def checkpoints(self) -> list[CheckpointInfo]:
        """This run's valid committed checkpoints, ascending by step. Collective."""
        manifests = self._collective(
            "list", self._list_coordinator if self.is_coordinator else None
        )
        return [m.info(self.storage.url(checkpoint_name(m.step))) for m in manifests]

    def _list_coordinator(self) -> list[Manifest]:
        return catalog.committed(self.storage, run_id=self.run_id or None)

    def latest(self) -> CheckpointInfo | None:
        """The newest valid checkpoint of this run, or None. Collective: every rank gets
        the coordinator's answer, so all ranks resume from the same step."""
        found = self.checkpoints()
        return found[-1] if found else None

    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        device: Any = None,
        verify: bool = True,
        allow_pickle: bool | None = None,
        rank: int | None = None,
    ) -> Any:
        """Load this rank's state of checkpoint ``step`` (default: the newest valid).
        Collective.

        Args:
            into: an existing state of the same structure (e.g. ``model.state_dict()``):
                tensors are read straight into it (the fast path).
            device: move loaded tensors there (e.g. ``"cuda:0"``).
            verify: check the checksum of every byte read (cheap: hashed while reading).
            allow_pickle: override the manager's setting for this call.
            rank: read this rank's state instead of the calling rank's (tools, readers).
        """
        from .serialization import load_state

        manifest = self._collective(
            "resolve", self._resolve_coordinator if self.is_coordinator else None, step=step
        )
        rel = checkpoint_name(manifest.step)
        if manifest.state_kind == "files":
            raise CheckpointError(
                f"checkpoint step {manifest.step} was written with saving(): read its files "
                f"from {self.storage.url(rel)} (checkpoint_path(step))"
            )
        if manifest.state_kind == "replicated":
            file_rel = REPLICATED_STATE_FILE
        elif rank is not None:
            if not 0 <= rank < manifest.world_size:
                raise ValueError(
                    f"rank {rank} is out of range: checkpoint step {manifest.step} was saved "
                    f"by {manifest.world_size} rank(s)"
                )
            file_rel = rank_state_file(rank)
        else:
            if manifest.world_size != self.world_size:
                raise CheckpointError(
                    f"checkpoint step {manifest.step} holds per-rank state of "
                    f"{manifest.world_size} rank(s) but this job has {self.world_size}; "
                    "restore it with the same world size, or save with the DCP integration "
                    "for resharding"
                )
            file_rel = rank_state_file(self.rank)
        entry = manifest.file(file_rel)
        catalog.check_inside(self.storage, rel, file_rel)
        path = f"{rel}/{file_rel}"
        pickle_ok = self.allow_pickle if allow_pickle is None else allow_pickle
        with self.storage.open_read(path) as raw:
            reader = _HashingReader(raw, Hasher(manifest.checksum_algorithm)) if verify else raw
            state = load_state(
                reader,
                allow_pickle=pickle_ok,
                into=into,
                device=device,
                size_bytes=entry.size_bytes,
            )
        if verify and isinstance(reader, _HashingReader):
            reader.check(entry, self.storage.url(path), self.storage)
        return state

    def _resolve_coordinator(self, step: int | None) -> Manifest:
        if step is None:
            found = catalog.committed(self.storage, run_id=self.run_id or None)
            if not found:
                raise CheckpointNotFoundError(
                    f"no valid checkpoint of run {self.run_id!r} in {self.root}"
                )
            return found[-1]
        step = validate_step(step)
        return catalog.load_checkpoint(self.storage, step)

    def checkpoint_path(self, step: int) -> str:
        """Where checkpoint ``step`` lives (whether or not it exists)."""
        return self.storage.url(checkpoint_name(validate_step(step)))

    def verify(self, step: int) -> CheckpointInfo:
        """Full checksum verification of one checkpoint (run on the calling rank)."""
        m = catalog.load_checkpoint(self.storage, validate_step(step), full=True)
        return m.info(self.storage.url(checkpoint_name(m.step)))

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Finish background work (rotation). Idempotent."""
        if self._closed:
            return
        self._finish_rotation()
        self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SavingBlock:
    """The body of ``saving()``: the user writes, then every rank commits or aborts."""

    def __init__(
        self,
        mgr: CheckpointManager,
        step: int,
        metrics: dict[str, float],
        metadata: dict[str, Any],
        overwrite: bool,
    ):
        self.mgr, self.step, self.metrics, self.metadata, self.overwrite = (
            mgr,
            step,
            metrics,
            metadata,
            overwrite,
        )
        self.info: CheckpointInfo | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Path:
        mgr = self.mgr
        local = mgr.storage.local_path("")
        if local is None:
            raise CheckpointError(
                "saving() needs a mounted filesystem; use save() for object stores"
            )
        # Drive the protocol from a helper thread so the user's block runs between
        # "pending created" and "files gathered", with the same collective order on
        # every rank.
        mgr._finish_rotation()
        self._ready = threading.Event()
        self._body_done = threading.Event()
        self._body_error: BaseException | None = None
        self._result: tuple[Manifest, dict[str, float]] | None = None
        self._error: BaseException | None = None
        self._pending: str | None = None
        self._thread = threading.Thread(
            target=self._run, name="atomic-checkpoint-saving", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._pending is None:
            self._thread.join()
            raise self._error if self._error is not None else CheckpointError("saving() failed")
        return Path(local, *self._pending.split("/"))

    def _run(self) -> None:
        mgr = self.mgr

        def write(pending: str) -> RankReport:
            self._pending = pending
            self._ready.set()
            self._body_done.wait()
            if self._body_error is not None:
                err = self._body_error
                raise CheckpointError(f"the saving() block raised {type(err).__name__}: {err}")
            return _report_files(mgr.storage, pending, mgr.rank, mgr.is_coordinator)

        try:
            self._result = commit_save(
                mgr._ctx,
                self.step,
                write,
                state_kind="files",
                metrics=self.metrics,
                metadata=self.metadata,
                overwrite=self.overwrite,
            )
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._body_error = exc if exc is not None else None
        self._body_done.set()
        if self._thread is not None:
            self._thread.join()
        if exc is not None:
            return  # the user's exception propagates; the save was discarded
        if self._error is not None:
            raise self._error
        if self._result is not None:
            self.info = self.mgr._after_commit(*self._result)


def _report_files(storage: Storage, pending: str, rank: int, is_coordinator: bool) -> RankReport:
    """Files mode: the coordinator checksums and fsyncs every file (arbitrary writers,
    such as ``save_pretrained``, neither checksum nor fsync); others report nothing."""
    if not is_coordinator:
        return RankReport((), 0.0, 0.0)
    t = time.perf_counter()
    entries = []
    local = storage.local_path(pending)
    for rel, _size in storage.walk_files(pending):
        h = Hasher()
        size = 0
        path = os.path.join(local, *rel.split("/")) if local else None
        with storage.open_read(f"{pending}/{rel}") as f:
            buf = bytearray(8 << 20)
            view = memoryview(buf)
            while n := f.readinto(view):
                h.update(view[:n])
                size += n
            if path is not None:
                try:
                    os.fsync(f.fileno())
                except OSError as exc:
                    from .errors import map_os_error

                    raise map_os_error(exc, "fsync", path) from exc
        entries.append(FileEntry(rel, size, h.hexdigest(), rank))
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    if local is not None:
        dirs = {os.path.dirname(os.path.join(local, *e.path.split("/"))) for e in entries}
        for d in sorted(dirs, key=len, reverse=True):
            storage.fsync_dir(os.path.relpath(d, storage.local_path("") or "").replace(os.sep, "/"))
    return RankReport(tuple(entries), t_write, time.perf_counter() - t)


def _write_plan(
    storage: Storage, path: str, rel: str, plan: Any, rank: int, step: int
) -> RankReport:
    """Stream a serialization plan to ``path``, hashing each chunk as it is written."""
    t = time.perf_counter()
    w = storage.open_write(path, size_hint=plan.total_size_bytes)
    h = Hasher()
    size = 0
    try:
        for i, chunk in enumerate(plan.iter_chunks()):
            h.update(chunk)
            w.write(chunk)
            size += len(chunk) if isinstance(chunk, bytes) else memoryview(chunk).nbytes
            if i == 0:  # some bytes written, the rest not, nothing fsync'd
                fault_point("mid_write", rank, step)
        t_write = time.perf_counter() - t
        t = time.perf_counter()
        w.close()
    except BaseException:
        w.abort()
        raise
    return RankReport(
        (FileEntry(rel, size, h.hexdigest(), rank),), t_write, time.perf_counter() - t
    )


class _HashingReader:
    """Hashes bytes as ``load_state`` reads them, so verification costs no second pass.

    If the reader is used out of order (seek backwards), hashing falls back to a
    separate sequential pass in ``check``.
    """

    def __init__(self, raw: Any, hasher: Hasher):
        self._raw = raw
        self._h = hasher
        self._pos = 0
        self._hashed = 0
        self._sequential = True

    def readinto(self, b: Any) -> int:
        n = self._raw.readinto(b)
        if n:
            if self._pos == self._hashed:
                self._h.update(memoryview(b).cast("B")[:n])
                self._hashed += n
            else:
                self._sequential = False
            self._pos += n
        return n or 0

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        if data:
            if self._pos == self._hashed:
                self._h.update(data)
                self._hashed += len(data)
            else:
                self._sequential = False
            self._pos += len(data)
        return bytes(data or b"")

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = self._raw.seek(pos, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def check(self, entry: FileEntry, where: str, storage: Storage) -> None:
        if not self._sequential or self._hashed != entry.size_bytes:
            # Read the rest (or all) sequentially to finish the checksum.
            h = Hasher(self._h.algorithm)
            with storage.open_read(
                where
                if storage.local_path("") is None
                else os.path.relpath(where, storage.local_path("") or "")
            ) as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            digest = h.hexdigest()
        else:
            digest = self._h.hexdigest()
        if digest != entry.checksum:
            raise CorruptCheckpointError(
                f"{where}: checksum {digest} does not match the manifest ({entry.checksum}): "
                "the file is corrupt"
            )


def _with_timings(info: CheckpointInfo, timings: dict[str, float]) -> CheckpointInfo:
    from dataclasses import replace

    return replace(info, timings_s=dict(timings))


def _open_storage(root: str | os.PathLike[str]) -> Storage:
    text = os.fspath(root)
    if "://" in text and not text.startswith("file://"):
        raise CheckpointError(
            f"object-store roots such as {text!r} need FsspecStorage (pip install "
            "'atomic-checkpoint[s3]')"
        )
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalStorage(text)
