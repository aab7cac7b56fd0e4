"""Atomic checkpoints for the Hugging Face ``Trainer``.

Two lines::

    from atomic_checkpoint.integrations.hf import make_atomic

    trainer = make_atomic(Trainer(model=model, args=args, train_dataset=ds))
    trainer.train(resume_from_checkpoint=True)  # as before

Works with any ``Trainer`` subclass (``Seq2SeqTrainer``, TRL trainers, yours).

Checkpoints still appear as ``output_dir/checkpoint-<step>`` with exactly the files the
Trainer writes, but only complete ones ever appear there, so the Trainer's own resume
(and any script that globs ``checkpoint-*``) only ever finds complete checkpoints::

    output_dir/
      checkpoint-20/                       committed: model, optimizer.pt, scheduler.pt,
        ...  checkpoint.manifest.json      rng_state_<rank>.pth, trainer_state.json
      .pending/checkpoint-30.<attempt>/    the save in progress: never resumed from

How: for the duration of ``_save_checkpoint`` the Trainer's output folder
(``_get_output_dir``) points into the pending directory of a
:class:`~atomic_checkpoint.CheckpointManager`; the Trainer writes there exactly what it
always writes, then one coordinator per storage domain checksums and fsyncs every
file, writes the manifest last and renames the directory into place. The Trainer is
touched at three private methods that Trainer subclasses in the wild (PEFT and
multimodal trainers) build on too: ``_save_checkpoint`` (wrapped, arguments passed
through), ``_get_output_dir`` (redirected during the save) and
``_push_from_checkpoint`` (deferred until the commit); ``train`` is wrapped to resolve
``resume_from_checkpoint=True``. A subclass whose ``_save_checkpoint`` writes extra
files under ``_get_output_dir(trial)/checkpoint-N`` gets them committed too.

What the options keep meaning (and what changes):

- ``save_total_limit`` becomes ``KeepLast(save_total_limit)``, applied after the new
  checkpoint is durable, un-committing before deleting; the newest is never deleted.
  At the end of training with ``save_total_limit=1`` and ``load_best_model_at_end``
  the stock Trainer deletes every checkpoint but the best, the newest included; here
  the newest stays (two checkpoints, as during training).
- The checkpoint the Trainer tracks as best (``metric_for_best_model``,
  ``state.best_model_checkpoint``) is never deleted, whatever the retention policy.
- ``save_on_each_node`` keeps its meaning and is verified against the storage: each
  node commits its own copy on node-local disks, nodes that share storage commit one
  copy, and ``save_on_each_node=False`` on storage that other nodes cannot see fails
  at the first save with an error saying so (FAILURE_MODES A5).
- ``resume_from_checkpoint=True`` loads the newest checkpoint that is committed and
  valid on every storage domain (checksums verified); folders torn by a crash are
  never candidates, and "checkpoints exist but none is valid" is an error.
- Hub pushes (``push_to_hub``) and ``on_save`` callbacks run after the commit and are
  given the committed path, never the pending one (FAILURE_MODES A9).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..catalog import parse_attempt_dir
from ..errors import CheckpointError, ResumeError
from ..layout import checkpoint_name, parse_checkpoint_name
from ..manifest import CheckpointInfo
from ..preemption import PreemptionGuard
from ..retention import AnyOf, KeepLast
from .accelerate import FrameworkRoot, _is_under

__all__ = ["KeepTrainerBest", "make_atomic"]

log = logging.getLogger("atomic_checkpoint")

_TRAINER_STATE_NAME = "trainer_state.json"
_ATTR = "_atomic_checkpoint"


class KeepTrainerBest:
    """Keep the checkpoint the Trainer tracks as best (``state.best_model_checkpoint``).

    The Trainer decides what "best" means (``metric_for_best_model``,
    ``greater_is_better``, first of equals), so this policy asks it rather than
    re-ranking metrics. ``make_atomic`` always adds it to the retention policy.
    Called on the coordinator after a commit is durable, while the training thread
    waits for the next save; it does no I/O.

    Args:
        trainer: the Trainer whose best checkpoint to keep.
        run_dir: the directory its checkpoints are committed under.
    """

    def __init__(self, trainer: Any, run_dir: str):
        self._trainer = trainer
        self._run_dir = os.path.normpath(os.path.abspath(run_dir))

    def __repr__(self) -> str:
        return "KeepTrainerBest()"

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        """The step of the Trainer's best checkpoint, if it is among ``checkpoints``.

        Args:
            checkpoints: this run's committed checkpoints, in any order.

        Returns:
            At most one step.
        """
        best = getattr(getattr(self._trainer, "state", None), "best_model_checkpoint", None)
        if not best:
            return frozenset()
        best = os.path.normpath(os.path.abspath(best))
        parent, name = os.path.split(best)
        if parse_attempt_dir(name) is not None:
            # Marker strategy: the files live in checkpoint-<step>/attempt-<token>/.
            parent, name = os.path.split(parent)
        step = parse_checkpoint_name(name)
        if parent != self._run_dir or step is None or step not in {c.step for c in checkpoints}:
            return frozenset()
        return frozenset({step})


def _moved(path: str, old: str, new: str) -> str:
    """``path`` (inside ``old``) once ``old`` is committed as ``new``."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(old))
    return new if rel == "." else os.path.join(new, rel)


