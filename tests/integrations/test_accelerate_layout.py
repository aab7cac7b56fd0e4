"""Accelerate's conventions kept: ``<project_dir>/checkpoints/checkpoint_<i>`` numbered
as automatic naming numbers them, nothing else in that folder (so Accelerate's own
``save_state()``/``load_state()`` keep working beside ours), a switch installed once on
the ``Accelerator`` that makes the stock calls atomic, adoption of stock checkpoints,
and the run lock released on every error path. Real Accelerate (CPU), real files, real
SIGKILLs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ResumeError,
)
from tests.integrations.helpers import RUN_TIMEOUT_S, SCRIPTS, communicate, job_env, spawn

pytest.importorskip("accelerate", reason="the Accelerate integration needs accelerate")
sys.path.insert(0, str(SCRIPTS))
from tiny_accel import build, train_step

from atomic_checkpoint.integrations.accelerate import (
    close,
    load_state,
    make_atomic,
    save_state,
)

pytestmark = pytest.mark.timeout(240)
MANIFEST = "checkpoint.manifest.json"


def _folders(project: Path) -> list[str]:
    return sorted(os.listdir(project / "checkpoints"))


def _locks(project: Path) -> list[str]:
    """Run locks held anywhere under the project (none once released)."""
    return sorted(str(p.relative_to(project)) for p in project.rglob("lock.json"))


def _weights(model) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def _two_saves(project: Path) -> dict[str, list[float]]:
    """Two training steps of a new project, each saved by the integration; returns the
    weights saved last."""
    acc, model, opt, sched = build(str(project), total_limit=None)
    for step in range(1, 3):
        train_step(acc, model, opt, sched, step)
        save_state(acc, timeout_s=30)
    close(acc)
    return _weights(model)


def test_checkpoints_keep_accelerates_names_and_numbering(tmp_path: Path) -> None:
    """Folders are checkpoint_<i> from 0 under <project_dir>/checkpoints, which holds
    nothing else; total_limit rotates them after each commit; the numbering continues
    after load_state. A project an earlier version wrote keeps its layout."""
    project = tmp_path / "run"
    acc, model, opt, sched = build(str(project), total_limit=2)
    infos = []
    for step in range(1, 4):
        train_step(acc, model, opt, sched, step)
        infos.append(save_state(acc, timeout_s=30))
    close(acc)
    assert [i.step for i in infos] == [0, 1, 2]
    assert infos[-1].path == str(project / "checkpoints" / "checkpoint_2")
    assert _folders(project) == ["checkpoint_1", "checkpoint_2"]
    assert (project / "checkpoints" / "checkpoint_2" / MANIFEST).is_file()
    assert sorted(n for n in os.listdir(project) if n.startswith(".")) == [
        ".atomic-checkpoint",
        ".pending",
        ".trash",
    ]
    acc, model, opt, sched = build(str(project), total_limit=2, seed=5)
    assert load_state(acc, timeout_s=30).step == 2
    assert acc.save_iteration == 3
    assert save_state(acc, timeout_s=30).path.endswith("checkpoint_3")
    close(acc)
    assert _folders(project) == ["checkpoint_2", "checkpoint_3"]

    # Written by an earlier version: checkpoints/ is the root, with checkpoint-<n>.
    old = tmp_path / "old"
    mgr = CheckpointManager(old / "checkpoints")
    acc, model, opt, sched = build(str(old), total_limit=None)
    acc.project_configuration.automatic_checkpoint_naming = False
    with mgr.saving(7) as pending:
        acc.save_state(output_dir=str(pending))
    mgr.close()
    expected = _weights(model)
    acc, model, opt, sched = build(str(old), total_limit=None, seed=9)
    assert load_state(acc, timeout_s=30).step == 7
    assert _weights(model) == expected
    close(acc)
    assert not (old / ".atomic-checkpoint").exists()


def test_stock_save_state_and_load_state_work_beside_ours(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Accelerate's own calls on a project the integration uses: load_state() loads the
    newest of our checkpoints, save_state() with total_limit rotates by number and
    writes the next one; nothing raises IndexError."""
    project = tmp_path / "run"
    expected = _two_saves(project)

    acc, model, *_ = build(str(project), total_limit=2, seed=7)
    acc.load_state()  # stock, automatic naming: the highest-numbered folder
    assert _weights(model) == expected
    acc.project_configuration.iteration = 2
    acc.save_state()  # stock: deletes the oldest to stay at total_limit, then writes
    assert _folders(project) == ["checkpoint_1", "checkpoint_2"]
    assert not (project / "checkpoints" / "checkpoint_2" / MANIFEST).exists()

    # Ours again: the stock checkpoint_2 is no checkpoint of ours (no manifest); ours
    # resumes from checkpoint_1, and the CLI reads the project without flags.
    acc, model, *_ = build(str(project), total_limit=None, seed=8)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert load_state(acc, timeout_s=30).step == 1
    close(acc)
    # ... saying that the newer stock one is not loaded, and how to resume from it.
    said = [r.getMessage() for r in caplog.records if "their training is dropped" in r.getMessage()]
    assert len(said) == 1 and "checkpoint_2" in said[0] and "adopt_existing=True" in said[0]
    for root in (project, project / "checkpoints"):
        out = subprocess.run(
            [sys.executable, "-m", "atomic_checkpoint", "list", "--json", str(root)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)["entries"]
        ok = [(r["step"], r["path"]) for r in rows if r["status"] == "ok"]
        assert ok == [(1, str(project / "checkpoints" / "checkpoint_1"))]
        stock = [r for r in rows if r["path"] == str(project / "checkpoints" / "checkpoint_2")]
        assert [(r["step"], r["status"]) for r in stock] == [(2, "foreign")]
        verify = subprocess.run(
            [sys.executable, "-m", "atomic_checkpoint", "verify", str(root), "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
        # The text output names the folders as they are on disk (before: checkpoint-1,
        # which `ls` and `rm` do not find).
        assert verify.stdout.startswith("checkpoints/checkpoint_1: ok"), verify.stdout
        text = subprocess.run(
            [sys.executable, "-m", "atomic_checkpoint", "list", str(root)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "checkpoints/checkpoint_1 " in text and "checkpoint-1" not in text, text
    assert _folders(project) == ["checkpoint_1", "checkpoint_2"]


def test_the_iteration_advice_of_a_refused_save_works_when_followed(tmp_path: Path) -> None:
    # A new job on a project of three stock checkpoints (0, 1, 2) starts numbering at
    # 0: the refusal said "set iteration = 1", which failed again at 1, then at 2. It
    # names the step above the newest one in the project.
    project = tmp_path / "run"
    acc, *_ = build(str(project), total_limit=None)
    for _ in range(3):
        acc.save_state()  # stock
    acc, *_ = build(str(project), total_limit=None, seed=3)
    with pytest.raises(CheckpointExistsError, match="Accelerate's own save_state") as err:
        save_state(acc, timeout_s=30)
    said = str(err.value)
    assert said.endswith("accelerator.project_configuration.iteration = 3"), said
    acc.project_configuration.iteration = int(said.rsplit("= ", 1)[1])  # as it says
    assert save_state(acc, timeout_s=30).step == 3
    close(acc)


def test_load_state_given_one_checkpoint_folder_as_root_says_so(tmp_path: Path) -> None:
    # It answered "no checkpoint under .../checkpoint_1; pass missing_ok=True to start
    # from scratch": that skipped the very checkpoint the user pointed at.
    # (One of ours holds a manifest: the manager itself refuses it as a root.)
    project = tmp_path / "run"
    acc, model, *_ = build(str(project), total_limit=None)
    acc.save_state()  # stock: checkpoint_0
    acc.save_state()  # stock: checkpoint_1
    expected = _weights(model)
    one = project / "checkpoints" / "checkpoint_1"
    acc, model, *_ = build(str(project), total_limit=None, seed=5)
    for missing_ok in (False, True):
        with pytest.raises(CheckpointNotFoundError, match="is one checkpoint folder") as err:
            load_state(acc, root=one, missing_ok=missing_ok, timeout_s=30)
        assert "step=1" in str(err.value) and "missing_ok" not in str(err.value)
    # As it says (a stock folder is adopted first, as load_state's own error says).
    assert load_state(acc, step=1, adopt_existing=True, timeout_s=30).step == 1
    assert _weights(model) == expected
    close(acc)


def test_load_state_skips_checkpoints_the_manager_saved_into_the_project(
    tmp_path: Path, caplog
) -> None:
    """An evaluation job's CheckpointManager(project).save(100, ...) lands beside the
    Accelerate checkpoints: load_state() picked it as the newest and failed inside
    Accelerate (no model weights there) at every restart."""
    project = tmp_path / "run"
    expected = _two_saves(project)
    with CheckpointManager(project) as mgr:
        mgr.save(100, {"eval_loss": 0.5})
    acc, model, *_ = build(str(project), total_limit=None, seed=9)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert load_state(acc, timeout_s=30).step == 1  # the newest save_state() wrote
    assert _weights(model) == expected
    assert "was saved by CheckpointManager.save()" in caplog.text
    with pytest.raises(CheckpointError, match=r"load it with CheckpointManager\.restore"):
        load_state(acc, step=100, timeout_s=30)
    close(acc)


def test_make_atomic_turns_the_stock_calls_atomic(tmp_path: Path, caplog) -> None:
    """After make_atomic(accelerator), accelerator.save_state() commits (manifest,
    rotation after the commit), a folder of the root is that step, any other folder is
    left to Accelerate; accelerator.load_state() loads the newest verified checkpoint
    and continues the numbering."""
    project = tmp_path / "run"
    acc, model, opt, sched = build(str(project), total_limit=2)
    assert make_atomic(acc, timeout_s=30) is acc
    assert make_atomic(acc) is acc  # idempotent
    paths = []
    for step in range(1, 4):
        train_step(acc, model, opt, sched, step)
        paths.append(acc.save_state())
    assert paths == [str(project / "checkpoints" / f"checkpoint_{i}") for i in range(3)]
    assert all((project / "checkpoints" / n / MANIFEST).is_file() for n in _folders(project))
    elsewhere = tmp_path / "export"
    # Automatic naming ignores output_dir (as Accelerate does): the next step, atomic.
    assert acc.save_state(str(elsewhere)).endswith("checkpoint_3")
    acc.project_configuration.automatic_checkpoint_naming = False
    explicit = acc.save_state(str(project / "checkpoints" / "checkpoint_9"))
    assert explicit.endswith("checkpoint_9")
    assert (project / "checkpoints" / "checkpoint_9" / MANIFEST).is_file()
    expected = _weights(model)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        acc.save_state(str(elsewhere))  # not a folder of the root: Accelerate's own save
    assert (elsewhere / "model.safetensors").is_file() and not (elsewhere / MANIFEST).exists()
    assert "not atomically" in caplog.text
    close(acc)  # waits for the rotation (KeepLast(total_limit), after each commit)
    assert _folders(project) == ["checkpoint_3", "checkpoint_9"]

    acc, model, opt, sched = build(str(project), total_limit=2, seed=3)
    make_atomic(acc, timeout_s=30)
    info = acc.load_state()
    assert info.step == 9 and _weights(model) == expected
    assert acc.save_iteration == 10
    close(acc)


def test_the_warning_about_stock_folders_names_them_as_they_are_on_disk(tmp_path, caplog):
    # It said "checkpoint-0, checkpoint-1": the protocol's names, which ls cannot find.
    project = tmp_path / "run"
    acc, model, opt, sched = build(str(project), total_limit=3)
    train_step(acc, model, opt, sched, 1)
    acc.save_state()  # Accelerate's own: no manifest
    acc, model, opt, sched = build(str(project), total_limit=3)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        make_atomic(acc, timeout_s=30)
        with pytest.raises(CheckpointExistsError, match="Accelerate's own save_state"):
            acc.save_state()  # its step 0 is the stock folder: refused, never replaced
    warned = [r.getMessage() for r in caplog.records if "without a manifest" in r.getMessage()]
    assert warned and "(checkpoints/checkpoint_0)" in warned[0], caplog.text
    close(acc)


def _corrupt(project: Path, step: int) -> None:
    path = project / "checkpoints" / f"checkpoint_{step}" / "optimizer.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _raise(*_args) -> None:
    raise RuntimeError("hook failed")


def _stock_torn(acc, project: Path) -> None:
    acc.save_state()
    (project / "checkpoints" / "checkpoint_0" / "optimizer.bin").unlink()


ERROR_PATHS = {
    # name: (setup(acc, project), call(acc), expected error)
    "resume_over_torn_stock_folder": (_stock_torn, lambda a: load_state(a), ResumeError),
    "nothing_to_load": (lambda a, p: None, lambda a: load_state(a), CheckpointNotFoundError),
    "step_not_committed": (
        lambda a, p: save_state(a),
        lambda a: load_state(a, step=5),
        CheckpointNotFoundError,
    ),
    "checksum_mismatch": (
        lambda a, p: (save_state(a), _corrupt(p, 0)),
        lambda a: load_state(a, step=0),
        CorruptCheckpointError,
    ),
    "accelerate_load_fails": (
        lambda a, p: (save_state(a), a.register_load_state_pre_hook(_raise)),
        lambda a: load_state(a),
        RuntimeError,
    ),
    "accelerate_save_fails": (
        lambda a, p: a.register_save_state_pre_hook(_raise),
        lambda a: save_state(a),
        RuntimeError,
    ),
    "complete_stock_folder_in_the_way": (
        lambda a, p: (a.save_state(), setattr(a.project_configuration, "iteration", 0)),
        lambda a: save_state(a),
        CheckpointExistsError,
    ),
    "adopt_finds_only_torn_folders": (
        _stock_torn,
        lambda a: load_state(a, adopt_existing=True),
        ResumeError,
    ),
}


@pytest.mark.parametrize("path", sorted(ERROR_PATHS))
def test_run_lock_released_on_error_path(tmp_path: Path, path: str) -> None:
    """Each error save_state/load_state raises releases the run lock (a later job, or
    the next Accelerator of this process, takes the root without a takeover)."""
    setup, call, error = ERROR_PATHS[path]
    project = tmp_path / "run"
    acc, *_ = build(str(project), total_limit=None)
    setup(acc, project)
    with pytest.raises(error):
        call(acc)
    assert _locks(project) == []
    assert acc.__dict__.get("_atomic_checkpoint_roots") == {}
    close(acc)


def _launch(args: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    return spawn([sys.executable, str(SCRIPTS / "accel_layout.py"), *args], job_env(tmp_path))


def _killed_then_checked(kind: str, tmp_path: Path) -> dict:
    project, ref, result = tmp_path / "project", tmp_path / "ref", tmp_path / "result.json"
    proc = _launch(["run", kind, str(project)], tmp_path)
    (out,) = communicate([proc], RUN_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL, out[-4000:]
    proc = _launch(["check", kind, str(project), str(ref), str(result)], tmp_path)
    (out,) = communicate([proc], RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-6000:]
    return json.loads(result.read_text())


@pytest.mark.faults
def test_stock_run_killed_mid_save_resumes_from_its_newest_complete_checkpoint(
    tmp_path: Path,
) -> None:
    """A plain Accelerate run killed during its third save (checkpoint_2: model written,
    optimizer not), continued with load_state(adopt_existing=True): checkpoint_0 and
    checkpoint_1 are adopted, the torn checkpoint_2 is not, the state restored is the
    reference's at that step, and the next save replaces the torn folder."""
    r = _killed_then_checked("stock", tmp_path)
    torn = ["model.safetensors"]
    assert r["listing_after_kill"]["checkpoint_2"] == torn
    assert r["loaded_step"] == 1 and r["loaded_adopted"]
    assert r["restored_vs_reference"] == []
    assert r["iteration_after_load"] == 2
    assert r["losses_resumed"] == r["losses_reference"]
    assert r["saved"] == "returned 2"
    after = r["listing_after_save"]
    assert sorted(after) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert all(MANIFEST in files for files in after.values())


@pytest.mark.faults
def test_sigkill_mid_stock_save_state_under_the_switch_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    """make_atomic(accelerator), total_limit=1, SIGKILL inside the stock
    accelerator.save_state() call: checkpoints/ still holds only the previous, complete
    checkpoint_1 (no torn folder anywhere Accelerate or we look); the restart loads it
    with the reference's exact state, and Accelerate alone loads what it saves next."""
    r = _killed_then_checked("switch", tmp_path)
    before = r["listing_after_kill"]
    assert sorted(before) == ["checkpoint_1"] and MANIFEST in before["checkpoint_1"]
    assert r["loaded_step"] == 1
    assert r["restored_vs_reference"] == []
    assert r["losses_resumed"] == r["losses_reference"]
    assert r["saved"] == "returned 'checkpoint_2'"
    assert sorted(r["listing_after_save"]) == ["checkpoint_1", "checkpoint_2"]
    assert r["stock_load"] == "returned None"
    assert r["stock_loaded_vs_saved"] == []


@pytest.mark.parametrize(
    "how", ["explicit_step", "newer_ones_corrupt", "newest_torn", "newest_manifest_lost"]
)
def test_loading_an_older_checkpoint_continues_the_numbering_after_the_newest(
    tmp_path: Path, how: str
) -> None:
    """Accelerate's number counts saves. Loading checkpoint_1 while 2 and 3 exist (asked
    for, or because 2 and 3 fail verification) continues with checkpoint_4, as stock
    Accelerate does in the same process; it used to set the counter to 2, and the next
    save_state() raised StepOrderError (2 is below the newest, 3)."""
    project = tmp_path / "run"
    acc, model, opt, sched = build(str(project), total_limit=None)
    make_atomic(acc, timeout_s=30)
    for step in range(1, 5):
        train_step(acc, model, opt, sched, step)
        acc.save_state()
    close(acc)
    assert _folders(project) == [f"checkpoint_{i}" for i in range(4)]

    acc, model, opt, sched = build(str(project), total_limit=None, seed=3)
    make_atomic(acc, timeout_s=30)
    if how == "explicit_step":
        info = acc.load_state(str(project / "checkpoints" / "checkpoint_1"))
    else:
        _corrupt(project, 2)
        if how == "newest_torn":
            # A torn manifest: the counter went on after step 2 only, and the next save
            # replaced checkpoint_3 without a word.
            manifest = project / "checkpoints" / "checkpoint_3" / MANIFEST
            manifest.write_bytes(manifest.read_bytes()[:100])
        elif how == "newest_manifest_lost":
            # A complete folder without a manifest, which a save refuses to replace: the
            # counter went on after step 2, and the first save raised
            # CheckpointExistsError, at every restart.
            (project / "checkpoints" / "checkpoint_3" / MANIFEST).unlink()
        else:
            _corrupt(project, 3)
        info = acc.load_state()
    assert info.step == 1
    assert acc.save_iteration == 4
    train_step(acc, model, opt, sched, 5)
    assert acc.save_state().endswith("checkpoint_4")
    close(acc)
    assert _folders(project) == [f"checkpoint_{i}" for i in range(5)]


def test_total_limit_neither_counts_nor_deletes_a_corrupt_newest_skipped_by_load_state(
    tmp_path: Path,
) -> None:
    """total_limit=2, checkpoints 0-2, a flipped byte in 2: load_state() loads 1, and the
    next save (3) kept the corrupt 2 and deleted 1, the checkpoint just loaded. Now 2 is
    neither counted nor deleted (left for inspection), as after restore() skipped it."""
    project = tmp_path / "run"
    acc, model, opt, sched = build(str(project), total_limit=2)
    make_atomic(acc, timeout_s=30)
    for step in range(1, 4):
        train_step(acc, model, opt, sched, step)
        acc.save_state()
    close(acc)
    _corrupt(project, 2)
    acc, model, opt, sched = build(str(project), total_limit=2, seed=3)
    make_atomic(acc, timeout_s=30)
    assert acc.load_state().step == 1
    train_step(acc, model, opt, sched, 4)
    assert acc.save_state().endswith("checkpoint_3")
    close(acc)  # waits for the rotation
    assert _folders(project) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]


def test_a_rank_whose_write_failed_raises_the_error_every_other_rank_raises() -> None:
    """The failing rank re-raised its own RuntimeError while the others raised
    DistributedCheckpointError: `except CheckpointError` around save_state caught it
    on the others only, and that rank crashed while they went on."""
    from atomic_checkpoint.errors import DistributedCheckpointError
    from atomic_checkpoint.integrations.accelerate import _share_outcome
    from tests.helpers import on_store_threads

    def body(coord, rank):
        own = RuntimeError("scheduler state_dict failed") if rank == 1 else None
        _share_outcome(coord, "accelerate step 5: files written", own, phase="write", step=5,
                       timeout_s=20)  # fmt: skip

    results = on_store_threads(3, body)
    messages = set()
    for rank, (kind, exc, _) in enumerate(results):
        assert kind == "error" and isinstance(exc, DistributedCheckpointError), (rank, exc)
        assert [f.rank for f in exc.failures] == [1]
        messages.add(str(exc))
    assert len(messages) == 1 and "scheduler state_dict failed" in messages.pop()
    assert isinstance(results[1][1].__cause__, RuntimeError)  # its own error, chained


def test_a_url_root_is_refused_not_made_a_local_folder(tmp_path, monkeypatch) -> None:
    # save_state(root="s3://bkt/run") saved to ./s3:/bkt/run on the node's disk, and
    # returned as if the bucket had it.
    monkeypatch.chdir(tmp_path)
    acc, model, opt, sched = build(str(tmp_path / "run"), total_limit=2)
    train_step(acc, model, opt, sched, 1)
    with pytest.raises(CheckpointError, match=r"is a URL; .* need a mounted filesystem"):
        save_state(acc, root="s3://bkt/accelerate-run", timeout_s=30)
    assert not (tmp_path / "s3:").exists()
