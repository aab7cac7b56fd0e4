"""``preemption.protect_dataloaders`` and ``protecting_loaders_of``: DataLoader workers
that a scheduler signals with their trainer (SLURM signals every process of the job
step) go on, so the trainer's next batch does not raise before its guard saves.

Real loaders with real workers (forked, spawned, from a fork server) in a trainer process
of their own (``loader_job.py``); the SIGTERM comes from another process (``kill``), as a
scheduler's does. The stock loader dies the same way, so the protection is what makes
the difference.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from torch.utils.data import DataLoader

from atomic_checkpoint import preemption
from atomic_checkpoint.preemption import protecting_loaders_of

pytestmark = pytest.mark.timeout(120)


_JOB = Path(__file__).with_name("loader_job.py")


def _numbers() -> DataLoader:
    return DataLoader(list(range(10)), num_workers=1)


@contextlib.contextmanager
def _job(kind: str, tmp_path: Path, context: str = "fork", init: bool = False):
    """Run ``loader_job.py`` (a trainer's loaders in a process of their own); yields
    the job, its workers' pids and the file that lets it read on."""
    go = tmp_path / "go"
    args = [str(_JOB), kind, context, str(go)]
    if init:
        (tmp_path / "init").mkdir()
        args.append(str(tmp_path / "init"))
    job = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        assert line, f"the job ended before starting its workers: {job.stderr.read()}"  # type: ignore[union-attr]
        yield job, json.loads(line)["workers"], go
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()


def _signal_workers_and_read(job: subprocess.Popen, workers: list[int], go: Path) -> dict:
    """SIGTERM to every worker from another process (as a scheduler sends it), then the
    job reads on; returns its report, the job having exited with 75."""
    assert workers and len(workers) % 2 == 0
    subprocess.run(["kill", "-TERM", *map(str, workers)], check=True)
    time.sleep(0.5)  # the stock workers are dead by now
    go.touch()
    assert job.stdout is not None
    report = json.loads(job.stdout.readline() or "{}")
    assert job.wait(timeout=60) == 75, job.stderr.read()  # type: ignore[union-attr]
    return report


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_protected_workers_go_on_and_the_loaders_own_init_still_runs(tmp_path, context):
    with _job("protected", tmp_path, context, init=True) as (job, workers, go):
        report = _signal_workers_and_read(job, workers, go)
        assert report == {"ok": True, "alive": [True, True], "stopping": []}
        stderr = job.stderr.read()  # type: ignore[union-attr]
    assert sorted(p.name for p in (tmp_path / "init").iterdir()) == ["worker-0", "worker-1"]
    # At the trainer's exit, the workers left on its SIGTERM: none had to be killed. A
    # forkserver worker is the fork server's child; the trainer is who started it.
    assert "did not leave on SIGTERM" not in stderr, stderr
    assert not [p for p in workers if _running(p)]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


@pytest.mark.parametrize("kind", ["early", "early-direct", "early-stock"])
def test_a_signal_in_a_workers_first_moments_waits_for_its_init(tmp_path, kind):
    # Spawned workers held as they unpickle their dataset, before torch's handlers and
    # any worker_init_fn: a protected loader starts its workers with the signals
    # blocked, so the scheduler's SIGTERM waits for the thread that tells who sent it.
    # early-direct: the loader was given dataloader_worker_init itself before.
    with _job(kind, tmp_path, "spawn") as (job, workers, go):
        report = _signal_workers_and_read(job, workers, go)
    if kind != "early-stock":
        assert report == {"ok": True, "alive": [True, True], "stopping": []}, report
    else:  # the window is real: a stock worker dies in it
        assert not report["ok"] and "killed by signal" in report["error"], report


def test_stock_workers_die_and_the_next_batch_raises(tmp_path):
    with _job("stock", tmp_path) as (job, workers, go):
        report = _signal_workers_and_read(job, workers, go)
    assert not report["ok"] and "killed by signal" in report["error"], report


def test_accelerate_prepared_loaders_are_protected_through_the_loader_they_wrap(tmp_path):
    # Accelerate's DataLoaderShard passes for a DataLoader but iterates the one it
    # wraps: an attribute set on the wrapper alone never reaches the workers.
    with _job("shard", tmp_path) as (job, workers, go):
        assert _signal_workers_and_read(job, workers, go)["ok"]


def test_preemption_guard_protects_what_the_accelerator_prepares(tmp_path):
    # One loader prepared before the guard, one after; the workers' signals are not the
    # trainer's, so the guard is not stopping.
    with _job("guard", tmp_path) as (job, workers, go):
        assert len(workers) == 4
        report = _signal_workers_and_read(job, workers, go)
    assert report == {"ok": True, "alive": [True] * 4, "stopping": [False]}, report


def test_protecting_loaders_of_wraps_on_the_instance_and_undoes():
    class Factory:
        def build(self) -> DataLoader:
            return _numbers()

    own = Factory()
    undo = protecting_loaders_of(own, "build")
    assert protecting_loaders_of(own, "build")() is None  # twice: a no-op
    wrapped = own.build().worker_init_fn
    assert callable(wrapped) and wrapped is not None
    # Picklable, for loaders whose workers start by spawn or forkserver.
    assert callable(pickle.loads(pickle.dumps(wrapped)))
    undo()
    assert "build" not in vars(own) and own.build().worker_init_fn is None

    # What the instance held before comes back.
    def mine() -> DataLoader:
        return _numbers()

    own.build = mine  # type: ignore[method-assign]
    undo = protecting_loaders_of(own, "build")
    assert own.build is not mine and own.build().worker_init_fn is not None
    undo()
    assert own.build is mine


def test_outside_a_worker_the_init_is_a_no_op():
    handler = preemption.signal.getsignal(preemption.signal.SIGTERM)
    preemption.dataloader_worker_init()
    assert preemption.signal.getsignal(preemption.signal.SIGTERM) is handler
    assert not preemption.signal.pthread_sigmask(preemption.signal.SIG_BLOCK, [])


_EXITING_TRAINER = """
import os, sys, time
sys.path.insert(0, {src!r})
from torch.utils.data import DataLoader
from atomic_checkpoint import preemption

loader = DataLoader(list(range(100_000)), batch_size=4, num_workers=2, persistent_workers=True,
                    collate_fn=list)
preemption.protect_dataloaders(loader)
it = iter(loader)  # alive until the interpreter exits, as a training script's iterator
next(it), next(it)  # a batch from each worker: both have run their init
print(" ".join(str(w.pid) for w in it._workers), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
sys.exit(75)  # as guard.exit() does once saved: the workers are stopped at exit
"""


def test_a_scheduler_sigterm_that_swallows_the_trainers_does_not_hang_its_exit(tmp_path):
    # Standard signals do not queue: a worker whose scheduler SIGTERM is still pending
    # when the trainer's own SIGTERM (stopping it at exit) comes sees one signal, from
    # the scheduler, and goes on; Python's exit handler then joins it without a bound.
    # Made certain here by stopping the workers (SIGSTOP) while both signals arrive.
    go = tmp_path / "go"
    src = str(Path(preemption.__file__).parents[1])
    trainer = subprocess.Popen(
        [sys.executable, "-c", _EXITING_TRAINER.format(src=src), str(go)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        workers = [int(p) for p in trainer.stdout.readline().split()]
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        subprocess.run(["kill", "-TERM", *map(str, workers)], check=True)  # the scheduler
        go.touch()  # the trainer exits, and SIGTERMs its workers: merged, still stopped
        time.sleep(0.3)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert trainer.wait(timeout=20) == 75  # no hang, the exit status kept
        deadline = time.monotonic() + 10
        while any(_running(p) for p in workers):
            assert time.monotonic() < deadline, "a DataLoader worker outlived its trainer"
            time.sleep(0.05)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()
