"""Adopting checkpoints the stock frameworks wrote (``atomic_checkpoint.adopt`` and
``atomic-checkpoint adopt``): real Trainer and Accelerate runs without this library
(tests/integrations/scripts/stock_runs.py), torn for real, adopted on real
filesystems (and the S3 server), then resumed through ``CheckpointManager`` and the
stock frameworks."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from atomic_checkpoint import (
    CheckpointError,
    CheckpointManager,
    LockHeldError,
    ResumeError,
    adopt,
    register_framework,
)
from atomic_checkpoint.layout import MANIFEST_NAME, META_DIR
from atomic_checkpoint.storage import FsspecStorage
from tests.cli.helpers import run_cli, run_json
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
STOCK = REPO / "tests" / "integrations" / "scripts" / "stock_runs.py"


def _stock(*args: Any) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    proc = subprocess.run(
        [sys.executable, str(STOCK), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def stock_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock Trainer run: checkpoint-2 ... checkpoint-10, then save_model() files at
    the top of output_dir. Copied by each test (``_copy``), never changed."""
    out = tmp_path_factory.mktemp("stock") / "out"
    _stock("hf", out, 10)
    return out


@pytest.fixture(scope="module")
def stock_accelerate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock Accelerate project: checkpoints/checkpoint_0 ... checkpoint_2."""
    project = tmp_path_factory.mktemp("stock") / "project"
    _stock("accelerate", project, 3)
    return project


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.fixture
def out(stock_hf: Path, tmp_path: Path) -> Path:
    """This test's own copy of the stock Trainer run (``stock_hf``), to tear and adopt."""
    return _copy(stock_hf, tmp_path)


@pytest.fixture
def project(stock_accelerate: Path, tmp_path: Path) -> Path:
    """This test's own copy of the stock Accelerate project (``stock_accelerate``)."""
    return _copy(stock_accelerate, tmp_path)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime in ns)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def _tear_hf(out: Path) -> None:
    """Three ways a Trainer save is torn by a crash (or a power cut: nothing fsync'd):
    the weights cut short, trainer_state.json (written last) never written, and the
    weights never written."""
    weights = out / "checkpoint-6" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    (out / "checkpoint-8" / "trainer_state.json").unlink()
    (out / "checkpoint-10" / "model.safetensors").unlink()


# ---------------------------------------------------------------------- Trainer
@pytest.mark.timeout(180)
def test_stock_trainer_checkpoints_are_adopted_torn_ones_refused_then_resumed(
    out: Path, tmp_path: Path
) -> None:
    _tear_hf(out)
    torn_before = {s: _tree(out / f"checkpoint-{s}") for s in (6, 8, 10)}

    result = adopt(out)
    assert result.adopted == [2, 4], result
    assert sorted(result.refused) == [6, 8, 10]
    assert "model.safetensors" in result.refused[6] and "truncated" in result.refused[6]
    assert "trainer_state.json is missing" in result.refused[8]
    # It holds the Trainer's other files: it is a Trainer save that did not finish, and
    # "--framework generic" (which would adopt it torn) is not suggested.
    assert "generic" not in result.refused[8], result.refused[8]
    assert "no model weights" in result.refused[10]
    assert result.frameworks == {2: "hf", 4: "hf"}
    # Nothing written for a refused folder, not even a manifest.
    assert {s: _tree(out / f"checkpoint-{s}") for s in (6, 8, 10)} == torn_before

    manifest = json.loads((out / "checkpoint-4" / MANIFEST_NAME).read_text())
    assert manifest["adopted"] is True and manifest["state_kind"] == "files"
    assert manifest["metrics"]["eval_loss"] > 0  # the Trainer's eval at step 4
    listed = {f["path"] for f in manifest["files"]}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= listed

    # The job continues through the manager: the newest adopted checkpoint is the one
    # to resume from; its checksums verify; the torn ones are never candidates.
    mgr = CheckpointManager(out)
    try:
        assert [c.step for c in mgr.checkpoints()] == [2, 4]
        latest = mgr.latest()
        assert latest is not None and latest.step == 4 and latest.adopted
        assert mgr.verify(4).adopted
        with pytest.raises(CheckpointError, match="adopted from a framework's files"):
            mgr.restore(4)  # the Trainer's files: the Trainer loads them, from this path
        path = mgr.checkpoint_path(4)
    finally:
        mgr.close()
    # ... and the stock Trainer resumes from the path it is given: step 5 onwards.
    result_json = tmp_path / "resumed.json"
    _stock("hf-resume", tmp_path / "resumed", path, 6, result_json)
    resumed = json.loads(result_json.read_text())
    assert resumed == {"first_step": 4, "global_step": 6}


