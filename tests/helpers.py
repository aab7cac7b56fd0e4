"""What tests share: running a Python snippet or module as a real child process (a
single-process job that a test lets finish, or that kills itself at a fault point,
``ATOMIC_CHECKPOINT_FAULTS``), comparing states exactly, collecting the library's
warnings, and a real storage that counts what discovery reads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from atomic_checkpoint.layout import MANIFEST_NAME
from atomic_checkpoint.storage.local import LocalStorage


def run_python(code: str, *args: object, **options: Any) -> subprocess.CompletedProcess[str]:
    """Run ``python -c CODE ARGS`` (``options``: those of :func:`_run_child`)."""
    return _run_child("-c", code, *args, **options)


def run_module(module: str, *args: object, **options: Any) -> subprocess.CompletedProcess[str]:
    """Run ``python -m MODULE ARGS`` (``options``: those of :func:`_run_child`)."""
    return _run_child("-m", module, *args, **options)


def _run_child(
    *argv: object,
    faults: str = "",
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGV`` to completion (at most ``timeout_s``; in ``cwd``), its output
    captured as text and its exit status left to the caller.

    The child is a job of its own, with one process: a launcher's ``WORLD_SIZE`` and
    ``RANK`` are not passed on, ``ATOMIC_CHECKPOINT_FAULTS`` is ``faults`` (none by
    default, whatever this process has), and ``env`` goes on top.
    """
    child_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    child_env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    if faults:
        child_env["ATOMIC_CHECKPOINT_FAULTS"] = faults
    child_env.update(env or {})
    return subprocess.run(
        [sys.executable, *map(str, argv)],
        env=child_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def same(a: Any, b: Any) -> bool:
    """Whether ``b`` is the state ``a`` exactly: numpy arrays and torch tensors of the
    same dtype and values, dicts with the same keys (in any order) and equal values,
    anything else by ``==``."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    torch = sys.modules.get("torch")  # a tensor means torch is imported already
    if torch is not None and isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """The JSON document a child printed last: its report to the test."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


class WarningMessages(logging.Handler):
    """Keeps the message of every record of level WARNING or above it handles, in order
    (``messages``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def library_warnings() -> WarningMessages:
    """A ``WarningMessages`` attached to the library's logger (``atomic_checkpoint``) for
    the rest of this process: what a rank or a child process was warned about, for its
    report to the test."""
    handler = WarningMessages()
    logging.getLogger("atomic_checkpoint").addHandler(handler)
    return handler


class CountsReads:
    """Mixed in before a real storage class (``class C(CountsReads, LocalStorage)``):
    counts the manifests it reads and the file sizes it checks, for tests that bound
    how much discovery reads."""

    manifest_reads = 0
    size_checks = 0
    _counting = threading.Lock()  # a scan of an object store reads from threads

    def read_bytes(self, path: str) -> bytes:
        if path.endswith(f"/{MANIFEST_NAME}"):
            with self._counting:
                self.manifest_reads += 1
        return super().read_bytes(path)  # type: ignore[misc]

    def size(self, path: str) -> int | None:
        with self._counting:
            self.size_checks += 1
        return super().size(path)  # type: ignore[misc]

    def reset(self) -> None:
        self.manifest_reads = self.size_checks = 0


class CountingLocalStorage(CountsReads, LocalStorage):
    """The real LocalStorage, counting manifest reads and file size checks."""


class ListHandler(logging.Handler):
    """Keeps the library's warnings (level and message, cut at 600 characters) in
    ``out``: add it to the ``atomic_checkpoint`` logger."""

    def __init__(self, out: list[str]):
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(f"{record.levelname} {record.getMessage()}"[:600])


def on_store_threads(world: int, body: Any) -> list[tuple[str, Any, float]]:
    """Run ``body(coordinator, rank)`` for ``world`` ranks as threads, each with its own
    client of one real TCPStore (the coordination a torchrun job uses) and its own
    ``TorchDistributedCoordinator``. Per rank: ("ok", result, seconds) or ("error",
    exception, seconds)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from atomic_checkpoint.coordination import TorchDistributedCoordinator

    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    port = server.port
    results: list[tuple[str, Any, float]] = [("missing", None, 0.0)] * world

    def run(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30))
        coord = TorchDistributedCoordinator(client, rank=rank, world_size=world, namespace="t")
        t0 = time.monotonic()
        try:
            results[rank] = ("ok", body(coord, rank), time.monotonic() - t0)
        except Exception as exc:
            results[rank] = ("error", exc, time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    del server
    return results
