# What README.md's Trainer adoption sample assumes: a stock Trainer run's output_dir (a
# real Trainer without the library saved checkpoint-2 and checkpoint-4; a crash then tore
# checkpoint-4: the Trainer writes trainer_state.json last), and a model,
# TrainingArguments (now to step 6) and a data set for the continued run.
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import os

import transformers
from transformers import PrinterCallback, Trainer, TrainingArguments

from atomic_checkpoint import CheckpointManager, ResumeError
from atomic_checkpoint.integrations.hf import AtomicCheckpointCallback, make_atomic

transformers.logging.set_verbosity_error()

# include: _tiny_trainer
ds = _Tokens()
_stock = Trainer(model=_model(), args=_args(4), train_dataset=ds)
_stock.remove_callback(PrinterCallback)
_stock.train()
os.remove("out/checkpoint-4/trainer_state.json")
# As the sample's first comment says, without the opt-in the resume refuses them.
_before = make_atomic(Trainer(model=_model(), args=_args(6), train_dataset=ds))
try:
    _before.train(resume_from_checkpoint=True)
    raise AssertionError("the stock checkpoints were not refused")
except ResumeError as _exc:
    print("before:", _exc)
model, args = _model(), _args(6)
# --- sample ---
# It adopted checkpoint-2, refused the torn checkpoint-4, resumed from step 2 and saved on.
with CheckpointManager("out", read_only=True) as _m:
    _steps = [c.step for c in _m.checkpoints()]
    assert 2 in _steps and 6 in _steps, _steps
    assert _m.checkpoints()[0].adopted, _m.checkpoints()
    _m.verify(6)
