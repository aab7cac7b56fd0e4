"""The Trainer integration on runs that already have stock checkpoints, switched on the
Trainer's way (``AtomicCheckpointCallback``), and the run lock on every error path.

Real transformers in this process (tiny GPT-2 built from a config, CPU, no downloads):
stock checkpoints are written by the stock Trainer itself, torn ones by removing what
a crash mid-save leaves missing (the kill test at the end tears one with a real
SIGKILL).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the Trainer integration needs transformers")

from transformers import Trainer

from atomic_checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LockHeldError,
    ResumeError,
)
from atomic_checkpoint.catalog import read_manifest
from atomic_checkpoint.errors import CheckpointExistsError
from atomic_checkpoint.integrations.hf import (
    SUPPORTED_TRANSFORMERS,
    AtomicCheckpointCallback,
    make_atomic,
)
from atomic_checkpoint.lock import read_lock_holder
from atomic_checkpoint.storage import open_storage

from .helpers import RUN_TIMEOUT_S, SCRIPTS, communicate, job_env, run_job, spawn
from .test_hf_trainer import _load, _torchrun, cpu_multiprocess_resume

sys.path.insert(0, str(SCRIPTS))
from tiny_hf import RandomTokens, SnapshotAt, tiny_args, tiny_model


def _trainer(out: Path, max_steps: int, callbacks: list[Any] | None = None) -> Trainer:
    return Trainer(
        model=tiny_model(),
        args=tiny_args(str(out), max_steps=max_steps),
        train_dataset=RandomTokens(32),
        callbacks=callbacks,
    )


def _stock_run(out: Path, max_steps: int = 4) -> None:
    """The stock Trainer, no atomic-checkpoint: checkpoint-2, checkpoint-4, ..."""
    _trainer(out, max_steps).train()
    assert not (out / "checkpoint-2" / "checkpoint.manifest.json").exists()


def _tear(folder: Path) -> None:
    """What a crash mid-save leaves: the model written, the rest (optimizer, scheduler,
    RNG, and trainer_state.json, written last) not yet."""
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        (folder / name).unlink(missing_ok=True)


def _lock_free(out: Path) -> bool:
    return read_lock_holder(open_storage(str(out))) is None


def _manifests(out: Path) -> dict[str, bool]:
    """checkpoint folder -> adopted flag of its manifest (folders without one left out)."""
    storage = open_storage(str(out))
    found = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("checkpoint-") and (out / name / "checkpoint.manifest.json").exists():
            found[name] = bool(read_manifest(storage, name).adopted)
    return found


# ---------------------------------------------------------------------- the switch
@pytest.mark.timeout(120)
def test_callback_passed_at_construction_makes_saves_atomic_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _trainer(out, 4, callbacks=[AtomicCheckpointCallback()])
    first.train()
    assert _manifests(out) == {"checkpoint-2": False, "checkpoint-4": False}
    assert first.state.global_step == 4 and _lock_free(out)

    # The stock resume rule, through the integration: the newest complete checkpoint.
    snap = SnapshotAt(0)
    again = _trainer(out, 6, callbacks=[AtomicCheckpointCallback(), snap])
    again.train(resume_from_checkpoint=True)
    assert snap.first_step_seen == 4
    assert sorted(_manifests(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


@pytest.mark.timeout(60)
def test_callback_added_after_construction_refuses_to_train(tmp_path: Path) -> None:
    """add_callback() comes after on_init_end: too late to wrap train(), so the run
    stops before its first step instead of saving non-atomically."""
    out = tmp_path / "out"
    trainer = _trainer(out, 2)
    trainer.add_callback(AtomicCheckpointCallback())
    with pytest.raises(CheckpointError, match=r"callbacks=\[AtomicCheckpointCallback\(\)\]"):
        trainer.train()
    assert not out.exists() or not [n for n in os.listdir(out) if n.startswith("checkpoint-")]


@pytest.mark.timeout(60)
def test_callback_and_make_atomic_together_are_refused(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "out", 2, callbacks=[AtomicCheckpointCallback()])
    with pytest.raises(CheckpointError, match="already applied"):
        make_atomic(trainer)


@pytest.mark.timeout(60)
def test_unsupported_private_method_signature_names_the_supported_releases(
    tmp_path: Path,
) -> None:
    """A Trainer whose _save_checkpoint takes other parameters (a future transformers,
    or a subclass that changed it) is refused up front, not broken mid-save."""

    class Changed(Trainer):
        def _save_checkpoint(self, model: Any, checkpoint_dir: str) -> None:  # type: ignore[override]
            raise AssertionError("never called")

    trainer = Changed(model=tiny_model(), args=tiny_args(str(tmp_path / "out"), max_steps=2))
    with pytest.raises(TypeError) as err:
        make_atomic(trainer)
    assert SUPPORTED_TRANSFORMERS in str(err.value)
    assert "_save_checkpoint(model, checkpoint_dir)" in str(err.value)

    # One parameter more, without a default: accepted, and train() failed at the first
    # save with "missing 1 required positional argument".
    class OneMore(Trainer):
        def _save_checkpoint(self, model: Any, trial: Any, metrics: Any) -> None:  # type: ignore[override]
            raise AssertionError("never called")

    class WithDefault(Trainer):
        def _save_checkpoint(self, model: Any, trial: Any, metrics: Any = None) -> None:  # type: ignore[override]
            super()._save_checkpoint(model, trial)

    args = tiny_args(str(tmp_path / "out"), max_steps=2)
    with pytest.raises(TypeError, match=r"_save_checkpoint\(model, trial, metrics\)"):
        make_atomic(OneMore(model=tiny_model(), args=args))
    make_atomic(WithDefault(model=tiny_model(), args=args))  # the Trainer's call works


# ---------------------------------------------------------------------- adoption
@pytest.mark.timeout(120)
def test_stock_checkpoints_without_opt_in_error_says_how_to_opt_in(tmp_path: Path) -> None:
    """The day-one case: stock checkpoint-2 and -4, then make_atomic and
    resume_from_checkpoint=True. Refused (nothing adopted silently), saying which are
    complete and exactly how to opt in; the run lock is released, so the next Trainer
    of the process does not have to take it over."""
    out = tmp_path / "out"
    _stock_run(out)
    with pytest.raises(ResumeError) as err:
        make_atomic(_trainer(out, 6)).train(resume_from_checkpoint=True)
    message = str(err.value)
    assert "['checkpoint-2', 'checkpoint-4'] can be adopted" in message
    assert "make_atomic(trainer, adopt_existing=True)" in message
    assert "AtomicCheckpointCallback(adopt_existing=True)" in message
    assert f"atomic-checkpoint adopt {out}" in message
    assert _manifests(out) == {}  # nothing written without the opt-in
    assert _lock_free(out)


@pytest.mark.timeout(120)
def test_training_from_scratch_over_complete_stock_checkpoints_is_refused_not_replacing_them(
    tmp_path: Path,
) -> None:
    """train() without resume_from_checkpoint into a stock run's output_dir: its saves
    replaced the complete stock checkpoint-2 and -4 as training reached their steps
    (with a warning calling them torn). Refused before any step; a torn one alone is
    still replaced."""
    out = tmp_path / "out"
    _stock_run(out)
    before = (out / "checkpoint-2" / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointExistsError) as err:
        make_atomic(_trainer(out, 4)).train()
    message = str(err.value)
    assert "['checkpoint-2', 'checkpoint-4']" in message and "Nothing was trained" in message
    assert "resume_from_checkpoint=True" in message and "another output_dir" in message
    assert (out / "checkpoint-2" / "model.safetensors").read_bytes() == before
    assert _manifests(out) == {} and _lock_free(out)
    # Torn ones are not the user's checkpoints: replaced by the saves, as before.
    _tear(out / "checkpoint-2")
    _tear(out / "checkpoint-4")
    make_atomic(_trainer(out, 4)).train()
    assert _manifests(out) == {"checkpoint-2": False, "checkpoint-4": False}


@pytest.mark.timeout(120)
def test_adopt_existing_resumes_from_the_newest_complete_stock_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Opted in: the complete stock checkpoints are adopted, the torn checkpoint-6 is
    refused and never resumed from, and the run continues from checkpoint-4, replacing
    the torn folder with its own save. (make_atomic(..., adopt_existing=True) is the
    same code: see the refusal test below.)"""
    out = tmp_path / "out"
    _stock_run(out, max_steps=6)
    _tear(out / "checkpoint-6")
    snap = SnapshotAt(0)
    trainer = _trainer(out, 8, callbacks=[AtomicCheckpointCallback(adopt_existing=True), snap])
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    assert snap.first_step_seen == 4
    manifests = _manifests(out)
    assert manifests["checkpoint-2"] is True and manifests["checkpoint-4"] is True
    # The torn folder was never adopted; the save of step 6 replaced it.
    assert manifests["checkpoint-6"] is False and manifests["checkpoint-8"] is False
    assert "trainer_state.json is missing" in trainer._atomic_checkpoint.refused[6]
    assert "not adopting checkpoint-6" in caplog.text
    assert _lock_free(out)


