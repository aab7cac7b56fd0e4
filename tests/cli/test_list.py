"""``atomic-checkpoint list``: what is under a root, as a table and as JSON."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager
from tests.cli.helpers import error_line, make_root, mixed_root, run_cli, run_json, state_file


@pytest.mark.timeout(60)
def test_list_healthy_root_json_and_table(root):
    t0 = time.time()
    # 1000 after 300: ordering is by integer step, not by name (checkpoint-1000 < -300).
    rid = make_root(root, (100, 300, 1000), losses={100: 0.5, 300: 0.25, 1000: 0.125})
    t1 = time.time()

    doc = run_json("list", root)
    assert doc["command"] == "list"
    assert doc["root"] == str(root)
    assert (
        doc["run_id"]
        == rid
        == json.loads((root / ".atomic-checkpoint/run.json").read_text())["run_id"]
    )
    entries = doc["entries"]
    assert [e["step"] for e in entries] == [100, 300, 1000]
    for e, loss in zip(entries, (0.5, 0.25, 0.125), strict=True):
        assert e["status"] == "ok" and e["problem"] is None
        assert e["name"] == f"checkpoint-{e['step']}"
        assert e["path"] == str(root / e["name"])
        assert e["run_id"] == rid
        assert e["size_bytes"] == state_file(root, e["step"]).stat().st_size
        assert isinstance(e["created_unix"], float) and t0 - 1 <= e["created_unix"] <= t1 + 1
        assert e["metrics"] == {"acc": e["step"] / 1000, "eval_loss": loss}
    assert [e["commit_seq"] for e in entries] == [1, 2, 3]

    # The same through the installed entry point, as a table.
    proc = run_cli("list", root, entry_point=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STEP", "COMMITTED", "SIZE", "METRICS", "STATUS"]
    rows = [ln for ln in lines[1:] if ln.startswith("checkpoint-")]
    assert [r.split()[0] for r in rows] == ["checkpoint-100", "checkpoint-300", "checkpoint-1000"]
    for row, e in zip(rows, entries, strict=True):
        local = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["created_unix"]))
        assert local in row
        assert f"{e['size_bytes']} B" in row
        assert f"eval_loss={e['metrics']['eval_loss']:.4g}" in row
        assert row.rstrip().endswith("ok")
    assert f"3 ok (run {rid})" in proc.stdout


@pytest.mark.timeout(90)
def test_list_mixed_root_names_every_problem_and_exits_0(tmp_path):
    root, rid = mixed_root(tmp_path)
    doc = run_json("list", root)  # informational: exit 0 although entries are corrupt
    by_name = {e["name"]: e for e in doc["entries"]}
    status = {name: e["status"] for name, e in by_name.items()}
    pending = [n for n in by_name if n.startswith(".pending/")]
    assert len(pending) == 1
    assert status == {
        "checkpoint-007": "foreign",
        "notes.txt": "foreign",
        "checkpoint-100": "ok",
        "checkpoint-200": "corrupt",
        "checkpoint-300": "ok",  # list checks sizes, not checksums: verify catches it
        "checkpoint-400": "corrupt",
        "checkpoint-500": "corrupt",
        "checkpoint-600": "foreign",
        "checkpoint-700": "corrupt",
        "checkpoint-800": "corrupt",
        "checkpoint-900": "ok",
        "checkpoint-1000": "foreign",
        pending[0]: "pending",
    }
    problem = {name: e["problem"] for name, e in by_name.items()}
    assert "is 10 bytes, manifest says" in problem["checkpoint-200"]
    assert "'rank-00000.safetensors' is missing" in problem["checkpoint-400"]
    assert "not valid JSON" in problem["checkpoint-500"]
    assert problem["checkpoint-600"] == "no manifest"
    assert "'..'" in problem["checkpoint-700"]
    assert "resolves outside the checkpoint" in problem["checkpoint-800"]
    assert problem["checkpoint-1000"] == "belongs to run 'other-run'"
    assert problem["notes.txt"] == "not a checkpoint name"
    assert problem[pending[0]] == "not committed"
    # The problem is relative to the row: the checkpoint's path is not repeated.
    assert not problem["checkpoint-200"].startswith(str(root))
    # Committed entries before pending ones, ascending by step.
    steps = [e["step"] for e in doc["entries"] if e["status"] != "pending" and e["step"]]
    assert steps == sorted(steps)
    assert doc["entries"][-1]["status"] == "pending"
    assert by_name[pending[0]]["step"] == 950
    assert by_name[pending[0]]["size_bytes"] > 8000  # the 1000 float64 it had written
    assert by_name["checkpoint-1000"]["run_id"] == "other-run"

    proc = run_cli("list", root)
    assert proc.returncode == 0 and proc.stderr == ""
    row = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln.strip()}
    assert "corrupt: file 'rank-00000.safetensors' is 10 bytes" in row["checkpoint-200"]
    assert "foreign: belongs to run 'other-run'" in row["checkpoint-1000"]
    assert "pending: not committed" in row[pending[0]]
    assert f"{root}: 5 corrupt, 4 foreign, 3 ok, 1 pending (run {rid})" in proc.stdout


@pytest.mark.timeout(60)
def test_list_all_runs_validates_other_runs_and_shows_run_column(tmp_path, root):
    rid = make_root(root, (100,))
    from tests.cli.helpers import foreign_run

    foreign_run(root, 1000, tmp_path / "other")
    doc = run_json("list", root, "--all-runs")
    assert doc["run_id"] == rid  # the run ROOT records, also when every run is listed
    assert [(e["step"], e["status"], e["run_id"]) for e in doc["entries"]] == [
        (100, "ok", rid),
        (1000, "ok", "other-run"),
    ]
    proc = run_cli("list", root, "--all-runs")
    assert proc.stdout.splitlines()[0].split() == [
        "NAME", "STEP", "COMMITTED", "SIZE", "METRICS", "RUN", "STATUS"
    ]  # fmt: skip
    assert "other-run" in proc.stdout
    # verify verifies them too (every checkpoint-<step> of ROOT counts), naming the run.
    verified = run_cli("verify", root)
    said = "checkpoint-1000 (run other-run): ok" in verified.stdout
    assert verified.returncode == 0 and said, verified.stdout + verified.stderr
    assert "2 ok, 0 failed" in verified.stdout


@pytest.mark.timeout(60)
def test_list_root_without_run_file_and_empty_root(tmp_path, root):
    make_root(root, (5,))
    (root / ".atomic-checkpoint" / "run.json").write_text("{not json")
    proc = run_cli("list", root, "--json")
    assert proc.returncode == 0
    assert "run.json is not valid JSON" in proc.stderr and "every run" in proc.stderr
    assert [e["status"] for e in json.loads(proc.stdout)["entries"]] == ["ok"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_json("list", empty)["entries"] == []
    proc = run_cli("list", empty)
    assert proc.returncode == 0 and "no checkpoints" in proc.stdout


@pytest.mark.timeout(60)
def test_list_missing_or_file_root_is_exit_2_with_one_line(tmp_path):
    proc = run_cli("list", tmp_path / "nope")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "does not exist" in error_line(proc) and str(tmp_path / "nope") in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    f = tmp_path / "file"
    f.write_text("x")
    proc = run_cli("list", f, "--json")
    assert proc.returncode == 2 and "is not a directory" in error_line(proc)
    # URL roots are read through fsspec (tests/cli/test_object_store.py); one whose
    # scheme no installed filesystem serves is a usage error naming it.
    proc = run_cli("list", "nosuchscheme://bucket/run")
    assert proc.returncode == 2 and "nosuchscheme://bucket/run" in error_line(proc)


@pytest.mark.timeout(60)
def test_list_inspect_and_verify_take_one_checkpoint_directory(tmp_path, root):
    # list showed the manifest as a foreign entry, inspect found "no checkpoint step
    # 100", and verify of a copy without its manifest said "nothing to verify".
    make_root(root, (100, 200))
    one = root / "checkpoint-100"
    listed = run_json("list", one)
    assert [(e["name"], e["step"], e["status"]) for e in listed["entries"]] == [
        ("checkpoint-100", 100, "ok")
    ]
    inspected = run_json("inspect", one, "100")
    assert inspected["name"] == "checkpoint-100" and inspected["status"] == "ok"
    torn = tmp_path / "torn" / "checkpoint-200"
    shutil.copytree(root / "checkpoint-200", torn)
    (torn / "checkpoint.manifest.json").unlink()
    proc = run_cli("verify", torn)
    assert proc.returncode == 1
    assert "holds the state files of one checkpoint" in proc.stderr
    assert "Copy the complete checkpoint again" in proc.stderr


@pytest.mark.timeout(60)
def test_a_root_the_terminal_cannot_spell_and_roots_that_name_no_directory(tmp_path):
    # Under a Latin-1 locale, a root named in Japanese made verify, list and inspect
    # fail with "internal error" and exit 1: `verify ROOT && upload` refused a healthy
    # root.
    root = tmp_path / "run-日本語"
    make_root(root, (100,))
    latin = {"PYTHONIOENCODING": "latin-1"}
    for args in (("list", root), ("verify", root), ("inspect", root, "100")):
        proc = run_cli(*args, env=latin)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        assert "run-\\u65e5\\u672c\\u8a9e" in proc.stdout + proc.stderr, proc.stdout
    # A dangling link, and a file URL one slash short: said, exit 2.
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "unmounted" / "run")
    proc = run_cli("list", link)
    assert proc.returncode == 2 and "is a symbolic link to" in proc.stderr, proc.stderr
    proc = run_cli("list", "file://tmp/run")
    assert proc.returncode == 2 and "names the host 'tmp'" in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_control_characters_from_the_root_never_reach_the_terminal(root):
    # Names, run ids, metric and tensor names come from files anyone may have written:
    # an ESC sequence among them retitled or cleared the terminal of `list`/`inspect`.
    evil = "\x1b]0;PWNED\x07\x1b[2Jloss\x9b"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {evil: np.zeros(2)}, metrics={evil: 0.5})
    for args in (("list", root), ("inspect", root, 1), ("verify", root)):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        shown = proc.stdout + proc.stderr
        assert not any(c in shown for c in "\x1b\x07\x9b"), shown
        assert "\\u001b]0;PWNED\\u0007" in proc.stdout or args[0] == "verify", proc.stdout
    doc = run_json("inspect", root, 1)  # JSON stays JSON, with the name as it is
    assert evil in doc["manifest"]["metrics"]
