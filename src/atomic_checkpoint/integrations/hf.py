"""Atomic checkpoints for the Hugging Face ``Trainer``.

One callback, the Trainer's own way to extend it::

    from atomic_checkpoint.integrations.hf import AtomicCheckpointCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[AtomicCheckpointCallback()])
    trainer.train(resume_from_checkpoint=True)  # as before

or ``trainer = make_atomic(trainer)`` for a Trainer built elsewhere (the callback calls
it). Works with any ``Trainer`` subclass (``Seq2SeqTrainer``, TRL trainers, yours), in
the releases named by ``SUPPORTED_TRANSFORMERS`` (both ends tested).

A run that already has stock checkpoints (saved without this library) is refused by
``resume_from_checkpoint=True``, with the complete ones named and the opt-in spelled
out: ``adopt_existing=True`` adopts them through :func:`atomic_checkpoint.adopt` (the
Trainer's completeness rule; a torn one is refused and never resumed from) at the start
of ``train()``. An explicit ``resume_from_checkpoint`` path to a stock checkpoint that
the rule accepts is loaded as is, without writing anything.

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
``resume_from_checkpoint=True``. A Trainer whose private methods take other parameters
is refused with a ``TypeError`` naming the supported releases. The roots ``train()``
opens, and with them the run lock, are closed on every way out of it, errors included.
A subclass whose ``_save_checkpoint`` writes extra
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
- Resuming below the newest checkpoint (an explicit older path, or ``True`` past newer
  ones that failed verification): the first save discards the newer checkpoints, as
  the stock Trainer would overwrite them (``_AtomicTrainer._plan_continuation``);
  ``train()`` from scratch over this run's checkpoints is refused before any step when
  its first save would not be above them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import catalog
from .._checks import flag, positive_seconds, retention_policy
from .._params import parameters_of
from ..coordination import gather_summary
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ResumeError,
    StepOrderError,
)
from ..layout import MANIFEST_NAME, checkpoint_name, parse_attempt_dir, parse_checkpoint_name
from ..manifest import CheckpointInfo
from ..preemption import PreemptionGuard, protecting_loaders_of
from ..retention import AnyOf, KeepLast
from ..storage import posix
from .accelerate import FrameworkRoot, framework_path

try:  # the callback must be a TrainerCallback; everything else works without transformers
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:  # pragma: no cover - the integration is only used with transformers
    _TrainerCallback = object  # type: ignore[assignment,misc,unused-ignore]

__all__ = ["AtomicCheckpointCallback", "KeepTrainerBest", "make_atomic"]

log = logging.getLogger("atomic_checkpoint")

_TRAINER_STATE_NAME = "trainer_state.json"
_ATTR = "_atomic_checkpoint"

#: The transformers releases the integration is tested with (oldest and newest; CI runs
#: both). Older 4.x releases cannot resume under torch>=2.6 even without this library:
#: their Trainer loads its RNG state with torch.load's new weights_only default.
SUPPORTED_TRANSFORMERS = "transformers 4.47.0 to 5.24.0"

# The private Trainer methods the integration wraps, with the leading parameters it
# relies on (it passes the trial by keyword and reads it from the second positional).
_PRIVATE_METHODS = {
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
    "_push_from_checkpoint": ("checkpoint_folder",),
}

_OPT_IN = (
    "make_atomic(trainer, adopt_existing=True), or "
    "Trainer(..., callbacks=[AtomicCheckpointCallback(adopt_existing=True)])"
)


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
        parent, name = os.path.split(os.path.normpath(best))
        if parse_attempt_dir(name) is not None:
            # Marker strategy: the files live in checkpoint-<step>/attempt-<token>/.
            parent, name = os.path.split(parent)
        step = parse_checkpoint_name(name)
        if step is None or step not in {c.step for c in checkpoints}:
            return frozenset()
        return frozenset({step}) if _names_dir(parent, self._run_dir) else frozenset()


def _names_dir(parent: str, run_dir: str) -> bool:
    """Whether ``parent`` (of a recorded best checkpoint) names ``run_dir`` (absolute).
    The record is as the run that wrote it named it: relative to that run's working
    directory (``output_dir="out"``), or through a link. Resolved against this
    process's working directory, it named another place, and a requeued job started
    from elsewhere (or through a /scratch link) deleted the best."""
    if not os.path.isabs(parent):
        # Relative to a working directory that may not be ours: the run's directory
        # ends with it (keeping one more checkpoint is the safe mistake).
        tail = os.path.normpath(parent).split(os.sep)
        if tail == ["."] or run_dir.split(os.sep)[-len(tail) :] == tail:
            return True
    absolute = os.path.normpath(os.path.abspath(parent))
    return absolute == run_dir or posix.real_path(absolute) == posix.real_path(run_dir)


def _best_named_here(checkpoint: str, output_dir: str) -> str | None:
    """The best checkpoint that ``checkpoint``'s ``trainer_state.json`` records, named
    for this process (under ``output_dir`` as given), when the record names this run's
    directory otherwise (relative to another working directory, or through a link) and
    that checkpoint is there; else None. The Trainer drops a recorded best it cannot
    find from here ("does not exist anymore"), and retention then deleted it."""
    try:
        text = posix.read_head(os.path.join(checkpoint, _TRAINER_STATE_NAME), 1 << 28)
        best = json.loads(text or b"{}").get("best_model_checkpoint")
    except (CheckpointError, ValueError, AttributeError):
        return None
    if not isinstance(best, str) or not best or posix.is_dir(best):
        return None
    parent, name = os.path.split(os.path.normpath(best))
    if parse_checkpoint_name(name) is None:
        return None
    here = os.path.join(output_dir, name)
    run_dir = os.path.normpath(os.path.abspath(output_dir))
    return here if _names_dir(parent, run_dir) and posix.is_dir(here) else None


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


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The arguments of :func:`make_atomic` (and of ``AtomicCheckpointCallback``)."""

    retention: Any
    verify_on_resume: bool
    timeout_s: float
    preemption: bool
    grace_s: float | None
    adopt_existing: bool

    def __post_init__(self) -> None:
        # Checked when make_atomic (or the callback) is called, before train() writes
        # anything: preemption="false" (a truthy string) armed the signal handlers.
        retention_policy(self.retention)
        for name in ("verify_on_resume", "preemption", "adopt_existing"):
            object.__setattr__(self, name, flag(name, getattr(self, name)))
        object.__setattr__(self, "timeout_s", positive_seconds("timeout_s", self.timeout_s))
        if self.grace_s is not None:
            object.__setattr__(self, "grace_s", positive_seconds("grace_s", self.grace_s))


