"""The Hugging Face Trainer integration, with the real transformers (tiny GPT-2 built
from a config, no downloads), real torchrun jobs on gloo, and real SIGKILLs.

Each multi-process test is one launch whose job writes what it saw to JSON files
(tests/integrations/scripts/hf_*.py); the assertions are grouped here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from atomic_checkpoint import CheckpointInfo, KeepLast
from atomic_checkpoint.integrations.hf import KeepTrainerBest, make_atomic
from atomic_checkpoint.retention import plan_deletions

from . import helpers
from .helpers import REPO, RUN_TIMEOUT_S, SCRIPTS, communicate, job_env, run_job, spawn

TRAINER_FILES = {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt"}
TRAINER_FILES |= {"trainer_state.json", "training_args.bin"}


def _transformers_major() -> int:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


# transformers 4.x resumes the optimizer of a multi-process job with
# torch.load(map_location=args.device), which is "cpu:<i>" in a CPU (gloo) job, and torch
# refuses to restore storages to an indexed CPU device: the stock Trainer cannot resume
# such a job, with or without this library (GPU jobs map to "cuda:<i>" and are fine).
# transformers 5 loads with map_location="cpu".
cpu_multiprocess_resume = pytest.mark.skipif(
    _transformers_major() < 5,
    reason="transformers 4.x cannot resume a multi-process CPU job (optimizer state loaded "
    "with map_location='cpu:<i>', which torch refuses), with or without atomic-checkpoint",
)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.dist
@cpu_multiprocess_resume
@pytest.mark.timeout(300)
def test_torchrun_job_saves_rotates_and_resumes_identically(tmp_path: Path) -> None:
    """2 processes: atomic saves with both ranks' files, rotation that keeps the best,
    pushes and on_save callbacks that only see committed paths, and a resume whose
    state and losses equal an uninterrupted run's."""
    run_job(
        _torchrun("--standalone", "--nproc_per_node=2", str(SCRIPTS / "hf_dist.py"), str(tmp_path)),
        job_env(tmp_path),
        "torchrun hf_dist.py",
    )
    r0, r1 = _load(tmp_path / "result-0.json"), _load(tmp_path / "result-1.json")
    run = str(tmp_path / "run")

    # Phase A, steps 1-8, save_total_limit=2: checkpoint-2 rotated away, checkpoint-4
    # kept although it is not among the last two, because it is the Trainer's best.
    assert [n for n in r0["a_listing"] if n.startswith("checkpoint-")] == [
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
    ]
    assert r0["a_best"] == f"{run}/checkpoint-4"
    # on_save callbacks run after the commit: the checkpoint they find is committed.
    assert r0["a_saves"] == [{"step": s, "committed": True} for s in (2, 4, 6, 8)]
    assert r1["a_saves"] == r0["a_saves"]
    # Hub pushes are handed the committed path, complete with every rank's files.
    pushes = r0["a_pushes"]
    assert [p["path"] for p in pushes] == [f"{run}/checkpoint-{s}" for s in (2, 4, 6, 8)]
    for push in pushes:
        assert push["committed"], push
        assert TRAINER_FILES | {"rng_state_0.pth", "rng_state_1.pth"} <= set(push["files"])
    assert r1["a_pushes"] == pushes  # every rank's hook gets the same committed path

    # Phase B: resume_from_checkpoint=True picked step 8 on both ranks, and restored
    # exactly the state an uninterrupted run has there (model, optimizer, scheduler, RNG).
    assert r0["b_first_step"] == r1["b_first_step"] == 8
    assert r0["restored_vs_reference"] == [] and r1["restored_vs_reference"] == []
    assert r0["losses_b"] == r0["losses_c"] and len(r0["losses_b"]) == 4
    assert r0["final_12_vs_reference"] == []
    # The best survived the restart and rotation; load_best_model_at_end loaded it, and
    # trainer_state.json records its committed path, never a pending one.
    assert [n for n in r0["listing"] if n.startswith("checkpoint-")] == [
        "checkpoint-10",
        "checkpoint-12",
        "checkpoint-4",
    ]
    assert r0["b_best"] == r0["state_12_best"] == f"{run}/checkpoint-4"
    assert r0["b_final_is_best"]

    # Every committed checkpoint verifies (all checksums) and lists both ranks' files;
    # the manifest records the step's eval metrics; nothing is left pending.
    verified = r0["verified"]
    assert sorted(verified, key=int) == ["4", "10", "12"]
    for entry in verified.values():
        assert TRAINER_FILES | {"rng_state_0.pth", "rng_state_1.pth"} <= set(entry["files"])
    assert verified["4"]["metrics"]["eval_score"] == 0.9
    assert r0["pending_left"] == []


