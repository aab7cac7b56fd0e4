"""Real multi-process jobs whose ranks the campaign can kill, stop and watch.

:class:`ForkJob` is :func:`tests.dist.launcher.run_ranks` with the handles a campaign
needs: ranks are forked from the same torch-preloaded forkserver, join a real gloo
process group through a TCPStore hosted here (as torchrun's agent hosts it), and the
parent gets their pids (to SIGKILL or SIGSTOP them at a moment of its choosing) and a
progress slot per rank (the last protocol phase each rank passed), so a random kill can
be attributed to startup, write, commit or rotation.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tests.dist.launcher import RankResult, _context

_SLOT = 48  # bytes per progress record

_progress_fd: int | None = None
_epoch = ""


def set_epoch(prefix: str) -> None:
    """Inside a rank: prefix every later progress record (e.g. ``"timed:"``), so the
    parent can tell the phases of the save it waits for from earlier ones."""
    global _epoch
    _epoch = prefix


def mark(what: str) -> None:
    """Inside a rank: record what this rank is doing now (one pwrite, no fsync)."""
    if _progress_fd is not None:
        data = (_epoch + what).encode()[: _SLOT - 1].ljust(_SLOT, b" ")
        with contextlib.suppress(OSError):
            os.pwrite(_progress_fd, data, 0)


def install_fault_hook(hook: Callable[[str, int, int | None], None]) -> None:
    """Call ``hook(phase, rank, step)`` at every named fault point of the library, then
    the library's own fault point (so ``ATOMIC_CHECKPOINT_FAULTS`` still works).

    The library imports ``fault_point`` by name into each module that uses it, so the
    wrapper replaces that name in every loaded ``atomic_checkpoint`` module.
    """
    import atomic_checkpoint._faults as faults
    import atomic_checkpoint.commit
    import atomic_checkpoint.manager  # noqa: F401  (load every user of fault_point)

    original = getattr(faults, "_campaign_original", faults.fault_point)
    faults._campaign_original = original  # type: ignore[attr-defined]

    def wrapped(phase: str, rank: int, step: int | None = None) -> None:
        hook(phase, rank, step)
        original(phase, rank, step)

    for name, mod in list(sys.modules.items()):
        if name.startswith("atomic_checkpoint") and name != "atomic_checkpoint._faults":
            current = getattr(mod, "fault_point", None)
            if current is original or getattr(current, "_campaign_hook", False):
                mod.fault_point = wrapped  # type: ignore[attr-defined]
    wrapped._campaign_hook = True  # type: ignore[attr-defined]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out_path: str,
    progress_path: str,
    env: dict[str, str],
    pg_timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    global _progress_fd
    # The rank's output (torch's C++ warnings about store timeouts, tracebacks) goes to
    # a per-job log, so the campaign's own progress stays readable.
    log_fd = os.open(progress_path + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    _progress_fd = os.open(progress_path, os.O_WRONLY | os.O_CREAT, 0o644)
    mark("connect")
    install_fault_hook(lambda phase, _rank, _step: mark(phase))
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s)
    )
    result: dict[str, Any]
    try:
        result = {"value": fn(rank, world, *args)}
    except BaseException as exc:  # shipped to the parent for assertions
        result = {"error": exc, "text": traceback.format_exc()}
    mark("finished")
    try:
        data = pickle.dumps(result)
    except Exception:
        data = pickle.dumps({"error": RuntimeError(repr(result)), "text": repr(result)})
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    os._exit(0)  # skip process-group teardown: with dead peers it can block


class ForkJob:
    """``world`` ranks running ``fn(rank, world, *args)``; see the module docstring."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world: int,
        *args: Any,
        tmp_dir: str,
        env: dict[str, str] | None = None,
        pg_timeout_s: float = 30.0,
    ):
        import torch.distributed as dist

        ctx = _context()
        self.world = world
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world + 1, True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        tag = time.monotonic_ns()
        self._outs = [os.path.join(tmp_dir, f"rank{r}.{tag}.pkl") for r in range(world)]
        self._progress = [os.path.join(tmp_dir, f"rank{r}.{tag}.progress") for r in range(world)]
        self.procs = [
            ctx.Process(
                target=_child,
                args=(
                    fn,
                    r,
                    world,
                    self._store.port,
                    self._outs[r],
                    self._progress[r],
                    dict(env or {}),
                    pg_timeout_s,
                    args,
                ),
                daemon=True,
            )
            for r in range(world)
        ]
        self.started = time.monotonic()
        for p in self.procs:
            p.start()
        self.killed: dict[int, str] = {}  # rank -> what it was doing when killed

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def progress(self, rank: int) -> str:
        """The last thing ``rank`` recorded (``connect``, a phase, ``finished``...)."""
        try:
            with open(self._progress[rank], "rb") as f:
                return f.read(_SLOT).decode(errors="replace").strip() or "starting"
        except FileNotFoundError:
            return "starting"

    def wait_started(self, timeout_s: float = 30.0) -> bool:
        """Wait until every rank runs the job's function (past process start and
        process-group set-up, which are the harness, not the library)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.progress(r) not in ("starting", "connect") for r in range(self.world)):
                return True
            time.sleep(0.002)
        return False

    def log_tail(self, rank: int, n: int = 2000) -> str:
        """The end of ``rank``'s output."""
        try:
            with open(self._progress[rank] + ".log", "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def signal(self, rank: int, sig: int) -> bool:
        """Send ``sig`` to ``rank``; False if it already exited."""
        p = self.procs[rank]
        if p.pid is None or not p.is_alive():
            return False
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self, rank: int) -> str | None:
        """SIGKILL ``rank``; returns what it was doing, or None if it had exited."""
        doing = self.progress(rank)
        if not self.signal(rank, signal.SIGKILL):
            return None
        self.killed[rank] = doing
        return doing

    def join(self, ranks: list[int], timeout_s: float) -> bool:
        """Wait until ``ranks`` exited; False if some still run at the deadline."""
        deadline = time.monotonic() + timeout_s
        for r in ranks:
            self.procs[r].join(max(0.0, deadline - time.monotonic()))
        return not any(self.procs[r].is_alive() for r in ranks)

    def wait(self, timeout_s: float) -> list[RankResult]:
        """Join every rank; ranks still running at the deadline are killed and get
        ``exitcode=None``."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        results = []
        for r, p in enumerate(self.procs):
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                p.join(5)
                results.append(
                    RankResult(
                        r, None, error_text="still running at the deadline\n" + self.log_tail(r)
                    )
                )
                continue
            res = RankResult(r, p.exitcode, error_text=self.log_tail(r))
            if os.path.exists(self._outs[r]):
                with open(self._outs[r], "rb") as f:
                    data = pickle.loads(f.read())
                res.value = data.get("value")
                res.error = data.get("error")
                res.error_text = data.get("text", "")
                os.unlink(self._outs[r])
            results.append(res)
        for path in self._progress:
            for p in (path, path + ".log"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        return results

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        del self._store
