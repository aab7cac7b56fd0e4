"""The run lock on a checkpoint root, with a lease and a fencing token.

One job at a time writes to a root (DESIGN invariant 7, FAILURE_MODES F1). The lock is
built only from operations that exclude across clients on every filesystem we support,
including those where ``flock`` does not (sshfs, many NFS setups): exclusive create,
atomic replace by rename, and plain reads through ``open()``. Files, all under
``ROOT/.atomic-checkpoint/``::

    lock.json                        the holder: run id, host, pid (+ start time, boot
                                     id, pid namespace), acquired/renewed times, lease,
                                     fencing token and nonce. Written once per holder.
    lock.lease-<nonce>.json          the holder's heartbeat: ``renewed_unix``, rewritten
                                     every ``lease_s / 3`` by a daemon thread.
    lock.takeover-<gen>.<k>.json     the claim of the one contender allowed to replace
                                     generation ``<gen>`` (= ``<token>-<nonce>``).
    lock.token                       the last token handed out (keeps tokens increasing
                                     across a release).

Life cycle:

- **Acquire**: ``create_exclusive(lock.json)``. If it exists, the holder is read and the
  lock is taken over automatically only when the holder is provably gone: same host
  and its process is dead (pid gone, pid reused, or a zombie), or its lease expired, or
  the new job declares the same run id (a restarted job), or it is an earlier manager
  of this very process. ``takeover=True`` takes over in every case. Otherwise
  :class:`~atomic_checkpoint.errors.LockHeldError` names the holder.
- **Object stores**: exclusive create is a conditional PUT (``If-None-Match: *``), which
  some S3-compatible servers ignore or reject. The storage probes it once (a key created
  twice: the second must be refused) and the lock refuses to run where it is not
  honoured, unless the user accepts the risk (storage option ``conditional_create=False``
  or ``ATOMIC_CHECKPOINT_CONDITIONAL_CREATE=false``).
- **Takeover** is race-free between any number of contenders on any number of clients:
  to replace generation ``G`` a contender must first create the claim file for ``G``
  exclusively; exactly one does, and only it replaces ``lock.json``. Claims are named
  by the generation, so a slow contender holding an old view can never claim a newer
  holder's generation (the ABA problem of "rename the stale lock away": a slow
  contender would rename away the *new* lock). A claim left by a contender that died
  between claim and replace goes stale after :data:`CLAIM_STALE_S`; then the next claim
  index is open.
- **Heartbeat**: a separate per-holder file, so the holder never rewrites ``lock.json``
  and a renewal racing a takeover cannot overwrite the new holder's lock.
- **Fencing**: :meth:`RunLock.check` re-reads ``lock.json`` (open, not stat: network
  filesystems cache attributes for many seconds) and raises
  :class:`~atomic_checkpoint.errors.FencedError` if the generation is not ours, or if
  our own lease could have expired (a stalled holder stops before others may take over).
  The manager calls it before each commit step and each deletion.
- **Release**: delete ``lock.json`` only if it still holds our generation.

Limits (no filesystem here offers compare-and-swap): the check and the act it guards
are two operations, so a holder taken over explicitly in the few milliseconds between
its check and its rename can finish that one rename. Lease expiry assumes clocks of
the hosts agree to well under ``lease_s / 6``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import operator
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, NoReturn

from ._process import HOST_ENV, current_host, on_child_exit
from ._process import pid_namespace as _pid_namespace
from ._process import proc_stat as _proc_stat
from ._process import read_text as _read_text
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedError,
    LockError,
    LockHeldError,
)
from .layout import META_DIR
from .storage import posix
from .storage.base import Storage
from .storage.fsspec import CONDITIONAL_CREATE_ENV, CONDITIONAL_CREATE_OPTION, PROBE_PREFIX

__all__ = [
    "DEFAULT_LEASE_S",
    "HOST_ENV",
    "LOCK_FILE",
    "LockHolder",
    "RunLock",
    "current_host",
    "read_lock_holder",
]

log = logging.getLogger("atomic_checkpoint")

LOCK_FILE = f"{META_DIR}/lock.json"
TOKEN_FILE = f"{META_DIR}/lock.token"
_LEASE_PREFIX = "lock.lease-"
_CLAIM_PREFIX = "lock.takeover-"


DEFAULT_LEASE_S = 60.0
#: A takeover claim older than this belongs to a contender that died mid-takeover.
CLAIM_STALE_S = 15.0
#: A contender whose view of the lock is older than this re-reads before replacing it,
#: so it can never act on a view older than a claim's staleness bound.
_VIEW_MAX_AGE_S = 5.0
_ACQUIRE_TIMEOUT_S = 3 * CLAIM_STALE_S
#: A holder stops committing and deleting once this fraction of its lease has passed
#: without a successful renewal: before anyone else may take over (tolerates skew).
_SELF_FENCE_AT = 5 / 6
_MAX_CLAIMS = 8
_CLAIM_KEEP_S = 3600.0
#: A conditional-create probe key older than this was left by a probe whose delete
#: failed (a probe lasts milliseconds); the next holder's tidy-up removes it.
PROBE_STALE_S = 60.0
#: Fixed on-disk size of lock documents. sshfs: after ``os.replace`` on one mount, the
#: first read through another mount can return the new data cut to the old file's
#: length; with equal lengths that cut is a no-op.
_LOCK_PAD = 1024
_LEASE_PAD = 256
_READ_ATTEMPTS = 5
_IS_WINDOWS = os.name == "nt"


def _fmt_time(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


#: The fields that identify one process: a pid is reused, so its start time, the
#: boot and the pid namespace tell this process from an earlier one with that pid.
_PROCESS_IDENTITY = operator.attrgetter("host", "pid", "boot_id", "pid_ns")
#: This process's start time, boot id and pid namespace, by pid (see ``_Me.now``).
_IDENTITY: dict[int, tuple[int | None, str | None, str | None]] = {}


@dataclass(frozen=True)
class _Me:
    host: str
    pid: int
    pid_start: int | None
    boot_id: str | None
    pid_ns: str | None

    @classmethod
    def now(cls, host: str | None = None) -> _Me:
        pid = os.getpid()
        known = _IDENTITY.get(pid)
        if known is None:
            stat = _proc_stat(pid)
            boot = _read_text("/proc/sys/kernel/random/boot_id")
            known = (stat[1] if stat else None, boot, _pid_namespace())
            if None not in known:
                # Read once per process (a fork has another pid): a read of /proc that
                # fails once (EIO, EMFILE) made this process a stranger to its own
                # lock, and a second manager was refused as another job.
                _IDENTITY.clear()
                _IDENTITY[pid] = known
        return cls(host or current_host(), pid, *known)


@dataclass(frozen=True, kw_only=True)
class LockHolder:
    """Who holds the run lock on a root: the content of ``.atomic-checkpoint/lock.json``.

    Attributes:
        run_id: the run the holder writes.
        host: its host name (``$ATOMIC_CHECKPOINT_HOST`` or ``socket.gethostname()``).
        pid: its process id on that host.
        acquired_unix: when it took the lock.
        renewed_unix: its latest heartbeat.
        lease_s: how long after ``renewed_unix`` the lock counts as abandoned.
        token: the fencing token, increasing with every new holder.
        nonce: random, makes the (token, nonce) generation unique.
        pid_start: start time of ``pid`` in clock ticks since boot (detects pid reuse).
        boot_id: the host's boot id (a pid means nothing across a reboot).
        pid_ns: the pid namespace (a pid means nothing in another container).
    """

    run_id: str
    host: str
    pid: int
    acquired_unix: float
    renewed_unix: float
    lease_s: float
    token: int
    nonce: str
    pid_start: int | None = None
    boot_id: str | None = None
    pid_ns: str | None = None

    @property
    def generation(self) -> str:
        """``<token>-<nonce>``: identifies this holder across every client."""
        return f"{self.token}-{self.nonce}"

    def lease_left_s(self, now: float | None = None) -> float:
        """Seconds until the lease expires (negative: expired that long ago)."""
        return self.renewed_unix + self.lease_s - (time.time() if now is None else now)

    def gone_reason(self, *, now: float | None = None, host: str | None = None) -> str | None:
        """Why the holder is provably gone, or None if it may still be running.

        Gone means: its lease expired, or it ran on this host (same host name, boot and
        pid namespace) and its process no longer exists, was reused by another process,
        or has exited and is waiting to be reaped.
        """
        left = self.lease_left_s(now)
        if left < 0:
            return (
                f"its lease expired {-left:.1f} s ago (last renewed {_fmt_time(self.renewed_unix)})"
            )
        dead = self._process_gone(host or current_host())
        return f"its process is gone: {dead}" if dead else None

    def _process_gone(self, host: str) -> str | None:
        if host != self.host or _IS_WINDOWS:
            # Windows: os.kill(pid, 0) would send CTRL_C_EVENT, not probe. Another
            # host: its pids are not ours to look at. Only the lease can tell.
            return None
        me = _Me.now(host)
        # A pid is meaningful only in the same boot and pid namespace. A different boot
        # id under the same host name may be a reboot or two machines sharing a name
        # (misconfigured clusters): never guess, leave it to the lease.
        if self.boot_id and me.boot_id and self.boot_id != me.boot_id:
            return None
        if self.pid_ns and me.pid_ns and self.pid_ns != me.pid_ns:
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return f"pid {self.pid} no longer exists on host {self.host!r}"
        except PermissionError:
            pass  # exists, owned by another user
        except OSError:
            return None
        stat = _proc_stat(self.pid)
        if stat is None:
            return None
        state, start = stat
        if self.pid_start is not None and start != self.pid_start:
            return f"pid {self.pid} on host {self.host!r} now belongs to another process"
        if state in ("Z", "X"):
            return f"pid {self.pid} on host {self.host!r} has exited (not yet reaped)"
        return None

    def is_live(self, *, now: float | None = None, host: str | None = None) -> bool:
        """True unless the holder is provably gone (see :meth:`gone_reason`)."""
        return self.gone_reason(now=now, host=host) is None

    def describe(self, now: float | None = None) -> str:
        """One human-readable line: who, where, since when, and the lease."""
        now = time.time() if now is None else now
        left = self.lease_left_s(now)
        lease = f"lease renewed {max(0.0, now - self.renewed_unix):.0f} s ago, " + (
            f"{left:.0f} s left" if left >= 0 else f"expired {-left:.0f} s ago"
        )
        return (
            f"run {self.run_id!r} on host {self.host!r}, pid {self.pid}, holding it since "
            f"{_fmt_time(self.acquired_unix)} ({lease}; fencing token {self.token})"
        )

    def is_this_process(self) -> bool:
        """Whether the holder is the calling process (same host, pid, process start,
        boot and pid namespace): an open manager of this very process."""
        return self._is_process(_Me.now())

    def _is_process(self, me: _Me) -> bool:
        # A start time one side could not read still names this process: a live pid
        # in the same boot and pid namespace is one process (an earlier one with
        # that pid is gone, and its lock is ours to take over either way).
        unknown = self.pid_start is None or me.pid_start is None
        return _PROCESS_IDENTITY(self) == _PROCESS_IDENTITY(me) and (
            unknown or self.pid_start == me.pid_start
        )

    def to_bytes(self) -> bytes:
        doc = {"kind": "atomic-checkpoint-lock", "version": 1, **asdict(self)}
        return _pad(json.dumps(doc, sort_keys=True).encode(), _LOCK_PAD)

    @classmethod
    def from_bytes(cls, data: bytes) -> LockHolder:
        """Parse a lock document. Raises ValueError saying what is wrong."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except RecursionError:  # untrusted bytes: nested too deeply for json
            raise ValueError("lock document is nested too deeply to parse") from None
        if not isinstance(doc, dict) or doc.get("kind") != "atomic-checkpoint-lock":
            raise ValueError("not an atomic-checkpoint lock document")
        try:
            holder = cls(
                run_id=str(doc["run_id"]),
                host=str(doc["host"]),
                pid=int(doc["pid"]),
                acquired_unix=float(doc["acquired_unix"]),
                renewed_unix=float(doc["renewed_unix"]),
                lease_s=float(doc["lease_s"]),
                token=int(doc["token"]),
                nonce=str(doc["nonce"]),
                pid_start=None if doc.get("pid_start") is None else int(doc["pid_start"]),
                boot_id=doc.get("boot_id") or None,
                pid_ns=doc.get("pid_ns") or None,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"lock document is missing or has a bad field: {exc}") from None
        if not holder.nonce.isalnum():
            raise ValueError(f"lock document has a bad nonce {holder.nonce!r}")
        return holder


