"""Kill campaign: SIGKILL one rank (the coordinator included) in the middle of a job.

Two kinds of trial, alternating:

- **named**: ``ATOMIC_CHECKPOINT_FAULTS=<phase>@<rank>=kill:<step>`` kills the rank at
  an exact protocol phase (every save phase, and the rotation phases
  ``before_uncommit``/``after_uncommit``/``mid_delete`` with ``KeepLast(2)``);
- **random**: the campaign sends SIGKILL to a random rank's pid after a random delay
  while the job starts, saves, commits and rotates in a loop; the rank's progress slot
  says where it landed.

Both kinds alternate between ``save`` and ``save_async`` (snapshot, then write, commit
and rotate on a background thread).

After every trial (see :mod:`reliability.checks`): every discoverable checkpoint
verifies and restores bit-exactly for every rank; the newest checkpoint committed
before the kill, and every step a surviving rank reported as saved, is there; every
survivor raised a clear error naming the dead rank within its timeout (no hang); the
next start removes all pending and trash data; and the next trial's job resumes from the
newest checkpoint and restores it exactly.

On sshfs, ROOT lives in an sshd export mounted twice (default caching): half the ranks
use mount A, half mount B, like two nodes sharing a network filesystem; the checks read
the export directly.

On S3 (``s3``), ROOT is ``s3://<bucket>/root`` on the test bed's S3 server, opened by
every rank through ``FsspecStorage`` (the marker strategy: a crashed save leaves its
attempt and marker under ``checkpoint-<step>/``, not in ``.pending``). On s3fs-fuse
(``s3fs``), the bucket is mounted twice, half the ranks on each mount, and the library
chooses the marker strategy from the mount type. On both, the checks read the bucket
directly through ``FsspecStorage`` (past s3fs's caches), and after the next start every
object must belong to a committed checkpoint or to the run's metadata; what the start
left is counted (``left_for_clean``) and handed to ``atomic-checkpoint clean``, and
anything ``clean`` cannot remove either is a leak.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from atomic_checkpoint._faults import ROTATION_PHASES, SAVE_PHASES

from . import fresh_dir
from .checks import inspect_root, leaks_after_clean, next_start_leftovers, unclear_reason
from .jobs import ForkJob
from .tally import Progress, Tally
from .workers import w_save_loop

#: Phases that only the coordinator passes.
COORDINATOR_ONLY = ("after_manifest", "after_rename", *ROTATION_PHASES)

#: Where a kill landed, from the victim's last progress record.
BUCKETS = {
    "connect": "startup",
    "startup": "startup",
    "resume": "startup",
    "prepare": "prepare",
    "before_write": "write",
    "mid_write": "write",
    "after_write": "commit",
    "after_manifest": "commit",
    "after_rename": "commit",
    "during_broadcast": "commit",
    "before_uncommit": "rotation",
    "after_uncommit": "rotation",
    "mid_delete": "rotation",
    "wait": "commit",
    "close": "close",
}

KEEP_LAST = 2


@dataclass(frozen=True)
class KillSize:
    trials: int
    world: int
    steps_per_trial: int
    tensor_elems: int
    timeout_s: float


SIZES = {
    "local": {
        "quick": KillSize(trials=24, world=3, steps_per_trial=3, tensor_elems=1 << 14, timeout_s=2),
        "full": KillSize(trials=560, world=3, steps_per_trial=3, tensor_elems=1 << 14, timeout_s=2),
    },
    "sshfs": {
        "quick": KillSize(trials=8, world=4, steps_per_trial=2, tensor_elems=1 << 13, timeout_s=4),
        "full": KillSize(trials=120, world=4, steps_per_trial=3, tensor_elems=1 << 14, timeout_s=4),
    },
    "s3": {
        "quick": KillSize(trials=6, world=3, steps_per_trial=2, tensor_elems=1 << 12, timeout_s=4),
        "full": KillSize(trials=120, world=3, steps_per_trial=3, tensor_elems=1 << 14, timeout_s=6),
    },
}
# s3fs-fuse runs on the same S3 server as ``s3``, with four ranks: two per mount.
SIZES["s3fs"] = {name: replace(size, world=4) for name, size in SIZES["s3"].items()}

#: The bucket of the S3 and s3fs-fuse roots.
BUCKET = "kill-campaign"


@dataclass
class _Where:
    """The roots the ranks use, where the checks read, and where the next start runs.

    ``storage_options``: the ranks' fsspec options (URL roots). ``direct``: on object
    stores, a storage reading the bucket itself, for the check of leftover objects;
    ``clean_root``/``clean_options``: what ``atomic-checkpoint clean`` is run on.
    """

    rank_roots: list[str]
    truth: Any
    restart_root: str
    _: KW_ONLY
    storage_options: dict[str, Any] | None = None
    direct: Any = None
    clean_root: str = ""
    clean_options: dict[str, Any] | None = None
    leaked: set[str] = field(default_factory=set, init=False)


def run(size: str, seed: int, progress: Progress, workdir: str, *, fs: str = "local") -> Tally:
    """Run the kill campaign on ``fs`` (``local``, ``sshfs``, ``s3`` or ``s3fs``)."""
    cfg = SIZES[fs][size]
    tally = Tally(f"kill-{fs}")
    rng = random.Random(seed)
    base = fresh_dir(os.path.join(workdir, f"kill-{fs}"))
    if fs == "local":
        root = os.path.join(base, "root")
        _campaign(tally, cfg, rng, progress, base, _Where([root] * cfg.world, root, root))
        return tally.finish()
    if fs in ("s3", "s3fs"):
        _run_s3(tally, cfg, rng, progress, base, fs)
        return tally.finish()
    from tests.testbed import SshfsExport

    with SshfsExport(os.path.join(base, "srv")) as exp:
        mount_a = exp.mount(os.path.join(base, "node-a"))
        mount_b = exp.mount(os.path.join(base, "node-b"))
        half = cfg.world // 2
        roots = [
            os.path.join(str(mount_a.path if r < half else mount_b.path), "root")
            for r in range(cfg.world)
        ]
        truth = os.path.join(str(exp.export), "root")
        _campaign(tally, cfg, rng, progress, base, _Where(roots, truth, roots[0]))
    return tally.finish()


def _run_s3(
    tally: Tally, cfg: KillSize, rng: random.Random, progress: Progress, base: str, fs: str
) -> None:
    """The campaign on ``s3://BUCKET/root`` (``s3``) or on two s3fs-fuse mounts of the
    bucket (``s3fs``), on the test bed's S3 server."""
    from tests.testbed import S3fsFuseMount, S3Server

    from atomic_checkpoint.storage import FsspecStorage

    with S3Server(os.path.join(base, "logs")) as server:
        server.create_bucket(BUCKET)
        opts = server.storage_options()
        url = f"s3://{BUCKET}/root"
        direct = FsspecStorage(url, opts)
        if fs == "s3":
            where = _Where(
                [url] * cfg.world,
                direct,
                url,
                storage_options=opts,
                direct=direct,
                clean_root=url,
                clean_options=opts,
            )
            _campaign(tally, cfg, rng, progress, base, where)
            return
        with contextlib.ExitStack() as stack:
            mounts = [
                stack.enter_context(S3fsFuseMount(server, BUCKET, os.path.join(base, node)))
                for node in ("node-a", "node-b")
            ]
            half = cfg.world // 2
            roots = [
                os.path.join(str(mounts[0 if r < half else 1].path), "root")
                for r in range(cfg.world)
            ]
            # The next start and `clean` run on a mount, as a user's would.
            where = _Where(roots, direct, roots[0], direct=direct, clean_root=roots[0])
            _campaign(tally, cfg, rng, progress, base, where)