@pytest.mark.timeout(180)
def test_adopt_is_idempotent_and_a_dry_run_writes_nothing(out: Path) -> None:
    _tear_hf(out)
    before = _tree(out)
    dry = adopt(out, dry_run=True)
    assert dry.dry_run and dry.adopted == [2, 4] and sorted(dry.refused) == [6, 8, 10]
    assert _tree(out) == before and not (out / META_DIR).exists()

    first = adopt(out, [4])
    assert first.adopted == [4] and first.refused == {}
    manifest = (out / "checkpoint-4" / MANIFEST_NAME).read_bytes()
    run = json.loads((out / META_DIR / "run.json").read_text())["run_id"]
    again = adopt(out, [2, 4])
    assert again.adopted == [2] and again.already == [4] and again.run_id == run
    third = adopt(out)
    assert third.adopted == [] and third.already == [2, 4] and sorted(third.refused) == [6, 8, 10]
    assert (out / "checkpoint-4" / MANIFEST_NAME).read_bytes() == manifest
    # Asked for a step that is not there: refused, saying so.
    assert "no folder for step 12" in adopt(out, [12]).refused[12]
    # The recorded run is matched, never replaced.
    with pytest.raises(CheckpointError, match="records run"):
        adopt(out, run_id="another-run")


def test_the_adopt_advice_of_a_refused_resume_works_when_followed(out: Path) -> None:
    # The advice was "adopt them first (`atomic-checkpoint adopt ROOT --dry-run`)": a
    # dry run writes nothing, and the resume failed again.
    with pytest.raises(ResumeError, match="without a manifest") as err:
        CheckpointManager(out, resume="must")
    said = str(err.value)
    command = f"`atomic-checkpoint adopt {out}`"
    assert command in said, said
    proc = run_cli(*command.strip("`").split()[1:])  # as the message says it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with CheckpointManager(out, resume="must") as mgr:
        assert mgr.latest().step == 10


