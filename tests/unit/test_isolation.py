"""The unit tests' guard (tests/unit/conftest.py) holds: starting a process fails the
test, by subprocess, by multiprocessing or by a bare fork."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest


def test_a_unit_test_cannot_start_a_process() -> None:
    with pytest.raises(AssertionError, match="a unit test started a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with pytest.raises(AssertionError, match="a unit test started a process"):
        os.fork()
    ctx = multiprocessing.get_context("spawn")
    with pytest.raises(AssertionError, match="a unit test started a process"):
        ctx.Process(target=print).start()
