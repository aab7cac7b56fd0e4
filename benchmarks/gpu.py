#!/usr/bin/env python
"""Saves and loads of a state that lives on a CUDA device, against the device's own
copy limits, on both state shapes of ``run.py`` (258-tensor flat, 624-tensor train).

    python benchmarks/gpu.py --size 1G --rounds 3 --dir /var/tmp/gpu-bench

What it measures, per shape (medians over ``--rounds``; every figure is checked byte
for byte against the state on the device before it is printed):

- ``d2h``: the device-to-host limit: every tensor copied with ``non_blocking=True``
  into one preallocated page-locked buffer, then one synchronize. ``save_async``
  must block for about this long (its snapshot buffer is pinned when tensors live on
  a GPU) and no less.
- ``async blocked`` / ``d2h``, and the first ``save_async`` after ``prepare_async``.
- ``async durable`` / ``sync save``: the background write costs what a sync save does.
- ``restore(into=)`` of the device tensors, warm, against the raw read of the file into
  page-locked memory followed by the host-to-device copies (``read+h2d``).
- ``restore(device=)`` + ``load_state_dict`` into device tensors, against the same.

It needs a CUDA device and exits 2 without one. Numbers print as a table and, with
``--json``, as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _bench import (  # noqa: E402
    STATE_SHAPES,
    HostBuffers,
    check_state,
    flatten,
    parse_size,
    read_file,
    size_label,
    state_bytes,
    warm_file,
    with_leaves,
)

from atomic_checkpoint import CheckpointManager, KeepLast, device_staging  # noqa: E402
from atomic_checkpoint.layout import checkpoint_name, rank_state_file  # noqa: E402


def _sync() -> None:
    torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """``check_state`` on the device: host tensors in ``got`` are compared there."""
    check_state({k: v.to(want[k].device) for k, v in got.items() if k in want}, want, what)


def _check_on_device(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str
) -> None:
    """``check_state``, and every tensor of ``got`` lives where its saved one did."""
    for k, t in want.items():
        if k in got and got[k].device != t.device:
            raise AssertionError(f"{what}: tensor {k!r} is on {got[k].device}, not {t.device}")
    check_state(got, want, what)


def _copy_all(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
    """Every tensor, device to host or host to device, queued without waiting."""
    for k, t in src.items():
        dst[k].copy_(t, non_blocking=True)


def _round(
    mgr: CheckpointManager,
    root: str,
    state: Any,
    leaves: dict[str, torch.Tensor],
    pinned: HostBuffers,
    step: int,
    add: Callable[[str, float], None],
) -> int:
    """One round of every figure; returns the last step saved."""
    s, _ = _timed(lambda: _copy_all(leaves, pinned.views))
    _check(pinned.views, leaves, "d2h")
    add("d2h_s", s)
    # Each save starts by waiting for the previous save's retention (it deletes a
    # checkpoint of the state's size: ~0.4 s for 2 GiB on one H200 machine's disk); in
    # training that runs during the steps between saves, so it is waited for here,
    # untimed (checkpoints() waits for it), and the timed saves are the saves alone.
    mgr.checkpoints()
    t0 = time.perf_counter()
    handle = mgr.save_async(step + 1, state)
    add("async_blocked_s", time.perf_counter() - t0)
    handle.result()
    add("async_durable_s", time.perf_counter() - t0)
    step += 2
    mgr.checkpoints()
    s, _ = _timed(lambda: mgr.save(step, state))
    add("sync_save_s", s)
    path = os.path.join(root, checkpoint_name(step), rank_state_file(0))
    mgr.checkpoints()  # its retention's deletion does not overlap the timed loads
    # Loads, warm: the file was just written and is in the page cache.
    warm_file(path)
    into_leaves = {k: torch.empty_like(v) for k, v in leaves.items()}
    into = with_leaves(state, into_leaves)
    s, _ = _timed(lambda: mgr.restore(step, into=into))
    _check_on_device(into_leaves, leaves, "restore(into=)")
    add("restore_into_s", s)

    def lsd() -> None:
        loaded = flatten(mgr.restore(step, device="cuda"))
        for k, t in into_leaves.items():
            t.copy_(loaded[k])

    for t in into_leaves.values():
        t.zero_()
    s, _ = _timed(lsd)
    _check_on_device(into_leaves, leaves, "restore(device=) + load_state_dict")
    add("restore_lsd_s", s)
    for t in into_leaves.values():
        t.zero_()
    pinned.scramble()

    def raw() -> None:
        # As run.py's raw read: the whole file into the buffer, then each tensor's
        # view copied to the device (the timing of the bytes, not their placement).
        read_file(path, pinned.flat)
        _copy_all(pinned.views, into_leaves)

    s, _ = _timed(raw)
    add("read_h2d_s", s)
    return step


def run_shape(shape: str, size: int, rounds: int, work: str) -> dict[str, float]:
    state = STATE_SHAPES[shape](size)
    leaves_cpu = flatten(state)
    leaves = {k: v.cuda() for k, v in leaves_cpu.items()}
    del leaves_cpu
    state = with_leaves(state, leaves)
    nbytes = state_bytes(leaves)
    # The header fits in the 4 MiB past the tensors, as in run.py: the raw read takes
    # the whole file.
    pinned = HostBuffers(leaves, extra_bytes=4 << 20, pin=True)
    root = os.path.join(work, shape)
    shutil.rmtree(root, ignore_errors=True)
    mgr = CheckpointManager(root, retention=KeepLast(2))
    fig: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        fig.setdefault(name, []).append(value)

    step = 0
    mgr.prepare_async(state)
    step += 1
    t0 = time.perf_counter()
    handle = mgr.save_async(step, state)
    first_blocked = time.perf_counter() - t0
    handle.result()
    _check_on_device(flatten(mgr.restore(step, device="cuda")), leaves, "first async save")
    for _ in range(rounds):
        step = _round(mgr, root, state, leaves, pinned, step, add)
    mgr.close()
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in fig.items()}
    med["first_blocked_s"] = first_blocked
    med["bytes"] = float(nbytes)
    med["tensors"] = float(len(leaves))
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="state size (e.g. 256M, 1G, 4G)")
    ap.add_argument("--shapes", default="flat,train", help="flat, train or both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in STATE_SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}: choose from {', '.join(STATE_SHAPES)}")
    if not torch.cuda.is_available():
        print("gpu.py: no CUDA device here; run it on a machine with one", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    work = args.dir or os.path.join(os.environ.get("TMPDIR", "/var/tmp"), "ac-gpu-bench")
    os.makedirs(work, exist_ok=True)
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{size_label(size)}, {args.rounds} rounds, work dir {work}"
    )
    # Loads into GPU memory go through page-locked slots that the first such load of
    # the process locks: a cost paid once, reported here, not in the rounds below.
    t0 = time.perf_counter()
    with device_staging.borrowed(torch, pin=True):
        pass
    pin_s = time.perf_counter() - t0
    print(
        f"staging ring: {device_staging.SLOTS} x {size_label(device_staging.SLOT_BYTES)} "
        f"page-locked, locked once per process in {pin_s * 1e3:.1f} ms"
    )
    out: dict[str, Any] = {"staging_pin_s": pin_s}
    for shape in shapes:
        t0 = time.perf_counter()
        m = run_shape(shape, size, args.rounds, work)
        out[shape] = m
        gb = m["bytes"] / 1e9
        print(
            f"\n[{shape}] {int(m['tensors'])} tensors, {gb:.2f} GB "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        rows = [
            ("d2h into pinned memory", m["d2h_s"], None),
            ("save_async blocked / d2h", m["async_blocked_s"], m["d2h_s"]),
            ("first save_async (prepared) / d2h", m["first_blocked_s"], m["d2h_s"]),
            ("save_async durable / sync save", m["async_durable_s"], m["sync_save_s"]),
            ("sync save", m["sync_save_s"], None),
            ("read+h2d (warm)", m["read_h2d_s"], None),
            ("restore(into=) warm / read+h2d", m["restore_into_s"], m["read_h2d_s"]),
            ("restore(device=)+lsd warm / read+h2d", m["restore_lsd_s"], m["read_h2d_s"]),
        ]
        for name, s, base in rows:
            ratio = f"{s / base:6.2f}x" if base else "       "
            print(f"  {name:40s} {s * 1e3:9.1f} ms  {ratio}  {gb / s:6.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
