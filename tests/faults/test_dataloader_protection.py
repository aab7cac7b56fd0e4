"""``preemption.protect_dataloaders`` and ``protecting_loaders_of``: DataLoader workers
that a scheduler signals with their trainer (SLURM signals every process of the job
step) go on, so the trainer's next batch does not raise before its guard saves.

Real loaders with real forked workers; the SIGTERM comes from another process (``kill``),
as a scheduler's does. Each test also shows the stock loader dying the same way, so the
protection is what makes the difference.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from atomic_checkpoint import preemption
from atomic_checkpoint.preemption import protect_dataloaders, protecting_loaders_of

pytestmark = pytest.mark.timeout(120)


class _Numbers(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class _MarkInit:
    """A loader's own ``worker_init_fn``: leaves a file per worker (picklable)."""

    def __init__(self, directory: Path):
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        (self.directory / f"worker-{worker_id}").write_text(str(os.getpid()))


def _loader(**kwargs: object) -> DataLoader:
    return DataLoader(_Numbers(), batch_size=4, num_workers=2, persistent_workers=True, **kwargs)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def _start(loader: object) -> tuple[object, set[int]]:
    """Iterate ``loader`` for two batches; returns the iterator and its workers
    (this process's children that its iteration started)."""
    before = _children()
    it = iter(loader)  # type: ignore[call-overload]
    # Two batches: one from each worker (round robin), so both have run their init
    # (torch's own SIGTERM handler is in place until then).
    next(it)
    next(it)
    return it, _children() - before


def _signal_workers_and_read(it: object, workers: set[int], n: int = 20) -> list[int]:
    """SIGTERM to every worker from another process (as a scheduler sends it), then
    ``n`` more batches; returns the first value of each."""
    assert len(workers) == 2
    subprocess.run(["kill", "-TERM", *map(str, workers)], check=True)
    time.sleep(0.5)  # the stock workers are dead by now
    return [int(next(it)[0, 0]) for _ in range(n)]  # type: ignore[call-overload]


def test_protected_workers_go_on_and_the_loaders_own_init_still_runs(tmp_path):
    loader = _loader(worker_init_fn=_MarkInit(tmp_path))
    # Nested the way Lightning's combined loaders hold them; twice: idempotent.
    protect_dataloaders({"train": [loader], "other": ("not a loader", 3)})
    protect_dataloaders(loader)
    it, workers = _start(loader)
    assert len(_signal_workers_and_read(it, workers)) == 20
    assert all(psutil.pid_exists(pid) for pid in workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]
    del it  # the loader's own shutdown (a signal from the trainer) still stops them


def test_stock_workers_die_and_the_next_batch_raises():
    it, workers = _start(_loader())
    with pytest.raises(RuntimeError, match="killed by signal"):
        _signal_workers_and_read(it, workers)


def test_accelerate_prepared_loaders_are_protected_through_the_loader_they_wrap():
    # Accelerate's DataLoaderShard passes for a DataLoader but iterates the one it
    # wraps: an attribute set on the wrapper alone never reaches the workers.
    from accelerate.data_loader import DataLoaderShard

    shard = DataLoaderShard(_Numbers(), batch_size=4, num_workers=2, persistent_workers=True)
    assert isinstance(shard, DataLoader)
    protect_dataloaders(shard)
    it, workers = _start(shard)
    assert len(_signal_workers_and_read(it, workers)) == 20


def test_preemption_guard_protects_what_the_accelerator_prepares(tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from atomic_checkpoint.integrations.accelerate import close, preemption_guard

    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True
        ),
    )
    before = accelerator.prepare(_loader())
    guard = preemption_guard(accelerator)
    after = accelerator.prepare(_loader())
    try:
        for loader in (before, after):
            it, workers = _start(loader)
            assert len(_signal_workers_and_read(it, workers)) == 20
            del it
        assert not guard.stopping  # the workers' signals are not the trainer's
    finally:
        guard.close()
        close(accelerator)


def test_protecting_loaders_of_wraps_on_the_instance_and_undoes():
    class Factory:
        def build(self) -> DataLoader:
            return DataLoader(_Numbers(), num_workers=1)

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
        return DataLoader(_Numbers(), num_workers=1)

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
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in workers):
            assert time.monotonic() < deadline, "a DataLoader worker outlived its trainer"
            time.sleep(0.05)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()
