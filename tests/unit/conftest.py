"""Fixtures of the unit tests that count what discovery reads: a root of many real
checkpoints, made once per module, and a copy of it for each test that changes it."""

from __future__ import annotations

import shutil
from pathlib import Path

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
