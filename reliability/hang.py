"""Hung ranks and slow storage: the others must raise ``CoordinationTimeoutError``
naming the rank that did not arrive, within the configured timeout (plus slack), and
the late rank itself must fail cleanly once it wakes up.

Variants:

- **hang**: ``ATOMIC_CHECKPOINT_FAULTS=<phase>@<rank>=hang`` makes one rank sleep at a
  protocol phase (the coordinator at any phase, a peer at the phases it passes);
- **frozen**: the campaign SIGSTOPs a random rank at a random moment of a save (a
  process stuck in the kernel, or descheduled for good), waits for the others to give
  up, then SIGCONTs it: it must raise too, never report success, never hang;
- **outcome**: a rank other than the leader freezes itself (SIGSTOP) on its exchange
  thread while it waits for the published outcome of the commit, and is woken once the
  others returned and its own exchange deadline has passed: it must report the outcome
  the others reported (the commit happened), not a timeout (issue 11, defect 14);
- **slow**: a real slow link: ranks 0-1 write to the server's own disk, rank 2 writes
  through an sshfs mount from another network namespace whose link is throttled with a
  token-bucket filter (``tc tbf``), so its write takes several timeouts.

A peer hung after its last message (``during_broadcast``) does not stop the others:
they return the leader's outcome, all the same one.

After each trial nothing torn is discoverable, the checkpoint before the trial is
intact, and the next start leaves no pending data. Run it beside a CPU hog too (a
busy loop per core, e.g. ``python -c "while True: pass" &``): a loaded machine is where
frozen and descheduled ranks are met.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from atomic_checkpoint._faults import SAVE_PHASES

from . import fresh_dir
from .checks import inspect_root, next_start_leftovers, unclear_reason
from .jobs import ForkJob
from .kill import COORDINATOR_ONLY
from .tally import Progress, Tally
from .workers import w_timed_save

WORLD = 3
SIZE = 1 << 12
#: Allowed lateness of a timeout: its own measurement, the save's work before the
#: barrier, and scheduling on a loaded 2-core machine.
SLACK_S = 2.0


#: How long past its timeout a rank's exchange waits before it counts the store as cut
#: off (``coordination._STALL_GRACE_S``): an outcome trial freezes its rank past both.
STALL_GRACE_S = 5.0


@dataclass(frozen=True)
class HangSize:
    hang: int
    frozen: int
    slow: int
    timeout_s: float
    outcome: int = 0


SIZES = {
    "quick": HangSize(hang=4, frozen=4, slow=1, timeout_s=2.0, outcome=1),
    "full": HangSize(hang=24, frozen=16, slow=3, timeout_s=2.0, outcome=4),
}


def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    cfg = SIZES[size]
    tally = Tally("hang")
    rng = random.Random(seed)
    base = fresh_dir(os.path.join(workdir, "hang"))
    os.makedirs(os.path.join(base, "jobs"))
    state: dict[str, Any] = {"step": 2, "big": {}}
    root = os.path.join(base, "root")
    choices = [(p, "coordinator") for p in SAVE_PHASES]
    choices += [(p, "peer") for p in SAVE_PHASES if p not in COORDINATOR_ONLY]
    rng.shuffle(choices)
    for i in range(cfg.hang):
        phase, role = choices[i % len(choices)]
        _hang_trial(tally, cfg, rng, base, root, state, phase, role)
    progress(f"hang: {cfg.hang} hung-rank trials, {tally.violations} violations")
    for _ in range(cfg.frozen):
        _frozen_trial(tally, cfg, rng, base, root, state)
    progress(f"hang: {cfg.frozen} frozen-rank trials, {tally.violations} violations")
    for _ in range(cfg.outcome):
        _outcome_trial(tally, cfg, rng, base, root, state)
    progress(f"hang: {cfg.outcome} frozen-at-outcome trials, {tally.violations} violations")
    if cfg.slow:
        try:
            with _slow_node(base) as (fast_root, slow_root, truth):
                for _ in range(cfg.slow):
                    _slow_trial(tally, cfg, base, fast_root, slow_root, truth, state)
        except Exception as exc:
            tally.violate("stuck", f"slow storage: could not run: {type(exc).__name__}: {exc}")
        progress(f"hang: {cfg.slow} slow-storage trials, {tally.violations} violations")
    return tally.finish()


def _next(state: dict[str, Any]) -> int:
    state["step"] += 2
    return state["step"]


def _hang_trial(
    tally: Tally,
    cfg: HangSize,
    rng: random.Random,
    base: str,
    root: str,
    state: dict[str, Any],
    phase: str,
    role: str,
) -> None:
    tally.trials += 1
    step = _next(state)
    victim = 0 if role == "coordinator" else rng.randrange(1, WORLD)
    label = f"hang at {phase} on rank {victim}"
    env = {"ATOMIC_CHECKPOINT_FAULTS": f"{phase}@{victim}=hang:{step}"}
    job = _save_job(base, cfg, [root] * WORLD, step, {}, env=env)
    try:
        # The others raise after one timeout; the victim sleeps on and is killed.
        job.join([r for r in range(WORLD) if r != victim], 20 + 3 * cfg.timeout_s)
        results = job.wait(timeout_s=0.5)
    finally:
        job.close()
    if results[victim].exitcode is not None:
        tally.count("missed", label)
    else:
        tally.faults += 1
    if phase == "during_broadcast" and role == "peer":
        # A peer hung after its last message (its write report): the leader publishes
        # the outcome without waiting for anyone, so the others rightly return it; the
        # hung peer would read the same outcome once it woke. One outcome for all.
        _judge_after_last_message(tally, label, results, victim)
    else:
        _judge_timeouts(tally, cfg, label, results, victim, None)
    _judge_root(tally, label, root, step, state["big"])


def _save_job(
    base: str,
    cfg: HangSize,
    roots: list[str],
    step: int,
    sizes: dict[int, int],
    *,
    frozen_at_outcome: int | None = None,
    env: dict[str, str] | None = None,
) -> ForkJob:
    """``WORLD`` ranks running :func:`reliability.workers.w_timed_save`: save ``step``
    into ``roots`` (one per rank) with tensor ``sizes``, under the campaign's
    coordination timeout."""
    return ForkJob(
        w_timed_save,
        WORLD,
        roots,
        step,
        SIZE,
        sizes,
        cfg.timeout_s,
        frozen_at_outcome,
        tmp_dir=os.path.join(base, "jobs"),
        env=env,
    )


def _outcomes(tally: Tally, label: str, results: list[Any], skip: int | None = None) -> list[str]:
    """Each rank's outcome (``"saved"`` or the type of its error), but for ``skip``'s; a
    rank that did not return is a ``hangs`` violation, one that crashed ``stuck``."""
    outcomes = []
    for r in results:
        if r.rank == skip:
            continue
        if r.exitcode is None:
            tally.violate("hangs", f"{label}: rank {r.rank} did not return")
        elif r.error is not None or r.value is None or r.value.get("setup_error"):
            tally.violate("stuck", f"{label}: rank {r.rank} crashed: {r.error_text[-300:]}")
        else:
            err = r.value["error"]
            outcomes.append("saved" if err is None else err["type"])
    return outcomes


def _judge_after_last_message(tally: Tally, label: str, results: list[Any], victim: int) -> None:
    """The others must all return (no hang) with one outcome between them."""
    outcomes = set(_outcomes(tally, label, results, skip=victim))
    if len(outcomes) > 1:
        tally.violate("split", f"{label}: the other ranks disagree: {sorted(outcomes)}")
    elif outcomes:
        tally.count("stalled_after_its_last_message", outcomes.pop())


def _frozen_trial(
    tally: Tally, cfg: HangSize, rng: random.Random, base: str, root: str, state: dict[str, Any]
) -> None:
    tally.trials += 1
    step = _next(state)
    victim = rng.randrange(WORLD)
    # Bigger states make the save last long enough to be caught in the middle.
    sizes = {r: 1 << 18 for r in range(WORLD)}
    state["big"][step] = sizes
    job = _save_job(base, cfg, [root] * WORLD, step, sizes)
    where = ""

    def freeze() -> bool:
        nonlocal where
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
            job.progress(r).startswith("timed:") for r in range(WORLD)
        ):
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.03))
        where = job.progress(victim).removeprefix("timed:")
        return where not in ("saved", "finished") and job.signal(victim, signal.SIGSTOP)

    # Wake the frozen rank once the others gave up.
    stopped, t_stop, results = _frozen_job(job, cfg, victim, freeze, cfg.timeout_s + SLACK_S + 10)
    label = f"frozen rank {victim} at {where}"
    if not stopped:
        tally.count("missed", "frozen: the save was over")
        return
    tally.faults += 1
    tally.count("frozen_at", where)
    _judge_timeouts(tally, cfg, label, results, victim, t_stop)
    woke = results[victim]
    if woke.exitcode is None:
        tally.violate("hangs", f"{label}: after SIGCONT the rank never finished")
    elif (
        woke.value is not None
        and woke.value.get("error") is None
        and any(r.value and r.value.get("error") for r in results if r.rank != victim)
    ):
        tally.violate("split", f"{label}: woke up and reported success while the others failed")
    elif woke.value is not None and woke.value.get("error") is not None:
        reason = unclear_reason(woke.value["error"])
        if reason:
            tally.violate("unclear", f"{label}: the woken rank: {reason}")
        tally.count("woken_error", woke.value["error"]["type"])
    _judge_root(tally, label, root, step, state["big"])


def _frozen_job(
    job: ForkJob,
    cfg: HangSize,
    victim: int,
    freeze: Callable[[], bool],
    others_s: float,
    frozen_s: float = 0.0,
) -> tuple[bool, float, list[Any]]:
    """Run ``job`` until ``freeze()`` froze ``victim`` (False: it could not), give the
    other ranks ``others_s`` to return, keep the victim frozen ``frozen_s`` at least,
    then wake it (SIGCONT). Returns whether it froze, when, and every rank's result."""
    try:
        frozen = freeze()
        t_stop = time.monotonic()
        if frozen:
            job.join([r for r in range(WORLD) if r != victim], others_s)
            time.sleep(max(0.0, t_stop + frozen_s - time.monotonic()))
            job.signal(victim, signal.SIGCONT)
        return frozen, t_stop, job.wait(timeout_s=20 + 3 * cfg.timeout_s)
    finally:
        job.close()


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def _outcome_trial(
    tally: Tally, cfg: HangSize, rng: random.Random, base: str, root: str, state: dict[str, Any]
) -> None:
    tally.trials += 1
    step = _next(state)
    victim = rng.randrange(1, WORLD)
    label = f"rank {victim} frozen at the outcome of the commit"
    job = _save_job(base, cfg, [root] * WORLD, step, {}, frozen_at_outcome=victim)

    def freeze() -> bool:
        pid = job.procs[victim].pid or -1
        deadline = time.monotonic() + 30 + 3 * cfg.timeout_s
        while not _stopped(pid) and job.procs[victim].is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return _stopped(pid)

    # Past the woken rank's own deadline for the exchange, as a long freeze is.
    frozen, _, results = _frozen_job(
        job, cfg, victim, freeze, 20 + 3 * cfg.timeout_s, cfg.timeout_s + STALL_GRACE_S + 1.0
    )
    if not frozen:
        tally.violate("stuck", f"{label}: the rank never reached the outcome")
        return
    tally.faults += 1
    outcomes = _outcomes(tally, label, results)
    if len(set(outcomes)) > 1:
        tally.violate("split", f"{label}: ranks report {outcomes}")
    elif outcomes:
        tally.count("outcome_after_freeze", outcomes[0])
    _judge_root(tally, label, root, step, state["big"])


