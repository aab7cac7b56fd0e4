"""A Trainer with ``make_atomic(preemption=True)``, signals armed first; SIGTERM to
itself at the start of step ``SIGNAL_AT + 1`` (as a scheduler would send it). Writes
``OUT/result.json`` and exits with the guard's exit status.

Arguments: OUT MAX_STEPS SIGNAL_AT (0: no signal) RESUME (0/1) [WORKERS [EVAL_STEPS
[SAVE_STEPS]]]. With
WORKERS > 0 the Trainer's DataLoaders have that many (persistent) workers, and the
signal goes, from another process, to the job's whole process group, as SLURM sends it
to every process of the job step. ``result.json`` lists the steps evaluated.
"""

from atomic_checkpoint import preemption

preemption.arm()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from tiny_hf import RandomTokens, tiny_args, tiny_model  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from atomic_checkpoint.integrations.hf import make_atomic  # noqa: E402

out, max_steps, signal_at, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
workers = int(sys.argv[5]) if len(sys.argv) > 5 else 0
eval_steps = int(sys.argv[6]) if len(sys.argv) > 6 else 0
save_steps = int(sys.argv[7]) if len(sys.argv) > 7 else 100
evaluating = {"eval_strategy": "steps", "eval_steps": eval_steps} if eval_steps else {}


class SignalAt(TrainerCallback):
    first_step = None  # global_step when the first step began: where training resumed

    def on_step_begin(self, args, state, control, **kw):
        if self.first_step is None:
            self.first_step = state.global_step
        if signal_at and state.global_step == signal_at:
            if workers:
                subprocess.run(["kill", "-TERM", "--", f"-{os.getpgid(0)}"], check=False)
            else:
                os.kill(os.getpid(), signal.SIGTERM)


args = tiny_args(
    os.path.join(out, "run"),
    max_steps=max_steps,
    save_steps=save_steps,
    dataloader_num_workers=workers,
    dataloader_persistent_workers=workers > 0,
    **evaluating,
)
trainer = make_atomic(
    Trainer(
        model=tiny_model(),
        args=args,
        train_dataset=RandomTokens(64),
        eval_dataset=RandomTokens(8) if eval_steps else None,
        callbacks=[signaller := SignalAt()],
    ),
    preemption=True,
)
trainer.train(resume_from_checkpoint=True if resume == "1" else None)
guard = trainer.preemption_guard
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(
        {
            "first_step": signaller.first_step,
            "global_step": trainer.state.global_step,
            "decided": guard.decided_step,
            "signum": guard.signum,
            "exit_code": guard.exit_code,
            "evaluated": [e["step"] for e in trainer.state.log_history if "eval_loss" in e],
        },
        f,
    )
guard.exit()