@pytest.mark.dist
@cpu_multiprocess_resume
@pytest.mark.timeout(300)
def test_nodes_with_their_own_disks_commit_full_copies_and_agree_on_resume(
    tmp_path: Path,
) -> None:
    """2 "nodes" (torchrun --nnodes=2, one process each), each with a directory the other
    cannot see: save_on_each_node is checked against the storage, each node commits a
    complete copy, and both resume from the newest step complete on every node."""
    port = str(_free_port())
    procs = []
    for node in (0, 1):
        cmd = _torchrun(
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(SCRIPTS / "hf_nodes.py"),
            str(tmp_path),
        )
        procs.append(spawn(cmd, job_env(tmp_path, ATOMIC_CHECKPOINT_HOST=f"node{node}")))
    outs = communicate(procs, RUN_TIMEOUT_S)
    for node, (p, out) in enumerate(zip(procs, outs, strict=True)):
        helpers.check_exit(p, out, f"node {node}")

    for rank in (0, 1):
        r = _load(tmp_path / f"result-{rank}.json")
        # save_on_each_node=False on disks the nodes do not share: refused, saying why.
        assert r["shared_flag_error"].startswith("StorageError"), r["shared_flag_error"]
        assert "save_on_each_node" in r["shared_flag_error"]
        # A framework that writes the model on rank 0 only: nothing committed anywhere.
        assert "lacks" in r["half_copy_error"] and "model.safetensors" in r["half_copy_error"]
        assert not [n for n in r["after_half_copy"] if n.startswith("checkpoint-")]
        # Each node committed and rotated its own complete copy (with its rank's RNG).
        first = r["after_first_run"]
        assert sorted(first, key=int) == ["4", "6"]
        for files in first.values():
            assert TRAINER_FILES | {f"rng_state_{rank}.pth"} <= set(files)
            assert f"rng_state_{1 - rank}.pth" not in files
        # Node 1 lost checkpoint-6: both nodes resumed from 4, the newest on both.
        assert r["resumed_first_step"] == 4
        assert sorted(r["after_resume"], key=int) == ["6", "8"]


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_sigkill_mid_save_stock_resume_fails_atomic_resume_is_exact(tmp_path: Path) -> None:
    """Killed while writing checkpoint-6 (model written, optimizer not yet): the stock
    Trainer leaves a torn checkpoint-6 that its resume trips over; with make_atomic the
    resume continues from checkpoint-4 with exactly the reference run's state."""
    stock, atomic, ref = tmp_path / "stock", tmp_path / "atomic", tmp_path / "ref"
    script = str(SCRIPTS / "hf_kill.py")
    runs = [
        spawn([sys.executable, script, "run", kind, str(out), "6"], job_env(tmp_path))
        for kind, out in (("stock", stock), ("atomic", atomic))
    ]
    for p, out in zip(runs, communicate(runs, RUN_TIMEOUT_S), strict=True):
        assert p.returncode == -signal.SIGKILL, out[-4000:]

    # What the kill left: stock, a torn checkpoint-6 under the final name; atomic, only
    # complete checkpoints under final names (the torn save stays in .pending/).
    torn = set(os.listdir(stock / "checkpoint-6"))
    assert "model.safetensors" in torn
    assert not {"optimizer.pt", "scheduler.pt", "trainer_state.json"} & torn
    assert sorted(n for n in os.listdir(atomic) if n.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]

    result = tmp_path / "result.json"
    run_job(
        [sys.executable, script, "check", str(stock), str(atomic), str(ref), str(result), "4"],
        job_env(tmp_path),
        "hf_kill.py check",
    )
    r = _load(result)
    assert r["stock_resume"].startswith("FileNotFoundError"), r["stock_resume"]
    assert "checkpoint-6" in r["stock_resume"] and "trainer_state.json" in r["stock_resume"]
    assert r["atomic_on_torn_only"].startswith("ResumeError"), r["atomic_on_torn_only"]
    assert "checkpoint-6" in r["atomic_on_torn_only"]
    assert r["atomic_first_step"] == 4
    assert r["restored_vs_reference"] == []
    assert r["losses_resumed"] == r["losses_reference"] and len(r["losses_resumed"]) == 6
    assert r["final_vs_reference"] == []
    # The re-done save of step 6 and the rest of the run committed and rotated normally.
    assert [n for n in r["atomic_listing"] if n.startswith("checkpoint-")] == [
        "checkpoint-10",
        "checkpoint-8",
    ]
    # The marker strategy (object-store mounts): the Trainer's files stay in one
    # committed attempt-<token>/ per checkpoint, and resume finds them there.
    assert r["marker_first_step"] == 4 and r["marker_restored_vs_reference"] == []
    assert sorted(r["marker_files"]) == ["checkpoint-10", "checkpoint-8"]
    for files in r["marker_files"].values():
        attempts = {f.split("/")[0] for f in files if "/" in f}
        assert len(attempts) == 1 and next(iter(attempts)).startswith("attempt-"), files
        assert {f.split("/", 1)[1] for f in files if "/" in f} >= TRAINER_FILES
        assert "checkpoint.manifest.json" in files


