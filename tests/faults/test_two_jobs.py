"""Two jobs on one checkpoint root: real processes, real kills, real sshfs mounts.

Each job is a real Python process (``lock_job.py``) driven over stdin, so every
interleaving (who holds the lock, who is frozen or killed, when a rotation or a save
proceeds) is forced by the order of commands, not by sleeps. All processes here share
one host name; jobs on "other hosts" set ``$ATOMIC_CHECKPOINT_HOST``.
"""

# Fixtures are imported from tests.testbed.pytest_fixtures and requested by parameter
# name, which pyflakes reads as redefinitions of the imports.
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from atomic_checkpoint import CheckpointManager, LocalStorage, LockHeldError
from atomic_checkpoint.catalog import committed
from atomic_checkpoint.layout import META_DIR, PENDING_DIR
from atomic_checkpoint.lock import HOST_ENV, LOCK_FILE, RunLock, read_lock_holder
from tests.testbed.pytest_fixtures import sshfs_export, sshfs_nodes  # noqa: F401

pytestmark = pytest.mark.faults

JOB = Path(__file__).with_name("lock_job.py")
FAIL_FAST_S = 2.0


class Job:
    """A job process; ``call`` sends one command and waits (bounded) for its answer."""

    def __init__(self, log: Path, *, host: str | None = None):
        env = {
            k: v for k, v in os.environ.items() if k not in (HOST_ENV, "ATOMIC_CHECKPOINT_FAULTS")
        }
        if host is not None:
            env[HOST_ENV] = host
        self.log = log
        self._err: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(JOB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def call(self, op: str, timeout_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"job {self.pid} did not answer {op!r}: {self.logs()}") from None

    def logs(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)  # reaped: its pid no longer exists

    def stop(self) -> None:
        if self.proc.poll() is None:
            with_exit = self.proc.stdin is not None and not self.proc.stdin.closed
            if with_exit:
                try:
                    self.proc.stdin.write('{"op": "exit"}\n')  # type: ignore[union-attr]
                    self.proc.stdin.close()  # type: ignore[union-attr]
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            if self.proc.poll() is None:
                os.kill(self.pid, signal.SIGCONT)
                self.proc.kill()
                self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                f.close()
        self._err.close()


@pytest.fixture
def jobs(tmp_path: Path):
    started: list[Job] = []

    def start(name: str, *, host: str | None = None) -> Job:
        job = Job(tmp_path / f"{name}.log", host=host)
        started.append(job)
        return job

    yield start
    for job in started:
        job.stop()


def steps(root: Path) -> list[int]:
    return [m.step for m in committed(LocalStorage(root), run_id=None, warn=False)]


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["ok"], reply
    return reply


@pytest.mark.timeout(60)
def test_a_second_job_fails_fast_and_leaves_the_first_jobs_save_alone(jobs, tmp_path):
    root = tmp_path / "ckpt"
    a = jobs("a")
    ok(a.call("open", root=str(root), kwargs={"run_id": "first"}))
    ok(a.call("save", step=1))
    ok(a.call("save_gated", step=2))
    assert ok(a.call("wait_gate"))["entered"]  # a save is in flight: its pending data exists
    pending = os.listdir(root / PENDING_DIR)
    assert len(pending) == 1

    b = jobs("b")
    t = time.monotonic()
    reply = b.call("open", root=str(root))
    took = time.monotonic() - t
    assert reply["error"] == "LockHeldError", reply
    assert took < FAIL_FAST_S, f"the second job took {took:.2f} s to fail"
    msg = reply["message"]
    for part in ("'first'", f"pid {a.pid}", "holding it since", "s left", "takeover=True"):
        assert part in msg, (part, msg)

    # The refused job swept nothing: the first job's save goes on and commits.
    assert os.listdir(root / PENDING_DIR) == pending
    ok(a.call("open_gate"))
    assert ok(a.call("join"))["save"] == {"ok": True}
    assert steps(root) == [1, 2]


@pytest.mark.timeout(60)
def test_readers_never_touch_the_lock_while_a_job_holds_it(jobs, tmp_path):
    root = tmp_path / "ckpt"
    a = jobs("a")
    ok(a.call("open", root=str(root)))
    ok(a.call("save", step=1))
    meta = sorted(os.listdir(root / META_DIR))
    lock_bytes = (root / LOCK_FILE).read_bytes()
    reader = CheckpointManager(root, read_only=True)
    assert reader.latest().step == 1
    assert reader.restore() == {"step": 1}
    reader.close()
    assert sorted(os.listdir(root / META_DIR)) == meta
    assert (root / LOCK_FILE).read_bytes() == lock_bytes
    ok(a.call("save", step=2))  # the job still holds its lock

    empty = tmp_path / "empty"
    empty.mkdir()
    CheckpointManager(empty, read_only=True).close()
    assert os.listdir(empty) == [], "a read-only manager creates nothing"


@pytest.mark.timeout(60)
def test_a_restart_after_sigkill_takes_over_automatically_and_sweeps(jobs, tmp_path):
    root = tmp_path / "ckpt"
    a = jobs("a")
    token_a = ok(a.call("open", root=str(root)))["token"]
    ok(a.call("save", step=1))
    ok(a.call("save_gated", step=2))
    assert ok(a.call("wait_gate"))["entered"]
    a.kill()  # mid-save: its lock and its pending data stay behind
    assert read_lock_holder(LocalStorage(root)).pid == a.pid
    assert os.listdir(root / PENDING_DIR)

    b = jobs("b")
    t = time.monotonic()
    token_b = ok(b.call("open", root=str(root)))["token"]
    assert time.monotonic() - t < FAIL_FAST_S, "no wait for a lease: the pid is dead"
    assert token_b == token_a + 1
    logs = b.logs()
    assert "WARNING took over the run lock" in logs and f"pid {a.pid} no longer exists" in logs
    assert os.listdir(root / PENDING_DIR) == [], "the new owner sweeps abandoned pending data"
    ok(b.call("save", step=2))
    assert steps(root) == [1, 2]


@pytest.mark.timeout(60)
def test_another_host_is_refused_while_the_lease_lives_and_takes_over_when_it_expires(
    jobs, tmp_path
):
    root = tmp_path / "ckpt"
    a = jobs("a", host="node-a")
    ok(a.call("open", root=str(root), kwargs={"lease_s": 1.5}))
    ok(a.call("save", step=1))
    b = jobs("b", host="node-b")
    reply = b.call("open", root=str(root))
    assert reply["error"] == "LockHeldError" and "host 'node-a'" in reply["message"], reply

    # Freeze A (a hung node: alive, not renewing). Its lease runs out.
    os.kill(a.pid, signal.SIGSTOP)
    storage = LocalStorage(root)
    deadline = time.monotonic() + 10
    while read_lock_holder(storage).lease_left_s() >= 0:
        assert time.monotonic() < deadline, "the frozen job's lease never expired"
        time.sleep(0.05)
    ok(b.call("open", root=str(root)))
    assert "lease expired" in b.logs()

    os.kill(a.pid, signal.SIGCONT)  # A wakes up as a zombie
    reply = a.call("save", step=2)
    assert reply["error"] == "FencedError", reply
    assert steps(root) == [1], "a zombie commits nothing"
    ok(a.call("close"))
    assert read_lock_holder(storage).host == "node-b", "a zombie's close leaves the lock alone"
    ok(b.call("save", step=2))
    assert steps(root) == [1, 2]


@pytest.mark.timeout(60)
def test_explicit_takeover_leaves_a_zombie_that_can_neither_delete_nor_commit(jobs, tmp_path):
    root = tmp_path / "ckpt"
    a = jobs("a")
    ok(a.call("open", root=str(root), gate_rotation=True))  # KeepLast(1), gated
    ok(a.call("save", step=1))
    ok(a.call("arm"))
    ok(a.call("save", step=2))  # its rotation (delete step 1) now waits at the gate
    assert ok(a.call("wait_gate"))["entered"]

    b = jobs("b")
    reply = b.call("open", root=str(root))
    assert reply["error"] == "LockHeldError", "A is alive: no automatic takeover"
    token_b = ok(b.call("open", root=str(root), kwargs={"takeover": True}))["token"]
    assert "takeover=True was passed" in b.logs()

    ok(a.call("open_gate"))
    rotation = ok(a.call("rotation_error"))
    assert rotation["error"] == "FencedError", rotation
    assert steps(root) == [1, 2], "the zombie's rotation deleted nothing"
    reply = a.call("save", step=3)
    assert reply["error"] == "FencedError" and "lost the run lock" in reply["message"], reply
    assert steps(root) == [1, 2] and not (root / "checkpoint-3").exists()
    assert os.listdir(root / PENDING_DIR) == []
    ok(a.call("close"))
    holder = read_lock_holder(LocalStorage(root))
    assert (holder.pid, holder.token) == (b.pid, token_b), "the zombie released nothing"
    ok(b.call("save", step=3))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gate", ["save_gated", "save_publish_gated"])
def test_a_zombie_caught_before_its_commit_is_fenced_and_commits_nothing(jobs, tmp_path, gate):
    # save_gated: stopped between prepare and publish (files written). save_publish_gated:
    # stopped after its last check of the lock, right before the rename; the job that
    # took over swept its pending files. It committed nothing (right), but raised
    # CheckpointNotFoundError ("cannot rename ...: does not exist"), which a training
    # loop takes for a step rotated away, and went on saving as a zombie.
    root = tmp_path / "ckpt"
    a = jobs("a")
    ok(a.call("open", root=str(root)))
    ok(a.call(gate, step=5))
    assert ok(a.call("wait_gate"))["entered"]
    b = jobs("b")
    ok(b.call("open", root=str(root), kwargs={"takeover": True}))
    ok(a.call("open_gate"))
    saved = ok(a.call("join"))["save"]
    assert saved["error"] == "FencedError", saved
    assert steps(root) == [] and not (root / "checkpoint-5").exists()


@pytest.mark.timeout(90)
def test_a_zombie_whose_taker_already_left_is_fenced_at_once(jobs, tmp_path):
    # The job that took over swept the zombie's pending files at its start and closed
    # before the zombie went on: the zombie waited visibility_timeout_s (30 s) for files
    # that would never come and raised CommitError, not FencedError.
    root = tmp_path / "ckpt"
    a = jobs("a")
    ok(a.call("open", root=str(root)))
    ok(a.call("save_state_gated", step=5))  # its file written, not yet looked for
    assert ok(a.call("wait_gate"))["entered"]
    b = jobs("b")
    ok(b.call("open", root=str(root), kwargs={"takeover": True}))
    ok(b.call("close"))
    t0 = time.monotonic()
    ok(a.call("open_gate"))
    saved = ok(a.call("join", timeout_s=60))["save"]
    took = time.monotonic() - t0
    assert saved["error"] in ("FencedError", "LockError"), saved
    assert took < 10, (took, saved)
    assert steps(root) == [] and not (root / "checkpoint-5").exists()


# ------------------------------------------------------------------ across two sshfs mounts


@pytest.mark.netfs
@pytest.mark.timeout(120)
def test_a_second_job_through_another_mount_is_refused(jobs, sshfs_nodes):
    node_a, node_b = sshfs_nodes
    a = jobs("a", host="node-a")
    ok(a.call("open", root=str(node_a.path / "ckpt"), kwargs={"run_id": "on-a"}))
    ok(a.call("save", step=1))
    b = jobs("b", host="node-b")
    t = time.monotonic()
    reply = b.call("open", root=str(node_b.path / "ckpt"))
    assert time.monotonic() - t < FAIL_FAST_S
    assert reply["error"] == "LockHeldError", reply
    assert "'on-a' on host 'node-a'" in reply["message"] and f"pid {a.pid}" in reply["message"]

    ok(b.call("open", root=str(node_b.path / "ckpt"), kwargs={"takeover": True}))
    reply = a.call("save", step=2)
    assert reply["error"] == "FencedError", reply
    ok(b.call("save", step=2))
    ok(b.call("close"))
    assert read_lock_holder(LocalStorage(node_a.path / "ckpt")) is None


@pytest.mark.netfs
@pytest.mark.timeout(180)
def test_contenders_racing_an_expired_lock_through_two_mounts_exactly_one_wins(sshfs_nodes):
    node_a, node_b = sshfs_nodes
    for round_ in range(20):
        name = f"ckpt-{round_}"
        via = [LocalStorage(node_a.path / name), LocalStorage(node_b.path / name)]
        via[0].makedirs(META_DIR)
        dead = RunLock(via[0], run_id="dead", host="gone", heartbeat=False, clock=lambda: 1e9)
        dead.acquire()  # its lease ran out decades ago
        contenders = [
            RunLock(via[i % 2], run_id=f"c{i}", host=f"node-{i}", heartbeat=False) for i in range(4)
        ]
        start = threading.Barrier(len(contenders))
        outcome: dict[int, str] = {}

        def contend(i: int, start=start, contenders=contenders, outcome=outcome) -> None:
            start.wait()
            try:
                contenders[i].acquire()
                outcome[i] = "won"
            except LockHeldError as exc:
                outcome[i] = str(exc)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        winners = [i for i, o in outcome.items() if o == "won"]
        assert len(outcome) == 4 and len(winners) == 1, (round_, outcome)
        (w,) = winners
        contenders[w].check()
        for storage in via:  # both nodes see the same holder
            assert read_lock_holder(storage).run_id == f"c{w}"
        for i, o in outcome.items():
            if i != w:
                assert f"'c{w}' on host 'node-{w}'" in o, o
