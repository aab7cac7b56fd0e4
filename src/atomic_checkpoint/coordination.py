"""How ranks agree: the ``Coordinator`` protocol and its implementations.

Every exchange has a unique key and a timeout, and every rank takes part: a missing
rank is named in the timeout error rather than hanging the others.

``TorchDistributedCoordinator`` moves small pickled objects through the process
group's key-value store (the TCPStore that torchrun starts), never through collectives:

- it never touches the training's collective stream, so a checkpoint barrier cannot
  deadlock with, or be killed by the watchdog of, an NCCL collective
  (FAILURE_MODES A8);
- it is safe from a background thread (async saves use a cloned store connection);
- a rank that does not arrive is named: each round keeps a list of the ranks that
  arrived.

Its rounds cost O(N) store requests for N ranks, through one single-threaded store
server (``_gather``): one rank collects every rank's key in one wait and one
``multi_get``, and writes one outcome key that every other rank reads. ``gather``
keeps the values on the collecting rank and sends every rank only a summary of them,
so its bytes are O(N) too (a save's write round); ``gather_and_route`` also sends
single ranks a value of their own (each domain's leader its members' reports, each rank
its leader's answer: several storage domains); ``all_gather`` sends every rank the
list; ``broadcast`` sends the source's value once every rank arrived; ``publish`` sends
one rank's value without waiting for the others. docs/scale.md has the counts.

Keys are ``atomic_checkpoint/<namespace>/<seq>/<rank>`` (and ``.../<seq>/arrived``).
``seq`` advances identically on every rank because every rank makes the same sequence
of calls (DESIGN invariant 3), counted by the calling thread. The human-readable ``key``
passed by the caller (``"save step 10: write"``) travels with every value, so ranks
that made different calls meet in the same round and every rank raises
``CollectiveMismatchError`` naming them, instead of reading another call's value.
Each outcome key is written once, by
whoever writes it first (see ``_gather``). A rank deletes its keys once a later round is
complete: by then every rank has finished reading them, so the store does not grow
with the run.

Timeouts count only time this process was running (``_Worker.run``): a rank frozen or
descheduled past its deadline finishes the exchange on waking and reads what the
others read. A receiver whose connection really hangs can ask ``settle`` what the
others got from a ``publish`` (through a new connection), so that it reports the same
outcome (DESIGN invariant 11).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import pickle
import queue
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CollectiveMismatchError,
    CoordinationTimeoutError,
    DistributedCheckpointError,
    FencedError,
    LockHeldError,
    RankFailure,
)

_T = TypeVar("_T")

log = logging.getLogger("atomic_checkpoint")

__all__ = [
    "Coordinator",
    "SingleProcessCoordinator",
    "TorchDistributedCoordinator",
    "default_coordinator",
    "exchange_outcomes",
    "gather_summary",
    "shared_failures",
]


@runtime_checkable
class Coordinator(Protocol):
    """Exchanges small objects between the ranks of one job.

    Every rank must call every method, in the same order (collective semantics).
    Optional: ``leave()``, called by a manager that made the coordinator when it
    closes, so that the ranks still making calls fail at once instead of waiting
    (``TorchDistributedCoordinator.leave``).
    """

    # Read-only to the library: a property or a plain attribute satisfies them.
    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, key: str, obj: Any, *, timeout_s: float) -> list[Any]:
        """Every rank contributes ``obj``; returns the list indexed by rank.

        Raises:
            CoordinationTimeoutError: some ranks did not arrive within ``timeout_s``;
                the error names them.
        """
        ...

    def broadcast(self, key: str, obj: Any, *, src: int = 0, timeout_s: float) -> Any:
        """Returns ``src``'s ``obj`` on every rank (others pass anything, e.g. None)."""
        ...

    def clone(self) -> Coordinator:
        """A coordinator with its own connection and key namespace, for a background
        thread. Called on every rank in the same order."""
        ...


class SingleProcessCoordinator:
    """One process, no exchange."""

    rank = 0
    world_size = 1

    def all_gather(self, key: str, obj: Any, *, timeout_s: float) -> list[Any]:
        return [obj]

    def broadcast(self, key: str, obj: Any, *, src: int = 0, timeout_s: float) -> Any:
        return obj

    def clone(self) -> SingleProcessCoordinator:
        return self


#: How long past its own timeout an exchange may take before this rank counts as cut off.
_STALL_GRACE_S = 5.0

#: A coordinator's worker thread ends after this long without work.
_WORKER_IDLE_S = 30.0

#: At interpreter exit, how long in all the workers' queued store requests may take.
_EXIT_DRAIN_S = 5.0

#: The caller waits for its worker in slices this long; a slice that ends more than
#: ``_NOT_RUNNING_S`` late means this process was not running (frozen, descheduled).
_WAIT_SLICE_S = 0.25
_NOT_RUNNING_S = 1.0

#: How long a rank waits in a round before it looks for a cause (once per round; only
#: where ``timeout_s`` is over twice this, else the timeout itself comes soon enough).
#: The collecting rank logs who is missing: a collective call made on some ranks only
#: (``if rank == 0: mgr.save(...)``) otherwise showed nothing until the timeout, 600 s
#: by default. The collecting rank and the ranks waiting for a published value also
#: announce their call in the round (``_announce``): ranks in different calls that each
#: wait for a message the other never sends (rank 0 collecting the arguments of a
#: ``rollback()`` under ``if rank == 0:``, the others waiting for their leader's answer
#: in ``save()``) read nothing of each other's, and found the mismatch only at the
#: timeout. The ranks that wait for a collected outcome (most ranks, in a save's slow
#: write round) do neither: each would cost a request and a line in the job's log.
SLOW_ROUND_S = 60.0

#: Written into the key of a rank that did not arrive in time, followed by
#: ``<rank that gave up>|<ranks missing>|<its call's key>``. Values are tagged (``_tag``)
#: and start with the 4-byte length of their key, which is never this long.
_GAVE_UP = b"\x00atomic-checkpoint-gave-up:"

#: How many rounds in a row a call skips as taken by calls other ranks made without
#: this one (``_rounds``), before it fails.
_MOST_TAKEN_ROUNDS = 16

#: The outcome of a round whose ranks made different calls, followed by the pickled
#: ``{rank: key}``.
_MISMATCH = b"\x00atomic-checkpoint-mismatch:"


def ranks_text(ranks: Sequence[int], most: int = 16) -> str:
    """``[1, 2, 3]``; past ``most`` ranks, the first ``most`` and how many in all."""
    if len(ranks) <= most:
        return str(list(ranks))
    return f"[{', '.join(map(str, ranks[:most]))}, ...] ({len(ranks)} ranks)"


def _delete_keys(store: Any, keys: list[str]) -> None:
    for k in keys:
        store.delete_key(k)


def _gave_up_mark(rank: int, missing: Sequence[int], key: str) -> bytes:
    return _GAVE_UP + f"{rank}|{','.join(map(str, missing))}|{time.time():.6f}|{key}".encode()


def _gave_up_by(raw: bytes) -> tuple[str, tuple[int, ...], str]:
    """A give-up mark's rank that gave up, ranks it names, and the call it was in."""
    by, late, _, key = _gave_up_fields(raw)
    return by, late, key


def _gave_up_fields(raw: bytes) -> tuple[str, tuple[int, ...], float, str]:
    """A give-up mark's fields: ``_gave_up_by``'s, and when (Unix time) it was made."""
    by, _, rest = raw[len(_GAVE_UP) :].decode(errors="replace").partition("|")
    listed, _, rest = rest.partition("|")
    when, _, key = rest.partition("|")
    return by, tuple(int(r) for r in listed.split(",") if r), float(when or 0), key