#: What parsing an untrusted claim or heartbeat document can raise (json recursion on
#: deep nesting, float() of a 400-digit int, a missing key or a wrong type).
_UNPARSEABLE = (ValueError, KeyError, TypeError, OverflowError, RecursionError)


def _pad(data: bytes, size: int) -> bytes:
    return data + b" " * (size - 1 - len(data)) + b"\n" if len(data) < size else data + b"\n"


def _read_optional(storage: Storage, path: str) -> bytes | None:
    """The bytes of ``path``, or None if it does not exist. A file the storage refuses
    to read (larger than ``MAX_READ_BYTES``, a FIFO or a link) reads as the refusal's
    text: not a lock document, so it is handled like any unreadable lock file."""
    try:
        return storage.read_bytes(path)
    except CheckpointNotFoundError:
        return None
    except CorruptCheckpointError as exc:
        return f"unreadable: {exc}".encode()


def _parse_lock(storage: Storage, raw: bytes | None) -> tuple[bytes | None, LockHolder | None]:
    """Parse ``raw`` (re-reading a few times if it does not parse: a reader on another
    client can briefly see a file cut short). Returns (raw, holder or None if
    unreadable); raw is None if the lock vanished meanwhile."""
    delay = 0.01
    for attempt in range(_READ_ATTEMPTS):
        if raw is None:
            return None, None
        try:
            return raw, LockHolder.from_bytes(raw)
        except (ValueError, UnicodeDecodeError):
            if attempt == _READ_ATTEMPTS - 1:
                break
            time.sleep(delay)
            delay *= 2
            raw = _read_optional(storage, LOCK_FILE)
    return raw, None


