"""Atomic, verified Lightning checkpoints: train, resume from the newest complete one,
and see a torn file refused.

Run:  python examples/lightning_checkpoint_io.py [CHECKPOINT_DIR]

CPU only, a few seconds. With ``Trainer(strategy="ddp", devices=N)`` nothing changes:
only global rank 0 writes, as with Lightning's own plugin.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from atomic_checkpoint import CheckpointError
from atomic_checkpoint.integrations.lightning import (
    MANIFEST_SUFFIX,
    AtomicCheckpointIO,
    latest_checkpoint,
    verify_checkpoint,
)

warnings.filterwarnings("ignore", module="lightning")  # tips about dataloader workers etc.
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=8)


#: Trainer arguments for a quiet run on the CPU: no logger, progress bar or model summary.
QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)


def trainer(dirpath: str, max_steps: int) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps,
        # The two lines: the plugin, and ModelCheckpoint as usual.
        plugins=[AtomicCheckpointIO()],
        callbacks=[
            ModelCheckpoint(
                dirpath=dirpath,
                every_n_train_steps=2,
                save_top_k=2,
                monitor="step",
                mode="max",
                save_last=True,
            )
        ],
        **QUIET,
    )


def main() -> None:
    from _dir import example_dir  # beside this file

    dirpath = example_dir(__doc__, "lightning-ckpts-")
    trainer(dirpath, max_steps=6).fit(Regressor())
    print(f"trained 6 steps; {dirpath} holds:")
    for name in sorted(os.listdir(dirpath)):
        print(f"  {name}")

    newest = latest_checkpoint(dirpath)  # by recorded step, verified; never by mtime
    if newest is None:
        raise SystemExit(f"no complete checkpoint in {dirpath}")
    step = verify_checkpoint(newest).global_step
    resumed = trainer(dirpath, max_steps=8)
    resumed.fit(Regressor(), ckpt_path=newest)
    print(
        f"resumed at step {step} from {os.path.basename(newest)}; now at step {resumed.global_step}"
    )

    # A copy torn half way (what an interrupted in-place copy leaves) is refused.
    torn = os.path.join(dirpath, "torn.ckpt")
    shutil.copy(os.path.join(dirpath, "last.ckpt"), torn)
    shutil.copy(os.path.join(dirpath, "last.ckpt" + MANIFEST_SUFFIX), torn + MANIFEST_SUFFIX)
    with open(torn, "r+b") as f:
        f.truncate(os.path.getsize(torn) // 2)
    try:
        AtomicCheckpointIO().load_checkpoint(torn)
    except CheckpointError as exc:
        print(f"loading a torn copy: refused: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