@pytest.mark.timeout(180)
def test_example_runs_and_says_what_happened(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stdout = helpers.run_example(tmp_path, "hf_trainer.py", out)
    assert "['checkpoint-4', 'checkpoint-6']" in stdout
    assert "the stock resume would load checkpoint-8" in stdout
    assert "continued from step 6" in stdout
    assert "trained to step 10: ['checkpoint-8', 'checkpoint-10']" in stdout
    assert (out / "checkpoint-10" / "checkpoint.manifest.json").is_file()
    assert (out / "checkpoint-8" / "trainer_state.json").is_file()  # the torn one was redone


# ---------------------------------------------------------------------- in-process
@dataclass
class _State:
    best_model_checkpoint: str | None


@dataclass
class _FakeTrainer:
    state: _State


def _infos(*steps: int) -> list[CheckpointInfo]:
    return [CheckpointInfo(step=s, path=f"checkpoint-{s}", size_bytes=1) for s in steps]


@pytest.mark.timeout(30)
def test_keep_trainer_best_protects_the_best_beyond_the_last_n(tmp_path: Path) -> None:
    run = str(tmp_path / "out")
    trainer = _FakeTrainer(_State(best_model_checkpoint=os.path.join(run, "checkpoint-20")))
    policy = KeepLast(2) | KeepTrainerBest(trainer, run)
    deleted = [i.step for i in plan_deletions(policy, _infos(10, 20, 30, 40, 50))]
    assert deleted == [10, 30]
    # Marker-strategy layout: the best's files live in checkpoint-<step>/attempt-<token>.
    trainer.state.best_model_checkpoint = os.path.join(run, "checkpoint-30", "attempt-" + "a" * 16)
    assert [i.step for i in plan_deletions(policy, _infos(10, 20, 30, 40, 50))] == [10, 20]
    # A best outside this run's directory (another trial) protects nothing here.
    trainer.state.best_model_checkpoint = os.path.join(str(tmp_path), "other", "checkpoint-20")
    assert [i.step for i in plan_deletions(policy, _infos(10, 20, 30, 40, 50))] == [10, 20, 30]


@pytest.mark.timeout(30)
def test_make_atomic_refuses_what_is_not_a_trainer() -> None:
    with pytest.raises(TypeError, match="_save_checkpoint"):
        make_atomic(object())


_OLDER_RESUME = r"""
import sys
sys.path.insert(0, sys.argv[2])
from tiny_hf import RandomTokens, tiny_args, tiny_model
from transformers import Trainer
from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.integrations.hf import make_atomic

out = sys.argv[1]
first = Trainer(
    model=tiny_model(), args=tiny_args(out, max_steps=4), train_dataset=RandomTokens(32)
)
make_atomic(first).train()
before = CheckpointManager(out, read_only=True).checkpoints()[-1].commit_seq
second = Trainer(
    model=tiny_model(), args=tiny_args(out, max_steps=8), train_dataset=RandomTokens(32)
)
make_atomic(second).train(resume_from_checkpoint=out + "/checkpoint-2")
after = {c.step: c.commit_seq for c in CheckpointManager(out, read_only=True).checkpoints()}
print("GLOBAL_STEP", second.state.global_step)
print("STEPS", sorted(after))
print("REPLACED_4", after[4] > before)
"""


@pytest.mark.timeout(180)
def test_resuming_an_older_checkpoint_continues_and_replaces_the_newer_ones(
    tmp_path: Path,
) -> None:
    """Stock Trainer behaviour is kept: resuming checkpoint-2 while checkpoint-4 exists
    trains on and saves step 4 again (an atomic overwrite), so saves below the newest
    step (refused with StepOrderError for plain managers) never happen in this flow."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", _OLDER_RESUME, str(out), str(SCRIPTS)],
        cwd=REPO,
        env=job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GLOBAL_STEP 8" in proc.stdout, proc.stdout[-3000:]
    assert "STEPS [2, 4, 6, 8]" in proc.stdout, proc.stdout[-3000:]
    assert "REPLACED_4 True" in proc.stdout, proc.stdout[-3000:]


def _run_snippet(tmp_path: Path, code: str, *args: str, timeout_s: float = 150) -> str:
    """Run ``code`` in a fresh interpreter (``argv``: the output dir, the scripts
    folder, ``args``); returns stdout + stderr, after checking it exited 0."""
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out"), str(SCRIPTS), *args],
        cwd=REPO,
        env=job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    return text


_BELOW_NEWEST = r"""
import logging, os, sys
sys.path.insert(0, sys.argv[2])
from tiny_hf import RandomTokens, tiny_args, tiny_model
from transformers import Trainer
from atomic_checkpoint import CheckpointManager, StepOrderError
from atomic_checkpoint.integrations.hf import make_atomic

logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
out, case = sys.argv[1], sys.argv[3]
first = Trainer(
    model=tiny_model(), args=tiny_args(out, max_steps=8), train_dataset=RandomTokens(32)
)
make_atomic(first).train()
before = {c.step: c.commit_seq for c in CheckpointManager(out, read_only=True).checkpoints()}
print("BEFORE", sorted(before))

def trainer():
    args = tiny_args(out, max_steps=8)
    return make_atomic(Trainer(model=tiny_model(), args=args, train_dataset=RandomTokens(32)))

if case == "older":
    trainer().train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
elif case == "corrupt":
    for step in (6, 8):  # one flipped byte in each newer checkpoint's weights
        path = os.path.join(out, f"checkpoint-{step}", "model.safetensors")
        data = bytearray(open(path, "rb").read()); data[-1] ^= 0xFF
        open(path, "wb").write(bytes(data))
    trainer().train(resume_from_checkpoint=True)
elif case == "scratch":
    second = trainer()
    try:
        second.train()
    except StepOrderError as exc:
        print("REFUSED_AT_STEP", second.state.global_step, "|", exc)
    else:
        print("NOT REFUSED")
after = {c.step: c.commit_seq for c in CheckpointManager(out, read_only=True).checkpoints()}
print("STEPS", sorted(after))
print("NEW", sorted(s for s in after if after[s] > before.get(s, -1)))
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["older", "corrupt"])
def test_resuming_below_the_newest_checkpoint_trains_on_and_replaces_the_newer_ones(
    tmp_path: Path, case: str
) -> None:
    """Resuming checkpoint-4 while 6 and 8 exist (on purpose, or because 6 and 8 fail
    verification and ``resume_from_checkpoint=True`` falls back): the stock Trainer
    trains on and overwrites 6 and 8. Here too, instead of refusing the save of step 6
    (below the newest, 8) after ``save_steps`` of training: the first save discards the
    newer checkpoints (said at ``train()``), and 6 and 8 are saved again."""
    text = _run_snippet(tmp_path, _BELOW_NEWEST, case, timeout_s=200)
    assert "BEFORE [2, 4, 6, 8]" in text, text[-3000:]
    assert "STEPS [2, 4, 6, 8]" in text, text[-3000:]
    assert "NEW [6, 8]" in text, text[-3000:]
    assert "the first save of this training discards them" in text, text[-3000:]
    assert "discarded the newer checkpoints ['checkpoint-6', 'checkpoint-8']" in text


