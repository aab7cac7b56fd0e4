"""torch.distributed.checkpoint inside our commit: real gloo jobs, real DTensor sharding,
real SIGKILLs (tests/dist/launcher.run_ranks forks real processes)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from atomic_checkpoint import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    KeepLast,
    RankFailure,
    ResumeError,
)
from atomic_checkpoint._faults import ENV as FAULTS_ENV
from atomic_checkpoint.integrations.dcp import (
    DCP_METADATA_KEY,
    async_save_dcp,
    load,
    load_dcp,
    save,
    save_dcp,
)
from atomic_checkpoint.layout import MANIFEST_NAME, PENDING_DIR
from tests.cli.helpers import run_json
from tests.dist.launcher import ok_values, run_ranks
from tests.integrations.helpers import run_example

ROWS, COLS = 24, 6  # divisible by 4 and 2; DTensor handles uneven shards too


# ---------------------------------------------------------------------- rank workers
def _full(step: int) -> dict[str, torch.Tensor]:
    """The global (unsharded) tensors of step ``step``: any process can rebuild them."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "emb": torch.randn(5, 8, generator=g).to(torch.bfloat16),
        "bias": torch.randn(COLS, generator=g),
        "exp_avg": torch.randn(ROWS, COLS, generator=g),
    }


def _sharded(world: int, step: int | None) -> dict[str, Any]:
    """A model+optimizer-shaped state dict of DTensors on a ``world``-rank CPU mesh:
    ``w`` row-sharded, ``emb`` column-sharded, ``bias`` replicated. ``step=None``
    builds zeros of the same layout (a load target)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full(step if step is not None else 0)
    if step is None:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "emb": distribute_tensor(full["emb"], mesh, [Shard(1)]),
            "bias": distribute_tensor(full["bias"], mesh, [Replicate()]),
        },
        "optim": {
            "state": {"w": {"exp_avg": distribute_tensor(full["exp_avg"], mesh, [Shard(0)])}}
        },
        "step": -1 if step is None else step,
        "note": "" if step is None else f"step {step}",
    }


def _matches(sd: dict[str, Any], step: int) -> bool:
    full = _full(step)
    got = {
        "w": sd["model"]["w"].full_tensor(),
        "emb": sd["model"]["emb"].full_tensor(),
        "bias": sd["model"]["bias"].full_tensor(),
        "exp_avg": sd["optim"]["state"]["w"]["exp_avg"].full_tensor(),
    }
    same = all(got[k].dtype == full[k].dtype and torch.equal(got[k], full[k]) for k in full)
    return same and sd["step"] == step and sd["note"] == f"step {step}"


def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "is_exception": isinstance(exc, Exception),
        "is_checkpoint_error": isinstance(exc, CheckpointError),
        "failed_ranks": list(getattr(exc, "failed_ranks", ())),
        "missing_ranks": list(getattr(exc, "missing_ranks", ())),
        "message": str(exc),
        "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None,
    }


def w_save_four(rank: int, world: int, root: str) -> dict[str, Any]:
    """Steps 5, 10, 20 commit (KeepLast(2) rotates 5 away); step 30 fails inside DCP on
    rank 1; step 40 loses rank 2 to SIGKILL after it wrote its shard."""
    mgr = CheckpointManager(root, retention=KeepLast(2), timeout_s=4)
    infos = [save_dcp(mgr, s, _sharded(world, s), metrics={"loss": 1.0 / s}) for s in (5, 10, 20)]
    out: dict[str, Any] = {"infos": [(i.step, i.path, i.commit_seq) for i in infos]}
    try:
        save_dcp(mgr, 30, _sharded(world, 30))
        out["err30"] = None
    except BaseException as exc:
        out["err30"] = _error(exc)
    out["steps_after_30"] = [i.step for i in mgr.checkpoints()]
    t0 = time.monotonic()
    try:
        save_dcp(mgr, 40, _sharded(world, 40))
        out["err40"] = None
    except BaseException as exc:
        out["err40"] = _error(exc)
    out["err40_s"] = time.monotonic() - t0
    return out


def w_load_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """Reshard into 2 ranks: newest, an explicit older step, then a corrupted shard."""
    mgr = CheckpointManager(root, timeout_s=10)
    out: dict[str, Any] = {"pending_after_open": os.listdir(os.path.join(root, PENDING_DIR))}
    out["steps"] = [i.step for i in mgr.checkpoints()]
    sd = _sharded(world, None)
    info = load_dcp(mgr, sd)
    out["latest"] = info.step if info else None
    out["latest_ok"] = _matches(sd, 20)
    out["local_rows"] = tuple(sd["model"]["w"].to_local().shape)
    sd10 = _sharded(world, None)
    out["ten"] = load_dcp(mgr, sd10, step=10).step  # type: ignore[union-attr]
    out["ten_ok"] = _matches(sd10, 10)
    if rank == 0:
        # Same size, one flipped byte: only a checksum can tell.
        shard = os.path.join(root, "checkpoint-20", "__1_0.distcp")
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    sd_fallback = _sharded(world, None)
    out["fallback"] = load_dcp(mgr, sd_fallback).step  # type: ignore[union-attr]
    out["fallback_ok"] = _matches(sd_fallback, 10)
    try:
        load_dcp(mgr, _sharded(world, None), step=20)
        out["corrupt_err"] = None
    except BaseException as exc:
        out["corrupt_err"] = _error(exc)
    mgr.close()
    return out


def w_coordinator_dies_after_dcp(rank: int, world: int, root: str) -> dict[str, Any]:
    mgr = CheckpointManager(root, timeout_s=4)
    save_dcp(mgr, 10, _sharded(world, 10))
    try:
        save_dcp(mgr, 20, _sharded(world, 20))
        return {"err": None}
    except BaseException as exc:
        return {"err": _error(exc)}


class _Optim:
    """A Stateful whose state_dict raises on ``bad_rank`` (a bug in its state)."""

    def __init__(self, rank: int, bad_rank: int) -> None:
        self.rank, self.bad_rank = rank, bad_rank

    def state_dict(self) -> dict[str, Any]:
        if self.rank == self.bad_rank:
            raise RuntimeError(f"optimizer state_dict failed on rank {self.rank}")
        return {"lr": torch.tensor(0.1)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:  # pragma: no cover - unused
        pass


def w_one_rank_fails_before_dcp(rank: int, world: int, root: str) -> dict[str, Any]:
    """Step 2: rank 1's Stateful raises; step 3: rank 1 passes step 4. Each must fail
    on every rank at once with one error, before DCP's collective (where the others
    waited for the process group's timeout); step 5 then commits."""
    mgr = CheckpointManager(root, timeout_s=20)
    save_dcp(mgr, 1, {"w": torch.ones(4) * rank})
    out: dict[str, Any] = {}
    for step, sd in (
        (2, {"w": torch.ones(4), "optim": _Optim(rank, 1)}),
        (4 if rank == 1 else 3, {"w": torch.ones(4)}),
    ):
        t0 = time.monotonic()
        try:
            save_dcp(mgr, step, sd)
            out[f"err{step}"] = None
        except BaseException as exc:
            out[f"err{min(step, 3)}"] = {**_error(exc), "seconds": time.monotonic() - t0}
    save_dcp(mgr, 5, {"w": torch.ones(4) * rank})
    out["steps"] = [i.step for i in mgr.checkpoints()]
    mgr.close()
    return out


