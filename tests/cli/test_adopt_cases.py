"""``atomic-checkpoint adopt`` as a shell user meets it: its ``--json`` document when
it exits 1, and messages that name the command's flags, never the Python API's
parameters."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.cli.helpers import error_line, make_root, run_cli, run_json


def test_adopt_json_says_why_it_exits_1_when_there_is_nothing_to_adopt(root: Path) -> None:
    (root / "step_100").mkdir(parents=True)
    (root / "step_100" / "w.bin").write_bytes(os.urandom(100))
    proc = run_cli("adopt", root, "--json")
    assert proc.returncode == 1, proc.stderr
    doc = run_json("adopt", root, expect_rc=1)
    assert doc["problem"] is not None and doc["problem"].startswith("nothing to adopt")
    assert doc["problem"] in error_line(proc)
    assert doc["adopted"] == [] and doc["refused"] == []


def test_adopt_json_says_why_it_exits_1_when_a_folder_is_refused(root: Path) -> None:
    for step in (1, 2):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        (root / f"checkpoint-{step}" / "w.bin").write_bytes(os.urandom(100) if step == 1 else b"")
    doc = run_json("adopt", root, "--framework", "generic", expect_rc=1)
    assert [a["step"] for a in doc["adopted"]] == [1]
    assert [r["step"] for r in doc["refused"]] == [2]
    assert doc["problem"].startswith("1 checkpoint(s) not adopted (step(s) 2)")
    ok = run_json("adopt", root, "1")
    assert ok["problem"] is None and ok["already"] == [1]


def test_adopt_messages_name_the_commands_flags(tmp_path: Path) -> None:
    """A root without a run file holding checkpoints of two runs: the advice is
    ``--run-id``, not ``run_id=``; ``--framework generic`` on folders not named
    ``checkpoint-<N>`` is told to rename them, not to pass ``--framework generic``."""
    a, b, mixed = tmp_path / "a", tmp_path / "b", tmp_path / "mixed"
    make_root(a, (1,))
    make_root(b, (2,))
    mixed.mkdir()
    shutil.copytree(a / "checkpoint-1", mixed / "checkpoint-1")
    shutil.copytree(b / "checkpoint-2", mixed / "checkpoint-2")
    (mixed / "checkpoint-3").mkdir()
    (mixed / "checkpoint-3" / "w.bin").write_bytes(os.urandom(10))
    runs = error_line(run_cli("adopt", mixed))
    assert "--run-id RUN" in runs and "run_id=" not in runs, runs

    steps = tmp_path / "steps"
    (steps / "step_5").mkdir(parents=True)
    (steps / "step_5" / "w.bin").write_bytes(os.urandom(10))
    proc = run_cli("adopt", steps, "--framework", "generic")
    assert proc.returncode == 1
    line = error_line(proc)
    assert "--framework generic adopts" not in line and "rename" in line, line


def test_adopt_refused_by_a_live_job_names_no_python_parameter(root: Path) -> None:
    from atomic_checkpoint import CheckpointManager

    (root / "checkpoint-1").mkdir(parents=True)
    (root / "checkpoint-1" / "w.bin").write_bytes(os.urandom(10))
    with CheckpointManager(root):
        proc = run_cli("adopt", root, "--framework", "generic")
    assert proc.returncode == 3, proc.stderr
    line = error_line(proc)
    assert "takeover=True" not in line and "clean --force" in line, line


def test_adopt_refusal_of_a_dcp_folder_names_the_flag(root: Path) -> None:
    folder = root / "checkpoint-1"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(os.urandom(10))
    (folder / "__0_0.distcp").write_bytes(os.urandom(10))
    proc = run_cli("adopt", root, "--framework", "generic")
    assert proc.returncode == 1, proc.stderr
    assert "--framework dcp" in error_line(proc) and 'framework="dcp"' not in proc.stderr
    assert 'framework="dcp"' not in proc.stdout
