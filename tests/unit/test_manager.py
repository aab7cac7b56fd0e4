"""CheckpointManager in one process on a real local filesystem: the user-facing rules."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from atomic_checkpoint import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    FencedError,
    KeepBest,
    KeepLast,
    LocalStorage,
    ReadOnlyError,
    ResumeError,
    SerializationError,
    SingleProcessCoordinator,
    StateMismatchError,
    StepOrderError,
    StorageError,
    UnsafeCheckpointError,
)
from atomic_checkpoint.layout import MANIFEST_NAME, PENDING_DIR, parse_attempt_dir

pytestmark = pytest.mark.timeout(60)


def state(step: int = 1):
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(256, generator=g),
        "opt": {0: {"step": torch.tensor(float(step))}},
        "hp": (0.9, 0.999),
        "step": step,
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_save_restore_latest_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path)
    # The names sort differently as strings ("checkpoint-10" < "checkpoint-5"): ordering
    # is by integer step. (Saving below a committed step is refused: test_rollback.py.)
    for s in (5, 9, 10, 100):
        mgr.save(s, state(s), metrics={"loss": 1.0 / s})
    assert [c.step for c in mgr.checkpoints()] == [5, 9, 10, 100]
    assert mgr.latest().step == 100
    assert same(mgr.restore(), state(100))
    assert same(mgr.restore(9), state(9))
    info = mgr.latest()
    assert info.metrics == {"loss": 0.01} and info.path == str(tmp_path / "checkpoint-100")
    assert info.run_id and info.size_bytes > 1024


def test_restore_into_existing_tensors_fills_them_in_place(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    target = state(2)
    ptr = target["w"].data_ptr()
    out = mgr.restore(1, into=target)
    assert out["w"].data_ptr() == ptr and torch.equal(out["w"], state(1)["w"])


def test_restore_into_a_module_an_optimizer_or_an_uncalled_state_dict_is_refused(tmp_path):
    # Passed over without a word: restore() returned the state and the model kept its
    # values (into= fills tensors, not objects).
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(StateMismatchError, match=r"state\['model'\].*a Linear there.*state_dict"):
        mgr.restore(into={"model": model, "optim": opt.state_dict()})
    with pytest.raises(StateMismatchError, match=r"state\['optim'\].*a SGD there"):
        mgr.restore(into={"model": model.state_dict(), "optim": opt})
    with pytest.raises(StateMismatchError, match=r"the method Linear.state_dict there, not called"):
        mgr.restore(into={"model": model.state_dict, "optim": opt.state_dict()})
    assert torch.count_nonzero(model.weight) == 0  # nothing was half-loaded
    mgr.restore(into={"model": model.state_dict(), "optim": opt.state_dict()})
    assert torch.count_nonzero(model.weight) > 0


def test_saving_an_existing_step_is_an_error_unless_overwrite(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, state(3))
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        mgr.save(3, state(4))
    assert same(mgr.restore(3), state(3))  # nothing lost
    mgr.save(3, state(4), overwrite=True)
    assert same(mgr.restore(3), state(4))
    assert [c.step for c in mgr.checkpoints()] == [3]
    assert os.listdir(tmp_path / PENDING_DIR) == []


@pytest.mark.parametrize("bad", [-1, 1.5, "7", None, True])
def test_bad_steps_are_rejected_before_anything_is_written(tmp_path, bad):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises((TypeError, ValueError), match="step"):
        mgr.save(bad, state())
    assert mgr.checkpoints() == [] and os.listdir(tmp_path / PENDING_DIR) == []


def test_unsupported_objects_name_their_path_and_write_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    with pytest.raises(SerializationError, match=r"opt.*weird"):
        mgr.save(2, {"opt": {"weird": object()}})
    assert [c.step for c in mgr.checkpoints()] == [1]
    assert os.listdir(tmp_path / PENDING_DIR) == []


def test_pickle_needs_explicit_permission_both_ways(tmp_path):
    class Thing:
        pass

    mgr = CheckpointManager(tmp_path, allow_pickle=True)
    mgr.save(1, {"thing": Thing.__name__, "obj": {1, 2, 3}})
    reader = CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        reader.restore(1)
    assert reader.restore(1, allow_pickle=True)["obj"] == {1, 2, 3}


def test_root_that_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(StorageError, match="is a file"):
        CheckpointManager(f)


def _corrupt_cases():
    def truncate(d):
        f = d / "rank-00000.safetensors"
        f.write_bytes(f.read_bytes()[:-10])

    def flip(d):
        f = d / "rank-00000.safetensors"
        data = bytearray(f.read_bytes())
        data[-5] ^= 0x01
        f.write_bytes(bytes(data))

    def delete_file(d):
        (d / "rank-00000.safetensors").unlink()

    def delete_manifest(d):
        (d / MANIFEST_NAME).unlink()

    def mangle_manifest(d):
        (d / MANIFEST_NAME).write_text("{not json")

    def escape(d):
        doc = json.loads((d / MANIFEST_NAME).read_text())
        doc["files"][0]["path"] = "../../outside.safetensors"
        (d / MANIFEST_NAME).write_text(json.dumps(doc))

    def symlink_out(d):
        outside = d.parent.parent / "outside.bin"
        outside.write_bytes((d / "rank-00000.safetensors").read_bytes())
        (d / "rank-00000.safetensors").unlink()
        (d / "rank-00000.safetensors").symlink_to(outside)

    def future_schema(d):
        doc = json.loads((d / MANIFEST_NAME).read_text())
        doc["schema_version"] = 999
        (d / MANIFEST_NAME).write_text(json.dumps(doc))

    return {
        "truncate": (truncate, "bytes"),
        "flip": (flip, "checksum"),
        "delete_file": (delete_file, "missing"),
        "delete_manifest": (delete_manifest, None),
        "mangle_manifest": (mangle_manifest, "JSON"),
        "escape": (escape, "refusing"),
        "symlink_out": (symlink_out, "outside"),
        "future_schema": (future_schema, "newer"),
    }


@pytest.mark.parametrize("case", sorted(_corrupt_cases()))
def test_corrupt_newest_checkpoint_is_skipped_and_named(tmp_path, case, caplog):
    fn, problem = _corrupt_cases()[case]
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    fn(root / "checkpoint-2")
    if case == "flip":
        # Sizes still match: discovery accepts it, verification and verified restore do not.
        assert mgr.latest().step == 2
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            mgr.verify(2)
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            mgr.restore(2)
        return
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        latest = mgr.latest()
    assert latest.step == 1  # resume falls back to the newest valid one
    assert same(mgr.restore(), state(1))
    if problem is not None:
        assert any(
            problem in r.getMessage() and "checkpoint-2" in r.getMessage() for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        with pytest.raises(CorruptCheckpointError, match=problem):
            mgr.restore(2)
    else:
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore(2)


def test_resume_modes(tmp_path):
    with pytest.raises(ResumeError, match="no valid checkpoint"):
        CheckpointManager(tmp_path / "a", resume="must")
    # A ValueError too, as the Trainer's "no valid checkpoint found" is: a fallback
    # written for that keeps working.
    with pytest.raises(ValueError, match="no valid checkpoint"):
        CheckpointManager(tmp_path / "a", resume="must")
    assert not (tmp_path / "a").exists()  # a mistyped path: nothing created there
    mgr = CheckpointManager(tmp_path / "b")
    mgr.save(1, state(1))
    mgr.close()
    with pytest.raises(ResumeError, match="already has 1 checkpoint"):
        CheckpointManager(tmp_path / "b", resume="never")
    with CheckpointManager(tmp_path / "b", resume="must") as resumed:
        assert resumed.latest().step == 1
    # Checkpoints exist but none is valid: never a silent fresh start.
    (tmp_path / "b" / "checkpoint-1" / "rank-00000.safetensors").unlink()
    with pytest.raises(ResumeError, match="none is valid"):
        CheckpointManager(tmp_path / "b")


def test_the_advice_of_a_refused_fresh_start_works_when_followed(tmp_path):
    # Both messages said "start a separate run there with a new run_id": every run in a
    # root shares the checkpoint-<step> names and another run's checkpoint is never
    # replaced, so that run's first save of a step these hold failed (and with
    # unreadable manifests, the new run_id was refused at once the same way).
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1000, state(1))
    with pytest.raises(ResumeError, match="already has 1 checkpoint") as never:
        CheckpointManager(root, resume="never")
    said = str(never.value)
    assert "run_id" not in said and "use another root" in said, said
    with CheckpointManager(tmp_path / "another", resume="never") as fresh:
        assert fresh.save(1000, state(2)).step == 1000  # the same step, beside nothing
    assert "resume='auto'" in said  # and its other advice: continue them
    with CheckpointManager(root, resume="auto") as resumed:
        assert resumed.latest().step == 1000
    (root / "checkpoint-1000" / "checkpoint.manifest.json").write_text("{garbage")
    with pytest.raises(ResumeError, match="none is valid") as corrupt:
        CheckpointManager(root)
    said = str(corrupt.value)
    assert "run_id" not in said and "in another root" in said, said
    assert f"`atomic-checkpoint verify {root}`" in said, said  # names the root to check
    with pytest.raises(ResumeError, match="none is valid"):  # what it no longer advises
        CheckpointManager(root, run_id="fresh")


def test_restarted_job_continues_its_run_and_ignores_other_runs(tmp_path):
    a = CheckpointManager(tmp_path, run_id="run-a")
    a.save(1000, state(1))
    a.close()
    b = CheckpointManager(tmp_path, run_id="run-b", retention=KeepLast(1))
    assert b.latest() is None  # another run's checkpoint is not ours to resume
    b.save(1, state(1))
    b.save(2, state(2))
    b.close()
    assert (tmp_path / "checkpoint-1000").is_dir()  # foreign: never deleted
    with CheckpointManager(tmp_path, run_id="run-b") as listed:
        assert [c.step for c in listed.checkpoints()] == [2]
    # Without an explicit run id, a restarted job adopts the run recorded in the root.
    first = CheckpointManager(tmp_path / "c")
    first.save(1, state(1))
    first.close()
    with CheckpointManager(tmp_path / "c") as again:
        assert again.run_id == first.run_id and again.latest().step == 1


def test_a_run_named_by_the_first_job_is_recorded_for_restarts_that_do_not_name_it(
    tmp_path, caplog
):
    # The first job names its run; a restart without run_id continues it quietly (it
    # used to find no run file and "adopt" the checkpoints with a warning).
    with CheckpointManager(tmp_path, run_id="named-run") as first:
        first.save(1, state(1))
    assert (
        json.loads((tmp_path / ".atomic-checkpoint" / "run.json").read_text())["run_id"]
        == "named-run"
    )
    with (
        caplog.at_level(logging.WARNING, logger="atomic_checkpoint"),
        CheckpointManager(tmp_path) as again,
    ):
        assert again.run_id == "named-run" and again.latest().step == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_read_only_manager_never_writes(tmp_path):
    mgr = CheckpointManager(tmp_path / "r")
    mgr.save(1, state(1))
    before = sorted(str(p) for p in (tmp_path / "r").rglob("*"))
    ro = CheckpointManager(tmp_path / "r", read_only=True)
    assert ro.latest().step == 1 and same(ro.restore(), state(1))
    # Each refusal says what to do (save() said only "is read-only").
    for call in (lambda: ro.save(2, state(2)), lambda: ro.rollback(1), ro.apply_retention):
        with pytest.raises(ReadOnlyError, match="without read_only=True"):
            call()
    assert sorted(str(p) for p in (tmp_path / "r").rglob("*")) == before
    mgr.close()
    with pytest.raises(CheckpointError, match=r"is closed .*open a new CheckpointManager"):
        mgr.save(2, state(2))


def test_on_commit_sees_only_committed_paths(tmp_path):
    seen = []

    def hook(info):
        # The hook runs after the commit is durable: the manifest is there.
        seen.append(
            (info.step, info.path, (tmp_path / f"checkpoint-{info.step}" / MANIFEST_NAME).exists())
        )

    mgr = CheckpointManager(tmp_path, on_commit=hook)
    mgr.save(1, state(1))
    with mgr.saving(2) as d:
        (d / "x.txt").write_text("x")
    assert seen == [
        (1, str(tmp_path / "checkpoint-1"), True),
        (2, str(tmp_path / "checkpoint-2"), True),
    ]


def test_a_saving_block_that_writes_nothing_commits_nothing(tmp_path):
    # Committed, the empty step 200 was the newest checkpoint, and KeepLast(1) deleted
    # step 100, the only one holding weights (a save_pretrained(output_dir) slip).
    elsewhere = tmp_path / "output_dir"
    elsewhere.mkdir()
    mgr = CheckpointManager(tmp_path / "root", retention=KeepLast(1))
    with mgr.saving(100) as d:
        (d / "model.bin").write_bytes(b"w" * 1000)
    with (
        pytest.raises(CommitError, match=r"holds no file: the saving\(\) block wrote nothing"),
        mgr.saving(200),
    ):
        (elsewhere / "model.bin").write_bytes(b"w" * 1000)
    handle = mgr.saving_async(300, lambda d: None)
    with pytest.raises(CommitError, match="holds no file"):
        handle.result()
    with pytest.raises(CommitError):
        mgr.wait()
    assert [c.step for c in mgr.checkpoints()] == [100]
    assert mgr.verify(100).size_bytes == 1000
    mgr.close()
    assert os.listdir(tmp_path / "root" / PENDING_DIR) == []


def test_an_on_commit_callback_that_raises_is_logged_and_the_save_succeeds(tmp_path, caplog):
    # An upload that fails in on_commit must not report a committed checkpoint as
    # failed: the save returns its info (a retry would find the step taken), the
    # error is logged with its traceback, and later saves call the callback again.
    calls = []

    def upload(info):
        calls.append(info.step)
        raise RuntimeError(f"upload of step {info.step} failed")

    mgr = CheckpointManager(tmp_path, on_commit=upload)
    with caplog.at_level(logging.ERROR, logger="atomic_checkpoint"):
        assert mgr.save(1, state(1)).step == 1
        with mgr.saving(2) as d:
            (d / "x.txt").write_text("x")
        assert mgr.save_async(3, state(3)).result().step == 3
        mgr.close()  # no pending failure: step 3 committed
    assert calls == [1, 2, 3]
    failed = [r for r in caplog.records if "on_commit callback failed" in r.getMessage()]
    assert [r.exc_info[1].args[0] for r in failed] == [
        f"upload of step {s} failed" for s in (1, 2, 3)
    ]
    assert "checkpoint-3" in failed[2].getMessage()
    reader = CheckpointManager(tmp_path, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 2, 3]
    assert same(reader.restore(3), state(3))


@pytest.mark.parametrize("strategy", ["rename", "marker"])
def test_saving_refuses_a_file_named_like_the_manifest(tmp_path, strategy):
    # Copying the previous checkpoint into the block copies its manifest too; the
    # commit would write the real manifest over it, and the checkpoint would list a
    # manifest of the wrong size: committed, and corrupt from the start.
    mgr = CheckpointManager(tmp_path, strategy=strategy)
    with mgr.saving(1) as d:
        (d / "model.bin").write_bytes(b"v1")
    with pytest.raises(CheckpointError, match="manifest") as caught, mgr.saving(2) as d:
        shutil.copytree(mgr.checkpoint_path(1), d, dirs_exist_ok=True)
        (d / "model.bin").write_bytes(b"v2")
    assert "Nothing was committed" in str(caught.value)
    assert [c.step for c in mgr.checkpoints()] == [1]
    with mgr.saving(2) as d:  # the same save, without the manifest, commits
        (d / "model.bin").write_bytes(b"v2")
    mgr.verify(2)
    # (under attempt-<token>/ with the marker strategy)
    [model] = Path(mgr.checkpoint_path(2)).rglob("model.bin")
    assert model.read_bytes() == b"v2"


def test_keep_best_on_a_metric_no_save_records_warns_once_when_it_deletes(tmp_path, caplog):
    # A misspelt metric name makes KeepBest keep nothing: the best checkpoints go,
    # deleted by the newest-is-kept rule. The policy is not wrong to do so (a missing
    # metric is not kept, as documented), but the user is told, once, what is deleted.
    logs = caplog.at_level(logging.WARNING, logger="atomic_checkpoint")
    with logs, CheckpointManager(tmp_path, retention=KeepBest(2, metric="eval-loss")) as mgr:
        for step, loss in [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]:
            mgr.save(step, state(step), metrics={"eval_loss": loss})
        assert [c.step for c in mgr.checkpoints()] == [4]
    warned = [r.getMessage() for r in caplog.records if "records metric" in r.getMessage()]
    assert len(warned) == 1
    assert "'eval-loss'" in warned[0] and "they record: eval_loss" in warned[0]
    assert "checkpoint-1" in warned[0]
    caplog.clear()
    # Spelt right: kept by the metric, and no warning.
    other = tmp_path / "right"
    logs = caplog.at_level(logging.WARNING, logger="atomic_checkpoint")
    with logs, CheckpointManager(other, retention=KeepBest(2, metric="eval_loss")) as mgr:
        for step, loss in [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]:
            mgr.save(step, state(step), metrics={"eval_loss": loss})
        assert [c.step for c in mgr.checkpoints()] == [1, 2, 4]
    assert not [r for r in caplog.records if "records metric" in r.getMessage()]


def test_restore_refuses_a_device_this_process_has_not_got_before_reading(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last visible GPU
    with pytest.raises(CheckpointError, match=r"sees \d+ CUDA device\(s\)") as caught:
        mgr.restore(device=missing)
    assert not isinstance(caught.value, AssertionError) and missing in str(caught.value)
    with pytest.raises(ValueError, match="not a torch device"):
        mgr.restore(device="gpu0")
    assert same(mgr.restore(device="cpu"), state(1))


def test_a_second_manager_of_the_same_process_supersedes_the_first_and_says_so(tmp_path, caplog):
    # A notebook cell run again opens a second writable manager on ROOT: it takes the
    # lock over (a warning names the reason), and the first one's next save is fenced
    # with a message about this process, not about another job.
    first = CheckpointManager(tmp_path)
    first.save(1, state(1))
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        second = CheckpointManager(tmp_path)
    assert "earlier CheckpointManager of this same process" in caplog.text
    with pytest.raises(FencedError, match="newer CheckpointManager of this same process"):
        first.save(2, state(2))
    assert second.save(2, state(2)).step == 2
    second.close()
    first.close()  # fenced already: nothing of ROOT is its to release
    assert [c.step for c in CheckpointManager(tmp_path, read_only=True).checkpoints()] == [1, 2]


def test_saving_block_that_raises_discards_everything(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), mgr.saving(1) as d:
        (d / "half.bin").write_bytes(b"x" * 100)
        raise RuntimeError("boom")
    assert mgr.checkpoints() == [] and os.listdir(tmp_path / PENDING_DIR) == []
    assert not (tmp_path / "checkpoint-1").exists()


def test_saving_yields_a_path_that_carries_the_committed_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with mgr.saving(3, metrics={"loss": 0.5}) as d:
        assert isinstance(d, Path) and d.info is None  # nothing committed yet
        assert d.parent == tmp_path / PENDING_DIR
        (d / "model").mkdir()
        (d / "model" / "w.bin").write_bytes(b"w" * 10)
    assert d.info is not None and d.info.step == 3 and d.info.metrics == {"loss": 0.5}
    assert d.info.path == str(tmp_path / "checkpoint-3")
    assert d.info == mgr.last_saved and [c.step for c in mgr.checkpoints()] == [3]
    with pytest.raises(RuntimeError, match="boom"), mgr.saving(4) as failed:
        raise RuntimeError("boom")
    assert failed.info is None  # discarded: nothing to report


def test_foreign_directory_under_a_checkpoint_name_is_not_overwritten(tmp_path):
    (tmp_path / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "checkpoint-5" / "pytorch_model.bin").write_bytes(b"theirs")
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CommitError, match="not a committed checkpoint"):
        mgr.save(5, state(5))
    assert (tmp_path / "checkpoint-5" / "pytorch_model.bin").read_bytes() == b"theirs"
    # Asked explicitly, it is replaced atomically by a committed checkpoint.
    mgr.save(5, state(5), overwrite=True)
    assert same(mgr.restore(5), state(5))
    assert not (tmp_path / "checkpoint-5" / "pytorch_model.bin").exists()


def test_one_log_line_per_commit(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    with caplog.at_level(logging.INFO, logger="atomic_checkpoint"):
        info = mgr.save(1, state(1))
    lines = [r.getMessage() for r in caplog.records if "committed" in r.getMessage()]
    assert len(lines) == 1 and "checkpoint-1" in lines[0] and "/s" in lines[0]
    assert set(info.timings_s) >= {"prepare", "write", "fsync", "gather", "commit", "total"}


def test_the_timings_of_a_save_are_durations_that_fit_in_its_total(tmp_path):
    # A large enough state that the write dominates: each phase is a duration of its
    # own (never negative), and they add up to no more than the total.
    info = CheckpointManager(tmp_path).save(1, {"w": torch.zeros(1 << 22)})
    phases = {k: info.timings_s[k] for k in ("prepare", "write", "fsync", "gather", "commit")}
    assert all(v >= 0.0 for v in phases.values()), phases
    assert sum(phases.values()) <= info.timings_s["total"] * 1.01 + 1e-3, info.timings_s


def test_crashed_save_leftovers_are_swept_at_start(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    (tmp_path / PENDING_DIR / "checkpoint-2.0123456789abcdef").mkdir()
    (
        tmp_path / PENDING_DIR / "checkpoint-2.0123456789abcdef" / "rank-00000.safetensors"
    ).write_bytes(b"x")
    assert [c.step for c in mgr.checkpoints()] == [1]  # pending data is never a checkpoint
    mgr.close()  # else its lease renewal, fenced by the next start, logs after the test
    CheckpointManager(tmp_path).close()
    assert os.listdir(tmp_path / PENDING_DIR) == []


def test_adopt_existing_records_another_tools_checkpoints_under_the_held_lock(tmp_path):
    # A job whose manager is open (it holds the run lock, so atomic_checkpoint.adopt
    # is refused) records the checkpoint another tool wrote into ROOT meanwhile.
    from atomic_checkpoint import LockHeldError, ReadOnlyError, adopt

    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root)
    mgr.save(1, {"x": np.arange(3)})
    stock = root / "checkpoint-5"
    (stock / "model").mkdir(parents=True)
    (stock / "model" / "weights.bin").write_bytes(b"w" * 4096)
    (stock / "state.json").write_text("{}")
    with pytest.raises(LockHeldError):
        adopt(root, framework="generic")
    result = mgr.adopt_existing(framework="generic")
    assert result.adopted == [5] and result.refused == {} and result.already == [1]
    assert [c.step for c in mgr.checkpoints()] == [1, 5]
    info = mgr.checkpoints()[-1]
    assert info.adopted and info.commit_seq > mgr.checkpoints()[0].commit_seq
    mgr.verify(5)
    assert mgr.adopt_existing(framework="generic").already == [1, 5]  # idempotent
    mgr.save(6, {"x": np.arange(3)})  # the commit numbers go on after the adopted one
    assert mgr.checkpoints()[-1].commit_seq > info.commit_seq
    mgr.close()
    with CheckpointManager(root, read_only=True) as reader, pytest.raises(ReadOnlyError):
        reader.adopt_existing()


def test_restoring_a_step_that_is_not_there_says_which_steps_are(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ck") as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": np.zeros(2)})
        with pytest.raises(CheckpointNotFoundError) as missing:
            mgr.restore(15)
        text = str(missing.value)
        assert "no checkpoint step 15" in text and "checkpoint steps there: 10, 20;" in text
        # Of many, the steps around the one asked for, and how many there are: the 10
        # newest alone left out 10 and 20 without saying the list was cut.
        for step in range(991, 1001):
            mgr.save(step, {"w": np.zeros(2)})
        with pytest.raises(CheckpointNotFoundError) as missing:
            mgr.restore(15)
        assert "there: 10, 20, 991, 992, 993, 994 ... 1000 (12 in all);" in str(missing.value)
        # A directory of that name that was never committed is named as such.
        (tmp_path / "ck" / "checkpoint-15").mkdir()
        with pytest.raises(
            CheckpointNotFoundError, match="has no manifest: it was never committed"
        ):
            mgr.restore(15)


def test_a_marker_roots_step_taken_by_rotation_or_being_saved_is_named_so(tmp_path: Path) -> None:
    # Marker roots (object stores, s3fs mounts) un-commit in place: a reader whose
    # step rotation took mid-read was told it was "never committed (a crashed save or
    # another tool wrote it)".
    from atomic_checkpoint.strategies import MarkerStrategy

    with CheckpointManager(tmp_path / "ck", strategy="marker") as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": np.zeros(2)})
        assert MarkerStrategy().uncommit(mgr.storage, 10) is not None  # its data stays
        with pytest.raises(CheckpointNotFoundError, match=r"un-committed \(rotation or rollback"):
            mgr.restore(10)
        MarkerStrategy().prepare(mgr.storage, 30, "0123456789abcdef")
        with pytest.raises(CheckpointNotFoundError, match="a save that has not committed"):
            mgr.restore(30)


def test_restoring_into_a_state_of_another_shape_never_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The target is wrong, not the checkpoints: restore() must not skip them one by one
    # as corrupt and end with "no checkpoint verifies".
    with CheckpointManager(tmp_path / "ck") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.zeros(4, 3)})
        with (
            caplog.at_level(logging.WARNING, logger="atomic_checkpoint"),
            pytest.raises(StateMismatchError, match=r"shape \(4, 3\).*shape \(3, 4\)"),
        ):
            mgr.restore(into={"w": torch.zeros(3, 4)})
        assert not [r for r in caplog.records if "skipping" in r.getMessage()]
        assert isinstance(StateMismatchError("x"), ValueError)
        assert torch.equal(mgr.restore(into={"w": torch.ones(4, 3)})["w"], torch.zeros(4, 3))


def test_another_runs_checkpoint_of_the_same_step_is_never_replaced(tmp_path):
    """Run b's checkpoint-500 sits in run a's root. a's save of step 500 is refused,
    saying whose it is, and ``overwrite=True`` does not delete b's checkpoint either
    (other runs' checkpoints are never counted, resumed from or deleted)."""
    with CheckpointManager(tmp_path, run_id="run-b") as b:
        b.save(500, state(1))
    with CheckpointManager(tmp_path, run_id="run-a") as a:
        for overwrite in (False, True):
            with pytest.raises(CheckpointExistsError, match=r"another run .'run-b'") as caught:
                a.save(500, state(2), overwrite=overwrite)
            assert "overwrite=True included" in str(caught.value)
        a.save(600, state(3))
    with CheckpointManager(tmp_path, run_id="run-b", read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [500]
        assert same(reader.restore(500), state(1))


def test_a_step_whose_manifest_cannot_be_read_is_not_called_committed(tmp_path):
    """checkpoint-20's manifest is truncated (a disk fault): it is no checkpoint (the
    listing says corrupt, restore skips it), so a save of step 20 must not say "already
    committed". It is still never replaced silently: overwrite=True replaces it."""
    with CheckpointManager(tmp_path) as first:
        first.save(10, state(10))
        first.save(20, state(20))
    manifest = tmp_path / "checkpoint-20" / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:40])
    with CheckpointManager(tmp_path) as mgr:
        assert same(mgr.restore(), state(10))
        with pytest.raises(CheckpointExistsError, match="is not a valid checkpoint") as caught:
            mgr.save(20, state(21))
        assert "already committed" not in str(caught.value)
        assert "overwrite=True" in str(caught.value)
        mgr.save(20, state(21), overwrite=True)
        assert same(mgr.restore(20), state(21))


