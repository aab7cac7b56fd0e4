# What the Trainer preludes share (each names it on a line "include: _tiny_trainer"):
# examples/hf_trainer.py's one-layer GPT-2, its 64 random sequences of a 64-token
# vocabulary, and its TrainingArguments that save every 2 steps on the CPU, quietly,
# here into out/.
# ruff: noqa: F401  (the preludes that include this part use these names)
from examples.hf_trainer import Tokens as _Tokens
from examples.hf_trainer import tiny_gpt2 as _model
from examples.hf_trainer import training_args as _training_args
from transformers import TrainingArguments


def _args(max_steps: int) -> TrainingArguments:
    return _training_args("out", max_steps)
