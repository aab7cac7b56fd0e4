"""What ``import atomic_checkpoint`` pulls in, in a fresh interpreter: no framework
(torch, numpy, fsspec, transformers, lightning) until it is used, and a numpy-only
state saved and loaded where torch is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_import_does_not_import_torch_or_numpy() -> None:
    code = (
        "import sys, atomic_checkpoint.serialization\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": SRC},
        timeout=60,
    )
    assert out.stdout.strip() == "[]"


def test_numpy_only_state_round_trips_without_torch(tmp_path: Path) -> None:
    # sys.modules["torch"] = None makes "import torch" fail as if it were not installed.
    code = f"""
import sys
sys.modules["torch"] = None
import io, numpy as np
from atomic_checkpoint.serialization import plan_state, load_state, read_header
state = {{"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(7), 1: (1.5, None)}}
plan = plan_state(state)
path = {str(tmp_path / "s.safetensors")!r}
with open(path, "wb") as f:
    for chunk in plan.iter_chunks():
        f.write(chunk)
with open(path, "rb", buffering=0) as f:
    out = load_state(f)
    header = read_header(f)
assert out["w"].tolist() == state["w"].tolist() and out["w"].dtype == np.float32
assert type(out["n"]) is np.int64 and out["n"] == 7 and out[1] == (1.5, None)
assert header.metadata["format"] == "np"
print("ok", "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": SRC},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok False"


def test_import_does_not_import_frameworks():
    code = (
        "import sys, atomic_checkpoint\n"
        "frameworks = ('torch', 'fsspec', 'numpy', 'transformers', 'lightning')\n"
        "print(sorted(m for m in frameworks if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