@pytest.mark.timeout(120)
def test_a_sharded_checkpoint_needs_every_shard_its_index_lists(out: Path) -> None:
    folder = out / "checkpoint-4"
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}
    index["weight_map"]["b.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors is missing" in adopt(out, [4]).refused[4]
    shutil.copy(
        folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"
    )
    assert adopt(out, [4]).adopted == [4]


@pytest.mark.parametrize("damage", ["zero_filled", "zeros_inside"])
def test_a_torch_save_file_a_crash_left_as_zeros_is_refused(out: Path, damage: str) -> None:
    # What a power cut leaves of a file never fsync'd: its size, zeros for its data
    # (all of it, or blocks inside). Adopted as complete, it failed torch.load at resume.
    path = out / "checkpoint-4" / "optimizer.pt"
    data = bytearray(path.read_bytes())
    if damage == "zero_filled":
        data = bytearray(len(data))
    else:
        data[len(data) // 3 : len(data) // 3 + 64] = bytes(64)
    path.write_bytes(bytes(data))
    refused = adopt(out, [4]).refused[4]
    assert "optimizer.pt" in refused
    assert ("starts with zero bytes" if damage == "zero_filled" else "CRC-32") in refused


@pytest.mark.timeout(120)
def test_adopt_refuses_while_a_manager_of_the_root_is_open(out: Path) -> None:
    mgr = CheckpointManager(out)
    try:
        with pytest.raises(LockHeldError, match="adopt before opening it"):
            adopt(out)
        assert not (out / "checkpoint-2" / MANIFEST_NAME).exists()
    finally:
        mgr.close()
    assert adopt(out, [2]).adopted == [2]


@pytest.mark.timeout(60)
def test_a_registered_rule_decides_for_its_names(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for step, ok in ((1, True), (2, False)):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        (root / f"checkpoint-{step}" / ("DONE" if ok else "partial")).write_text("x")
    register_framework(
        "done-file-test",
        r"^checkpoint-(?P<step>[0-9]+)$",
        lambda path: None if os.path.exists(os.path.join(path, "DONE")) else "no DONE file",
        auto=False,
    )
    assert adopt(root, framework="done-file-test", dry_run=True).adopted == [1]
    result = adopt(root, framework="done-file-test")
    assert result.adopted == [1] and result.refused == {2: "no DONE file"}
    assert (root / "checkpoint-1" / MANIFEST_NAME).exists()
    with CheckpointManager(root, read_only=True) as mgr:
        assert [c.step for c in mgr.checkpoints()] == [1]
    with pytest.raises(ValueError, match="unknown framework"):
        adopt(root, framework="nope")


@pytest.mark.timeout(60)
def test_a_registered_rule_for_other_names_or_returning_a_bool_is_said(tmp_path: Path) -> None:
    # snap.<N> folders were "adopted" (manifests written) but no manager of the root
    # ever listed them; a rule returning True refused every complete folder with the
    # reason "True".
    root = tmp_path / "root"
    (root / "snap.1").mkdir(parents=True)
    (root / "snap.1" / "DONE").write_text("x")
    register_framework("snapshots-test", r"^snap\.(?P<step>[0-9]+)$", lambda path: None)
    result = adopt(root, framework="snapshots-test")
    assert result.adopted == [] and "rename it to checkpoint-1 first" in result.refused[1]
    assert not (root / "snap.1" / MANIFEST_NAME).exists()
    (root / "snap.1").rename(root / "checkpoint-1")
    register_framework("bool-rule-test", r"^checkpoint-([0-9]+)$", lambda path: True, auto=False)
    with pytest.raises(TypeError, match=r"returned True.*must return None"):
        adopt(root, framework="bool-rule-test")
    assert not (root / "checkpoint-1" / MANIFEST_NAME).exists()


# ---------------------------------------------------------------------- Accelerate
@pytest.mark.timeout(180)
def test_stock_accelerate_project_is_adopted_and_keeps_accelerates_layout(project: Path) -> None:
    torn = project / "checkpoints" / "checkpoint_2"
    (torn / "random_states_0.pkl").unlink()  # the save died before the RNG states
    weights = project / "checkpoints" / "checkpoint_1" / "optimizer.bin"
    result = adopt(project)
    assert result.adopted == [0, 1] and list(result.refused) == [2], result
    assert "random_states_0.pkl is missing" in result.refused[2]
    assert (project / "checkpoints" / "checkpoint_1" / MANIFEST_NAME).exists()
    assert not (torn / MANIFEST_NAME).exists()
    # Nothing of ours inside checkpoints/: Accelerate lists and digit-sorts that folder.
    assert sorted(os.listdir(project / "checkpoints")) == [f"checkpoint_{i}" for i in range(3)]
    mgr = CheckpointManager(project, read_only=True)
    assert [c.step for c in mgr.checkpoints()] == [0, 1]
    assert mgr.verify(1).adopted
    # A torn optimizer file in an adopted checkpoint is found by its checksum.
    with open(weights, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    with pytest.raises(CheckpointError, match="checksum"):
        mgr.verify(1)


# ---------------------------------------------------------------------- object store
def _uploaded(stock: Path, store: FsspecStorage, steps: tuple[int, ...]) -> FsspecStorage:
    """``store`` holding the stock run's checkpoints ``steps``, as a stock run on S3."""
    for step in steps:
        for name in sorted(os.listdir(stock / f"checkpoint-{step}")):
            data = (stock / f"checkpoint-{step}" / name).read_bytes()
            store.write_bytes_atomic(f"checkpoint-{step}/{name}", data)
    return store


@pytest.mark.netfs
@pytest.mark.timeout(180)
def test_adopt_on_an_s3_root_commits_like_a_marker_save(
    stock_hf: Path, s3_server: Any, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/out"
    opts = s3_server.storage_options()
    store = _uploaded(stock_hf, FsspecStorage(url, opts), (2, 4))
    store.write_bytes_atomic("checkpoint-6/config.json", b"{}")  # torn: model only begun
    result = adopt(url, storage_options=opts)
    assert result.adopted == [2, 4] and list(result.refused) == [6], result
    manifest = json.loads(store.read_bytes(f"checkpoint-4/{MANIFEST_NAME}"))
    assert manifest["adopted"] is True and manifest["strategy"] == "marker"
    mgr = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in mgr.checkpoints()] == [2, 4]
    assert mgr.verify(4).adopted
    assert adopt(url, storage_options=opts, steps=[2, 4]).already == [2, 4]


@pytest.mark.netfs
@pytest.mark.timeout(180)
def test_cli_adopt_on_s3_that_stops_answering_half_way_exits_at_its_timeout(
    stock_hf: Path, s3_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    # The endpoint stops answering once the first checkpoint is adopted: the command
    # said "did not finish within 15 s (--timeout)", then the process never exited
    # (Python's exit waited for the threads still inside the storage call).
    import time

    from tests.cli.helpers import cli_env
    from tests.testbed.s3proxy import Rule, S3Proxy

    url = f"s3://{s3_bucket}/out"
    _uploaded(stock_hf, FsspecStorage(url, s3_server.storage_options()), (2, 4, 6, 8, 10))
    silent = tmp_path / "silent"
    with S3Proxy(s3_server, lifetime_s=120) as proxy:
        held = proxy.add(Rule("delay", times=None, when=lambda _r: silent.exists()))
        options = [
            a
            for k, v in proxy.storage_options(max_attempts=1).items()
            for a in ("--storage-option", f"{k}={json.dumps(v)}")
        ]
        cmd = [sys.executable, "-m", "atomic_checkpoint", "adopt", url, *options]
        with subprocess.Popen(
            [*cmd, "--timeout", "15"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env({"PYTHONUNBUFFERED": "1"}),  # each line as adopt prints it
        ) as proc:
            try:
                assert proc.stdout is not None and proc.stderr is not None
                first = proc.stdout.readline()
                silent.touch()
                t0 = time.monotonic()
                rc = proc.wait(60)
                took = time.monotonic() - t0
                err = proc.stderr.read()
            finally:
                held.release.set()
                if proc.poll() is None:
                    proc.kill()
    assert first.startswith("adopted checkpoint-2"), (first, err)
    assert held.fired > 0
    assert rc == 2 and "did not finish within 15 s (--timeout)" in err, (rc, err)
    assert took < 15 + 10, took
    assert "Traceback" not in err


# ---------------------------------------------------------------------- the CLI
@pytest.mark.timeout(120)
def test_cli_adopt_json_prints_its_document_when_it_fails_and_names_no_run_it_never_made(
    stock_hf: Path, tmp_path: Path
) -> None:
    # Every checkpoint refused: the document named a run id that was never recorded
    # (the next adopt made another). A --run-id other than the recorded run: exit 1
    # with no document at all, where a script reads stdout.
    torn = _copy(stock_hf, tmp_path / "torn")
    for step in (2, 4, 6, 8, 10):
        (torn / f"checkpoint-{step}" / "trainer_state.json").unlink()
    refused = run_json("adopt", torn, expect_rc=1)
    assert refused["run_id"] is None and refused["adopted"] == [], refused
    assert len(refused["refused"]) == 5 and not (torn / META_DIR / "run.json").exists()
    out = _copy(stock_hf, tmp_path / "whole")
    assert run_cli("adopt", out).returncode == 0
    wrong = run_json("adopt", out, "--run-id", "run-of-another-job", expect_rc=1)
    assert "records run" in wrong["problem"] and wrong["adopted"] == [], wrong
    assert wrong["schema_version"] == 1 and wrong["command"] == "adopt"


@pytest.mark.timeout(180)
def test_cli_adopt_reports_and_exit_codes(out: Path, tmp_path: Path) -> None:
    _tear_hf(out)
    dry = run_cli("adopt", out, "--dry-run")
    assert dry.returncode == 1, dry.stderr
    assert "would adopt checkpoint-2 (hf)" in dry.stdout
    assert "would refuse checkpoint-8: trainer_state.json is missing" in dry.stdout
    assert not (out / META_DIR).exists()

    asked = run_cli("adopt", out, "2", "4")
    assert asked.returncode == 0, asked.stderr
    assert "adopted checkpoint-4 (hf):" in asked.stdout and "checksummed" in asked.stdout
    assert "adopted 2" in asked.stdout.splitlines()[-1]

    doc = run_json("adopt", out, expect_rc=1)
    assert doc["already"] == [2, 4] and doc["adopted"] == []
    assert [r["step"] for r in doc["refused"]] == [6, 8, 10]
    proc = run_cli("adopt", out, "6")
    assert proc.returncode == 1
    assert proc.stderr.startswith("atomic-checkpoint: error: 1 checkpoint(s) not adopted")
    assert "truncated" in proc.stderr

    assert run_cli("adopt", out, "--framework", "nope").returncode == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = run_cli("adopt", empty)
    assert nothing.returncode == 1 and "nothing to adopt" in nothing.stderr
    assert os.listdir(empty) == []  # no run file or lock left behind

    # A live job holds the run lock: refused (3), nothing written.
    mgr = CheckpointManager(out)
    try:
        held = run_cli("adopt", out, "6", "--framework", "generic")
        assert held.returncode == 3, held.stderr
        assert not (out / "checkpoint-6" / MANIFEST_NAME).exists()
    finally:
        mgr.close()

    inspected = run_json("inspect", out, "4")
    assert inspected["manifest"]["adopted"] is True
    assert "adopted:" in run_cli("inspect", out, "4").stdout


@pytest.mark.timeout(120)
def test_cli_list_groups_files_that_are_not_checkpoints(out: Path) -> None:
    _tear_hf(out)
    adopted_run = adopt(out, [2, 4]).run_id
    proc = run_cli("list", out)
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()
    # save_model()'s files (config.json, model.safetensors, ...): one line, not a row each.
    assert not any(r.startswith(("config.json", "model.safetensors")) for r in rows), rows
    (grouped,) = [r for r in rows if "other entries" in r]
    assert grouped.startswith("(4 other entries)")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert name in grouped
    # Torn checkpoint-<N> folders keep a row each, and adopted ones say so.
    for step in (6, 8, 10):
        (row,) = [r for r in rows if r.startswith(f"checkpoint-{step} ")]
        assert "no manifest" in row and "adopt" in row
    (row4,) = [r for r in rows if r.startswith("checkpoint-4 ")]
    assert "ok (adopted)" in row4
    assert rows[-1].endswith("7 foreign, 2 ok (run " + adopted_run + ")"), rows[-1]
    # --json keeps one entry per name (its keys are stable).
    doc = run_json("list", out)
    names = {e["name"] for e in doc["entries"]}
    assert {"config.json", "checkpoint-6"} <= names
    assert {e["name"]: e["adopted"] for e in doc["entries"]}["checkpoint-4"] is True


@pytest.mark.timeout(120)
def test_cli_verify_checks_a_lightning_directory_through_its_sidecars(tmp_path: Path) -> None:
    # The plugin's file writer (what AtomicCheckpointIO.save_checkpoint runs), without
    # importing Lightning itself (seconds).
    from atomic_checkpoint.integrations.lightning import _AtomicFileIO
    from tests.integrations.scripts.lightning_workers import checkpoint_dict

    ckpts = tmp_path / "ckpts"
    io = _AtomicFileIO()
    io.save_checkpoint(checkpoint_dict(2), ckpts / "epoch=0-step=2.ckpt")
    io.save_checkpoint(checkpoint_dict(4), ckpts / "epoch=0-step=4.ckpt")
    # ModelCheckpoint(save_last="link"): last.ckpt is a relative link to the newest.
    os.symlink("epoch=0-step=4.ckpt", ckpts / "last.ckpt")
    # Each run imports torch (the sidecar reader's module): few runs, seconds each.
    doc = run_json("verify", ckpts)
    assert doc["ok"] is True and doc["skipped"] == []
    assert {c["name"]: c["step"] for c in doc["checkpoints"]} == {
        "epoch=0-step=2.ckpt": 2,
        "epoch=0-step=4.ckpt": 4,
        "last.ckpt": 4,
    }
    # One flipped byte in a .ckpt: verify finds it and fails.
    path = ckpts / "epoch=0-step=2.ckpt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    bad = run_cli("verify", ckpts)
    assert bad.returncode == 1
    assert "epoch=0-step=2.ckpt: CORRUPT" in bad.stdout and "last.ckpt: ok" in bad.stdout
    # A .ckpt without a sidecar (another plugin's) cannot be verified: it fails too.
    shutil.copy(ckpts / "epoch=0-step=4.ckpt", ckpts / "stock.ckpt")
    path.unlink()
    (ckpts / ("epoch=0-step=2.ckpt" + ".manifest.json")).unlink()
    stock = run_cli("verify", ckpts)
    assert stock.returncode == 1 and "stock.ckpt: NOT A CHECKPOINT" in stock.stdout


@pytest.mark.timeout(120)
def test_cli_list_shows_a_lightning_directory_by_step_and_prune_says_it_is_not_its_own(
    tmp_path: Path,
) -> None:
    # `list` showed every .ckpt and sidecar as "foreign: not a checkpoint name", and
    # `prune --keep-last 1` said "nothing to prune" with exit 0, as if done.
    from atomic_checkpoint.integrations.lightning import _AtomicFileIO
    from tests.integrations.scripts.lightning_workers import checkpoint_dict

    ckpts = tmp_path / "ckpts"
    io = _AtomicFileIO()
    for step in (20, 4):
        io.save_checkpoint(checkpoint_dict(step), ckpts / f"epoch=0-step={step}.ckpt")
    os.symlink("epoch=0-step=20.ckpt", ckpts / "last.ckpt")
    shutil.copy(ckpts / "epoch=0-step=4.ckpt", ckpts / "stock.ckpt")  # no sidecar
    with open(ckpts / "epoch=0-step=4.ckpt", "r+b") as f:  # torn: shorter than recorded
        f.truncate(100)
    doc = run_json("list", ckpts)
    got = {e["name"]: (e["step"], e["status"]) for e in doc["entries"]}
    assert got == {
        "epoch=0-step=4.ckpt": (None, "corrupt"),
        "epoch=0-step=20.ckpt": (20, "ok"),
        "last.ckpt": (20, "ok"),
        "stock.ckpt": (None, "foreign"),
    }, got
    sizes = {e["name"]: e["size_bytes"] for e in doc["entries"]}
    assert (
        sizes["last.ckpt"]
        == sizes["epoch=0-step=20.ckpt"]
        == os.path.getsize(ckpts / "epoch=0-step=20.ckpt")
    )
    text = run_cli("list", ckpts)
    assert text.returncode == 0, text.stderr
    rows = text.stdout.splitlines()
    (stock,) = [r for r in rows if r.startswith("stock.ckpt ")]
    assert "no manifest" in stock and "--framework lightning" in stock, stock
    (last,) = [r for r in rows if r.startswith("last.ckpt ")]
    assert "a link to epoch=0-step=20.ckpt" in last, last
    assert not any(".manifest.json" in r for r in rows), rows
    pruned = run_cli("prune", ckpts, "--keep-last", "1")
    assert pruned.returncode == 2, pruned.stdout
    assert "Lightning ModelCheckpoint directory" in pruned.stderr
    assert "save_top_k" in pruned.stderr
    kept = [f"epoch=0-step={s}.ckpt{x}" for s in (4, 20) for x in ("", ".manifest.json")]
    assert sorted(os.listdir(ckpts)) == sorted([*kept, "last.ckpt", "stock.ckpt"])


def test_generic_refuses_a_folder_no_manager_of_the_root_would_list(tmp_path: Path) -> None:
    """``generic`` matches ``checkpoint_<N>`` too (Accelerate's spelling, which a project
    directory maps). In a plain root such a folder, once adopted, would be a checkpoint
    that ``checkpoints()``, ``latest()`` and ``verify`` never see: refused, with the
    rename that makes it one; nothing is written into it."""
    root = tmp_path / "root"
    for name in ("checkpoint-100", "checkpoint_400"):
        (root / name).mkdir(parents=True)
        (root / name / "weights.bin").write_bytes(os.urandom(4096))
    result = adopt(root, framework="generic")
    assert result.adopted == [100]
    assert "rename it to checkpoint-400" in result.refused[400]
    assert not (root / "checkpoint_400" / MANIFEST_NAME).exists()
    with CheckpointManager(root) as mgr:
        assert [c.step for c in mgr.checkpoints()] == [100]


def test_generic_never_adopts_our_own_checkpoint_without_its_manifest(tmp_path: Path) -> None:
    """A copy cut short: checkpoint-30 holds this library's state file (truncated) but
    no manifest. The hints led to ``--framework generic``, which adopted it; verify then
    said ok and restore() raised at every start instead of falling back to step 20."""
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        for step in (20, 30):
            mgr.save(step, {"w": torch.full((1024,), float(step))})
    (root / "checkpoint-30" / MANIFEST_NAME).unlink()
    with open(root / "checkpoint-30" / "rank-00000.safetensors", "r+b") as f:
        f.truncate(100)
    result = adopt(root, framework="generic")
    assert result.adopted == [] and "own state files" in result.refused[30], result
    assert not (root / "checkpoint-30" / MANIFEST_NAME).exists()
    with CheckpointManager(root) as mgr:
        assert mgr.restore()["w"][0] == 20.0


def test_an_unknown_framework_lists_every_rule_the_integrations_bring(tmp_path: Path) -> None:
    """In a fresh process no integration is imported yet, but ``dcp`` and ``lightning``
    are accepted (imported on demand): the error lists them too."""
    proc = run_cli("adopt", tmp_path, "--framework", "nosuch")
    assert proc.returncode == 2
    for name in ("'accelerate'", "'dcp'", "'generic'", "'hf'", "'lightning'"):
        assert name in proc.stderr, proc.stderr


def test_adopt_pointed_at_one_checkpoint_folder_writes_nothing_into_it(tmp_path: Path) -> None:
    # `adopt out/checkpoint-8` (verify takes one folder; adopt takes the directory that
    # holds them) said "nothing to adopt" after writing .atomic-checkpoint/ into the
    # stock folder, whose files a later adoption then checksummed into its manifest.
    folder = tmp_path / "out" / "checkpoint-8"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "optimizer.pt").write_bytes(os.urandom(1000))
    before = sorted(os.listdir(folder))
    proc = run_cli("adopt", folder)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "nothing to adopt" in proc.stderr and "pass the directory that holds it" in proc.stderr
    assert sorted(os.listdir(folder)) == before


def test_adopt_existing_loads_the_integration_rules_and_refuses_unknown_ones(
    tmp_path: Path,
) -> None:
    # A bare KeyError for each: 'bogus', and the documented 'dcp' and 'lightning' unless
    # something had imported their integration before.
    with CheckpointManager(tmp_path / "root") as mgr:
        with pytest.raises(ValueError, match="unknown framework 'bogus'"):
            mgr.adopt_existing("bogus")
        assert mgr.adopt_existing("dcp").adopted == []


def test_a_flag_given_as_text_is_refused(tmp_path: Path) -> None:
    # adopt(dry_run="false") ran as a dry run (a non-empty string is truthy), and
    # AtomicCheckpointIO(verify="false") kept verifying while saying "false".
    from atomic_checkpoint.integrations.lightning import _AtomicFileIO

    (tmp_path / "root").mkdir()
    with pytest.raises(TypeError, match="dry_run must be True or False, got 'false'"):
        adopt(tmp_path / "root", dry_run="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="verify must be True or False"):
        _AtomicFileIO(verify="false")  # type: ignore[arg-type]


def test_register_framework_says_what_is_wrong_with_its_arguments() -> None:
    with pytest.raises(TypeError, match="must be a str or a compiled pattern"):
        register_framework("bad-a", 5, lambda path: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unterminated subpattern"):
        register_framework("bad-b", "^ck-(", lambda path: None)
    with pytest.raises(TypeError, match="record of framework 'bad-c' must be callable"):
        register_framework("bad-c", r"^x-(\d+)$", lambda path: None, record=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"step_inside of framework 'bad-d'.*with record"):
        register_framework("bad-d", r"^x-(\d+)?$", lambda path: None, step_inside=len)


def test_a_file_framework_adopts_a_name_without_a_step_by_the_step_inside(tmp_path: Path) -> None:
    # "latest.bin" names no step: its step_inside reads the one the file records.
    root = tmp_path / "root"
    root.mkdir()
    (root / "model-3.bin").write_text("3")
    (root / "latest.bin").write_text("7")
    (root / "latest-empty.bin").write_text("")
    recorded: list[str] = []

    def record(path: str) -> bool:
        recorded.append(os.path.basename(path))
        Path(path + ".ok").write_text("adopted")
        return True

    register_framework(
        "file-step-inside-test",
        r"^(?:latest(?:-empty)?|model-(?P<step>[0-9]+))\.bin$",
        lambda path: None,
        record=record,
        step_inside=lambda path: int(Path(path).read_text()) if Path(path).read_text() else None,
        auto=False,
    )
    result = adopt(root, framework="file-step-inside-test")
    assert result.adopted == [3, 7] and result.refused == {}, result
    assert sorted(recorded) == ["latest.bin", "model-3.bin"]  # no step: no candidate


@pytest.mark.parametrize("damage", ["manifest", "data"])
def test_an_integrations_save_says_when_it_replaces_a_checkpoint_resume_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    # The Trainer resumed from step 3 past a checkpoint-6 whose manifest (or a file) was
    # torn, and its save of step 6 replaced it without a word.
    from atomic_checkpoint.adopt import set_aside_unmanifested
    from atomic_checkpoint.storage import open_storage

    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        for step in (3, 6):
            mgr.save(step, {"w": torch.full((1024,), float(step))})
    torn = (
        root
        / "checkpoint-6"
        / (MANIFEST_NAME if damage == "manifest" else "rank-00000.safetensors")
    )
    torn.write_bytes(torn.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        set_aside_unmanifested(open_storage(root), 6, "hf")
        set_aside_unmanifested(open_storage(root), 3, "hf")  # a valid one: nothing said
    assert caplog.text.count("this save replaces") == 1, caplog.text
    assert "checkpoint-6, which is not a valid checkpoint" in caplog.text


# ---------------------------------------------------------------------- torn by siblings
def _save_custom_state(folder: Path, n: int) -> None:
    """What ``save_state`` writes for an object registered with
    ``register_for_checkpointing`` (``accelerate.checkpointing.save_custom_state``:
    ``torch.save`` of its ``state_dict()``, on the main process), without the
    process-wide ``PartialState`` its logging needs."""
    torch.save({"n": n}, folder / "custom_checkpoint_0.pkl")


@pytest.mark.timeout(120)
def test_accelerate_folder_lacking_the_custom_state_its_siblings_have_is_refused(
    project: Path,
) -> None:
    """Accelerate writes ``custom_checkpoint_<i>.pkl`` (the registered objects) last,
    after the RNG states: a save killed between them left a folder that passed every
    other check, and ``load_state`` then failed on it. Refused, as every other
    adoptable sibling has that file."""
    ckpts = project / "checkpoints"
    for i in (0, 1):  # the stock save_state of checkpoint_2 died before its custom state
        _save_custom_state(ckpts / f"checkpoint_{i}", i)
    dry = adopt(project, dry_run=True)
    assert dry.adopted == [0, 1] and list(dry.refused) == [2], dry
    assert "custom_checkpoint_0.pkl is missing" in dry.refused[2]
    assert "every other complete checkpoint" in dry.refused[2]
    result = adopt(project)
    assert result.adopted == [0, 1] and list(result.refused) == [2], result
    assert not (ckpts / "checkpoint_2" / MANIFEST_NAME).exists()


@pytest.mark.timeout(120)
def test_a_file_only_some_siblings_have_does_not_refuse(project: Path) -> None:
    """Only a file *every* other adoptable sibling holds tells: a run restarted with
    fewer registered objects (or processes) left older folders with more files."""
    _save_custom_state(project / "checkpoints" / "checkpoint_0", 0)
    result = adopt(project, dry_run=True)
    assert result.adopted == [0, 1, 2] and not result.refused, result


@pytest.mark.timeout(120)
def test_accelerate_folder_lacking_a_process_rng_its_siblings_have_is_refused(
    project: Path,
) -> None:
    """Two processes: rank 1 killed before it wrote ``random_states_1.pkl`` left
    checkpoint_1 with rank 0's RNG file only, which the numbering check (0..n-1, none
    missing in between) cannot see. Its siblings have both: refused, also by the CLI."""
    ckpts = project / "checkpoints"
    for i in (0, 2):
        shutil.copyfile(
            ckpts / f"checkpoint_{i}" / "random_states_0.pkl",
            ckpts / f"checkpoint_{i}" / "random_states_1.pkl",
        )
    result = adopt(project, dry_run=True)
    assert result.adopted == [0, 2] and list(result.refused) == [1], result
    assert "random_states_1.pkl is missing" in result.refused[1]
    doc = run_json("adopt", project, "--dry-run", expect_rc=1)
    assert [a["step"] for a in doc["adopted"]] == [0, 2]
    assert [r["step"] for r in doc["refused"]] == [1]


@pytest.mark.timeout(120)
def test_trainer_folder_lacking_the_rng_state_its_siblings_have_is_refused(out: Path) -> None:
    (out / "checkpoint-4" / "rng_state.pth").unlink()
    result = adopt(out, dry_run=True)
    assert result.adopted == [2, 6, 8, 10] and list(result.refused) == [4], result
    assert "rng_state.pth is missing" in result.refused[4]


@pytest.mark.timeout(120)
def test_trainer_folders_of_a_run_resized_between_restarts(out: Path) -> None:
    """Two processes (rng_state_<p>.pth), then one (rng_state.pth), then two again, the
    last but one save torn (process 1 killed before its RNG state). The torn folder
    counted as complete when judging the others: it was adopted, and the complete
    one-process folder refused as missing rng_state_0.pth."""
    for step in (2, 4, 8, 10):
        folder = out / f"checkpoint-{step}"
        (folder / "rng_state.pth").rename(folder / "rng_state_0.pth")
        if step != 8:
            shutil.copyfile(folder / "rng_state_0.pth", folder / "rng_state_1.pth")
    result = adopt(out, dry_run=True)
    assert result.adopted == [2, 4, 6, 10] and list(result.refused) == [8], result
    assert "rng_state_1.pth is missing" in result.refused[8]


# ---------------------------------------------------------------------- generic, temporaries
def test_generic_refuses_a_truncated_torch_save_file(tmp_path: Path) -> None:
    """``generic`` checks a file that starts as a zip archive (``torch.save``'s format,
    whatever its name) as the framework rules do: a truncated one is refused."""
    root = tmp_path / "root"
    for step in (100, 200):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        torch.save(
            {"model": torch.nn.Linear(64, 64).state_dict(), "step": step},
            root / f"checkpoint-{step}" / "model.data",
        )
    os.truncate(root / "checkpoint-200" / "model.data", 5000)  # the save was killed
    result = adopt(root, framework="generic")
    assert result.adopted == [100] and list(result.refused) == [200], result
    assert "not a whole torch.save archive" in result.refused[200]
    assert not (root / "checkpoint-200" / MANIFEST_NAME).exists()


def test_a_killed_adopts_temporary_manifest_is_never_recorded(tmp_path: Path) -> None:
    """An adopt killed between writing its manifest's temporary file and linking it
    into place left ``checkpoint.manifest.json.tmp-...`` in the folder. Adopting again
    records only the framework's files, and ``clean`` still removes the leftover."""
    from safetensors.torch import save_file

    from atomic_checkpoint.cli import main
    from atomic_checkpoint.storage.temps import STALE_TEMP_S

    folder = tmp_path / "out" / "checkpoint-2"
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    left = folder / f"{MANIFEST_NAME}.tmp-4000000-1-2"  # its writer is long gone
    left.write_bytes(b'{"step": 2')
    old = left.stat().st_mtime - 2 * STALE_TEMP_S
    os.utime(left, (old, old))
    assert adopt(folder.parent, dry_run=True).size_bytes[2] == sum(
        (folder / n).stat().st_size for n in ("model.safetensors", "trainer_state.json")
    )
    result = adopt(folder.parent)
    assert result.adopted == [2], result
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    recorded = sorted(f["path"] if isinstance(f, dict) else f for f in doc["files"])
    assert recorded == ["model.safetensors", "trainer_state.json"]
    assert main(["clean", str(folder.parent)]) == 0
    assert not left.exists()
    with CheckpointManager(folder.parent, read_only=True) as mgr:
        assert mgr.verify(2).adopted
