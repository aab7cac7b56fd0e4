# What the Lightning preludes share (each names it on a line "include: _regressor"):
# examples/lightning_checkpoint_io.py's LightningModule, a linear regressor with its data
# (8 batches an epoch), and its Trainer arguments that keep a run quiet on the CPU.
# ruff: noqa: F401  (the preludes that include this part use these names)
from examples.lightning_checkpoint_io import QUIET as _quiet
from examples.lightning_checkpoint_io import Regressor as _Regressor
