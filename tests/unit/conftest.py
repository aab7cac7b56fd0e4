"""Fixtures of the unit tests: a guard that fails any test starting a process (unit
tests touch no process and no disk beyond a temp dir; tests with real children belong
in tests/faults, tests/dist, tests/storage or tests/packaging), and, for the tests that
count what discovery reads, a root of many real checkpoints, made once per module, and
a copy of it for each test that changes it."""

from __future__ import annotations

import _posixsubprocess
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.testbed.roots import make_local_root


@pytest.fixture(scope="module")
def made_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The requesting module's ``N`` checkpoints of one run, steps 0 to N-1, the run
    recorded in ROOT as a job leaves it. Made once per module and never changed: tests
    that change a root take ``root``, a copy of it."""
    return make_local_root(tmp_path_factory.mktemp("made") / "root", range(request.module.N))


@pytest.fixture
def root(made_root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "root"
    shutil.copytree(made_root, dst, symlinks=True)
    return dst


def _no_process(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError(
        "a unit test started a process: tests/unit runs in one process; move this test "
        "to tests/faults, tests/dist, tests/storage or tests/packaging"
    )


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way Python starts a process (subprocess, which holds its own reference
    to ``_posixsubprocess.fork_exec`` or uses ``os.posix_spawn``, multiprocessing, a
    bare fork) fails the test."""
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _no_process)
    monkeypatch.setattr(subprocess, "_fork_exec", _no_process, raising=False)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _no_process)
