"""I/O fault campaign with libfiu: real errnos from real syscalls on one chosen rank.

Every rank of a 3-rank job runs as its own process under ``fiu-run -x`` (libfiu's
POSIX wrappers) plus ``fiu_extra.so`` (built here from ``fiu_extra.c``: the directory
calls libfiu does not wrap, and hit counting). A trial arms one failure point on one
rank, the coordinator or a peer, at one phase of the protocol:

====================  =====================================================
phase                 armed
====================  =====================================================
startup               before ``CheckpointManager()`` (lock, sweep, scan)
prepare               before ``save()`` (fence, pending directory)
before_write ...      at the library's named fault point of that phase
during_broadcast      (save phases, see ``atomic_checkpoint._faults``)
before_uncommit ...   at the rotation fault points (``KeepLast(2)``)
restore               before ``restore()`` of the newest checkpoint
====================  =====================================================

with one errno (ENOSPC, EIO, EDQUOT, EROFS), transient (``onetime``: the next call
fails, then the point disables itself) or persistent (every call fails until the trial
disarms it). Points: ``write``, ``fsync``, ``rename`` (also renameat/renameat2),
``open`` (also openat), ``mkdir`` (mkdir/mkdirat), ``unlink`` (also unlinkat/rmdir).

On s3fs-fuse (``libfiu-s3fs``), ROOT is a directory on an s3fs-fuse mount of a bucket
of the test bed's S3 server, and the library chooses the marker strategy from the mount
type: the faults fail the rank's own libc calls on the FUSE mount (an ``open``, ``write``,
``fsync``, ``rename`` or ``unlink`` of a marker, a data file or a manifest), before s3fs
sees them. The checks read the bucket directly (past s3fs's caches), and after the next
start every object must belong to a committed checkpoint or to the run's metadata, or
go with ``atomic-checkpoint clean`` (else it is a leak). Quick: one combination per
point; full: every point x phase x role x mode.

Checked after every trial:

- the fault either failed the save on every rank, with an error that names the failing
  rank, phase, path and the injected errno (a ``DistributedCheckpointError`` carrying
  the mapped ``StorageError`` subclass), or was survived on every rank (no split);
- nothing torn is discoverable, the newest checkpoint from before is intact, and a
  failed save's step is not committed;
- a fault in rotation never fails the save, and its warning names the errno;
- with the fault cleared, the same manager saves the same step; the next start leaves
  no pending or trash data, restores the newest checkpoint exactly and saves again, and
  retention catches up.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import random
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from atomic_checkpoint._faults import ROTATION_PHASES, SAVE_PHASES

from . import REPO_ROOT, fresh_dir
from .checks import inspect_root, leaks_after_clean, unclear_reason
from .fiuctl import EXTRA_ENV, build_extra, compiler, fiu_argv
from .fiuctl import POINTS as ALL_POINTS
from .tally import Progress, Tally

POINTS = dict(ALL_POINTS)
ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EDQUOT": errno.EDQUOT, "EROFS": errno.EROFS}
PHASES = ("startup", "prepare", *SAVE_PHASES, *ROTATION_PHASES, "restore")
ROLES = ("coordinator", "peer")
MODES = ("once", "persistent")
APIS = ("save", "save_async")

WORLD = 3
KEEP_LAST = 2
TENSOR_ELEMS = 1 << 12
TIMEOUT_S = 10.0
PART_DEADLINE_S = 60.0


def available() -> tuple[bool, str]:
    """(True, "") when fiu-run, libfiu's preloads, fiu_ctrl and a C compiler work."""
    from tests.testbed.fiu_tools import fiu_available

    ok, why = fiu_available()
    if not ok:
        return ok, why
    if compiler() is None:
        return False, "no C compiler (gcc) to build fiu_extra.so (apt-get install gcc)"
    return True, ""