# ---------------------------------------------------------------------- multi-process
def _job_with_a_killed_rank(
    tmp_path: Path, fn: Callable[..., Any], world: int, killed: int, *args: Any, **options: Any
) -> tuple[str, list[Any]]:
    """Run ``fn(rank, world, ROOT, *args)`` on ``world`` ranks (``options``: those of
    ``run_ranks``, faults among them), ROOT being ``tmp_path/ckpt``: rank ``killed`` must
    die by SIGKILL, every other rank return. ROOT and the others' values, in rank
    order."""
    root = str(tmp_path / "ckpt")
    results = run_ranks(fn, world, root, *args, tmp_dir=str(tmp_path), **options)
    assert results[killed].killed, results[killed].error_text
    return root, ok_values([r for r in results if r.rank != killed])


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.timeout(180)
def test_four_rank_sharded_save_reshards_into_two_and_failures_commit_nothing(tmp_path):
    # Rank 2 is killed by SIGKILL in step 40; the others return.
    faults = "mid_write@1=raise:30,mid_write@2=kill:40"
    root, values = _job_with_a_killed_rank(
        tmp_path, w_save_four, 4, 2, faults=faults, pg_timeout_s=3, timeout_s=90
    )
    # Every rank got the same CheckpointInfo for every committed step.
    assert all(v["infos"] == values[0]["infos"] for v in values)
    assert [i[0] for i in values[0]["infos"]] == [5, 10, 20]

    # Step 30: DCP raised its BaseException-derived CheckpointException on every rank;
    # every rank got the same DistributedCheckpointError (an Exception) instead.
    errs30 = [v["err30"] for v in values]
    assert all(e is not None and e["type"] == "DistributedCheckpointError" for e in errs30)
    assert all(e["is_exception"] and e["cause"] == "CheckpointException" for e in errs30)
    assert len({e["message"] for e in errs30}) == 1
    assert "injected fault at mid_write on rank 1" in errs30[0]["message"]
    # ...and nothing was committed: the job carried on with 10 and 20 (5 rotated).
    assert all(v["steps_after_30"] == [10, 20] for v in values)

    # Step 40: a rank died mid-save. Every survivor raised a CheckpointError (bounded
    # by the timeouts), naming rank 2.
    # Bounded: the process-group timeout plus two coordination timeouts (3 + 4 + 4 s).
    assert all(v["err40_s"] < 30 for v in values), [v["err40_s"] for v in values]
    for v in values:
        e = v["err40"]
        assert e is not None and e["is_checkpoint_error"] and e["is_exception"], e
        assert 2 in e["failed_ranks"] or "rank(s) [2]" in e["message"], e

    # Nothing of 30 or 40 is discoverable (the surviving coordinator discarded them).
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [10, 20]
    assert reader.latest().step == 20
    assert os.listdir(os.path.join(root, PENDING_DIR)) == []
    assert not os.path.exists(os.path.join(root, "checkpoint-40"))

    # Files and manifest of a committed DCP checkpoint.
    files = sorted(os.listdir(os.path.join(root, "checkpoint-20")))
    assert files == [".metadata", *[f"__{r}_0.distcp" for r in range(4)], MANIFEST_NAME]
    manifest = json.loads(Path(root, "checkpoint-20", MANIFEST_NAME).read_text())
    assert DCP_METADATA_KEY in manifest["metadata"]
    assert {f["path"] for f in manifest["files"]} == set(files) - {MANIFEST_NAME}
    for step in (10, 20):
        reader.verify(step)

    # A 2-rank job loads the 4-rank checkpoints (DCP resharding), values identical.
    loaded = run_ranks(w_load_two, 2, root, tmp_dir=str(tmp_path), timeout_s=90)
    for v in ok_values(loaded):
        assert v["pending_after_open"] == []  # the killed save was swept at start-up
        assert v["steps"] == [10, 20]
        assert v["latest"] == 20 and v["latest_ok"]
        assert v["local_rows"] == (ROWS // 2, COLS)  # half the rows: a 2-way shard
        assert v["ten"] == 10 and v["ten_ok"]
        # A flipped byte in one shard of 20: the newest that verifies is 10.
        assert v["fallback"] == 10 and v["fallback_ok"]
        e = v["corrupt_err"]
        assert e is not None and e["type"] == "CorruptCheckpointError", e
        assert "__1_0.distcp" in e["message"] and "checksum" in e["message"]


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.timeout(120)
def test_coordinator_killed_after_dcp_finished_leaves_nothing_discoverable(tmp_path):
    # After DCP wrote every shard and its .metadata, before our manifest.
    faults = "after_write@0=kill:20"
    root, (survivor,) = _job_with_a_killed_rank(
        tmp_path, w_coordinator_dies_after_dcp, 2, 0, faults=faults, timeout_s=60
    )
    err = survivor["err"]
    assert err is not None and err["type"] == "CoordinationTimeoutError", err
    assert err["missing_ranks"] == [0], err  # the coordinator that died is named
    reader = CheckpointManager(root, read_only=True)
    assert reader.latest().step == 10
    (pending,) = [p for p in os.listdir(os.path.join(root, PENDING_DIR)) if "checkpoint-20" in p]
    pending_dir = os.path.join(root, PENDING_DIR, pending)
    # DCP alone would take this directory for a checkpoint: it is complete by DCP's rule.
    assert ".metadata" in os.listdir(pending_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = dcp.FileSystemReader(pending_dir).read_metadata()
    assert "model.w" in meta.state_dict_metadata


# ---------------------------------------------------------------------- one process
def _plain(step: int) -> dict[str, Any]:
    full = _full(step)
    return {"model": {"w": full["w"], "emb": full["emb"]}, "step": step}


@pytest.mark.timeout(60)
def test_single_process_round_trip_and_errors(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, timeout_s=10)
    assert load_dcp(mgr, _plain(0), missing_ok=True) is None
    with pytest.raises(CheckpointNotFoundError):
        load_dcp(mgr, _plain(0))
    info = save_dcp(mgr, 3, _plain(3), metrics={"loss": 0.5})
    assert info.step == 3 and info.metrics == {"loss": 0.5}
    assert info.path == str(root / "checkpoint-3")
    target = {
        "model": {"w": torch.zeros(ROWS, COLS), "emb": torch.zeros(5, 8).bfloat16()},
        "step": 0,
    }
    assert load_dcp(mgr, target).step == 3
    assert torch.equal(target["model"]["w"], _full(3)["w"]) and target["step"] == 3
    assert torch.equal(target["model"]["emb"], _full(3)["emb"])

    # A DCP failure (its CheckpointException is a BaseException) becomes a
    # CheckpointError that `except Exception` catches; nothing is committed or left.
    monkeypatch.setenv(FAULTS_ENV, "mid_write@0=raise:4")
    caught: BaseException | None = None
    try:
        save_dcp(mgr, 4, _plain(4))
    except Exception as exc:
        caught = exc
    assert isinstance(caught, DistributedCheckpointError), caught
    assert isinstance(caught.__cause__, CheckpointException)
    assert caught.failed_ranks == (0,) and "injected fault" in str(caught)
    monkeypatch.delenv(FAULTS_ENV)
    assert [c.step for c in mgr.checkpoints()] == [3]
    assert os.listdir(root / PENDING_DIR) == []

    # A checkpoint not written by save_dcp is refused with a clear error.
    mgr.save(5, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match="not written by save_dcp"):
        load_dcp(mgr, _plain(0), step=5)
    # ...and step=None skips it, loading the newest DCP checkpoint.
    assert load_dcp(mgr, target).step == 3
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        load_dcp(mgr, target, step=7)
    # A load into the wrong shapes fails on every rank with a CheckpointError.
    with pytest.raises(DistributedCheckpointError, match="dcp_read"):
        load_dcp(mgr, {"model": {"w": torch.zeros(3, 3), "emb": torch.zeros(5, 8)}, "step": 0})
    mgr.close()

    only_foreign = CheckpointManager(tmp_path / "other")
    only_foreign.save(1, {"x": torch.ones(2)})
    with pytest.raises(ResumeError, match="not written by save_dcp"):
        load_dcp(only_foreign, target)
    only_foreign.close()


@pytest.mark.timeout(60)
def test_truncated_shard_is_never_loaded(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root)
    save_dcp(mgr, 1, _plain(1))
    save_dcp(mgr, 2, _plain(2))
    shard = root / "checkpoint-2" / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 7)
    target = {
        "model": {"w": torch.zeros(ROWS, COLS), "emb": torch.zeros(5, 8).bfloat16()},
        "step": 0,
    }
    # Step 2 no longer validates (size), so the newest loadable is 1.
    assert load_dcp(mgr, target).step == 1
    assert torch.equal(target["model"]["w"], _full(1)["w"])
    with pytest.raises(CheckpointNotFoundError):
        load_dcp(mgr, target, step=2)
    mgr.close()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.timeout(60)
def test_a_newest_checkpoint_load_dcp_skipped_for_its_checksums_is_replaced_and_never_counted(
    tmp_path,
):
    """As after restore(): load_dcp() skipped step 2 (a flipped byte) and loaded step 1;
    the job saves step 2 again (it replaced the corrupt copy, not CheckpointExistsError at
    every restart), and KeepLast(2) neither counts nor deletes the corrupt one (it
    deleted step 1, the checkpoint just loaded, and kept the corrupt one)."""
    target = lambda: {"model": {"w": torch.zeros(ROWS, COLS)}, "step": 0}  # noqa: E731
    for root in (tmp_path / "again", tmp_path / "kept"):
        mgr = CheckpointManager(root, retention=KeepLast(2))
        save_dcp(mgr, 1, _plain(1))
        save_dcp(mgr, 2, _plain(2))
        mgr.close()
        _flip_a_byte(root / "checkpoint-2" / "__0_0.distcp")
        mgr = CheckpointManager(root, retention=KeepLast(2))
        loaded = target()
        assert load_dcp(mgr, loaded).step == 1
        assert torch.equal(loaded["model"]["w"], _full(1)["w"])
        assert mgr.last_restored is not None and mgr.last_restored.step == 1
        if root.name == "again":
            save_dcp(mgr, 2, _plain(3))  # replaces the corrupt copy, with a warning
            mgr.wait()
            again = target()
            assert load_dcp(mgr, again).step == 2
            assert torch.equal(again["model"]["w"], _full(3)["w"])
        else:
            save_dcp(mgr, 3, _plain(3))
            mgr.wait()
            assert sorted(p.name for p in root.glob("checkpoint-*")) == [
                "checkpoint-1",
                "checkpoint-2",
                "checkpoint-3",
            ]
        mgr.close()


@pytest.mark.timeout(120)
def test_example_dcp_sharded_runs(tmp_path):
    out = run_example(tmp_path, "dcp_sharded.py", tmp_path / "ckpt", timeout_s=100)
    assert "4 ranks saved steps [100, 200, 300]" in out, out
    assert "2 ranks loaded step 300" in out, out
    assert "identical to what was saved: True" in out, out


# ---------------------------------------------------------------------- async and path-style
def _bump(sd: dict[str, Any]) -> None:
    """What training does right after an async save returns: update in place."""
    with torch.no_grad():
        for part in ("model", "optim"):
            stack = [sd[part]]
            while stack:
                node = stack.pop()
                for v in node.values():
                    if isinstance(v, dict):
                        stack.append(v)
                    elif hasattr(v, "to_local"):  # a DTensor: this rank's shard
                        v.to_local().add_(1000)
                    elif isinstance(v, torch.Tensor):
                        v.add_(1000)


def w_async_and_path(rank: int, world: int, root: str, paths: str) -> dict[str, Any]:
    """Path-style: step 7 fails inside DCP on rank 1, step 8 commits. Async: steps 10 and
    20 commit while training updates the state and runs its own collectives; step 30
    fails inside DCP on rank 1; step 40 loses rank 2 to SIGKILL in the middle of it."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    try:
        save(_sharded(world, 7), checkpoint_id=os.path.join(paths, "step-7"), step=7)
        out["err7"] = None
    except BaseException as exc:
        out["err7"] = _error(exc)
    out["path8"] = save(
        _sharded(world, 8), checkpoint_id=os.path.join(paths, "step-8"), step=8
    ).path
    try:
        save(_sharded(world, 8), checkpoint_id=os.path.join(paths, "step-8"))
        out["err8_again"] = None
    except BaseException as exc:
        out["err8_again"] = _error(exc)
    back = _sharded(world, None)
    out["load8"] = load(back, checkpoint_id=os.path.join(paths, "step-8")).step
    out["load8_ok"] = _matches(back, 8)

    mgr = CheckpointManager(root, retention=KeepLast(2), timeout_s=4)
    infos = []
    for s in (10, 20):
        sd = _sharded(world, s)
        handle = async_save_dcp(mgr, s, sd, metrics={"loss": 1.0 / s})
        # Training goes on: in-place updates (the snapshot must not see them) and the
        # training's own collectives on the default group, while the save runs.
        _bump(sd)
        for _ in range(20):
            t = torch.ones(4)
            dist.all_reduce(t)
            if not torch.equal(t, torch.full((4,), float(world))):
                raise AssertionError(f"the training's all_reduce got {t}")
        infos.append(handle.result(timeout=60))
        out[f"wait{s}"] = mgr.wait() is not None  # the same save: committed
    out["infos"] = [(i.step, i.path, i.commit_seq) for i in infos]
    for s in (10, 20):  # what was staged, not the updates made during the write
        back = _sharded(world, None)
        out[f"load{s}"] = load_dcp(mgr, back, step=s).step  # type: ignore[union-attr]
        out[f"ok{s}"] = _matches(back, s)
    handle = async_save_dcp(mgr, 30, _sharded(world, 30))
    try:
        handle.result(timeout=60)
        out["result30"] = None
    except BaseException as exc:
        out["result30"] = _error(exc)
    try:
        mgr.wait()
        out["err30"] = None
    except BaseException as exc:
        out["err30"] = _error(exc)
    out["wait30_again"] = mgr.wait()  # raised once only
    out["steps_after_30"] = [i.step for i in mgr.checkpoints()]
    t0 = time.monotonic()
    async_save_dcp(mgr, 40, _sharded(world, 40))
    try:
        mgr.wait()
        out["err40"] = None
    except BaseException as exc:
        out["err40"] = _error(exc)
    out["err40_s"] = time.monotonic() - t0
    return out


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.timeout(240)
def test_async_and_path_style_saves_commit_atomically_and_fail_on_every_rank(tmp_path):
    paths = str(tmp_path / "paths")
    faults = "mid_write@1=raise:7,mid_write@1=raise:30,mid_write@2=kill:40"
    root, values = _job_with_a_killed_rank(
        tmp_path, w_async_and_path, 3, 2, paths, faults=faults, pg_timeout_s=3, timeout_s=150
    )

    # Path-style: a DCP failure on rank 1 reached every rank, same error, nothing at
    # PATH; the next save committed; a second save onto it is refused on every rank.
    for v in values:
        e = v["err7"]
        # DCP itself shares rank 1's failure with every rank (as for save_dcp).
        assert e["type"] == "DistributedCheckpointError" and 1 in e["failed_ranks"], e
        assert "injected fault at mid_write on rank 1" in e["message"]
        assert v["path8"] == os.path.join(paths, "step-8")
        assert v["err8_again"]["type"] == "CheckpointExistsError", v["err8_again"]
        assert v["load8"] == 8 and v["load8_ok"]
    assert len({v["err7"]["message"] for v in values}) == 1
    assert sorted(os.listdir(paths)) == ["step-8"]  # no step-7, no pending left
    assert MANIFEST_NAME in os.listdir(os.path.join(paths, "step-8"))

    # Async: identical results on every rank; each step holds the state as it was when
    # async_save_dcp returned, not the updates made while it was written (loaded back
    # by the same job).
    assert all(v["infos"] == values[0]["infos"] for v in values)
    assert [i[0] for i in values[0]["infos"]] == [10, 20]
    assert all(v["wait10"] and v["wait20"] for v in values)
    for v in values:
        assert (v["load10"], v["load20"]) == (10, 20) and v["ok10"] and v["ok20"], v
    # Step 30: DCP failed on rank 1; the handle and then mgr.wait() (once) raised the
    # same DistributedCheckpointError on every rank, with rank 1's error and DCP's.
    for v in values:
        for key in ("result30", "err30"):
            e = v[key]
            assert e["type"] == "DistributedCheckpointError" and 1 in e["failed_ranks"], e
            assert "'dcp_write'" in e["message"], e
            assert "injected fault at mid_write on rank 1" in e["message"], e
            assert "CheckpointException" in e["message"]
        assert v["wait30_again"] is None
        assert v["steps_after_30"] == [10, 20]
    assert len({v["err30"]["message"] for v in values}) == 1
    # Step 40: rank 2 was SIGKILLed mid-write; every survivor's wait() raised a
    # CheckpointError naming it, bounded by the timeouts (3 s group + 4 s exchange).
    for v in values:
        e = v["err40"]
        assert e is not None and e["is_checkpoint_error"] and e["is_exception"], e
        assert 2 in e["failed_ranks"] + e["missing_ranks"] or "[2]" in e["message"], e
        assert v["err40_s"] < 30, v["err40_s"]

    # Nothing of 30 or 40 is discoverable; the pending directories were discarded.
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [10, 20]
    assert os.listdir(os.path.join(root, PENDING_DIR)) == []
    for step in (10, 20):
        reader.verify(step)
        manifest = json.loads(Path(root, f"checkpoint-{step}", MANIFEST_NAME).read_text())
        assert DCP_METADATA_KEY in manifest["metadata"]


@pytest.mark.timeout(60)
def test_single_process_async_and_path_style(tmp_path, monkeypatch, caplog):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, timeout_s=10)
    sd = _plain(3)
    handle = async_save_dcp(mgr, 3, sd, metrics={"loss": 0.5})
    sd["model"]["w"].add_(1000)  # after the call: not in the checkpoint
    info = handle.result(timeout=30)
    assert mgr.wait() == info and info.step == 3 and info.metrics == {"loss": 0.5}
    target = {
        "model": {"w": torch.zeros(ROWS, COLS), "emb": torch.zeros(5, 8).bfloat16()},
        "step": 0,
    }
    assert load_dcp(mgr, target).step == 3
    assert torch.equal(target["model"]["w"], _full(3)["w"]) and target["step"] == 3

    # A DCP failure in the background: an Exception on handle.result() and once on the
    # next call of the manager, naming rank 0 and DCP's error; nothing left behind.
    monkeypatch.setenv(FAULTS_ENV, "mid_write@0=raise:4")
    handle = async_save_dcp(mgr, 4, _plain(4))
    with pytest.raises(DistributedCheckpointError) as err:
        handle.result(timeout=30)
    assert err.value.failed_ranks == (0,) and "injected fault" in str(err.value)
    assert isinstance(err.value.__cause__, CheckpointException)
    with pytest.raises(DistributedCheckpointError):
        async_save_dcp(mgr, 5, _plain(5))  # the next save raises it, once
    monkeypatch.delenv(FAULTS_ENV)
    assert mgr.wait() is None
    assert [c.step for c in mgr.checkpoints()] == [3]
    assert os.listdir(root / PENDING_DIR) == []
    assert async_save_dcp(mgr, 5, _plain(5)).result(timeout=30).step == 5

    # A failed load says it was a load: not the save's "No partial checkpoint is
    # visible", and no doubled full stop.
    with pytest.raises(DistributedCheckpointError) as err:
        load_dcp(mgr, {"model": {"w": torch.zeros(3, 3), "emb": torch.zeros(5, 8)}, "step": 0})
    message = str(err.value)
    assert message.startswith("loading checkpoint step 5 failed on 1 rank(s)"), message
    assert "No partial checkpoint" not in message and ".." not in message
    assert err.value.operation == "load"
    # A rank's message that ends a sentence is not followed by a second full stop.
    ends = DistributedCheckpointError([RankFailure(1, "dcp_read", "E", "Bad shard.")], step=5)
    assert "Bad shard. No partial" in str(ends) and ".." not in str(ends), str(ends)

    # A background failure not raised yet: close() raises it, and releases the run
    # lock all the same (the next manager of ROOT does not have to take it over).
    monkeypatch.setenv(FAULTS_ENV, "mid_write@0=raise:6")
    async_save_dcp(mgr, 6, _plain(6))
    with pytest.raises(DistributedCheckpointError, match="injected fault"):
        mgr.close()
    monkeypatch.delenv(FAULTS_ENV)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        CheckpointManager(root, timeout_s=10).close()
    assert "took over the run lock" not in caplog.text

    # Path-style, one process.
    path = tmp_path / "plain" / "step-9"
    assert save(_plain(9), checkpoint_id=path, step=9).path == str(path)
    back = {"model": {"w": torch.zeros(ROWS, COLS), "emb": torch.zeros(5, 8).bfloat16()}}
    back["step"] = 0
    assert load(back, checkpoint_id=str(path)).step == 9
    assert torch.equal(back["model"]["w"], _full(9)["w"]) and back["step"] == 9
    with pytest.raises(CheckpointExistsError):
        save(_plain(9), checkpoint_id=path)
    with pytest.raises(CheckpointNotFoundError):
        load(back, checkpoint_id=tmp_path / "plain" / "nothing")
    # Torn: a truncated shard is refused before DCP reads anything.
    shard = path / "__0_0.distcp"
    good = shard.read_bytes()
    shard.write_bytes(good[:-7])
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp"):
        load(back, checkpoint_id=path)
    shard.write_bytes(good)
    # A stock dcp.save directory (DCP calls it complete) has no manifest: refused.
    stock = tmp_path / "plain" / "stock"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_plain(1), checkpoint_id=str(stock))
    with pytest.raises(CorruptCheckpointError, match=r"no checkpoint\.manifest\.json"):
        load(back, checkpoint_id=stock)
    # A failure after the manifest, before the rename: PATH stays absent, and the
    # pending directory is discarded.
    monkeypatch.setenv(FAULTS_ENV, "after_manifest@0=raise:10")
    with pytest.raises(DistributedCheckpointError, match="'commit'"):
        save(_plain(10), checkpoint_id=tmp_path / "plain" / "step-10", step=10)
    monkeypatch.delenv(FAULTS_ENV)
    assert sorted(os.listdir(tmp_path / "plain")) == ["step-9", "stock"]


@pytest.mark.timeout(60)
def test_path_style_checkpoints_named_as_a_roots_are_the_run_that_opens_it(tmp_path, caplog):
    # A job that saved path-style (save(..., checkpoint_id="ckpts/checkpoint-N")) and
    # then moved to a manager of ckpts started from scratch: the manifests recorded
    # step 0 unless step= was passed ("corrupt: manifest says step 0") and no run
    # ("foreign: belongs to run ''").
    root = tmp_path / "ckpts"
    save(_plain(5), checkpoint_id=root / "checkpoint-5")  # the step comes from the name
    save(_plain(10), checkpoint_id=root / "checkpoint-10", step=10)
    with pytest.raises(ValueError, match="names step 20 but step=2"):
        save(_plain(20), checkpoint_id=root / "checkpoint-20", step=2)
    assert not (root / "checkpoint-20").exists()
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = CheckpointManager(root, retention=KeepLast(2), timeout_s=10)
    assert "record no run (steps [5, 10]" in caplog.text
    try:
        assert [c.step for c in mgr.checkpoints()] == [5, 10]
        back = {"model": {"w": torch.zeros(ROWS, COLS), "emb": torch.zeros(5, 8).bfloat16()}}
        back["step"] = 0
        assert load_dcp(mgr, back).step == 10
        assert torch.equal(back["model"]["w"], _full(10)["w"]) and back["step"] == 10
        save_dcp(mgr, 15, _plain(15))
        assert [c.step for c in mgr.checkpoints()] == [10, 15]  # retention took step 5
        run = mgr.run_id
    finally:
        mgr.close()
    # Saved path-style into the root of a run: a checkpoint of that run.
    assert save(_plain(20), checkpoint_id=root / "checkpoint-20").run_id == run
    with CheckpointManager(root, timeout_s=10) as again:
        assert again.run_id == run
        assert [c.step for c in again.checkpoints()] == [10, 15, 20]
        assert again.latest().step == 20


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_rank_that_fails_before_dcp_fails_every_rank_at_once(tmp_path):
    root = str(tmp_path / "ckpt")
    values = ok_values(
        run_ranks(w_one_rank_fails_before_dcp, 3, root, tmp_dir=str(tmp_path), timeout_s=90)
    )
    errs2 = [v["err2"] for v in values]
    assert all(e is not None and e["type"] == "DistributedCheckpointError" for e in errs2), errs2
    assert all(e["failed_ranks"] == [1] for e in errs2), errs2
    assert len({e["message"] for e in errs2}) == 1
    assert "optimizer state_dict failed on rank 1" in errs2[0]["message"]
    errs3 = [v["err3"] for v in values]
    assert all(e is not None and e["type"] == "CommitError" for e in errs3), errs3
    assert "different steps" in errs3[0]["message"]
    # At once: not after timeout_s (20 s), nor DCP's process-group timeout.
    assert all(e["seconds"] < 10 for e in errs2 + errs3), [e["seconds"] for e in errs2 + errs3]
    assert all(v["steps"] == [1, 5] for v in values)
    assert os.listdir(os.path.join(root, PENDING_DIR)) == []


@pytest.mark.timeout(60)
def test_save_dcp_says_what_is_wrong_with_a_state_dict_or_thread_count(tmp_path):
    # A list: a bare AttributeError ('list' object has no attribute 'items');
    # thread_count=0: a DistributedCheckpointError wrapping "min() arg is an empty sequence".
    with CheckpointManager(tmp_path / "ckpt", timeout_s=10) as mgr:
        with pytest.raises(TypeError, match="state_dict must be a dict"):
            save_dcp(mgr, 1, [1, 2])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="thread_count must be an int of at least 1"):
            save_dcp(mgr, 1, _plain(1), thread_count=0)
        assert mgr.checkpoints() == []
        save_dcp(mgr, 1, _plain(1))
        assert [c.step for c in mgr.checkpoints()] == [1]


def test_a_checkpoint_dcp_wrote_in_place_loads(tmp_path):
    # On an s3fs-fuse mount (the marker strategy: files in checkpoint-<step>/attempt-
    # <token>/) save_dcp committed a checkpoint load_dcp read from checkpoint-<step>/,
    # where no .metadata is: it could never be loaded, and resuming stopped there.
    with CheckpointManager(tmp_path, strategy="marker") as mgr:
        saved = save_dcp(mgr, 5, {"w": torch.arange(4.0)})
        assert os.path.isfile(os.path.join(saved.files_path, ".metadata"))
        assert [i.files_path for i in mgr.checkpoints()] == [saved.files_path]
        state = {"w": torch.zeros(4)}
        assert load_dcp(mgr, state).step == 5
        assert torch.equal(state["w"], torch.arange(4.0))


class _Planted:
    """A value whose unpickling creates the file named: what a hostile checkpoint
    would make run instead."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.path),))


def test_loads_refuse_pickles_that_name_other_code_unless_allow_pickle(tmp_path):
    # The manifest's checksums prove the bytes are the ones saved, not that they are
    # safe: DCP unpickles .metadata whole and loads non-tensor values with
    # weights_only=False. A checkpoint from elsewhere ran code on load_dcp.
    ran = tmp_path / "code-ran"
    with CheckpointManager(tmp_path / "ckpt", timeout_s=10) as mgr:
        save_dcp(mgr, 1, {"w": torch.arange(4.0), "obj": _Planted(str(ran)), "n": 7})
        ran.unlink(missing_ok=True)  # (were the save to run it); the load is what is checked
        target: dict[str, Any] = {"w": torch.zeros(4), "obj": None, "n": 0}
        with pytest.raises(DistributedCheckpointError, match="allow_pickle=True"):
            load_dcp(mgr, target)
        assert not ran.exists()
        assert load_dcp(mgr, target, allow_pickle=True).step == 1  # trusted: as dcp.load
        assert ran.exists() and target["n"] == 7

    # A .metadata that names other code is refused by the reader every load uses (and
    # by adoption's completeness check), before anything runs.
    from atomic_checkpoint.integrations.dcp import _SafeReader, stock_checkpoint_problem

    ran.unlink()
    stock = tmp_path / "stock"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(stock), no_dist=True)
    (stock / ".metadata").write_bytes(pickle.dumps(_Planted(str(ran))))
    with pytest.raises(pickle.UnpicklingError, match="not part of DCP's metadata"):
        _SafeReader(str(stock)).read_metadata()
    assert "not part of DCP's metadata" in (stock_checkpoint_problem(stock) or "")
    assert not ran.exists()


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_a_path_style_save_killed_mid_write_is_removed_once_its_name_is_committed(tmp_path):
    # A path-style save SIGKILLed mid-write leaves its pending directory beside PATH. It
    # can never commit once PATH exists (a path-style save never replaces), but nothing
    # removed it: every crash left a hidden directory of shards for good.
    paths = tmp_path / "paths"
    code = (
        "import sys, torch\n"
        "from atomic_checkpoint.integrations.dcp import save\n"
        "save({'model': {'w': torch.arange(4096.0)}}, checkpoint_id=sys.argv[1])\n"
    )
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo)])}
    killed = subprocess.run(
        [sys.executable, "-c", code, paths / "step-5"],
        env={**env, FAULTS_ENV: "mid_write@*=kill"},
        timeout=90,
    )
    assert killed.returncode == -signal.SIGKILL
    (leftover,) = os.listdir(paths)
    assert leftover.startswith(".step-5.") and leftover.endswith(".pending")

    save(_plain(4), checkpoint_id=paths / "step-4", step=4)  # another name: kept (may be live)
    assert sorted(os.listdir(paths)) == sorted([leftover, "step-4"])
    # `list` called it "foreign: not checkpoints, left alone".
    rows = {e["name"]: e for e in run_json("list", paths)["entries"]}
    assert rows[leftover]["status"] == "pending", rows
    assert "a save of step-5 in progress, or killed before its rename" in rows[leftover]["problem"]
    # One whose name exists can never commit: `clean` removes it (nothing else does).
    doomed = paths / ".step-4.0123456789abcdef.pending"
    doomed.mkdir()
    (doomed / "__0_0.distcp").write_bytes(b"x" * 100)
    cleaned = run_json("clean", paths)
    assert [r["name"] for r in cleaned["removed"]] == [doomed.name], cleaned
    assert sorted(os.listdir(paths)) == sorted([leftover, "step-4"])
    save(_plain(5), checkpoint_id=paths / "step-5", step=5)  # the restart saves step-5 again
    assert sorted(os.listdir(paths)) == ["step-4", "step-5"]
    back = _plain(0)
    assert load(back, checkpoint_id=paths / "step-5").step == 5


