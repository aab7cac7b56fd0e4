"""One rank of a long-lived campaign job, started as its own process (under
``fiu-run -x`` for the libfiu campaign) by :class:`reliability.iofaults.RankGroup`.

Environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (the parent
hosts the TCPStore, as torchrun's agent does). The rank coordinates through that store
with :class:`~atomic_checkpoint.TorchDistributedCoordinator`, exactly as a torchrun job
does, and runs the trials the parent posts under ``spec/<n>``:

A. with the libfiu fault armed on the victim rank at the trial's phase (directly, or
   from the library's named fault point through a hook), start a manager and save (or
   restore); then wait for background rotation, disarm, and report ``res/<n>/a/<rank>``;
B. after the parent has inspected the root (``go/<n>``): retry the failed save with the
   same manager, start a new manager (the "next start"), report what its sweep left,
   restore the newest checkpoint, save the next step; report ``res/<n>/b/<rank>``.

Faults are armed in-process through libfiu's C API (``fiu_enable``), which takes the
errno as an integer and needs no control pipe, so persistent faults on ``write`` are
possible (the pipe protocol itself writes).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

if __package__ in (None, ""):  # run by its path: make the repository importable
    import _repo_on_path  # noqa: F401  (reliability/_repo_on_path.py)

import torch.distributed as dist

import atomic_checkpoint.catalog
import atomic_checkpoint.retention
import atomic_checkpoint.serialization  # noqa: F401  (imported before any fault is armed)
from atomic_checkpoint import CheckpointManager, KeepLast, TorchDistributedCoordinator
from atomic_checkpoint.layout import PENDING_DIR, TRASH_DIR
from reliability.checks import describe_error, expected_state, states_equal
from reliability.fiuctl import EXTRA_ENV, Fiu
from reliability.jobs import install_fault_hook


class Arm:
    """The fault of one trial on this rank: armed at most once, disarmed at the end."""

    def __init__(self, fiu: Fiu | None, spec: dict[str, Any]):
        self.fiu = fiu
        self.point = spec["point"]
        self.code = spec["errno"]
        self.onetime = spec["mode"] == "once"
        self.phase = spec["phase"]
        self.armed = False
        self._lock = threading.Lock()

    def now(self) -> None:
        with self._lock:
            if not self.armed and self.fiu is not None:
                self.fiu.enable(self.point, self.code, onetime=self.onetime)
                self.armed = True

    def off(self) -> int:
        with self._lock:
            if self.fiu is None:
                return 0
            self.fiu.disable(self.point)
            return self.fiu.hits(self.point)


class Captured(logging.Handler):
    """The library's warnings during one part of a trial."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception:  # a record that cannot format is itself worth seeing
            self.lines.append(repr(record.msg))


_current: Arm | None = None


def _hook(phase: str, rank: int, step: int | None) -> None:
    arm = _current
    if arm is not None and arm.phase == phase:
        arm.now()


def _join_rotation(timeout_s: float = 30.0) -> None:
    # Retention runs on a background thread after a commit; a fault armed for it must
    # stay armed until it is done, and no trial may overlap the next one's.
    for t in threading.enumerate():
        if t.name == "atomic-checkpoint-rotation":
            t.join(timeout_s)


