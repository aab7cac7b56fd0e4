"""How ranks agree: the ``Coordinator`` protocol and its implementations.

Every exchange is an all-gather with a unique key and a timeout. A broadcast is an
all-gather where only the source's value is used: every rank then proves it arrived,
so a missing rank is named in the timeout error rather than hanging the others.

``TorchDistributedCoordinator`` moves small pickled objects through the process
group's key-value store (the TCPStore that torchrun starts), never through collectives:

- it never touches the training's collective stream, so a checkpoint barrier cannot
  deadlock with, or be killed by the watchdog of, an NCCL collective
  (FAILURE_MODES A8);
- it is safe from a background thread (async saves use a cloned store connection);
- a rank that does not arrive is named: we know exactly whose key is missing.

Keys are ``atomic_checkpoint/<namespace>/<seq>/<rank>``. ``seq`` advances identically on
every rank because every rank makes the same sequence of calls (DESIGN invariant 3);
the human-readable ``key`` passed by the caller is only for error messages. A rank
deletes its key of round ``seq-1`` once round ``seq`` is complete: by then every rank
has finished reading round ``seq-1``, so the store does not grow with the run.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from .errors import CheckpointError, CoordinationTimeoutError

__all__ = [
    "Coordinator",
    "SingleProcessCoordinator",
    "TorchDistributedCoordinator",
    "default_coordinator",
]


@runtime_checkable
class Coordinator(Protocol):
    """Exchanges small objects between the ranks of one job.

    Every rank must call every method, in the same order (collective semantics).
    """

    rank: int
    world_size: int

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

_namespace_lock = threading.Lock()
_namespace_counter = 0


def _next_namespace() -> int:
    """Namespaces are handed out in creation order, identical on every rank as long as
    every rank creates its managers in the same order (which collective use requires)."""
    global _namespace_counter
    with _namespace_lock:
        _namespace_counter += 1
        return _namespace_counter


class TorchDistributedCoordinator:
    """Coordination through an initialised ``torch.distributed`` process group's store."""

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
        self._ns = namespace or f"atomic_checkpoint/{_next_namespace()}"
        self._seq = 0
        self._clones = 0
        self._last_key: str | None = None
        self._stalled = False

    def _keys(self, seq: int) -> list[str]:
        return [f"{self._ns}/{seq}/{r}" for r in range(self.world_size)]

    def all_gather(self, key: str, obj: Any, *, timeout_s: float) -> list[Any]:
        """All-gather through the store, with a hard deadline even if the store never
        answers.

        A rank cut off from the store by a network partition (link down, no reset)
        blocks inside TCPStore: its ``wait`` times out, then its next request waits for
        a reply until the kernel abandons the connection, many minutes later (seen
        with torch 2.13 across two network namespaces). So the exchange runs in a
        helper thread; past ``timeout_s`` + a grace period this rank gives up, marks
        itself stalled (the stuck thread still holds the connection, so nothing more is
        sent through it) and raises; later exchanges fail at once.
        """
        if self._stalled:
            raise CoordinationTimeoutError(
                f"rank {self.rank}: the coordination store stopped answering during an "
                f"earlier exchange, so {key!r} is not attempted; restart the job once the "
                "network is back",
                key=key,
            )
        box: list[tuple[bool, Any]] = []

        def exchange() -> None:
            try:
                box.append((True, self._all_gather(key, obj, timeout_s)))
            except BaseException as exc:  # re-raised in the calling thread
                box.append((False, exc))

        limit_s = timeout_s + _STALL_GRACE_S
        helper = threading.Thread(target=exchange, name="atomic-checkpoint-exchange", daemon=True)
        helper.start()
        helper.join(limit_s)
        if not box:
            self._stalled = True
            raise CoordinationTimeoutError(
                f"rank {self.rank}: the coordination store did not answer at {key!r} within "
                f"{limit_s:g} s: this rank is probably cut off from it (network partition). "
                "It stops coordinating; restart the job once the network is back",
                key=key,
            )
        ok, result = box[0]
        if ok:
            return list(result)
        if isinstance(result, CheckpointError) or not isinstance(result, Exception):
            raise result
        raise CheckpointError(
            f"rank {self.rank}: coordination store failed at {key!r}: {result}"
        ) from result

    def _all_gather(self, key: str, obj: Any, timeout_s: float) -> list[Any]:
        self._seq += 1
        keys = self._keys(self._seq)
        # Set by a rank that gives up on this round, so that a rank arriving later (it
        # was frozen or descheduled) fails too instead of finding every key in place and
        # returning success while the others raise (DESIGN invariant 4).
        gave_up = f"{self._ns}/{self._seq}/gave-up"
        self._store.set(keys[self.rank], pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        deadline = time.monotonic() + timeout_s
        try:
            self._store.wait(keys, timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as exc:  # DistStoreError (a RuntimeError) on timeout
            missing = tuple(r for r, k in enumerate(keys) if not self._safe_check(k))
            if not missing and time.monotonic() < deadline:
                raise CheckpointError(f"coordination store failed at {key!r}: {exc}") from exc
            try:
                self._store.set(gave_up, pickle.dumps(self.rank))
            except Exception:  # pragma: no cover - the store is gone: nobody is late
                pass
            raise CoordinationTimeoutError(
                f"rank {self.rank}: rank(s) {list(missing)} did not arrive at {key!r} within "
                f"{timeout_s:g} s (a rank crashed, hung, or is still writing on slow storage; "
                "raise timeout_s if saves legitimately take longer)",
                missing_ranks=missing,
                key=key,
            ) from exc
        if self._safe_check(gave_up):
            who = pickle.loads(self._store.get(gave_up))
            raise CoordinationTimeoutError(
                f"rank {self.rank} arrived at {key!r} after rank {who} gave up waiting for "
                f"it ({timeout_s:g} s): this rank stalled (frozen, descheduled or on slow "
                "storage), so the exchange failed for every rank",
                missing_ranks=(self.rank,),
                key=key,
            )
        if hasattr(self._store, "multi_get"):
            raw = self._store.multi_get(keys)
        else:  # pragma: no cover - torch < 2.4
            raw = [self._store.get(k) for k in keys]
        if self._last_key is not None:
            # Everyone has set its key of this round, so everyone finished reading the
            # previous round: our previous key can go.
            try:
                self._store.delete_key(self._last_key)
            except Exception:  # pragma: no cover - best effort; the store only grows
                pass
        self._last_key = keys[self.rank]
        return [pickle.loads(b) for b in raw]

    def _safe_check(self, k: str) -> bool:
        try:
            return bool(self._store.check([k]))
        except Exception:
            return False

    def broadcast(self, key: str, obj: Any, *, src: int = 0, timeout_s: float) -> Any:
        return self.all_gather(key, obj if self.rank == src else None, timeout_s=timeout_s)[src]

    def clone(self) -> TorchDistributedCoordinator:
        self._clones += 1
        store = self._store.clone() if hasattr(self._store, "clone") else self._store
        return TorchDistributedCoordinator(
            store,
            rank=self.rank,
            world_size=self.world_size,
            namespace=f"{self._ns}/clone{self._clones}",
        )


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
