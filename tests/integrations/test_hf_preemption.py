"""``make_atomic(trainer, preemption=True)``: the real Trainer (tiny GPT-2, CPU) gets a
real SIGTERM mid-training, saves the step it is at atomically, stops, and the process
exits with the requeue code; the restart resumes from that step. The stock Trainer has
no handler: the same SIGTERM kills it and nothing is saved."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from atomic_checkpoint import REQUEUE_EXIT_CODE, CheckpointManager
from tests.integrations.helpers import REPO, SCRIPTS
from tests.integrations.helpers import communicate as _communicate
from tests.integrations.helpers import job_env as _env
from tests.integrations.helpers import spawn as _spawn

pytestmark = pytest.mark.timeout(180)


def _launch(tmp_path: Path, *args: object, **env: str) -> tuple[int, str]:
    # The scripts directory (tiny_hf) first, then this tree's library.
    path = os.pathsep.join([str(SCRIPTS), str(REPO / "src"), str(REPO)])
    proc = _spawn(
        [sys.executable, str(SCRIPTS / "hf_preempt.py"), *map(str, args)],
        _env(tmp_path, PYTHONPATH=path, **env),
    )
    (out,) = _communicate([proc], 120)
    return int(proc.returncode), out


def test_sigterm_to_the_whole_job_with_dataloader_workers_saves_and_exits_for_requeue(tmp_path):
    # SLURM signals every process of the job step, the dataloader_num_workers workers
    # included: under torch's own worker handler they exit and the Trainer's next batch
    # raises ("DataLoader worker ... killed by signal") before anything is saved.
    # make_atomic(preemption=True) gives the Trainer's loaders workers that go on.
    rc, out = _launch(tmp_path, tmp_path, 20, 3, 0, 2)  # 2 workers; the process group
    assert rc == REQUEUE_EXIT_CODE, out[-4000:]
    assert "killed by signal" not in out
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["global_step"], result["decided"], result["exit_code"]) == (4, 4, 75)
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    assert [c.step for c in reader.checkpoints()] == [4]
    reader.verify(4)


def test_sigterm_saves_the_current_step_stops_and_exits_with_the_requeue_code(tmp_path):
    rc, out = _launch(tmp_path, tmp_path, 20, 3, 0)  # SIGTERM as step 4 begins
    assert rc == REQUEUE_EXIT_CODE, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {
        "first_step": 0,
        "global_step": 4,
        "decided": 4,
        "signum": 15,
        "exit_code": 75,
        "evaluated": [],
    }
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    assert [c.step for c in reader.checkpoints()] == [4]  # save_steps=100: only this one
    reader.verify(4)
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= {
        p.name for p in (tmp_path / "run" / "checkpoint-4").iterdir()
    }
    assert "every rank saves step 4 now" in out

    # The requeued run resumes from step 4 and runs to its end: exit status 0.
    rc, out = _launch(tmp_path, tmp_path, 6, 0, 1)
    assert rc == 0, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {
        "first_step": 4,
        "global_step": 6,
        "decided": None,
        "signum": None,
        "exit_code": 0,
        "evaluated": [],
    }


def test_a_preemption_at_an_evaluation_step_says_that_the_evaluation_is_skipped(tmp_path):
    # eval_steps=4 and the SIGTERM as step 4 begins, no grace period known: the guard
    # saves step 4 and stops before the evaluation scheduled there (nothing says it
    # would fit); the resumed run goes on from step 5, so best-model tracking never
    # sees step 4. That was silent.
    rc, out = _launch(tmp_path, tmp_path, 20, 3, 0, 0, 4)
    assert rc == REQUEUE_EXIT_CODE, out[-4000:]
    assert "preemption at step 4: the evaluation eval_steps schedules there is skipped" in out
    assert "no evaluation was timed yet in this run" in out
    assert json.loads((tmp_path / "result.json").read_text())["evaluated"] == []
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    assert [c.step for c in reader.checkpoints()] == [4]


def test_a_preemption_at_an_evaluation_step_evaluates_first_when_both_fit(tmp_path):
    # eval_steps=2, save_steps=2, a 60 s grace period, the SIGTERM as step 4 begins:
    # the evaluation and the save at step 2 were timed, both fit, so the Trainer
    # evaluates step 4 before the preemption save, which records its metric (it used
    # to skip the evaluation whatever the time left: the checkpoint had no eval_loss,
    # and KeepBest / load_best_model_at_end never saw step 4).
    rc, out = _launch(tmp_path, tmp_path, 20, 3, 0, 0, 2, 2, ATOMIC_CHECKPOINT_GRACE_S="60")
    assert rc == REQUEUE_EXIT_CODE, out[-4000:]
    assert "is skipped" not in out
    assert "of work announced before the save fits: it runs first" in out
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["decided"], result["evaluated"]) == (4, [2, 4])
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    infos = {c.step: c for c in reader.checkpoints()}
    assert sorted(infos) == [2, 4]
    assert "eval_loss" in infos[4].metrics, infos[4].metrics
    reader.verify(4)
