# What the Trainer preludes share (each names it on a line "include: _tiny_trainer"):
# 64 random sequences of a 64-token vocabulary, and TrainingArguments that save every
# 2 steps into out/ on the CPU, quietly.
import torch
from transformers import TrainingArguments


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