def _lease_path(nonce: str) -> str:
    return f"{META_DIR}/{_LEASE_PREFIX}{nonce}.json"


def _with_heartbeat(storage: Storage, holder: LockHolder) -> LockHolder:
    """``holder`` with ``renewed_unix`` from its heartbeat file, when newer."""
    try:
        raw = _read_optional(storage, _lease_path(holder.nonce))
        doc = json.loads(raw) if raw else None
    except (ValueError, RecursionError, CheckpointError):
        doc = None  # torn or unreadable heartbeat: the lock file's time stands
    if isinstance(doc, dict) and doc.get("nonce") == holder.nonce:
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            renewed = float(doc["renewed_unix"])
            if renewed > holder.renewed_unix:
                return replace(holder, renewed_unix=renewed)
    return holder


#: The run lock's advice in ``CheckpointManager`` terms, and what to say instead to
#: whoever cannot pass its arguments (the command line, the Trainer and Accelerate
#: integrations, which open the root themselves).
_WITHOUT_TAKEOVER = (
    ("pass CheckpointManager(..., takeover=True), or run", "run"),
    (
        "take a copy's lock over with takeover=True",
        "take a copy's lock over with `atomic-checkpoint clean --force` on the copy",
    ),
    ("; or pass takeover=True", ""),
)


