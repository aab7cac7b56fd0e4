"""What ``verify ROOT``'s exit status promises for names that look like checkpoints.

A script runs ``atomic-checkpoint verify ROOT --quiet && upload ROOT``: exit 0 must
mean that every ``checkpoint-<step>`` entry of ROOT is a complete checkpoint that was
just verified, byte for byte. A ``checkpoint-<step>`` directory with no manifest (a
torn copy, another tool's save, a manifest deleted by hand), a ``checkpoint-<step>``
symlink, or a crashed object-store save left in place fails verify; the only
manifest-less ``checkpoint-<step>`` that does not is a marker save in progress of the
live job that holds the run lock.
"""

from __future__ import annotations

import os
import shutil

import pytest

from atomic_checkpoint.storage import open_storage
from atomic_checkpoint.strategies import MarkerStrategy
from tests.cli.helpers import Holder, error_line, make_root, run_cli, run_json

pytestmark = pytest.mark.timeout(90)


def test_the_verify_advice_for_a_folder_without_a_manifest_works_when_followed(root):
    # It said "`atomic-checkpoint verify` says what it is": verify ROOT 3 (the step the
    # user asked for) prints the same message again; verify ROOT, of the whole root, is
    # the command that says what the folder is.
    from atomic_checkpoint import CheckpointManager, CheckpointNotFoundError

    make_root(root, (1, 2))
    shutil.copytree(root / "checkpoint-2", root / "checkpoint-3")
    os.unlink(root / "checkpoint-3" / "checkpoint.manifest.json")
    mgr = CheckpointManager(root, read_only=True)
    with pytest.raises(CheckpointNotFoundError, match="has no manifest") as err:
        mgr.restore(3)
    mgr.close()
    said = str(err.value)
    command = f"`atomic-checkpoint verify {root}` (without a step)"
    assert command in said, said
    proc = run_cli("verify", root)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("checkpoint-3:"))
    assert "NOT A CHECKPOINT: no manifest: never committed by this library" in line, line
    assert "adopt ROOT --dry-run` tells whether it is complete and" in line, line
    assert "`atomic-checkpoint adopt ROOT` adopts it" in line, line


def test_verify_fails_on_checkpoint_names_that_are_not_checkpoints(tmp_path, root):
    make_root(root, (1, 2))
    # A torn copy: the data of step 2 copied to checkpoint-3, no manifest.
    shutil.copytree(root / "checkpoint-2", root / "checkpoint-3")
    os.unlink(root / "checkpoint-3" / "checkpoint.manifest.json")
    proc = run_cli("verify", root)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = {ln.split(":")[0]: ln for ln in proc.stdout.splitlines()}
    assert ": ok (" in lines["checkpoint-1"] and ": ok (" in lines["checkpoint-2"]
    assert "NOT A CHECKPOINT: no manifest" in lines["checkpoint-3"]
    assert "1 of 3 checkpoint(s) failed verification (checkpoint-3)" in error_line(proc)
    quiet = run_cli("verify", root, "--quiet")
    assert quiet.returncode == 1 and "checkpoint-3: NOT A CHECKPOINT" in quiet.stdout

    doc = run_json("verify", root, expect_rc=1)
    assert doc["ok"] is False
    assert [(c["name"], c["status"]) for c in doc["checkpoints"]] == [
        ("checkpoint-1", "ok"),
        ("checkpoint-2", "ok"),
        ("checkpoint-3", "not_a_checkpoint"),
    ]
    assert "no manifest" in doc["checkpoints"][2]["problem"]
    assert doc["skipped"] == []

    # A symbolic link named like a checkpoint (to a complete one elsewhere) fails too.
    os.rename(root / "checkpoint-3", tmp_path / "torn")
    elsewhere = tmp_path / "elsewhere"
    make_root(elsewhere, (4,))
    os.symlink(elsewhere / "checkpoint-4", root / "checkpoint-4")
    doc = run_json("verify", root, expect_rc=1)
    bad = {c["name"]: c for c in doc["checkpoints"] if c["status"] != "ok"}
    assert list(bad) == ["checkpoint-4"] and bad["checkpoint-4"]["status"] == "not_a_checkpoint"
    assert "symbolic link" in bad["checkpoint-4"]["problem"]

    # Gone: verify exits 0 again; a single step is verified as before; list stays
    # informational (exit 0) and still shows what it saw.
    os.unlink(root / "checkpoint-4")
    assert run_json("verify", root)["ok"] is True
    shutil.move(str(tmp_path / "torn"), root / "checkpoint-3")
    assert run_cli("verify", root, 2).returncode == 0
    listed = run_json("list", root)
    assert {e["name"]: e["status"] for e in listed["entries"]}["checkpoint-3"] == "foreign"


