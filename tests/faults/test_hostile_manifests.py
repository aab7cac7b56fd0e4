"""Hostile manifests, run files and lock files: one bad file never stops discovery of
the rest of ROOT, and no read of untrusted bytes is unbounded (DESIGN invariant 9).

Each case damages the newest checkpoint's manifest (step 300) of a root with three
checkpoints, then starts a manager on the root for real: start-up, ``latest()``,
``checkpoints()``, ``restore()`` of the good ones, and ``list``/``verify`` must all
work, with step 300 skipped (a warning naming it) or listed as corrupt. Before the fix
a deeply nested manifest raised RecursionError, a 400-digit number OverflowError, and a
huge or sparse manifest was read whole before its size was checked (GBs of memory, or
MemoryError for a sparse 10 TiB file): every one of them stopped the whole root.

The huge-file cases run in a subprocess whose peak RSS (``getrusage``) is checked.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from atomic_checkpoint import (
    CheckpointManager,
    CorruptCheckpointError,
    SingleProcessCoordinator,
)
from atomic_checkpoint.layout import META_DIR
from tests.cli.helpers import make_root, manifest_path, run_cli, run_json, state
from tests.helpers import run_python

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

DEEP = 100_000


def _manifest_doc(root: Path, step: int) -> dict:
    return json.loads(manifest_path(root, step).read_text())


def _with(root: Path, step: int, **fields: object) -> bytes:
    doc = _manifest_doc(root, step)
    doc.update(fields)
    return json.dumps(doc).encode()


def _nested_files(root: Path) -> bytes:
    doc = _manifest_doc(root, 300)
    text = json.dumps(doc)
    return text.replace('"files": [', '"files": [' + "[" * DEEP + "]" * DEEP + ",", 1).encode()


#: name -> (the damaged manifest of step 300 from the root, a fragment of the problem).
#: NaN and 5000 digits already failed cleanly before the fix: kept as guards.
CASES = {
    "deeply-nested": (
        lambda r: b'{"format": "atomic-checkpoint", "x": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        "nested too deeply",
    ),
    "deeply-nested-files": (_nested_files, "nested too deeply"),
    "400-digit-created_unix": (
        lambda r: _with(r, 300, created_unix=int("9" * 400)),
        "created_unix",
    ),
    "400-digit-metric": (
        lambda r: _with(r, 300, metrics={"eval_loss": int("9" * 400)}),
        "eval_loss",
    ),
    "400-digit-commit_seq": (lambda r: _with(r, 300, commit_seq=int("9" * 400)), "commit_seq"),
    "1e400-created_unix": (
        lambda r: _with(r, 300).replace(b'"created_unix": ', b'"created_unix": 1e400, "x": '),
        "created_unix",
    ),
    "NaN-metric": (
        lambda r: _with(r, 300).replace(b'"metrics": {', b'"metrics": {"nan": NaN, '),
        "NaN",
    ),
    "world_size-2**62": (lambda r: _with(r, 300, world_size=2**62), "world_size"),
    "files-twice": (
        lambda r: _with(r, 300).replace(b'"files": [', b'"files": [], "files": [', 1),
        "duplicate key 'files'",
    ),
    "5000-digit-step": (
        lambda r: _with(r, 300).replace(b'"step": 300', b'"step": ' + b"9" * 5000),
        "JSON",
    ),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "root"
    make_root(root, (100, 200, 300))
    return root


def _copy(pristine: Path, dest: Path) -> Path:
    subprocess.run(["cp", "-a", str(pristine), str(dest)], check=True)
    return dest


def _check_root_still_works(root: Path, problem: str, caplog) -> None:
    """Manager start-up (writable: lock, sweep, scan), latest(), checkpoints() and
    restore() of the good ones; the bad step is skipped with a warning naming it."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
        try:
            assert mgr.latest().step == 200
            assert [c.step for c in mgr.checkpoints()] == [100, 200]
            restored = mgr.restore()
            assert restored["step"] == 200
            assert (restored["model"]["w"] == state(200)["model"]["w"]).all()
            assert mgr.restore(step=100)["step"] == 100
            with pytest.raises(CorruptCheckpointError, match=problem):
                mgr.restore(step=300)
        finally:
            mgr.close()
    warned = [r.getMessage() for r in caplog.records if "checkpoint-300" in r.getMessage()]
    assert warned and any(problem in w for w in warned), [r.getMessage() for r in caplog.records]