def without_takeover_advice(text: str) -> str:
    """``text``, a run lock error's message, advising what a caller that cannot pass
    ``takeover=True`` can do instead (``atomic-checkpoint clean --force``)."""
    for python, instead in _WITHOUT_TAKEOVER:
        text = text.replace(python, instead)
    return text


def _unreadable_lock_error(storage: Storage, raw: bytes) -> LockError:
    return LockError(
        f"the run lock {storage.url(LOCK_FILE)} is unreadable ({len(raw)} bytes that are "
        "not a lock document): a job may be creating it right now, or one crashed while "
        "creating it. If no job is running on this root, delete that file; or pass "
        "takeover=True"
    )


def read_lock_holder(storage: Storage) -> LockHolder | None:
    """The current holder of the run lock on ``storage``, or None if it is free.

    Read-only (never creates, renews or removes anything), for readers and the CLI.
    ``renewed_unix`` includes the holder's latest heartbeat.

    Raises:
        LockError: the lock file exists but cannot be parsed.
        StorageError: it cannot be read.
    """
    raw, holder = _parse_lock(storage, _read_optional(storage, LOCK_FILE))
    if raw is None:
        return None
    if holder is None:
        raise _unreadable_lock_error(storage, raw)
    return _with_heartbeat(storage, holder)