def _eval_metrics(state: Any, step: int) -> dict[str, float]:
    """The evaluation metrics logged at ``step`` (recorded in the manifest, so that
    ``KeepBest(metric="eval_loss")`` and ``atomic-checkpoint list`` can use them)."""
    out: dict[str, float] = {}
    for entry in getattr(state, "log_history", None) or ():
        if entry.get("step") != step:
            continue
        for key, value in entry.items():
            if (
                key.startswith("eval_")
                and not key.endswith(("_runtime", "_per_second"))
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                out[key] = float(value)
    return out


class _AtomicTrainer:
    """The state ``make_atomic`` attaches to one Trainer."""

    def __init__(
        self,
        trainer: Any,
        *,
        retention: Any,
        verify_on_resume: bool,
        timeout_s: float,
        preemption: bool = False,
        grace_s: float | None = None,
    ):
        self.trainer = trainer
        self.preemption = preemption
        self.grace_s = grace_s
        self.user_retention = retention
        self.verify_on_resume = verify_on_resume
        self.timeout_s = timeout_s
        self.roots: dict[str, FrameworkRoot] = {}
        self.save_total_limit: int | None = trainer.args.save_total_limit
        self._orig_save = trainer._save_checkpoint
        self._orig_output_dir = trainer._get_output_dir
        self._orig_push = trainer._push_from_checkpoint
        self._orig_train = trainer.train
        self._pending: str | None = None
        self._final: str | None = None
        self._pushes: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.last_saved: CheckpointInfo | None = None
        # The commit strategy; None chooses from the storage (tests force "marker").
        self.strategy: str | None = None

    # ------------------------------------------------------------------ roots
    def retention_for(self, run_dir: str) -> Any:
        limit = self.save_total_limit
        base = self.user_retention
        if base is None and limit is not None and limit > 0:
            base = KeepLast(int(limit))
        if base is None:
            return None  # keep everything, as the Trainer does without a limit
        return AnyOf(base, KeepTrainerBest(self.trainer, run_dir))

    def root(self, run_dir: str) -> FrameworkRoot:
        key = os.path.abspath(run_dir)
        opened = self.roots.get(key)
        if opened is None:
            args = self.trainer.args
            opened = FrameworkRoot(
                key,
                per_node=bool(args.save_on_each_node),
                retention=self.retention_for(key),
                label="Trainer",
                timeout_s=self.timeout_s,
                strategy=self.strategy,
            )
            self.roots[key] = opened
        return opened

    def close(self) -> None:
        for opened in self.roots.values():
            opened.close()
        self.roots.clear()

    # ------------------------------------------------------------------ hooks
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Replaces ``trainer._save_checkpoint(model, trial)``; every rank calls it."""
        trainer = self.trainer
        trial = kwargs.get("trial", args[1] if len(args) > 1 else None)
        run_dir = os.path.abspath(self._orig_output_dir(trial=trial))
        step = int(trainer.state.global_step)
        opened = self.root(run_dir)
        name = checkpoint_name(step)
        pushes: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

        def write(directory: Path, final: str) -> None:
            pending = str(directory.parent)
            # The Trainer saves into os.path.join(_get_output_dir(trial), "checkpoint-N"):
            # point that at the pending directory for this call only.
            trainer._get_output_dir = lambda *a, **k: pending
            self._pending, self._final, self._pushes = str(directory), final, pushes
            model = _per_node_writer(trainer)
            try:
                self._orig_save(*args, **kwargs)
            finally:
                self._pending = self._final = None
                _restore(trainer, "_get_output_dir", self._orig_output_dir)
                if model is not None:
                    model.__dict__.pop("should_save_on_this_rank", None)
            state = trainer.state
            best = getattr(state, "best_model_checkpoint", None)
            if best and _is_under(best, str(directory)):
                # The Trainer recorded the pending path as the best checkpoint; record
                # where it will be once committed, in memory and in trainer_state.json.
                state.best_model_checkpoint = _moved(best, str(directory), final)
                state_file = directory / _TRAINER_STATE_NAME
                if trainer.args.should_save and state_file.is_file():
                    state.save_to_json(str(state_file))

        info = opened.save(
            step,
            write,
            nested=name,
            metrics=_eval_metrics(trainer.state, step),
            metadata={
                "trainer": {
                    "global_step": step,
                    "epoch": float(trainer.state.epoch or 0.0),
                    "transformers_version": _transformers_version(),
                }
            },
        )
        self.last_saved = info
        for folder, a, kw in pushes:
            # Hub uploads start only now, from the committed directory.
            self._orig_push(folder, *a, **kw)

    def push_from_checkpoint(self, checkpoint_folder: str, *args: Any, **kwargs: Any) -> Any:
        """Replaces ``trainer._push_from_checkpoint``: defers a push of the checkpoint
        being saved until it is committed, then pushes the committed path."""
        pending, final = self._pending, self._final
        if pending is not None and final is not None and _is_under(checkpoint_folder, pending):
            self._pushes.append((_moved(checkpoint_folder, pending, final), args, kwargs))
            return None
        return self._orig_push(checkpoint_folder, *args, **kwargs)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Replaces ``trainer.train``: resolves ``resume_from_checkpoint=True`` to the
        newest complete checkpoint, and owns rotation for the duration."""
        trainer = self.trainer
        output_dir = trainer.args.output_dir
        # Rotation is ours for the whole run: with save_total_limit unset the Trainer's
        # rotate_checkpoints() and its end-of-training deletion do nothing.
        limit = trainer.args.save_total_limit
        self.save_total_limit = limit  # KeepLast(limit) for the roots this run opens
        if resume_from_checkpoint is True:
            opened = self.root(output_dir)
            step = opened.resolve(verify=self.verify_on_resume)
            if step is None:
                raise ResumeError(
                    f"resume_from_checkpoint=True but {opened.root} holds no checkpoint; "
                    "pass resume_from_checkpoint=None to start from scratch"
                )
            resume_from_checkpoint = opened.path(step)
            log.info("Trainer: resuming from %s", resume_from_checkpoint)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(resume_from_checkpoint))
            step = parse_checkpoint_name(os.path.basename(path))
            if step is not None and os.path.dirname(path) == os.path.abspath(output_dir):
                # One of ours: refuse a torn or corrupt one instead of half-loading it.
                self.root(output_dir).resolve(step, verify=self.verify_on_resume)
        trainer.args.save_total_limit = None
        callback = None
        try:
            if self.preemption:
                callback = _preemption_callback(
                    PreemptionGuard(
                        self.root(output_dir).manager,
                        timeout_s=self.timeout_s,
                        grace_s=self.grace_s,
                    )
                )
                trainer.preemption_guard = callback.guard
                trainer.add_callback(callback)
            return self._orig_train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if callback is not None:
                trainer.remove_callback(callback)
                callback.guard.close()
            trainer.args.save_total_limit = limit
            self.close()


