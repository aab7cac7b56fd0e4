"""The suite's own command collects every test module: a directory that pytest skips by
default (its ``norecursedirs`` holds ``dist``, ``build``, ``venv``...) would drop a
whole part of the suite from CI without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_every_test_module_under_tests_is_collected() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}
    modules = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    assert modules - collected == set()
    assert any(m.startswith("tests/dist/") for m in collected)