@pytest.mark.timeout(120)
def test_explicit_path_to_a_complete_stock_checkpoint_resumes_without_writing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    _stock_run(out)
    snap = SnapshotAt(0)
    make_atomic(_trainer(out, 6, callbacks=[snap])).train(
        resume_from_checkpoint=str(out / "checkpoint-2")
    )
    assert snap.first_step_seen == 2
    # The stock folders were read, not adopted; steps 4 and 6 were saved again, ours.
    assert _manifests(out) == {"checkpoint-4": False, "checkpoint-6": False}
    assert _lock_free(out)


# ---------------------------------------------------------------------- lock on errors
@pytest.mark.timeout(180)
def test_a_complete_stock_checkpoint_newer_than_ours_is_refused_at_resume_not_replaced(
    tmp_path: Path,
) -> None:
    """Our run saved checkpoint-2 and -4; the stock Trainer went on to a complete
    checkpoint-6. resume_from_checkpoint=True resumed from 4 with a warning, and the save
    of step 6 replaced the stock folder: two steps of training lost without an error.
    Now it is refused, saying how to opt in; opted in, the run resumes from 6."""
    out = tmp_path / "out"
    _trainer(out, 4, callbacks=[AtomicCheckpointCallback()]).train()
    _trainer(out, 6).train(resume_from_checkpoint=str(out / "checkpoint-4"))
    stock = out / "checkpoint-6" / "trainer_state.json"
    before = stock.read_bytes()
    with pytest.raises(ResumeError) as err:
        make_atomic(_trainer(out, 8)).train(resume_from_checkpoint=True)
    message = str(err.value)
    assert "['checkpoint-6']" in message and "newer than checkpoint-4" in message
    assert "AtomicCheckpointCallback(adopt_existing=True)" in message
    assert stock.read_bytes() == before and "checkpoint-6" not in _manifests(out)
    assert _lock_free(out)

    snap = SnapshotAt(0)
    _trainer(out, 8, callbacks=[AtomicCheckpointCallback(adopt_existing=True), snap]).train(
        resume_from_checkpoint=True
    )
    assert snap.first_step_seen == 6
    assert _manifests(out) == {
        "checkpoint-2": False,
        "checkpoint-4": False,
        "checkpoint-6": True,
        "checkpoint-8": False,
    }


