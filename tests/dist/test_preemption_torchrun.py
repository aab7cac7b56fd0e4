"""Preemption under a real launcher: ``python -m atomic_checkpoint.launch`` (torchrun's
own agent) with two gloo workers running the README's loop
(``scripts/preempt_train.py``), real signals delivered the ways schedulers deliver
them. Every case must end with the launcher and every rank exiting
``REQUEUE_EXIT_CODE`` and a verified checkpoint of the step the ranks agreed on.

Stock torchrun exits 1 with a traceback when its agent is signalled and 0 when its
workers are; a SIGTERM before the guard exists kills the workers on the default action.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from atomic_checkpoint import REQUEUE_EXIT_CODE, CheckpointManager
from atomic_checkpoint.layout import PENDING_DIR
from tests.helpers import run_python

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

REPO = str(Path(__file__).resolve().parents[2])
SCRIPT = os.path.join(REPO, "tests", "dist", "scripts", "preempt_train.py")
WORLD = 2


class Job:
    """One launch: the launcher's pid is the agent's; the ranks report theirs in CTL."""

    def __init__(self, tmp: Path, *, max_steps: int = 1500, save_every: int = 10**6, **env: str):
        self.root, self.ctl = tmp / "ckpt", tmp / "ctl"
        self.ctl.mkdir(parents=True, exist_ok=True)
        for p in self.ctl.iterdir():
            p.unlink()
        self.log = open(tmp / "launch.log", "a")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "atomic_checkpoint.launch",
                "--standalone",
                f"--nproc-per-node={WORLD}",
                "--monitor-interval=0.1",
                SCRIPT,
                str(self.root),
                str(self.ctl),
                str(max_steps),
                str(save_every),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO]),
                "OMP_NUM_THREADS": "1",
                "TMPDIR": str(tmp),
                **env,
            },
        )
        self.tmp = tmp

    def wait_for(self, what: str, cond: Callable[[], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.proc.poll() is not None:
                pytest.fail(f"the job exited ({self.proc.returncode}) before {what}: {self.text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}: {self.text()}")
            time.sleep(0.01)

    def read(self, name: str) -> str | None:
        try:
            return (self.ctl / name).read_text()
        except FileNotFoundError:
            return None

    def pid(self, rank: int) -> int:
        self.wait_for(f"rank {rank}'s pid", lambda: self.read(f"rank{rank}.pid") is not None)
        return int(self.read(f"rank{rank}.pid") or 0)

    def at_step(self, n: int) -> bool:
        return all(int(self.read(f"rank{r}.step") or 0) >= n for r in range(WORLD))

    def finish(self, timeout_s: float = 90) -> tuple[int, list[dict[str, Any]]]:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            pytest.fail(f"the job did not stop within {timeout_s:g} s: {self.text()}")
        finally:
            self.log.close()
        results = []
        for r in range(WORLD):
            text = self.read(f"result-rank{r}.json")
            assert text is not None, f"rank {r} reported nothing: {self.text()}"
            results.append(json.loads(text))
        return rc, results

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.tmp / "launch.log").read_text()[-4000:]


def _committed(root: Path, results: list[dict[str, Any]]) -> int:
    """Every rank stopped at one agreed step, saved it, and it verifies."""
    decided = {r["decided"] for r in results}
    assert len(decided) == 1 and None not in decided, results
    step = decided.pop()
    assert all(r["saved"][-1:] == [step] and r["exit_code"] == REQUEUE_EXIT_CODE for r in results)
    reader = CheckpointManager(root, read_only=True)
    assert reader.latest() is not None and reader.latest().step == step
    reader.verify(step)
    assert os.listdir(root / PENDING_DIR) == []
    return step


def _kill(pids: list[int], sig: int = signal.SIGTERM) -> None:
    for pid in pids:
        os.kill(pid, sig)


#: Each case is a torchrun launch (~10 s on 2 cores); every delivery pattern runs in CI.


@pytest.mark.parametrize(
    "pattern",
    [
        "agent",
        "one-worker",
        "every-worker",
        "agent-and-workers",
    ],
)
def test_every_delivery_pattern_ends_with_the_requeue_code_and_the_agreed_checkpoint(
    tmp_path, pattern
):
    job = Job(tmp_path)
    workers = [job.pid(r) for r in range(WORLD)]
    job.wait_for("both ranks to pass step 3", lambda: job.at_step(3))
    if pattern == "agent":  # Kubernetes: PID 1 of the container is the launcher
        _kill([job.proc.pid])
    elif pattern == "one-worker":
        _kill(workers[1:])
    elif pattern == "every-worker":  # a node shutting down: every process but the agent
        _kill(workers)
    else:  # SLURM's scancel / preemption: every process of the step
        _kill([job.proc.pid, *workers])
    rc, results = job.finish()
    assert rc == REQUEUE_EXIT_CODE, job.text()
    _committed(job.root, results)
    # The ranks stop at the first boundary where any of them has the signal (the
    # agent forwards it to one worker after the other): the same list on every rank.
    by = {tuple(r["requested_by"]) for r in results}
    assert len(by) == 1, results
    if pattern == "one-worker":
        assert by == {(1,)}
    else:
        assert by.pop() in ((0,), (1,), (0, 1))
    if pattern in ("one-worker", "every-worker"):  # the agent saw each rank's status
        assert f"the workers exited with [{REQUEUE_EXIT_CODE}]" in job.text()
    assert "Traceback" not in job.text()


def test_repeated_sigterms_during_the_save_do_not_cut_it_short(tmp_path):
    # Rank 0 pauses 3 x 1 s in the middle of writing the preemption save: the second
    # round of signals (agent and workers, as SLURM repeats them) lands inside it.
    job = Job(
        tmp_path, ATOMIC_CHECKPOINT_FAULTS="mid_write@0=delay,mid_write@0=delay,mid_write@0=delay"
    )
    workers = [job.pid(r) for r in range(WORLD)]
    job.wait_for("both ranks to pass step 3", lambda: job.at_step(3))
    _kill([job.proc.pid])

    def writing() -> bool:
        pend = job.root / PENDING_DIR
        return pend.is_dir() and any(
            (pend / d / "rank-00000.safetensors").exists() for d in os.listdir(pend)
        )

    job.wait_for("rank 0 to be writing the preemption save", writing)
    _kill([job.proc.pid, *workers])
    # And again, every few milliseconds, until the launcher is gone (a scheduler that
    # repeats the signal): once it has decided on the requeue code, no signal may turn
    # that into a death by SIGTERM, not even during interpreter shutdown.
    job.wait_for("the launcher to decide", lambda: "preempted:" in job.text())
    deadline = time.monotonic() + 60
    while job.proc.poll() is None and time.monotonic() < deadline:
        try:
            os.kill(job.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.005)
    rc, results = job.finish()
    assert rc == REQUEUE_EXIT_CODE, job.text()
    _committed(job.root, results)
    assert "more signal(s) ignored while the workers saved" in job.text()


def test_an_async_save_stuck_in_storage_still_ends_the_job_within_the_grace_period(tmp_path):
    # Rank 0's background writer of the async save of step 8 never returns (a storage
    # call that does not answer); every worker gets SIGTERM with a grace period of 8 s.
    # Rank 0 waited in should_save for that save without a bound while rank 1 timed
    # out (30 s), the launcher killed rank 0 after its shutdown timeout, and the job
    # exited 1 long after the scheduler's SIGKILL would have come.
    grace = 8.0
    job = Job(
        tmp_path,
        save_every=4,
        PREEMPT_ASYNC="1",
        ATOMIC_CHECKPOINT_GRACE_S=str(grace),
        ATOMIC_CHECKPOINT_FAULTS="mid_write@0=hang:8",
    )
    workers = [job.pid(r) for r in range(WORLD)]

    def stuck() -> bool:
        pend = job.root / PENDING_DIR
        return job.at_step(9) and any(
            (pend / d / "rank-00000.safetensors").exists() for d in os.listdir(pend)
        )

    job.wait_for("rank 0's async save of step 8 to be stuck in its write", stuck)
    signalled = time.monotonic()
    _kill(workers)
    rc, results = job.finish()
    took = time.monotonic() - signalled
    assert rc == REQUEUE_EXIT_CODE, job.text()
    # Within the grace period (half a second for the launcher on a busy node): rank 1,
    # whose own write was not stuck, waited at its exit for its worker, held in the
    # stuck save's round, and the job ended about 3 s after the grace period.
    assert took < grace + 0.5, (took, job.text())
    for r in results:
        assert r["exit_code"] == REQUEUE_EXIT_CODE and r["decided"] is not None, results
        assert "had not ended within the 8 s grace period" in r["skipped_save"], results
    reader = CheckpointManager(job.root, read_only=True)
    assert reader.latest().step == 4  # the stuck save never committed; step 4 is intact
    reader.verify(4)


def test_a_sigterm_before_the_process_group_exists_saves_and_the_restart_resumes(tmp_path):
    # Every worker is signalled while it starts (signals armed, no process group, no
    # manager, no guard yet): on the default action they would die, and the restart
    # would begin from scratch.
    job = Job(tmp_path, PREEMPT_HOLD_STARTUP="1")
    workers = [job.pid(r) for r in range(WORLD)]
    job.wait_for(
        "both ranks to start",
        lambda: all(job.read(f"startup-rank{r}") is not None for r in range(WORLD)),
    )
    _kill(workers)
    (job.ctl / "go").write_text("")
    rc, results = job.finish()
    assert rc == REQUEUE_EXIT_CODE, job.text()
    step = _committed(job.root, results)
    assert step == 1 and all(r["signum"] == signal.SIGTERM for r in results), results
    assert f"the workers exited with [{REQUEUE_EXIT_CODE}]" in job.text()

    # The requeued job resumes from that checkpoint, bit-exactly, and runs to its end.
    again = Job(tmp_path, max_steps=3, save_every=1)
    rc, results = again.finish()
    assert rc == 0, again.text()
    assert all(r["restored"] == step and r["restored_ok"] is True for r in results), results
    assert all(r["decided"] is None and r["exit_code"] == 0 for r in results)
    assert all(r["saved"] == [step + 1, step + 2, step + 3] for r in results)


def test_a_sigterm_to_one_worker_during_a_long_start_up_ends_the_job_within_the_grace_period(
    tmp_path,
):
    # One worker is signalled while every rank is still starting (no guard anywhere), and
    # the start-up outlasts the grace period (CTL/go is never written). That worker's
    # start-up deadline ends it with 75, 3 s before the grace period ends; the agent then
    # stops rank 0 with a SIGTERM of its own. Rank 0's deadline must count from rank 1's
    # signal, not from the agent's 7 s later: the scheduler's SIGKILL at the end of the
    # grace period would otherwise end the job with no exit status to requeue on.
    grace_s = 10.0
    job = Job(tmp_path, PREEMPT_HOLD_STARTUP="1", ATOMIC_CHECKPOINT_GRACE_S=f"{grace_s:g}")
    workers = [job.pid(r) for r in range(WORLD)]
    job.wait_for(
        "both ranks to start",
        lambda: all(job.read(f"startup-rank{r}") is not None for r in range(WORLD)),
    )
    signalled = time.monotonic()
    _kill(workers[1:])
    # The scheduler: whatever still runs when the grace period ends is SIGKILLed.
    try:
        rc = job.proc.wait(max(0.0, signalled + grace_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        for pid in (job.proc.pid, *workers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.proc.wait(30)
        pytest.fail(f"the job outlived the {grace_s:g} s grace period: {job.text()}")
    finally:
        job.log.close()
    text = job.text()
    assert rc == REQUEUE_EXIT_CODE, text
    assert f"the workers exited with [{REQUEUE_EXIT_CODE}]" in text
    # Rank 0 stopped by the deadline of rank 1's signal, noted through the launcher.
    assert "at another worker of this node" in text, text
    assert all(job.read(f"result-rank{r}.json") is None for r in range(WORLD))  # no guard


def test_a_sigterm_while_the_launcher_starts_is_still_a_requeue(tmp_path):
    # Importing torch takes the launcher about a second; a SIGTERM then killed it
    # (status 143: a scheduler's "requeue on 75" did not requeue) before any worker.
    # The signal is sent as the launcher starts importing torch.distributed.
    code = """
