"""Exact comparison of training state (model, optimizer, scheduler, RNG)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch


def snapshot(model, optimizer, scheduler) -> dict[str, object]:
    """Everything resume must restore exactly: model, optimizer, scheduler, RNG."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": _clone(optimizer.state_dict()),
        "scheduler": _clone(scheduler.state_dict()),
        "torch_rng": torch.get_rng_state().clone(),
        "python_rng": random.getstate(),
        "numpy_rng": _clone(np.random.get_state()),
    }


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    return obj


def differences(a: object, b: object, where: str = "") -> list[str]:
    """Where two snapshots differ (exact comparison; empty means identical)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if ok else [where]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        out: list[str] = []
        for k in a:
            out += differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += differences(x, y, f"{where}[{i}]")
        return out
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def dump(path: str, doc: object) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, path)
