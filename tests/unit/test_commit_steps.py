"""The commit as explicit steps (``commit.begin`` / ``finish`` / ``abort``), driven the
way the manager drives them: on a real directory, and with several ranks as threads,
each with its own client of one real TCPStore (the coordination a torchrun job uses).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atomic_checkpoint import (
    CheckpointExistsError,
    CheckpointManager,
    DistributedCheckpointError,
    SaveAbandonedError,
    catalog,
    commit,
)
from atomic_checkpoint.commit import Failed, RankReport, SaveContext, SharedManifest
from atomic_checkpoint.coordination import SingleProcessCoordinator
from atomic_checkpoint.manifest import FileEntry, Hasher
from atomic_checkpoint.storage import open_storage
from atomic_checkpoint.strategies import choose_strategy
from tests.helpers import on_store_threads


def _ctx(root: Path, coord: Any = None, **kw: Any) -> SaveContext:
    storage = open_storage(str(root))
    return SaveContext(
        storage=storage,
        coord=coord or SingleProcessCoordinator(),
        run_id="steps",
        timeout_s=20.0,
        strategy=choose_strategy(storage),
        **kw,
    )


def _write(ctx: SaveContext, location: str, rank: int, data: bytes = b"x" * 100) -> RankReport:
    rel = f"rank-{rank:05d}.safetensors"  # a per-rank checkpoint lists every rank's
    w = ctx.storage.open_write(f"{location}/{rel}", size_hint=len(data))
    w.write(data)
    w.close()  # fsync'd
    h = Hasher()
    h.update(data)
    return RankReport((FileEntry(rel, len(data), h.hexdigest(), rank),), 0.0, 0.0)


def _finish(ctx: SaveContext, pending: commit.Pending, written: Any) -> commit.Committed:
    return commit.finish(
        ctx, pending, written, commit_seq=1, state_kind="per_rank", metrics={}, metadata={}
    )


def _pending_entries(root: Path) -> list[str]:
    pending = root / ".pending"
    return sorted(p.name for p in pending.iterdir()) if pending.exists() else []


def test_begin_creates_the_pending_location_and_finish_commits_it(tmp_path):
    ctx = _ctx(tmp_path)
    pending = commit.begin(ctx, 5)
    assert pending.writes and pending.location.startswith(".pending/checkpoint-5.")
    assert (tmp_path / pending.location).is_dir()
    assert not (tmp_path / "checkpoint-5").exists()  # nothing visible before finish
    done = _finish(ctx, pending, _write(ctx, pending.location, 0))
    assert done.manifest.step == 5 and [f.path for f in done.manifest.files] == [
        "rank-00000.safetensors"
    ]
    assert catalog.read_manifest(ctx.storage, "checkpoint-5").commit_seq == 1
    assert _pending_entries(tmp_path) == []
    assert set(done.timings) >= {"prepare", "write", "fsync", "gather", "commit", "total"}
    assert done.domain_views is None  # one storage domain


def test_abort_removes_what_begin_created_and_is_idempotent(tmp_path, caplog):
    ctx = _ctx(tmp_path)
    pending = commit.begin(ctx, 7)
    _write(ctx, pending.location, 0)
    commit.abort(ctx, pending)
    commit.abort(ctx, pending)  # again: nothing left to do, nothing to warn about
    assert _pending_entries(tmp_path) == [] and not (tmp_path / "checkpoint-7").exists()
    assert "could not remove" not in caplog.text


def test_a_problem_found_before_begin_fails_it_and_creates_nothing(tmp_path):
    ctx = _ctx(tmp_path)
    with pytest.raises(TypeError, match="unsupported"):
        commit.begin(ctx, 3, problem=TypeError("unsupported object at state['x']"))
    assert _pending_entries(tmp_path) == []


def test_a_failed_write_is_raised_by_finish_and_nothing_is_committed(tmp_path):
    ctx = _ctx(tmp_path)
    pending = commit.begin(ctx, 4)
    with pytest.raises(OSError, match="disk on fire"):
        _finish(ctx, pending, Failed("write", OSError("disk on fire")))
    assert _pending_entries(tmp_path) == [] and not (tmp_path / "checkpoint-4").exists()


def test_a_committed_step_is_refused_by_begin_without_overwrite(tmp_path):
    ctx = _ctx(tmp_path)
    pending = commit.begin(ctx, 2)
    _finish(ctx, pending, _write(ctx, pending.location, 0))
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        commit.begin(ctx, 2)
    pending = commit.begin(ctx, 2, overwrite=True)
    assert pending.replace
    _finish(ctx, pending, _write(ctx, pending.location, 0, b"y" * 10))
    assert catalog.read_manifest(ctx.storage, "checkpoint-2").files[0].size_bytes == 10


def test_an_abandoned_async_save_is_never_committed(tmp_path):
    cancel = threading.Event()
    ctx = _ctx(tmp_path, cancel=cancel)
    pending = commit.begin(ctx, 9)
    written = _write(ctx, pending.location, 0)
    cancel.set()  # close() gave up on it while it wrote
    with pytest.raises(SaveAbandonedError, match="step 9 was abandoned"):
        _finish(ctx, pending, written)
    assert not (tmp_path / "checkpoint-9").exists() and _pending_entries(tmp_path) == []


def test_the_save_context_carries_values_not_callbacks_into_the_manager():
    # The commit never calls back up a layer: what the manager decides (lock, cancel,
    # commit number, input check) comes in as values and arguments.
    for field in dataclasses.fields(SaveContext):
        assert "Callable" not in str(field.type), field.name
    for fn in (commit.begin, commit.finish, commit.abort):
        params = inspect.signature(fn).parameters
        assert not {"check_input", "fence", "next_commit_seq", "on_domain_view"} & set(params)
        for name, param in params.items():
            assert "Callable" not in str(param.annotation), f"{fn.__name__}({name})"
    source = inspect.getsource(commit)
    assert "from .manager" not in source and "import manager" not in source


# ---------------------------------------------------------------- several ranks


def _ranks(
    world: int, root: Path, body: Callable[[SaveContext, int], Any]
) -> list[tuple[str, Any]]:
    """Run ``body(ctx, rank)`` on ``world`` threads, each with its own client of one
    TCPStore; returns ("ok", result) or ("error", exception) per rank."""
    pytest.importorskip("torch.distributed")
    done = on_store_threads(world, lambda coord, rank: body(_ctx(root, coord), rank))
    return [(kind, value) for kind, value, _ in done]


def test_every_rank_gets_the_same_commit_through_the_leader(tmp_path):
    def body(ctx: SaveContext, rank: int) -> Any:
        pending = commit.begin(ctx, 11)
        return _finish(ctx, pending, _write(ctx, pending.location, rank)).manifest

    results = _ranks(3, tmp_path, body)
    assert [kind for kind, _ in results] == ["ok"] * 3
    leader, *others = [m for _, m in results]
    assert len(leader.files) == 3
    for m in others:  # the outcome without its file list: O(1) bytes per rank
        assert isinstance(m, SharedManifest) and m.files == ()
        assert (m.step, m.commit_seq, m.size_bytes) == (11, 1, leader.size_bytes)


def test_one_ranks_bad_input_fails_every_rank_alike_and_nothing_is_committed(tmp_path):
    def body(ctx: SaveContext, rank: int) -> Any:
        problem = TypeError("cannot save a lambda") if rank == 2 else None
        pending = commit.begin(ctx, 12, problem=problem)
        written = _write(ctx, pending.location, rank) if pending.writes else None
        return _finish(ctx, pending, written)

    results = _ranks(3, tmp_path, body)
    errors = [e for kind, e in results if kind == "error"]
    assert len(errors) == 3 and all(isinstance(e, DistributedCheckpointError) for e in errors)
    assert {str(e) for e in errors} == {str(errors[0])}  # the same error on every rank
    (failure,) = errors[0].failures
    assert (failure.rank, failure.phase, failure.error_type) == (2, "prepare", "TypeError")
    assert not (tmp_path / "checkpoint-12").exists() and _pending_entries(tmp_path) == []


def test_ranks_asked_for_different_steps_write_nothing_and_all_fail(tmp_path):
    def body(ctx: SaveContext, rank: int) -> Any:
        pending = commit.begin(ctx, 13 if rank != 1 else 14)
        assert pending.writes == (rank != 1)
        written = _write(ctx, pending.location, rank) if pending.writes else None
        return _finish(ctx, pending, written)

    results = _ranks(3, tmp_path, body)
    assert [kind for kind, _ in results] == ["error"] * 3
    assert all("different steps" in str(e) for _, e in results)
    assert not list(tmp_path.glob("checkpoint-*")) and _pending_entries(tmp_path) == []


def test_the_manager_commits_through_the_steps(tmp_path):
    # The facade's save is begin, this rank's write, finish: the same observable result.
    with CheckpointManager(tmp_path) as mgr:
        info = mgr.save(1, {"w": np.arange(4.0)})
    assert info.step == 1 and info.timings_s["prepare"] >= 0.0
    assert _pending_entries(tmp_path) == []
