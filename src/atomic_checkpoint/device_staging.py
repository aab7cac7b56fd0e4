"""Page-locked host buffers between files and GPU memory, reused by every save and load.

A load into a GPU tensor cannot read the file straight into the tensor's memory: the
bytes go to host memory first, then to the device; a save goes the other way. To or
from pageable memory that copy runs at a fraction of the link's speed (the driver
copies through its own page-locked buffer, and the call waits for it), and locking the
whole state's worth of memory costs more than the load (measured on one H200 machine:
2 GiB took 380 ms to copy from pageable memory, 56 ms from page-locked memory, and
1.5 s to lock).

So both go through a few small buffers that are locked once per process and reused:

- a load (``serialization.load_state``) reads a window of the file into one slot while
  the previous slot's host-to-device copies run on the GPU's copy engine;
- a sync save to a local disk (``rankfiles``, through ``StatePlan.iter_chunks(staging=)``)
  copies the next chunk of a GPU tensor into one slot while the previous slot's chunk
  is copied into the O_DIRECT staging buffers and hashed.

Before a slot is used again its copies are waited for (a CUDA event per slot and
device). An async save does not use them: its snapshot buffer is page-locked as a whole.

One :class:`DeviceStaging` (two slots of 32 MiB, 64 MiB locked) serves the process; a
second save or load that runs while it is in use gets a private ring of pageable slots
(correct, slower) rather than waiting or locking more memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

SLOT_BYTES = 32 << 20
SLOTS = 2

_shared: DeviceStaging | None = None
_shared_lock = threading.Lock()
_pin_failed = False  # locking failed once: not tried again in this process

log = logging.getLogger(__name__)


class DeviceStaging:
    """``count`` host buffers of ``slot_bytes`` each, used in turn.

    ``wait(k)`` blocks until every copy queued from slot ``k`` has left it; ``record(k,
    devices)`` marks the copies just queued from slot ``k`` on those devices' current
    streams. Host memory is page-locked with ``pin`` (CUDA's pinned memory), which is
    what lets the copies run asynchronously; without it each copy returns once the
    driver has taken the bytes, and ``record`` has nothing to wait for.
    """

    def __init__(
        self, torch: Any, *, slot_bytes: int = SLOT_BYTES, count: int = SLOTS, pin: bool = False
    ):
        self.torch = torch
        self.slot_bytes = slot_bytes
        self.pinned = pin
        self.slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(count)
        ]
        self.views = [memoryview(s.numpy()) for s in self.slots]
        self._events: list[list[Any]] = [[] for _ in range(count)]
        self._lock = threading.Lock()

    def wait(self, k: int) -> None:
        """Until the copies queued from slot ``k`` have read it."""
        for event in self._events[k]:
            event.synchronize()
        self._events[k] = []

    def record(self, k: int, devices: set[Any]) -> None:
        """The copies from slot ``k`` just queued on ``devices``: ``wait(k)`` waits for them."""
        cuda = self.torch.cuda
        for device in devices:
            if device.type == "cuda":
                event = cuda.Event()
                event.record(cuda.current_stream(device))
                self._events[k].append(event)

    def drain(self) -> None:
        """Until every queued copy is done (the loaded tensors hold their bytes)."""
        for k in range(len(self.slots)):
            self.wait(k)

    def try_acquire(self) -> bool:
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        """Wait for the ring's copies and free it for the next save or load."""
        self.drain()
        self._lock.release()


def acquire(torch: Any, pin: bool) -> DeviceStaging:
    """A ring for one save or load: the process's locked one if ``pin`` and it is free
    (locked on first use), else a private one of pageable slots. Hand it back with
    ``ring.release()`` (or take it with :func:`borrowed`)."""
    global _shared, _pin_failed
    if pin and not _pin_failed:
        with _shared_lock:
            if _shared is None or _shared.slot_bytes != SLOT_BYTES:
                try:
                    _shared = DeviceStaging(torch, slot_bytes=SLOT_BYTES, pin=True)
                except RuntimeError as exc:  # e.g. the driver cannot lock more memory
                    _pin_failed = True
                    log.warning(
                        "atomic-checkpoint: could not lock %d MiB of host memory for "
                        "saves and loads of GPU tensors (%s); copying through pageable "
                        "memory, which is slower",
                        SLOTS * SLOT_BYTES >> 20,
                        exc,
                    )
            ring = _shared
        if ring is not None and ring.try_acquire():
            return ring
    ring = DeviceStaging(torch, slot_bytes=SLOT_BYTES, pin=False)
    ring.try_acquire()
    return ring


@contextlib.contextmanager
def borrowed(torch: Any, pin: bool) -> Iterator[DeviceStaging]:
    """:func:`acquire`'s ring for the block; handed back (its copies waited for) at
    the end, whether the block raised or not."""
    ring = acquire(torch, pin)
    try:
        yield ring
    finally:
        ring.release()