class RankGroup:
    """``world`` :mod:`reliability.rankd` processes under fiu-run, and their store."""

    def __init__(self, world: int, workdir: str, extra_so: str | None):
        import torch.distributed as dist

        self.world = world
        self.store = dist.TCPStore(
            "127.0.0.1", 0, world + 1, True, wait_for_workers=False, timeout=timedelta(seconds=120)
        )
        self.n = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[str] = []
        for r in range(world):
            env = dict(os.environ)
            env.update(
                {
                    "RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(r),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(self.store.port),
                    "PYTHONPATH": REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""),
                }
            )
            argv = [sys.executable, "-m", "reliability.rankd"]
            if extra_so is not None:
                env[EXTRA_ENV] = extra_so
                argv = fiu_argv(extra_so, argv, ctrl_prefix=os.path.join(workdir, "fiu-ctrl"))
            log = os.path.join(workdir, f"rank{r}.{time.monotonic_ns()}.log")
            self.logs.append(log)
            with open(log, "wb") as f:
                self.procs.append(
                    subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=f, stderr=f)
                )
        self._wait([f"ready/{r}" for r in range(world)], 180, "start")

    def _wait(self, keys: list[str], timeout_s: float, what: str) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.store.check(keys):
                return True
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"rank(s) {dead} exited during {what}: {self.tail(dead[0])}")
            time.sleep(0.002)
        return False

    def tail(self, rank: int, n: int = 1500) -> str:
        try:
            with open(self.logs[rank], "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def post(self, spec: dict[str, Any]) -> int:
        n = self.n
        self.n += 1
        spec = dict(spec, n=n)
        self.store.set(f"spec/{n}", json.dumps(spec))
        return n

    def collect(self, n: int, part: str) -> list[dict[str, Any]] | None:
        keys = [f"res/{n}/{part}/{r}" for r in range(self.world)]
        if not self._wait(keys, PART_DEADLINE_S, f"trial {n} part {part}"):
            return None
        return [json.loads(self.store.get(k)) for k in keys]

    def go(self, n: int) -> None:
        self.store.set(f"go/{n}", "1")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"spec/{self.n}", json.dumps({"op": "stop"}))
        deadline = time.monotonic() + 10
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for log in self.logs:
            with contextlib.suppress(OSError):
                os.unlink(log)


def combos(size: str, rng: random.Random) -> list[dict[str, Any]]:
    """Full: every point x errno x phase x role x mode, each through ``save`` and
    ``save_async`` (start-up and restore have no save). Quick: every point x phase
    once, with a random errno, role, mode and API."""
    out = []
    if size == "full":
        for point, name, phase, role, mode in itertools.product(
            POINTS, ERRNOS, PHASES, ROLES, MODES
        ):
            for api in APIS if phase not in ("startup", "restore") else APIS[:1]:
                out.append(_combo(point, name, phase, role, mode, api))
    else:
        for point, phase in itertools.product(POINTS, PHASES):
            out.append(_random_combo(rng, point, phase))
    rng.shuffle(out)
    return out


#: Quick size on s3fs-fuse: phases where every point has calls to fail (start-up, the
#: save's own files and its commit), so that most quick trials land a fault.
QUICK_S3FS_PHASES = ("startup", "prepare", "before_write", "mid_write", "after_manifest")


def combos_s3fs(size: str, rng: random.Random) -> list[dict[str, Any]]:
    """Full: every point x phase x role x mode, with a random errno and API. Quick:
    one phase of :data:`QUICK_S3FS_PHASES` per point, with a random errno, role, mode
    and API."""
    out = []
    if size == "full":
        for point, phase, role, mode in itertools.product(POINTS, PHASES, ROLES, MODES):
            api = rng.choice(APIS) if phase not in ("startup", "restore") else "save"
            out.append(_combo(point, rng.choice(list(ERRNOS)), phase, role, mode, api))
    else:
        for point in POINTS:
            out.append(_random_combo(rng, point, rng.choice(QUICK_S3FS_PHASES)))
    rng.shuffle(out)
    return out


class _Where:
    """The root the ranks use (``root``), where the checks read (``truth``: the path, or
    a storage reading the bucket itself), and on object stores that storage
    (``direct``), for the check of leftover objects."""

    def __init__(self, root: str, truth: Any = None, direct: Any = None):
        self.root = root
        self.truth = truth if truth is not None else root
        self.direct = direct
        self.leaked: set[str] = set()


def parse_combo(text: str) -> dict[str, Any]:
    """``point:ERRNO:mode:phase:role[:api]``, e.g. ``rename:EIO:once:startup:coordinator``
    or ``fsync:EIO:persistent:after_write:peer:save_async``."""
    point, name, mode, phase, role, *rest = text.split(":")
    api = rest[0] if rest else "save"
    if point not in POINTS or name not in ERRNOS or mode not in MODES or api not in APIS:
        raise ValueError(f"bad combination {text!r}")
    if phase not in PHASES or role not in ROLES or len(rest) > 1:
        raise ValueError(f"bad combination {text!r}")
    return _combo(point, name, phase, role, mode, api)


def _combo(point: str, name: str, phase: str, role: str, mode: str, api: str) -> dict[str, Any]:
    return {
        "point": point,
        "errno_name": name,
        "phase": phase,
        "role": role,
        "mode": mode,
        "api": api,
    }


def _random_combo(rng: random.Random, point: str, phase: str) -> dict[str, Any]:
    """``point`` failing in ``phase`` with a random errno, role, mode and API (drawn in
    that order, so a seed names the same trials)."""
    errno_name = rng.choice(list(ERRNOS))
    return _combo(point, errno_name, phase, rng.choice(ROLES), rng.choice(MODES), rng.choice(APIS))