class Rank:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            self.world + 1,
            False,
            timeout=timedelta(seconds=120),
        )
        self.fiu = Fiu() if os.environ.get(EXTRA_ENV) else None
        self.log = logging.getLogger("atomic_checkpoint")
        install_fault_hook(_hook)

    def manager(self, spec: dict[str, Any], ns: str) -> CheckpointManager:
        coord = TorchDistributedCoordinator(
            self.store, rank=self.rank, world_size=self.world, namespace=f"ac/{ns}"
        )
        return CheckpointManager(
            spec["root"],
            retention=KeepLast(spec["keep_last"]),
            coordinator=coord,
            timeout_s=spec["timeout_s"],
        )

    def capture(self) -> Captured:
        cap = Captured()
        self.log.addHandler(cap)
        return cap

    def part_a(self, spec: dict[str, Any]) -> tuple[dict[str, Any], CheckpointManager | None]:
        global _current
        n, step, size = spec["n"], spec["step"], spec["size"]
        victim = spec["victim"] == self.rank
        arm = Arm(self.fiu if victim else None, spec)
        if self.fiu is not None:
            self.fiu.reset()
        cap = self.capture()
        out: dict[str, Any] = {"ok": None, "error": None, "exact": None}
        mgr = None
        phase = spec["phase"]
        _current = arm if victim else None
        try:
            if phase == "startup":
                arm.now()
            mgr = self.manager(spec, f"{n}/a")
            if phase == "prepare":
                arm.now()
            if phase == "restore":
                arm.now()
                state = mgr.restore()
                out["exact"] = states_equal(state, expected_state(spec["newest"], self.rank, size))
            elif spec.get("api") == "save_async":
                # The background save raises its failure once, at wait(), on every rank.
                mgr.save_async(step, expected_state(step, self.rank, size))
                mgr.wait()
            else:
                mgr.save(step, expected_state(step, self.rank, size))
            out["ok"] = True
        except Exception as exc:
            out["ok"] = False
            out["error"] = describe_error(exc)
        _join_rotation()
        _current = None
        out["hits"] = arm.off()
        out["armed"] = arm.armed
        self.log.removeHandler(cap)
        out["warnings"] = cap.lines
        return out, mgr

    def part_b(self, spec: dict[str, Any], mgr: CheckpointManager | None, a: dict[str, Any]):
        n, step, size = spec["n"], spec["step"], spec["size"]
        cap = self.capture()
        out: dict[str, Any] = {"retry": None, "start": None, "restore": None, "next": None}
        newest = spec["newest"]
        try:
            if mgr is None:
                mgr = self.manager(spec, f"{n}/a2")
            if not a["ok"] and spec["phase"] != "restore":
                # The same manager, after the fault cleared: the next save must work.
                mgr.save(step, expected_state(step, self.rank, size))
                out["retry"] = "ok"
            mgr.close()
        except Exception as exc:
            out["retry"] = describe_error(exc)
            if mgr is not None:
                try:
                    mgr.close()
                except Exception as close_exc:
                    out["close_error"] = describe_error(close_exc)
        try:
            mgr2 = self.manager(spec, f"{n}/b")
            if mgr2.is_coordinator:
                out["left"] = [
                    f"{d}/{x}" for d in (PENDING_DIR, TRASH_DIR) for x in mgr2.storage.listdir(d)
                ]
            out["start"] = "ok"
            latest = mgr2.latest()
            out["latest"] = latest.step if latest else None
            if latest is not None:
                out["restore"] = states_equal(
                    mgr2.restore(), expected_state(latest.step, self.rank, size)
                )
            mgr2.save(step + 1, expected_state(step + 1, self.rank, size))
            out["next"] = "ok"
            mgr2.close()
        except Exception as exc:
            out["next_error"] = describe_error(exc)
        _join_rotation()
        self.log.removeHandler(cap)
        out["warnings"] = cap.lines
        out["newest_expected"] = newest
        return out

    def serve(self) -> None:
        self.store.set(f"ready/{self.rank}", "1")
        n = 0
        forever = timedelta(seconds=3600)
        while True:
            key = f"spec/{n}"
            self.store.wait([key], forever)
            spec = json.loads(self.store.get(key))
            if spec.get("op") == "stop":
                return
            a, mgr = self.part_a(spec)
            self.store.set(f"res/{n}/a/{self.rank}", json.dumps(a))
            self.store.wait([f"go/{n}"], forever)
            b = self.part_b(spec, mgr, a)
            self.store.set(f"res/{n}/b/{self.rank}", json.dumps(b))
            n += 1


def main() -> None:
    rank = Rank()
    t = time.monotonic()
    rank.serve()
    sys.stderr.write(f"rank {rank.rank}: done after {time.monotonic() - t:.1f} s\n")


if __name__ == "__main__":
    main()