@pytest.mark.timeout(60)
def test_a_url_output_dir_is_refused_before_training(tmp_path: Path, monkeypatch) -> None:
    """output_dir="s3://bucket/run" trained and committed to the local folder
    ./s3:/bucket/run, with the user believing the checkpoints were in the bucket."""
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(
        model=tiny_model(),
        args=tiny_args("s3://bucket/run", max_steps=2),
        train_dataset=RandomTokens(32),
        callbacks=[AtomicCheckpointCallback()],
    )
    with pytest.raises(CheckpointError, match="is a URL"):
        trainer.train()
    assert trainer.state.global_step == 0
    # (The Trainer itself may create the empty folder when it is built.)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


@pytest.mark.timeout(120)
def test_lock_released_when_resume_finds_only_a_torn_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stock_run(out)
    shutil.rmtree(out / "checkpoint-2")
    _tear(out / "checkpoint-4")
    with pytest.raises(ResumeError, match=r"checkpoint-4: trainer_state\.json is missing"):
        make_atomic(_trainer(out, 6)).train(resume_from_checkpoint=True)
    assert _lock_free(out)


@pytest.mark.timeout(120)
def test_lock_released_when_adopt_existing_refuses_every_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stock_run(out)
    for name in ("checkpoint-2", "checkpoint-4"):
        _tear(out / name)
    with pytest.raises(ResumeError, match="Not adoptable") as err:
        make_atomic(_trainer(out, 6), adopt_existing=True).train(resume_from_checkpoint=True)
    assert "adopt_existing=True" not in str(err.value)  # already opted in
    assert _manifests(out) == {}
    assert _lock_free(out)


@pytest.mark.timeout(60)
def test_adoption_stops_train_while_another_job_holds_the_lock(tmp_path: Path) -> None:
    """Adopting takes the run lock: a job (here a manager of this process) holding it
    stops train() with LockHeldError before anything is written or trained."""
    out = tmp_path / "out"
    _stock_run(out)
    holder = CheckpointManager(str(out))
    try:
        with pytest.raises(LockHeldError):
            make_atomic(_trainer(out, 6), adopt_existing=True).train(resume_from_checkpoint=True)
        assert _manifests(out) == {}
    finally:
        holder.close()
    assert _lock_free(out)


