# What README.md's Lightning adoption samples assume: a stock run (Lightning's own
# checkpoint plugin) that saved ckpts/step=2, 4, 6 and last.ckpt, then was killed while its
# copy into last.ckpt had truncated that file (the stock copy opens it with "wb" first);
# a LightningModule; the reader's other Trainer arguments (here: to step 8, quiet).
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import functools
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from atomic_checkpoint.integrations.lightning import AtomicCheckpointIO, latest_checkpoint

# include: _regressor
_every2 = ModelCheckpoint(dirpath="ckpts", save_last=True, every_n_train_steps=2, save_top_k=-1)
pl.Trainer(max_steps=6, callbacks=[_every2], **_quiet).fit(_Regressor())
open("ckpts/last.ckpt", "wb").close()  # the kill's state: truncated, nothing written yet
Trainer = functools.partial(pl.Trainer, max_steps=8, **_quiet)
model = _Regressor()
# --- sample ---
# It resumed from step 6, the newest complete checkpoint, and trained on to step 8.
assert trainer.global_step == 8, trainer.global_step
assert os.path.isfile("ckpts/epoch=0-step=6.ckpt.manifest.json"), os.listdir("ckpts")
