"""Named fault points inside the protocol, for crash and failure tests.

Tests make a chosen rank misbehave at a chosen phase through the environment, so real
processes launched by torchrun can be killed at exact moments::

    ATOMIC_CHECKPOINT_FAULTS="after_manifest@0=kill"          # coordinator, any step
    ATOMIC_CHECKPOINT_FAULTS="mid_write@2=raise:30,after_rename@0=hang"

Format: ``phase@rank=action[:step]``, comma-separated; rank ``*`` means every rank.
Actions: ``kill`` (SIGKILL self), ``raise`` (an injected OSError EIO), ``hang`` (sleep
far beyond any timeout), ``exit`` (``os._exit(1)`` without cleanup), ``delay`` (sleep
one second, then go on: entries run in order, so ``delay`` before ``kill`` at the same
point lets other ranks get ahead first).

Save phases, in order: ``before_write``, ``mid_write``, ``after_write``,
``after_manifest``, ``after_rename``, ``during_broadcast``. Rotation phases:
``before_uncommit``, ``after_uncommit``, ``mid_delete``. Other points, which fire only
on some paths: ``mid_replace`` (an overwrite without an atomic exchange, between moving
the old copy out and renaming the new one in) and ``mid_create`` (inside
``LocalStorage.create_exclusive``, the temporary file written and fsync'd, not yet
linked under its name; storage knows no rank: use rank ``*``). Replication to a
persistent tier (``tiered``, on its replicator thread, rank 0): ``mid_replicate`` (the
first file copied, the others not) and ``before_replica_commit`` (every file copied and
verified, the manifest not yet published). Unset, a fault point
costs one dict lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import time

ENV = "ATOMIC_CHECKPOINT_FAULTS"

SAVE_PHASES = (
    "before_write",
    "mid_write",
    "after_write",
    "after_manifest",
    "after_rename",
    "during_broadcast",
)
ROTATION_PHASES = ("before_uncommit", "after_uncommit", "mid_delete")
OTHER_PHASES = ("mid_replace", "mid_create", "mid_replicate", "before_replica_commit")

_cache: tuple[str, dict[str, list[tuple[str, str, int | None]]]] = ("", {})


def _parse(spec: str) -> dict[str, list[tuple[str, str, int | None]]]:
    out: dict[str, list[tuple[str, str, int | None]]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            where, action = item.split("=", 1)
            phase, rank = where.split("@", 1)
            step: int | None = None
            if ":" in action:
                action, step_s = action.split(":", 1)
                step = int(step_s)
        except ValueError:
            raise ValueError(f"{ENV}: cannot parse {item!r}; expected phase@rank=action[:step]")
        if phase not in SAVE_PHASES + ROTATION_PHASES + OTHER_PHASES:
            raise ValueError(f"{ENV}: unknown phase {phase!r}")
        if action not in ("kill", "raise", "hang", "exit", "delay"):
            raise ValueError(f"{ENV}: unknown action {action!r}")
        out.setdefault(phase, []).append((rank, action, step))
    return out


def fault_point(phase: str, rank: int, step: int | None = None) -> None:
    """Misbehave here if the environment asks this rank to."""
    global _cache
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    if spec != _cache[0]:
        _cache = (spec, _parse(spec))
    for want_rank, action, want_step in _cache[1].get(phase, ()):
        if want_rank not in ("*", str(rank)):
            continue
        if want_step is not None and want_step != step:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # the signal is asynchronous on some platforms
        elif action == "exit":
            os._exit(1)
        elif action == "hang":
            time.sleep(3600)
        elif action == "delay":
            time.sleep(1.0)
        else:
            raise OSError(errno.EIO, f"injected fault at {phase} on rank {rank}")
