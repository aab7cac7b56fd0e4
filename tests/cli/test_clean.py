"""``atomic-checkpoint clean``: abandoned pending/trash data, and the run lock."""

from __future__ import annotations

import os
import time

import pytest

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from tests.cli.helpers import (
    Holder,
    crash_during_save,
    error_line,
    make_root,
    run_cli,
    run_json,
    tree_bytes,
    wait_for,
)


@pytest.mark.timeout(90)
def test_clean_removes_crash_leftovers_and_keeps_checkpoints(root):
    make_root(root, (100, 200, 300))
    pending = crash_during_save(root, 400)  # a save killed after writing its files
    # A prune killed between un-commit and delete leaves its data in .trash/.
    proc = run_cli(
        "prune", root, "--keep-last", "2", env={"ATOMIC_CHECKPOINT_FAULTS": "mid_delete@0=kill"}
    )
    assert proc.returncode == -9
    [trash] = list((root / ".trash").iterdir())
    sizes = {
        f".trash/{trash.name}": tree_bytes(trash),
        f".pending/{pending.name}": tree_bytes(pending),
    }
    assert all(sizes.values())

    doc = run_json("clean", root, "--dry-run")
    assert doc["dry_run"] is True and doc["failed"] == []
    assert {i["name"]: i["size_bytes"] for i in doc["removed"]} == sizes
    assert {i["name"]: i["kind"] for i in doc["removed"]} == {
        f".trash/{trash.name}": "trash",
        f".pending/{pending.name}": "pending",
    }
    assert doc["freed_bytes"] == sum(sizes.values())
    # The killed save's lock is left behind, but its process is provably gone.
    assert doc["lock"]["is_live"] is False and doc["lock"]["pid"] > 0
    assert trash.exists() and pending.exists()  # a dry run changes nothing

    proc = run_cli("clean", root, entry_point=True)
    assert proc.returncode == 0, proc.stderr
    assert f"removed .pending/{pending.name} (pending," in proc.stdout
    assert f"removed .trash/{trash.name} (trash," in proc.stdout
    assert not trash.exists() and not pending.exists()
    assert run_cli("verify", root).returncode == 0  # 200 and 300 are intact
    assert [e["step"] for e in run_json("list", root)["entries"]] == [200, 300]

    proc = run_cli("clean", root)
    assert proc.returncode == 0 and "nothing to clean" in proc.stdout


@pytest.mark.timeout(90)
def test_clean_refuses_while_a_live_save_is_in_progress(root):
    make_root(root, (1,))
    holder = Holder(root, step=5, faults="after_write@0=hang:5")
    try:
        holder.save()  # hangs after writing: its pending directory is in use
        pending_dir = root / ".pending"
        wait_for(lambda: any(pending_dir.iterdir()), what="the live save's pending dir")
        [live] = list(pending_dir.iterdir())

        proc = run_cli("clean", root)
        assert proc.returncode == 3, proc.stderr
        err = error_line(proc)
        assert f"run {holder.run_id!r}" in err and f"pid {holder.pid}" in err
        assert "refusing to clean" in err and "--force" in err
        assert live.exists()

        # A dry run never refuses, but says the real one would.
        proc = run_cli("clean", root, "--dry-run")
        assert proc.returncode == 0
        assert f"would remove .pending/{live.name}" in proc.stdout
        assert "would refuse" in proc.stderr
        assert live.exists()
        doc = run_json("clean", root, "--dry-run")
        assert doc["lock"]["run_id"] == holder.run_id and doc["lock"]["is_live"] is True
        assert doc["lock"]["expires_unix"] > time.time()
    finally:
        holder.close()
    # Killed: same host, pid gone, so the lock is provably abandoned.
    doc = run_json("clean", root)
    assert doc["lock"]["is_live"] is False and doc["lock_removed"] is False
    assert [i["name"] for i in doc["removed"]] == [f".pending/{live.name}"]
    assert not live.exists()


@pytest.mark.timeout(90)
def test_clean_force_removes_the_lock_and_fences_the_holder(root):
    make_root(root, (1,))
    holder = Holder(root, step=7)
    try:
        proc = run_cli("clean", root, "--force", "--json")
        assert proc.returncode == 0, proc.stderr
        assert "warning: --force" in proc.stderr and holder.run_id in proc.stderr
        assert "removed the run lock" in proc.stderr
        assert not (root / ".atomic-checkpoint" / "lock.json").exists()
        # The job that lost its lock can no longer commit.
        holder.save()
        line = holder.readline()
        assert line.startswith("FAILED FencedError"), line
        assert not (root / "checkpoint-7").exists()
    finally:
        holder.close()
    # The root is free: a new job starts without takeover.
    mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
    mgr.close()


