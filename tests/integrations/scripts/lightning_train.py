"""A small Lightning training job for the integration tests (CPU, gloo).

Run as a script: ``Trainer(strategy="ddp", devices=N)`` re-executes this file for the
other ranks, the way Lightning runs on a real cluster. Every save records, beside the
checkpoint, a reference copy of the live model/optimizer/scheduler/RNG state of each
rank (``REF/step-<s>-rank<r>.pt``); a resumed run records its live state right after
the restore (``REF/resumed-rank<r>.pt``), so a test can compare the two bit for bit.

Options (all ``--name value``):
    --dir D             ModelCheckpoint dirpath
    --ref R             where reference states and reports go
    --io IO             stock | atomic | stock-async | atomic-async
    --devices N         1: single process; >1: DDP on CPU with gloo
    --max-steps N
    --every N           ModelCheckpoint(every_n_train_steps=N)
    --top-k K           save_top_k (monitor="step", mode="max" when K > 1)
    --save-last 0|1|link
    --resume R          none | last (Lightning's ckpt_path="last") | latest (newest
                        complete file by recorded step: integrations.lightning)
    --adopt 0|1         with --resume latest: adopt the complete stock files first
    --preempt 0|1       add integrations.lightning.PreemptionCallback; exit with its code
    --signal-self-at S  one rank sends itself SIGTERM at the start of step S
    --signal-rank R     that rank (default 0)
    --signal-group 0|1  with --signal-self-at: another process sends SIGTERM to the
                        job's whole process group instead (SLURM signals every process
                        of the job step, DataLoader workers included)
    --workers N         the DataLoader's num_workers (persistent workers when N > 0)
    --hold-at S         after the save of step S, write REF/held and sleep (the test
                        kills the job then)
    --settle 0|1        with --hold-at: before step S, wait for each background save
                        to land before the next step
    --slow-stock-at S   stock-async only: the inner TorchCheckpointIO sleeps before
                        writing step S (a large checkpoint that takes long to write)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # noqa: E402

WORKERS = 0  # --workers


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.dropout = nn.Dropout(0.1)  # consumes the global RNG every step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(self.dropout(x)), y)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(256, 6, generator=g)
        y = (x @ torch.arange(6.0)).unsqueeze(1)
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y),
            batch_size=8,
            num_workers=WORKERS,
            persistent_workers=WORKERS > 0,
        )

    # Lightning does not checkpoint the RNG; a job that wants identical resumes does.
    def on_save_checkpoint(self, checkpoint):
        checkpoint["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate()}

    def on_load_checkpoint(self, checkpoint):
        torch.set_rng_state(checkpoint["rng"]["torch"])
        random.setstate(checkpoint["rng"]["python"])
        # Lightning draws from the global RNG between the restore and the first step
        # (data loading), so the test compares the RNG as restored, here.
        self.restored_rng = (torch.get_rng_state(), random.getstate())


def cpu_trainer(
    devices: int, max_steps: int, callbacks: list[Callback], plugins: list
) -> pl.Trainer:
    """A Trainer of ``TinyModel`` on the CPU, in ``devices`` processes (DDP over gloo when
    more than one), with no logger, progress bar, model summary or sanity check."""
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=max_steps,
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def live_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    rng = getattr(module, "restored_rng", None) or (torch.get_rng_state(), random.getstate())
    return {
        "global_step": trainer.global_step,
        "model": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "rng": rng[0],
        "python_rng": rng[1],
    }


@dataclass(eq=False)  # compared and hashed by identity, as Lightning's callbacks are
class Recorder(Callback):
    ref: str
    resumed: bool
    hold_at: int | None
    settle: bool
    signal_at: int | None = None
    signal_rank: int = 0
    signal_group: bool = False
    start_step: int | None = field(default=None, init=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # Called on every rank while the checkpoint dict is built: the reference is the
        # live state at exactly that moment.
        path = os.path.join(self.ref, f"step-{trainer.global_step}-rank{trainer.global_rank}.pt")
        torch.save(live_state(trainer, pl_module), path)

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step
        if self.resumed:
            torch.save(
                live_state(trainer, pl_module),
                os.path.join(self.ref, f"resumed-rank{trainer.global_rank}.pt"),
            )
        pl_module.restored_rng = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.signal_at and trainer.global_rank == self.signal_rank:
            if self.signal_group:  # from another process, to every process of the job
                subprocess.run(["kill", "-TERM", "--", f"-{os.getpgid(0)}"], check=False)
            else:
                os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption notice
        if self.settle and self.hold_at is not None and trainer.global_step < self.hold_at:
            # Before the save the test is about, let background saves land, as they
            # do when steps take longer than saves (real training); otherwise a
            # removal could find the previous file not written yet.
            path = trainer.checkpoint_callback.best_model_path
            deadline = time.monotonic() + 60
            while path and not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)
        if (
            self.hold_at is not None
            and trainer.global_step == self.hold_at
            and trainer.global_rank == 0
        ):
            # ModelCheckpoint saved (and asked to remove) in the previous batch's end hook.
            with open(os.path.join(self.ref, "held"), "w") as f:
                f.write(str(trainer.global_step))
            time.sleep(300)


class SlowTorchCheckpointIO(TorchCheckpointIO):
    def __init__(self, slow_at: int | None):
        super().__init__()
        self.slow_at = slow_at

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if checkpoint.get("global_step") == self.slow_at:
            time.sleep(300)
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--io", choices=["stock", "atomic", "stock-async", "atomic-async"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--save-last", choices=["0", "1", "link"], default="1")
    p.add_argument("--resume", choices=["none", "last", "latest"], default="none")
    p.add_argument("--adopt", type=int, default=0)
    p.add_argument("--preempt", type=int, default=0)
    p.add_argument("--signal-self-at", type=int, default=None)
    p.add_argument("--signal-rank", type=int, default=0)
    p.add_argument("--signal-group", type=int, default=0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--settle", type=int, default=0)
    p.add_argument("--slow-stock-at", type=int, default=None)
    a = p.parse_args()
    global WORKERS
    WORKERS = a.workers
    os.makedirs(a.ref, exist_ok=True)
    pl.seed_everything(7, verbose=False)

    if a.io == "stock":
        plugin = TorchCheckpointIO()
    elif a.io == "stock-async":
        plugin = AsyncCheckpointIO(SlowTorchCheckpointIO(a.slow_stock_at))
    else:
        from atomic_checkpoint.integrations.lightning import (
            AsyncAtomicCheckpointIO,
            AtomicCheckpointIO,
        )

        plugin = AtomicCheckpointIO() if a.io == "atomic" else AsyncAtomicCheckpointIO()

    ckpt_path = None
    if a.resume == "last":
        ckpt_path = "last"
    elif a.resume == "latest":
        from atomic_checkpoint.integrations.lightning import latest_checkpoint

        ckpt_path = latest_checkpoint(a.dir, adopt=bool(a.adopt))

    monitor = {"monitor": "step", "mode": "max"} if a.top_k > 1 else {}
    checkpoint = ModelCheckpoint(
        dirpath=a.dir,
        every_n_train_steps=a.every,
        save_top_k=a.top_k,
        save_last="link" if a.save_last == "link" else a.save_last == "1",
        **monitor,
    )
    recorder = Recorder(
        a.ref,
        resumed=ckpt_path is not None,
        hold_at=a.hold_at,
        settle=bool(a.settle),
        signal_at=a.signal_self_at,
        signal_rank=a.signal_rank,
        signal_group=bool(a.signal_group),
    )
    callbacks = [checkpoint, recorder]
    preempt = None
    if a.preempt:
        from atomic_checkpoint.integrations.lightning import PreemptionCallback

        preempt = PreemptionCallback()
        callbacks.append(preempt)
    trainer = cpu_trainer(a.devices, a.max_steps, callbacks, [plugin])
    trainer.fit(TinyModel(), ckpt_path=ckpt_path)
    report = {
        "resumed_from": ckpt_path,
        "start_step": recorder.start_step,
        "final_step": trainer.global_step,
        "world_size": trainer.world_size,
        "best_k": sorted(os.path.basename(k) for k in checkpoint.best_k_models),
    }
    if preempt is not None:
        report["preempted"] = preempt.saved_path
    with open(os.path.join(a.ref, f"report-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)
    if preempt is not None:
        preempt.exit()  # 75 when preempted: requeue


if __name__ == "__main__":
    main()
