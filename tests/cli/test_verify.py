"""``atomic-checkpoint verify``: full checksum verification, exit status, progress."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from tests.cli.helpers import (
    cli_env,
    error_line,
    flip_byte,
    make_root,
    mixed_root,
    run_cli,
    run_json,
    state_file,
)


@pytest.mark.timeout(60)
def test_verify_healthy_root_exit_0_line_per_checkpoint(root):
    rid = make_root(root, (100, 200, 1000))
    proc = run_cli("verify", root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:3]] == [
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-1000",
    ]
    assert all(": ok (" in ln for ln in lines[:3])
    assert lines[3] == f"{root}: 3 ok, 0 failed"

    doc = run_json("verify", root)
    assert doc["ok"] is True and doc["run_id"] == rid and doc["skipped"] == []
    for c in doc["checkpoints"]:
        size = state_file(root, c["step"]).stat().st_size
        assert c["status"] == "ok" and c["problem"] is None
        assert c["size_bytes"] == c["verified_bytes"] == size  # every byte was hashed
        assert isinstance(c["seconds"], float)

    quiet = run_cli("verify", root, "--quiet", entry_point=True)
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""


@pytest.mark.timeout(90)
def test_verify_mixed_root_names_each_problem_and_exits_1(tmp_path):
    root, _ = mixed_root(tmp_path)
    proc = run_cli("verify", root)
    assert proc.returncode == 1
    line = {ln.split(":")[0]: ln for ln in proc.stdout.splitlines()}
    assert ": ok (" in line["checkpoint-100"] and ": ok (" in line["checkpoint-900"]
    assert "CORRUPT: file 'rank-00000.safetensors' is 10 bytes" in line["checkpoint-200"]
    # Same size, one byte flipped: only the checksum can tell, and verify reads it all.
    assert "CORRUPT:" in line["checkpoint-300"] and "checksum" in line["checkpoint-300"]
    assert "CORRUPT: file 'rank-00000.safetensors' is missing" in line["checkpoint-400"]
    assert "CORRUPT:" in line["checkpoint-500"] and "not valid JSON" in line["checkpoint-500"]
    assert "CORRUPT:" in line["checkpoint-700"] and "'..'" in line["checkpoint-700"]
    assert "resolves outside the checkpoint" in line["checkpoint-800"]
    # A checkpoint name with no manifest is not a checkpoint: it fails verify too.
    assert "NOT A CHECKPOINT: no manifest" in line["checkpoint-600"]
    # It may be another tool's complete checkpoint: adopt is offered before removal.
    assert (
        "`atomic-checkpoint adopt ROOT --dry-run` tells whether it is complete"
        in (line["checkpoint-600"])
    )
    for skipped in ("notes.txt", "checkpoint-007"):
        assert skipped not in line
    assert ": ok (" in line["checkpoint-1000 (run other-run)"]
    err = error_line(proc)
    assert "7 of 10 checkpoint(s) failed verification" in err
    assert "checkpoint-200, checkpoint-300" in err

    doc = run_json("verify", root, expect_rc=1)
    assert doc["ok"] is False
    status = {c["name"]: c["status"] for c in doc["checkpoints"]}
    assert status == {
        "checkpoint-100": "ok",
        "checkpoint-200": "corrupt",
        "checkpoint-300": "corrupt",
        "checkpoint-400": "corrupt",
        "checkpoint-500": "corrupt",
        "checkpoint-600": "not_a_checkpoint",
        "checkpoint-700": "corrupt",
        "checkpoint-800": "corrupt",
        "checkpoint-900": "ok",
        "checkpoint-1000": "ok",  # another run's: verified too, every checkpoint-<step> counts
    }
    assert {c["name"]: c["run_id"] for c in doc["checkpoints"]}["checkpoint-1000"] == "other-run"
    skipped = {s["name"]: s["status"] for s in doc["skipped"]}
    assert skipped.pop(next(n for n in skipped if n.startswith(".pending/"))) == "pending"
    assert skipped == {"checkpoint-007": "foreign", "notes.txt": "foreign"}

    quiet = run_cli("verify", root, "-q")
    assert quiet.returncode == 1
    assert quiet.stdout.count("CORRUPT:") == 6 and ": ok" not in quiet.stdout
    assert quiet.stdout.count("NOT A CHECKPOINT:") == 1


@pytest.mark.timeout(90)
def test_verify_one_step(tmp_path):
    root, _ = mixed_root(tmp_path)
    proc = run_cli("verify", root, 100)
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0].startswith("checkpoint-100: ok (")
    assert "checkpoint-900" not in proc.stdout

    proc = run_cli("verify", root, 300)
    assert proc.returncode == 1 and "checksum" in error_line(proc)

    # Another run's checkpoint can be verified when asked for by step.
    doc = run_json("verify", root, 1000)
    assert [(c["name"], c["status"], c["run_id"]) for c in doc["checkpoints"]] == [
        ("checkpoint-1000", "ok", "other-run")
    ]

    proc = run_cli("verify", root, 600)
    assert proc.returncode == 1
    assert "has no manifest" in error_line(proc) and "never committed" in proc.stderr

    proc = run_cli("verify", root, 12345)
    assert proc.returncode == 1
    assert "no checkpoint step 12345" in error_line(proc) and "1000" in proc.stderr


@pytest.mark.timeout(60)
def test_verify_usage_and_environment_errors_exit_2(tmp_path, root):
    make_root(root, (1,))
    for bad in ("abc", "-5", "1.5"):
        proc = run_cli("verify", root, bad)
        assert proc.returncode == 2, (bad, proc.stderr)
        assert "invalid step" in error_line(proc) and proc.stdout == ""
    proc = run_cli("verify", tmp_path / "missing")
    assert proc.returncode == 2 and "does not exist" in error_line(proc)

    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("verify", empty)
    assert proc.returncode == 1 and "nothing to verify" in error_line(proc)


@pytest.mark.timeout(60)
def test_verify_never_runs_pickled_code_from_a_checkpoint(tmp_path, root):
    """A checkpoint saved with allow_pickle holds a pickle that would create a
    directory when unpickled; verify and inspect must read it as bytes only."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator(), allow_pickle=True)
    mgr.save(1, {"w": np.ones(3), "evil": Evil()})
    mgr.close()
    assert not marker.exists()
    assert run_cli("verify", root).returncode == 0
    doc = run_json("inspect", root, 1)
    assert [t["dtype"] for t in doc["files"][0]["tensors"]] == ["F64", "U8"]
    assert not marker.exists()


