"""Runs of the stock frameworks, without atomic-checkpoint, for the adoption tests.

stock_runs.py hf OUTPUT_DIR MAX_STEPS
    A stock Trainer run saving every 2 steps (checkpoint-2, -4, ...), then
    ``trainer.save_model(OUTPUT_DIR)`` (config.json, model.safetensors, ... at the top).

stock_runs.py hf-resume OUTPUT_DIR CHECKPOINT MAX_STEPS RESULT_JSON
    A stock Trainer resumed from CHECKPOINT (a path), trained to MAX_STEPS; writes the
    first step it trained and its final global_step.

stock_runs.py accelerate PROJECT_DIR SAVES
    Stock ``accelerator.save_state()`` with automatic naming, SAVES times
    (checkpoints/checkpoint_0, _1, ...).

stock_runs.py accelerate-load PROJECT_DIR RESULT_JSON
    Stock ``accelerator.load_state()`` (the newest folder by Accelerate's own rule).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def hf(output_dir: str, max_steps: int) -> None:
    from tiny_hf import RandomTokens, tiny_args, tiny_model
    from transformers import Trainer

    trainer = Trainer(
        model=tiny_model(),
        args=tiny_args(output_dir, max_steps=max_steps, eval_strategy="steps", eval_steps=2),
        train_dataset=RandomTokens(64),
        eval_dataset=RandomTokens(8, seed=1),
    )
    trainer.train()
    trainer.save_model(output_dir)


def hf_resume(output_dir: str, checkpoint: str, max_steps: int, result: str) -> None:
    from tiny_hf import RandomTokens, SnapshotAt, tiny_args, tiny_model
    from transformers import Trainer

    seen = SnapshotAt(0)
    trainer = Trainer(
        model=tiny_model(seed=1),
        args=tiny_args(output_dir, max_steps=max_steps),
        train_dataset=RandomTokens(64),
        callbacks=[seen],
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    with open(result, "w") as f:
        json.dump({"first_step": seen.first_step_seen, "global_step": trainer.state.global_step}, f)


def accelerate(project_dir: str, saves: int) -> None:
    from tiny_accel import build, train_step

    accelerator, model, optimizer, scheduler = build(project_dir, total_limit=None)
    for step in range(saves):
        train_step(accelerator, model, optimizer, scheduler, step)
        accelerator.save_state()


def accelerate_load(project_dir: str, result: str) -> None:
    from tiny_accel import build

    accelerator, *_ = build(project_dir, total_limit=None)
    accelerator.load_state()
    with open(result, "w") as f:
        json.dump({"iteration": accelerator.project_configuration.iteration}, f)


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    if what == "hf":
        hf(rest[0], int(rest[1]))
    elif what == "hf-resume":
        hf_resume(rest[0], rest[1], int(rest[2]), rest[3])
    elif what == "accelerate":
        accelerate(rest[0], int(rest[1]))
    elif what == "accelerate-load":
        accelerate_load(rest[0], rest[1])
    else:
        raise SystemExit(f"unknown command {what!r}")