@pytest.mark.timeout(180)
def test_training_from_scratch_over_this_runs_checkpoints_is_refused_before_any_step(
    tmp_path: Path,
) -> None:
    """``train()`` without ``resume_from_checkpoint`` in an ``output_dir`` holding this
    run's checkpoints up to step 8, saving every 2 steps: every save would be refused
    (below the newest). It is refused at ``train()``, at step 0, saying what to do,
    instead of after ``save_steps`` of training; nothing is deleted."""
    text = _run_snippet(tmp_path, _BELOW_NEWEST, "scratch")
    assert "REFUSED_AT_STEP 0 |" in text, text[-3000:]
    assert "resume_from_checkpoint=True" in text
    assert "STEPS [2, 4, 6, 8]" in text and "NEW []" in text, text[-3000:]


_ARGS_RECORDED = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
import torch
from tiny_hf import RandomTokens, tiny_args, tiny_model
from transformers import Trainer
from atomic_checkpoint.integrations.hf import make_atomic

out = sys.argv[1]
args = tiny_args(out, max_steps=2, save_total_limit=3)
make_atomic(Trainer(model=tiny_model(), args=args, train_dataset=RandomTokens(16))).train()
saved = torch.load(os.path.join(out, "checkpoint-2", "training_args.bin"), weights_only=False)
print("SAVED_LIMIT", saved.save_total_limit, "AFTER", args.save_total_limit)
"""


@pytest.mark.timeout(120)
def test_training_args_bin_records_the_users_save_total_limit(tmp_path: Path) -> None:
    """Rotation is the library's during ``train()``, but each checkpoint's
    ``training_args.bin`` records the ``save_total_limit`` the user set, as the stock
    Trainer's does (it recorded None)."""
    text = _run_snippet(tmp_path, _ARGS_RECORDED, timeout_s=100)
    assert "SAVED_LIMIT 3 AFTER 3" in text, text[-2000:]