def _campaign(
    tally: Tally, cfg: KillSize, rng: random.Random, progress: Progress, base: str, where: _Where
) -> None:
    tmp = os.path.join(base, "jobs")
    os.makedirs(tmp, exist_ok=True)
    next_step = 1
    # Calibration: one job without a fault (it must succeed) gives the loop's duration,
    # over which random kill delays are spread.
    next_step = _trial(tally, cfg, rng, where, tmp, next_step, mode="none")
    duration = max(0.2, tally.stats.pop("last_job_s"))
    tally.stats["job_duration_s"] = round(duration, 2)
    named = [(p, r) for p in SAVE_PHASES for r in ("coordinator", "peer")]
    named = [(p, r) for p, r in named if not (p in COORDINATOR_ONLY and r == "peer")]
    named += [(p, "coordinator") for p in ROTATION_PHASES]
    rng.shuffle(named)  # the quick size then covers a different sample per seed
    for i in range(cfg.trials):
        # Sync and async saves alternate within each kind of trial.
        use_async = (i // 2) % 2 == 1
        random_kill = i % 2 == 1
        if random_kill:
            fault: dict[str, Any] = {"mode": "random", "delay_max": duration}
        else:
            phase, role = named[(i // 2) % len(named)]
            fault = {"mode": "named", "phase": phase, "role": role}
        landed_before = tally.faults
        next_step = _trial(tally, cfg, rng, where, tmp, next_step, use_async=use_async, **fault)
        if random_kill:
            # Keep most random kills inside the job: jobs vary in length (resume work,
            # async saves, machine load), so the window follows what is observed.
            duration = duration * 1.05 if tally.faults > landed_before else duration * 0.8
            duration = min(max(duration, 0.05), 5.0)
        if (i + 1) % max(1, cfg.trials // 10) == 0 or i + 1 == cfg.trials:
            progress(
                f"{tally.name}: {i + 1}/{cfg.trials} trials, {tally.faults} kills landed, "
                f"{tally.violations} violations"
            )
    tally.stats.pop("last_job_s", None)


def _trial(
    tally: Tally,
    cfg: KillSize,
    rng: random.Random,
    where: _Where,
    tmp: str,
    next_step: int,
    *,
    mode: str,
    phase: str = "",
    role: str = "",
    delay_max: float = 0.0,
    use_async: bool = False,
) -> int:
    tally.trials += 1
    before = inspect_root(where.truth, world=cfg.world, size=cfg.tensor_elems)
    steps = list(range(next_step, next_step + cfg.steps_per_trial))
    env: dict[str, str] = {}
    victim: int | None = None
    label = mode
    if mode == "named":
        victim = 0 if role == "coordinator" else rng.randrange(1, cfg.world)
        j = rng.randrange(len(steps))
        at = steps[j]
        if phase in ROTATION_PHASES:
            # KeepLast(2): saving the step at index i of (committed + steps) deletes the
            # one at index i - 2; aim at the deletion that the j-th save triggers.
            chain = before.steps + steps
            idx = len(before.steps) + j
            at = chain[idx - 2] if idx >= 2 else chain[0]
        env["ATOMIC_CHECKPOINT_FAULTS"] = f"{phase}@{victim}=kill:{at}"
        label = f"named {phase}@{victim}:{at}"
    job = ForkJob(
        w_save_loop,
        cfg.world,
        where.rank_roots,
        steps,
        cfg.tensor_elems,
        cfg.timeout_s,
        KEEP_LAST,
        use_async,
        where.storage_options,
        tmp_dir=tmp,
        env=env,
    )
    landed: str | None = None
    try:
        started = job.wait_started()
        t_ready = time.monotonic()
        if mode == "random" and started:
            time.sleep(rng.uniform(0.0, delay_max))
            victim = rng.randrange(cfg.world)
            landed = job.kill(victim)
            label = f"random kill of rank {victim} at {landed}"
        # Survivors must give up within their timeouts; the bound is generous.
        results = job.wait(timeout_s=30 + cfg.timeout_s * (cfg.steps_per_trial + 3))
        tally.stats["last_job_s"] = round(time.monotonic() - t_ready, 3)
    finally:
        job.close()
    dead = {r.rank for r in results if r.exitcode == -signal.SIGKILL}
    if mode == "named" and victim in dead:
        landed = phase
    hit = victim in dead and landed not in (None, "finished", "idle")
    label += " (save_async)" if use_async else ""
    if hit:
        tally.faults += 1
        tally.count("save_kind", "async" if use_async else "sync")
        tally.count("landed", BUCKETS.get(landed or "", landed or "?"))
        tally.count("victim", "coordinator" if victim == 0 else "peer")
    elif mode != "none":
        tally.count("missed", f"{mode} ({landed})")
    _judge(tally, cfg, where, label, before, steps, results, dead)
    return max(steps) + 1


def _judge(
    tally: Tally,
    cfg: KillSize,
    where: _Where,
    label: str,
    before: Any,
    steps: list[int],
    results: list[Any],
    dead: set[int],
) -> None:
    acked: set[int] = set()
    for r in results:
        if r.exitcode is None:
            tally.violate("hangs", f"{label}: rank {r.rank} still running at the deadline")
            continue
        if r.rank in dead:
            continue
        if r.error is not None or r.exitcode != 0:
            tally.violate("unclear", f"{label}: rank {r.rank} crashed: {r.error_text[-300:]}")
            continue
        v = r.value
        acked.update(v["done"])
        if v["restored"] is False:
            tally.violate("torn", f"{label}: rank {r.rank} resumed step {v['latest']} inexactly")
        if before.newest is not None and v["latest"] is not None and v["latest"] != before.newest:
            tally.violate(
                "lost",
                f"{label}: rank {r.rank} resumed step {v['latest']}, newest is {before.newest}",
            )
        if v["error"] is not None:
            if not dead:
                tally.violate("stuck", f"{label}: rank {r.rank} failed with no fault: {v['error']}")
                continue
            reason = unclear_reason(v["error"], dead=dead)
            if reason:
                tally.violate("unclear", f"{label}: rank {r.rank}: {reason}")
            tally.count("survivor_error", v["error"]["type"])
        elif dead and v["done"] == steps:
            tally.count("survivor_finished", "all steps")
    after = inspect_root(where.truth, world=cfg.world, size=cfg.tensor_elems)
    for problem in after.torn:
        tally.violate("torn", f"{label}: {problem}")
    required = max([s for s in [before.newest, *acked] if s is not None], default=None)
    if required is not None and required not in after.steps:
        tally.violate("lost", f"{label}: step {required} is gone; found {after.steps}")
    window = after.steps[-KEEP_LAST:]
    for s in sorted(acked):
        if s not in after.steps and (not window or s > window[0]):
            tally.violate("split", f"{label}: step {s} was reported saved but is not committed")
    for s in after.steps:
        if s not in before.steps and s not in steps:
            tally.violate("torn", f"{label}: step {s} appeared from nowhere")
    if len(after.steps) > KEEP_LAST + 1:
        tally.count("over_retention", str(len(after.steps)))
    if after.orphans:
        tally.violate(
            "leaks", f"{label}: checkpoint directories without a manifest: {after.orphans}"
        )
    left, error = next_start_leftovers(where.restart_root, where.storage_options)
    if error:
        tally.violate("stuck", f"{label}: the next start failed: {error}")
    if left:
        tally.violate("leaks", f"{label}: still there after the next start: {left}")
    if (after.killed_writes or after.killed_deletes) and not error:
        # A kill inside a marker or manifest write leaves its temporary file, and one
        # between a delete's last marker and its rmdir an empty directory: the next
        # start (its sweep) must have removed them.
        again = inspect_root(where.truth, world=cfg.world, size=cfg.tensor_elems)
        if after.killed_writes:
            tally.count("killed_write_left", str(len(after.killed_writes)))
            still = [n for n in after.killed_writes if n in again.killed_writes]
            if still:
                tally.violate("leaks", f"{label}: temporary files outlived the next start: {still}")
        if after.killed_deletes:
            tally.count("killed_delete_left", str(len(after.killed_deletes)))
            still = [n for n in after.killed_deletes if n in again.killed_deletes]
            if still:
                tally.violate(
                    "leaks",
                    f"{label}: empty checkpoint directories outlived the next start: {still}",
                )
    if where.direct is not None and not error:
        leaks_after_clean(
            tally, label, where.direct, where.leaked, where.clean_root, where.clean_options
        )
