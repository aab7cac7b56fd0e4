"""Tiered campaign: one fault in a real multi-rank tiered job, then a restart, checked
from the outside.

Each trial runs a real job (1 to 3 ranks, each a separate process and its own "node":
its own host name and its own tier 0 directory) with ``TieredCheckpointManager``: tier
1, the persistent tier, is a local directory (standing in for NFS or sshfs) or a prefix
on the real S3 server (moto, reached through the fault-injecting proxy of
``tests/testbed/s3proxy.py``); with two or more ranks, half the jobs keep peer replicas
(``peers=1``). The job saves a few steps, waiting a random while for replication
between them, and ONE fault is injected at a random moment:

- **kill-phase**: SIGKILL of a random rank at a named fault point (a save phase, a
  rotation phase of either tier, ``mid_replicate`` or ``before_replica_commit`` on the
  replicator thread) of a random step (``ATOMIC_CHECKPOINT_FAULTS``);
- **kill-random**: SIGKILL of a random rank after a random delay (its progress slot
  says where it landed);
- **replicator**: the replicator raises (an injected EIO) at ``mid_replicate`` or
  ``before_replica_commit``, for one step or for every attempt;
- **wipe-live**: one node's tier 0 is wiped between two steps while the job runs;
- **wipe-restart**: one node's tier 0 is wiped after the job ended (a replaced node);
- **disk-full**: one node's tier 0 is a tmpfs of 1 or 2 MiB that the steps overflow;
- **link-cut** / **link-stall**: the link to the S3 server fails (503s, cut
  connections) or stalls (every request held) for a random window, or until the job
  ends.

Then the job is restarted on the same nodes (single-rank jobs: half the time
``atomic-checkpoint drain`` runs first). The restart restores the newest step every rank
agrees on, saves one more step and waits for its replication.

Checked after the faulted job and after the restart (on every node's tier 0, every peer
copy and tier 1, read directly):

- **torn**: every checkpoint visible on any tier verifies and restores bit-exactly,
  each rank's file; the restart's ranks restore their state bit-exactly;
- **lost**: every step acknowledged as persisted (``on_commit(1, ...)``) is on tier 1,
  or tier 1 holds ``KEEP`` newer steps (its retention); the step the restart restores
  is at least the newest persisted step, the newest step every rank's ``save`` returned
  (unless a wipe destroyed that node's copy: then the newest step the wiped node heard
  was on its peers, ``peer_recoverable``, before the wipe); once the restart's
  replication drained, every step every rank's ``save`` returned (those a wipe
  destroyed aside) is on tier 1 or superseded there, i.e. tier 0's retention never
  dropped a step tier 1 had not received;
- **hangs**: every process (the job's ranks, ``drain``, the restart's ranks) ends
  within its bound;
- **stuck**: the restart fails (restore or the new save), except a save onto the tier 0
  that is still full; ``drain`` fails.

Sizes: ``quick`` (CI) runs 7 trials, every kind once (one of the two link faults),
jobs of 1 or 2 ranks, tier 1 a directory except for the link fault; ``full`` runs 300
trials, jobs of 1 to 3 ranks, tier 1 on S3 for the link faults and 15 % of the others.

Counts: faults by kind (``by_fault``), where kills landed (``landed``), the persistent
tier (``by_tier``), the job sizes (``by_world``) and what missed (``missed``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from atomic_checkpoint._faults import ROTATION_PHASES, SAVE_PHASES

from . import run_module
from .jobs import ForkJob, install_fault_hook, mark
from .tally import Progress, Tally

KINDS = (
    "kill-phase",
    "kill-random",
    "replicator",
    "wipe-live",
    "wipe-restart",
    "disk-full",
    "link-cut",
    "link-stall",
)
REPLICATION_PHASES = ("mid_replicate", "before_replica_commit")
COORDINATOR_ONLY = ("after_manifest", "after_rename", "before_replica_commit", *ROTATION_PHASES)
#: Tier 1 keeps the newest KEEP steps; tier 0 the newest one (and every step not yet
#: on tier 1).
KEEP = 3
ELEMS = 4096
#: Coordination timeout of the managers, and process-group timeout of the jobs.
TIMEOUT_S = 5.0
#: A job (faulted or restarted) whose ranks have not all ended after this long hangs.
JOB_BOUND_S = 90.0
DRAIN_BOUND_S = 60.0
BUCKET = "tiered"


@dataclass(frozen=True)
class TieredSize:
    trials: int
    #: share of the trials whose persistent tier is S3 (link faults always are)
    s3_share: float
    #: how many ranks a job may have
    worlds: tuple[int, ...] = (1, 2, 3)
    #: the most steps a job saves (at least 3)
    max_steps: int = 5
    #: one link fault per round of kinds, cut or stall (each costs a restart on S3)
    one_link: bool = False


SIZES = {
    "quick": TieredSize(trials=7, s3_share=0.0, worlds=(1, 2), max_steps=3, one_link=True),
    "full": TieredSize(trials=300, s3_share=0.15, max_steps=4),
}


# ---------------------------------------------------------------------- in the ranks
def _ack(path: str, line: str) -> None:
    """One line of this rank's record (one ``write``: it survives the rank's SIGKILL)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def w_job(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the job: its node's manager over tier 0 (``cfg["fast"][rank]``) and
    tier 1 (``cfg["slow"]``). ``cfg["phase"]``: ``"job"`` saves ``cfg["steps"]``
    (wiping its tier 0 after ``cfg["wipe"]`` if it names this rank); ``"restart"``
    restores the newest agreed step, checks it bit-exactly and saves ``cfg["next"]``.
    Everything acknowledged goes to ``cfg["acks"]/rank<r>.<phase>`` as it happens."""
    from tests.dist.workers import make_state, states_equal

    from atomic_checkpoint import CheckpointError, KeepLast, Tier, TieredCheckpointManager
    from atomic_checkpoint.domains import HOST_ENV

    os.environ[HOST_ENV] = f"node{rank}"
    mark("job")  # the harness is done: this rank runs the job
    acks = os.path.join(cfg["acks"], f"rank{rank}.{cfg['phase']}")
    spec = cfg.get("raise")
    if spec is not None:  # the replicator's injected failure, recorded when it fires

        def fired(phase: str, r: int, step: int | None) -> None:
            mark(phase)  # the progress slot, as the launcher's own hook does
            if phase == spec[0] and str(r) == spec[1] and spec[2] in (None, step):
                _ack(acks, f"fired {phase} {step}")

        install_fault_hook(fired)

    def on_commit(tier: int, info: Any) -> None:
        _ack(acks, f"{'persisted' if tier else 'committed'} {info.step}")

    if cfg["opts"] is not None:
        import s3fs

        # s3fs' own retry loop (5 attempts with back-off, on top of botocore's) would
        # stretch every request over a cut link to seconds: one retry, as in the tests.
        s3fs.S3FileSystem.retries = 1
    fast = cfg["fast"][rank]
    mgr = TieredCheckpointManager(
        [
            Tier(fast, retention=KeepLast(1)),
            Tier(cfg["slow"], retention=KeepLast(KEEP), storage_options=cfg["opts"]),
        ],
        on_commit=on_commit,
        timeout_s=TIMEOUT_S,
        retry_max_s=0.2,
        fast_domains="per-host",
        peers=cfg["peers"],
    )
    out: dict[str, Any] = {}
    elems = cfg["elems"]
    rng = random.Random(cfg["seed"] * 10 + rank)

    def peer_safe() -> None:
        safe = mgr.peer_recoverable() if cfg["peers"] else []
        if safe:
            _ack(acks, f"peersafe {max(safe)}")

    if cfg["phase"] == "restart":
        try:
            latest = mgr.latest()
            out["latest"] = None if latest is None else latest.step
            if latest is not None:
                state = mgr.restore()
                got = mgr.last_restored
                assert got is not None  # set by every restore that returns
                out["restored"] = got.step
                out["exact"] = states_equal(state, make_state(got.step, rank, big_elems=elems))
        except CheckpointError as exc:
            out["restore_error"] = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                mgr.close(timeout_s=1)
            return out
        steps = [cfg["next"]]
    else:
        steps = cfg["steps"]
    try:
        for s in steps:
            mgr.save(s, make_state(s, rank, big_elems=elems))
            _ack(acks, f"saved {s}")
            peer_safe()
            if cfg["phase"] == "job" and cfg.get("wipe") == [s, rank]:
                _ack(acks, f"wiped {s}")
                # At once, as a replaced disk: renamed away, then removed (a plain
                # rmtree would race this manager's own rotation and replication).
                os.rename(fast, fast + ".wiped")
                os.makedirs(fast)
                shutil.rmtree(fast + ".wiped", ignore_errors=True)
            if cfg["phase"] == "job" and rng.random() < 0.5:
                mgr.wait_replicated(timeout_s=rng.uniform(0, 1.5))
        out["replicated"] = mgr.wait_replicated(timeout_s=cfg["wait_s"])
        peer_safe()
    except CheckpointError as exc:
        out["save_error"] = f"{type(exc).__name__}: {exc}"
    try:
        out["left"] = mgr.close(timeout_s=cfg["close_s"])
    except CheckpointError as exc:
        out["close_error"] = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------- the campaign
def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    cfg = SIZES[size]
    tally = Tally("tiered")
    camp = _Campaign(tally, random.Random(seed), os.path.join(workdir, "tiered"), seed)
    try:
        # Every kind in turn (shuffled per round), so a quick run covers them all.
        order: list[str] = []
        while len(order) < cfg.trials:
            chunk = list(KINDS)
            if cfg.one_link:
                chunk.remove(camp.rng.choice(("link-cut", "link-stall")))
            camp.rng.shuffle(chunk)
            order += chunk
        for i, kind in enumerate(order[: cfg.trials]):
            camp.trial(i, kind, cfg)
            if (i + 1) % 10 == 0 or i + 1 == cfg.trials:
                progress(
                    f"tiered: {tally.trials} trials, {tally.faults} faults, "
                    f"{tally.violations} violations"
                )
    finally:
        camp.close()
    return tally.finish()


class _Campaign:
    def __init__(self, tally: Tally, rng: random.Random, base: str, seed: int):
        self.tally = tally
        self.rng = rng
        self.base = base
        self.seed = seed
        os.makedirs(base, exist_ok=True)
        self._stack = contextlib.ExitStack()
        self.server: Any = None
        self.proxy: Any = None
        # How long a clean job runs once its ranks started, learned as it goes: where a
        # random kill may land.
        self.job_s = {1: 0.6, 2: 1.0, 3: 1.4}
        self._tmpfs: bool | None = None

    def close(self) -> None:
        self._stack.close()

    def s3(self) -> tuple[Any, Any]:
        if self.server is None:
            from tests.testbed.s3 import S3Server
            from tests.testbed.s3proxy import S3Proxy

            self.server = self._stack.enter_context(S3Server(os.path.join(self.base, "s3")))
            self.server.create_bucket(BUCKET)
            self.proxy = self._stack.enter_context(S3Proxy(self.server, lifetime_s=4 * 3600))
        return self.server, self.proxy

    def tmpfs_ok(self) -> bool:
        if self._tmpfs is None:
            from tests.testbed.probes import tmpfs_available

            self._tmpfs = tmpfs_available()[0]
        return self._tmpfs

    # -------------------------------------------------------------- one trial
    def trial(self, i: int, kind: str, cfg: TieredSize) -> None:
        rng, tally = self.rng, self.tally
        if kind == "disk-full" and not self.tmpfs_ok():
            tally.count("missed", "disk-full (tmpfs cannot be mounted here)")
            return
        world = rng.choice(cfg.worlds)
        peers = 1 if world > 1 and rng.random() < 0.5 else 0
        on_s3 = kind.startswith("link") or rng.random() < cfg.s3_share
        root = os.path.join(self.base, f"t{i}")
        acks = os.path.join(root, "acks")
        os.makedirs(acks)
        fast = [os.path.join(root, f"node{r}") for r in range(world)]
        victim = rng.randrange(world)
        steps = list(range(1, rng.randint(3, cfg.max_steps) + 1))
        elems = ELEMS
        disk: Any = None
        if kind == "disk-full":
            from tests.testbed.disk import SmallDisk

            # 0.4 to 0.7 MiB per rank and step on a tmpfs of 1 MiB (or 2 for the
            # largest): tier 0 holds one step and part of a second (more with
            # peer copies and replication behind) before it is full.
            elems = rng.choice((50_000, 65_536, 90_000))
            disk = SmallDisk(root, 1 if elems < 90_000 else rng.choice((1, 2)))
            disk.start()
            fast[victim] = str(disk.path)
        if on_s3:
            _server, proxy = self.s3()
            slow = f"s3://{BUCKET}/t{i}"
            opts: dict[str, Any] | None = proxy.storage_options(max_attempts=1)
        else:
            slow, opts = os.path.join(root, "persistent"), None
        job: dict[str, Any] = {
            "fast": fast,
            "slow": slow,
            "opts": opts,
            "acks": acks,
            "peers": peers,
            "elems": elems,
            "seed": self.seed * 100_000 + i,
            "steps": steps,
            "phase": "job",
            "wait_s": rng.choice((0.0, 1.0, 3.0)),
            "close_s": 2.0,
        }
        env: dict[str, str] = {}
        label = f"{kind} world {world} peers {peers} on {'s3' if on_s3 else 'dir'}"
        rule: Any = None
        if kind == "kill-phase":
            phase = rng.choice(SAVE_PHASES + ROTATION_PHASES + REPLICATION_PHASES * 4)
            who = 0 if phase in COORDINATOR_ONLY else victim
            step = rng.choice(steps)
            env["ATOMIC_CHECKPOINT_FAULTS"] = f"{phase}@{who}=kill:{step}"
            victim = who
            label += f": kill rank {who} at {phase} of step {step}"
        elif kind == "replicator":
            phase = rng.choice(REPLICATION_PHASES)
            who = 0 if phase in COORDINATOR_ONLY else victim
            one: int | None = rng.choice(steps) if rng.random() < 0.5 else None
            env["ATOMIC_CHECKPOINT_FAULTS"] = f"{phase}@{who}=raise" + (
                f":{one}" if one is not None else ""
            )
            job["raise"] = [phase, str(who), one]
            label += f": replicator of rank {who} raises at {phase} of step {one or 'every'}"
        elif kind == "wipe-live":
            job["wipe"] = [rng.choice(steps[:-1]), victim]
            label += f": node {victim} wiped after step {job['wipe'][0]}"
        elif kind == "wipe-restart":
            label += f": node {victim} wiped before the restart"
        elif kind.startswith("link"):
            rule, window = self._link_rule(kind)
            label += f": {rule.action} {window}"
        self.tally.trials += 1
        self.tally.count("by_world", str(world))
        self.tally.count("by_tier", "s3" if on_s3 else "dir")
        try:
            self._run_trial(i, kind, label, job, env, world, victim, rule, disk)
        finally:
            if self.proxy is not None:
                self.proxy.clear()
            if disk is not None:
                disk.close()
            shutil.rmtree(root, ignore_errors=True)

    def _link_rule(self, kind: str) -> tuple[Any, str]:
        """The proxy's rule for a link fault: from a random moment of the job, for a
        random while or until the job ends (the restart sees the link back)."""
        from tests.testbed.s3proxy import Rule

        start = self.rng.uniform(0, 2.0)
        length = self.rng.choice((0.5, 1.5, 3.0) if kind == "link-stall" else (0.5, 2.0, None))
        first: list[float] = []

        def window(_req: Any) -> bool:
            # Counted from the job's first request to tier 1, not from process start-up
            # (seconds on a busy machine, S3 client imports included).
            if not first:
                first.append(time.monotonic())
            dt = time.monotonic() - first[0]
            return dt >= start and (length is None or dt < start + length)

        if kind == "link-stall":
            rule = Rule("delay", delay_s=self.rng.choice((0.3, 1.0)), times=None, when=window)
        else:
            action = self.rng.choice(("error", "cut"))
            rule = Rule(action, status=503, times=None, when=window)
        end = "the end of the job" if length is None else f"{start + length:.1f} s"
        return rule, f"from {start:.1f} s to {end} after the job's first request"

    def _run_trial(
        self,
        i: int,
        kind: str,
        label: str,
        job: dict[str, Any],
        env: dict[str, str],
        world: int,
        victim: int,
        rule: Any,
        disk: Any,
    ) -> None:
        tally, rng = self.tally, self.rng
        tmp = os.path.dirname(job["acks"])
        if rule is not None:
            rule = self.proxy.add(rule)
        t0 = time.monotonic()
        fj = ForkJob(w_job, world, job, tmp_dir=tmp, env=env, pg_timeout_s=TIMEOUT_S * 2)
        landed = None
        started = None
        try:
            if fj.wait_started():
                started = time.monotonic()
            if kind == "kill-random" and started is not None:
                time.sleep(rng.uniform(0, 0.8 * self.job_s[world]))
                landed = fj.kill(victim)
            results = fj.wait(JOB_BOUND_S)
        finally:
            fj.close()
        took = time.monotonic() - (started or t0)
        if rule is not None:
            self.proxy.clear()  # the link is back for the restart
        for r in results:
            if r.exitcode is None:
                tally.violate("hangs", f"{label}: rank {r.rank} of the job: {r.error_text[-300:]}")
            elif r.killed:
                tally.count("job_ended", "killed")
            elif r.error is not None:
                # The fault may fail the job (a dead rank, a tier 0 that is full, a
                # persistent tier that cannot be read at start): an outcome, not a
                # violation; the restart must cope.
                tally.count("job_ended", f"raised {type(r.error).__name__}")
            else:
                v = r.value or {}
                tally.count("job_ended", "save failed" if "save_error" in v else "returned")
        values = [r.value or {} for r in results]
        hit = self._hit(kind, job, results, values, victim, landed, rule, label)
        if not hit and all(r.ok for r in results) and not any("save_error" in v for v in values):
            self.job_s[world] = 0.8 * self.job_s[world] + 0.2 * took
        if hit:
            tally.faults += 1
            tally.count("by_fault", kind)
        else:
            tally.count("missed", kind)
        acks = self._acks(job["acks"], world, "job")
        self._check_tiers(f"{label} (after the fault)", job, world)
        self._check_persisted(f"{label} (after the fault)", job, acks["persisted"])

        if kind == "wipe-restart":
            shutil.rmtree(job["fast"][victim])
            os.makedirs(job["fast"][victim])
        if world == 1 and rng.random() < 0.5:
            self._drain(label, job)
        restart = dict(job, phase="restart", next=max(job["steps"]) + 1, wait_s=20.0, close_s=10.0)
        restart.pop("raise", None)
        restart.pop("wipe", None)
        if job["opts"] is not None:
            restart["opts"] = self.proxy.storage_options(max_attempts=1)
        fj = ForkJob(w_job, world, restart, tmp_dir=tmp, pg_timeout_s=TIMEOUT_S * 2, watch=False)
        try:
            again = fj.wait(JOB_BOUND_S)
        finally:
            fj.close()
        self._judge_restart(label, kind, job, again, acks, victim, disk)
        after = self._acks(job["acks"], world, "restart")
        self._check_tiers(f"{label} (after the restart)", job, world)
        self._check_persisted(
            f"{label} (after the restart)", job, acks["persisted"] | after["persisted"]
        )
        if all(r.ok and r.value.get("replicated") for r in again):
            # The restart's replication drained: every step held on tier 0 reached tier
            # 1 (a wipe destroys the steps up to it on the wiped node: not owed).
            wiped = acks["wiped"][1] if acks["wiped"] else 0
            if kind == "wipe-restart":
                wiped = max(job["steps"])
            held = {s for s in acks["saved"] if s > wiped} | after["saved"]
            self._check_persisted(f"{label} (after the restart, drained)", job, held)
        else:
            tally.count("restart_not_drained", kind)
        took = round(time.monotonic() - t0, 1)
        tally.stats.setdefault("trial_s", []).append(took)
        tally.count("seconds_by_fault", kind, round(took))

    def _hit(
        self,
        kind: str,
        job: dict[str, Any],
        results: list[Any],
        values: list[dict[str, Any]],
        victim: int,
        landed: str | None,
        rule: Any,
        label: str,
    ) -> bool:
        """Did the fault reach the library?"""
        if kind == "kill-random":
            if landed is None or landed in ("finished",):
                return False
            self.tally.count("landed", landed.split(":")[-1].strip() or "?")
            return results[victim].killed
        if kind == "kill-phase":
            if results[victim].killed:
                self.tally.count("landed", job_phase(label))
                return True
            return False
        if kind == "replicator":
            return any(
                "fired " in _read(os.path.join(job["acks"], f"rank{r}.job"))
                for r in range(len(results))
            )
        if kind == "wipe-live":
            return any(
                "wiped " in _read(os.path.join(job["acks"], f"rank{r}.job"))
                for r in range(len(results))
            )
        if kind == "wipe-restart":
            return True
        if kind == "disk-full":
            texts = " ".join(
                str(v.get(k, "")) for v in values for k in ("save_error", "close_error")
            ) + " ".join(r.error_text for r in results)
            return "No space" in texts or "ENOSPC" in texts or "disk is full" in texts
        return rule is not None and rule.fired > 0

    def _acks(self, acks_dir: str, world: int, phase: str) -> dict[str, Any]:
        """What the ranks acknowledged: ``persisted`` (tier 1 commits, rank 0),
        ``saved`` (the steps every rank's save returned), per rank ``wiped`` and the
        newest ``peersafe`` step heard before a wipe."""
        saved: list[set[int]] = []
        out: dict[str, Any] = {"persisted": set(), "peersafe": 0, "wiped": None}
        for r in range(world):
            mine: set[int] = set()
            wiped = None
            for line in _read(os.path.join(acks_dir, f"rank{r}.{phase}")).splitlines():
                what, _, arg = line.partition(" ")
                if what == "persisted":
                    out["persisted"].add(int(arg))
                elif what == "saved":
                    mine.add(int(arg))
                elif what == "wiped":
                    wiped = int(arg)
                    out["wiped"] = (r, wiped, set(mine))
                elif what == "peersafe" and wiped is None:
                    out["peersafe"] = max(out["peersafe"], int(arg))
            saved.append(mine)
        out["saved"] = set.intersection(*saved) if saved else set()
        return out

    def _drain(self, label: str, job: dict[str, Any]) -> None:
        """``atomic-checkpoint drain`` of the single node, as a user runs it after the
        job; it must end within its bound (its outcome is counted: a drain that finds
        the link or the tier still bad says so and leaves the steps on tier 0)."""
        opts = None if job["opts"] is None else self.proxy.storage_options(max_attempts=1)
        try:
            proc = _drain_cli(job["fast"][0], job["slow"], opts)
        except subprocess.TimeoutExpired:
            self.tally.violate("hangs", f"{label}: drain did not end in {DRAIN_BOUND_S:g} s")
            return
        self.tally.count("drain", f"rc {proc.returncode}")
        if proc.returncode:
            why = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            self.tally.violate("stuck", f"{label}: drain failed: {why[-1:]}")

    # -------------------------------------------------------------- checks
    def _slow_storage(self, job: dict[str, Any]) -> Any:
        from atomic_checkpoint.storage import FsspecStorage
        from atomic_checkpoint.storage.local import LocalStorage

        if job["opts"] is None:
            return LocalStorage(job["slow"]) if os.path.isdir(job["slow"]) else None
        return FsspecStorage(job["slow"], self.server.storage_options())

    def _check_tiers(self, label: str, job: dict[str, Any], world: int) -> list[int]:
        """Torn: everything visible on every tier verifies and restores bit-exactly.
        Returns the steps tier 1 holds."""
        from atomic_checkpoint.storage.local import LocalStorage

        for r, fast in enumerate(job["fast"]):
            if not os.path.isdir(fast):
                continue
            _check_root(self.tally, f"{label}: node {r}", LocalStorage(fast), job["elems"], None)
            peers = os.path.join(fast, ".peers")
            if os.path.isdir(peers):
                for name in sorted(os.listdir(peers)):
                    _check_root(
                        self.tally,
                        f"{label}: node {r}'s peer copy {name}",
                        LocalStorage(os.path.join(peers, name)),
                        job["elems"],
                        None,
                    )
        slow = self._slow_storage(job)
        if slow is None:
            return []
        return _check_root(self.tally, f"{label}: tier 1", slow, job["elems"], world)

    def _check_persisted(self, label: str, job: dict[str, Any], persisted: set[int]) -> None:
        """Lost: a step acknowledged on tier 1 (or, once replication drained, held on
        tier 0) is on tier 1, unless tier 1 holds KEEP newer ones (its own retention
        dropped it)."""
        if not persisted:
            return
        slow = self._slow_storage(job)
        on_slow = set() if slow is None else _valid_steps(slow)
        for s in sorted(persisted):
            if s not in on_slow and len([x for x in on_slow if x > s]) < KEEP:
                self.tally.violate(
                    "lost", f"{label}: step {s} is owed on tier 1, which holds {sorted(on_slow)}"
                )

    def _judge_restart(
        self,
        label: str,
        kind: str,
        job: dict[str, Any],
        results: list[Any],
        acks: dict[str, Any],
        victim: int,
        disk: Any,
    ) -> None:
        tally = self.tally
        # The newest step the restart must restore, at least.
        owed = max(acks["persisted"], default=0)
        if kind == "wipe-restart":
            owed = max(owed, acks["peersafe"])
        elif acks["wiped"] is not None:
            _r, w, _before = acks["wiped"]
            owed = max(owed, acks["peersafe"], max((s for s in acks["saved"] if s > w), default=0))
        else:
            owed = max(owed, max(acks["saved"], default=0))
        restored = set()
        for r in results:
            where = f"{label}: rank {r.rank} of the restart"
            if r.exitcode is None:
                tally.violate("hangs", f"{where}: {r.error_text[-300:]}")
                return
            if not r.ok:
                tally.violate("stuck", f"{where} failed: {r.error_text[-500:]}")
                return
            v = r.value
            if "restore_error" in v:
                tally.violate("lost" if owed else "stuck", f"{where}: {v['restore_error']}")
                return
            if v.get("exact") is False:
                tally.violate("torn", f"{where} restored step {v['restored']} inexactly")
            restored.add(v.get("restored"))
            if "save_error" in v and disk is None:
                tally.violate("stuck", f"{where}: the next save failed: {v['save_error']}")
            elif "save_error" in v:
                tally.count("restart_save_failed", "disk still full")
        if len(restored) != 1:
            tally.violate("torn", f"{label}: the ranks restored different steps {restored}")
            return
        [got] = restored
        if owed and (got is None or got < owed):
            tally.violate(
                "lost", f"{label}: the restart restored step {got}, step {owed} was acknowledged"
            )
        tally.count("restored_from", "none" if got is None else "a step")


def job_phase(label: str) -> str:
    return label.split(" at ", 1)[1].split(" of ", 1)[0] if " at " in label else "?"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _valid_steps(storage: Any) -> set[int]:
    from atomic_checkpoint import catalog

    return {e.step for e in catalog.scan(storage) if e.status == "ok" and e.step is not None}


def _check_root(tally: Tally, label: str, storage: Any, elems: int, world: int | None) -> list[int]:
    """Every checkpoint visible on ``storage`` verifies and each rank file it lists
    restores bit-exactly; ``world``: every rank's file must be listed (tier 1)."""
    from tests.dist.workers import make_state, states_equal

    from atomic_checkpoint import catalog
    from atomic_checkpoint.layout import checkpoint_name, rank_state_file
    from atomic_checkpoint.serialization import load_state

    steps = []
    for e in catalog.scan(storage):
        if e.status == "corrupt":
            tally.violate("torn", f"{label}: {e.name}: {e.problem}")
            continue
        if e.status != "ok" or e.step is None or e.manifest is None:
            continue
        name = checkpoint_name(e.step)
        try:
            catalog.validate(storage, name, e.manifest, full=True)
        except Exception as exc:
            tally.violate("torn", f"{label}: {name} does not verify: {exc}")
            continue
        ranks = {}
        for f in e.manifest.files:
            for r in range(e.manifest.world_size):
                if f.path.rsplit("/", 1)[-1] == rank_state_file(r):
                    ranks[r] = f.path
        if world is not None and sorted(ranks) != list(range(world)):
            tally.violate("torn", f"{label}: {name} lists the files of ranks {sorted(ranks)}")
            continue
        for r, path in sorted(ranks.items()):
            try:
                with storage.open_read(f"{name}/{path}") as fh:
                    got = load_state(fh)
            except Exception as exc:
                tally.violate("torn", f"{label}: {name} rank {r} does not load: {exc}")
                continue
            if not states_equal(got, make_state(e.step, r, big_elems=elems)):
                tally.violate("torn", f"{label}: {name} rank {r} restores another state")
        steps.append(e.step)
    return sorted(steps)


def _drain_cli(fast: str, slow: str, opts: dict[str, Any] | None) -> subprocess.CompletedProcess:
    """``atomic-checkpoint drain FAST --to SLOW --missing-ok`` as a user's end-of-job
    script runs it on every node, bounded (a kill before the job's first save leaves no
    tier 0: nothing to drain there, exit 0)."""
    import json

    from atomic_checkpoint.domains import HOST_ENV

    argv = ["drain", fast, "--to", slow, "--missing-ok"]
    for k, v in (opts or {}).items():
        argv.append(f"--to-storage-option={k}={json.dumps(v)}")
    env = dict(os.environ)
    env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    # On the node itself (its host name, as the job's rank 0 had): there the dead job's
    # run lock is known to be free (its pid is gone).
    env[HOST_ENV] = "node0"
    return run_module("atomic_checkpoint", *argv, timeout_s=DRAIN_BOUND_S, env=env)
