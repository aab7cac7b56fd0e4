"""SIGKILL in the middle of a Trainer save, with and without make_atomic.

hf_kill.py run {stock|atomic} OUT_DIR KILL_STEP
    Trains a 10-step schedule saving every 2 steps (save_total_limit=2) and kills
    itself with SIGKILL while saving checkpoint KILL_STEP: after the model file is
    written, before optimizer.pt, scheduler.pt, the RNG state and trainer_state.json.

hf_kill.py check STOCK_DIR ATOMIC_DIR REF_DIR RESULT_JSON RESUME_STEP
    Resumes each killed run with resume_from_checkpoint=True (stock Trainer on the
    stock run, make_atomic on the atomic run), runs an uninterrupted reference, and
    writes what happened to RESULT_JSON.

hf_kill.py adopt STOCK_DIR REF_DIR RESULT_JSON RESUME_STEP
    Continues a killed stock run with the integration switched on the Trainer's way
    (AtomicCheckpointCallback(adopt_existing=True)) and resume_from_checkpoint=True,
    runs an uninterrupted reference, and writes what happened to RESULT_JSON.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from compare import differences, dump
from tiny_hf import RandomTokens, SnapshotAt, StopAt, losses, tiny_args, tiny_model
from transformers import Trainer, TrainerCallback

from atomic_checkpoint.integrations.hf import make_atomic

MAX_STEPS = 10


def build(out: str, *, atomic: bool, callbacks: list | None = None) -> Trainer:
    t = Trainer(
        model=tiny_model(),
        args=tiny_args(out, max_steps=MAX_STEPS, save_total_limit=2),
        train_dataset=RandomTokens(64),
        callbacks=callbacks,
    )
    return make_atomic(t, timeout_s=60) if atomic else t


def run(kind: str, out: str, kill_step: int) -> None:
    trainer = build(out, atomic=kind == "atomic")
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        name = os.path.basename(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else ""
        if name == "optimizer.pt" and trainer.state.global_step == kill_step:
            # The model files of this checkpoint are on disk, nothing else is.
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    trainer.train()
    raise SystemExit(f"the run finished without reaching the kill at step {kill_step}")


def compare_to_reference(
    doc: dict, resumed: Trainer, snap: SnapshotAt, ref_dir: str, resume_step: int
) -> SnapshotAt:
    """Train an uninterrupted reference run in ``ref_dir`` and record in ``doc`` how the
    resumed run differs from it: the state restored at ``resume_step`` (``snap``), the
    losses after it, and the final weights (all empty/equal when the resume is exact).
    Returns the reference's own snapshot at ``resume_step``."""
    ref_snap = SnapshotAt(resume_step)
    reference = build(ref_dir, atomic=False, callbacks=[ref_snap])
    reference.train()
    doc["restored_vs_reference"] = differences(snap.taken, ref_snap.taken)
    doc["losses_resumed"] = {
        k: v for k, v in losses(resumed.state.log_history).items() if k > resume_step
    }
    doc["losses_reference"] = {
        k: v for k, v in losses(reference.state.log_history).items() if k > resume_step
    }
    doc["final_vs_reference"] = differences(
        resumed.model.state_dict(), reference.model.state_dict()
    )
    return ref_snap


