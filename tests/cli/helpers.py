"""Roots made by the real CheckpointManager, corrupted for real, and the CLI run as a
real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from atomic_checkpoint.layout import MANIFEST_NAME, rank_state_file
from atomic_checkpoint.manifest import _body_checksum

VENV_BIN = Path(sys.executable).parent
ENTRY_POINT = VENV_BIN / "atomic-checkpoint"


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    env["PYTHONWARNINGS"] = "error"
    env.update(extra or {})
    return env


def run_cli(
    *args: Any,
    entry_point: bool = False,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    **kwargs: Any,
) -> subprocess.CompletedProcess[str]:
    """Run ``atomic-checkpoint ARGS`` (``python -m atomic_checkpoint`` by default, or the
    installed entry point); never a traceback, whatever the outcome."""
    cmd = [str(ENTRY_POINT)] if entry_point else [sys.executable, "-m", "atomic_checkpoint"]
    proc = subprocess.run(
        [*cmd, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=cli_env(env),
        **kwargs,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def run_json(*args: Any, expect_rc: int = 0, **kwargs: Any) -> dict[str, Any]:
    proc = run_cli(*args, "--json", **kwargs)
    assert proc.returncode == expect_rc, (proc.returncode, proc.stdout, proc.stderr)
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == 1
    return doc


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single ``atomic-checkpoint: error: ...`` line of stderr (asserts there is one)."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("atomic-checkpoint: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def state(step: int, n: int = 12) -> dict[str, Any]:
    return {
        "model": {
            "w": np.arange(n, dtype=np.float32).reshape(-1, 4) * step,
            "b": np.ones(5, dtype=np.int64),
            "mask": np.zeros((2, 3), dtype=np.bool_),
        },
        "step": step,
        "opt": {"lr": 0.1},
    }


def make_root(
    root: Path,
    steps: tuple[int, ...] = (100, 200, 300),
    *,
    losses: dict[int, float] | None = None,
    run_id: str | None = None,
) -> str:
    """Save ``steps`` with the real manager; returns the run id. Metrics: eval_loss
    (``losses[step]``, default 1/step) and acc."""
    mgr = CheckpointManager(root, run_id=run_id, coordinator=SingleProcessCoordinator())
    try:
        for s in steps:
            loss = (losses or {}).get(s, 1.0 / s if s else 1.0)
            mgr.save(s, state(s), metrics={"eval_loss": loss, "acc": s / 1000}, metadata={"s": s})
        return mgr.run_id
    finally:
        mgr.close()


def state_file(root: Path, step: int) -> Path:
    return root / f"checkpoint-{step}" / rank_state_file(0)


def manifest_path(root: Path, step: int) -> Path:
    return root / f"checkpoint-{step}" / MANIFEST_NAME


def truncate(path: Path, keep: int = 10) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def flip_byte(path: Path, offset: int = -3) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def rewrite_manifest(root: Path, step: int, **changes: Any) -> None:
    p = manifest_path(root, step)
    doc = json.loads(p.read_text())
    for key, value in changes.items():
        if key == "first_path":
            doc["files"][0]["path"] = value
        else:
            doc[key] = value
    # Sealed again, as the library writes a manifest with these fields.
    doc.pop("manifest_checksum", None)
    doc["manifest_checksum"] = _body_checksum(doc, doc["checksum_algorithm"])
    p.write_text(json.dumps(doc))


def foreign_run(root: Path, step: int, other_root: Path) -> str:
    """A ``checkpoint-<step>`` of another run, moved into ``root`` (a reused root)."""
    rid = make_root(other_root, (step,), run_id="other-run")
    os.rename(other_root / f"checkpoint-{step}", root / f"checkpoint-{step}")
    return rid


def crash_during_save(root: Path, step: int, phase: str = "after_write") -> Path:
    """A real save killed (SIGKILL) at ``phase``: leaves its pending directory."""
    code = textwrap.dedent(
        f"""
        import numpy as np
        from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
        mgr = CheckpointManager({str(root)!r}, coordinator=SingleProcessCoordinator())
        mgr.save({step}, {{"w": np.ones(1000, dtype=np.float64)}})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=cli_env({"ATOMIC_CHECKPOINT_FAULTS": f"{phase}@0=kill:{step}"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -9, (proc.returncode, proc.stderr)
    pending = [p for p in (root / ".pending").iterdir() if p.name.startswith(f"checkpoint-{step}.")]
    assert len(pending) == 1
    return pending[0]


def tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def mixed_root(tmp_path: Path) -> tuple[Path, str]:
    """A root holding every kind of entry ``list``/``verify`` must tell apart.

    checkpoint-100, -900: ok; -200: state file truncated; -300: one byte flipped (same
    size); -400: state file deleted; -500: manifest mangled; -600: manifest deleted;
    -700: manifest lists ``../``; -800: state file is a symlink to an identical copy
    outside the checkpoint; -1000: another run's; ``notes.txt`` and ``checkpoint-007``:
    strays; ``.pending/checkpoint-950.*``: a save killed after writing.
    """
    root = tmp_path / "root"
    rid = make_root(root, (100, 200, 300, 400, 500, 600, 700, 800, 900))
    truncate(state_file(root, 200))
    flip_byte(state_file(root, 300))
    state_file(root, 400).unlink()
    manifest_path(root, 500).write_bytes(b'{"format": "atomic-checkpoint", "step": 5')
    manifest_path(root, 600).unlink()
    rewrite_manifest(root, 700, first_path="../checkpoint-100/rank-00000.safetensors")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "secret.safetensors"
    os.rename(state_file(root, 800), target)
    os.symlink(target, state_file(root, 800))
    foreign_run(root, 1000, tmp_path / "other")
    (root / "notes.txt").write_text("not a checkpoint\n")
    (root / "checkpoint-007").mkdir()
    crash_during_save(root, 950)
    return root, rid


HOLDER_CODE = """
import sys
import numpy as np
from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
root, lease_s, step = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator(), lease_s=lease_s)
print("READY", mgr.run_id, flush=True)
sys.stdin.readline()
try:
    mgr.save(step, {"w": np.ones(100)})
except Exception as exc:
    print("FAILED", type(exc).__name__, exc, flush=True)
else:
    print("SAVED", flush=True)
"""


class Holder:
    """A real job holding the run lock on a root: a separate process with a writing
    CheckpointManager. ``save()`` makes it save ``step`` (with ``faults`` armed, e.g. a
    hang mid-save)."""

    def __init__(
        self,
        root: Path,
        *,
        step: int = 999,
        lease_s: float = 60.0,
        host: str | None = None,
        faults: str | None = None,
    ):
        extra = {}
        if host is not None:
            extra["ATOMIC_CHECKPOINT_HOST"] = host
        if faults is not None:
            extra["ATOMIC_CHECKPOINT_FAULTS"] = faults
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER_CODE, str(root), str(lease_s), str(step)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(extra),
        )
        line = self.readline()
        assert line.startswith("READY "), (
            line,
            self.proc.stderr.read() if self.proc.stderr else "",
        )
        self.run_id = line.split()[1]
        self.pid = self.proc.pid

    def readline(self, timeout_s: float = 60.0) -> str:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout_s):
                raise TimeoutError(f"holder printed nothing within {timeout_s} s")
        finally:
            sel.close()
        return self.proc.stdout.readline().strip()

    def save(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def wait_for(predicate: Any, timeout_s: float = 30.0, what: str = "condition") -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(f"{what} not reached within {timeout_s} s")