_BEST_FROM_ELSEWHERE = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from tiny_hf import RandomTokens, tiny_args, tiny_model
from transformers import Trainer
from atomic_checkpoint.integrations.hf import make_atomic

base, run, max_steps, scores = sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
os.chdir(base)
given = iter(float(s) for s in scores.split(","))
args = tiny_args(
    run, max_steps=max_steps, eval_strategy="steps", eval_steps=2, save_total_limit=1,
    load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=False,
)
trainer = make_atomic(Trainer(
    model=tiny_model(), args=args, train_dataset=RandomTokens(32),
    eval_dataset=RandomTokens(8), compute_metrics=lambda _p: {"score": next(given)},
))
trainer.train(resume_from_checkpoint=True if max_steps > 4 else None)
print("BEST", trainer.state.best_model_checkpoint)
print("LEFT", sorted(n for n in os.listdir(run) if n.startswith("checkpoint-")))
"""


@pytest.mark.timeout(240)
def test_the_best_checkpoint_survives_a_resume_from_another_directory(tmp_path: Path) -> None:
    # The best (step 4) was recorded as "out/checkpoint-4", relative to the first run's
    # working directory. The requeued job, started elsewhere with the absolute path,
    # resolved it against its own directory: the Trainer dropped it ("does not exist
    # anymore") and save_total_limit=1 deleted checkpoint-4, the best model.
    base = tmp_path / "base"
    (base / "elsewhere").mkdir(parents=True)
    first = _run_snippet(tmp_path, _BEST_FROM_ELSEWHERE, str(base), "out", "4", "3,1")
    assert "BEST out/checkpoint-4" in first, first[-3000:]
    out = base / "out"
    again = _run_snippet(
        tmp_path, _BEST_FROM_ELSEWHERE, str(base / "elsewhere"), str(out), "8", "4,5"
    )
    assert f"BEST {out / 'checkpoint-4'}" in again, again[-3000:]
    assert "LEFT ['checkpoint-4', 'checkpoint-8']" in again, again[-3000:]