def run(
    size: str,
    seed: int,
    progress: Progress,
    workdir: str,
    *,
    only: list[dict[str, Any]] | None = None,
    fs: str = "local",
) -> Tally:
    """Run the campaign (``only``: just these combinations, see :func:`parse_combo`) on
    a local directory (``fs="local"``) or on an s3fs-fuse mount (``fs="s3fs"``)."""
    name = "libfiu" if fs == "local" else f"libfiu-{fs}"
    tally = Tally(name)
    ok, why = available()
    if not ok:
        tally.violate("stuck", f"libfiu is not usable here: {why}")
        return tally.finish()
    rng = random.Random(seed)
    base = fresh_dir(os.path.join(workdir, name))
    extra = build_extra(base)
    if only is not None:
        todo = list(only)
    else:
        todo = combos(size, rng) if fs == "local" else combos_s3fs(size, rng)
    with contextlib.ExitStack() as stack:
        where = _open_root(stack, fs, base)
        group = RankGroup(WORLD, base, extra)
        try:
            state = {"next_step": 1}
            _seed_root(group, where.root, state)
            for i, combo in enumerate(todo):
                group = _trial(tally, group, base, extra, where, combo, rng, state)
                if (i + 1) % max(1, len(todo) // 10) == 0 or i + 1 == len(todo):
                    progress(
                        f"{name}: {i + 1}/{len(todo)} trials, {tally.faults} faults fired, "
                        f"{tally.violations} violations"
                    )
        finally:
            group.close()  # before the mount goes
    return tally.finish()


S3FS_BUCKET = "libfiu-campaign"


def _open_root(stack: contextlib.ExitStack, fs: str, base: str) -> _Where:
    if fs == "local":
        return _Where(os.path.join(base, "root"))
    if fs != "s3fs":
        raise ValueError(f"unknown filesystem {fs!r}")
    from tests.testbed import S3fsFuseMount, S3Server

    from atomic_checkpoint.storage import FsspecStorage

    server = stack.enter_context(S3Server(os.path.join(base, "logs")))
    server.create_bucket(S3FS_BUCKET)
    mount = stack.enter_context(S3fsFuseMount(server, S3FS_BUCKET, os.path.join(base, "mnt")))
    direct = FsspecStorage(f"s3://{S3FS_BUCKET}/root", server.storage_options())
    return _Where(os.path.join(str(mount.path), "root"), direct, direct)


def _spec(root: str, step: int, newest: int | None, combo: dict[str, Any], victim: int) -> dict:
    return {
        "root": root,
        "step": step,
        "newest": newest,
        "size": TENSOR_ELEMS,
        "keep_last": KEEP_LAST,
        "timeout_s": TIMEOUT_S,
        "victim": victim,
        "point": POINTS[combo["point"]],
        "errno": ERRNOS[combo["errno_name"]],
        "mode": combo["mode"],
        "phase": combo["phase"],
        "api": combo.get("api", "save"),
    }


def _seed_root(group: RankGroup, root: str, state: dict[str, int]) -> None:
    """Two committed checkpoints, so that every save in a trial rotates one out."""
    n = group.post(_spec(root, 1, None, _NO_FAULT, -1))
    a = group.collect(n, "a")
    if a is None or not all(r["ok"] for r in a):
        raise RuntimeError(f"seeding the root failed: {a} {group.tail(0)}")
    group.go(n)
    b = group.collect(n, "b")
    if b is None or not all(r["next"] == "ok" for r in b):
        raise RuntimeError(f"seeding the root failed: {b} {group.tail(0)}")
    state["next_step"] = 3


_NO_FAULT = {
    "point": "write",
    "errno_name": "EIO",
    "phase": "prepare",
    "role": "peer",
    "mode": "once",
}


def _trial(
    tally: Tally,
    group: RankGroup,
    base: str,
    extra: str,
    where: _Where,
    combo: dict[str, Any],
    rng: random.Random,
    state: dict[str, int],
) -> RankGroup:
    tally.trials += 1
    step = state["next_step"]
    state["next_step"] += 2
    before = inspect_root(where.truth, world=WORLD, size=TENSOR_ELEMS)
    victim = 0 if combo["role"] == "coordinator" else rng.randrange(1, WORLD)
    spec = _spec(where.root, step, before.newest, combo, victim)
    label = (
        f"{combo['point']} {combo['errno_name']} {combo['mode']} at {combo['phase']} "
        f"on rank {victim} through {spec['api']} (step {step})"
    )
    n = group.post(spec)
    a = group.collect(n, "a")
    if a is None:
        tally.violate("hangs", f"{label}: part A did not finish: {group.tail(victim)}")
        return _restart(group, base, extra)
    hits = a[victim]["hits"]
    if hits:
        tally.faults += 1
        tally.count("fired", combo["point"])
    else:
        tally.count("not_reached", f"{combo['point']}@{combo['phase']}")
    after = inspect_root(where.truth, world=WORLD, size=TENSOR_ELEMS)
    _judge_a(tally, label, combo, spec, a, hits, before, after, step)
    group.go(n)
    b = group.collect(n, "b")
    if b is None:
        tally.violate("hangs", f"{label}: part B did not finish: {group.tail(victim)}")
        return _restart(group, base, extra)
    final = inspect_root(where.truth, world=WORLD, size=TENSOR_ELEMS)
    _judge_b(tally, label, a, b, final, step)
    if where.direct is not None:
        # After part B (the next start, a save, its close); clean runs on the mount.
        leaks_after_clean(tally, label, where.direct, where.leaked, where.root)
    return group


def _restart(group: RankGroup, base: str, extra: str) -> RankGroup:
    group.close()
    for p in group.procs:
        if p.poll() is None:
            p.kill()
    return RankGroup(WORLD, base, extra)


def _judge_a(
    tally: Tally,
    label: str,
    combo: dict[str, Any],
    spec: dict[str, Any],
    a: list[dict[str, Any]],
    hits: int,
    before: Any,
    after: Any,
    step: int,
) -> None:
    code, victim, phase = spec["errno"], spec["victim"], combo["phase"]
    for problem in after.torn:
        tally.violate("torn", f"{label}: {problem}")
    if before.newest is not None and before.newest not in after.steps:
        tally.violate("lost", f"{label}: step {before.newest} is gone ({after.steps})")
    oks = [r["ok"] for r in a]
    errors = [(i, r["error"]) for i, r in enumerate(a) if r["error"] is not None]
    for i, desc in errors:
        tally.count("error_type", desc["type"])
        reason = unclear_reason(desc, errno=code if hits else None, victim=victim)
        if reason:
            tally.violate("unclear", f"{label}: rank {i}: {reason}")
            tally.stats.setdefault("unclear_errors", []).append(desc)
    if phase == "restore":
        for i, r in enumerate(a):
            if r["ok"] and not r["exact"]:
                tally.violate(
                    "lost", f"{label}: rank {i} restored something other than step {spec['newest']}"
                )
            if not r["ok"] and not hits:
                tally.violate("stuck", f"{label}: rank {i} failed without a fault: {r['error']}")
        return
    if not hits:
        for i, r in enumerate(a):
            if not r["ok"]:
                tally.violate("stuck", f"{label}: rank {i} failed without a fault: {r['error']}")
    if hits and all(oks):
        # Survived faults are legitimate only for best-effort steps (a cleanup, an
        # existing directory); the report lists them for review.
        tally.count("survived", f"{combo['point']}@{phase}/{combo['role']}/{combo['mode']}")
    if any(oks) and not all(oks):
        tally.violate("split", f"{label}: ranks disagree: ok={oks}")
    if all(oks) and step not in after.steps:
        tally.violate("split", f"{label}: every rank saved step {step}, but it is not committed")
    if not any(oks) and step in after.steps:
        tally.violate("split", f"{label}: every rank failed, but step {step} is committed")
    if phase in ROTATION_PHASES and not all(oks):
        tally.violate("split", f"{label}: a fault in rotation failed the save: {errors[:1]}")
    for line in a[0]["warnings"]:
        if "retention" in line and hits and f"errno {code}" not in line:
            tally.violate("unclear", f"{label}: rotation warning without errno {code}: {line}")


def _judge_b(
    tally: Tally,
    label: str,
    a: list[dict[str, Any]],
    b: list[dict[str, Any]],
    final: Any,
    step: int,
) -> None:
    for problem in final.torn:
        tally.violate("torn", f"{label} (after recovery): {problem}")
    for i, r in enumerate(b):
        if r["retry"] not in (None, "ok"):
            tally.violate("stuck", f"{label}: rank {i}: retrying step {step} failed: {r['retry']}")
        if r.get("next_error"):
            tally.violate(
                "stuck", f"{label}: rank {i}: the next start/save failed: {r['next_error']}"
            )
        if r["restore"] is False:
            tally.violate("torn", f"{label}: rank {i}: step {r.get('latest')} restores inexactly")
    left = b[0].get("left") or []
    if left:
        tally.violate("leaks", f"{label}: the next start left {left}")
    if final.pending or final.trash:
        tally.violate(
            "leaks", f"{label}: after recovery: pending {final.pending} trash {final.trash}"
        )
    if final.newest != step + 1:
        tally.violate("stuck", f"{label}: after recovery the newest step is {final.newest}")
    if len(final.steps) > KEEP_LAST:
        tally.violate("stuck", f"{label}: retention did not catch up: {final.steps}")
