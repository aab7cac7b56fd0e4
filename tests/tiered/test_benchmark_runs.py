"""The documented multi-rank tiered benchmark (docs/benchmarks.md: ``benchmarks/tiered.py
--ranks 3``) runs to the end with its peer rows: they wipe the nodes and save step 1
again, which the persistent tier of the job before them refused, so every multi-rank
run crashed with StepOrderError. A tiny run; nothing is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_the_multi_rank_tiered_benchmark_runs_with_its_peer_rows(tmp_path):
    out = tmp_path / "t.json"
    args = ["--ranks", "2", "--size", "1M", "--rounds", "1", "--dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tiered.py"), *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "restored states bit-exact on every rank, from the expected tiers: True" in proc.stdout
    doc = json.loads(out.read_text())
    assert "ratio_s3_over_peer" in json.dumps(doc), doc
