"""A tiny GPT-2 and random token data for Trainer tests (CPU, seconds, no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from compare import snapshot
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

VOCAB = 64
SEQ_LEN = 8


class RandomTokens(torch.utils.data.Dataset):
    """``n`` fixed random sequences; labels are the inputs (language modelling)."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i]
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    """One layer, 16 wide, with GPT-2's default dropout (so RNG state matters)."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16)
    )


def tiny_args(output_dir: str, **overrides: object) -> TrainingArguments:
    kwargs: dict[str, object] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)  # type: ignore[arg-type]


class SnapshotAt(TrainerCallback):
    """Snapshots the training state at the beginning of the step after ``step``: after a
    resume from ``step``, that is the state the checkpoint restored."""

    def __init__(self, step: int):
        self.step = step
        self.taken: dict[str, object] | None = None
        self.first_step_seen: int | None = None

    def on_step_begin(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw
    ):
        if self.first_step_seen is None:
            self.first_step_seen = state.global_step
        if state.global_step == self.step and self.taken is None:
            self.taken = snapshot(model, optimizer, lr_scheduler)


class StopAt(TrainerCallback):
    """Stops the training once it has done ``step`` steps (a run cut short, as a kill
    or a preemption would, but cleanly)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def losses(log_history: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in log_history if "loss" in e}