def _preemption_callback(guard: PreemptionGuard) -> Any:
    """A ``TrainerCallback`` that asks ``guard`` at every optimizer step, on every rank
    (the Trainer calls ``on_step_end`` on each, the same number of times), and turns
    the agreed answer into the Trainer's own controls: save this step (through the
    atomic save above), skip evaluation, stop training."""
    from transformers import TrainerCallback

    class PreemptionCallback(TrainerCallback):
        def __init__(self) -> None:
            self.guard = guard

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            save = guard.should_save(int(state.global_step))
            if guard.stopping:
                # The save (or none, when it would not fit in the grace period) is the
                # guard's decision, not save_steps': evaluation would eat the window.
                control.should_save = save
                control.should_evaluate = False
                control.should_training_stop = True
            return control

    return PreemptionCallback()


def _per_node_writer(trainer: Any) -> Any:
    """With ``save_on_each_node``, let every node's writer save the model.

    transformers 5.x ``PreTrainedModel.save_pretrained`` writes only on global rank 0
    whenever a process group exists (``should_save_on_this_rank``), whatever
    ``is_main_process`` says, so with ``save_on_each_node`` on node-local disks every
    other node's checkpoint lacks the model weights and config. For a model that is not
    tensor-parallel, honour ``is_main_process`` (the Trainer passes
    ``args.should_save``) for the duration of the save. Returns the model patched, or
    None.
    """
    if not trainer.args.save_on_each_node:
        return None
    model: Any = getattr(trainer, "model", None)
    if not callable(getattr(model, "should_save_on_this_rank", None)):
        return None
    if getattr(model, "_tp_size", None) not in (None, 1):
        return None  # tensor-parallel shards are consolidated by rank 0 on purpose
    model.should_save_on_this_rank = lambda is_main_process: bool(is_main_process)
    return model


