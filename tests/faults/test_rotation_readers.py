"""A read-only reader racing the training job's rotation (``KeepLast(1)``): a
checkpoint is committed at every instant (the new one before the old one goes), so the
reader must always find one. It used to list ROOT once, find only the old name, read it
after the rotation deleted it, and answer "no checkpoint" (``latest()`` None,
``restore()`` raising, ``checkpoints()`` empty) in about 5 % of rotations.

The first test puts the rotation exactly between the reader's listing and its read; the
second runs a real writer process against a reader for a few seconds."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, KeepLast, catalog


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "w": np.full(1000, float(step), dtype=np.float32)}


@contextmanager
def _rotation_after_next_listing(
    monkeypatch: pytest.MonkeyPatch, writer: CheckpointManager, step: int
) -> Iterator[None]:
    """The next listing of ROOT (the reader's) returns, then ``writer`` saves ``step``
    (committing it, then deleting the older one), before the reader reads anything."""
    real = catalog._root_names
    armed = [True]

    def listing(storage: Any, known: Any = ()) -> list[str]:
        names = real(storage, known)
        if armed[0]:
            armed[0] = False
            writer.save(step, _state(step))
            writer.apply_retention()  # the rotation, finished (it runs in the background)
            assert not (Path(writer.root) / "checkpoint-1").exists()
        return names

    monkeypatch.setattr(catalog, "_root_names", listing)
    yield
    assert not armed[0], "the reader did not list ROOT"


@pytest.mark.parametrize("op", ["latest", "restore", "checkpoints"])
def test_a_reader_whose_listing_a_rotation_outdated_finds_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    writer = CheckpointManager(tmp_path, retention=KeepLast(1))
    writer.save(1, _state(1))
    reader = CheckpointManager(tmp_path, read_only=True)
    with _rotation_after_next_listing(monkeypatch, writer, 2):
        if op == "latest":
            found = reader.latest()
            assert found is not None and found.step == 2
        elif op == "restore":
            assert reader.restore()["step"] == 2
        else:
            assert [c.step for c in reader.checkpoints()] == [2]
    writer.close()


WRITER = """
import sys, time
import numpy as np
from atomic_checkpoint import CheckpointManager, KeepLast
root, seconds = sys.argv[1], float(sys.argv[2])
with CheckpointManager(root, retention=KeepLast(1)) as m:
    m.save(1, {"step": 1, "w": np.ones(25_000, dtype=np.float32)})
    print("ready", flush=True)
    step, end = 1, time.monotonic() + seconds
    while time.monotonic() < end:
        step += 1
        m.save(step, {"step": step, "w": np.full(25_000, float(step), dtype=np.float32)})
print(step, flush=True)
"""


@pytest.mark.timeout(60)
def test_a_reader_never_finds_an_empty_root_while_a_real_job_rotates(tmp_path: Path) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "4"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        reader = CheckpointManager(tmp_path, read_only=True)
        empty, calls, end = [], 0, time.monotonic() + 3.5
        while time.monotonic() < end:
            calls += 1
            found = reader.latest()
            if found is None:
                empty.append("latest")
            if not reader.checkpoints():
                empty.append("checkpoints")
            state = reader.restore()
            assert state["w"][0] == state["step"]  # never a torn or mixed state
        saved = int(writer.communicate(timeout=30)[0].strip())
    finally:
        writer.kill()
    assert saved > 20, "the writer hardly rotated: the race was not run"
    assert empty == [], f"{len(empty)} of {calls} rounds found no checkpoint"
