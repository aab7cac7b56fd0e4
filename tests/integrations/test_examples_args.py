"""The examples' one argument, ``[DIR]``: ``--help`` printed nothing and trained into a
directory named ``--help``; a second run into the same DIR ended in a ``StepOrderError``
traceback. ``--help`` prints the example's docstring; a DIR that holds files is refused
before anything runs, saying to pass a new one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .helpers import REPO, job_env

EXAMPLES = [
    "async_save.py",
    "accelerate_save_state.py",
    "dcp_sharded.py",
    "hf_trainer.py",
    "lightning_checkpoint_io.py",
]


def _run(tmp_path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        cwd=work,
        env=job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", EXAMPLES)
def test_help_prints_the_docstring_and_writes_nothing(tmp_path, name):
    proc = _run(tmp_path, name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Run:" in proc.stdout and "[" in proc.stdout
    assert list((tmp_path / "cwd").iterdir()) == []  # no directory named --help


@pytest.mark.timeout(150)
def test_a_directory_that_holds_files_is_refused_before_anything_runs(tmp_path):
    used = tmp_path / "ckpt"
    used.mkdir()
    (used / "checkpoint-3").mkdir()
    proc = _run(tmp_path, "async_save.py", str(used))
    assert proc.returncode == 1, proc.stderr
    assert "is not empty" in proc.stderr and "pass a new or empty directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in used.iterdir()) == ["checkpoint-3"]
