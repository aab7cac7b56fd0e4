# What README.md's Lightning samples assume: Lightning's names, a LightningModule with its
# data (a linear regressor, 8 batches an epoch), and the reader's other Trainer arguments,
# which the samples leave out (here: 6 steps, no logger, quiet). After a sample that only
# builds its Trainer, the Trainer fits, and each checkpoint file has its manifest.
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import functools
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from atomic_checkpoint.integrations.lightning import AtomicCheckpointIO, latest_checkpoint

# include: _regressor
Trainer = functools.partial(pl.Trainer, max_steps=6, **_quiet)
model = _Regressor()
# --- sample ---
if trainer.global_step == 0:
    trainer.fit(model)
_files = []
for _dir, _, _names in os.walk("."):
    _files += [os.path.join(_dir, n) for n in _names if n.endswith(".ckpt")]
assert _files, "no checkpoint was saved"
for _f in _files:
    assert os.path.isfile(_f + ".manifest.json"), _f
