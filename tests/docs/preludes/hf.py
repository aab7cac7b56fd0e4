# What README.md's Trainer sample assumes: a model, TrainingArguments and a data set (a
# one-layer GPT-2 on 64 random sequences, CPU). After it, the Trainer trains 4 steps,
# saving every 2, and each checkpoint is a committed, verified one.
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import os

import transformers
from transformers import PrinterCallback, Trainer, TrainingArguments

from atomic_checkpoint import CheckpointManager

transformers.logging.set_verbosity_error()

# include: _tiny_trainer
model = _model()
args = _args(4)
ds = _Tokens()
# --- sample ---
trainer.remove_callback(PrinterCallback)
trainer.train()
assert {"checkpoint-2", "checkpoint-4"} <= set(os.listdir("out")), os.listdir("out")
with CheckpointManager("out", read_only=True) as _m:
    assert [c.step for c in _m.checkpoints()] == [2, 4], _m.checkpoints()
    _m.verify(4)
