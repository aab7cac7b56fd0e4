"""Extra peak memory of each save method, measured in a fresh process.

Run by ``run.py`` as ``python _memory.py SIZE_BYTES WORKDIR OUT_JSON``. The process
builds the state, then for each method resets its peak RSS (Linux: writing 5 to
``/proc/self/clear_refs`` resets VmHWM), runs the save once and reads VmHWM: the
extra peak is VmHWM minus the resident size just before the save. The page cache is
not part of RSS, so only the copies a method makes count. Each save is checked by
loading it back, as in the timed trials.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def _children_peak() -> int:
    """Peak RSS of this process's children (and theirs), for the process-tree figure."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def main(argv: list[str]) -> int:
    size, work, out_path = int(argv[0]), argv[1], argv[2]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _bench

    state = _bench.model_state(size, seed=7)
    nbytes = _bench.state_bytes(state)
    _bench.init_single_process_group()
    # The host buffers (used to check each save) are allocated here, before the
    # baseline, so they count for no method.
    methods = _bench.Methods(state, work)
    results: dict[str, Any] = {"state_bytes": nbytes, "hwm_reset": _reset_peak()}
    plan = [
        ("ours_sync", methods.ours_sync),
        ("ours_async", methods.ours_async),  # first async save: allocates the snapshot
        ("ours_async_steady", methods.ours_async),  # reuses it
        ("torch_save", methods.torch_save),
        ("safetensors_save", methods.safetensors_save),
        ("dcp_save", methods.dcp_save),
        ("dcp_async", methods.dcp_async),
        ("raw_write", methods.raw_write),
    ]
    baseline = None
    for name, fn in plan:
        gc.collect()
        before = _status()["VmRSS"]
        if baseline is None:
            baseline = before
        _reset_peak()
        trial = fn()
        peak = _status()["VmHWM"]
        results[name] = {
            "extra_peak_bytes": peak - before,
            # Against the process before any save: for async this counts the snapshot
            # buffer that stays allocated between saves.
            "extra_vs_baseline_bytes": peak - baseline,
            "ratio": (peak - before) / nbytes,
        }
        if trial.verify is not None:
            trial.verify()
        for path in trial.cleanup:
            _bench.remove(path)
        _bench.settle()
    methods.close()
    results["children_peak_bytes"] = _children_peak()
    del state, methods
    gc.collect()
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
