"""HF Trainer and Lightning jobs for the ``preemption`` campaign: two gloo ranks on
CPU under torchrun, a tiny model, periodic checkpoints through the framework's own
``save_steps`` / ``ModelCheckpoint(every_n_train_steps=...)``.

Arguments: FRAMEWORK (hf | lightning) SIDE (ours | stock) OUT CTL MAX_STEPS SAVE_EVERY.

- ``stock``: the framework as it ships, under stock torchrun, its default signal
  handling, no code of this library.
- ``ours``: ``preemption.arm()`` first; HF: ``make_atomic(trainer, preemption=True)``;
  Lightning: ``AtomicCheckpointIO`` and ``PreemptionCallback``; the process ends with
  the guard's exit status, under ``python -m atomic_checkpoint.launch``.

Each rank writes ``CTL/rank<r>.pid`` at once, ``CTL/rank<r>.step`` after each step and
``CTL/result-rank<r>.json`` if training returns. ``PREEMPT_HOLD=startup`` holds every
rank before the framework is imported; ``PREEMPT_HOLD=checkpoint`` (with
``PREEMPT_HOLD_NTH``) holds rank 0 inside its n-th periodic save (HF: the model file
written, the optimizer not yet; Lightning: the checkpoint being assembled), writing
``CTL/at-<moment>-rank<r>`` and waiting for ``CTL/go``, as ``preempt_train.py`` does.
"""

import os
import sys

framework, side = sys.argv[1], sys.argv[2]
if side == "ours":
    from atomic_checkpoint import preemption

    preemption.arm()  # first: a SIGTERM during start-up is recorded, not fatal

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

out, ctl = sys.argv[3], Path(sys.argv[4])
max_steps, save_every = int(sys.argv[5]), int(sys.argv[6])
rank = int(os.environ["RANK"])
HOLD = os.environ.get("PREEMPT_HOLD", "")
HOLD_NTH = int(os.environ.get("PREEMPT_HOLD_NTH", "1"))
seen = {"n": 0}
SCRIPTS = Path(__file__).resolve().parents[2] / "integrations" / "scripts"
sys.path.insert(0, str(SCRIPTS))


def put(name: str, text: str) -> None:
    tmp = ctl / f".{name}.{threading.get_ident()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, ctl / name)


def hold(moment: str, step: int | None) -> None:
    if moment != HOLD or (moment != "startup" and rank != 0):
        return
    seen["n"] += 1
    if seen["n"] != HOLD_NTH:
        return
    where = {"step": step, "at": time.monotonic()}
    put(f"at-{moment}-rank{rank}", json.dumps(where))
    deadline = time.monotonic() + 60
    while not (ctl / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    put(f"left-{moment}-rank{rank}", json.dumps(where))


put(f"rank{rank}.pid", str(os.getpid()))
hold("startup", None)


def run_hf() -> int:
    from tiny_hf import RandomTokens, tiny_args, tiny_model
    from transformers import Trainer, TrainerCallback

    class Paced(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            put(f"rank{rank}.step", str(state.global_step))
            time.sleep(0.02)  # a step of real training takes a while

    args = tiny_args(
        os.path.join(out, "run"),
        max_steps=max_steps,
        save_steps=save_every,
        save_total_limit=3,
        logging_steps=10**6,
        ddp_backend="gloo",
    )
    trainer = Trainer(
        model=tiny_model(), args=args, train_dataset=RandomTokens(64), callbacks=[Paced()]
    )
    if side == "ours":
        from atomic_checkpoint.integrations.hf import make_atomic

        trainer = make_atomic(trainer, preemption=True)
    inner = trainer._save_optimizer_and_scheduler

    def save_optimizer_and_scheduler(*a, **k):  # type: ignore[no-untyped-def]
        hold("checkpoint", trainer.state.global_step)  # the model file is written
        return inner(*a, **k)

    trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
    trainer.train()
    guard = getattr(trainer, "preemption_guard", None)
    report(trainer.state.global_step, guard)
    return 0 if guard is None else guard.exit_code


def run_lightning() -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning_train import TinyModel, cpu_trainer

    class Paced(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            put(f"rank{rank}.step", str(trainer.global_step))
            time.sleep(0.02)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):  # type: ignore[no-untyped-def]
            hold("checkpoint", trainer.global_step)  # the checkpoint is being assembled

    pl.seed_everything(7, verbose=False)
    ckpt_dir = os.path.join(out, "run")
    callbacks = [
        ModelCheckpoint(
            dirpath=ckpt_dir, every_n_train_steps=save_every, save_top_k=-1, save_last=True
        ),
        Paced(),
    ]
    plugins = []
    preempt = None
    if side == "ours":
        from atomic_checkpoint.integrations.lightning import AtomicCheckpointIO, PreemptionCallback

        plugins.append(AtomicCheckpointIO())
        callbacks.append(preempt := PreemptionCallback())
    trainer = cpu_trainer(2, max_steps, callbacks, plugins)
    trainer.fit(TinyModel())
    report(trainer.global_step, None if preempt is None else preempt.guard)
    if preempt is not None:
        preempt.exit()
    return 0


def report(global_step: int, guard) -> None:  # type: ignore[no-untyped-def]
    put(
        f"result-rank{rank}.json",
        json.dumps(
            {
                "rank": rank,
                "global_step": global_step,
                "decided": None if guard is None else guard.decided_step,
                "skipped_save": None if guard is None else guard.skipped_save,
                "exit_code": 0 if guard is None else guard.exit_code,
                "ended_at": time.monotonic(),
            }
        ),
    )


code = run_hf() if framework == "hf" else run_lightning()
if side == "ours" and code:
    from atomic_checkpoint.preemption import REQUEUE_EXIT_CODE

    assert code == REQUEUE_EXIT_CODE
    import signal

    for s in (signal.SIGTERM, signal.SIGUSR1):  # as guard.exit() does
        signal.signal(s, signal.SIG_IGN)
sys.exit(code)