def test_verify_skips_only_a_marker_save_of_the_live_lock_holder(root):
    make_root(root, (1,))
    holder = Holder(root)  # a real job, holding the run lock
    try:
        # What a marker commit (object stores, s3fs mounts) has in ROOT mid-save: the
        # marker and an attempt with data under checkpoint-5/, no manifest yet.
        storage = open_storage(str(root))
        pending = MarkerStrategy().prepare(storage, 5, "0123456789abcdef")
        storage.write_bytes_atomic(f"{pending}/rank-00000.safetensors", b"x" * 1000)

        doc = run_json("verify", root)
        assert doc["ok"] is True and [c["name"] for c in doc["checkpoints"]] == ["checkpoint-1"]
        skipped = {s["name"]: s for s in doc["skipped"]}
        assert skipped["checkpoint-5"]["status"] == "pending"
        assert skipped["checkpoint-5"]["in_progress"] is True

        holder.kill()  # the job dies: what it left is a crashed save's leftover now
        doc = run_json("verify", root, expect_rc=1)
        bad = {c["name"]: c for c in doc["checkpoints"] if c["status"] != "ok"}
        assert bad["checkpoint-5"]["status"] == "not_a_checkpoint"
        assert "no live job holds the run lock" in bad["checkpoint-5"]["problem"]
        assert "clean" in bad["checkpoint-5"]["problem"]
        assert "checkpoint-5" not in {s["name"] for s in doc["skipped"]}
    finally:
        holder.close()


def test_a_marker_save_of_the_live_job_that_has_only_made_its_directory_is_in_progress(root):
    # A marker save creates checkpoint-<step>/, then its marker in it; on a mounted
    # object store the gap is a round trip. verify landing there said "NOT A CHECKPOINT
    # ... remove it" about the live job's save and exited 1.
    make_root(root, (1,))
    holder = Holder(root)
    try:
        (root / "checkpoint-5").mkdir()  # the instant before the marker is written
        doc = run_json("verify", root)
        assert doc["ok"] is True, doc
        skipped = {s["name"]: s for s in doc["skipped"]}
        assert skipped["checkpoint-5"]["in_progress"] is True
        holder.kill()  # no live job: an empty checkpoint-<step>/ is not a checkpoint
        doc = run_json("verify", root, expect_rc=1)
        bad = {c["name"]: c["status"] for c in doc["checkpoints"] if c["status"] != "ok"}
        assert bad == {"checkpoint-5": "not_a_checkpoint"}
    finally:
        holder.close()


def test_verify_takes_one_checkpoint_directory_as_its_root(tmp_path, root):
    # A path-style save (DCP's checkpoint_id="ckpts/step-100") is a directory with a
    # manifest, not a root: verify said "nothing to verify", so `verify ... && upload`
    # could never pass for it.
    make_root(root, (1, 2))
    single = tmp_path / "ckpts" / "step-100"
    single.parent.mkdir()
    shutil.copytree(root / "checkpoint-2", single)
    for target in (single, root / "checkpoint-1"):
        proc = run_cli("verify", target)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ": ok (" in proc.stdout and "1 ok, 0 failed" in proc.stdout, proc.stdout
    state = next(p for p in single.iterdir() if p.name.endswith(".safetensors"))
    with open(state, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    proc = run_cli("verify", single)
    assert proc.returncode == 1 and "CORRUPT" in proc.stdout, proc.stdout + proc.stderr
    assert run_json("verify", root)["ok"]  # a root is still verified as one