def _restore(obj: Any, name: str, original: Any) -> None:
    bound_self = getattr(original, "__self__", None)
    func = getattr(original, "__func__", None)
    if bound_self is obj and func is not None and getattr(type(obj), name, None) is func:
        # The original is the class's method: drop the instance override.
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, original)


def _transformers_version() -> str:
    try:
        import transformers

        return str(transformers.__version__)
    except ImportError:  # pragma: no cover - make_atomic is only used with transformers
        return "unknown"


def make_atomic(
    trainer: Any,
    *,
    retention: Any = None,
    verify_on_resume: bool = True,
    timeout_s: float = 600.0,
    preemption: bool = False,
    grace_s: float | None = None,
) -> Any:
    """Make a ``transformers.Trainer``'s checkpoints atomic; returns the same trainer.

    Call it once, on every process, before ``train()``.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) instance.
        retention: a policy such as ``KeepLast(3) | KeepBest(1, metric="eval_loss")``;
            default ``KeepLast(args.save_total_limit)``, or keep everything. The
            Trainer's best checkpoint and the newest one are always kept.
        verify_on_resume: recompute every checksum of the checkpoint that
            ``resume_from_checkpoint=True`` picks (a corrupt one is skipped).
        timeout_s: bound on every wait for other processes during a save.
        preemption: stop on SIGTERM/SIGUSR1 (any rank) with one atomic save of the
            current step on every rank, through a :class:`PreemptionGuard` that
            ``train()`` creates and closes; afterwards ``trainer.preemption_guard``
            holds it: ``trainer.preemption_guard.exit()`` ends the process with 75
            (requeue) when preempted. Call ``preemption.arm()`` at the top of the
            script to cover the start-up too.
        grace_s: the scheduler's grace period for the preemption save (default
            ``ATOMIC_CHECKPOINT_GRACE_S``): a save that recent saves say cannot
            finish in time is not started.

    Returns:
        ``trainer``, with ``trainer.train``, ``_save_checkpoint`` and
        ``_push_from_checkpoint`` wrapped.

    Raises:
        TypeError: ``trainer`` lacks the methods the integration relies on.
        CheckpointError: ``make_atomic`` was already applied to it.
    """
    missing = [
        m
        for m in ("_save_checkpoint", "_get_output_dir", "_push_from_checkpoint", "train")
        if not callable(getattr(trainer, m, None))
    ]
    if missing or not hasattr(trainer, "args") or not hasattr(trainer, "state"):
        raise TypeError(
            f"make_atomic needs a transformers.Trainer; {type(trainer).__name__} lacks "
            f"{missing or ['args/state']} (transformers {_transformers_version()}); "
            "please report this version"
        )
    if getattr(trainer, _ATTR, None) is not None:
        raise CheckpointError("make_atomic was already applied to this Trainer")
    integration = _AtomicTrainer(
        trainer,
        retention=retention,
        verify_on_resume=verify_on_resume,
        timeout_s=timeout_s,
        preemption=preemption,
        grace_s=grace_s,
    )
    setattr(trainer, _ATTR, integration)
    trainer._save_checkpoint = integration.save_checkpoint
    trainer._push_from_checkpoint = integration.push_from_checkpoint
    trainer.train = integration.train
    return trainer