@pytest.mark.timeout(60)
def test_a_held_lock_tells_a_trainer_user_what_they_can_do(tmp_path: Path) -> None:
    # The advice named CheckpointManager(..., takeover=True), which a Trainer user
    # never calls (make_atomic opens the root): the shell's command instead.
    out = tmp_path / "out"
    hold = (
        "import sys, time; from atomic_checkpoint import CheckpointManager; "
        f"m = CheckpointManager({str(out)!r}); print('held', flush=True); "
        "sys.stdin.read(); m.close()"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        text=True,
    ) as holder:  # fmt: skip
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            with pytest.raises(LockHeldError) as held:
                make_atomic(_trainer(out, 2)).train()
        finally:
            holder.communicate("", timeout=30)
    assert "takeover=True" not in str(held.value)
    assert "atomic-checkpoint clean --force" in str(held.value)


@pytest.mark.timeout(120)
def test_lock_released_when_the_explicit_path_is_torn(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stock_run(out)
    _tear(out / "checkpoint-4")
    with pytest.raises(CheckpointNotFoundError, match=r"trainer_state\.json is missing"):
        make_atomic(_trainer(out, 6)).train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert _lock_free(out)


@pytest.mark.timeout(120)
def test_lock_released_when_the_explicit_path_is_corrupt(tmp_path: Path) -> None:
    out = tmp_path / "out"
    make_atomic(_trainer(out, 2)).train()
    weights = out / "checkpoint-2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the checksum tells
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        make_atomic(_trainer(out, 4)).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert _lock_free(out)


@pytest.mark.timeout(120)
def test_lock_released_when_resume_finds_no_checkpoint_at_all(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ResumeError, match="holds no checkpoint"):
        make_atomic(_trainer(out, 2)).train(resume_from_checkpoint=True)
    assert _lock_free(out)
    # The next Trainer of the process starts cleanly on the same directory.
    make_atomic(_trainer(out, 2)).train()
    assert [c.step for c in CheckpointManager(str(out), read_only=True).checkpoints()] == [2]


# ---------------------------------------------------------------------- killed stock run
@pytest.mark.faults
@pytest.mark.timeout(300)
def test_stock_run_killed_mid_save_continues_from_its_newest_complete_checkpoint(
    tmp_path: Path,
) -> None:
    """A stock Trainer run SIGKILLed while writing checkpoint-6 (model written, the rest
    not), continued with AtomicCheckpointCallback(adopt_existing=True) and
    resume_from_checkpoint=True: checkpoint-2 and -4 are adopted, the torn -6 refused,
    and the run resumes from 4 with exactly the state of an uninterrupted run."""
    stock, ref = tmp_path / "stock", tmp_path / "ref"
    script = str(SCRIPTS / "hf_kill.py")
    proc = spawn([sys.executable, script, "run", "stock", str(stock), "6"], job_env(tmp_path))
    (out,) = communicate([proc], RUN_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL, out[-4000:]
    torn = set(os.listdir(stock / "checkpoint-6"))
    assert "model.safetensors" in torn and "trainer_state.json" not in torn

    result = tmp_path / "result.json"
    run_job(
        [sys.executable, script, "adopt", str(stock), str(ref), str(result), "4"],
        job_env(tmp_path),
        "hf_kill.py adopt",
    )
    r = _load(result)
    assert r["at_resume"] == {
        "checkpoint-2": True,
        "checkpoint-4": True,
        "checkpoint-6": ("CheckpointNotFoundError"),
    }
    assert "trainer_state.json is missing" in r["refused"]["6"]
    assert r["first_step"] == 4
    assert r["restored_vs_reference"] == []
    assert r["losses_resumed"] == r["losses_reference"] and len(r["losses_resumed"]) == 6
    assert r["final_vs_reference"] == []
    # The redone save of 6 and the rest committed and rotated (save_total_limit=2).
    assert r["committed"] == [8, 10]


@pytest.mark.dist
@cpu_multiprocess_resume
@pytest.mark.timeout(300)
def test_torchrun_job_adopts_on_the_writing_process_and_every_rank_resumes_alike(
    tmp_path: Path,
) -> None:
    """2 processes: rank 0 adopts while rank 1 waits, both get the same refusals, and
    both resume from the newest complete stock checkpoint (checkpoint-4 torn)."""
    run_job(
        _torchrun(
            "--standalone", "--nproc_per_node=2", str(SCRIPTS / "hf_adopt_dist.py"), str(tmp_path)
        ),
        job_env(tmp_path),
        "torchrun hf_adopt_dist.py",
    )
    r0, r1 = _load(tmp_path / "result-0.json"), _load(tmp_path / "result-1.json")
    assert r0["first_step"] == r1["first_step"] == 2
    assert r0["refused"] == r1["refused"] and list(r0["refused"]) == ["4"]
    assert "trainer_state.json is missing" in r0["refused"]["4"]
    assert r0["global_step"] == r1["global_step"] == 6
    # checkpoint-2 adopted; the torn 4 replaced by the job's own save, as was 6.
    assert r0["committed"] == {"2": True, "4": False, "6": False}