def _run_with_tty_stderr(args, timeout_s=60.0):
    """Run the CLI with stderr on a real pseudo-terminal; returns (rc, stdout, tty)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "atomic_checkpoint", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=cli_env(),
        )
        os.close(slave)
        slave = -1
        chunks = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return proc.returncode, out.decode(), b"".join(chunks).decode()
    finally:
        os.close(master)
        if slave != -1:
            os.close(slave)


@pytest.mark.timeout(90)
def test_verify_progress_bar_on_a_terminal_and_lines_with_progress(root):
    mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
    mgr.save(1, {"w": np.ones(5 << 20, dtype=np.float64)})  # 40 MiB: large enough
    mgr.save(2, {"w": np.ones(10)})  # small: no bar unless asked
    mgr.close()

    rc, out, tty = _run_with_tty_stderr(["verify", root, 1])
    assert rc == 0
    assert "\rcheckpoint-1 [" in tty and "40.0 MiB" in tty and "/s" in tty
    assert tty.endswith("\r\x1b[K")  # the bar is erased before the result line
    assert out.startswith("checkpoint-1: ok (40.0 MiB") and "\r" not in out

    rc, out, tty = _run_with_tty_stderr(["verify", root, 2])
    assert rc == 0 and tty == ""
    rc, out, tty = _run_with_tty_stderr(["verify", root, 1, "--no-progress"])
    assert rc == 0 and tty == ""

    # --progress into a pipe: plain lines with the rate, and a last line per checkpoint.
    proc = run_cli("verify", root, "--progress", "--json")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["ok"] is True  # stdout stays pure JSON
    lines = proc.stderr.splitlines()
    assert "\r" not in proc.stderr
    assert any(
        ln.startswith("checkpoint-1:") and "/ 40.0 MiB" in ln and ln.endswith("B/s") for ln in lines
    )
    final = [ln for ln in lines if "verified" in ln]
    assert [ln.split(":")[0] for ln in final] == ["checkpoint-1", "checkpoint-2"]
    assert final[0].startswith("checkpoint-1: verified 40.0 MiB in ") and "/s)" in final[0]


@pytest.mark.timeout(60)
def test_verify_corruption_found_after_list_said_ok(root):
    """The user-facing difference between list (sizes) and verify (every byte)."""
    make_root(root, (10, 20))
    flip_byte(state_file(root, 20), -3)  # in the data: only the checksum can tell
    assert [e["status"] for e in run_json("list", root)["entries"]] == ["ok", "ok"]
    doc = run_json("verify", root, expect_rc=1)
    assert [c["status"] for c in doc["checkpoints"]] == ["ok", "corrupt"]
    assert "does not match the manifest" in doc["checkpoints"][1]["problem"]
    # In the header: its check, made before the checksum, tells.
    flip_byte(state_file(root, 20), -3)
    flip_byte(state_file(root, 20), 40)
    doc = run_json("verify", root, expect_rc=1)
    assert "header" in doc["checkpoints"][1]["problem"], doc


def _job_acts_while_verified(monkeypatch, root, step, act):
    """Make the real ``verify`` meet a real change of ROOT just as it starts reading
    checkpoint ``step``: the job that owns ROOT (a real manager, opened at that moment)
    does ``act(manager)`` (its retention, a rollback), which un-commits checkpoints."""
    from atomic_checkpoint import catalog

    real = catalog.validate_consistent
    done: list[int] = []
    acted: list[bool] = []

    def validate(storage, name, manifest, **kwargs):
        if manifest.step == step and kwargs.get("full") and not acted:
            acted.append(True)  # once: the manager reads through here too
            mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
            try:
                done.extend(act(mgr))
            finally:
                mgr.close()
        return real(storage, name, manifest, **kwargs)

    monkeypatch.setattr(catalog, "validate_consistent", validate)
    return done


@pytest.mark.timeout(60)
def test_a_checkpoint_rotated_away_while_verified_is_skipped_not_failed(
    tmp_path, root, monkeypatch, capsys
):
    """``verify ROOT`` of a live job's root: the job's retention un-commits the oldest
    checkpoint while verify reads it. That checkpoint is gone, not corrupt: listed as
    skipped (status ``removed``) and the exit status is 0. Asked for by step, or when
    every checkpoint went, nothing was verified: exit 1."""
    from atomic_checkpoint import KeepLast
    from atomic_checkpoint.cli import main

    def rotate(mgr):
        mgr.retention = KeepLast(1)
        return mgr.apply_retention()

    make_root(root, (10, 20, 30))
    removed = _job_acts_while_verified(monkeypatch, root, 10, rotate)
    assert main(["verify", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(removed) == [10, 20]
    assert doc["ok"] is True
    assert [(c["name"], c["status"]) for c in doc["checkpoints"]] == [("checkpoint-30", "ok")]
    assert [(s["name"], s["status"]) for s in doc["skipped"]] == [
        ("checkpoint-10", "removed"),
        ("checkpoint-20", "removed"),
    ]

    root = tmp_path / "root2"
    make_root(root, (10, 20))
    _job_acts_while_verified(monkeypatch, root, 10, rotate)
    assert main(["verify", str(root), "10"]) == 1
    assert "removed while being verified" in capsys.readouterr().out

    root = tmp_path / "root3"
    make_root(root, (10, 20))
    removed = _job_acts_while_verified(
        monkeypatch, root, 10, lambda m: m.rollback(0, allow_empty=True)
    )
    assert main(["verify", str(root)]) == 1
    captured = capsys.readouterr()
    assert removed == [20, 10]
    assert "checkpoint-10: removed while being verified" in captured.out
    assert "nothing was verified" in captured.err

    # Every listed checkpoint rotated away by a job that saved meanwhile: the one it
    # committed since is verified (it said "nothing was verified", exit 1: a false
    # alarm for `verify ROOT --quiet || alert` on a job that saves often).
    def save_and_rotate(mgr):
        mgr.save(30, {"w": np.arange(4.0)})
        return rotate(mgr)

    root = tmp_path / "root4"
    make_root(root, (10, 20))
    removed = _job_acts_while_verified(monkeypatch, root, 10, save_and_rotate)
    assert main(["verify", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(removed) == [10, 20]
    assert [(c["name"], c["status"]) for c in doc["checkpoints"]] == [("checkpoint-30", "ok")]


@pytest.mark.timeout(90)
def test_verify_root_fails_on_another_runs_corrupt_checkpoint(tmp_path):
    # `verify ROOT --quiet && upload ROOT`: another run's checkpoint copied into ROOT,
    # corrupt, was skipped and verify exited 0.
    from tests.cli.helpers import flip_byte, foreign_run, make_root, state_file

    root = tmp_path / "root"
    make_root(root, (1,))
    foreign_run(root, 5, tmp_path / "other")
    assert run_cli("verify", root, "--quiet").returncode == 0
    flip_byte(state_file(root, 5), -5)
    proc = run_cli("verify", root)
    assert proc.returncode == 1
    assert "checkpoint-5 (run other-run): CORRUPT:" in proc.stdout, proc.stdout
    assert "checkpoint-1: ok" in proc.stdout
