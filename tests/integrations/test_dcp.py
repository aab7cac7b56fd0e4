"""torch.distributed.checkpoint inside our commit: real gloo jobs, real DTensor sharding,
real SIGKILLs (tests/dist/launcher.run_ranks forks real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from atomic_checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    DistributedCheckpointError,
    KeepLast,
    ResumeError,
)
from atomic_checkpoint._faults import ENV as FAULTS_ENV
from atomic_checkpoint.integrations.dcp import DCP_METADATA_KEY, load_dcp, save_dcp
from atomic_checkpoint.layout import MANIFEST_NAME, PENDING_DIR
from tests.dist.launcher import run_ranks

REPO = Path(__file__).resolve().parents[2]
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


def _ok(results):
    for r in results:
        assert r.ok, f"rank {r.rank} exit {r.exitcode}: {r.error_text}"


# ---------------------------------------------------------------------- multi-process
@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.timeout(180)
def test_four_rank_sharded_save_reshards_into_two_and_failures_commit_nothing(tmp_path):
    root = str(tmp_path / "ckpt")
    faults = {FAULTS_ENV: "mid_write@1=raise:30,mid_write@2=kill:40"}
    saved = run_ranks(
        w_save_four, 4, root, tmp_dir=str(tmp_path), env=faults, pg_timeout_s=3, timeout_s=90
    )
    # Rank 2 was killed by SIGKILL in step 40; the others returned.
    assert saved[2].killed, saved[2].error_text
    for r in (saved[0], saved[1], saved[3]):
        assert r.ok, f"rank {r.rank}: {r.error_text}"
    values = [saved[r].value for r in (0, 1, 3)]
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
    _ok(loaded)
    for v in (r.value for r in loaded):
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
    root = str(tmp_path / "ckpt")
    # After DCP wrote every shard and its .metadata, before our manifest.
    faults = {FAULTS_ENV: "after_write@0=kill:20"}
    results = run_ranks(
        w_coordinator_dies_after_dcp, 2, root, tmp_dir=str(tmp_path), env=faults, timeout_s=60
    )
    assert results[0].killed, results[0].error_text
    assert results[1].ok, results[1].error_text
    err = results[1].value["err"]
    assert err is not None and err["type"] == "CoordinationTimeoutError", err
    assert "[0]" in err["message"]
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


@pytest.mark.timeout(120)
def test_example_dcp_sharded_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "dcp_sharded.py"), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "4 ranks saved steps [100, 200, 300]" in out, out
    assert "2 ranks loaded step 300" in out, out
    assert "identical to what was saved: True" in out, out
