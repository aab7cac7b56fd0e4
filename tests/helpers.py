"""What tests share: running a Python snippet as a real child process (a single-process
job that a test lets finish, or that kills itself at a fault point,
``ATOMIC_CHECKPOINT_FAULTS``), and a real storage that counts what discovery reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from atomic_checkpoint.layout import MANIFEST_NAME


def run_python(
    code: str,
    *args: object,
    faults: str = "",
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c CODE ARGS`` to completion (at most ``timeout_s``), its output
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
        [sys.executable, "-c", code, *map(str, args)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """The JSON document a child printed last: its report to the test."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


class CountsReads:
    """Mixed in before a real storage class (``class C(CountsReads, LocalStorage)``):
    counts the manifests it reads and the file sizes it checks, for tests that bound
    how much discovery reads."""

    manifest_reads = 0
    size_checks = 0

    def read_bytes(self, path: str) -> bytes:
        if path.endswith(f"/{MANIFEST_NAME}"):
            self.manifest_reads += 1
        return super().read_bytes(path)  # type: ignore[misc]

    def size(self, path: str) -> int | None:
        self.size_checks += 1
        return super().size(path)  # type: ignore[misc]

    def reset(self) -> None:
        self.manifest_reads = self.size_checks = 0
