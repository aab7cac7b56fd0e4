"""Every Python sample of README.md and of the documentation site runs as written.

The samples are found and run as ``tests/docs/samples.py`` says: each runnable one in a
fresh interpreter, in an empty temporary directory. The site itself is built, in strict
mode, by ``scripts/docs.sh``; these tests check what can go stale without building it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import samples as S

SAMPLES = S.samples()


def test_every_python_block_says_whether_it_runs() -> None:
    blocks = S.all_blocks()
    where = {b.path.relative_to(S.REPO).as_posix() for b in blocks}
    assert "README.md" in where and "docs/getting-started.md" in where, where
    assert S.problems(blocks) == []


def test_an_unmarked_or_unexplained_block_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)\n```\n\n"
        "<!-- sample: skip -->\n```python\nprint(2)\n```\n\n"
        "<!-- sample: run setup=nope -->\n```python\nprint(3)\n```\n"
    )
    found = S.problems(S.python_blocks(page))
    assert len(found) == 3, found
    assert "without a marker" in found[0]
    assert "must say why" in found[1]
    assert "unknown setup 'nope'" in found[2]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.where for s in SAMPLES])
def test_sample_runs(sample: S.Sample, tmp_path: Path) -> None:
    if sample.needs_torch:
        pytest.importorskip("torch", reason="this sample needs torch (pip install torch)")
    script = tmp_path / "sample.py"
    script.write_text(sample.script())
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMIC_CHECKPOINT_")}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"the sample at {sample.where} failed (exit {proc.returncode}):\n"
        f"--- script\n{sample.script()}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    missing = S.missing_output(sample.shown_output(), proc.stdout)
    assert missing == [], (
        f"the sample at {sample.where} does not print what its comments show: {missing}\n"
        f"--- stdout\n{proc.stdout}"
    )


def test_shown_output_is_checked_against_what_is_printed() -> None:
    shown = ["[200, 300]: step 100 rotated out", "200 True", "[3.0]"]
    assert S.missing_output(shown, "[200, 300]\nnoise\n200 True\n[3.0]\n") == []
    assert S.missing_output(shown, "[200, 3000]\n200 True\n[3.0]\n") == [shown[0]]
    assert S.missing_output(["[2]"], "[\n") == ["[2]"]