def _judge_timeouts(
    tally: Tally,
    cfg: HangSize,
    label: str,
    results: list[Any],
    victim: int,
    t_stop: float | None,
) -> None:
    for r in results:
        if r.rank == victim:
            continue
        if r.exitcode is None:
            tally.violate("hangs", f"{label}: rank {r.rank} did not give up")
            continue
        v = r.value
        if r.error is not None or v is None:
            tally.violate("stuck", f"{label}: rank {r.rank} crashed: {r.error_text[-300:]}")
            continue
        if v.get("setup_error"):
            tally.violate("stuck", f"{label}: rank {r.rank} failed before the trial: {v['error']}")
            continue
        if v["error"] is None:
            # Success is right only if the stalled rank had already sent its last
            # message (a frozen rank can stop just after it): then it succeeds too.
            late = results[victim].value
            if late is None or late.get("error") is not None:
                tally.violate(
                    "split", f"{label}: rank {r.rank} saved although rank {victim} stalled"
                )
            else:
                tally.count("stalled_after_its_last_message", "all ranks saved")
            continue
        reason = unclear_reason(v["error"], dead={victim})
        if reason:
            tally.violate("unclear", f"{label}: rank {r.rank}: {reason}")
        elif v["error"]["type"] != "CoordinationTimeoutError":
            tally.violate(
                "unclear", f"{label}: rank {r.rank} raised {v['error']['type']}, not a timeout"
            )
        waited = v["t_end"] - (t_stop if t_stop is not None else v["t_start"])
        tally.stats.setdefault("timeout_seen_s", []).append(round(waited, 3))
        if waited > cfg.timeout_s + SLACK_S:
            tally.violate(
                "hangs",
                f"{label}: rank {r.rank} raised after {waited:.2f} s (timeout {cfg.timeout_s} s)",
            )


