"""Continuing a stock ``torch.distributed.checkpoint`` run with the DCP integration:
DCP's completeness rule, ``load_dcp(..., adopt_existing=True)``, ``adopt(ROOT,
framework="dcp")`` and the path-style ``load(..., adopt=True)``. The stock run is a real
2-rank gloo job (tests/dist/launcher.run_ranks) SIGKILLed in the middle of a save."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from atomic_checkpoint import CheckpointError, CheckpointManager, CorruptCheckpointError, adopt
from atomic_checkpoint.integrations.dcp import (
    load,
    load_dcp,
    save_dcp,
    stock_checkpoint_problem,
)
from atomic_checkpoint.layout import MANIFEST_NAME
from tests.dist.launcher import ok_values, run_ranks
from tests.helpers import library_warnings
from tests.integrations.test_dcp import COLS, ROWS, _error, _full, _matches, _plain, _sharded


def _stock_save(state: dict[str, Any], path: Path) -> None:
    """A plain ``dcp.save`` in one process (DCP warns that no process group exists)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path))


def _target() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(ROWS, COLS), "emb": torch.zeros(5, 8).bfloat16()},
        "step": 0,
    }


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` but our manifests and run files: path -> sha256."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if name == MANIFEST_NAME or rel.startswith(".atomic-checkpoint"):
                continue
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# ---------------------------------------------------------------------- rank workers
def w_stock_run(rank: int, world: int, root: str) -> None:
    """A stock DCP run: ``dcp.save(sd, checkpoint_id=ROOT/checkpoint-<step>)`` for steps
    1, 2, 3. In step 3, rank 0 is SIGKILLed in ``FileSystemWriter.finish``: every rank's
    data file is written, ``.metadata`` (which DCP writes last) is not."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    stock_finish = FileSystemWriter.finish

    def finish(self: Any, metadata: Any, results: Any) -> None:
        if os.path.basename(os.fspath(self.path)) == "checkpoint-3":
            os.kill(os.getpid(), signal.SIGKILL)
        stock_finish(self, metadata, results)

    FileSystemWriter.finish = finish  # type: ignore[method-assign]
    for step in (1, 2, 3):
        dcp.save(_sharded(world, step), checkpoint_id=os.path.join(root, f"checkpoint-{step}"))


def w_continue(rank: int, world: int, root: str) -> dict[str, Any]:
    """The run continued with the integration: adopt, resume, save the torn step again
    (the next step after the one resumed from) and the one after."""
    records = library_warnings()
    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, timeout_s=10)
    try:
        load_dcp(mgr, _sharded(world, None))
        out["plain_load"] = None
    except BaseException as exc:
        out["plain_load"] = _error(exc)
    sd = _sharded(world, None)
    info = load_dcp(mgr, sd, adopt_existing=True)
    out["resumed"] = info.step if info else None
    out["resumed_ok"] = _matches(sd, 2)
    out["steps"] = [i.step for i in mgr.checkpoints()]
    try:
        save_dcp(mgr, 3, _sharded(world, 3))
        out["save3"] = None
    except BaseException as exc:
        out["save3"] = _error(exc)
    sd3 = _sharded(world, None)
    out["step3_ok"] = load_dcp(mgr, sd3, step=3) is not None and _matches(sd3, 3)
    save_dcp(mgr, 4, _sharded(world, 4))
    sd4 = _sharded(world, None)
    out["latest"] = load_dcp(mgr, sd4).step  # type: ignore[union-attr]
    out["latest_ok"] = _matches(sd4, 4)
    mgr.close()
    out["warnings"] = records.messages
    return out


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(90)
def test_killed_stock_dcp_run_continues_from_its_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    stock = run_ranks(w_stock_run, 2, str(root), tmp_dir=str(tmp_path), timeout_s=60)
    assert stock[0].exitcode == -signal.SIGKILL, stock[0]
    torn = root / "checkpoint-3"
    assert sorted(os.listdir(torn)) == ["__0_0.distcp", "__1_0.distcp"], os.listdir(torn)
    assert (root / "checkpoint-2" / ".metadata").is_file()
    before = _snapshot(root)

    results = run_ranks(w_continue, 2, str(root), tmp_dir=str(tmp_path), timeout_s=60)
    for out in ok_values(results):
        # Without the opt-in, stock checkpoints are never loaded.
        assert out["plain_load"] is not None and out["plain_load"]["is_checkpoint_error"]
        # Resumed bit-exactly from step 2 (the newest complete), on every rank.
        assert out["resumed"] == 2 and out["resumed_ok"], out
        assert out["steps"] == [1, 2]
        # The torn step is replaced by the run's next save (as DCP's own save would
        # have), with a warning. Before, that save failed on every rank ("not a
        # committed checkpoint"), at every restart.
        assert out["save3"] is None and out["step3_ok"], out["save3"]
        assert out["latest"] == 4 and out["latest_ok"]
    # The torn one is refused with its reason (warned by the coordinator).
    assert any(
        "checkpoint-3" in w and ".metadata is missing" in w for w in results[0].value["warnings"]
    ), results[0].value["warnings"]
    assert any(
        "checkpoint-3" in w and "replaced by this save" in w for w in results[0].value["warnings"]
    ), results[0].value["warnings"]
    assert not json.loads((torn / MANIFEST_NAME).read_bytes()).get("adopted")  # ours, new
    for step in (1, 2):
        doc = json.loads((root / f"checkpoint-{step}" / MANIFEST_NAME).read_bytes())
        assert doc["adopted"] is True and doc["metadata"]["adoption"]["framework"] == "dcp"
    # Nothing stock was modified but the torn step (only manifests were added beside
    # its files).
    after = _snapshot(root)
    new = ("checkpoint-3/", "checkpoint-4/")
    assert {k: v for k, v in after.items() if not k.startswith(new)} == {
        k: v for k, v in before.items() if not k.startswith("checkpoint-3/")
    }


@pytest.mark.timeout(60)
def test_dcp_completeness_rule_refuses_torn_directories(tmp_path):
    good = tmp_path / "checkpoint-1"
    _stock_save(_plain(1), good)
    assert stock_checkpoint_problem(good) is None

    def variant(name: str) -> Path:
        path = tmp_path / name
        shutil.copytree(good, path)
        return path

    no_meta = variant("no-meta")
    (no_meta / ".metadata").unlink()
    assert ".metadata is missing" in (stock_checkpoint_problem(no_meta) or "")
    short = variant("short")
    shard = short / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 5)
    assert "truncated data file(s): __0_0.distcp" in (stock_checkpoint_problem(short) or "")
    gone = variant("gone")
    (gone / "__0_0.distcp").unlink()
    assert "__0_0.distcp is missing" in (stock_checkpoint_problem(gone) or "")
    garbage = variant("garbage")
    meta = garbage / ".metadata"
    meta.write_bytes(meta.read_bytes()[:20])
    assert "cannot be read by DCP" in (stock_checkpoint_problem(garbage) or "")


@pytest.mark.timeout(60)
def test_adopt_framework_dcp_then_plain_load(tmp_path):
    root = tmp_path / "run"
    for step in (1, 2):
        _stock_save(_plain(step), root / f"checkpoint-{step}")
    (root / "checkpoint-2" / ".metadata").unlink()  # torn
    # ``auto`` never applies DCP's rule (the Trainer's names): nothing adopted.
    assert adopt(root, dry_run=True).adopted == []
    # A fresh process: the CLI finds the rule through the integration module.
    proc = subprocess.run(
        [sys.executable, "-m", "atomic_checkpoint", "adopt", str(root), "--framework", "dcp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr  # one refused
    assert "adopted checkpoint-1 (dcp)" in proc.stdout, proc.stdout
    assert "REFUSED checkpoint-2: .metadata is missing" in proc.stdout, proc.stdout
    mgr = CheckpointManager(root)
    target = _target()
    assert load_dcp(mgr, target).step == 1
    assert torch.equal(target["model"]["w"], _full(1)["w"]) and target["step"] == 1
    mgr.close()


@pytest.mark.timeout(60)
def test_path_style_load_adopts_a_complete_stock_directory_only(tmp_path):
    path = tmp_path / "ckpts" / "step-7"
    _stock_save(_plain(7), path)
    before = _snapshot(path)
    with pytest.raises(CorruptCheckpointError, match="adopt=True"):
        load(_target(), checkpoint_id=path)
    target = _target()
    info = load(target, checkpoint_id=path, adopt=True)
    assert info.step == 7 and torch.equal(target["model"]["w"], _full(7)["w"])
    assert torch.equal(target["model"]["emb"], _full(7)["emb"]) and target["step"] == 7
    assert json.loads((path / MANIFEST_NAME).read_bytes())["adopted"] is True
    assert _snapshot(path) == before
    # Recorded: it now loads without the opt-in, verified against its manifest.
    assert load(_target(), checkpoint_id=path).step == 7

    torn = tmp_path / "ckpts" / "step-8"
    _stock_save(_plain(8), torn)
    shard = torn / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match="truncated data file"):
        load(_target(), checkpoint_id=torn, adopt=True)
    assert not (torn / MANIFEST_NAME).exists()
    with pytest.raises(CheckpointError):
        load(_target(), checkpoint_id=tmp_path / "ckpts" / "step-9", adopt=True)


@pytest.mark.timeout(60)
def test_a_root_of_stock_dcp_checkpoints_is_not_a_first_run(tmp_path):
    """``load_dcp(mgr, sd, missing_ok=True)``, the usual first line of a training script,
    on a root that holds only stock ``dcp.save`` checkpoints: not "nothing to load"
    (training from scratch, then a save colliding with a stock folder), but a
    ``ResumeError`` naming them and how to adopt them; nothing is written."""
    from atomic_checkpoint import ResumeError

    root = tmp_path / "run"
    for step in (1, 2):
        _stock_save(_plain(step), root / f"checkpoint-{step}")
    before = _snapshot(root)
    mgr = CheckpointManager(root)
    try:
        for missing_ok in (True, False):
            with pytest.raises(ResumeError) as caught:
                load_dcp(mgr, _target(), missing_ok=missing_ok)
            message = str(caught.value)
            assert "checkpoint-1, checkpoint-2" in message
            assert "adopt_existing=True" in message and "--framework dcp" in message
        assert _snapshot(root) == before
        target = _target()
        assert load_dcp(mgr, target, adopt_existing=True).step == 2  # the way out it names
        assert torch.equal(target["model"]["w"], _full(2)["w"])
    finally:
        mgr.close()
    # An empty root is a first run: None.
    with CheckpointManager(tmp_path / "empty") as fresh:
        assert load_dcp(fresh, _target(), missing_ok=True) is None


@pytest.mark.parametrize("call", ["save_dcp", "load_dcp"])
def test_a_path_instead_of_a_manager_is_a_type_error_that_says_what_to_pass(tmp_path, call):
    with pytest.raises(
        TypeError, match=r"expected a CheckpointManager .* CheckpointManager\(ROOT\)"
    ):
        if call == "save_dcp":
            save_dcp(str(tmp_path), 1, _plain(1))  # type: ignore[arg-type]
        else:
            load_dcp(str(tmp_path), _target())  # type: ignore[arg-type]


def test_the_adopt_hints_on_a_stock_dcp_root_lead_to_the_dcp_rule(tmp_path):
    """A stock DCP root with a torn newest save: ``auto`` (the Trainer's rule, which the
    manager's warning suggests) refuses the folders and points at ``--framework dcp``,
    not ``generic``; ``generic`` refuses DCP folders too (readable files say nothing of
    whether DCP finished one), so the torn one is never recorded as complete."""
    root = tmp_path / "run"
    for step in (1, 2):
        _stock_save(_plain(step), root / f"checkpoint-{step}")
    (root / "checkpoint-2" / ".metadata").unlink()  # torn: DCP writes .metadata last
    auto = adopt(root, dry_run=True)
    assert auto.adopted == [] and "--framework dcp" in auto.refused[1]
    generic = adopt(root, framework="generic")
    assert generic.adopted == [] and set(generic.refused) == {1, 2}
    assert all("--framework dcp" in why for why in generic.refused.values())
    assert not (root / "checkpoint-2" / MANIFEST_NAME).exists()
    dcp_rule = adopt(root, framework="dcp")
    assert dcp_rule.adopted == [1] and ".metadata is missing" in dcp_rule.refused[2]


def test_restore_of_a_dcp_checkpoint_names_load_dcp(tmp_path):
    with CheckpointManager(tmp_path / "run") as mgr:
        save_dcp(mgr, 1, _plain(1))
        with pytest.raises(CheckpointError, match=r"load it with .*load_dcp\(mgr"):
            mgr.restore()


@pytest.mark.parametrize("how", ["save_dcp", "async_save_dcp"])
def test_a_save_of_the_step_of_a_complete_stock_dcp_checkpoint_refuses_to_replace_it(tmp_path, how):
    # save_dcp moved any checkpoint-<step> without a manifest aside as "torn", so a
    # complete dcp.save checkpoint of that step (never adopted) was replaced.
    from atomic_checkpoint import CheckpointExistsError
    from atomic_checkpoint.integrations.dcp import async_save_dcp, save_dcp

    root = tmp_path / "ckpt"
    dcp.save({"w": torch.full((4,), 10.0)}, checkpoint_id=str(root / "checkpoint-10"))
    before = sorted(p.name for p in (root / "checkpoint-10").iterdir())
    mgr = CheckpointManager(root)
    with pytest.raises(CheckpointExistsError, match=r"complete checkpoint that dcp\.save"):
        if how == "save_dcp":
            save_dcp(mgr, 10, {"w": torch.full((4,), 99.0)})
        else:
            async_save_dcp(mgr, 10, {"w": torch.full((4,), 99.0)}).result()
    assert sorted(p.name for p in (root / "checkpoint-10").iterdir()) == before
    if how != "save_dcp":
        # The async save's failure is reported once more by the next call.
        with pytest.raises(CheckpointExistsError):
            mgr.close()
        return
    with mgr:
        got = {"w": torch.zeros(4)}
        dcp.load(got, checkpoint_id=str(root / "checkpoint-10"))
        assert got["w"].tolist() == [10.0] * 4
        # Asked for, it is replaced.
        save_dcp(mgr, 10, {"w": torch.full((4,), 99.0)}, overwrite=True)
        assert (root / "checkpoint-10" / MANIFEST_NAME).exists()
