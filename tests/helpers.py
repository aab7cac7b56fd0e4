"""Running a Python snippet as a real child process: a single-process job that a test
lets finish, or that kills itself at a fault point (``ATOMIC_CHECKPOINT_FAULTS``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


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
