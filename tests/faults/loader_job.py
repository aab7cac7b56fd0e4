"""A trainer's DataLoaders in a process of their own, for the DataLoader protection tests.

Run as ``python loader_job.py KIND CONTEXT GO [INIT_DIR]``:

- KIND: ``protected`` (``protect_dataloaders`` on a plain loader, nested the way
  Lightning holds loaders, twice), ``stock`` (no protection), ``shard`` (Accelerate's
  ``DataLoaderShard``, protected), ``guard`` (Accelerate's ``preemption_guard``, with one
  loader prepared before it and one after), ``early``, ``early-direct`` (given
  ``dataloader_worker_init`` itself, then protected) and ``early-stock`` (not protected),
  with workers held in their first moments until GO: start them by ``spawn``;
- CONTEXT: the workers' start method, ``fork``, ``spawn`` or ``forkserver``;
- GO: a file the job waits for before it reads on (its folder is Accelerate's project);
- INIT_DIR: where the loaders' own ``worker_init_fn`` leaves a file per worker.

It starts its loaders' workers (a batch from each, so that every worker has run its
init; not for the early kinds), prints their pids as one JSON line, waits for GO (the
test signals the workers from outside in between, as a scheduler does), reads 20 more
batches from each loader and prints ``{"ok": true, "alive": [...]}`` or ``{"ok": false,
"error": ...}``. Then it exits 75 with its iterators alive, as ``guard.exit()`` does once
saved, so the workers are stopped by the exit path. Logs (DEBUG) go to stderr.

The loaders run here, not in the test process: workers forked from a process that has
run other tests inherit its threads' locks, and a real trainer is a process of its own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from atomic_checkpoint import preemption

BATCHES = 20
WAIT_S = 60.0
guards: list = []  # Accelerate's preemption guards, kept for the report


class Numbers(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class Held(Numbers):
    """Numbers whose copy in a worker waits for ``go`` as it is unpickled: a spawned
    worker is then held in its first moments, before torch's handlers and any
    ``worker_init_fn``."""

    def __init__(self, go: str):
        self.go = go

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(self.go) and time.monotonic() < deadline:
            time.sleep(0.01)


class MarkInit:
    """A loader's own ``worker_init_fn``: leaves a file per worker (picklable)."""

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        Path(self.directory, f"worker-{worker_id}").write_text(str(os.getpid()))


def loaders(kind: str, context: str, init_dir: str | None, project: str) -> list[object]:
    options: dict = dict(
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=context,
        worker_init_fn=MarkInit(init_dir) if init_dir else None,
    )
    if kind == "stock":
        return [DataLoader(Numbers(), **options)]
    if kind in ("early", "early-direct", "early-stock"):
        if kind == "early-direct":
            options["worker_init_fn"] = preemption.dataloader_worker_init
        loader = DataLoader(Held(os.path.join(project, "go")), **options)
        if kind != "early-stock":
            preemption.protect_dataloaders(loader)
        return [loader]
    if kind == "protected":
        loader = DataLoader(Numbers(), **options)
        preemption.protect_dataloaders({"train": [loader], "other": ("not a loader", 3)})
        preemption.protect_dataloaders(loader)
        return [loader]
    if kind == "shard":
        from accelerate.data_loader import DataLoaderShard

        shard = DataLoaderShard(Numbers(), **options)
        assert isinstance(shard, DataLoader)
        preemption.protect_dataloaders(shard)
        return [shard]
    if kind == "guard":
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        from atomic_checkpoint.integrations.accelerate import preemption_guard

        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
        accelerator = Accelerator(cpu=True, project_config=config)
        before = accelerator.prepare(DataLoader(Numbers(), **options))
        guard = preemption_guard(accelerator)
        after = accelerator.prepare(DataLoader(Numbers(), **options))
        guards.append(guard)
        return [before, after]
    raise SystemExit(f"unknown kind {kind!r}")


def workers_of(loader: object) -> list:
    """The worker processes of a loader with persistent workers (Accelerate's iterate
    the loader they wrap)."""
    base = getattr(loader, "base_dataloader", loader)
    return list(base._iterator._workers)


def main(kind: str, context: str, go: str, init_dir: str | None = None) -> int:
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    iterators = []
    workers: list[int] = []
    started = loaders(kind, context, init_dir, os.path.dirname(go))
    for loader in started:
        it = iter(loader)  # type: ignore[call-overload]
        if not kind.startswith("early"):  # those workers are held until GO
            next(it), next(it)  # round robin: a batch from each, both past their init
        iterators.append(it)
        workers += [w.pid for w in workers_of(loader)]
    print(json.dumps({"workers": workers}), flush=True)
    deadline = time.monotonic() + WAIT_S
    try:  # a stock loader raises from its SIGCHLD handler, wherever the trainer is
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.01)
        for it in iterators:
            for _ in range(BATCHES):
                next(it)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    else:
        alive = [w.is_alive() for loader in started for w in workers_of(loader)]
        stopping = [g.stopping for g in guards]  # the workers' signals are not the trainer's
        print(json.dumps({"ok": True, "alive": alive, "stopping": stopping}), flush=True)
    return 75


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