class RunLock:
    """The run lock of one job on one root, held by the job's coordinator.

    Thread-safe: :meth:`check` is called from the training thread and from the
    rotation thread while the heartbeat thread renews.

    Args:
        storage: the checkpoint root.
        run_id: the run this job writes (recorded for humans and same-run takeover).
        lease_s: lease length; the heartbeat renews every ``lease_s / 3``. Others may
            take over ``lease_s`` after the last renewal, and this job stops committing
            and deleting ``lease_s / 6`` before that.
        host: override of :func:`current_host`.
        clock: wall clock (seconds since the epoch); injectable for tests.
        heartbeat: renew from a daemon thread (off only in tests that call
            :meth:`renew` by hand).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        run_id: str,
        lease_s: float = DEFAULT_LEASE_S,
        host: str | None = None,
        clock: Callable[[], float] = time.time,
        heartbeat: bool = True,
    ):
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self.storage = storage
        self.run_id = run_id
        self.lease_s = float(lease_s)
        self._host = host
        self._clock = clock
        # How long since the last renewal, for this job's own fencing: monotonic, so a
        # wall clock stepped forward (NTP) cannot fence a healthy job, nor one stepped
        # back keep a lapsed one going. An injected clock (tests) stands for both.
        self._elapsed = time.monotonic if clock is time.time else clock
        self._heartbeat = heartbeat
        self._mutex = threading.Lock()
        self._holder: LockHolder | None = None
        self._last_renewed = 0.0  # by self._elapsed
        self._fenced: str | None = None
        self._released = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A lapsed lease taken back (``_reclaim``): one at a time, under one claimant
        # name, so that a claim left by an attempt the storage cut short is ours.
        self._reclaiming = threading.Lock()
        self._claimant = uuid.uuid4().hex

    # ---------------------------------------------------------------- state
    @property
    def holder(self) -> LockHolder | None:
        """Our lock document while held (None before acquire)."""
        return self._holder

    @property
    def token(self) -> int | None:
        return self._holder.token if self._holder is not None else None

    @property
    def is_held(self) -> bool:
        """Acquired, not released, and not known to be fenced."""
        return self._holder is not None and not self._released and self._fenced is None

    @property
    def is_fenced(self) -> bool:
        return self._fenced is not None

    def __repr__(self) -> str:
        state = "fenced" if self.is_fenced else "held" if self.is_held else "not held"
        return f"RunLock({self.storage.url(LOCK_FILE)!r}, token={self.token}, {state})"

    # ---------------------------------------------------------------- acquire
    def acquire(self, *, takeover: bool = False, same_run: bool = False) -> None:
        """Take the lock, or take it over from a holder that is provably gone.

        Called once, by the coordinator, from the thread that builds the manager;
        blocks for a few milliseconds normally, and at most ``3 * CLAIM_STALE_S``
        while other contenders race for the same lock.

        Args:
            takeover: take over from any holder, live or not (the user has made sure
                the other job is dead, or wants it fenced).
            same_run: this job declared its run id explicitly; a holder of the same
                run id is an earlier incarnation of this job and is taken over.

        Raises:
            LockHeldError: another job that may be alive holds the lock.
            LockError: the lock could not be settled within the bound.
        """
        if self._holder is not None:
            raise LockError("RunLock.acquire() called twice")
        self._check_conditional_create()
        if not self.storage.capabilities.exclusive_create:
            # s3fs-fuse, stores without conditional writes: O_EXCL holds only within
            # one client. A job started while another holds the lock is still refused,
            # and a zombie still fenced; two jobs starting in the same instant are not.
            log.warning(
                "%s (%s) has no exclusive create across clients: the run lock refuses a "
                "job started while another holds it, but cannot separate two jobs that "
                "start at the same instant; start one job per root",
                self.storage.url(""),
                self.storage.capabilities.name,
            )
        me = _Me.now(self._host)
        claimant = uuid.uuid4().hex  # identifies our claims across retries
        deadline = time.monotonic() + _ACQUIRE_TIMEOUT_S
        delay = 0.0
        waited_on = ""
        while time.monotonic() < deadline:
            # Every retry backs off: another contender is mid-way through a step we wait
            # for (its exclusive create, its replace, its release).
            time.sleep(delay)
            delay = min(max(delay * 2, 0.005), 0.2)
            read_at = time.monotonic()
            raw, holder = _parse_lock(self.storage, _read_optional(self.storage, LOCK_FILE))
            if raw is None:
                mine = self._new_doc(me, previous=None)
                # Whatever the create answered, the lock is ours if it holds our
                # generation (a random nonce): on an object store the create can land
                # and its answer be lost, and the client's retry is then refused (412).
                try:
                    self.storage.create_exclusive(LOCK_FILE, mine.to_bytes())
                except CheckpointError:
                    if not self._verify(mine):
                        raise
                if self._verify(mine):
                    self._won(mine, previous=None, reason=None)
                    return
                continue  # another job created it first: evaluate that one
            if holder is not None:
                holder = _with_heartbeat(self.storage, holder)
            # An unreadable lock either yields a reason or raises in there.
            reason = self._takeover_reason(raw, holder, me, takeover=takeover, same_run=same_run)
            if reason is None and holder is not None:
                raise self._held_error(holder)
            generation = holder.generation if holder is not None else _raw_generation(raw)
            mine = self._new_doc(me, previous=holder)
            claimed = self._claim(generation, mine, claimant)
            if claimed is None:
                # Another contender is replacing this very generation: wait for its lock
                # to appear, then judge that one.
                waited_on = generation
                continue
            if time.monotonic() - read_at > _VIEW_MAX_AGE_S:
                continue  # too old a view to act on; our claim lets us retry it
            now_raw = _read_optional(self.storage, LOCK_FILE)
            if now_raw != raw:
                continue  # released or replaced meanwhile
            self.storage.write_bytes_atomic(LOCK_FILE, mine.to_bytes())
            if self._verify(mine):
                self._won(mine, previous=holder, reason=reason)
                return
        raise LockError(
            f"could not acquire the run lock {self.storage.url(LOCK_FILE)} within "
            f"{_ACQUIRE_TIMEOUT_S:g} s: other jobs keep racing for it"
            + (f" (last waited on a takeover of generation {waited_on})" if waited_on else "")
            + ". Make sure only one job starts on this root, then start it again"
        )

    def _check_conditional_create(self) -> None:
        """Object stores: the lock is exclusive only if the store honours ``If-None-Match:
        *``, which S3-compatible servers may ignore (both creates succeed: two jobs
        starting together both held token 1) or reject; the protocol name cannot tell.
        The storage probes it once and this says what it found, in one line; where it
        is not honoured the lock refuses to run, naming the opt-out that accepts the
        risk."""
        check = getattr(self.storage, "check_conditional_create", None)
        if check is None or not self.storage.capabilities.exclusive_create:
            return
        fresh = getattr(self.storage, "conditional_create_found", None) is None
        honoured, seen = check()
        url = self.storage.url("")
        if fresh:
            log.info("conditional create (If-None-Match: *) on %s: %s", url, seen)
        if honoured:
            return
        raise LockError(
            f"cannot take the run lock on {url}: the store does not honour conditional "
            f"create (If-None-Match: *); probed: {seen}. There, two jobs starting on this "
            "root at the same time would both hold the lock, and two writers of one step "
            "could both believe they committed. Use a store that supports conditional "
            "writes, or accept the risk (start one job per root, alone) with "
            f"storage_options={{'{CONDITIONAL_CREATE_OPTION}': False}} (command line: "
            f"--storage-option {CONDITIONAL_CREATE_OPTION}=false), or "
            f"{CONDITIONAL_CREATE_ENV}=false in the environment"
        )

    def _takeover_reason(
        self,
        raw: bytes,
        holder: LockHolder | None,
        me: _Me,
        *,
        takeover: bool,
        same_run: bool,
    ) -> str | None:
        now = self._clock()
        if holder is None:
            if takeover:
                return "takeover=True was passed (the lock file was unreadable)"
            age = self._file_age_s(now)
            if age is not None and age > self.lease_s:
                return f"the lock file is unreadable and was last written {age:.0f} s ago"
            raise _unreadable_lock_error(self.storage, raw)
        if takeover:
            return "takeover=True was passed"
        gone = holder.gone_reason(now=now, host=me.host)
        if gone is not None:
            return gone
        if same_run and holder.run_id == self.run_id:
            return f"this job declared the same run id {self.run_id!r} (a restarted job)"
        if holder._is_process(me):
            return "it is an earlier CheckpointManager of this same process, not closed"
        return None

    def _file_age_s(self, now: float, path: str = LOCK_FILE) -> float | None:
        local = self.storage.local_path(path)
        modified = None if local is None else posix.mtime(local)
        return None if modified is None else now - modified

    def _held_error(self, holder: LockHolder) -> LockHeldError:
        now = self._clock()
        left = holder.lease_left_s(now)
        err = LockHeldError(
            f"checkpoint root {self.storage.url('')} is locked by another job: "
            f"{holder.describe(now)}. Only one job may write to a checkpoint root. If that "
            "job is running, stop it or give this job another root. If it is dead, its "
            f"lock is taken over automatically when its lease expires (in {left:.0f} s), "
            "or at once by a job restarted with the same explicit run_id; to take over now, "
            "pass CheckpointManager(..., takeover=True), or run `atomic-checkpoint clean "
            f"--force {self.storage.url('')}` (or delete {self.storage.url(LOCK_FILE)}) "
            "after making sure the other job is dead. A copy of a live job's root (cp, "
            "rsync) carries that job's lock, and that job writes to its own root, not to "
            "the copy: take a copy's lock over with takeover=True"
        )
        err.holder = holder  # type: ignore[attr-defined]
        return err

    def _new_doc(self, me: _Me, previous: LockHolder | None) -> LockHolder:
        last = 0
        raw = _read_optional(self.storage, TOKEN_FILE)
        if raw is not None:
            with contextlib.suppress(ValueError):
                last = int(raw.decode("ascii").strip() or 0)
        token = max(last, previous.token if previous is not None else 0) + 1
        now = self._clock()
        return LockHolder(
            run_id=self.run_id,
            host=me.host,
            pid=me.pid,
            acquired_unix=now,
            renewed_unix=now,
            lease_s=self.lease_s,
            token=token,
            nonce=uuid.uuid4().hex,
            pid_start=me.pid_start,
            boot_id=me.boot_id,
            pid_ns=me.pid_ns,
        )

    def _claim(self, generation: str, mine: LockHolder, claimant: str) -> str | None:
        """Claim the right to replace ``generation``; the claim's path, or None if a
        live contender holds it."""
        now = self._clock()
        doc = {
            "generation": generation,
            "by": claimant,
            "host": mine.host,
            "pid": mine.pid,
            "claimed_unix": now,
        }
        for k in range(_MAX_CLAIMS):
            path = f"{META_DIR}/{_CLAIM_PREFIX}{generation}.{k}.json"
            if self.storage.create_exclusive(path, json.dumps(doc).encode()):
                return path
            try:
                other = json.loads(self.storage.read_bytes(path))
                by, claimed_unix = other["by"], float(other["claimed_unix"])
            except CheckpointNotFoundError:
                return None  # vanished: re-read the lock
            except (CheckpointError, *_UNPARSEABLE):
                # Being written right now, or its claimant died between the exclusive
                # create and the write: stale only once it is old.
                age = self._file_age_s(now, path)
                if age is None or age <= CLAIM_STALE_S:
                    return None
                continue
            if by == claimant:
                return path  # ours, from an earlier round of this acquire
            if now - claimed_unix <= CLAIM_STALE_S:
                return None
            # Its claimant died between claim and replace: the next index is open.
        return None

    def _verify(self, mine: LockHolder) -> bool:
        _, holder = _parse_lock(self.storage, _read_optional(self.storage, LOCK_FILE))
        return holder is not None and holder.generation == mine.generation

    def _won(self, mine: LockHolder, previous: LockHolder | None, reason: str | None) -> None:
        with self._mutex:
            self._holder = mine
            # Counted from when the document was stamped (the time acquiring took).
            took = min(max(self._clock() - mine.renewed_unix, 0.0), self.lease_s)
            self._last_renewed = self._elapsed() - took
        url = self.storage.url("")
        if previous is not None or reason is not None:
            log.warning(
                "took over the run lock on %s from %s: %s; this job now holds it "
                "(fencing token %d): the old holder can no longer commit or delete",
                url,
                previous.describe(self._clock()) if previous else "an unreadable lock file",
                reason,
                mine.token,
            )
        else:
            log.info("acquired the run lock on %s (run %r, token %d)", url, self.run_id, mine.token)
        self._best_effort(
            "record the fencing token in",
            TOKEN_FILE,
            lambda: self.storage.write_bytes_atomic(TOKEN_FILE, f"{mine.token}\n".encode()),
        )
        self._best_effort("tidy", META_DIR, lambda: self._tidy(mine))
        if self._heartbeat:
            self._thread = threading.Thread(
                target=self._beat, name="atomic-checkpoint-lease", daemon=True
            )
            self._thread.start()
        _release_at_exit(self)

    def _tidy(self, mine: LockHolder) -> None:
        """Remove earlier holders' heartbeats and old claims (best effort: a stale
        listing on a network filesystem only delays this to a later holder).

        Claims are kept for :data:`_CLAIM_KEEP_S`, so a job restarted in a loop leaves
        one per restart; reading every one at each start made each start cost a read
        per restart of the last hour. They are read oldest generation first (the token
        in their name only grows) and the reading stops at the first one still kept:
        a start reads the claims it removes, plus one."""
        now = self._clock()
        own_lease = _lease_path(mine.nonce)
        claims: list[tuple[int, str]] = []
        for name in self.storage.listdir(META_DIR):
            path = f"{META_DIR}/{name}"
            if name.startswith(_LEASE_PREFIX) and path != own_lease:
                self._remove_quietly(path)
            elif name.startswith(PROBE_PREFIX):
                # A conditional-create probe whose delete failed (storage.fsspec).
                try:
                    created = float(json.loads(self.storage.read_bytes(path))["created_unix"])
                except (CheckpointError, *_UNPARSEABLE):
                    continue
                if now - created > PROBE_STALE_S:
                    self._remove_quietly(path)
            elif name.startswith(_CLAIM_PREFIX):
                claims.append((_claim_token(name), name))
        for _token, name in sorted(claims):
            path = f"{META_DIR}/{name}"
            try:
                claimed = float(json.loads(self.storage.read_bytes(path))["claimed_unix"])
            except (CheckpointError, *_UNPARSEABLE):
                continue
            # Claims must outlive any contender's view of their generation.
            if now - claimed <= _CLAIM_KEEP_S:
                break  # the claims of later generations are younger still
            self._remove_quietly(path)

    def _remove_quietly(self, path: str) -> None:
        self._best_effort("remove", path, lambda: self.storage.delete_file(path))

    def _best_effort(self, what: str, path: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except CheckpointError as exc:
            log.warning("run lock: could not %s %s: %s", what, self.storage.url(path), exc)

    # ---------------------------------------------------------------- fencing
    def check(self) -> None:
        """Raise FencedError unless this job still holds the lock.

        Called by the coordinator before creating a pending location, right before
        publishing a commit, and before every deletion; from the training thread or the
        rotation thread. Reads ``lock.json`` (one small read).

        Raises:
            FencedError: another job took over (or the lock was removed), or our lease
                could have expired because renewals failed.
            LockError: the lock was never acquired, or was released.
        """
        holder = self._holder
        if holder is None or self._released:
            raise LockError(f"the run lock on {self.storage.url('')} is not held by this job")
        if self._fenced is not None:
            raise FencedError(self._fenced)
        with self._mutex:
            last = self._last_renewed
        silent = self._elapsed() - last
        lease_lapsed = (
            f"this job could not renew its lease on the run lock of {self.storage.url('')} "
            f"for {silent:.0f} s (lease {self.lease_s:g} s): another job may have taken "
            "over, so this job no longer commits or deletes. Check the storage, then "
            "restart the job (it resumes from its last checkpoint)"
        )
        try:
            raw, current = _parse_lock(self.storage, _read_optional(self.storage, LOCK_FILE))
        except CheckpointError:
            if silent > self.lease_s * _SELF_FENCE_AT:
                self._fence(lease_lapsed)
            raise
        if current is not None and current.generation == holder.generation:
            # Still ours on disk, but past 5/6 of the lease without a renewal others may
            # take over any moment (clock skew): take it back as they would, or stop.
            if silent > self.lease_s * _SELF_FENCE_AT:
                self._reclaim(holder, raw, lease_lapsed)
            return
        if raw is None:
            why = (
                f"{self.storage.url(LOCK_FILE)} was removed (by `clean --force` or "
                "`prune --force`, which take the lock over and release it when done; by a "
                "job that took it over and has ended; by hand; or its root was unmounted, "
                "moved or replaced)"
            )
        elif current is None:
            why = f"{self.storage.url(LOCK_FILE)} was replaced by an unreadable file"
        else:
            why = f"it is now held by {current.describe(self._clock())}"
        if current is not None and current._is_process(_Me.now(self._host)):
            # Not another job: this process opened a second writable manager on ROOT
            # (a notebook cell run again), which took the lock over from this one.
            self._fence(
                f"this CheckpointManager (run {self.run_id!r}, fencing token {holder.token}) "
                f"lost the run lock on {self.storage.url('')} to a newer CheckpointManager "
                "of this same process, opened on the same ROOT without closing this one: "
                "only the newest can commit or delete. Use that one (and close() this), "
                "or open one manager per ROOT"
            )
        self._fence(
            f"this job (run {self.run_id!r}, fencing token {holder.token}) lost the run lock "
            f"on {self.storage.url('')}: {why}. A job that lost the lock can neither commit "
            "nor delete; stop this job"
            + (" (it was superseded)" if current is not None else ", and restart it")
        )

    def _reclaim(self, holder: LockHolder, raw: bytes | None, lapsed: str) -> None:
        """The lease lapsed (renewals failed: a full disk, a read-only remount) and
        ``lock.json`` still holds this job's generation: no job has taken ROOT over.
        Take it back the way a job taking over would, through the claim on this
        generation (which excludes a taker's own claim), with a new generation and
        fencing token. A full disk for longer than the lease fenced the job for good,
        though no one else had touched ROOT.

        Raises:
            FencedError: another job's claim or lock came first.
            CheckpointError: the storage still refuses the writes (not fenced: the next
                check, or the heartbeat, tries again).
        """
        with self._reclaiming:
            if self._holder is not holder:
                return  # another thread took it back meanwhile
            mine = self._new_doc(_Me.now(self._host), previous=holder)
            if self._claim(holder.generation, mine, self._claimant) is None:
                self._fence(lapsed)  # a job taking over holds the claim
            if _read_optional(self.storage, LOCK_FILE) != raw:
                self._fence(lapsed)  # replaced since we read it
            self.storage.write_bytes_atomic(LOCK_FILE, mine.to_bytes())
            if not self._verify(mine):
                self._fence(lapsed)
            with self._mutex:
                self._holder = mine
                self._last_renewed = self._elapsed()
        log.warning(
            "run lock on %s: this job's lease had lapsed (its renewals failed) and no other "
            "job took ROOT over: it holds the lock again (fencing token %d)",
            self.storage.url(""),
            mine.token,
        )
        self._best_effort(
            "record the fencing token in",
            TOKEN_FILE,
            lambda: self.storage.write_bytes_atomic(TOKEN_FILE, f"{mine.token}\n".encode()),
        )

    def _fence(self, message: str) -> NoReturn:
        first = False
        with self._mutex:
            if self._fenced is None:
                self._fenced, first = message, True
            message = self._fenced
        self._stop.set()
        if first:
            log.warning("%s", message)
        raise FencedError(message)

    # ---------------------------------------------------------------- heartbeat
    def renew(self) -> None:
        """Renew the lease once, if the lock is still ours (else mark us fenced).

        Called by the heartbeat thread every ``lease_s / 3`` (or by tests). Never
        raises: a failed renewal is logged, and :meth:`check` fences this job once the
        lease could have expired.
        """
        if not self.is_held:
            return
        try:
            self.check()
        except FencedError:
            return
        except CheckpointError as exc:
            log.warning(
                "run lock: could not read %s to renew: %s", self.storage.url(LOCK_FILE), exc
            )
            return
        holder = self._holder
        if holder is None:
            return
        now, stamped = self._clock(), self._elapsed()
        doc = json.dumps({"nonce": holder.nonce, "token": holder.token, "renewed_unix": now})
        try:
            self.storage.write_bytes_atomic(
                _lease_path(holder.nonce), _pad(doc.encode(), _LEASE_PAD)
            )
        except CheckpointError as exc:
            log.warning(
                "run lock: could not renew the lease on %s: %s (retrying every %.1f s)",
                self.storage.url(""),
                exc,
                self.lease_s / 3,
            )
            return
        with self._mutex:
            self._last_renewed = max(self._last_renewed, stamped)

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            self.renew()

    # ---------------------------------------------------------------- release
    def keep_at_exit(self) -> None:
        """Leave the lock to this process's end: not released by the exit hook (a
        save stuck in a storage call still runs under it, and the delete would hang
        on that storage too). The next job takes it over once the process is gone."""
        _held.discard(self)

    def release(self) -> bool:
        """Stop the heartbeat and delete the lock if it still holds our generation.

        Idempotent; called by ``CheckpointManager.close()`` on the coordinator.

        Returns:
            True if the lock file was ours and is now deleted.
        """
        holder = self._holder
        if holder is None or self._released:
            return False
        self._released = True
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        try:
            _, current = _parse_lock(self.storage, _read_optional(self.storage, LOCK_FILE))
            ours = current is not None and current.generation == holder.generation
            if ours:
                self.storage.delete_file(LOCK_FILE)
            self.storage.delete_file(_lease_path(holder.nonce))
        except CheckpointError as exc:
            log.warning(
                "could not release the run lock %s: %s (the next job takes it over when the "
                "lease expires, or at once on this host)",
                self.storage.url(LOCK_FILE),
                exc,
            )
            return False
        if ours:
            log.info("released the run lock on %s (token %d)", self.storage.url(""), holder.token)
        return ours


def _claim_token(name: str) -> int:
    """The token of the generation a claim file (``lock.takeover-<token>-<nonce>.<k>.json``)
    was made for; -1 for a name that does not parse (read first, like the oldest)."""
    try:
        return int(name[len(_CLAIM_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return -1


def _raw_generation(raw: bytes) -> str:
    """Generation id of an unreadable lock file: a digest of its bytes."""
    return "x" + hashlib.blake2b(raw, digest_size=8).hexdigest()


_held: weakref.WeakSet[RunLock] = weakref.WeakSet()
_exit_hooked_pid: int | None = None


def _release_at_exit(lock: RunLock) -> None:
    """Have ``lock`` released at interpreter exit, by one hook per process (one per
    acquisition grew without bound in a process that opens managers again and again).
    Registered at the process's first acquisition, so it runs after the async saves'
    exit hook (``async_save.register_exit``, registered at a later save_async: atexit
    runs hooks last-in, first-out): no lock is released under a save still finishing.
    In a ``multiprocessing`` child started by fork or forkserver, which ends with
    ``os._exit`` after running multiprocessing's finalizers only, a finalizer does it."""
    global _exit_hooked_pid
    _held.add(lock)
    pid = os.getpid()
    if _exit_hooked_pid == pid:
        return
    _exit_hooked_pid = pid
    atexit.register(_release_all, pid)
    on_child_exit(_release_all, pid, priority=10)


def _release_all(pid: int) -> None:
    # A forked child inherits atexit handlers; only the process that acquired releases.
    if os.getpid() != pid:
        return
    for lock in list(_held):
        lock.release()
