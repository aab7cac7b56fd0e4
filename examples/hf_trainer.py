"""Atomic Hugging Face Trainer checkpoints: train, find the torn checkpoint a crash
mid-save leaves, and resume from the newest complete one.

Run:  python examples/hf_trainer.py [OUTPUT_DIR]

CPU only, a few seconds, no downloads (a one-layer GPT-2 built from a config). Under
``torchrun --nproc_per_node=N`` nothing changes: every process calls the same code.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from atomic_checkpoint.integrations.hf import make_atomic

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


class Tokens(torch.utils.data.Dataset):
    """64 random sequences of 8 tokens; the labels are the inputs."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class FirstStep(TrainerCallback):
    """Remembers the step training (re)started from."""

    step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def tiny_gpt2() -> GPT2LMHeadModel:
    """A one-layer GPT-2 over the 64-token vocabulary, the same weights every time."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))


def training_args(output_dir: str, max_steps: int, **more: Any) -> TrainingArguments:
    """Batches of 4, a save every 2 steps, on the CPU, without logs or progress bars."""
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_steps=2,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **more,
    )


def trainer(output_dir: str, max_steps: int) -> Trainer:
    args = training_args(output_dir, max_steps, save_total_limit=2)
    t = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())
    t.remove_callback(PrinterCallback)
    return make_atomic(t)  # the one line that makes its checkpoints atomic


def checkpoints(output_dir: str) -> list[str]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # The rotation runs on rank 0, after the commit: the other ranks' train() can
        # return first, so they look once rank 0 is done.
        torch.distributed.barrier()
    found = [n for n in os.listdir(output_dir) if n.startswith("checkpoint-")]
    return sorted(found, key=lambda n: int(n.split("-")[1]))


def main() -> None:
    from _dir import example_dir  # beside this file

    output_dir = example_dir(__doc__, "hf-atomic-")

    trainer(output_dir, max_steps=6).train()
    print(f"trained 6 steps, saving every 2 with save_total_limit=2: {checkpoints(output_dir)}")
    print("  (checkpoint-2 was deleted only after checkpoint-6 was committed)")

    # What a crash (OOM kill, preemption, full disk) during the save of step 8 leaves
    # with the stock Trainer: the model files, no optimizer, no trainer_state.json.
    torn = os.path.join(output_dir, "checkpoint-8")
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one process makes it
        os.makedirs(torn)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(output_dir, "checkpoint-6", name), torn)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank sees it before it resumes
    print(f"simulated a crash mid-save: {torn} holds only {sorted(os.listdir(torn))}")
    stock_pick = os.path.basename(get_last_checkpoint(output_dir))
    print(f"  the stock resume would load {stock_pick} and fail: it has no trainer_state.json")

    first = FirstStep()
    resumed = trainer(output_dir, max_steps=10)
    resumed.add_callback(first)
    resumed.train(resume_from_checkpoint=True)
    print(f"resume_from_checkpoint=True continued from step {first.step}, the newest complete")
    print(f"trained to step {resumed.state.global_step}: {checkpoints(output_dir)}")
    print("  (the torn checkpoint-8 was replaced by a complete one; 4 and 6 were rotated away)")


if __name__ == "__main__":
    main()