def _check_cli(root: Path, problem: str) -> None:
    doc = run_json("list", root)
    status = {e["name"]: e for e in doc["entries"]}
    assert status["checkpoint-100"]["status"] == status["checkpoint-200"]["status"] == "ok"
    assert status["checkpoint-300"]["status"] == "corrupt"
    assert problem in status["checkpoint-300"]["problem"]
    doc = run_json("verify", root, expect_rc=1)
    result = {c["name"]: c["status"] for c in doc["checkpoints"]}
    assert result == {"checkpoint-100": "ok", "checkpoint-200": "ok", "checkpoint-300": "corrupt"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_manifest_is_skipped_and_the_rest_of_the_root_works(
    pristine, tmp_path, case, caplog
):
    make, problem = CASES[case]
    root = _copy(pristine, tmp_path / "root")
    manifest_path(root, 300).write_bytes(make(root))
    _check_root_still_works(root, problem, caplog)
    _check_cli(root, problem)


# A subprocess: its peak RSS (VmHWM) is its own. It starts a manager on ROOT (writable), asks
# for latest/checkpoints, restores the good ones, and runs `list` and `verify` in
# process (so their reads count too), then prints its peak RSS.
_RSS_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, resource, sys
    from atomic_checkpoint import CheckpointManager, CorruptCheckpointError
    from atomic_checkpoint.cli import main
    root = sys.argv[1]
    mgr = CheckpointManager(root)
    latest = mgr.latest().step
    steps = [c.step for c in mgr.checkpoints()]
    restored = mgr.restore()["step"]
    try:
        mgr.restore(step=300)
        bad = "restored"
    except CorruptCheckpointError as exc:
        bad = str(exc)
    mgr.close()
    out = {}
    for cmd in ("list", "verify"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main([cmd, root, "--json"])
        out[cmd] = (rc, json.loads(buf.getvalue()))
    # Peak RSS of this process image: VmHWM (ru_maxrss carries the parent's peak across
    # fork and exec, so a test run that imported torch would read as ours).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            peak = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    print(json.dumps({
        "latest": latest, "steps": steps, "restored": restored, "bad": bad, "cli": out,
        "maxrss_kib": peak,
    }))
    """
)

#: Peak RSS of the subprocess: Python, numpy and the library take ~60 MiB; reading a
#: 2 GiB manifest whole took 2 GiB more before the fix.
_RSS_LIMIT_KIB = 200 << 10


@pytest.mark.parametrize(
    "size_bytes",
    [pytest.param(2 << 30, id="2GiB"), pytest.param(10 << 40, id="10TiB")],
)
def test_a_huge_sparse_manifest_is_refused_by_its_size_without_reading_it(
    pristine, tmp_path, size_bytes
):
    root = _copy(pristine, tmp_path / "root")
    path = manifest_path(root, 300)
    try:
        os.truncate(path, size_bytes)  # sparse: no blocks, the size is all that is huge
    except OSError as exc:
        pytest.skip(f"{tmp_path} cannot hold a sparse {size_bytes}-byte file: {exc}")
    proc = run_python(_RSS_SCRIPT, root, timeout_s=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["latest"] == 200 and got["steps"] == [100, 200] and got["restored"] == 200
    assert f"{size_bytes} bytes" in got["bad"], got["bad"]
    (rc_list, listed), (rc_verify, verified) = got["cli"]["list"], got["cli"]["verify"]
    assert rc_list == 0 and rc_verify == 1
    entry = {e["name"]: e for e in listed["entries"]}["checkpoint-300"]
    assert entry["status"] == "corrupt" and f"{size_bytes} bytes" in entry["problem"]
    assert [c["status"] for c in verified["checkpoints"]] == ["ok", "ok", "corrupt"]
    assert got["maxrss_kib"] < _RSS_LIMIT_KIB, f"peak RSS {got['maxrss_kib']} KiB"
    assert "skipping" in proc.stderr and "checkpoint-300" in proc.stderr


# ---------------------------------------------------------------- run and lock files

NESTED = b"[" * DEEP + b"]" * DEEP


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(NESTED, id="deeply-nested"),
        pytest.param(b'{"run_id": ' + NESTED + b"}", id="nested-run_id"),
        pytest.param(None, id="sparse-10TiB"),
    ],
)
def test_a_hostile_run_file_does_not_stop_the_root(pristine, tmp_path, content, caplog):
    root = _copy(pristine, tmp_path / "root")
    run_file = root / META_DIR / "run.json"
    run_id = json.loads(run_file.read_text())["run_id"]
    if content is None:
        os.truncate(run_file, 10 << 40)
    else:
        run_file.write_bytes(content)
    proc = run_cli("list", root, "--json")
    assert proc.returncode == 0, proc.stderr
    assert [e["status"] for e in json.loads(proc.stdout)["entries"]] == ["ok"] * 3
    assert "run.json" in proc.stderr
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        reader = CheckpointManager(root, read_only=True, coordinator=SingleProcessCoordinator())
        assert reader.latest().step == 300
        reader.close()
        # A writable start takes the run id from the checkpoints and records it again.
        mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
        try:
            assert mgr.run_id == run_id
            assert mgr.restore()["step"] == 300
        finally:
            mgr.close()
    assert json.loads(run_file.read_bytes())["run_id"] == run_id


@pytest.mark.parametrize("content", [NESTED, None], ids=["deeply-nested", "sparse-10TiB"])
def test_a_hostile_stale_lock_file_is_taken_over(pristine, tmp_path, content, caplog):
    root = _copy(pristine, tmp_path / "root")
    lock = root / META_DIR / "lock.json"
    if content is None:
        lock.touch()
        os.truncate(lock, 10 << 40)
    else:
        lock.write_bytes(content)
    old = os.stat(lock).st_mtime - 3600  # written long before any lease
    os.utime(lock, (old, old))
    assert [e["status"] for e in run_json("list", root)["entries"]] == ["ok"] * 3
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator(), lease_s=30)
        try:
            assert mgr.latest().step == 300
            mgr.save(400, state(400))
        finally:
            mgr.close()
    assert any("unreadable" in r.getMessage() for r in caplog.records)
