"""Running the integration tests' real jobs (torchrun launches, example scripts) as
child processes.

Each job starts in a process group of its own, so that a test that runs out of time
can kill the whole group (torchrun's agent and its workers, which outlive a killed
agent otherwise); every wait is bounded by :data:`RUN_TIMEOUT_S`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
RUN_TIMEOUT_S = 120  # each launch; a test's launches stay within its timeout


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a job: offline (no model hub), one OpenMP thread
    per process (the machine's cores are shared by every rank), no fault injection
    inherited, and ``TMPDIR`` in the test's directory (torchrun leaves
    ``torchelastic_*`` directories there); ``extra`` on top."""
    env = dict(os.environ)
    env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmp_path),
    )
    env.update(extra)
    return env


def spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``cmd`` in the repository, in its own process group, its output captured."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, for communicate's kill
    )


def communicate(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[str]:
    """Wait for every process (each started by ``spawn``: stderr in stdout); on timeout
    kill each one's whole process group (torchrun workers included) so nothing outlives
    the test, and fail the test with what each printed."""
    outs, late = read_all(procs, timeout_s)
    if late:
        shown = "\n".join(
            f"--- process {i} ---\n{out[-4000:]}\n{err[-4000:]}"
            for i, (out, err) in enumerate(outs)
        )
        pytest.fail(f"processes {late} did not exit within {timeout_s:g} s:\n{shown}")
    return [out for out, _ in outs]


def read_all(
    procs: list[subprocess.Popen[str]], timeout_s: float
) -> tuple[list[tuple[str, str]], list[int]]:
    """Every process's (stdout, stderr), read at once: read one after the other, a
    process blocked on a full pipe stalls the rest (torchrun on one node waits at exit
    for the other nodes' agents, which wait for theirs). Processes still running after
    ``timeout_s`` have their process group killed (each must be started in its own
    session); returns the outputs and the indices of the processes killed."""
    outs: list[tuple[str, str]] = [("", "")] * len(procs)

    def read(i: int) -> None:
        out, err = procs[i].communicate()
        outs[i] = (out or "", err or "")

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in readers:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in late:
        os.killpg(procs[i].pid, signal.SIGKILL)
    for t in readers:
        t.join(30)
    return outs, late


def check_exit(proc: subprocess.Popen[str], out: str, what: str) -> None:
    """Fail the test with the end of ``out`` unless ``proc`` exited 0."""
    if proc.returncode != 0:
        pytest.fail(f"{what} exited with {proc.returncode}:\n{out[-6000:]}")


def run_job(
    cmd: list[str], env: dict[str, str], what: str, timeout_s: float = RUN_TIMEOUT_S
) -> str:
    """Run ``cmd`` to completion (killed after ``timeout_s``); fail the test with its
    output unless it exits 0."""
    proc = spawn(cmd, env)
    (out,) = communicate([proc], timeout_s)
    check_exit(proc, out, what)
    return out


def run_example(tmp_path: Path, name: str, *args: object, timeout_s: float = RUN_TIMEOUT_S) -> str:
    """Run ``python examples/NAME ARGS`` as a reader of the docs would, to completion
    (killed after ``timeout_s``); fail the test with its output unless it exits 0;
    return that output."""
    cmd = [sys.executable, str(REPO / "examples" / name), *map(str, args)]
    return run_job(cmd, job_env(tmp_path), f"examples/{name}", timeout_s)