def test_arguments_a_user_gets_wrong_are_refused_at_construction(tmp_path, monkeypatch):
    """Each of these used to be accepted and to fail later, or never: the class
    ``KeepLast`` as a policy (every rotation failed, only logged: the disk filled),
    ``timeout_s=inf`` (``close()`` raised ``OverflowError`` and kept the run lock),
    ``root=None`` (an ``AttributeError``), ``root=""`` (an unset variable: the current
    directory became the root)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=r"KeepLast\(3\), not the class KeepLast"):
        CheckpointManager(tmp_path / "a", retention=KeepLast)
    with pytest.raises(TypeError, match=r"KeepLast\(3\) keeps the 3 newest"):
        CheckpointManager(tmp_path / "a", retention=3)
    for bad in (float("inf"), float("nan"), 0, -5):
        with pytest.raises(ValueError, match="timeout_s must be a positive, finite number"):
            CheckpointManager(tmp_path / "a", timeout_s=bad)
    for root in (None, 123, b"ckpt"):
        with pytest.raises(TypeError, match="root must be a path"):
            CheckpointManager(root)
    for root in ("", "  "):
        with pytest.raises(ValueError, match="root is an empty path"):
            CheckpointManager(root)
    assert os.listdir(tmp_path) == []  # nothing was created anywhere
    # A policy set later is checked the same way; the valid one is kept.
    with CheckpointManager(tmp_path / "b", retention=KeepLast(2)) as mgr:
        with pytest.raises(TypeError, match="not the class"):
            mgr.retention = KeepLast
        assert mgr.retention == KeepLast(2) or repr(mgr.retention) == repr(KeepLast(2))
        mgr.retention = None
        assert mgr.retention is None


def test_flags_given_as_text_are_refused_before_anything_happens(tmp_path):
    # "no" and "false" are truthy: overwrite="no" replaced a committed checkpoint, and
    # read_only="false" opened the root read-only (settings read from a config file).
    for name in ("read_only", "allow_pickle", "takeover"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 'false'"):
            CheckpointManager(tmp_path / "a", **{name: "false"})
    with CheckpointManager(tmp_path / "b") as mgr:
        first = mgr.save(1, state(1))
        for call in (
            lambda: mgr.save(1, state(2), overwrite="no"),
            lambda: mgr.save_async(1, state(2), overwrite="no"),
            lambda: mgr.save(2, state(2), replicated="no"),
            lambda: mgr.saving(1, overwrite="no").__enter__(),
            lambda: mgr.restore(1, verify="no"),
            lambda: mgr.rollback(1, allow_empty="no"),
        ):
            with pytest.raises(TypeError, match="must be True or False"):
                call()
        assert [c.step for c in mgr.checkpoints()] == [1]
        assert mgr.latest().commit_seq == first.commit_seq  # not replaced
        assert mgr.save(2, state(2), overwrite=np.bool_(False)).step == 2  # numpy's bool


def test_one_save_at_a_time_per_manager_keeps_the_step_order(tmp_path):
    """A save inside a ``saving()`` block committed before the block's step, and two
    threads saving through one manager committed out of step order: both passed the
    step check before either committed. Now a nested save is an error and threads
    take turns, so every commit is above the ones before it (or is refused)."""
    import threading

    with CheckpointManager(tmp_path) as mgr:
        with mgr.saving(5) as d:
            (d / "f").write_bytes(b"x")
            with pytest.raises(CheckpointError, match="inside a save of this manager"):
                mgr.save(6, state(6))
        assert [c.step for c in mgr.checkpoints()] == [5]
        mgr.save(6, state(6))  # after the block: fine

        refused: list[int] = []

        def saver(offset: int) -> None:
            for i in range(20):
                step = 100 + 2 * i + offset
                try:
                    mgr.save(step, state(1))
                except StepOrderError:
                    refused.append(step)

        threads = [threading.Thread(target=saver, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        listed = mgr.checkpoints()
    by_seq = [c.step for c in sorted(listed, key=lambda c: c.commit_seq)]
    assert by_seq == sorted(by_seq), by_seq  # committed in step order
    assert len(by_seq) - 2 + len(refused) == 40  # every save committed or was refused


def test_metrics_must_be_numbers(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        for bad in ("0.5", b"1", None, [1.0]):
            with pytest.raises(TypeError, match="metric 'loss' must be a number"):
                mgr.save(1, state(1), metrics={"loss": bad})
        assert mgr.checkpoints() == []  # nothing was written
        # A diverged loss is left out of the manifest, not a lost save.
        assert mgr.save(1, state(1), metrics={"loss": float("nan"), "acc": 0.5}).metrics == {
            "acc": 0.5
        }
        info = mgr.save(2, state(2), metrics={"loss": torch.tensor(0.25), "acc": np.float32(0.5)})
        assert info.metrics == {"loss": 0.25, "acc": 0.5}


def test_a_read_only_manager_on_a_missing_root_says_it_is_missing(tmp_path, caplog):
    # The CLI exits 2 on a missing ROOT; the library's reader said nothing and found no
    # checkpoint, which a typo in a resume path then looked like a fresh start. INFO: a
    # watcher that polls a root before the job creates it is no mistake.
    with caplog.at_level(logging.INFO, logger="atomic_checkpoint"):
        reader = CheckpointManager(tmp_path / "chekpoints", read_only=True)
    assert reader.latest() is None
    assert "does not exist (a mistyped path?)" in caplog.text
    # restore() says it too (an evaluation job with a typo polled an "empty" root).
    with pytest.raises(CheckpointNotFoundError, match="chekpoints: it does not exist"):
        reader.restore()
    assert not (tmp_path / "chekpoints").exists()  # a reader creates nothing
    caplog.clear()
    (tmp_path / "ok").mkdir()
    with caplog.at_level(logging.INFO, logger="atomic_checkpoint"):
        CheckpointManager(tmp_path / "ok", read_only=True).close()
    assert "does not exist" not in caplog.text


def test_storage_domains_is_checked_in_a_single_process_too(tmp_path):
    with pytest.raises(ValueError, match="storage_domains must be 'auto', 'shared' or"):
        CheckpointManager(tmp_path, storage_domains="per_host")
    assert not tmp_path.joinpath(".atomic-checkpoint").exists()


def test_one_checkpoint_that_cannot_be_deleted_does_not_stop_retention(tmp_path, caplog):
    # Oldest first, the first failure ended the loop: with checkpoint-2 undeletable
    # (another owner, immutable), 3, 4 and 5 were never deleted and the disk filled.
    from atomic_checkpoint.errors import StorageError

    mgr = CheckpointManager(tmp_path)
    for s in (1, 2, 3, 4, 5):
        mgr.save(s, state(s))
    real = mgr._delete_checkpoint

    def delete(step: int) -> None:
        if step == 2:
            raise StorageError("rename checkpoint-2 failed: Operation not permitted", errno=1)
        real(step)

    mgr._delete_checkpoint = delete  # type: ignore[method-assign]
    mgr.retention = KeepLast(1)
    with pytest.raises(StorageError, match=r"could not delete checkpoint step\(s\) \[2\]"):
        mgr.apply_retention()
    assert [c.step for c in mgr.checkpoints()] == [2, 5]  # the others went
    mgr._delete_checkpoint = real  # type: ignore[method-assign]
    assert mgr.apply_retention() == [2]  # retried, once it can be
    mgr.close()


def test_on_commit_and_coordinator_that_cannot_work_are_refused_at_once(tmp_path):
    # Accepted, on_commit=[cb] failed after every save (logged) and never ran; a
    # coordinator of the wrong kind failed inside the first exchange with an
    # AttributeError.
    with pytest.raises(TypeError, match="on_commit must be a callable"):
        CheckpointManager(tmp_path, on_commit=[print])
    with pytest.raises(TypeError, match="no all_gather, broadcast, clone"):
        CheckpointManager(tmp_path, coordinator="torch")
    bad_rank = SingleProcessCoordinator()
    bad_rank.rank = 1
    with pytest.raises(ValueError, match="rank 1 of world_size 1"):
        CheckpointManager(tmp_path, coordinator=bad_rank)
    assert not os.path.exists(tmp_path / ".atomic-checkpoint")  # nothing was written


class _Wrapper:
    """A user's Storage: the documented protocol, each call passed on to a
    LocalStorage, whose capabilities it copies (``direct_io`` among them)."""

    def __init__(self, inner: LocalStorage):
        self._inner = inner
        self.capabilities = inner.capabilities


for _name in [
    "url",
    "local_path",
    "makedirs",
    "open_write",
    "open_read",
    "read_bytes",
    "write_bytes_atomic",
    "create_exclusive",
    "listdir",
    "size",
    "is_dir",
    "walk_files",
    "fsync_dir",
    "delete_file",
    "delete_tree",
    "refresh",
    "rename_dir",
    "exchange_dirs",
]:
    setattr(_Wrapper, _name, lambda self, *a, _n=_name, **k: getattr(self._inner, _n)(*a, **k))


def test_a_wrapping_storage_that_copied_direct_io_capabilities_works_without_it(tmp_path):
    # restore() (and a large save) failed with "'_Wrapper' object has no attribute
    # 'direct_io_enabled'".
    wrapper = _Wrapper(LocalStorage(tmp_path))
    assert wrapper.capabilities.direct_io
    with CheckpointManager(wrapper) as mgr:
        mgr.save(1, state(1))
        assert same(mgr.restore(), state(1))


def test_a_reader_says_that_a_newer_step_directory_has_no_manifest(tmp_path, caplog):
    # An evaluator (read_only=True) went back to step 2 in silence when checkpoint-3
    # had lost its manifest; a writable start warned.
    with CheckpointManager(tmp_path) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state(s))
    os.remove(tmp_path / "checkpoint-3" / MANIFEST_NAME)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        reader = CheckpointManager(tmp_path, read_only=True)
    assert "checkpoint-3, newer than step 2 (the newest valid checkpoint), has no manifest" in (
        caplog.text
    )
    assert reader.latest().step == 2


def test_an_empty_step_directory_is_removed_before_anything_is_written(tmp_path, caplog):
    # An interrupted copy left checkpoint-3/ empty: the restarted job wrote every
    # rank's data, then the rename failed with a bare "already exists"; then the save
    # refused the empty directory, which holds nothing to lose (FAILURE_MODES E3: a
    # leftover never blocks a save of the same step).
    with CheckpointManager(tmp_path) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state(s))
    shutil.rmtree(tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3").mkdir()
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = CheckpointManager(tmp_path)
    assert "checkpoint-3, newer than step 2 (the newest valid checkpoint), has no manifest" in (
        caplog.text
    )
    with mgr:
        assert mgr.latest().step == 2
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            mgr.save(3, state(3))
        assert "removing" in caplog.text and "never a checkpoint" in caplog.text
        assert same(mgr.restore(3), state(3))
        assert os.listdir(tmp_path / PENDING_DIR) == []


@pytest.mark.parametrize("left", ["attempt", "empty"])
def test_a_marker_strategy_leftover_never_blocks_a_renaming_save_of_its_step(tmp_path, left):
    # A marker-strategy save (or retention delete) killed on a local root, then the job
    # restarted with the default strategy (rename): save(N) raised "exists but is not a
    # committed checkpoint", at every restart, since the rename strategy's sweep does
    # not look inside checkpoint directories.
    with CheckpointManager(tmp_path, strategy="marker") as mgr:
        mgr.save(1, state(1))
        if left != "empty":
            mgr.save(2, state(2))
    step_dir = tmp_path / "checkpoint-2"
    if left == "empty":
        step_dir.mkdir()
    else:
        (step_dir / MANIFEST_NAME).unlink()  # cut short before its commit, or un-committed
        assert [n for n in os.listdir(step_dir) if parse_attempt_dir(n)], os.listdir(step_dir)
    user_dir = tmp_path / "checkpoint-3"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("mine")  # not ours: still never removed
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest().step == 1
        mgr.save(2, state(2))
        assert same(mgr.restore(2), state(2))
        with pytest.raises(CommitError, match="exists but is not a committed checkpoint"):
            mgr.save(3, state(3))
    assert (user_dir / "notes.txt").read_text() == "mine"


def test_a_checkpoint_of_a_newer_format_is_never_replaced_overwrite_included(tmp_path):
    # docs/format.md: a checkpoint of a higher schema_version is skipped, never
    # replaced or deleted. save(step, overwrite=True) replaced it, and the refusal of a
    # plain save advised exactly that.
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    path = tmp_path / "checkpoint-2" / MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["schema_version"] = 999
    path.write_text(json.dumps(doc))
    newer = path.read_bytes()
    with CheckpointManager(tmp_path) as mgr:
        for overwrite in (False, True):
            with pytest.raises(CheckpointExistsError, match="newer version") as info:
                mgr.save(2, state(20), overwrite=overwrite)
            assert "Pass overwrite=True" not in str(info.value)
    assert path.read_bytes() == newer


def test_a_reader_of_a_root_without_a_run_file_follows_the_newest_checkpoints_run(tmp_path):
    # It listed every run's checkpoints and restored another run's newer step.
    for rid, steps in (("run-a", (100, 200)), ("run-b", (150, 300))):
        with CheckpointManager(tmp_path / rid, run_id=rid) as mgr:
            for s in steps:
                mgr.save(s, state(s))
        for s in steps:
            shutil.copytree(
                tmp_path / rid / f"checkpoint-{s}", tmp_path / "mix" / f"checkpoint-{s}"
            )
    with CheckpointManager(tmp_path / "mix", read_only=True) as reader:
        assert reader.run_id == "run-b"
        assert [c.step for c in reader.checkpoints()] == [150, 300]
    with CheckpointManager(tmp_path / "mix", read_only=True, run_id="run-a") as reader:
        assert [c.step for c in reader.checkpoints()] == [100, 200]


@pytest.mark.parametrize("read_only", [False, True])
def test_a_checkpoint_directory_opened_as_a_root_is_refused(tmp_path, read_only):
    # It held no checkpoint as a root: the job started from scratch and its save wrote
    # a run (.atomic-checkpoint/, .pending/, checkpoint-1/) inside the checkpoint.
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(30, state(30))
    one = tmp_path / "root" / "checkpoint-30"
    before = sorted(os.listdir(one))
    with pytest.raises(CheckpointError, match=r"is one checkpoint .*restore\(step=30\)"):
        CheckpointManager(one, read_only=read_only)
    assert sorted(os.listdir(one)) == before


def test_bad_numbers_and_ranks_are_clear_errors(tmp_path):
    # lease_s='x' and wait(timeout_s='x') failed inside a comparison, a negative
    # visibility_timeout_s was accepted, restore(rank='0') failed formatting a name and
    # rank=True read rank 1.
    with pytest.raises(TypeError, match="lease_s must be a number of seconds"):
        CheckpointManager(tmp_path, lease_s="x")
    with pytest.raises(ValueError, match="visibility_timeout_s must be a positive"):
        CheckpointManager(tmp_path, visibility_timeout_s=-1)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state(1))
        for bad in ("0", True):
            with pytest.raises(TypeError, match="rank must be an int"):
                mgr.restore(rank=bad)
        mgr.save_async(2, state(2))
        with pytest.raises(TypeError, match="timeout_s must be a number of seconds"):
            mgr.wait(timeout_s="x")
        assert mgr.wait(timeout_s=30).step == 2


def test_bounds_given_as_text_or_bool_are_refused_and_a_negative_result_timeout_too(tmp_path):
    # timeout_s="10", b"10" and True (a 1 s bound) were accepted, since float() takes
    # them; wait(timeout_s=True) polled for 1 s; handle.result(timeout=-1) of a running
    # save raised TimeoutError "still running after -1 s".
    for name in ("timeout_s", "lease_s", "visibility_timeout_s"):
        for bad in ("10", b"10", True):
            with pytest.raises(TypeError, match=f"{name} must be a number of seconds"):
                CheckpointManager(tmp_path / "never", **{name: bad})
    assert not (tmp_path / "never").exists()
    with CheckpointManager(tmp_path / "root") as mgr:
        handle = mgr.save_async(1, state(1))
        for bad in ("5", True):
            with pytest.raises(TypeError, match="must be a number of seconds"):
                mgr.wait(timeout_s=bad)
            with pytest.raises(TypeError, match="timeout must be a number of seconds"):
                handle.result(timeout=bad)
        with pytest.raises(ValueError, match="timeout must be a positive"):
            handle.result(timeout=-1)
        assert handle.result(timeout=30).step == 1
        assert handle.result(timeout=0).step == 1  # 0 polls


def test_restore_to_a_device_this_process_cannot_use_is_a_checkpoint_error(tmp_path):
    # device="mps" (or "xpu") on a machine without it raised torch's NotImplementedError
    # or AssertionError from the first tensor, after the file was read.
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"t": torch.ones(2)})
        for device in ("mps", "xpu"):
            if (
                getattr(torch, device, None) is not None and getattr(torch, device).is_available()
            ):  # pragma: no cover - a machine that has one
                continue
            with pytest.raises(CheckpointError, match=f"cannot allocate on {device}"):
                mgr.restore(device=device)
        assert mgr.restore(device="meta")["t"].device.type == "meta"


def test_a_storage_object_that_lacks_part_of_the_protocol_is_refused_at_open(tmp_path):
    # A user's wrapper that forwards only the methods its author thought of was
    # accepted (it had listdir and url), and its first save failed at the commit with
    # an AttributeError, after the rank's files were written.
    from atomic_checkpoint.storage.local import LocalStorage

    class Forwarding:
        def __init__(self, inner):
            self.inner = inner
            self.capabilities = inner.capabilities

        def __getattr__(self, name):
            if name in ("fsync_dir", "refresh"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    root = tmp_path / "root"
    with pytest.raises(
        TypeError, match=r"Forwarding is not a Storage: it lacks fsync_dir, refresh"
    ):
        CheckpointManager(Forwarding(LocalStorage(str(root))))
    assert not root.exists()  # refused before anything was written
    # adopt() and a tier of TieredCheckpointManager take a Storage too: the same check.
    from atomic_checkpoint import Tier, TieredCheckpointManager, adopt

    with pytest.raises(TypeError, match=r"Forwarding is not a Storage: it lacks fsync_dir"):
        adopt(Forwarding(LocalStorage(str(root))))
    with pytest.raises(TypeError, match=r"root must be a path .* got NoneType"):
        adopt(None)
    with pytest.raises(TypeError, match=r"Forwarding is not a Storage: it lacks fsync_dir"):
        TieredCheckpointManager(
            [Tier(tmp_path / "fast"), Tier(Forwarding(LocalStorage(str(root))))]
        )
    assert not root.exists()

    bad_caps = LocalStorage(str(root))
    bad_caps.capabilities = {"atomic_rename": True}
    with pytest.raises(TypeError, match=r"capabilities must be a StorageCapabilities .*, got dict"):
        CheckpointManager(bad_caps)

    class Complete(Forwarding):
        def __getattr__(self, name):
            return getattr(self.inner, name)

    # A wrapper that forwards everything is a Storage, found through __getattr__.
    with CheckpointManager(Complete(LocalStorage(str(root)))) as mgr:
        mgr.save(1, {"x": torch.zeros(2)})
        assert mgr.latest().step == 1


def test_what_a_run_remembers_of_its_checkpoints_stays_as_small_as_the_root(tmp_path):
    # The steps known to verify grew by one per save, never pruned when retention
    # deleted them: unbounded over a week-long run.
    with CheckpointManager(tmp_path, retention=KeepLast(2)) as mgr:
        for step in range(1, 61):
            mgr.save(step, {"x": torch.zeros(1)})
        mgr.checkpoints()  # the last rotation has ended
        assert len(mgr._known_good) <= 3, sorted(mgr._known_good)


def test_a_storage_without_directory_rename_commits_by_marker(tmp_path):
    # A user's Storage with exactly the documented protocol (no rename_dir): its
    # capabilities default to an atomic rename, the rename strategy was chosen, and
    # every save failed with "cannot rename directories ... committed with the marker
    # strategy", which it was not.
    from atomic_checkpoint.storage import StorageCapabilities
    from atomic_checkpoint.storage.memory import MemoryStorage

    class NoRename:
        def __init__(self):
            self.inner = MemoryStorage()
            self.capabilities = StorageCapabilities(name="docstore")

        def __getattr__(self, name):
            if name in ("rename_dir", "exchange_dirs"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    with CheckpointManager(NoRename()) as mgr:
        assert mgr.strategy.name == "marker"
        mgr.save(1, {"x": torch.zeros(2)})
        assert mgr.latest().step == 1


def test_the_info_a_save_returns_equals_the_one_read_back(tmp_path):
    # The save's timings made them differ: `info in mgr.checkpoints()` was False for
    # the checkpoint just saved.
    with CheckpointManager(tmp_path) as mgr:
        info = mgr.save(1, {"x": torch.zeros(2)}, metrics={"loss": 0.5})
        assert info.timings_s  # still reported
        assert info == mgr.latest() and info in mgr.checkpoints()


def test_collective_calls_inside_on_commit_are_refused_with_one_process_too(tmp_path):
    """A rollback() inside on_commit of a synchronous save deleted the checkpoint the
    save then returned; latest() and checkpoints() there worked with one process and
    hung or failed once the job had several ranks. Refused, as the FAQ says."""
    seen: dict[str, str] = {}

    def on_commit(info):
        calls = {
            "latest": mgr.latest,
            "checkpoints": mgr.checkpoints,
            "restore": mgr.restore,
            "apply_retention": mgr.apply_retention,
            "rollback": lambda: mgr.rollback(0, allow_empty=True),
        }
        for name, call in calls.items():
            try:
                call()
                seen[name] = "ran"
            except CheckpointError as exc:
                seen[name] = str(exc)

    mgr = CheckpointManager(tmp_path, on_commit=on_commit)
    info = mgr.save(1, {"w": 1})
    assert set(seen) == {"latest", "checkpoints", "restore", "apply_retention", "rollback"}
    assert all("made from on_commit" in why for why in seen.values()), seen
    assert os.path.isdir(info.path) and mgr.latest() == info
    mgr.close()


def test_a_new_retention_policy_never_changes_the_clean_up_of_a_save_that_returned(tmp_path):
    """Saved under KeepLast(1), step 1 was kept or deleted depending on whether the
    background rotation had run before `mgr.retention = None`; the setter now waits for it."""
    for pause in (0.0, 0.3):
        root = tmp_path / f"pause-{pause}"
        mgr = CheckpointManager(root, retention=KeepLast(1))
        mgr.save(1, {"w": 1})
        mgr.save(2, {"w": 2})
        time.sleep(pause)
        mgr.retention = None
        mgr.save(3, {"w": 3})
        assert [c.step for c in mgr.checkpoints()] == [2, 3]
        mgr.close()
