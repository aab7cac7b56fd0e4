"""The ``preemption`` campaign: real torchrun jobs, real signals at random moments,
delivered the ways schedulers deliver them, a grace period after which everything is
SIGKILLed, then the checkpoint the restart would resume from checked bit for bit.

Each trial launches ``tests/dist/scripts/preempt_train.py`` (two gloo ranks, the
README's loop) and picks:

- a moment: ``startup`` (every rank before its process group exists), ``training``
  (a random step), ``periodic-save`` (while a periodic save is being written);
- a delivery pattern: SIGTERM to the ``agent`` (Kubernetes: the container's PID 1),
  to ``every-worker``, to ``one-worker``, to ``agent-and-workers`` at once (SLURM),
  or ``second``: the agent, then the agent and every worker again a moment later.

Ours: ``python -m atomic_checkpoint.launch`` with signals armed and ``guard.exit()``.
Every trial must end within the grace period with the requeue code (75) from the
launcher, every rank stopped at one agreed step, that step committed (or, when the
guard judged that no save could fit, the previous checkpoint intact), and the newest
checkpoint verifying and restoring every rank's state exactly. Stock: stock torchrun
and the loop without ``arm()`` (``PREEMPT_STOCK=1``), measured, not judged: its rows
show how often a SIGTERM leaves the requeue code and the agreed checkpoint without
this library's launcher and start-up protection.

    python reliability/run.py --campaign preemption            # 3 trials + 1 stock
    PREEMPTION_TRIALS=500 python reliability/run.py --campaign preemption --full

``PREEMPTION_TRIALS`` (full: 500 ours and 50 stock; when set, a fifth as many stock)
and ``PREEMPTION_GRACE_S`` (default 10) size it; a trial takes 5-15 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reliability.tally import Progress, Tally

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "dist" / "scripts" / "preempt_train.py"
WORLD = 2
REQUEUE = 75
MOMENTS = ("startup", "training", "periodic-save")
PATTERNS = ("agent", "every-worker", "one-worker", "agent-and-workers", "second")
SIZES = {"quick": (3, 1), "full": (500, 50)}  # (ours, stock) trials


class _Trial:
    def __init__(self, where: Path, *, stock: bool, moment: str, grace_s: float):
        self.root, self.ctl = where / "ckpt", where / "ctl"
        self.ctl.mkdir(parents=True)
        self.stock, self.moment = stock, moment
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(where),
            "ATOMIC_CHECKPOINT_GRACE_S": f"{grace_s:g}",
        }
        env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
        if stock:
            env["PREEMPT_STOCK"] = "1"
        if moment == "startup":
            env["PREEMPT_HOLD_STARTUP"] = "1"
        if moment == "periodic-save":  # 1 s pause mid-write on rank 0: a window to land in
            env["ATOMIC_CHECKPOINT_FAULTS"] = "mid_write@0=delay"
        launcher = "torch.distributed.run" if stock else "atomic_checkpoint.launch"
        self.log = open(where / "launch.log", "w")  # noqa: SIM115 - closed in end()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                launcher,
                "--standalone",
                f"--nproc-per-node={WORLD}",
                "--monitor-interval=0.1",
                str(SCRIPT),
                str(self.root),
                str(self.ctl),
                "3000",
                "3",
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

    def wait_for(self, cond: Any, timeout_s: float = 90) -> bool:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def pids(self) -> list[int]:
        return [int(self.read(f"rank{r}.pid") or 0) for r in range(WORLD)]

    def step(self, r: int) -> int:
        try:
            return int(self.read(f"rank{r}.step") or 0)
        except ValueError:
            return 0

    def saving(self) -> bool:
        pend = self.root / ".pending"
        try:
            return any((pend / d / "rank-00000.safetensors").exists() for d in os.listdir(pend))
        except FileNotFoundError:
            return False

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
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if t.moment == "startup":
        (t.ctl / "go").write_text("")
    if pattern == "second":
        # A random moment later (the save may be under way): the agent and every
        # worker again, as SLURM repeats the signal to the whole step.
        t.wait_for(lambda: False, rng.uniform(0.0, 1.5))
        for pid in [agent, *workers]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


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


def _one(tally: Tally, rng: random.Random, where: Path, *, stock: bool, grace_s: float) -> None:
    moment, pattern = rng.choice(MOMENTS), rng.choice(PATTERNS)
    key = f"{moment}/{pattern}"
    t = _Trial(where, stock=stock, moment=moment, grace_s=grace_s)
    try:
        ready = t.wait_for(lambda: all(t.pids()))
        if ready and moment == "startup":
            ready = t.wait_for(
                lambda: all(t.read(f"startup-rank{r}") is not None for r in range(WORLD))
            )
        elif ready and moment == "training":
            at = rng.randint(2, 9)
            ready = t.wait_for(lambda: all(t.step(r) >= at for r in range(WORLD)))
        elif ready:
            ready = t.wait_for(t.saving)
        if not ready:
            t.kill_all()
            t.proc.wait(30)
            tally.violate("stuck", f"{key}: the job never reached the moment: {_tail(where)}")
            return
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
    reached = max(before, *(t.step(r) for r in range(WORLD)))
    newest, problem = _newest_restores(t.root)
    decided = {r["decided"] for r in results if r}
    skipped = [r["skipped_save"] for r in results if r and r.get("skipped_save")]
    saved = len(decided) == 1 and None not in decided and newest == next(iter(decided))
    lost = reached - (newest or 0)
    side = "stock" if stock else "ours"
    tally.count(f"{side}_trials", key)
    tally.count(f"{side}_requeue_code", key, int(rc == REQUEUE))
    tally.count(f"{side}_agreed_step_committed", key, int(saved))
    tally.count(f"{side}_killed_at_grace_end", key, int(rc is None))
    tally.stats.setdefault(f"{side}_signal_to_exit_s", []).append(round(took, 2))
    tally.stats.setdefault(f"{side}_lost_steps", []).append(lost)
    if problem is not None:  # a torn newest checkpoint is wrong with or without us
        tally.violate("torn", f"{side} {key}: step {newest}: {problem}")
    if stock:
        return
    tally.faults += 1
    if rc is None:
        tally.violate("hangs", f"{key}: still running {grace_s:g} s after the signal")
    elif rc != REQUEUE:
        tally.violate("unclear", f"{key}: exit status {rc}, not the requeue code: {_tail(where)}")
    if len(decided) != 1 or None in decided or not all(results):
        tally.violate("split", f"{key}: the ranks stopped at {sorted(map(str, decided))}")
    elif not saved and not skipped:
        tally.violate("lost", f"{key}: agreed step {decided} not committed (newest {newest})")
    if skipped:
        tally.count("ours_save_skipped_for_the_deadline", key)


def _tail(where: Path) -> str:
    try:
        return (where / "launch.log").read_text()[-1500:]
    except OSError:
        return ""


def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    tally = Tally("preemption")
    ours, stock = SIZES[size]
    ours = int(os.environ.get("PREEMPTION_TRIALS", ours))
    if size == "full" and "PREEMPTION_TRIALS" in os.environ:
        stock = max(1, ours // 5)
    grace_s = float(os.environ.get("PREEMPTION_GRACE_S", "10"))
    rng = random.Random(seed)
    base = Path(workdir) / "preemption"
    plan = [False] * ours + [True] * stock
    for i, is_stock in enumerate(plan):
        tally.trials += 1
        _one(tally, rng, base / f"trial-{i}", stock=is_stock, grace_s=grace_s)
        if (i + 1) % 10 == 0 or i + 1 == len(plan):
            progress(f"preemption: {i + 1}/{len(plan)} trials, {tally.violations} violations")
    slowest = max(tally.stats.get("ours_signal_to_exit_s", [0.0]))
    tally.stats["ours_slowest_signal_to_exit_s"] = slowest
    return tally.finish()
