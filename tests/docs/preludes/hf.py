# What README.md's Trainer sample assumes: a model, TrainingArguments and a data set (a
# one-layer GPT-2 on 64 random sequences, CPU). After it, the Trainer trains 4 steps,
# saving every 2, and each checkpoint is a committed, verified one.
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import os

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

from atomic_checkpoint import CheckpointManager

transformers.logging.set_verbosity_error()


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(max_steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir="out",
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_steps=2,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
args = _args(4)
ds = _Tokens()
# --- sample ---
trainer.remove_callback(PrinterCallback)
trainer.train()
assert {"checkpoint-2", "checkpoint-4"} <= set(os.listdir("out")), os.listdir("out")
with CheckpointManager("out", read_only=True) as _m:
    assert [c.step for c in _m.checkpoints()] == [2, 4], _m.checkpoints()
    _m.verify(4)