class _AtomicTrainer:
    """The state ``make_atomic`` attaches to one Trainer."""

    def __init__(self, trainer: Any, settings: _Settings):
        self.trainer = trainer
        self.settings = settings
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
        # Stock checkpoints the last adoption refused (step -> why), for error messages.
        self.refused: dict[int, str] = {}
        # (root, step): train() resumed from ``step`` below newer checkpoints of ``root``;
        # the first save discards them (``_plan_continuation``).
        self.continue_from: tuple[str, int] | None = None

    # ------------------------------------------------------------------ roots
    def retention_for(self, run_dir: str) -> Any:
        limit = self.save_total_limit
        base = self.settings.retention
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
                timeout_s=self.settings.timeout_s,
                strategy=self.strategy,
            )
            self.roots[key] = opened
        return opened

    def close(self, timeout_s: float | None = None) -> None:
        """Close every root this run opened; ``timeout_s`` bounds all of it (a
        preempted run: the grace period left)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for opened in self.roots.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            opened.close(timeout_s=left)
        self.roots.clear()

    # ------------------------------------------------------------------ hooks
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Replaces ``trainer._save_checkpoint(model, trial)``; every rank calls it."""
        trainer = self.trainer
        trial = kwargs.get("trial", args[1] if len(args) > 1 else None)
        given = os.fspath(self._orig_output_dir(trial=trial))  # as the Trainer names it
        run_dir = os.path.abspath(given)
        step = int(trainer.state.global_step)
        opened = self.root(run_dir)
        name = checkpoint_name(step)
        pushes: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        if self.continue_from is not None and self.continue_from[0] == opened.root:
            # Collective, like this method: every rank saw the same plan at train().
            start = self.continue_from[1]
            self.continue_from = None
            removed = opened.manager.rollback(start)
            if removed:
                log.warning(
                    "Trainer: continuing from step %d: discarded the newer checkpoints %s "
                    "of %s before saving step %d",
                    start,
                    [checkpoint_name(s) for s in sorted(removed)],
                    opened.root,
                    step,
                )

        def write(directory: Path, final: str) -> None:
            pending = str(directory.parent)
            # The Trainer saves into os.path.join(_get_output_dir(trial), "checkpoint-N"):
            # point that at the pending directory for this call only.
            trainer._get_output_dir = lambda *a, **k: pending
            self._pending, self._final, self._pushes = str(directory), final, pushes
            model = _per_node_writer(trainer)
            # The user's save_total_limit is back for the write, so training_args.bin
            # records it; the Trainer's rotation then sees only this checkpoint (its
            # folder is alone under the pending directory) and deletes nothing.
            during = trainer.args.save_total_limit
            trainer.args.save_total_limit = self.save_total_limit
            try:
                self._orig_save(*args, **kwargs)
            finally:
                trainer.args.save_total_limit = during
                self._pending = self._final = None
                _restore(trainer, "_get_output_dir", self._orig_output_dir)
                if model is not None:
                    model.__dict__.pop("should_save_on_this_rank", None)
            state = trainer.state
            best = getattr(state, "best_model_checkpoint", None)
            if best and posix.is_under(best, str(directory)):
                # The Trainer recorded the pending path as the best checkpoint; record
                # where it will be once committed, in memory and in trainer_state.json.
                # Named as the Trainer names it (a relative output_dir stays relative).
                named = os.path.join(given, os.path.relpath(final, run_dir))
                state.best_model_checkpoint = _moved(best, str(directory), named)
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
        if pending is not None and final is not None and posix.is_under(checkpoint_folder, pending):
            self._pushes.append((_moved(checkpoint_folder, pending, final), args, kwargs))
            return None
        return self._orig_push(checkpoint_folder, *args, **kwargs)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Replaces ``trainer.train``: adopts stock checkpoints when opted in, resolves
        ``resume_from_checkpoint=True`` to the newest complete checkpoint, checks an
        explicit path, and owns rotation for the duration. The roots it opens (and
        with them the run lock) are closed on every way out, errors included."""
        trainer = self.trainer
        output_dir = trainer.args.output_dir
        # Refuse "s3://bkt/run" before any training: os.path.abspath would make it the
        # local folder ./s3:/bkt/run, where every save "succeeds" and nothing reaches
        # the bucket.
        framework_path("Trainer", output_dir)
        # Rotation is ours for the whole run: with save_total_limit unset the Trainer's
        # rotate_checkpoints() and its end-of-training deletion do nothing.
        limit = trainer.args.save_total_limit
        self.save_total_limit = limit  # KeepLast(limit) for the roots this run opens
        callback = None
        undo: list[Callable[[], None]] = []
        try:
            if self.settings.adopt_existing:
                self.adopt(output_dir)
            resume_from_checkpoint, start = self._resume_path(resume_from_checkpoint, output_dir)
            self.continue_from = None
            trial = kwargs.get("trial", args[0] if args else None)
            if trial is None:  # a search trial saves under its own run-<id> folder
                self._plan_continuation(resume_from_checkpoint, start, output_dir)
            trainer.args.save_total_limit = None
            if isinstance(resume_from_checkpoint, (str, os.PathLike)):
                best = _best_named_here(os.fspath(resume_from_checkpoint), output_dir)
                if best is not None:
                    fix = _best_fix_callback(best)
                    trainer.add_callback(fix)
                    undo.append(functools.partial(trainer.remove_callback, fix))
            if self.settings.preemption:
                callback = _preemption_callback(
                    PreemptionGuard(
                        self.root(output_dir).manager,
                        timeout_s=self.settings.timeout_s,
                        grace_s=self.settings.grace_s,
                    )
                )
                trainer.preemption_guard = callback.guard
                trainer.add_callback(callback)
                undo += [protecting_loaders_of(trainer, n) for n in _LOADER_FACTORIES]
            return self._orig_train(resume_from_checkpoint, *args, **kwargs)
        finally:
            within = None
            if callback is not None:
                trainer.remove_callback(callback)
                callback.guard.close()
                if callback.guard.stopping:  # preempted: exit within the grace period
                    within = callback.guard.time_left_s
            for restore in undo:
                restore()
            trainer.args.save_total_limit = limit
            self.close(timeout_s=within)

    def _resume_path(self, resume_from_checkpoint: Any, output_dir: str) -> tuple[Any, int | None]:
        """What to hand the Trainer's ``train``, and the step it resumes from when that is
        a checkpoint of ``output_dir`` (else None): ``True`` becomes the newest complete
        checkpoint; an explicit path under ``output_dir`` is checked (never half-load a
        torn one); anything else passes through."""
        if resume_from_checkpoint is True:
            opened = self.root(output_dir)
            try:
                step = opened.resolve(verify=self.settings.verify_on_resume)
            except ResumeError as exc:
                hint = self._stock_hint(opened)
                raise ResumeError(f"{exc}. {hint}" if hint else str(exc)) from None
            if step is None:
                raise ResumeError(
                    f"resume_from_checkpoint=True but {opened.root} holds no checkpoint; "
                    "pass resume_from_checkpoint=None to start from scratch"
                )
            if not self.settings.adopt_existing:
                self._refuse_newer_stock(opened, step)
            path = opened.path(step)
            log.info("Trainer: resuming from %s", path)
            return path, step
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(resume_from_checkpoint))
            step = parse_checkpoint_name(os.path.basename(path))
            if step is not None and os.path.dirname(path) == os.path.abspath(output_dir):
                opened = self.root(output_dir)
                try:
                    # One of ours: refuse a torn or corrupt one instead of half-loading it.
                    opened.resolve(step, verify=self.settings.verify_on_resume)
                except CheckpointNotFoundError as exc:
                    self._check_stock(opened, step, path, exc)
                return resume_from_checkpoint, step
        return resume_from_checkpoint, None

    def _plan_continuation(self, resume: Any, start: int | None, output_dir: str) -> None:
        """Checkpoints are ordered by step (a save below the newest committed step of the
        run raises ``StepOrderError``), while the stock Trainer simply overwrites
        ``checkpoint-<step>`` folders as it reaches them again. Where the two meet:

        - resuming from step ``start`` below the newest checkpoint (an explicit older
          path, or ``True`` after the newer ones failed verification): the newer
          checkpoints belong to a trajectory this training abandons, and a resume after
          a crash must not load them. The first save of this ``train()`` discards them
          (``rollback(start)``, newest first, un-committed before deleted), just before
          it commits; until then nothing is deleted. A warning says so now.
        - starting from scratch (``resume_from_checkpoint`` None or False) over this
          run's checkpoints: when the first save's step is known (``save_strategy=
          "steps"``) and not above the newest, every save would be refused, so this
          refuses now, before any training, with what to do instead; otherwise a
          warning.
        """
        args = self.trainer.args
        if _save_strategy(args) == "no" or (resume not in (None, False) and start is None):
            return  # nothing is saved, or resumed from elsewhere: nothing to reconcile
        opened = self.root(output_dir)
        if resume in (None, False) and not self.settings.adopt_existing:
            self._refuse_stock_in_the_way(opened)
        steps = sorted(i.step for i in opened.manager.checkpoints())
        newer = [s for s in steps if start is None or s > start]
        if not newer:
            return
        if start is not None:
            log.warning(
                "Trainer: resuming from step %d of %s, below this run's newer checkpoints "
                "%s: the first save of this training discards them (checkpoints are "
                "ordered by step, and a resume after a crash must not load the trajectory "
                "this one abandons). Copy them elsewhere before that save to keep them",
                start,
                opened.root,
                [checkpoint_name(s) for s in newer],
            )
            self.continue_from = (opened.root, start)
            return
        first = _first_save_step(args)
        where = (
            f"{opened.root} holds this run's checkpoints up to step {newer[-1]} "
            f"({len(newer)} of them)"
        )
        advice = (
            "pass resume_from_checkpoint=True to continue from the newest, or "
            f"resume_from_checkpoint='{os.path.join(opened.root, checkpoint_name(newer[0]))}' "
            "(any of them) to go back to it (its first save discards the newer ones), or "
            "train into another output_dir"
        )
        if first is not None and first <= newer[-1]:
            raise StepOrderError(
                f"Trainer: train() starts from scratch, but {where}, and its first save "
                f"(step {first}) would not be above them: checkpoints are ordered by step, "
                f"so every such save is refused. Nothing was trained yet: {advice}",
                step=first,
                newest=newer[-1],
            )
        log.warning(
            "Trainer: train() starts from scratch, but %s: a save at or below step %d will "
            "be refused (checkpoints are ordered by step); to avoid it, %s",
            where,
            newer[-1],
            advice,
        )

    # ------------------------------------------------------------------ adoption
    def adopt(self, run_dir: str) -> None:
        """Adopt the complete stock checkpoints under ``run_dir`` (``adopt_existing``).

        ``adopt`` takes the run lock, so it runs before this job opens the root, on
        the processes that write checkpoints (``args.should_save``: process 0, or each
        node's first process with ``save_on_each_node``) one after the other, under the
        run id the first one recorded: on storage those nodes share, the later ones find
        the folders already adopted; on node-local disks each adopts its own copy.
        Every process gets the same outcome; a failure raises on every process.
        """
        from ..adopt import adopt

        rank, world, gather = _collective()
        writers = gather(bool(self.trainer.args.should_save))
        own: BaseException | None = None
        refused: dict[int, str] = {}
        run_id: str | None = None  # one run for every node's copy (node-local disks)
        for writer in [r for r, w in enumerate(writers) if w] if world > 1 else [0]:
            mine: Any = None
            if rank == writer:
                try:
                    result = adopt(run_dir, framework="hf", run_id=run_id)
                    mine = ("ok", result.adopted, result.refused, result.run_id)
                    if result.adopted:
                        log.info(
                            "Trainer: adopted the stock checkpoints %s under %s",
                            [checkpoint_name(s) for s in result.adopted],
                            result.root,
                        )
                except Exception as exc:
                    own = exc
                    mine = ("error", f"{type(exc).__name__}: {exc}")
            views = gather(mine)
            for view in views:
                if view is None:
                    continue
                if view[0] == "error":
                    if own is not None:
                        raise own
                    raise CheckpointError(
                        f"Trainer: adopting the stock checkpoints under {run_dir} failed on "
                        f"process {writer}: {view[1]}"
                    )
                refused.update(view[2])
                run_id = run_id or view[3]
        self.refused = refused
        for step, why in sorted(refused.items()):
            log.warning(
                "Trainer: not adopting %s under %s (never resumed from): %s",
                checkpoint_name(step),
                run_dir,
                why,
            )

    def _dry_adopt(self, opened: FrameworkRoot, steps: list[int] | None) -> dict[int, str | None]:
        """Which stock folders ``adopt`` would take (step -> None) or refuse (step -> why),
        checked by each storage domain's coordinator (nothing written) and merged, so
        every rank gets the same answer."""
        from ..adopt import adopt

        mgr = opened.manager
        view: dict[int, str | None] | None = None
        if mgr.is_coordinator and steps == []:
            view = {}  # nothing to judge (None would judge every folder)
        elif mgr.is_coordinator:
            try:
                result = adopt(opened.root, steps, framework="hf", dry_run=True)
                view = {s: None for s in result.adopted}
                view.update(result.refused)
            except (CheckpointError, OSError, ValueError) as exc:
                view = {s: f"could not be checked: {exc}" for s in steps or ()}
        return gather_summary(
            mgr.coordinator,
            f"{opened.label}: stock checkpoints",
            view,
            _merged_views,
            timeout_s=self.settings.timeout_s,
        )

    def _stock_hint(self, opened: FrameworkRoot) -> str:
        """The end of the "nothing to resume from" error: which stock checkpoints are
        complete, which are not (and why), and exactly how to opt in."""
        found = self.refused if self.settings.adopt_existing else self._dry_adopt(opened, None)
        complete = sorted(s for s, why in found.items() if why is None)
        torn = {s: why for s, why in sorted(found.items()) if why is not None}
        parts = []
        if torn:
            parts.append(
                "Not adoptable (never resumed from): "
                + "; ".join(f"{checkpoint_name(s)}: {why}" for s, why in torn.items())
            )
        if complete:
            parts.append(
                f"Complete stock Trainer checkpoints {[checkpoint_name(s) for s in complete]} "
                f"can be adopted (checked now, nothing written). To resume from the newest, "
                f"opt in: {_OPT_IN}, or run `atomic-checkpoint adopt {opened.root}` once"
            )
        return ". ".join(parts) + "." if parts else ""

    def _refuse_stock_in_the_way(self, opened: FrameworkRoot) -> None:
        """Collective: ``train()`` from scratch into an ``output_dir`` that holds complete
        checkpoints the stock Trainer wrote (no manifest): its saves would replace them
        as training reaches their steps (the user's only copy of that training), so this
        refuses before any step. Torn ones are replaced as before."""
        named: list[int] = []
        if opened.manager.is_coordinator:
            storage = opened.manager.storage
            named = [
                s
                for s, name in catalog.listed_steps(storage)
                if storage.size(f"{name}/{MANIFEST_NAME}") is None
            ]
        found = self._dry_adopt(opened, named)
        complete = sorted(s for s, why in found.items() if why is None)
        if complete:
            names = [checkpoint_name(s) for s in complete]
            raise CheckpointExistsError(
                f"Trainer: train() starts from scratch, but {names} under {opened.root} are "
                "complete checkpoints the Trainer wrote without atomic-checkpoint (no "
                "manifest): this training's saves would replace them as it reaches their "
                f"steps. Nothing was trained yet. To continue from the newest, pass "
                f"resume_from_checkpoint=True and opt in: {_OPT_IN}; to start over, train "
                "into another output_dir (or move them away)"
            )

    def _refuse_newer_stock(self, opened: FrameworkRoot, step: int) -> None:
        """Collective: ``resume_from_checkpoint=True`` found ``step``, the newest
        committed checkpoint; refuse if the stock Trainer wrote a complete checkpoint
        above it (the run went on without this library). Resuming from ``step`` would
        drop that training, and the save of its step would replace the folder."""
        # Only the folders named above the step are judged (one listing, then their
        # files): a dry adoption of the whole root read every checkpoint's manifest at
        # every resume. The list matters on the coordinator only (_dry_adopt).
        above: list[int] = []
        if opened.manager.is_coordinator:
            above = [s for s, _ in catalog.listed_steps(opened.manager.storage) if s > step]
        found = self._dry_adopt(opened, above)
        newer = sorted(s for s, why in found.items() if why is None and s > step)
        if newer:
            names = [checkpoint_name(s) for s in newer]
            raise ResumeError(
                f"Trainer: {names} under {opened.root} are complete checkpoints the Trainer "
                f"wrote without atomic-checkpoint (no manifest), newer than "
                f"{checkpoint_name(step)}, the newest committed one: resuming from it would "
                f"drop their training, and the save of step {newer[0]} would replace "
                f"{names[0]}. To resume from the newest, opt in: {_OPT_IN}, or run "
                f"`atomic-checkpoint adopt {opened.root}` once; to resume from "
                f"{checkpoint_name(step)}, pass its path as resume_from_checkpoint "
                "(the newer folders are then replaced as training reaches their steps)"
            )

    def _check_stock(
        self, opened: FrameworkRoot, step: int, path: str, exc: CheckpointNotFoundError
    ) -> None:
        """An explicit ``resume_from_checkpoint`` path to a folder without a manifest:
        load it as the stock Trainer would if the Trainer's completeness rule accepts it
        (``trainer_state.json``, written last, the weights, each file whole), else
        refuse it with the reason. Nothing is written here (adopting is opt-in)."""
        why = self._dry_adopt(opened, [step]).get(step, "not found")
        if why is not None:
            raise CheckpointNotFoundError(
                f"{exc}. {path} is not a complete stock Trainer checkpoint either: {why}"
            ) from None
        log.info(
            "Trainer: resuming from the stock checkpoint %s (complete by the Trainer's rule; "
            "no manifest, so no checksums to verify; adopt it with %s)",
            path,
            _OPT_IN,
        )


def _save_strategy(args: Any) -> str:
    """``args.save_strategy`` as a string (an enum in the Trainer's arguments)."""
    return str(getattr(args.save_strategy, "value", args.save_strategy))


def _first_save_step(args: Any) -> int | None:
    """The step of the first save of a training from scratch, where the arguments say
    it (``save_strategy="steps"`` with a whole ``save_steps``); else None."""
    every = getattr(args, "save_steps", None)
    if _save_strategy(args) != "steps" or not isinstance(every, (int, float)) or every < 1:
        return None
    first = int(every)
    max_steps = getattr(args, "max_steps", -1)
    if isinstance(max_steps, int) and 0 < max_steps < first:
        return None  # the only save is the one at the end, which some releases skip
    return first


def _collective() -> tuple[int, int, Any]:
    """(rank, world size, all_gather of one picklable value) of the job, before any
    root is open: torch.distributed when the Trainer initialised it, else one process."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - transformers needs torch
        dist = None  # type: ignore[assignment]
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1, lambda value: [value]
    world = dist.get_world_size()

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, value)
        return out

    return dist.get_rank(), world, gather


#: The Trainer's DataLoader factories: under ``preemption=True`` each loader they build
#: has workers that go on through the scheduler's SIGTERM. SLURM signals every process
#: of the job step, the ``dataloader_num_workers`` workers included; under torch's own
#: worker handler they exit, and the Trainer's next batch raises (``DataLoader worker
#: ... killed by signal``) before the guard can save.
_LOADER_FACTORIES = ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader")


#: Evaluations the preemption callback remembers the duration of: the slowest counts.
RECENT_EVALUATIONS = 3


def _preemption_callback(guard: PreemptionGuard) -> Any:
    """A ``TrainerCallback`` that asks ``guard`` at every optimizer step, on every rank
    (the Trainer calls ``on_step_end`` on each, the same number of times), and turns
    the agreed answer into the Trainer's own controls: save this step (through the
    atomic save above), evaluate first only if the evaluation and the save both fit in
    the grace period, stop training.

    The Trainer evaluates before it saves. The evaluations it runs at ``eval_steps``
    are timed here (from this step end to ``on_evaluate``), and the slowest recent one
    is announced to the guard (``should_save(work_s=)``), which decides, the same on
    every rank, whether it fits with the save: then the checkpoint records its metric
    and best-model tracking sees the step."""
    from transformers import TrainerCallback

    class PreemptionCallback(TrainerCallback):
        def __init__(self) -> None:
            self.guard = guard
            self._evaluating_since: float | None = None
            self._evaluations: list[float] = []  # seconds, the last RECENT_EVALUATIONS

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            step = int(state.global_step)
            evaluate = bool(control.should_evaluate)
            work = max(self._evaluations) if evaluate and self._evaluations else None
            save = guard.should_save(step, work_s=work)
            if guard.stopping:
                # The save (or none, when it would not fit in the grace period) is the
                # guard's decision, not save_steps'; the evaluation runs only if it fits.
                if evaluate and not guard.work_fits and state.is_world_process_zero:
                    why = guard.skipped_work or "no evaluation was timed yet in this run"
                    log.warning(
                        "preemption at step %d: the evaluation eval_steps schedules there is "
                        "skipped (%s), and the resumed run goes on from the next step: that "
                        "checkpoint has no metric, so best-model tracking "
                        "(metric_for_best_model, load_best_model_at_end) never sees step %d",
                        step,
                        why,
                        step,
                    )
                control.should_save = save
                control.should_evaluate = evaluate and guard.work_fits
                control.should_training_stop = True
            if control.should_evaluate:
                self._evaluating_since = time.monotonic()
            return control

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            # Only the evaluations the training loop ran at a step end (a user's own
            # trainer.evaluate() has none in progress here).
            if self._evaluating_since is not None:
                took = time.monotonic() - self._evaluating_since
                self._evaluations = [*self._evaluations, took][-RECENT_EVALUATIONS:]
                self._evaluating_since = None
            return control

    return PreemptionCallback()


def _best_fix_callback(best: str) -> Any:
    """A ``TrainerCallback`` that gives the resumed state its best checkpoint back,
    named from here (``_best_named_here``), once the Trainer dropped it."""
    from transformers import TrainerCallback

    class BestFromHere(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            # Dropped (transformers 5), or kept as a path that does not resolve from here
            # (transformers 4: its final load of the best model then found nothing).
            recorded = state.best_model_checkpoint
            if recorded is None or not posix.is_dir(recorded):
                state.best_model_checkpoint = best
                log.info("Trainer: the best checkpoint recorded at resume is %s", best)
            return control

    return BestFromHere()


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


def _unsupported(trainer: Any) -> list[str]:
    """What keeps the integration from wrapping ``trainer``: missing methods, or private
    methods whose parameters are not the ones the supported releases have."""
    problems = [
        f"no {m}()" for m in ("train", *_PRIVATE_METHODS) if not callable(getattr(trainer, m, None))
    ]
    if problems:
        return problems
    if not hasattr(trainer, "args") or not hasattr(trainer, "state"):
        return ["no args/state attributes"]
    for name, expected in _PRIVATE_METHODS.items():
        try:
            params = list(inspect.signature(getattr(trainer, name)).parameters.values())
        except (TypeError, ValueError):
            continue  # a builtin or C-level wrapper: nothing to check
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            continue  # (*args, **kwargs): a wrapper that passes everything through
        positional = [
            p.name
            for p in params
            if p.kind
            in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        head = positional[: len(expected)]
        # A parameter the Trainer does not pass, without a default (an override that
        # takes one more): accepted, train() failed at the first save with a bare
        # "missing 1 required positional argument".
        required_extra = [
            p
            for p in params
            if p.name not in head
            and p.default is inspect.Parameter.empty
            and p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        if (
            len(head) < len(expected)
            or (name != "_push_from_checkpoint" and head != list(expected))
            or required_extra
        ):
            problems.append(f"{name}({', '.join(p.name for p in params)})")
    return problems


def make_atomic(
    trainer: Any,
    *,
    retention: Any = None,
    verify_on_resume: bool = True,
    timeout_s: float = 600.0,
    preemption: bool = False,
    grace_s: float | None = None,
    adopt_existing: bool = False,
) -> Any:
    """Make a ``transformers.Trainer``'s checkpoints atomic; returns the same trainer.

    Call it once, on every process, before ``train()`` (or pass
    :class:`AtomicCheckpointCallback` in ``Trainer(callbacks=[...])``, which calls it).

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
        adopt_existing: at the start of ``train()``, adopt the stock Trainer
            checkpoints already in ``output_dir`` (saved without this library) through
            :func:`atomic_checkpoint.adopt`: each complete one (by the Trainer's own
            rule: ``trainer_state.json``, written last, the weights, every file whole)
            gets a manifest marked adopted, with checksums taken now; a torn one is
            refused, logged, and never resumed from. Nothing is moved or deleted.

    Returns:
        ``trainer``, with ``trainer.train``, ``_save_checkpoint`` and
        ``_push_from_checkpoint`` wrapped.

    Raises:
        TypeError: ``trainer`` lacks the methods the integration relies on, or they take
            other parameters than in the supported transformers releases.
        CheckpointError: ``make_atomic`` was already applied to it.
    """
    _make_atomic(
        trainer,
        _Settings(retention, verify_on_resume, timeout_s, preemption, grace_s, adopt_existing),
    )
    return trainer


def _make_atomic(trainer: Any, settings: _Settings) -> None:
    """``make_atomic``'s work (and ``AtomicCheckpointCallback``'s)."""
    problems = _unsupported(trainer)
    if problems:
        raise TypeError(
            f"make_atomic needs a transformers.Trainer as in {SUPPORTED_TRANSFORMERS}; "
            f"{type(trainer).__name__} (transformers {_transformers_version()}) has "
            f"{', '.join(problems)}: the integration wraps _save_checkpoint(model, trial), "
            "_get_output_dir(trial) and _push_from_checkpoint(checkpoint_folder). Use a "
            "supported release, or report this version"
        )
    if getattr(trainer, _ATTR, None) is not None:
        raise CheckpointError(
            "make_atomic was already applied to this Trainer (by a call, or by an "
            "AtomicCheckpointCallback passed in callbacks=[...]): use one of the two"
        )
    integration = _AtomicTrainer(trainer, settings)
    setattr(trainer, _ATTR, integration)
    trainer._save_checkpoint = integration.save_checkpoint
    trainer._push_from_checkpoint = integration.push_from_checkpoint
    trainer.train = integration.train


class AtomicCheckpointCallback(_TrainerCallback):  # type: ignore[misc,valid-type,unused-ignore]
    """The Trainer's own way to switch atomic checkpoints on: pass it at construction.

    ::

        trainer = Trainer(..., callbacks=[AtomicCheckpointCallback()])
        trainer.train(resume_from_checkpoint=True)  # as before

    It gives exactly what :func:`make_atomic` gives (it calls it, with the same
    arguments), for code that builds the Trainer elsewhere (TRL, scripts that take a
    list of callbacks). A callback is not handed the Trainer, so it finds the one
    whose ``__init__`` is running when the Trainer announces ``on_init_end`` (the
    Trainer that holds this very callback), before ``train()`` can be called; added
    later with ``trainer.add_callback()`` it is too late for that, and ``train()``
    refuses to start, saying so.

    Args:
        retention, verify_on_resume, timeout_s, preemption, grace_s, adopt_existing:
            as for :func:`make_atomic`.
    """

    @parameters_of(make_atomic, first="self")
    def __init__(
        self, *, retention, verify_on_resume, timeout_s, preemption, grace_s, adopt_existing
    ) -> None:
        self.settings = _Settings(
            retention, verify_on_resume, timeout_s, preemption, grace_s, adopt_existing
        )
        self.trainer: Any = None

    def __repr__(self) -> str:
        return f"AtomicCheckpointCallback(adopt_existing={self.settings.adopt_existing})"

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        trainer = _trainer_holding(self)
        if trainer is None:
            raise CheckpointError(
                "AtomicCheckpointCallback: could not find the Trainer that announced "
                f"on_init_end (transformers {_transformers_version()}; supported: "
                f"{SUPPORTED_TRANSFORMERS}); call make_atomic(trainer) instead"
            )
        if self.trainer is not None and self.trainer is not trainer:
            raise CheckpointError(
                "AtomicCheckpointCallback: this instance already serves another Trainer; "
                "give each Trainer its own AtomicCheckpointCallback()"
            )
        _make_atomic(trainer, self.settings)
        self.trainer = trainer
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.trainer is None:
            raise CheckpointError(
                "AtomicCheckpointCallback was added after the Trainer was built (with "
                "add_callback?): the checkpoints of this run would not be atomic. Pass "
                "it as Trainer(..., callbacks=[AtomicCheckpointCallback()]), or call "
                "make_atomic(trainer) before train()"
            )
        return control


def _trainer_holding(callback: Any) -> Any:
    """The Trainer whose ``callback_handler`` holds ``callback``, found among the
    callers of ``on_init_end`` (``Trainer.__init__`` and its subclasses' ``__init__``)."""
    frame: Any = sys._getframe(1)
    for _ in range(64):  # bounded: the Trainer is a few frames up
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        handler = getattr(candidate, "callback_handler", None)
        if any(cb is callback for cb in getattr(handler, "callbacks", ())):
            return candidate
        frame = frame.f_back
    return None


def _merged_views(views: list[dict[int, str | None] | None]) -> dict[int, str | None]:
    """The storage domains' verdicts on the stock folders, merged: a step is adoptable
    (None) only if no domain refused it."""
    merged: dict[int, str | None] = {}
    for v in views:
        for step, why in (v or {}).items():
            if merged.get(step) is None:
                merged[step] = why
    return merged
