"""Launch real multi-process jobs (gloo process groups) for tests, the reliability
campaigns and the benchmarks: the one launcher of the repository.

Like torchrun, the parent hosts the TCPStore (torchrun's agent does the same), and each
rank is a separate OS process with its own ``torch.distributed`` process group, so a
SIGKILLed rank is a real dead process. Ranks are forked from a forkserver that has
imported torch once: a trial costs a fraction of a second instead of the ~10 s of a
torchrun launch on two cores (a few tests still go through real torchrun).

- :func:`run_ranks` runs ``fn(rank, world, *args)`` on every rank and returns the
  per-rank results (tests, benchmarks).
- :func:`beside` runs a script of ``tests/dist/scripts`` as a separate program next to
  a job (a reader, an observer), as another program on the machine would.
- :class:`ForkJob` is the same job with the handles a campaign needs: the ranks' pids
  (to SIGKILL or SIGSTOP them at a moment of the parent's choosing) and, with
  ``watch=True``, a progress slot per rank (the last protocol phase it passed, written
  by :func:`mark` and the library's fault points) and a per-rank log, so a random kill
  can be attributed to startup, write, commit or rotation.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_CTX: Any = None
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SLOT = 48  # bytes per progress record

_progress_fd: int | None = None
_epoch = ""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "torch.distributed.checkpoint",
                "torch.distributed.tensor",
                "atomic_checkpoint",
                "atomic_checkpoint.serialization",
                "tests.dist.workers",
            ]
        )
    return _CTX


@dataclass
class RankResult:
    rank: int
    exitcode: int | None  # None: killed by the launcher at the deadline
    value: Any = None
    error: BaseException | None = None
    error_text: str = ""

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None

    @property
    def killed(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0


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
    progress_path: str | None,
    env: dict[str, str],
    pg_timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    global _progress_fd
    if progress_path is not None:
        # The rank's output (torch's C++ warnings about store timeouts, tracebacks) goes
        # to a per-job log, so the campaign's own progress stays readable.
        log_fd = os.open(progress_path + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    if progress_path is not None:
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
    """``world`` ranks running ``fn(rank, world, *args)``, started at construction; see
    the module docstring. ``watch=False`` leaves out the progress slots and logs (the
    ranks' output then goes where the parent's does)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world: int,
        *args: Any,
        tmp_dir: str,
        env: dict[str, str] | None = None,
        pg_timeout_s: float = 30.0,
        watch: bool = True,
    ):
        import torch.distributed as dist

        ctx = _context()
        self.world = world
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world + 1, True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        tag = time.monotonic_ns()
        self._outs = [os.path.join(tmp_dir, f"rank{r}.{tag}.pkl") for r in range(world)]
        self._progress: list[str | None] = [
            os.path.join(tmp_dir, f"rank{r}.{tag}.progress") if watch else None
            for r in range(world)
        ]
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
        path = self._progress[rank]
        if path is None:
            return "starting"
        try:
            with open(path, "rb") as f:
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
        """The end of ``rank``'s output (empty without ``watch``)."""
        path = self._progress[rank]
        if path is None:
            return ""
        try:
            with open(path + ".log", "rb") as f:
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
        """Join every rank; ranks still running at the deadline are killed (a stopped one
        continued first) and get ``exitcode=None``."""
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
            for p in (path, path + ".log") if path is not None else ():
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


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    tmp_dir: str,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    faults: str = "",
    pg_timeout_s: float = 10.0,
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return per-rank results.

    The ranks' environment is this process's with ``env`` on top and, where ``faults``
    is given, ``ATOMIC_CHECKPOINT_FAULTS=faults``. Every process is killed at the
    deadline; its result then has ``exitcode=None``.
    """
    if faults:
        env = {**(env or {}), "ATOMIC_CHECKPOINT_FAULTS": faults}
    job = ForkJob(
        fn, world, *args, tmp_dir=tmp_dir, env=env, pg_timeout_s=pg_timeout_s, watch=False
    )
    try:
        return job.wait(timeout_s)
    finally:
        job.close()


def ok_values(results: list[RankResult]) -> list[Any]:
    """Every rank's return value, in rank order; the test fails at the first rank that
    returned none, naming it and its error."""
    for r in results:
        assert r.ok, f"rank {r.rank} exit {r.exitcode}: {r.error_text}"
    return [r.value for r in results]


@contextlib.contextmanager
def beside(script: str, *args: Any, stop: str | os.PathLike[str]) -> Iterator[subprocess.Popen]:
    """Run ``tests/dist/scripts/SCRIPT ARGS`` as its own program while the ``with`` body
    runs; on exit write the file ``stop`` (the script polls for it) and wait for the
    script to finish (60 s at most)."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "dist", "scripts", script), *map(str, args)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        yield proc
    finally:
        with open(stop, "w") as f:
            f.write("stop")
        proc.wait(60)