def _tag(key: str, payload: bytes) -> bytes:
    """``payload`` as stored: after the call's ``key``, so a rank that reads a value
    knows which call sent it."""
    k = key.encode()
    return len(k).to_bytes(4, "big") + k + payload


def _untag(raw: bytes) -> tuple[str, bytes]:
    n = int.from_bytes(raw[:4], "big")
    return raw[4 : 4 + n].decode(errors="replace"), raw[4 + n :]


_DIGITS = re.compile(r"\d+")


def _same_call(a: str, b: str) -> bool:
    """Whether keys ``a`` and ``b`` name the same call, whatever its numbers: ranks that
    save different steps meet in the same call, whose own check of the steps then
    says so (``"save step 10: prepare"`` and ``"save step 11: prepare"``)."""
    return a == b or _DIGITS.sub("#", a) == _DIGITS.sub("#", b)


def _mismatch_in_mark(raw: bytes, key: str, rank: int) -> CollectiveMismatchError | None:
    """The mismatch a give-up mark ``raw`` shows, or None: the rank that gave up was in
    another call than this rank's ``key`` (both sides waited on different keys)."""
    by, _, their_key = _gave_up_by(raw)
    if _same_call(their_key, key):
        return None
    return _mismatch({int(by): their_key, rank: key}, rank)


class _RoundTaken(Exception):
    """This rank's call arrived in a round that ranks in another call had already
    abandoned: they gave up waiting for this rank there (``_taken_by_lone_call``).
    Raised on the worker thread and caught by ``_rounds``, which runs the call again
    in the next round."""


def _taken_by_lone_call(raw: bytes, key: str, rank: int, arrived_unix: float) -> bool:
    """Whether ``raw``, read in a round this rank arrived at in call ``key`` at
    ``arrived_unix``, is the give-up mark of a call other ranks made without this one:
    a rank in another call gave up waiting for this rank there before this rank
    arrived. Such a call (``checkpoints()`` under ``if rank == 0:``) took a round number
    on its ranks alone; counted as this rank's too, it put every later call one round
    out of step, so each failed for good. It failed on its ranks already (they timed
    out); this rank's call belongs to the next round. A mark made while this rank
    waited there is two calls that met (each rank in its own): their mismatch, as
    before. (Marks hold the wall-clock time: across hosts, clocks apart by more than
    the gap between the two events can take one case for the other.)"""
    if not raw.startswith(_GAVE_UP):
        return False
    by, late, when, their_key = _gave_up_fields(raw)
    return (
        by != str(rank) and rank in late and when < arrived_unix and not _same_call(their_key, key)
    )


def _store_failed(rank: int, key: str, exc: BaseException) -> CheckpointError:
    """A store call that failed (not a timeout). A connection the store closed is its
    host gone: rank 0 hosts the TCPStore unless an agent (torchrun) does, so a rank 0
    that died showed the survivors only "Failed to recv, got 0 bytes"."""
    text = str(exc)
    gone = any(
        w in text.lower() for w in ("recv", "connection", "broken pipe", "reset by peer", "closed")
    )
    why = (
        ": the store's host went away (rank 0, which hosts the store unless torchrun's "
        "agent does, died or cannot be reached): restart the job, which resumes from "
        "its newest complete checkpoint"
        if gone
        else ""
    )
    return CheckpointError(f"rank {rank}: coordination store failed at {key!r}: {text}{why}")


def _mismatch(calls: dict[int, str], rank: int) -> CollectiveMismatchError:
    """The error of a round in which the ranks made different calls (``calls``: what
    each rank known to differ was doing)."""
    by_call: dict[str, list[int]] = {}
    for r, k in sorted(calls.items()):
        by_call.setdefault(k, []).append(r)
    listed = "; ".join(
        f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))} in {k!r}"
        for k, rs in by_call.items()
    )
    left = ""
    if LEFT_CALL in calls.values():
        left = (
            f" A rank in {LEFT_CALL!r} has closed its manager (close(), the end of its "
            "with block, or an exception that left it) and makes no more calls."
        )
    return CollectiveMismatchError(
        f"rank {rank}: the ranks made different collective calls at the same point "
        f"({listed}).{left} Every rank must call the checkpoint methods (save, save_async, "
        "restore, latest, checkpoints, rollback, apply_retention, close...) in the same "
        "order with the same step; a call made on some ranks only (under "
        "`if rank == 0:`) puts them out of step. For a rank-local look at ROOT, open "
        "another manager with read_only=True and coordinator=SingleProcessCoordinator()",
        calls=calls,
    )


#: The call a rank that left (its manager closed) is "in" for the rounds it skips.
LEFT_CALL = "close()"

#: How many rounds ``leave`` fills: a save takes two or three, so a rank that goes on
#: saving after another one left fails at once in each of several saves.
_LEAVE_ROUNDS = 16

#: How long ``leave`` may take.
_LEAVE_TIMEOUT_S = 5.0

#: What ``_give_up`` expects in a round's arrival list, to read it without waiting for it:
#: a missing key answers with the expected value; real lists are digits and commas.
_NO_LIST = b"\x01none"