import builtins, os, signal, sys
from atomic_checkpoint import launch
real = builtins.__import__
def importing(name, *args, **kwargs):
    if name.startswith("torch.distributed"):
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGTERM)
    return real(name, *args, **kwargs)
builtins.__import__ = importing
sys.exit(launch.main(["--standalone", "--nproc-per-node=1", sys.argv[1]]))
"""
    marker = tmp_path / "worker-ran"
    script = tmp_path / "worker.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = run_python(
        code,
        script,
        timeout_s=60,
        cwd=REPO,
        env={"PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])},
    )
    assert proc.returncode == REQUEUE_EXIT_CODE, (proc.returncode, proc.stderr[-2000:])
    assert "before any worker started" in proc.stderr
    assert not marker.exists()


def test_a_sigterm_while_python_imports_the_package_is_still_a_requeue(tmp_path):
    # `python -m atomic_checkpoint.launch` imports the package (about half a second)
    # before launch.main can install a handler; a SIGTERM then ended it with 143. Here
    # the signal comes in the middle of that import: a `sitecustomize` on the path sends
    # it as `atomic_checkpoint.manager` starts to load.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        """
import importlib.abc, os, signal, sys
class _SignalOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "atomic_checkpoint.manager":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)
        return None
sys.meta_path.insert(0, _SignalOnImport())
"""
    )
    marker = tmp_path / "worker-ran"
    script = tmp_path / "worker.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), os.path.join(REPO, "src"), REPO])
    proc = subprocess.run(
        [sys.executable, "-m", "atomic_checkpoint.launch", "--standalone"]
        + ["--nproc-per-node=1", str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == REQUEUE_EXIT_CODE, (proc.returncode, proc.stderr[-2000:])
    assert "the launcher got SIGTERM before any worker started" in proc.stderr
    assert not marker.exists()


def test_importing_the_package_elsewhere_changes_no_signal_handler():
    from atomic_checkpoint import _early

    code = (
        "import signal, atomic_checkpoint; "
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "True", out.stderr
    python = "/usr/bin/python3"
    assert _early.launching([python, "-m", "atomic_checkpoint.launch", "--standalone"])
    assert _early.launching([python, "-W", "error", "-u", "-matomic_checkpoint.launch"])
    assert not _early.launching([python, "-m", "atomic_checkpoint", "list", "ROOT"])
    assert not _early.launching([python, "train.py", "-m", "atomic_checkpoint.launch"])
    assert not _early.launching([python, "-c", "import atomic_checkpoint.launch"])