def check(stock_dir: str, atomic_dir: str, ref_dir: str, result: str, resume_step: int) -> None:
    doc: dict[str, object] = {}
    try:
        build(stock_dir, atomic=False).train(resume_from_checkpoint=True)
        doc["stock_resume"] = "succeeded"
    except Exception as exc:
        doc["stock_resume"] = f"{type(exc).__name__}: {exc}"
        doc["stock_resume_type"] = [c.__name__ for c in type(exc).__mro__]
        doc["stock_traceback"] = traceback.format_exc()

    # make_atomic on a directory holding only a torn checkpoint: an error, never a
    # silent fresh start.
    torn_only = os.path.join(ref_dir + "-torn-only")
    shutil.copytree(
        os.path.join(stock_dir, "checkpoint-6"), os.path.join(torn_only, "checkpoint-6")
    )
    try:
        build(torn_only, atomic=True).train(resume_from_checkpoint=True)
        doc["atomic_on_torn_only"] = "succeeded"
    except Exception as exc:
        doc["atomic_on_torn_only"] = f"{type(exc).__name__}: {exc}"

    snap = SnapshotAt(resume_step)
    resumed = build(atomic_dir, atomic=True, callbacks=[snap])
    resumed.train(resume_from_checkpoint=True)
    doc["atomic_first_step"] = snap.first_step_seen

    ref_snap = compare_to_reference(doc, resumed, snap, ref_dir, resume_step)
    doc["atomic_listing"] = sorted(os.listdir(atomic_dir))

    # The marker strategy (chosen on object-store mounts such as s3fs, where directory
    # rename is copy+delete): files stay in checkpoint-N/attempt-<token>/.
    marker = ref_dir + "-marker"
    first = build(marker, atomic=True, callbacks=[StopAt(4)])
    first._atomic_checkpoint.strategy = "marker"
    first.train()
    snap_m = SnapshotAt(4)
    again = build(marker, atomic=True, callbacks=[snap_m])
    again._atomic_checkpoint.strategy = "marker"
    again.train(resume_from_checkpoint=True)
    doc["marker_first_step"] = snap_m.first_step_seen
    doc["marker_restored_vs_reference"] = differences(snap_m.taken, ref_snap.taken)
    doc["marker_files"] = {
        name: _files(os.path.join(marker, name))
        for name in os.listdir(marker)
        if name.startswith("checkpoint-")
    }
    dump(result, doc)


def adopt(stock_dir: str, ref_dir: str, result: str, resume_step: int) -> None:
    from atomic_checkpoint import CheckpointManager
    from atomic_checkpoint.integrations.hf import AtomicCheckpointCallback
    from atomic_checkpoint.storage import open_storage

    doc: dict[str, object] = {"before": sorted(os.listdir(stock_dir))}
    storage = open_storage(stock_dir)
    snap = SnapshotAt(resume_step)
    seen = Manifests(storage)
    continued = Trainer(
        model=tiny_model(),
        args=tiny_args(stock_dir, max_steps=MAX_STEPS, save_total_limit=2),
        train_dataset=RandomTokens(64),
        callbacks=[AtomicCheckpointCallback(adopt_existing=True, timeout_s=60), snap, seen],
    )
    continued.train(resume_from_checkpoint=True)
    adopted = seen.at_train_begin
    doc["at_resume"] = adopted
    doc["refused"] = {str(k): v for k, v in continued._atomic_checkpoint.refused.items()}
    doc["first_step"] = snap.first_step_seen

    compare_to_reference(doc, continued, snap, ref_dir, resume_step)
    doc["after"] = sorted(os.listdir(stock_dir))
    doc["committed"] = [c.step for c in CheckpointManager(stock_dir, read_only=True).checkpoints()]
    dump(result, doc)


def _files(top: str) -> list[str]:
    """Every file under ``top``, relative, '/'-separated."""
    return sorted(
        os.path.relpath(os.path.join(d, f), top).replace(os.sep, "/")
        for d, _, files in os.walk(top)
        for f in files
    )


class Manifests(TrainerCallback):
    """Records, when training begins (after adoption, before any save), whether each
    checkpoint folder has a manifest marked adopted (or the error reading it)."""

    def __init__(self, storage) -> None:
        self.storage = storage
        self.at_train_begin: dict[str, object] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        from atomic_checkpoint.catalog import read_manifest

        for name in sorted(os.listdir(args.output_dir)):
            if name.startswith("checkpoint-"):
                try:
                    self.at_train_begin[name] = bool(read_manifest(self.storage, name).adopted)
                except Exception as exc:
                    self.at_train_begin[name] = type(exc).__name__


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "adopt":
        adopt(*sys.argv[2:5], int(sys.argv[5]))
    else:
        check(*sys.argv[2:6], int(sys.argv[6]))