def w_save_dcp_on_node_local_disks(rank: int, world: int, base: str) -> dict[str, Any]:
    """Two "nodes" of one rank each, each with its own ROOT: both DCP saves, then what
    is on each node's disk."""
    from atomic_checkpoint.domains import HOST_ENV

    os.environ[HOST_ENV] = f"node{rank}"
    root = os.path.join(base, f"node{rank}")
    out: dict[str, Any] = {}
    with CheckpointManager(root, timeout_s=30) as mgr:
        for name, save in (("sync", save_dcp), ("async", async_save_dcp)):
            try:
                done = save(mgr, 1, _plain(1))
                out[name] = "saved" if name == "sync" else done.result().step
            except Exception as exc:
                out[name] = _error(exc)
        out["on_disk"] = sorted(os.listdir(root))
    return out


def test_save_dcp_refuses_node_local_disks_before_writing(tmp_path):
    # DCP's coordinator writes the global .metadata alone: each node committed its
    # copy and `verify` said ok, but no copy could ever be loaded.
    base = str(tmp_path)
    v = ok_values(run_ranks(w_save_dcp_on_node_local_disks, 2, base, tmp_dir=base, timeout_s=90))
    for x in v:
        for name in ("sync", "async"):
            assert x[name]["type"] == "CheckpointError", x
            assert "not shared by all ranks" in x[name]["message"], x
        assert not any(n.startswith("checkpoint-") for n in x["on_disk"]), x
