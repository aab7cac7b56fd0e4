"""Fixtures of the CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Where a test's ROOT goes, ``tmp_path/root`` (not made: the test makes it)."""
    return tmp_path / "root"