@pytest.mark.timeout(90)
def test_clean_holder_on_another_host_waits_for_its_lease(root):
    """A holder on another host cannot be probed by pid: only its lease tells."""
    make_root(root, (1,))
    holder = Holder(root, lease_s=4.0, host="node-b")
    holder.close()  # dead, but this host cannot know that
    crash_dir = root / ".pending" / "checkpoint-9.0123456789abcdef"
    crash_dir.mkdir(parents=True)
    proc = run_cli("clean", root)
    assert proc.returncode == 3 and "host 'node-b'" in error_line(proc)
    # It says why a dead holder is not seen as dead here, and what to do about it.
    assert "only there can its process be seen to be gone" in error_line(proc)
    assert "ATOMIC_CHECKPOINT_HOST=node-b" in error_line(proc)
    assert crash_dir.exists()
    expires = run_json("clean", root, "--dry-run")["lock"]["expires_unix"]
    wait_for(lambda: time.time() > expires + 0.2, timeout_s=10, what="lease expiry")
    doc = run_json("clean", root)
    assert doc["lock"]["is_live"] is False and not crash_dir.exists()


@pytest.mark.timeout(60)
def test_clean_unlinks_stray_files_and_symlinks_without_following_them(tmp_path, root):
    make_root(root, (1,))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.bin").write_bytes(b"x" * 1000)
    os.symlink(precious, root / ".pending" / "checkpoint-3.0123456789abcdef")
    (root / ".pending" / "stray.txt").write_text("left by hand")
    doc = run_json("clean", root)
    # Only what the library names so is removed: a file of someone else's stays.
    assert [i["name"] for i in doc["removed"]] == [".pending/checkpoint-3.0123456789abcdef"]
    assert [p.name for p in (root / ".pending").iterdir()] == ["stray.txt"]
    assert (precious / "data.bin").read_bytes() == b"x" * 1000
    assert (root / "checkpoint-1").is_dir()


@pytest.mark.timeout(90)
def test_clean_and_a_start_never_delete_files_the_library_did_not_write(tmp_path):
    # A directory that was never a checkpoint root, with folders named .pending and
    # .trash of the user's own: clean, and a manager's start (its sweep), removed them.
    home = tmp_path / "home"
    (home / ".pending" / "thesis").mkdir(parents=True)
    (home / ".trash").mkdir()
    (home / ".pending" / "thesis" / "chapter1.tex").write_text("my thesis")
    (home / ".trash" / "recover-me.txt").write_text("still needed")
    (home / ".trash" / "checkpoint-7.notatoken").mkdir()  # near our names, not one
    mine = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    doc = run_json("clean", home)
    assert doc["removed"] == [] and doc["failed"] == []
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == mine
    with CheckpointManager(home) as mgr:
        mgr.save(1, {"w": [1.0]})
    left = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert set(mine) <= set(left), set(mine) - set(left)


@pytest.mark.timeout(60)
def test_clean_missing_root_exit_2(tmp_path):
    proc = run_cli("clean", tmp_path / "missing", "--dry-run")
    assert proc.returncode == 2 and "does not exist" in error_line(proc)


@pytest.mark.timeout(60)
def test_a_torn_lock_file_counts_as_live_only_within_a_lease(root):
    # A crash while the lock was first written leaves a file that is no lock document:
    # a job may be writing it right now, so a fresh one is refused (exit 3); one older
    # than a lease was refused for ever ("it frees itself when its lease expires"),
    # while a manager's start took it over.
    make_root(root, (100, 200))
    lock = root / ".atomic-checkpoint" / "lock.json"
    lock.write_bytes(b"\x00garbage")
    proc = run_cli("prune", root, "--keep-last", "1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "an unreadable lock file (not a lock document: torn by a crash" in proc.stderr
    old = time.time() - 2 * 86400
    os.utime(lock, (old, old))
    proc = run_cli("prune", root, "--keep-last", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "takeover=True" not in proc.stdout + proc.stderr
