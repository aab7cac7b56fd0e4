"""The three storages the lifecycle model runs on, and the states it saves.

Kept free of Hypothesis and pytest: the subprocess that is SIGKILLed mid-save
(``tests/model/_child.py``) imports it to open the same storage the test uses.

- ``exchange``: a local directory with the rename strategy; an overwrite swaps the old
  and new copies with one ``renameat2(RENAME_EXCHANGE)``.
- ``no-exchange``: the rename strategy where ``RENAME_EXCHANGE`` is not available (sshfs,
  NFS, Windows): an overwrite moves the old copy into ``.trash/`` and renames the new
  one in, two renames. The storage is a real local directory whose ``exchange_dirs``
  reports "cannot", exactly what ``LocalStorage.exchange_dirs`` returns on those
  filesystems (EINVAL/ENOSYS from the kernel or no ``renameat2``).
- ``marker``: ``strategy="marker"`` on a local directory (the object-store protocol:
  files written in place, the manifest created last is the commit).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import numpy as np

from atomic_checkpoint import (
    CheckpointManager,
    KeepBest,
    KeepEvery,
    KeepLast,
    LocalStorage,
    Pin,
    SingleProcessCoordinator,
)
from atomic_checkpoint.storage.detect import local_capabilities

KINDS = ("exchange", "no-exchange", "marker")

#: Retention policies the model switches between (on reopen), as (kind, arg) parts
#: combined with ``|``; () is no retention.
POLICIES: tuple[tuple[tuple[str, Any], ...], ...] = (
    (),
    (("last", 1),),
    (("last", 2),),
    (("last", 3),),
    (("best", 1),),
    (("last", 1), ("best", 1)),
    (("last", 2), ("every", 20)),
    (("last", 1), ("pin", (0, 10, 25))),
    (("best", 2), ("every", 15)),
    (("last", 1), ("best", 1), ("every", 30), ("pin", (5,))),
)

METRIC = "eval_loss"


class NoExchangeStorage(LocalStorage):
    """A local directory on which ``RENAME_EXCHANGE`` is unavailable, as on sshfs,
    NFS and Windows (``LocalStorage.exchange_dirs`` returns False there)."""

    def exchange_dirs(self, a: str, b: str) -> bool:
        return False


def open_storage_kind(kind: str, root: str) -> tuple[LocalStorage, str | None]:
    """The storage and the ``strategy=`` argument for ``kind``."""
    os.makedirs(root, exist_ok=True)
    if kind == "exchange":
        return LocalStorage(root), None
    if kind == "no-exchange":
        caps = replace(local_capabilities(root), name="local-no-exchange")
        return NoExchangeStorage(root, capabilities=caps), None
    if kind == "marker":
        return LocalStorage(root), "marker"
    raise ValueError(f"unknown storage kind {kind!r}")


def build_policy(spec: tuple[tuple[str, Any], ...]) -> Any:
    """The library's policy for a model spec (None for no retention)."""
    parts: list[Any] = []
    for name, arg in spec:
        if name == "last":
            parts.append(KeepLast(arg))
        elif name == "best":
            parts.append(KeepBest(arg, metric=METRIC, mode="min"))
        elif name == "every":
            parts.append(KeepEvery(arg))
        elif name == "pin":
            parts.append(Pin(list(arg)))
        else:
            raise ValueError(name)
    if not parts:
        return None
    policy = parts[0]
    for p in parts[1:]:
        policy = policy | p
    return policy


def open_manager(kind: str, root: str, spec: tuple[tuple[str, Any], ...] = (), **kw: Any) -> Any:
    storage, strategy = open_storage_kind(kind, root)
    return CheckpointManager(
        storage,
        retention=build_policy(spec),
        strategy=strategy,
        coordinator=SingleProcessCoordinator(),
        timeout_s=kw.pop("timeout_s", 30.0),
        visibility_timeout_s=kw.pop("visibility_timeout_s", 5.0),
        **kw,
    )


def make_state(vid: int, step: int) -> dict[str, Any]:
    """The state saved as value ``vid``: deterministic, distinct per value, a few sizes
    (one under a block, several blocks, one large enough for the direct-write path)."""
    rng = np.random.default_rng(vid)
    n = (16, 3000, 70000)[vid % 3]
    return {
        "model": {"w": rng.standard_normal(n).astype(np.float32)},
        "optim": {0: {"m": rng.integers(-(2**40), 2**40, 33, dtype=np.int64)}},
        "step": step,
        "vid": vid,
        "tag": f"value-{vid}",
    }


def metric_of(vid: int) -> float:
    """The checkpoint's ``eval_loss``: a few distinct values, so ties happen too."""
    return round((vid * 37 % 11) / 10.0, 1)


def same_state(got: Any, vid: int, step: int) -> bool:
    """Whether ``got`` is bit-exactly value ``vid`` saved at ``step``."""
    want = make_state(vid, step)
    try:
        a, b = got["model"]["w"], want["model"]["w"]
        c, d = got["optim"][0]["m"], want["optim"][0]["m"]
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
            and c.dtype == d.dtype
            and c.tobytes() == d.tobytes()
            and got["step"] == step
            and got["vid"] == vid
            and got["tag"] == want["tag"]
        )
    except (KeyError, TypeError, AttributeError, IndexError):
        return False


def vid_of(got: Any) -> Any:
    try:
        return got["vid"]
    except Exception:
        return None