def _pack_list(raws: list[bytes]) -> bytes:
    """An all-gather's outcome: every rank's pickled value, equal neighbours stored once
    (most rounds send the leader's answer and the same ``None`` from every other rank,
    so this stays small however many ranks there are)."""
    runs: list[list[Any]] = []
    for b in raws:
        if runs and runs[-1][0] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return pickle.dumps(runs, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack_list(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for b, n in pickle.loads(raw):
        out.extend(pickle.loads(b) for _ in range(n))  # one object per rank, as sent
    return out


class _Worker:
    """One daemon thread that runs a coordinator's store requests in order.

    A persistent thread rather than one per exchange: starting a thread per round cost
    more than the round's store requests (8 ranks on 2 cores: 1.28 ms per all-gather
    with a thread per round and six requests, 0.56 ms for four requests in the calling
    thread). Jobs queue behind a stuck one, so once a request hangs every later ``run``
    times out too, and the coordinator counts itself stalled.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = -1
        self._lock = threading.Lock()
        _WORKERS.add(self)

    def _loop(self, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            try:
                fn, box, done = jobs.get(timeout=_WORKER_IDLE_S)
            except queue.Empty:
                # Idle: end the thread (a manager may be dropped without close()); the
                # next job starts a new one. Decided under the lock jobs are queued under.
                with self._lock:
                    if jobs.empty():
                        if self._jobs is jobs:
                            self._thread = None
                        return
                continue
            try:
                value = (True, fn())
            except BaseException as exc:  # handed to the caller; dropped if deferred
                value = (False, exc)
            if box is not None:
                box.append(value)
                done.set()

    def _submit(self, item: tuple[Any, Any, Any]) -> None:
        with self._lock:
            # A forked child inherits no threads: it starts its own.
            if self._thread is None or self._pid != os.getpid():
                self._jobs = queue.SimpleQueue()
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._loop,
                    args=(self._jobs,),
                    name="atomic-checkpoint-exchange",
                    daemon=True,
                )
                self._thread.start()
            self._jobs.put(item)

    def run(self, fn: Any, timeout_s: float) -> tuple[bool, Any]:
        """Run ``fn`` on the worker: (True, (ok, value or exception)), or (False, None)
        if it did not finish within ``timeout_s`` of this process's running time.

        Time during which this process could not run does not count: a process frozen
        (SIGSTOP, a debugger, a cgroup freezer) or descheduled for long on a loaded
        machine wakes up with every deadline passed, its worker thread included, and
        would declare a store that answered long ago "not answering" before the worker
        even got the CPU to read the answer, and fail while the other ranks succeed.
        The wait goes in slices; a slice that returns much later than asked marks time
        this process was not running, and the deadline moves by that much. Within it,
        the exchange itself decides (late ranks find give-up marks, see
        ``_all_gather``), the same way on every rank.
        """
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._submit((fn, box, done))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False, None
            ask = min(left, _WAIT_SLICE_S)
            t = time.monotonic()
            if done.wait(ask):
                return True, box[0]
            overslept = time.monotonic() - t - ask
            if overslept > _NOT_RUNNING_S:
                deadline += overslept

    def defer(self, fn: Any) -> None:
        """Run ``fn`` on the worker after what is queued; its errors are ignored (best
        effort clean-up)."""
        self._submit((fn, None, None))

    def drain(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until what is queued (deferred key deletions)
        has run; whether it has. Not collective; a worker that is not running returns
        True at once."""
        with self._lock:
            if self._thread is None or self._pid != os.getpid():
                return True
        done = threading.Event()
        self._submit((lambda: None, [], done))
        return done.wait(timeout_s)


_WORKERS: weakref.WeakSet[_Worker] = weakref.WeakSet()


@atexit.register
def _drain_workers() -> None:
    """At interpreter exit, let every worker finish its queued store requests.

    Workers are daemon threads, and the last round's key deletions are deferred to
    them. A process that exits right after an exchange (the end of a training loop
    guarded by ``PreemptionGuard``, whose ``should_save`` exchanges at every step)
    would otherwise tear the interpreter and torch's store client down while the worker
    is inside a store request: the process then aborts (``terminate called without an
    active exception``, SIGABRT) instead of exiting 0, and its launcher reports the
    job as failed. atexit handlers run before that teardown, while threads still run.
    """
    drain_workers(_EXIT_DRAIN_S)


def drain_workers(within_s: float) -> bool:
    """Let every worker of this process finish its queued store requests, waiting at
    most ``within_s`` in all; whether they did. A worker still inside a round that
    waits for other ranks (an async save left running by ``close(timeout_s=)``) does
    not finish: ``PreemptionGuard.exit`` then ends the process at once rather than
    wait past the grace period."""
    deadline = time.monotonic() + within_s
    drained = True
    for worker in list(_WORKERS):
        drained = worker.drain(max(0.0, deadline - time.monotonic())) and drained
    return drained


_namespace_lock = threading.Lock()
_namespace_counter = 0


def _incarnation() -> str:
    """What sets this process's keys apart from those of the job's earlier incarnations
    in the same store. torchrun with ``--max-restarts`` restarts the workers in place,
    and with its c10d rendezvous they connect to the agent's store again, where the
    last incarnation's keys are still there: the new processes number their managers
    and rounds from 1 again, so a rank read the old outcome of its round (a save that
    returned the last incarnation's step, on one rank only). ``TORCHELASTIC_RESTART_COUNT``
    is the same on every worker of one incarnation."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "" if count in ("", "0") else f"restart{count}/"


def _next_namespace() -> int:
    """Namespaces are handed out in creation order, identical on every rank as long as
    every rank creates its managers in the same order (which collective use requires)."""
    global _namespace_counter
    with _namespace_lock:
        _namespace_counter += 1
        return _namespace_counter


class TorchDistributedCoordinator:
    """Coordination through an initialised ``torch.distributed`` process group's store.

    Args:
        store: the store to meet through; default: the default process group's.
        rank, world_size: default: the process group's.
        namespace: the prefix of this coordinator's keys in the store. Every rank must
            use the same one. The default is made from a counter of coordinators made
            in this process (and the job's incarnation), so it agrees across ranks that
            are one process each and create their coordinators in the same order; ranks
            that share a process (threads, each with its own store client) must pass
            one explicitly, or they never meet.
    """

    def __init__(
        self,
        store: Any = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        namespace: str | None = None,
    ):
        import torch.distributed as dist

        if store is None:
            if not dist.is_available() or not dist.is_initialized():
                raise CheckpointError(
                    "TorchDistributedCoordinator needs an initialised process group: call "
                    "torch.distributed.init_process_group() first (or use torchrun)"
                )
            store = dist.distributed_c10d._get_default_store()
        self._store = store
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self._ns = namespace or f"atomic_checkpoint/{_incarnation()}{_next_namespace()}"
        self._seq = 0
        self._arrived_unix = 0.0  # when this rank began its current round (``_rounds``)
        self._last_publish: tuple[int, int, str] | None = None  # (round, src, key): ``settle``
        self._clones = 0
        self._stalled = False
        self._worker = _Worker()
        # Keys this rank published, to delete once every rank is known to have read them.
        self._read_by_all: list[str] = []
        # Keys ``dst`` wrote for single ranks in the current round (``gather_and_route``).
        self._routed_keys: list[str] = []

    def _keys(self, seq: int) -> list[str]:
        return [f"{self._ns}/{seq}/{r}" for r in range(self.world_size)]

    def all_gather(self, key: str, obj: Any, *, timeout_s: float) -> list[Any]:
        """All-gather through the store, with a hard deadline even if the store never
        answers: rank 0 collects every value and publishes the list (``_gather``), so a
        round costs O(N) store requests; the list itself reaches every rank, so use
        ``gather`` where only one rank needs the values.

        A rank cut off from the store by a network partition (link down, no reset)
        blocks inside TCPStore: its ``wait`` times out, then its next request waits for
        a reply until the kernel abandons the connection, many minutes later (seen
        with torch 2.13 across two network namespaces). So the exchange runs on this
        coordinator's worker thread; past ``timeout_s`` + a grace period this rank
        gives up, marks itself stalled (the stuck thread still holds the connection, so
        nothing more is sent through it) and raises; later exchanges fail at once.
        """
        seq = self._next_round(key)
        _, raw = self._rounds(
            key, seq, lambda n: self._gather(key, obj, 0, timeout_s, n, _pack_list), timeout_s
        )
        return _unpack_list(raw)

    def gather(self, key: str, obj: Any, **options: Any) -> tuple[list[Any] | None, Any]:
        """Deprecated (it warns; removed in 0.2): ``gather_and_route`` with the same
        arguments, of which it returns the first two values."""
        warnings.warn(
            "TorchDistributedCoordinator.gather is deprecated and will be removed in 0.2: "
            "call gather_and_route with the same arguments and take its first two values",
            DeprecationWarning,
            stacklevel=2,
        )
        values, reduced, _ = self.gather_and_route(key, obj, **options)
        return values, reduced

    def gather_and_route(
        self,
        key: str,
        obj: Any,
        *,
        dst: int,
        timeout_s: float,
        reduce: Callable[[list[Any]], Any],
        route: Callable[[list[Any]], dict[int, Any] | None] | None = None,
        routed: bool = False,
    ) -> tuple[list[Any] | None, Any, Any]:
        """Every rank contributes ``obj``; ``dst`` gets the list indexed by rank, and
        every rank gets ``reduce(list)``, computed once on ``dst``: O(N) store requests
        and, for a small ``reduce`` result, O(N) bytes per round (a save's write round,
        whose reports only the leader needs). Besides, one value for some ranks alone:
        ``route(list)``, computed once on ``dst``, maps a rank to what only it receives
        (None: nothing for anyone, e.g. the round failed). A rank that passes
        ``routed=True`` reads its value, and must then be in ``route``'s answer
        whenever it is not None. Returns ``(list on dst else None, reduced, this
        rank's routed value or None)``.

        With several storage domains, each domain's leader needs its members' reports
        and each rank its own leader's answer: sent this way, a round puts O(N) bytes
        through the store, where an all-gather of the same values (every rank reading
        every value) put O(N^2). ``dst`` writes the routed keys before the outcome, so
        a rank that read the outcome finds its key; each is one more request for the
        rank that reads it (and one to delete it, off the caller's path), and ``dst``
        writes them in one ``multi_set``.

        Raises:
            CoordinationTimeoutError: some ranks did not arrive within ``timeout_s``
                (``dst`` among them if it never answered); the same ranks are named on
                every rank.
        """
        box: list[Any] = []

        def exchange(seq: int) -> tuple[bool, Any, Any]:
            def outcome_of(raws: list[bytes]) -> bytes:
                values = [pickle.loads(b) for b in raws]
                private = route(values) if route is not None else None
                box[:] = [values, None if private is None else private.get(self.rank)]
                if private:
                    self._send_routed(seq, private)
                return pickle.dumps(
                    (private is not None, reduce(values)), protocol=pickle.HIGHEST_PROTOCOL
                )

            _, raw = self._gather(key, obj, dst, timeout_s, seq, outcome_of)
            sent, reduced = pickle.loads(raw)
            mine = None
            if box:
                mine = box[1]
            elif sent and routed:
                own = self._routed_key(seq, self.rank)
                mine = pickle.loads(self._store.get(own))
                # Read by this rank alone: it goes now, off the caller's path.
                self._worker.defer(functools.partial(_delete_keys, self._store, [own]))
            return sent, reduced, mine

        _, reduced, mine = self._rounds(key, self._next_round(key), exchange, timeout_s)
        return (box[0] if box else None), reduced, mine

    def _routed_key(self, seq: int, rank: int) -> str:
        return f"{self._ns}/{seq}/to/{rank}"

    def _send_routed(self, seq: int, private: dict[int, Any]) -> None:
        """On ``dst``, before the outcome: the routed values of the other ranks."""
        keys, values = [], []
        for r, v in private.items():
            if r != self.rank:
                keys.append(self._routed_key(seq, r))
                values.append(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))
        if not keys:
            return
        multi_set = getattr(self._store, "multi_set", None)
        if multi_set is not None:
            multi_set(keys, values)
        else:
            for k, v in zip(keys, values, strict=True):
                self._store.set(k, v)
        self._routed_keys = keys

    def publish(self, key: str, obj: Any, *, src: int, timeout_s: float) -> Any:
        """``src`` passes ``obj`` (it does not wait for anyone); every rank gets it. One
        key in the store, read by every rank (an ``all_gather`` has every rank read
        every rank's key); deleted after the next ``all_gather``, when every rank has
        read it.

        Raises:
            CoordinationTimeoutError: on a receiver, ``src`` did not publish within
                ``timeout_s``; on ``src``, a receiver gave up waiting before it
                published (every rank then raises). A receiver can then ask ``settle``
                what the round's outcome is for the others.
        """
        self._last_publish = None  # set only once this round is really attempted
        seq = self._next_round(key)

        def attempt(n: int) -> Any:
            self._last_publish = (n, src, key)
            return self._publish(key, obj, src, timeout_s, n)

        return self._rounds(key, seq, attempt, timeout_s)

    def settle(self, key: str, *, src: int, timeout_s: float) -> tuple[str, Any]:
        """After ``publish`` raised ``CoordinationTimeoutError`` on a receiver: what did
        the other receivers get? ``("value", obj)``: ``src`` published ``obj``, so every
        rank that read it goes on with it; ``("failed", None)``: a give-up mark holds
        the key, so ``src``'s publish failed too and every rank raises; ``("unknown",
        None)``: the store cannot be reached from here (then only the storage can tell).

        A receiver that gave up in the exchange itself wrote the give-up mark (the round
        failed for everyone), unless ``src``'s value came first: then the exchange
        returned it and raised nothing. So only a receiver whose exchange thread did not
        come back (its store connection hangs) needs a look: through a new connection,
        with a bounded wait, marking the key given-up if it is still empty so that
        ``src`` cannot publish into it afterwards.
        """
        last = self._last_publish
        if last is None or last[1:] != (src, key):
            return ("unknown", None)  # that round was never attempted (stalled before)
        if not self._stalled:
            return ("failed", None)
        clone = getattr(self._store, "clone", None)
        if clone is None:
            return ("unknown", None)  # the only connection is the one that hangs
        slot = self._keys(last[0])[src]
        mark = _gave_up_mark(self.rank, (src,), key)
        box: list[Any] = []

        def look() -> None:
            box.append(clone().compare_set(slot, "", mark))

        t = threading.Thread(target=look, name="atomic-checkpoint-settle", daemon=True)
        t.start()
        t.join(max(timeout_s, 0.001))
        if not box:
            return ("unknown", None)
        raw = box[0]
        if raw.startswith((_GAVE_UP, _MISMATCH)):
            return ("failed", None)
        sent_by, payload = _untag(raw)
        if not _same_call(sent_by, key):
            return ("failed", None)  # another call's value: every rank fails this round
        return ("value", pickle.loads(payload))

    def _next_round(self, key: str) -> int:
        """The round number of the next exchange. Advanced by the calling thread, in
        call order (identical on every rank), and only for an exchange that is really
        attempted: a stalled coordinator refuses before it takes a number."""
        if self._stalled:
            self._refuse(key)
        self._seq += 1
        return self._seq

    def _refuse(self, key: str) -> None:
        raise CoordinationTimeoutError(
            f"rank {self.rank}: the coordination store stopped answering during an "
            f"earlier exchange, so {key!r} is not attempted; restart the job once the "
            "network is back",
            key=key,
        )

    def _run(self, key: str, fn: Any, timeout_s: float) -> Any:
        if self._stalled:
            self._refuse(key)
        limit_s = timeout_s + _STALL_GRACE_S
        done, box = self._worker.run(fn, limit_s)
        if not done:
            self._stalled = True
            raise CoordinationTimeoutError(
                f"rank {self.rank}: the coordination store did not answer at {key!r} within "
                f"{limit_s:g} s: this rank is probably cut off from it (network partition). "
                "It stops coordinating; restart the job once the network is back",
                key=key,
            )
        ok, result = box
        if ok:
            return result
        if isinstance(result, CheckpointError) or not isinstance(result, Exception):
            raise result
        raise _store_failed(self.rank, key, result) from result

    def _rounds(self, key: str, seq: int, attempt: Callable[[int], _T], timeout_s: float) -> _T:
        """``attempt(seq)`` on the worker thread (``_run``); if round ``seq`` turns out
        to be one that ranks in another call abandoned without this rank
        (``_RoundTaken``: a call they made alone), this rank's call goes to the next
        round, and so on: it meets the other ranks' same call there."""

        def rounds() -> _T:
            n = seq
            for _ in range(_MOST_TAKEN_ROUNDS):
                self._arrived_unix = time.time()
                try:
                    return attempt(n)
                except _RoundTaken:
                    log.warning(
                        "rank %d: other ranks made a call without this rank in round %d "
                        "and gave up waiting for it there; %r goes on in the next round",
                        self.rank,
                        n,
                        key,
                    )
                    n = self._seq = n + 1
            raise CoordinationTimeoutError(
                f"rank {self.rank}: {_MOST_TAKEN_ROUNDS} rounds in a row before {key!r} were "
                "calls other ranks made without this one: every rank must make the same "
                "collective calls, in the same order (not only the rank under `if rank == 0:`)",
                key=key,
            )

        return self._run(key, rounds, timeout_s)

    def _taken(self, raw: bytes, key: str) -> bool:
        """``_taken_by_lone_call`` for this rank, in the round it is attempting."""
        return _taken_by_lone_call(raw, key, self.rank, self._arrived_unix)

    def _claim(self, slot: str, obj: Any, key: str, timeout_s: float, seq: int) -> bytes:
        """Write ``obj`` into this rank's ``slot`` unless a rank that gave up waiting
        for it marked it first; then this rank is late, and fails like the others. A
        rank in another call may have written the slot first (its outcome, in a round
        it collects): ``CollectiveMismatchError``."""
        mine = _tag(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        stored = self._store.compare_set(slot, "", mine)
        if stored != mine:
            if self._taken(stored, key):
                raise _RoundTaken
            if not stored.startswith(_GAVE_UP):
                self._check_call(key, stored, slot, seq)  # raises: another call wrote it
            mismatch = _mismatch_in_mark(stored, key, self.rank)
            if mismatch is not None:
                raise mismatch
            raise CoordinationTimeoutError(
                f"rank {self.rank} arrived at {key!r} after rank {_gave_up_by(stored)[0]} gave "
                f"up waiting for it ({timeout_s:g} s): this rank stalled (frozen, "
                "descheduled or on slow storage), so the exchange failed for every rank",
                missing_ranks=(self.rank,),
                key=key,
            )
        return mine

    def _give_up_on(self, key: str, keys: dict[int, str]) -> dict[int, bytes]:
        """After a timeout: write a give-up mark into every key in ``keys`` that is still
        empty; returns what each key holds now (a value that arrived meanwhile stands)."""
        mark = _gave_up_mark(self.rank, tuple(keys), key)
        return {r: self._store.compare_set(k, "", mark) for r, k in keys.items()}

    def _check_call(self, key: str, raw: bytes, slot: str, seq: int) -> bytes:
        """The payload of ``raw``, a value read at ``slot`` in round ``seq`` for this
        rank's call ``key``.

        Ranks in different calls can meet in any kind of round, and not every rank
        reads every key: a rank that publishes goes on to the next round without
        waiting. So the mismatch is found by whoever reads a value of another call (or
        collects the values), and it then also fills every key of the next round with
        the mismatch: each rank fails in this round or the next, and every rank of
        this round skips the next one, so all start their next call in the same
        round.

        Raises:
            CollectiveMismatchError: it is the outcome of a round whose ranks made
                different calls, or a value another call sent (its rank was in
                another call when it wrote this key).
        """
        if raw.startswith(_MISMATCH):
            origin, calls = pickle.loads(raw[len(_MISMATCH) :])
            if origin == seq:
                self._seq = seq + 1  # filled with this mismatch: nobody waits in it
            raise _mismatch(calls, self.rank)
        sent_by, payload = _untag(raw)
        if not _same_call(sent_by, key):
            owner = int(slot.rsplit("/", 1)[1])
            mark = self._mismatch_mark(seq, {owner: sent_by, self.rank: key})
            return self._check_call(key, mark, slot, seq)
        return payload

    def _mismatch_mark(self, seq: int, calls: dict[int, str]) -> bytes:
        """The mismatch found in round ``seq``, also written into every empty key of
        the next round (see ``_check_call``)."""
        mark = _MISMATCH + pickle.dumps((seq, calls), protocol=pickle.HIGHEST_PROTOCOL)
        for k in self._keys(seq + 1):
            self._store.compare_set(k, "", mark)
        return mark

    def _publish(self, key: str, obj: Any, src: int, timeout_s: float, seq: int) -> Any:
        slot = self._keys(seq)[src]
        if self.rank == src:
            self._claim(slot, obj, key, timeout_s, seq)
            self._read_by_all.append(slot)
            return obj
        try:
            self._await([slot], key, seq, timeout_s, look="announce")
            raw = self._store.get(slot)
        except Exception as exc:  # DistStoreError (a RuntimeError) on timeout
            try:
                raw = self._give_up_on(key, {src: slot})[src]
            except Exception as exc2:  # pragma: no cover - the store itself failed
                raise _store_failed(self.rank, key, exc2) from exc
            if raw.startswith(_GAVE_UP) and _gave_up_by(raw)[0] == str(self.rank):
                raise CoordinationTimeoutError(
                    f"rank {self.rank}: rank {src} did not answer at {key!r} within "
                    f"{timeout_s:g} s (it crashed, hung, or is still working on slow "
                    "storage; raise timeout_s if saves legitimately take longer)",
                    missing_ranks=(src,),
                    key=key,
                ) from exc
        if self._taken(raw, key):
            raise _RoundTaken
        if raw.startswith(_GAVE_UP):
            # A rank in another call (collecting in this slot) may have given up on this one.
            mismatch = _mismatch_in_mark(raw, key, self.rank)
            if mismatch is not None:
                raise mismatch
            raise CoordinationTimeoutError(
                f"rank {self.rank}: rank {src} did not answer at {key!r} in time: rank "
                f"{_gave_up_by(raw)[0]} gave up waiting for it ({timeout_s:g} s)",
                missing_ranks=(src,),
                key=key,
            )
        return pickle.loads(self._check_call(key, raw, slot, seq))

    def _gather(
        self,
        key: str,
        obj: Any,
        dst: int,
        timeout_s: float,
        seq: int,
        outcome_of: Callable[[list[bytes]], bytes],
    ) -> tuple[list[bytes] | None, bytes]:
        """One round, on the worker thread: ``dst`` collects, every rank reads one outcome.

        Returns every rank's pickled value (on ``dst``; None elsewhere) and the outcome
        ``dst`` computed from them (``outcome_of``), the same on every rank.

        Store requests, everyone on time: a rank other than ``dst`` sets its key,
        appends its rank to the round's arrival list, waits for the outcome key and
        reads it (4, plus the deferred delete of its key); ``dst`` appends itself, waits
        for every key at once, reads them in one ``multi_get`` and writes the outcome
        (4). So O(N) requests and O(N) bytes per round, where reading every rank's key
        on every rank cost N^2 of both.

        The outcome key is written once, by whoever writes it first (``compare_set``
        with an empty expected value): ``dst`` with the outcome, or a rank that gave up
        waiting (``_give_up``), which writes a give-up mark naming the ranks missing
        from the arrival list. Every rank that finishes the round reads that one value,
        so every rank returns the same outcome or raises naming the same ranks (DESIGN
        invariant 4); a rank arriving after the mark (frozen, descheduled) finds it and
        fails like the others. Each rank waits ``timeout_s`` from its own arrival, as
        every rank did when each read every key: a missing rank is named by whoever
        gives up first, ``dst`` included, and a ``dst`` that never answers by the others.
        """
        keys = self._keys(seq)
        out_key = keys[dst]
        values: list[bytes] | None = None
        self._routed_keys = []
        mine = _tag(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        if self.rank != dst:
            # Set before appended: a rank on the arrival list has its value in place.
            self._store.set(keys[self.rank], mine)
            self._store.append(self._arrivals(seq), f"{self.rank},".encode())
            try:
                self._await([out_key], key, seq, timeout_s)
                raw = self._store.get(out_key)
            except Exception as exc:  # DistStoreError (a RuntimeError) on timeout
                raw = self._give_up(key, seq, dst, exc)
        else:
            others = [k for r, k in enumerate(keys) if r != dst]
            self._store.append(self._arrivals(seq), f"{self.rank},".encode())
            raw = b""
            try:
                if others:
                    self._await(others, key, seq, timeout_s, look="collecting")
            except Exception as exc:  # DistStoreError (a RuntimeError) on timeout
                raw = self._give_up(key, seq, dst, exc)
            if not raw:  # everyone arrived (perhaps just as this rank gave up)
                got = iter(self._store.multi_get(others) if others else ())
                values = [mine if r == dst else next(got) for r in range(self.world_size)]
                marked = next((v for v in values if v.startswith(_MISMATCH)), None)
                if any(v.startswith(_GAVE_UP) for v in values):
                    # Marked by the rank that gave up on their owners, after it marked
                    # the outcome key: the round failed.
                    raw, values = self._store.get(out_key), None
                elif marked is not None:  # a mismatch in the round before: this one fails
                    raw, values = self._store.compare_set(out_key, "", marked), None
                else:
                    calls = [_untag(v) for v in values]
                    if all(_same_call(k, key) for k, _ in calls):
                        values = [payload for _, payload in calls]
                        outcome = _tag(key, outcome_of(values))
                    else:
                        # Another call's value: first, did its ranks abandon this round
                        # (a call they made alone)? Then it is not this call's round.
                        peek = self._store.compare_set(out_key, _NO_LIST, _NO_LIST)
                        if self._taken(peek, key):
                            raise _RoundTaken
                        called = {r: k for r, (k, _) in enumerate(calls)}
                        outcome, values = self._mismatch_mark(seq, called), None
                    raw = self._store.compare_set(out_key, "", outcome)
        routed, self._routed_keys = self._routed_keys, []
        if raw.startswith(_GAVE_UP):
            if routed:  # written just before a rank's give-up mark won: nobody reads them
                self._worker.defer(functools.partial(_delete_keys, self._store, routed))
            if self._taken(raw, key):
                if self.rank != dst:  # nobody reads this rank's value there
                    self._worker.defer(
                        functools.partial(_delete_keys, self._store, [keys[self.rank]])
                    )
                raise _RoundTaken
            raise self._missing_error(key, raw, dst, timeout_s)
        payload = self._check_call(key, raw, out_key, seq)
        # The outcome is out, so every rank has arrived in this round and finished every
        # earlier one: this rank's key of this round (read by ``dst`` before it wrote the
        # outcome) and what it published earlier can go, off the caller's path.
        done = self._read_by_all
        self._read_by_all = [out_key, self._arrivals(seq)] if self.rank == dst else []
        if self.rank != dst:
            done = [*done, keys[self.rank]]
        if done:
            self._worker.defer(functools.partial(_delete_keys, self._store, done))
        return values, payload

    def _arrivals(self, seq: int) -> str:
        return f"{self._ns}/{seq}/arrived"

    def _arrived(self, seq: int) -> set[int]:
        """The ranks on round ``seq``'s arrival list, read without waiting for it."""
        seen = self._store.compare_set(self._arrivals(seq), _NO_LIST, _NO_LIST)
        return set() if seen == _NO_LIST else {int(r) for r in seen.split(b",") if r}

    def _await(
        self, keys: list[str], key: str, seq: int, timeout_s: float, *, look: str = ""
    ) -> None:
        """Wait up to ``timeout_s`` for every key in ``keys`` (round ``seq``, this rank in
        call ``key``); raises the store's timeout error.

        ``look``: what this rank does once the round has taken ``SLOW_ROUND_S``
        (where ``timeout_s`` is over twice that), before it waits on: ``"collecting"``
        (it collects the round) announces its call and logs which ranks have not
        arrived (two requests); ``"announce"`` announces its call (one request)."""
        start = time.monotonic()
        if look and timeout_s > 2 * SLOW_ROUND_S:
            try:
                self._wait_until(keys, start + SLOW_ROUND_S)
                return
            except Exception:  # DistStoreError (a RuntimeError) on timeout
                pass
            if not self._announce(key, seq) and look == "collecting":
                self._log_missing(key, seq, timeout_s)
        self._wait_until(keys, start + timeout_s)

    def _wait_until(self, keys: list[str], deadline: float) -> None:
        left = deadline - time.monotonic()
        self._store.wait(keys, timedelta(seconds=max(left, 0.001)))

    def _announce(self, key: str, seq: int) -> bool:
        """Say, in round ``seq``'s call key, that this rank waits there in call ``key``.
        The first rank to announce writes the key (and deletes it once its round is
        over); a later one reads it. A rank that reads another call fills every key of
        the round still empty with the mismatch (and the next round's, as
        ``_check_call`` does), which wakes every rank waiting in it: each then reads the
        mismatch where it reads its round's answer, and raises. Returns whether this
        rank found a mismatch."""
        slot = f"{self._ns}/{seq}/call"
        mine = f"{self.rank}|{key}".encode()
        stored = self._store.compare_set(slot, "", mine)
        if stored == mine:
            self._read_by_all.append(slot)  # deleted once a round of every rank is over
            return False
        by, _, their_key = stored.decode(errors="replace").partition("|")
        if _same_call(their_key, key):
            return False
        calls = {int(by): their_key, self.rank: key}
        mark = _MISMATCH + pickle.dumps((seq, calls), protocol=pickle.HIGHEST_PROTOCOL)
        for k in self._keys(seq):
            self._store.compare_set(k, "", mark)
        self._mismatch_mark(seq, calls)
        return True

    def _log_missing(self, key: str, seq: int, timeout_s: float) -> None:
        arrived = self._arrived(seq)
        missing = [r for r in range(self.world_size) if r not in arrived]
        if missing:
            log.warning(
                "rank %d: still waiting for rank(s) %s at %r after %g s (%d of %d arrived; "
                "giving up at timeout_s=%g s): they are slow, hung, or not making this call. "
                "Every rank must make the same collective calls (save, save_async, restore, "
                "rollback, close), not only the rank under `if rank == 0:`",
                self.rank,
                ranks_text(missing),
                key,
                SLOW_ROUND_S,
                len(arrived),
                self.world_size,
                timeout_s,
            )

    def _give_up(self, key: str, seq: int, dst: int, exc: Exception) -> bytes:
        """After a timeout in ``_gather``: mark the round failed, naming the ranks not on
        its arrival list (``dst`` if every rank arrived: it never answered),
        unless its outcome came first. Returns what the outcome key holds now, or b""
        if this rank is ``dst`` and everyone arrived meanwhile (the round stands).
        Two requests, whatever the number of ranks, and one per missing rank from the
        rank whose mark stands: it marks their keys too, so that a ``dst`` still waiting
        for them (it arrived later) wakes up now and fails like the others rather than
        at its own deadline."""
        try:
            # Reads the list without waiting for it to exist (a missing key answers
            # with the expected value, which no arrival list can equal).
            arrived = self._arrived(seq)
            missing = [r for r in range(self.world_size) if r not in arrived]
            if not missing:
                if self.rank == dst:
                    return b""
                missing = [dst]
            mark = _gave_up_mark(self.rank, missing, key)
            keys = self._keys(seq)
            stored = self._store.compare_set(keys[dst], "", mark)
            if stored == mark:
                for r in missing:
                    if r != dst:
                        self._store.compare_set(keys[r], "", mark)
            return stored
        except Exception as exc2:  # pragma: no cover - the store itself failed
            raise _store_failed(self.rank, key, exc2) from exc

    def _missing_error(
        self, key: str, raw: bytes, dst: int, timeout_s: float
    ) -> CoordinationTimeoutError | CollectiveMismatchError:
        """The one error of a round that a rank gave up on (``raw``: its mark), or,
        if that rank was in another call, the mismatch."""
        mismatch = _mismatch_in_mark(raw, key, self.rank)
        if mismatch is not None:
            return mismatch
        by, late, _ = _gave_up_by(raw)
        if by == str(self.rank) and late == (dst,) and dst != self.rank:
            text = (
                f"rank {self.rank}: rank {dst}, which collects {key!r}, did not answer within "
                f"{timeout_s:g} s although every other rank arrived (it crashed, hung, or is "
                "still working on slow storage; raise timeout_s if saves legitimately take "
                "longer)"
            )
        elif by == str(self.rank):
            text = (
                f"rank {self.rank}: rank(s) {list(late)} did not arrive at {key!r} within "
                f"{timeout_s:g} s (a rank crashed, hung, is still writing on slow storage, "
                "or skipped this call: it left the loop or closed its manager early, and "
                "every rank must make the same calls; raise timeout_s if saves "
                "legitimately take longer)"
            )
        elif self.rank in late:
            text = (
                f"rank {self.rank} arrived at {key!r} after rank {by} gave up waiting for it "
                f"({timeout_s:g} s): this rank stalled (frozen, descheduled or on slow "
                "storage), so the exchange failed for every rank"
            )
        else:
            text = (
                f"rank {self.rank}: rank(s) {list(late)} did not arrive at {key!r} in time: "
                f"rank {by} gave up waiting for them ({timeout_s:g} s)"
            )
        return CoordinationTimeoutError(text, missing_ranks=late, key=key)

    def broadcast(self, key: str, obj: Any, *, src: int = 0, timeout_s: float) -> Any:
        """``src``'s ``obj`` on every rank, once every rank has arrived (unlike
        ``publish``, a missing rank fails the round for everyone)."""
        seq = self._next_round(key)
        _, raw = self._rounds(
            key,
            seq,
            lambda n: self._gather(key, obj, src, timeout_s, n, lambda raws: raws[src]),
            timeout_s,
        )
        return pickle.loads(raw)

    def leave(self, why: str = LEFT_CALL) -> None:
        """This rank makes no more calls through this coordinator (its manager closed).

        Its key in each of the next ``_LEAVE_ROUNDS`` rounds is filled with a value of
        the call ``why``, so that a rank still making calls meets a different call
        there at once (``CollectiveMismatchError`` on every rank of that round, naming
        this one) instead of waiting ``timeout_s`` (600 s by default) for a rank that
        has gone: a rank whose ``with`` block ended on an exception, or whose loop ended
        early. The first rounds of the next ``clone`` are filled too: the other ranks
        make it at their first async save, which this rank never reaches. This rank
        then skips those rounds and that clone, so that the coordinator stays usable
        after every rank left alike. One store request, bounded; best effort (a store
        that cannot be reached only costs the others their wait, as before).
        """
        if self._stalled:
            return
        start = self._seq + 1
        rounds = range(start, start + _LEAVE_ROUNDS)
        keys = [f"{self._ns}/{seq}/{self.rank}" for seq in rounds]
        self._seq += _LEAVE_ROUNDS
        clone_ns = self._next_clone_namespace()
        keys += [f"{clone_ns}/{seq}/{self.rank}" for seq in range(1, 1 + _LEAVE_ROUNDS)]
        value = _tag(why, pickle.dumps(None, protocol=pickle.HIGHEST_PROTOCOL))

        def mark() -> None:
            multi_set = getattr(self._store, "multi_set", None)
            if multi_set is not None:
                multi_set(keys, [value] * len(keys))
            else:
                for k in keys:
                    self._store.set(k, value)

        try:
            self._run(why, mark, _LEAVE_TIMEOUT_S)
        except CheckpointError as exc:
            log.debug("rank %d could not mark its leave in the store: %s", self.rank, exc)

    def _next_clone_namespace(self) -> str:
        """The key namespace of this coordinator's next clone (every rank numbers its
        clones alike)."""
        self._clones += 1
        return f"{self._ns}/clone{self._clones}"

    def clone(self) -> TorchDistributedCoordinator:
        namespace = self._next_clone_namespace()
        store = self._store.clone() if hasattr(self._store, "clone") else self._store
        return TorchDistributedCoordinator(
            store, rank=self.rank, world_size=self.world_size, namespace=namespace
        )


def exchange_outcomes(
    coord: Coordinator, key: str, value: Any, failure: RankFailure | None, *, timeout_s: float
) -> tuple[list[Any], list[RankFailure]]:
    """Share this rank's outcome of one step with every rank: what it produced, or what
    failed. Collective; called by every rank, from the thread that runs the step.

    The exchange behind DESIGN invariant 4 (if any rank fails, every rank raises the
    same error): every rank gets the same answer, so every rank decides the same way
    whether, and what, to raise. Every rank receives every rank's value (an all-gather,
    O(N^2) bytes for N ranks); where the failures are all that matter,
    ``shared_failures`` costs O(N), and ``gather_routed`` serves the library's own
    rounds.

    Args:
        coord: the job's coordinator.
        key: names the step in a timeout error (e.g. ``"save step 40: write"``).
        value: this rank's result (small and picklable), or None.
        failure: what failed on this rank, or None.
        timeout_s: bound on the wait for the other ranks.

    Returns:
        Every rank's value, indexed by rank, and every rank's failure in rank order
        (empty when every rank succeeded); identical on every rank.

    Raises:
        CoordinationTimeoutError: a rank did not report within ``timeout_s`` (it
            crashed or hangs); it names the missing ranks.
    """
    outcomes = coord.all_gather(key, (value, failure), timeout_s=timeout_s)
    return [v for v, _ in outcomes], [f for _, f in outcomes if f is not None]


def rank_failure(exc: BaseException, rank: int, phase: str) -> RankFailure:
    """What one rank tells the others about its failure: its type name and message."""
    return RankFailure(rank, phase, type(exc).__name__, str(exc) or repr(exc))


def shared_error(failures: Sequence[RankFailure], step: int | None = None) -> CheckpointError:
    """The one error every rank raises for these failures (DESIGN invariant 4): built
    from what every rank sent, so type and message are the same everywhere."""
    if len(failures) == 1 and failures[0].error_type == "CheckpointExistsError":
        return CheckpointExistsError(failures[0].message)
    kinds = {f.error_type for f in failures}
    if len(kinds) == 1 and (kind := _AS_ITSELF.get(kinds.pop())) is not None:
        # Another job holds or took over ROOT: the job's own condition, raised on every
        # rank as the type a single process raises and the docs name (`except
        # LockHeldError:` never fired under torchrun: it was a DistributedCheckpointError
        # ending in "no partial checkpoint is visible", also at open).
        first = failures[0]
        return kind(f"rank {first.rank} in phase {first.phase!r}: {first.message}")
    return DistributedCheckpointError(list(failures), step=step)


#: Errors every rank raises as themselves (the same type and message everywhere).
_AS_ITSELF: dict[str, type[CheckpointError]] = {
    "LockHeldError": LockHeldError,
    "FencedError": FencedError,
}


def _run_here(
    coord: Coordinator,
    phase: str,
    fn: Callable[[], _T] | None,
    failed: tuple[str, Exception] | None = None,
) -> tuple[Any, tuple[Any, RankFailure | None]]:
    """Run ``fn`` on this rank; returns its result (None if it failed) and what this
    rank sends: (result, its failure or None). ``failed``: this rank failed already,
    (the step it failed in, the error); ``fn`` is not run. With one rank, a failure is
    raised."""
    value: Any = None
    failed_in, error = failed if failed is not None else (phase, None)
    if fn is not None and error is None:
        try:
            value = fn()
        except Exception as exc:  # every failure is shared, never swallowed
            error = exc
    if coord.world_size == 1 and error is not None:
        raise error
    return value, (value, None if error is None else rank_failure(error, coord.rank, failed_in))


def gather_routed(
    coord: Coordinator,
    key: str,
    phase: str,
    fn: Callable[[], _T],
    summarize: Callable[[list[_T]], Any],
    route: Callable[[list[_T]], dict[int, Any] | None],
    *,
    dst: int,
    routed: bool,
    timeout_s: float,
    step: int | None = None,
    failed: tuple[str, Exception] | None = None,
) -> tuple[_T, Any, Any]:
    """Run ``fn`` on this rank and share the outcome, without sending every result to
    every rank: ``dst`` collects them, every rank gets ``summarize(results)`` and each
    rank that asks (``routed``) its own ``route(results)[rank]``, both computed once on
    ``dst``; ``route`` may answer None: nothing is routed this round (e.g. the summary
    says what to do next). Returns this rank's result, the summary and its routed value
    (None unless ``routed`` and routed). If any rank failed, every rank raises the same
    error. ``failed``: this rank failed already, (the step it failed in, the error),
    and sends that instead of running ``fn``.

    Through a coordinator with ``gather_and_route``, a round costs O(N) store requests
    and, for a small summary, O(N) bytes for N ranks; otherwise it is an all-gather
    (every rank gets every result, O(N^2) bytes) from which every rank computes the
    same summary and routes.
    """
    value, payload = _run_here(coord, phase, fn, failed)

    def reduce(outcomes: list[Any]) -> tuple[list[RankFailure], Any]:
        failures = [f for _, f in outcomes if f is not None]
        return (failures, None) if failures else ([], summarize([v for v, _ in outcomes]))

    def routes(outcomes: list[Any]) -> dict[int, Any] | None:
        if any(f is not None for _, f in outcomes):
            return None  # the round failed: nobody reads a routed value
        return route([v for v, _ in outcomes])

    if coord.world_size == 1:
        own = route([value]) if routed else None
        return value, summarize([value]), None if own is None else own.get(0)
    gather = getattr(coord, "gather_and_route", None)
    if gather is None:
        everything = coord.all_gather(key, payload, timeout_s=timeout_s)
        (failures, summary), private = reduce(everything), routes(everything)
        mine = private.get(coord.rank) if private is not None and routed else None
    else:
        _, (failures, summary), mine = gather(
            key, payload, dst=dst, timeout_s=timeout_s, reduce=reduce, route=routes, routed=routed
        )
    if failures:
        raise shared_error(failures, step)
    return value, summary, mine


def gather_summary(
    coord: Coordinator,
    key: str,
    value: Any,
    summarize: Callable[[list[Any]], _T],
    *,
    timeout_s: float,
) -> _T:
    """Every rank contributes ``value``; every rank gets ``summarize(values)`` (the
    values indexed by rank), computed once on rank 0. Collective.

    For a check whose answer is small (the first rank that refused, the failures, the
    union of what the ranks found): through a coordinator with ``gather_and_route`` a
    round costs O(N) bytes, where an all-gather sends every rank's value to every rank.
    A rank that does not arrive within ``timeout_s`` is named on every rank
    (``CoordinationTimeoutError``), as for an all-gather.
    """
    _, summary, _ = gather_routed(
        coord,
        key,
        key,
        functools.partial(_identity, value),
        summarize,
        _no_routes,
        dst=0,
        routed=False,
        timeout_s=timeout_s,
    )
    return summary


def agree(coord: Coordinator, call: str, value: Any, *, timeout_s: float) -> None:
    """Check that every rank passed the same ``value`` to ``call`` (e.g. the step of
    ``rollback``) before anything is done with it. Collective; one O(N) round.

    Raises:
        CollectiveMismatchError: on every rank, naming each rank's value, when they
            differ (a step computed on each rank from its own clock or data).
    """
    differ = gather_summary(
        coord, f"{call}: arguments", value, _by_rank_if_differ, timeout_s=timeout_s
    )
    if differ is None:
        return
    listed = ", ".join(f"rank {r}: {v!r}" for r, v in differ.items())
    raise CollectiveMismatchError(
        f"the ranks called {call} with different arguments ({listed}); nothing was done. "
        "Every rank must pass the same value: compute it once (e.g. on rank 0) and use it "
        "on every rank",
        calls={r: f"{call} {v!r}" for r, v in differ.items()},
    )


def _by_rank_if_differ(values: list[Any]) -> dict[int, Any] | None:
    if all(v == values[0] for v in values[1:]):
        return None
    return dict(enumerate(values))


def gather_to(
    coord: Coordinator, key: str, value: Any, *, dst: int, timeout_s: float
) -> list[Any] | None:
    """Every rank contributes ``value``; ``dst`` gets the list indexed by rank, the
    others None. Collective. Through a coordinator with ``gather_and_route`` a round
    costs O(N) store requests and bytes (each rank writes its value once, ``dst`` reads
    them); otherwise it is an all-gather. A rank that does not arrive within
    ``timeout_s`` is named on every rank, as for an all-gather."""
    if coord.world_size == 1:
        return [value]
    gather = getattr(coord, "gather_and_route", None)
    if gather is None:
        values = coord.all_gather(key, value, timeout_s=timeout_s)
        return values if coord.rank == dst else None
    values, _, _ = gather(key, value, dst=dst, timeout_s=timeout_s, reduce=_no_routes)
    return values if coord.rank == dst else None


def shared_failures(
    coord: Coordinator, key: str, failure: RankFailure | None, *, timeout_s: float
) -> list[RankFailure]:
    """Every rank's failure of one step, in rank order (empty: none failed), the same
    list on every rank (``gather_summary``): what the DCP and Accelerate integrations
    exchange around the framework's own writes and reads (DESIGN invariant 4)."""
    return gather_summary(coord, key, failure, _failures_of, timeout_s=timeout_s)


def _failures_of(failures: list[RankFailure | None]) -> list[RankFailure]:
    return [f for f in failures if f is not None]


def _identity(value: _T) -> _T:
    return value


def _no_routes(_values: list[Any]) -> None:
    return None


def run_on_leaders(
    coord: Coordinator,
    key: str,
    phase: str,
    fn: Callable[[], _T] | None,
    *,
    leader: int,
    leaders: Sequence[int],
    timeout_s: float,
    step: int | None = None,
    pick: Callable[[Any, Any], Any] | None = None,
    want: Any = None,
    combine: Callable[[list[Any]], Any] | None = None,
    elsewhere: Callable[[], None] | None = None,
) -> tuple[Any, Any]:
    """Run ``fn`` on each storage domain's leader (``elsewhere`` on the other ranks, its
    failure shared like the leaders'); every rank gets its own leader's result, or every
    rank raises the same error. Collective.

    Returns this rank's leader's result (on the leader, what ``fn`` returned; on the
    others ``pick(result, want)``, ``want`` being what that rank sent, default: the
    result) and ``combine`` of every leader's result in the order of ``leaders``
    (computed once, on ``leaders[0]``; None without ``combine``). Each rank receives
    its own part alone (``gather_routed``): O(N) bytes for N ranks, where an all-gather
    of the results would send every leader's to every rank.
    """
    lead = coord.rank == leader
    full: list[Any] = []
    share = pick or (lambda result, _want: result)

    def here() -> tuple[int, Any, Any]:
        if fn is not None and lead:
            full.append(fn())
            return leader, want, full[0]
        if elsewhere is not None and not lead:
            elsewhere()
        return leader, want, None

    def to_members(sent: list[tuple[int, Any, Any]]) -> dict[int, Any]:
        return {r: share(sent[to][2], w) for r, (to, w, _) in enumerate(sent) if r != to}

    def combined(sent: list[tuple[int, Any, Any]]) -> Any:
        return None if combine is None else combine([sent[r][2] for r in leaders])

    _, summary, got = gather_routed(
        coord,
        key,
        phase,
        here,
        combined,
        to_members,
        dst=leaders[0],
        routed=not lead,
        timeout_s=timeout_s,
        step=step,
    )
    return (full[0] if lead else got), summary


def default_coordinator() -> Coordinator:
    """torch.distributed when a process group is initialised, else single process.

    torch is only looked at if it is already imported: a script that never imported
    torch cannot have a process group.
    """
    import sys

    if "torch" in sys.modules or "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return TorchDistributedCoordinator()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CheckpointError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but no torch.distributed process group is "
            "initialised: call torch.distributed.init_process_group() before creating the "
            "CheckpointManager, or pass coordinator=SingleProcessCoordinator() if each process "
            "really saves on its own"
        )
    return SingleProcessCoordinator()