def _judge_root(
    tally: Tally, label: str, root: str, step: int, big: dict[int, dict[int, int]]
) -> None:
    """``big``: step -> {rank: tensor elements} of the saves made with bigger states."""
    view = inspect_root(root, world=WORLD, size=lambda s, r: big.get(s, {}).get(r, SIZE))
    for t in view.torn:
        tally.violate("torn", f"{label}: {t}")
    if step - 1 not in view.steps:
        tally.violate(
            "lost", f"{label}: step {step - 1} from before the stall is gone: {view.steps}"
        )
    left, error = next_start_leftovers(root)
    if error:
        tally.violate("stuck", f"{label}: the next start failed: {error}")
    if left:
        tally.violate("leaks", f"{label}: still there after the next start: {left}")


# ------------------------------------------------------------------------ slow storage


@contextlib.contextmanager
def _slow_node(base: str) -> Iterator[tuple[str, str, str]]:
    """(root on the server's disk, the same root through a throttled sshfs mount from
    another namespace, the root's real path)."""
    from tests.testbed import NetnsPair

    with NetnsPair("achang") as pair, pair.sshfs_export(os.path.join(base, "srv")) as exp:
        mnt = exp.mount(os.path.join(base, "slow-mnt"))
        # 4 Mbit/s with a small bucket: a 4 MB rank file takes about 8 s.
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                pair.name("b"),
                "tc",
                "qdisc",
                "add",
                "dev",
                pair.veth,
                "root",
                "tbf",
                "rate",
                "4mbit",
                "burst",
                "16kb",
                "latency",
                "400ms",
            ],
            check=True,
            capture_output=True,
            timeout=10,
        )
        truth = os.path.join(str(exp.export), "root")
        yield truth, os.path.join(str(mnt.path), "root"), truth


def _slow_trial(
    tally: Tally,
    cfg: HangSize,
    base: str,
    fast_root: str,
    slow_root: str,
    truth: str,
    state: dict[str, Any],
) -> None:
    tally.trials += 1
    step = _next(state)
    victim = WORLD - 1
    label = "slow storage under rank 2"
    roots = [fast_root] * (WORLD - 1) + [slow_root]
    sizes = {victim: 1 << 19}
    state["big"][step] = sizes
    job = _save_job(base, cfg, roots, step, sizes)
    try:
        results = job.wait(timeout_s=120)
    finally:
        job.close()
    tally.faults += 1
    _judge_timeouts(tally, cfg, label, results, victim, None)
    slow = results[victim]
    if slow.exitcode is None:
        tally.violate("hangs", f"{label}: the slow rank never finished")
    elif slow.value is not None and slow.value.get("error") is None:
        tally.violate("split", f"{label}: the slow rank reported success")
    elif slow.value is not None:
        tally.stats.setdefault("slow_rank_s", []).append(round(slow.value["elapsed_s"], 2))
        reason = unclear_reason(slow.value["error"])
        if reason:
            tally.violate("unclear", f"{label}: the slow rank: {reason}")
    _judge_root(tally, label, truth, step, state["big"])
