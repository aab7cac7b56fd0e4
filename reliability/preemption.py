"""The ``preemption`` campaign: real torchrun jobs, real signals at random moments,
delivered the ways schedulers deliver them, a grace period after which everything is
SIGKILLed, then the checkpoint the restart would resume from checked with the resume
of whoever wrote it.

Rows (``kind``):

- ``ours``: ``tests/dist/scripts/preempt_train.py`` (two gloo ranks, the README's
  loop) under ``python -m atomic_checkpoint.launch``, signals armed, ``guard.exit()``.
  Judged: every trial must end within the grace period with the requeue code (75)
  from the launcher, every rank stopped at one agreed step, that step committed (or,
  when the guard judged that no save could fit, the previous checkpoint intact; or,
  when the ranks were still starting as the grace period ran out, no guard yet, the
  start-up deadline of ``preemption.arm`` ended them with 75 and the previous
  checkpoint is still the newest), and the newest checkpoint verifying and restoring
  every rank's state exactly.
- ``stock``: the same loop without ``arm()`` and ``guard.exit()`` under stock torchrun
  (``PREEMPT_STOCK=1``). Measured, not judged.
- ``hf-stock`` / ``lightning-stock``: ``tests/dist/scripts/preempt_frameworks.py``, a
  tiny HF Trainer (``save_steps``) or Lightning Trainer (``ModelCheckpoint``) job as the
  framework ships it, under stock torchrun with the framework's own signal handling.
  Measured: whether the newest checkpoint the framework's own resume picks
  (``get_last_checkpoint`` / ``ckpt_path="last"``) loads with that resume
  (``Trainer.train(resume_from_checkpoint=...)`` / ``Trainer.fit(ckpt_path=...)``, in
  this process) and whether it is complete.
- ``hf-ours`` / ``lightning-ours``: the same jobs with this library's integration
  (``make_atomic(trainer, preemption=True)``; ``AtomicCheckpointIO`` and
  ``PreemptionCallback``), signals armed, under ``atomic_checkpoint.launch``. Judged:
  the requeue code, an agreed step, the newest checkpoint loading with the framework's
  resume, nothing torn.

Moments, observed rather than intended: the job holds at the moment (the ranks that
reach it write a marker and wait), the signal is delivered while they are held, and
then they go on (``preempt_train.py`` documents the holds). ``startup`` (every rank
before its process group exists), ``training`` (a random step reached), ``eval`` and
``data-loading`` (those phases of a step, every rank), ``loader-workers`` (every rank
reading a batch from a DataLoader with two worker processes, which the signal reaches
too, whatever the pattern, as SLURM signals every process of the job step; ours
protects its loader with ``preemption.protect_dataloaders``), ``periodic-save`` (rank 0 mid
write of a synchronous save), ``async-save`` (rank 0's background writer of an
in-flight ``save_async``), ``mid-commit`` (rank 0 between its files' fsync and the
manifest), ``rotation`` (retention deleting an old step: un-committed, data not yet
deleted). Framework rows: ``startup``, ``training``, ``checkpoint`` (rank 0 inside a
periodic save). Moments are dealt round-robin from a shuffled order, so a few trials
cover them all; delivery patterns are drawn at random: SIGTERM to the ``agent``
(Kubernetes: the container's PID 1), to ``every-worker``, to ``one-worker``, to
``agent-and-workers`` at once (SLURM), or ``second``: the agent, then the agent and
every worker again a moment later.

Per trial: the moment hit (and whether a signalled rank saw the signal while held
there), saved in time, previous checkpoint kept, resume step, requeue code seen, lost
steps, signal to commit and to exit. The run ends with a table of them per row, per
moment and per delivery pattern.

    python reliability/run.py --campaign preemption            # CI: 2 + 1 + 1 HF or Lightning
    PREEMPTION_TRIALS=500 python reliability/run.py --campaign preemption --full

``PREEMPTION_TRIALS`` (full: 500 ours, 50 stock, 25 of each framework row; when set, a
fifth as many stock and a tenth as many of each framework row),
``PREEMPTION_FRAMEWORK_TRIALS`` (each framework row) and ``PREEMPTION_GRACE_S``
(full: 10; quick: 30, for CI's shared cores) size it; ``PREEMPTION_KINDS`` and
``PREEMPTION_MOMENTS`` (comma-separated) narrow it to some rows and moments. A trial
takes 7-20 s on 2 cores (framework rows 10-40 s: the framework's resume runs for each).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from reliability.tally import Progress, Tally

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "dist" / "scripts" / "preempt_train.py"
FW_SCRIPT = REPO / "tests" / "dist" / "scripts" / "preempt_frameworks.py"
FW_HELPERS = REPO / "tests" / "integrations" / "scripts"
WORLD = 2
REQUEUE = 75
#: Moments, each with the range the occurrence a trial holds at is drawn from (None: the
#: first occurrence, no draw).
Occurrences = dict[str, tuple[int, int] | None]
#: Where our loop's trials hold.
MOMENTS_AT: Occurrences = {
    "startup": None,
    "training": None,
    "eval": (1, 2),  # evaluations at steps 4 and 8
    "data-loading": (2, 9),
    "loader-workers": (2, 9),
    "periodic-save": (1, 3),
    "async-save": (1, 3),
    "mid-commit": (1, 3),
    "rotation": (1, 2),  # deletions of steps 3 and 6
}
#: Where the frameworks' trials hold.
FW_MOMENTS_AT: Occurrences = {"startup": None, "training": None, "checkpoint": (1, 3)}
MOMENTS = tuple(MOMENTS_AT)
FW_MOMENTS = tuple(FW_MOMENTS_AT)
#: Moments every rank holds at; the others only rank 0 does.
EVERY_RANK = ("startup", "eval", "data-loading", "loader-workers")
PATTERNS = ("agent", "every-worker", "one-worker", "agent-and-workers", "second")
KINDS = ("ours", "stock", "hf-ours", "hf-stock", "lightning-ours", "lightning-stock")
#: Trials per kind.
SIZES = {
    "quick": {"ours": 2, "stock": 1},  # and one framework row with our integration
    "full": {"ours": 500, "stock": 50, **{k: 25 for k in KINDS[2:]}},
}
SAVE_EVERY = 3  # periodic saves at 3, 6, 9, ...; KeepLast(3) first rotates at 12
KEEP = 3  # preempt_train.py's retention: KeepLast(3)


def _nth(moment: str, rng: random.Random) -> int:
    """Which occurrence of ``moment`` to hold at. Every moment with a range draws one,
    whichever is asked (ours, then the frameworks'): a seed deals the trials it always
    dealt."""
    ranges = {**MOMENTS_AT, **FW_MOMENTS_AT}
    drawn = {m: rng.randint(*r) for m, r in ranges.items() if r is not None}
    return drawn.get(moment, 1)


class _Trial:
    """One launch of the job (``restart``: the requeued job, one step, no signal)."""

    def __init__(
        self,
        where: Path,
        *,
        kind: str,
        moment: str,
        grace_s: float,
        nth: int,
        restart: bool = False,
    ):
        self.where = where
        self.root = where / "ckpt"
        self.ctl = where / ("ctl-restart" if restart else "ctl")
        self.ctl.mkdir(parents=True)
        self.kind, self.moment = kind, moment
        self.framework = kind.split("-")[0] if "-" in kind else None
        self.ours = kind == "ours" or kind.endswith("-ours")
        self.held = moment != "training" and not restart
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(where),
            "ATOMIC_CHECKPOINT_GRACE_S": f"{grace_s:g}",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
        }
        for name in ("ATOMIC_CHECKPOINT_FAULTS", "ATOMIC_CHECKPOINT_ARM", "PREEMPT_HOLD_STARTUP"):
            env.pop(name, None)
        if kind == "stock":
            env["PREEMPT_STOCK"] = "1"
        if self.held:
            env["PREEMPT_HOLD"], env["PREEMPT_HOLD_NTH"] = moment, str(nth)
        if moment == "async-save" and not restart:
            env["PREEMPT_ASYNC"] = "1"
        if moment == "loader-workers" and not restart:
            env["PREEMPT_LOADER_WORKERS"] = "2"
        launcher = "atomic_checkpoint.launch" if self.ours else "torch.distributed.run"
        if self.framework is None:
            steps = "1" if restart else "3000"
            job = [str(SCRIPT), str(self.root), str(self.ctl), steps, str(SAVE_EVERY)]
        else:
            side = "ours" if self.ours else "stock"
            job = [str(FW_SCRIPT), self.framework, side, str(where), str(self.ctl), "3000"]
            job.append(str(SAVE_EVERY))
            self.root = where / "run"
        log = "restart.log" if restart else "launch.log"
        self.log = open(where / log, "w")  # noqa: SIM115 - closed in end()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                launcher,
                "--standalone",
                f"--nproc-per-node={WORLD}",
                "--monitor-interval=0.1",
                *job,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
            env=env,
            start_new_session=True,
        )

    def read(self, name: str) -> str | None:
        try:
            return (self.ctl / name).read_text()
        except (FileNotFoundError, ValueError):
            return None

    def wait_for(self, cond: Any, timeout_s: float = 120) -> bool:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def pids(self) -> list[int]:
        return [int(self.read(f"rank{r}.pid") or 0) for r in range(WORLD)]

    def loader_pids(self) -> list[int]:
        """The DataLoader worker processes of every rank (``loader-workers``)."""
        if self.moment != "loader-workers":
            return []
        return [int(p) for r in range(WORLD) for p in (self.read(f"rank{r}.loaders") or "").split()]

    def step(self, r: int) -> int:
        try:
            return int(self.read(f"rank{r}.step") or 0)
        except ValueError:
            return 0

    def holders(self) -> list[int]:
        if self.moment in EVERY_RANK:
            return list(range(WORLD))
        return [0]

    def at_moment(self) -> bool:
        return all(self.read(f"at-{self.moment}-rank{r}") is not None for r in self.holders())

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.pids()]:
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def end(self) -> None:
        self.log.close()


def _deliver(t: _Trial, pattern: str, rng: random.Random) -> None:
    agent, workers = t.proc.pid, t.pids()
    targets = {
        "agent": [agent],
        "every-worker": workers,
        "one-worker": [rng.choice(workers)],
        "agent-and-workers": [agent, *workers],
        "second": [agent],
    }[pattern]
    # The scheduler signals every process of the job step: the loader workers too.
    targets = [*targets, *t.loader_pids()]
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if t.held:
        (t.ctl / "go").write_text("")
    if pattern == "second":
        # A random moment later (the save may be under way): the agent and every
        # worker again, as SLURM repeats the signal to the whole step.
        t.wait_for(lambda: False, rng.uniform(0.0, 1.5))
        for pid in [agent, *workers, *t.loader_pids()]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------- checks
def _committed(root: Path) -> list[int]:
    from atomic_checkpoint import CheckpointManager

    if not root.is_dir():
        return []
    return [c.step for c in CheckpointManager(root, read_only=True).checkpoints()]


def _newest_restores(root: Path) -> tuple[int | None, str | None]:
    """The step a restart resumes from, and what is wrong with it (None: verified, and
    every rank's state restores exactly)."""
    from tests.dist.workers import make_state, states_equal

    from atomic_checkpoint import CheckpointManager

    if not root.is_dir():
        return None, None
    reader = CheckpointManager(root, read_only=True)
    latest = reader.latest()
    if latest is None:
        return None, None
    try:
        reader.verify(latest.step)
        for r in range(WORLD):
            state = reader.restore(latest.step, rank=r)
            if not states_equal(state, make_state(latest.step, r, big_elems=4096)):
                return latest.step, f"rank {r}'s state differs after restore"
    except Exception as exc:
        return latest.step, f"{type(exc).__name__}: {exc}"
    return latest.step, None


#: What the HF Trainer writes into every checkpoint of these jobs (2 ranks, AdamW, a
#: linear schedule): a checkpoint without one of them resumes silently incomplete.
HF_FILES = (
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "trainer_state.json",
    "rng_state_0.pth",
    "rng_state_1.pth",
)


def _hf_resume(run: Path) -> tuple[int | None, str | None, bool]:
    """What the stock resume (``resume_from_checkpoint=True``) picks in ``run``: its
    step, why it does not load (None: it loads), and whether it has every file."""
    if str(FW_HELPERS) not in sys.path:
        sys.path.insert(0, str(FW_HELPERS))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from tiny_hf import RandomTokens, tiny_args, tiny_model
    from transformers import Trainer
    from transformers.trainer_utils import get_last_checkpoint

    if not run.is_dir():
        return None, None, False
    last = get_last_checkpoint(str(run))
    if last is None:
        return None, None, False
    step = int(last.rsplit("-", 1)[1])
    complete = all((Path(last) / f).is_file() for f in HF_FILES)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            trainer = Trainer(
                model=tiny_model(),
                args=tiny_args(scratch, max_steps=step + 1, save_steps=10**6),
                train_dataset=RandomTokens(64),
            )
            trainer.train(resume_from_checkpoint=last)  # loads, then trains one step
            if trainer.state.global_step != step + 1:
                return step, f"ended at step {trainer.state.global_step}, not {step + 1}", complete
        except Exception as exc:
            return step, f"{type(exc).__name__}: {str(exc)[:300]}", complete
    return step, None, complete


def _lightning_resume(run: Path, ours: bool) -> tuple[int | None, str | None, bool]:
    """What the framework's resume picks in ``run`` (stock: ``ckpt_path="last"``;
    ours: ``latest_checkpoint``, the newest complete file by step), its step, why it
    does not load (None: ``Trainer.fit(ckpt_path=...)`` restores it), and whether it
    is complete (loads with ``torch.load`` and carries the loop and optimizer state)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if str(FW_HELPERS) not in sys.path:
        sys.path.insert(0, str(FW_HELPERS))
    import lightning.pytorch as pl
    import torch
    from lightning_train import TinyModel

    if not run.is_dir():
        return None, None, False
    if ours:
        from atomic_checkpoint.integrations.lightning import latest_checkpoint

        found = latest_checkpoint(str(run))
        path = None if found is None else Path(found)
    else:
        path = run / "last.ckpt"
        if not path.exists() and not path.is_symlink():
            return None, None, False
    if path is None:
        return None, None, False
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        step = int(ckpt["global_step"])
        complete = "optimizer_states" in ckpt and "loops" in ckpt
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:300]}", False
    with tempfile.TemporaryDirectory() as scratch:
        try:
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=step + 1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=scratch,
            )
            trainer.fit(TinyModel(), ckpt_path=str(path))  # loads, then trains one step
            if trainer.global_step != step + 1:
                return step, f"ended at step {trainer.global_step}, not {step + 1}", complete
        except Exception as exc:
            return step, f"{type(exc).__name__}: {str(exc)[:300]}", complete
    return step, None, complete


def _restart(where: Path, kind: str, moment: str, grace_s: float) -> tuple[int | None, str | None]:
    """Requeue the job (our loop, stock or ours): one step, no signal. Returns the step
    every rank restored (None: none restored) and what went wrong (None: each rank's
    state after ``restore`` equals the state it saved at that step, and the job
    exited 0)."""
    t = _Trial(where, kind=kind, moment=moment, grace_s=grace_s, nth=1, restart=True)
    try:
        try:
            rc = t.proc.wait(120)
        except subprocess.TimeoutExpired:
            t.kill_all()
            t.proc.wait(30)
            return None, "the restart did not end in 120 s"
    finally:
        t.kill_all()
        t.end()
    results = [json.loads(t.read(f"result-rank{r}.json") or "null") for r in range(WORLD)]
    if rc != 0 or not all(results):
        tail = (where / "restart.log").read_text(errors="replace")[-1500:]
        return None, f"the restart exited {rc}: {tail}"
    restored = {r["restored"] for r in results}
    if len(restored) != 1:
        return None, f"the ranks restored different steps: {sorted(map(str, restored))}"
    if not all(r["restored_ok"] in (True, None) for r in results):
        return next(iter(restored)), "a rank's restored state differs from the one it saved"
    return next(iter(restored)), None


# ---------------------------------------------------------------------- one trial
def _one(
    tally: Tally,
    rng: random.Random,
    where: Path,
    *,
    kind: str,
    moment: str,
    grace_s: float,
) -> dict[str, Any]:
    pattern = rng.choice(PATTERNS)
    t0 = time.monotonic()
    key = f"{kind} {moment}/{pattern}"
    t = _Trial(where, kind=kind, moment=moment, grace_s=grace_s, nth=_nth(moment, rng))
    prev: int | None = None
    try:
        ready = t.wait_for(lambda: all(t.pids()))
        if ready and t.held:
            ready = t.wait_for(t.at_moment)
        elif ready:
            at = rng.randint(2, 9)
            ready = t.wait_for(lambda: all(t.step(r) >= at for r in range(WORLD)))
        if not ready:
            t.kill_all()
            t.proc.wait(30)
            tally.violate("stuck", f"{key}: the job never reached the moment: {_tail(where)}")
            return {"kind": kind, "moment": moment, "pattern": pattern, "stuck": True}
        if t.framework is None:
            prev = max(_committed(t.root), default=None)
        before = max(t.step(r) for r in range(WORLD))
        signalled = time.monotonic()
        _deliver(t, pattern, rng)
        try:
            rc: int | None = t.proc.wait(max(0.1, signalled + grace_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None  # the scheduler's SIGKILL
            t.kill_all()
            t.proc.wait(30)
        took = time.monotonic() - signalled
        # Workers of a launcher that exited may linger: the scheduler kills them too.
        t.kill_all()
    finally:
        t.end()
    results = [json.loads(t.read(f"result-rank{r}.json") or "null") for r in range(WORLD)]
    lefts = [json.loads(t.read(f"left-{moment}-rank{r}") or "null") for r in range(WORLD)]
    reached = max(before, *(t.step(r) for r in range(WORLD)))
    # Every rank still starting when the grace period was nearly over, no guard yet:
    # they exited with the requeue code on their own (preemption.arm's deadline).
    deadline_exit = not any(results) and "no PreemptionGuard has taken it over" in _tail(
        where, None
    )
    decided = {r["decided"] for r in results if r}
    skipped = [r["skipped_save"] for r in results if r and r.get("skipped_save")]
    record: dict[str, Any] = {
        "kind": kind,
        "moment": moment,
        "pattern": pattern,
        "hit": True,  # the job was held at the moment (or at the step) when signalled
        "signal_inside": any(x and x.get("signalled") for x in lefts) if t.held else None,
        "rc": rc,
        "requeue": rc == REQUEUE,
        "killed_at_grace_end": rc is None,
        "signal_to_exit_s": round(took, 2),
        "reached": reached,
        "decided": sorted(map(str, decided)),
        "skipped_save": bool(skipped),
        "startup_deadline_exit": deadline_exit,
    }
    if t.framework is None:
        newest, problem = _newest_restores(t.root)
        committed = _committed(t.root)
        complete = problem is None
        record["restart_step"], record["restart_problem"] = _restart(where, kind, moment, grace_s)
    elif t.framework == "hf":
        newest, problem, complete = _hf_resume(t.root)
        committed = []
    else:
        newest, problem, complete = _lightning_resume(t.root, t.ours)
        committed = []
    saved = len(decided) == 1 and None not in decided and newest == next(iter(decided))
    commits = [r.get("committed_at") for r in results if r and r.get("committed_at")]
    record.update(
        {
            "newest": newest,
            "resume_step": None if newest is None else newest + 1,
            "newest_loads": newest is not None and problem is None,
            "newest_complete": newest is not None and complete,
            "problem": problem,
            "saved_in_time": saved and rc is not None,
            "previous": prev,
            "previous_kept": None if prev is None else (prev in committed or newest is not None),
            "lost_steps": reached - (newest or 0),
            "signal_to_commit_s": round(max(commits) - signalled, 2) if commits else None,
            "trial_s": round(time.monotonic() - t0, 1),
        }
    )
    if t.framework is None and prev is not None:
        # Kept, or replaced by retention: KeepLast(KEEP) deletes it once KEEP newer steps
        # are committed (an in-flight async save and the steps trained meanwhile can
        # commit that many before the stop).
        replaced = len([s for s in committed if s > prev]) >= KEEP
        record["previous_kept"] = (prev in committed or replaced) and problem is None
    record["resumed"] = (
        record["restart_problem"] is None and record["restart_step"] == newest
        if t.framework is None
        else record["newest_loads"]  # the framework's own resume, run above
    )
    if t.framework is None and record["restart_problem"] is not None:
        tally.violate("torn", f"{key}: the restart: {record['restart_problem']}")
    elif t.framework is None and record["restart_step"] != newest:
        tally.violate("lost", f"{key}: the restart restored {record['restart_step']}, not {newest}")
    if problem is not None and (t.ours or t.framework is None):
        # A torn newest checkpoint is wrong with or without us (our loop writes through
        # the library either way); the frameworks' stock rows are what is measured.
        tally.violate("torn", f"{key}: step {newest}: {problem}")
    if not t.ours:
        return record
    tally.faults += 1
    if rc is None:
        tally.violate("hangs", f"{key}: still running {grace_s:g} s after the signal")
    elif rc != REQUEUE:
        tally.violate("unclear", f"{key}: exit status {rc}, not the requeue code: {_tail(where)}")
    if deadline_exit:
        # Nothing trained since the start, nothing to save: the previous checkpoint
        # must be the newest, intact (checked below and by the restore above).
        if newest != prev:
            tally.violate("lost", f"{key}: start-up exit, newest {newest}, was {prev}")
    elif len(decided) != 1 or None in decided or not all(results):
        tally.violate("split", f"{key}: the ranks stopped at {record['decided']}")
    elif not saved and not skipped:
        tally.violate("lost", f"{key}: agreed step {decided} not committed (newest {newest})")
    if record["previous_kept"] is False:
        tally.violate("lost", f"{key}: the previous checkpoint (step {prev}) is gone")
    return record


def _tail(where: Path, chars: int | None = 1500) -> str:
    try:
        text = (where / "launch.log").read_text(errors="replace")
    except OSError:
        return ""
    return text if chars is None else text[-chars:]


# ---------------------------------------------------------------------- the table
def _row(records: list[dict[str, Any]]) -> str:
    n = len(records)

    def c(field: str) -> int:
        return sum(1 for r in records if r.get(field))

    exits = sorted(r["signal_to_exit_s"] for r in records if "signal_to_exit_s" in r)
    median = exits[len(exits) // 2] if exits else 0.0
    lost = [r["lost_steps"] for r in records if "lost_steps" in r]
    kept = [r for r in records if r.get("previous_kept") is not None]
    commits = [r["signal_to_commit_s"] for r in records if r.get("signal_to_commit_s")]
    return (
        f"{n:6d} {c('signal_inside'):5d} {c('requeue'):6d} {c('saved_in_time'):5d} "
        f"{c('previous_kept'):3d}/{len(kept):<3d} {c('newest_loads'):5d} "
        f"{c('newest_complete'):8d} {c('resumed'):7d} {c('killed_at_grace_end'):6d} "
        f"{max(lost, default=0):4d} "
        f"{max(commits, default=0.0):6.2f} {median:4.1f}/{max(exits, default=0.0):4.1f}"
    )


def summary(records: list[dict[str, Any]]) -> list[str]:
    """The campaign's table: per row, per moment and per delivery pattern. Columns:
    trials; seen: a held rank recorded the signal before leaving the moment; exit75:
    the launcher's exit status was the requeue code; saved: the agreed step committed
    before the exit; kept: the checkpoint newest at the signal still there and
    verified / trials that had one (our loop); loads: the newest checkpoint loads with
    its writer's resume (ours: verified and every rank's state bit-exact; HF/Lightning:
    the framework's own resume); complete: it has every part; resumed: the requeued job
    (our loop: launched again for one step; HF/Lightning: the framework's resume)
    restored that newest step, every rank's state bit-exact; killed: still running
    at the end of the grace period; lost: most steps lost; commit: slowest signal to
    commit, s (our loop); exit s: signal to exit, median/max."""
    head = (
        f"{'':32s} {'trials':>6s} {'seen':>5s} {'exit75':>6s} {'saved':>5s} {'kept':>7s} "
        f"{'loads':>5s} {'complete':>8s} {'resumed':>7s} {'killed':>6s} {'lost':>4s} "
        f"{'commit':>6s} {'exit s':>9s}"
    )
    lines = [head]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[r["kind"]].append(r)
        groups[f"{r['kind']} {r['moment']}"].append(r)
        groups[f"{r['kind']} /{r['pattern']}"].append(r)
    for kind in KINDS:
        if kind not in groups:
            continue
        lines.append(f"{kind:32s} {_row(groups[kind])}")
        for m in dict.fromkeys((*MOMENTS, *FW_MOMENTS)):
            g = groups.get(f"{kind} {m}")
            if g:
                lines.append(f"  {m:30s} {_row(g)}")
        for p in PATTERNS:
            g = groups.get(f"{kind} /{p}")
            if g:
                lines.append(f"  /{p:29s} {_row(g)}")
    return lines


def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    tally = Tally("preemption")
    sizes = dict(SIZES[size])
    if "PREEMPTION_TRIALS" in os.environ:
        n = int(os.environ["PREEMPTION_TRIALS"])
        sizes["ours"] = n
        if size == "full":
            sizes["stock"] = max(1, n // 5)
            for k in KINDS[2:]:
                sizes[k] = max(1, n // 10)
    if size == "quick":
        # CI: one framework trial, HF or Lightning by the seed's parity.
        sizes["hf-ours" if seed % 2 else "lightning-ours"] = 1
    if "PREEMPTION_FRAMEWORK_TRIALS" in os.environ:
        for k in KINDS[2:]:
            sizes[k] = int(os.environ["PREEMPTION_FRAMEWORK_TRIALS"])
    # The quick mode runs in CI, on 2 cores that other jobs share: under a load of 7,
    # importing torch and forming the process group after a start-up signal alone can
    # take 6 s. The figures come from the full mode, with the 10 s.
    grace_s = float(os.environ.get("PREEMPTION_GRACE_S", "10" if size == "full" else "30"))
    only_kinds = [k for k in os.environ.get("PREEMPTION_KINDS", "").split(",") if k]
    only_moments = [m for m in os.environ.get("PREEMPTION_MOMENTS", "").split(",") if m]
    for name in (*only_kinds, *only_moments):
        if name not in (*KINDS, *MOMENTS, *FW_MOMENTS):
            raise ValueError(f"PREEMPTION_KINDS/PREEMPTION_MOMENTS: unknown {name!r}")
    rng = random.Random(seed)
    base = Path(workdir) / "preemption"
    plan: list[tuple[str, str]] = []
    for kind in only_kinds or KINDS:
        moments = [m for m in (FW_MOMENTS if "-" in kind else MOMENTS) if m in only_moments]
        moments = moments or list(FW_MOMENTS if "-" in kind else MOMENTS)
        rng.shuffle(moments)
        plan += [(kind, moments[i % len(moments)]) for i in range(sizes.get(kind, 0))]
    records: list[dict[str, Any]] = []
    log = base / "trials.jsonl"
    base.mkdir(parents=True, exist_ok=True)
    for i, (kind, moment) in enumerate(plan):
        tally.trials += 1
        rec = _one(tally, rng, base / f"trial-{i}", kind=kind, moment=moment, grace_s=grace_s)
        records.append(rec)
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if (i + 1) % 10 == 0 or i + 1 == len(plan):
            progress(f"preemption: {i + 1}/{len(plan)} trials, {tally.violations} violations")
    for rec in records:
        if "rc" not in rec:
            continue
        side = rec["kind"]
        k = f"{rec['moment']}/{rec['pattern']}"
        tally.count(f"{side}_trials", k)
        tally.count(f"{side}_requeue_code", k, int(rec["requeue"]))
        tally.count(f"{side}_saved_in_time", k, int(rec["saved_in_time"]))
        tally.count(f"{side}_newest_loads", k, int(rec["newest_loads"]))
        tally.count(f"{side}_resumed", k, int(bool(rec.get("resumed"))))
        tally.count(f"{side}_killed_at_grace_end", k, int(rec["killed_at_grace_end"]))
        tally.stats.setdefault(f"{side}_signal_to_exit_s", []).append(rec["signal_to_exit_s"])
        tally.stats.setdefault(f"{side}_lost_steps", []).append(rec["lost_steps"])
        if rec.get("signal_to_commit_s") is not None:
            tally.stats.setdefault(f"{side}_signal_to_commit_s", []).append(
                rec["signal_to_commit_s"]
            )
        if rec["skipped_save"]:
            tally.count(f"{side}_save_skipped_for_the_deadline", k)
        if rec["startup_deadline_exit"]:
            tally.count(f"{side}_startup_deadline_exit", k)
    ours = [r for r in records if r["kind"] == "ours" and "rc" in r]
    tally.stats["ours_slowest_signal_to_exit_s"] = max(
        (r["signal_to_exit_s"] for r in ours), default=0.0
    )
    tally.stats["ours_slowest_signal_to_commit_s"] = max(
        (r["signal_to_commit_s"] for r in ours if r.get("signal_to_commit_s") is not None),
        default=0.0,
    )
    tally.stats["moment_signal_seen_while_held"] = sum(1 for r in records if r.get("signal_inside"))
    for line in summary([r for r in records if "rc" in r]):
        progress(line)
    progress(f"per-trial records: {log} (kept when --workdir is given)")
    return tally.finish()


# ---------------------------------------------------------------------- docs tables
def markdown(records: list[dict[str, Any]]) -> str:
    """The per-moment and per-pattern tables of ``docs/preemption.md`` from a run's
    records. Each cell: trials: launcher exit 75 / saved the agreed step in time (our
    loop; the frameworks' rows: the newest checkpoint loads with the framework's
    resume) / the requeued job resumed the newest checkpoint bit-exactly (/ killed at
    the grace end)."""
    records = [r for r in records if "rc" in r]
    kinds = [k for k in KINDS if any(r["kind"] == k for r in records)]

    def cell(rs: list[dict[str, Any]]) -> str:
        if not rs:
            return ""
        n = len(rs)
        exit75 = sum(1 for r in rs if r["requeue"])
        middle = sum(
            1 for r in rs if (r["saved_in_time"] if "-" not in r["kind"] else r["newest_loads"])
        )
        resumed = sum(1 for r in rs if r.get("resumed"))
        killed = sum(1 for r in rs if r["killed_at_grace_end"])
        text = f"{n}: {exit75} / {middle} / {resumed}"
        return text + (f" / {killed} killed" if killed else "")

    lines: list[str] = []
    for axis, values in (
        ("moment", list(dict.fromkeys((*MOMENTS, *FW_MOMENTS)))),
        ("delivery pattern", list(PATTERNS)),
    ):
        key = "moment" if axis == "moment" else "pattern"
        lines.append(f"| {axis} | " + " | ".join(kinds) + " |")
        lines.append("|---|" + "---|" * len(kinds))
        for v in values:
            cells = [cell([r for r in records if r["kind"] == k and r[key] == v]) for k in kinds]
            if any(cells):
                lines.append(f"| {v} | " + " | ".join(cells) + " |")
        lines.append(
            "| all | "
            + " | ".join(cell([r for r in records if r["kind"] == k]) for k in kinds)
            + " |"
        )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    # python -m reliability.preemption WORKDIR/preemption/trials.jsonl
    with open(sys.argv[1]) as f:
        print(markdown([json.loads(line) for line in f if line.strip()]))
