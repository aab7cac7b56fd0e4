"""The run lock on a real local filesystem, with an injected clock.

Two jobs are two ``RunLock`` objects with different host names (every process here
shares one host name), or real child processes where the pid matters. Interleavings of
racing contenders are forced with events, not sleeps.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from atomic_checkpoint import (
    FencedError,
    LocalStorage,
    LockError,
    LockHeldError,
    MemoryStorage,
    StorageFullError,
)
from atomic_checkpoint import lock as lockmod
from atomic_checkpoint.layout import META_DIR
from atomic_checkpoint.lock import LOCK_FILE, LockHolder, RunLock, read_lock_holder

pytestmark = pytest.mark.timeout(60)

LEASE_S = 60.0


class Clock:
    """A wall clock that moves only when told to."""

    def __init__(self, start: float = 1_800_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_lock(storage, clock, *, run_id="run-a", host="node-a", lease_s=LEASE_S, heartbeat=False):
    return RunLock(
        storage, run_id=run_id, host=host, lease_s=lease_s, clock=clock, heartbeat=heartbeat
    )


@pytest.fixture
def storage(tmp_path: Path) -> LocalStorage:
    s = LocalStorage(tmp_path)
    s.makedirs(".atomic-checkpoint")
    return s


def raw_lock(storage: LocalStorage) -> bytes:
    return storage.read_bytes(LOCK_FILE)


def test_acquire_records_holder_release_removes_it_and_tokens_increase(storage):
    clock = Clock()
    a = make_lock(storage, clock)
    a.acquire()
    holder = read_lock_holder(storage)
    assert holder is not None
    assert (holder.run_id, holder.host, holder.token) == ("run-a", "node-a", 1)
    assert holder.pid == os.getpid()
    assert holder.acquired_unix == holder.renewed_unix == clock.now
    assert holder.lease_s == LEASE_S and holder.is_live(now=clock.now, host="node-b")
    # Fixed length: a reader on another sshfs mount may see a replaced file cut to the
    # old length; equal lengths make that harmless.
    assert len(raw_lock(storage)) == 1024
    a.check()
    assert a.release() is True
    assert read_lock_holder(storage) is None
    assert not [n for n in storage.listdir(".atomic-checkpoint") if n.startswith("lock.lease-")]
    assert a.release() is False  # idempotent

    b = make_lock(storage, clock, run_id="run-b")
    b.acquire()
    assert b.token == 2, "a new holder after a release still gets a larger token"


def test_live_holder_on_another_host_is_refused_with_a_message_naming_it(storage):
    clock = Clock()
    a = make_lock(storage, clock, run_id="train-llama")
    a.acquire()
    before = raw_lock(storage)
    clock.advance(10)
    b = make_lock(storage, clock, run_id="other-run", host="node-b")
    with pytest.raises(LockHeldError) as info:
        b.acquire()
    msg = str(info.value)
    for part in (
        "'train-llama'",
        "host 'node-a'",
        f"pid {os.getpid()}",
        "since 2027-01-15T08:00:00Z",
        "50 s left",
        "takeover=True",
        "atomic-checkpoint clean --force",
        str(storage.url(LOCK_FILE)),
        "A copy of a live job's root (cp, rsync) carries that job's lock",
    ):
        assert part in msg, part
    assert info.value.holder.run_id == "train-llama"
    clone = pickle.loads(pickle.dumps(info.value))  # errors cross ranks
    assert str(clone) == msg and clone.holder == info.value.holder
    assert raw_lock(storage) == before, "a refused job must not touch the lock"
    a.check()


def test_expired_lease_is_taken_over_logged_and_the_old_holder_is_fenced(storage, caplog):
    clock = Clock()
    a = make_lock(storage, clock, run_id="old-run")
    a.acquire()
    clock.advance(LEASE_S + 1)
    b = make_lock(storage, clock, run_id="new-run", host="node-b")
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        b.acquire()
    assert b.token == a.token + 1
    took = [r.getMessage() for r in caplog.records if "took over the run lock" in r.getMessage()]
    assert len(took) == 1
    assert "'old-run'" in took[0] and "host 'node-a'" in took[0] and "lease expired" in took[0]
    b.check()
    with pytest.raises(FencedError, match=r"lost the run lock.*'new-run' on host 'node-b'"):
        a.check()
    assert a.is_fenced
    assert a.release() is False
    assert read_lock_holder(storage).run_id == "new-run", "a fenced holder must not release"


def test_renewal_keeps_the_lease_alive(storage):
    clock = Clock()
    a = make_lock(storage, clock)
    a.acquire()
    clock.advance(40)
    a.renew()
    assert read_lock_holder(storage).renewed_unix == clock.now
    clock.advance(40)  # 80 s after acquiring, 40 s after the renewal
    b = make_lock(storage, clock, run_id="run-b", host="node-b")
    with pytest.raises(LockHeldError, match="20 s left"):
        b.acquire()
    a.check()


def _holding(renewal_error: OSError) -> tuple[Clock, MemoryStorage, RunLock]:
    """A lock acquired on memory storage whose lease renewals fail with ``renewal_error``."""
    clock = Clock()
    storage = MemoryStorage()
    holder = make_lock(storage, clock)
    holder.acquire()
    storage.inject("write_atomic", "lock.lease-", renewal_error, times=None)
    return clock, storage, holder


def test_a_holder_whose_renewals_fail_takes_its_lock_back_only_if_no_one_took_it():
    # Renewals failing past 5/6 of the lease (a full disk, a read-only remount) fenced
    # the job for good, though no other job had touched ROOT: a full disk for 75 s
    # killed the job that the full-disk error told to "free space, then save again".
    clock, storage, a = _holding(OSError(errno.ENOSPC, "full"))
    first = a.token
    storage.inject("create_exclusive", "lock.takeover-", OSError(errno.ENOSPC, "full"), times=None)
    clock.advance(30)
    a.renew()  # fails, logged, not raised
    a.check()  # still inside the safe part of the lease
    clock.advance(21)  # 51 s without a renewal: past 5/6 of the lease
    with pytest.raises(StorageFullError):
        a.check()  # it tries to take the lock back: the storage says why it cannot
    assert not a.is_fenced
    storage._faults.clear()  # space again
    a.check()  # taken back through a claim, as a job taking over would
    assert a.token == first + 1 and read_lock_holder(storage).token == a.token
    a.renew()
    a.check()

    # Past the lease, another job took ROOT over: the lapsed holder is fenced for good.
    storage.inject("write_atomic", "lock.lease-", OSError(errno.EIO, "I/O error"), times=None)
    clock.advance(61)
    b = make_lock(storage, clock, run_id="run-b", host="node-b")
    b.acquire()
    storage._faults.clear()
    with pytest.raises(FencedError, match="'run-b' on host 'node-b'"):
        a.check()
    with pytest.raises(FencedError):
        a.check()
    b.check()


def test_a_lapsed_holder_yields_to_a_job_whose_takeover_claim_came_first():
    clock, storage, a = _holding(OSError(errno.EIO, "I/O error"))
    clock.advance(51)
    # A job taking over has claimed this generation (and not yet replaced lock.json).
    generation = read_lock_holder(storage).generation
    claim = {"generation": generation, "by": "someone", "host": "node-b", "pid": 1}
    storage.create_exclusive(
        f"{META_DIR}/lock.takeover-{generation}.0.json",
        json.dumps({**claim, "claimed_unix": clock.now}).encode(),
    )
    with pytest.raises(FencedError, match="could not renew its lease"):
        a.check()
    assert a.is_fenced


def _holder(**kw) -> LockHolder:
    me = lockmod._Me.now()
    base = dict(
        run_id="r",
        host=me.host,
        pid=os.getppid(),  # alive for the whole test
        acquired_unix=0.0,
        renewed_unix=time.time(),
        lease_s=LEASE_S,
        token=1,
        nonce="ab12",
        pid_start=lockmod._proc_stat(os.getppid())[1],
        boot_id=me.boot_id,
        pid_ns=me.pid_ns,
    )
    base.update(kw)
    return LockHolder(**base)


@pytest.mark.parametrize(
    ("change", "gone"),
    [
        ({}, None),
        ({"pid_start": 1}, "now belongs to another process"),  # the pid was reused
        ({"renewed_unix": time.time() - LEASE_S - 5}, "lease expired"),
        ({"host": "elsewhere", "pid": 2**22 + 1}, None),  # another host's pids: lease only
        ({"boot_id": "another-boot", "pid": 2**22 + 1}, None),  # same name, other machine?
        ({"pid_ns": "pid:[1]", "pid": 2**22 + 1}, None),  # another container
        ({"pid": 2**22 + 1}, "no longer exists"),  # above pid_max: certainly dead
    ],
)
def test_which_holders_are_provably_gone(change, gone):
    reason = _holder(**change).gone_reason()
    if gone is None:
        assert reason is None
    else:
        assert reason is not None and gone in reason


def test_same_run_id_declared_explicitly_takes_over_a_live_holder(storage):
    clock = Clock()
    a = make_lock(storage, clock, run_id="run-7")
    a.acquire()
    for run_id, same_run in (("run-7", False), ("run-8", True)):
        other = make_lock(storage, clock, run_id=run_id, host="node-b")
        with pytest.raises(LockHeldError):
            other.acquire(same_run=same_run)
    restarted = make_lock(storage, clock, run_id="run-7", host="node-b")
    restarted.acquire(same_run=True)
    with pytest.raises(FencedError):
        a.check()


def test_explicit_takeover_fences_a_live_holder_and_stops_its_heartbeat(storage):
    a = RunLock(storage, run_id="zombie", host="node-a", lease_s=0.9)  # renews every 0.3 s
    a.acquire()
    time.sleep(1.0)  # longer than the lease: only the heartbeat keeps it alive
    a.check()
    b = RunLock(storage, run_id="new", host="node-b", heartbeat=False)
    with pytest.raises(LockHeldError):
        b.acquire()
    b.acquire(takeover=True)
    deadline = time.monotonic() + 5
    while not a.is_fenced:  # the heartbeat notices on its own, without a check()
        assert time.monotonic() < deadline, "the old holder's heartbeat did not notice"
        time.sleep(0.02)
    assert a._thread is not None
    a._thread.join(timeout=5)
    assert not a._thread.is_alive()
    assert read_lock_holder(storage).run_id == "new"
    with pytest.raises(FencedError, match="'new' on host 'node-b'"):
        a.check()


def test_an_earlier_unclosed_lock_of_this_process_is_superseded(storage):
    a = RunLock(storage, run_id="nb", heartbeat=False)
    a.acquire()
    b = RunLock(storage, run_id="nb", heartbeat=False)
    b.acquire()
    b.check()
    with pytest.raises(FencedError):
        a.check()


@pytest.mark.parametrize("fails", ["the first start", "the second start"])
def test_this_process_is_still_itself_when_reading_proc_fails_once(storage, monkeypatch, fails):
    """A read of /proc that failed once (EIO, EMFILE under fault injection) gave this
    process another identity: the second manager of a notebook was refused with
    LockHeldError naming this very process, and the first one stayed the holder."""
    real = lockmod._proc_stat
    monkeypatch.setattr(lockmod, "_IDENTITY", {})
    monkeypatch.setattr(lockmod, "_proc_stat", lambda pid: None)
    if fails == "the second start":
        monkeypatch.setattr(lockmod, "_proc_stat", real)
    a = RunLock(storage, run_id="nb", heartbeat=False)
    a.acquire()
    monkeypatch.setattr(
        lockmod, "_proc_stat", (lambda pid: None) if fails != "the first start" else real
    )
    b = RunLock(storage, run_id="nb", heartbeat=False)
    b.acquire()
    b.check()
    with pytest.raises(FencedError, match="newer CheckpointManager of this same process"):
        a.check()
    # Only an unknown start time is let pass: a known other one is an earlier process
    # that had this pid (reused), never this one.
    me = lockmod._Me.now()
    if me.pid_start is not None:
        reused = dataclasses.replace(b.holder, pid_start=me.pid_start + 1)
        assert not reused.is_this_process() and b.holder.is_this_process()


def test_a_removed_lock_fences_its_holder(storage):
    a = make_lock(storage, Clock())
    a.acquire()
    os.unlink(storage.local_path(LOCK_FILE))  # `clean --force` or by hand
    with pytest.raises(FencedError, match="was removed"):
        a.check()


def test_an_unreadable_lock_is_refused_while_fresh_and_taken_over_when_old(storage):
    clock = Clock(time.time())
    path = storage.local_path(LOCK_FILE)
    Path(path).write_bytes(b"")  # a crash between the exclusive create and the write
    b = make_lock(storage, clock, run_id="b")
    with pytest.raises(LockError, match="unreadable") as info:
        b.acquire()
    assert not isinstance(info.value, LockHeldError)
    with pytest.raises(LockError, match="unreadable"):
        read_lock_holder(storage)
    os.utime(path, (clock.now - LEASE_S - 10,) * 2)
    b.acquire()
    assert read_lock_holder(storage).run_id == "b"

    Path(path).write_bytes(b"{not json")
    c = make_lock(storage, clock, run_id="c")
    c.acquire(takeover=True)
    assert read_lock_holder(storage).run_id == "c"


def _expired_lock(storage) -> None:
    old = make_lock(storage, Clock(time.time() - 10 * LEASE_S), run_id="dead", host="gone")
    old.acquire()


def race(contenders: list[RunLock]) -> dict[int, LockHeldError | None]:
    """Start every contender's ``acquire()`` at once; what each got."""
    start = threading.Barrier(len(contenders))
    outcome: dict[int, LockHeldError | None] = {}

    def contend(i: int) -> None:
        start.wait()
        try:
            contenders[i].acquire()
            outcome[i] = None
        except LockHeldError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(contenders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return outcome


def test_racing_contenders_for_an_expired_lock_exactly_one_wins(tmp_path):
    for round_ in range(20):
        storage = LocalStorage(tmp_path / f"r{round_}")
        storage.makedirs(".atomic-checkpoint")
        _expired_lock(storage)
        contenders = [
            RunLock(storage, run_id=f"c{i}", host=f"node-{i}", heartbeat=False) for i in range(4)
        ]
        outcome = race(contenders)
        winners = [i for i, err in outcome.items() if err is None]
        assert len(outcome) == 4 and len(winners) == 1, outcome
        (w,) = winners
        assert read_lock_holder(storage).run_id == f"c{w}"
        contenders[w].check()
        for i, err in outcome.items():
            if i != w:
                assert f"'c{w}' on host 'node-{w}'" in str(err)


class _PausingStorage(LocalStorage):
    """Pauses the thread named ``slow`` at its ``pause_at``-th read of the lock file, and
    tells when the thread named ``fast`` has tried to claim a takeover."""

    def __init__(self, root: Path, pause_at: int):
        super().__init__(root)
        self.pause_at = pause_at
        self.slow_reads = 0
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.fast_claimed = threading.Event()

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        if path == LOCK_FILE and threading.current_thread().name == "slow":
            self.slow_reads += 1
            if self.slow_reads == self.pause_at:
                self.paused.set()
                assert self.resume.wait(10)
        return data

    def create_exclusive(self, path: str, data: bytes) -> bool:
        created = super().create_exclusive(path, data)
        if "lock.takeover-" in path and threading.current_thread().name == "fast":
            self.fast_claimed.set()
        return created


class _Contest:
    """Contender ``slow`` (paused as the storage says) against ``fast``, in threads."""

    def __init__(self, storage: _PausingStorage):
        _expired_lock(storage)
        self.locks = {
            name: RunLock(storage, run_id=name, host=f"node-{name}", heartbeat=False)
            for name in ("slow", "fast")
        }
        self.result: dict[str, str | LockHeldError] = {}
        self.threads = {
            name: threading.Thread(target=self._contend, args=(name,), name=name)
            for name in ("slow", "fast")
        }
        self.threads["slow"].start()
        assert storage.paused.wait(10)
        self.threads["fast"].start()

    def _contend(self, name: str) -> None:
        try:
            self.locks[name].acquire()
            self.result[name] = "won"
        except LockHeldError as exc:
            self.result[name] = exc

    def join(self, name: str) -> None:
        self.threads[name].join(timeout=30)
        assert not self.threads[name].is_alive()


def test_a_contender_that_judged_an_old_generation_cannot_replace_the_new_holder(tmp_path):
    # Slow reads the expired lock and pauses; fast takes it over meanwhile. Slow's view
    # is now stale: it must lose, not remove the new holder's lock (the ABA race of
    # "rename the stale lock away").
    storage = _PausingStorage(tmp_path, pause_at=1)
    storage.makedirs(".atomic-checkpoint")
    contest = _Contest(storage)
    contest.join("fast")
    assert contest.result["fast"] == "won"
    storage.resume.set()
    contest.join("slow")
    lost = contest.result["slow"]
    assert isinstance(lost, LockHeldError) and "'fast'" in str(lost)
    contest.locks["fast"].check()


def test_the_claim_excludes_a_contender_between_the_re_read_and_the_replace(tmp_path):
    # Slow has claimed the expired generation and re-read the lock (still expired), and
    # pauses right before replacing it. Fast must not take over the same generation in
    # that window: without the per-generation claim both would replace, and both win.
    storage = _PausingStorage(tmp_path, pause_at=2)
    storage.makedirs(".atomic-checkpoint")
    contest = _Contest(storage)
    assert storage.fast_claimed.wait(10)  # fast tried to claim while slow is paused
    storage.resume.set()
    contest.join("slow")
    contest.join("fast")
    assert contest.result["slow"] == "won", contest.result
    lost = contest.result["fast"]
    assert isinstance(lost, LockHeldError) and "'slow'" in str(lost)
    contest.locks["slow"].check()
    assert read_lock_holder(storage).run_id == "slow"


def test_a_claim_left_by_a_contender_that_died_mid_takeover_goes_stale(storage, monkeypatch):
    _expired_lock(storage)
    gen = read_lock_holder(storage).generation
    claim = f".atomic-checkpoint/lock.takeover-{gen}.0.json"
    doc = {"generation": gen, "by": "x", "host": "h", "pid": 1, "claimed_unix": time.time()}
    storage.create_exclusive(claim, json.dumps(doc).encode())
    monkeypatch.setattr(lockmod, "_ACQUIRE_TIMEOUT_S", 0.5)
    b = RunLock(storage, run_id="b", heartbeat=False)
    with pytest.raises(LockError, match="racing"):
        b.acquire()  # a live contender is mid-takeover: wait for it, bounded
    later = RunLock(
        storage, run_id="b", heartbeat=False, clock=lambda: time.time() + lockmod.CLAIM_STALE_S + 1
    )
    later.acquire()
    assert read_lock_holder(storage).run_id == "b"


def test_lease_s_must_be_positive(storage):
    with pytest.raises(ValueError, match="lease_s"):
        RunLock(storage, run_id="r", lease_s=0)


def test_a_wall_clock_stepped_forward_does_not_fence_a_healthy_job(storage, monkeypatch):
    # An NTP step of a few minutes: the lease's silence was measured by the wall clock,
    # so the next check fenced a job whose heartbeat was fine, and every later save
    # failed. It is measured by the monotonic clock; the documents keep wall times.
    lock = RunLock(storage, run_id="r", heartbeat=False)  # the default: the wall clock
    lock.acquire()
    real = time.time
    monkeypatch.setattr(lock, "_clock", lambda: real() + 300)  # the wall clock steps
    lock.check()  # not fenced
    lock.renew()
    assert json.loads(storage.read_bytes(LOCK_FILE))["run_id"] == "r"
    lock.release()
