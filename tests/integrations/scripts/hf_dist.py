"""torchrun job (2 processes, gloo): save, rotate, resume with make_atomic.

Phase A trains steps 1-8 of a 12-step schedule, saving every 2 steps with
save_total_limit=2 and a scripted "score" metric whose best is at step 4; pushes and
on_save callbacks are recorded. Phase B resumes (resume_from_checkpoint=True) and
trains to 12. Phase C is an uninterrupted 12-step reference run. Results go to
OUT/result-<rank>.json for the test to assert on.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import differences, dump
from tiny_hf import RandomTokens, SnapshotAt, StopAt, losses, tiny_args, tiny_model
from transformers import Trainer, TrainerCallback

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from atomic_checkpoint.catalog import read_manifest
from atomic_checkpoint.integrations.hf import make_atomic

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
MANIFEST = "checkpoint.manifest.json"
# The scripted metric of the evaluations at steps 2, 4, ..., 12: the best is at step 4.
SCORES = {2: 0.5, 4: 0.9, 6: 0.3, 8: 0.2, 10: 0.1, 12: 0.1}


class Score:
    """compute_metrics returning the scripted score of the step being evaluated."""

    def __init__(self, first_step: int) -> None:
        self.step = first_step

    def __call__(self, _eval_pred: object) -> dict[str, float]:
        value = SCORES[self.step]
        self.step += 2
        return {"score": value}


class RecordingTrainer(Trainer):
    """Records hub pushes instead of uploading (no network in tests)."""

    pushes: list[dict[str, object]] = []

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        self.pushes.append(
            {
                "path": checkpoint_folder,
                "committed": os.path.isfile(os.path.join(checkpoint_folder, MANIFEST)),
                "files": sorted(os.listdir(checkpoint_folder)),
            }
        )


class Recorder(TrainerCallback):
    """What on_save callbacks see: the conventional checkpoint path, committed?"""

    def __init__(self) -> None:
        self.saves: list[dict[str, object]] = []

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.saves.append(
            {"step": state.global_step, "committed": os.path.isfile(os.path.join(path, MANIFEST))}
        )


def trainer(out: str, *, first_eval: int, callbacks: list[TrainerCallback]) -> Trainer:
    t = RecordingTrainer(
        model=tiny_model(),
        args=tiny_args(
            out,
            max_steps=12,
            save_total_limit=2,
            eval_strategy="steps",
            eval_steps=2,
            metric_for_best_model="score",
            greater_is_better=True,
            load_best_model_at_end=True,
        ),
        train_dataset=RandomTokens(64),
        eval_dataset=RandomTokens(8, seed=1),
        compute_metrics=Score(first_eval),
        callbacks=callbacks,
    )
    # Pushing is switched on after construction, so Trainer.__init__ creates no repo.
    t.args.push_to_hub = True
    return make_atomic(t, timeout_s=60)


def main() -> None:
    run = os.path.join(OUT, "run")
    result: dict[str, object] = {"rank": RANK}

    # Phase A: steps 1-8, then the job "stops".
    rec_a = Recorder()
    a = trainer(run, first_eval=2, callbacks=[rec_a, StopAt(8)])
    a.train()
    result["a_listing"] = sorted(os.listdir(run))
    result["a_saves"] = rec_a.saves
    result["a_pushes"] = list(RecordingTrainer.pushes)
    result["a_best"] = a.state.best_model_checkpoint
    RecordingTrainer.pushes.clear()

    # Phase B: a fresh Trainer resumes from the newest complete checkpoint.
    snap_b = SnapshotAt(8)
    b = trainer(run, first_eval=10, callbacks=[snap_b])
    b.train(resume_from_checkpoint=True)
    result["b_first_step"] = snap_b.first_step_seen
    result["b_best"] = b.state.best_model_checkpoint
    result["listing"] = sorted(os.listdir(run))
    with open(os.path.join(run, "checkpoint-12", "trainer_state.json")) as f:
        result["state_12_best"] = json.load(f)["best_model_checkpoint"]
    best_weights = _weights(os.path.join(run, "checkpoint-4", "model.safetensors"))
    result["b_final_is_best"] = not differences(
        {k: v for k, v in b.model.state_dict().items() if k in best_weights}, best_weights
    )

    # Phase C: the same 12 steps, uninterrupted.
    snap_c = SnapshotAt(8)
    c = trainer(os.path.join(OUT, "reference"), first_eval=2, callbacks=[snap_c])
    c.args.push_to_hub = False
    c.train()
    result["restored_vs_reference"] = differences(snap_b.taken, snap_c.taken)
    result["losses_b"] = {k: v for k, v in losses(b.state.log_history).items() if k > 8}
    result["losses_c"] = {k: v for k, v in losses(c.state.log_history).items() if k > 8}
    result["final_12_vs_reference"] = differences(
        _weights(os.path.join(run, "checkpoint-12", "model.safetensors")),
        _weights(os.path.join(OUT, "reference", "checkpoint-12", "model.safetensors")),
    )

    if RANK == 0:
        mgr = CheckpointManager(run, read_only=True, coordinator=SingleProcessCoordinator())
        verified = {}
        for info in mgr.checkpoints():
            checked = mgr.verify(info.step)
            verified[info.step] = {
                "files": sorted(
                    e.path for e in read_manifest(mgr.storage, f"checkpoint-{info.step}").files
                ),
                "metrics": dict(checked.metrics),
            }
        result["verified"] = verified
        result["pending_left"] = sorted(os.listdir(os.path.join(run, ".pending")))
    dump(os.path.join(OUT, f"result-{RANK}.json"), result)


def _weights(path: str) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(path))


if __name__ == "__main__":
    main()
