"""The run lock against real processes on this host: a holder whose process exited,
or was SIGKILLed and not yet reaped, is provably gone and taken over at once."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atomic_checkpoint import LocalStorage, LockHeldError
from atomic_checkpoint import lock as lockmod
from atomic_checkpoint.lock import RunLock, read_lock_holder

pytestmark = pytest.mark.timeout(60)

LEASE_S = 60.0


@pytest.fixture
def storage(tmp_path: Path) -> LocalStorage:
    s = LocalStorage(tmp_path)
    s.makedirs(".atomic-checkpoint")
    return s


def _child_holding_lock(root: Path, then: str) -> subprocess.Popen[str]:
    code = (
        "import os, sys, time\n"
        "from atomic_checkpoint.lock import RunLock\n"
        "from atomic_checkpoint.storage import LocalStorage\n"
        "RunLock(LocalStorage(sys.argv[1]), run_id='crashed-run', heartbeat=False).acquire()\n"
        "print('held', flush=True)\n"
        "os._exit(0) if sys.argv[2] == 'exit' else time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(root), then], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_dead_process_on_this_host_is_taken_over_at_once(storage, tmp_path, caplog):
    child = _child_holding_lock(tmp_path, "exit")
    assert child.wait(timeout=30) == 0
    holder = read_lock_holder(storage)
    assert holder.pid == child.pid and holder.lease_left_s() > LEASE_S - 30
    assert not holder.is_live(), "its lease still runs, but its process is provably gone"
    b = RunLock(storage, run_id="restarted", heartbeat=False)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        b.acquire()
    assert f"pid {child.pid} no longer exists" in caplog.text
    assert b.token == holder.token + 1


def test_an_exited_but_unreaped_process_is_gone(storage, tmp_path, caplog):
    child = _child_holding_lock(tmp_path, "sleep")
    try:
        b = RunLock(storage, run_id="restarted", heartbeat=False)
        with pytest.raises(LockHeldError, match=f"pid {child.pid}"):
            b.acquire()  # alive: refused
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while lockmod._proc_stat(child.pid)[0] != "Z":  # dead, not yet reaped by us
            assert time.monotonic() < deadline, "child did not die"
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            b.acquire()
        assert "has exited (not yet reaped)" in caplog.text
    finally:
        child.kill()
        child.wait(timeout=10)
