"""Nothing lost: overwrites without an atomic exchange, clean-up failures after a durable
commit, roots without (or with a damaged) run file, and directory fsyncs of ``saving()``.

Real directories, real processes killed with SIGKILL at the exact moment (a named fault
point, or the storage call itself), a real sshfs mount where it is cheap, a real ext4
filesystem whose immutable files refuse deletion.
"""

# pytest fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import atomic_checkpoint.storage.local as local_storage
from atomic_checkpoint import CheckpointManager, KeepLast, ResumeError
from atomic_checkpoint.layout import META_DIR, PENDING_DIR, TRASH_DIR
from tests.cli.helpers import run_cli
from tests.faults.test_failure_modes import (
    REPO,
    assert_killed,
    checkpoint_dirs,
    leftovers,
    np_state,
)
from tests.helpers import last_json, run_python, same
from tests.testbed.pytest_fixtures import small_disk, sshfs_export  # noqa: F401

pytestmark = pytest.mark.timeout(120)

RUN_FILE = f"{META_DIR}/run.json"

# A child that saves (step, variant, overwrite) triples and then closes. Options:
# "no-renameat2" takes renameat2 away, as on Windows and macOS: no RENAME_EXCHANGE, so
# an overwrite is two renames (sshfs and NFS refuse renameat2's flags: the same path);
# "kill-between-renames" SIGKILLs the process at the storage call that would rename the
# new copy in while the old one sits in .trash/; "kill-writing-run-file" at the first
# write of the run file's bytes (both work whatever fault points exist).
_CHILD = """
import json, os, signal, sys
sys.path.insert(0, {repo!r})
import atomic_checkpoint.storage.local as local
from atomic_checkpoint import CheckpointManager
from tests.faults.test_failure_modes import np_state

root, plan, opts = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3].split(",")
if "no-renameat2" in opts:
    local._renameat2 = None
if "kill-between-renames" in opts:
    real_rename = local.LocalStorage.rename_dir

    def rename_dir(self, src, dst):
        if src.startswith(".pending/") and any(
            n.startswith(dst + ".") for n in self.listdir(".trash")
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(self, src, dst)

    local.LocalStorage.rename_dir = rename_dir
if "kill-writing-run-file" in opts:
    real_write = os.write

    def write(fd, data):
        if os.path.basename(os.readlink(f"/proc/self/fd/{{fd}}")).startswith("run.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(fd, data)

    os.write = write
mgr = CheckpointManager(root)
for step, variant, overwrite in plan:
    mgr.save(step, np_state(step, variant), overwrite=overwrite)
mgr.close()
print("done")
"""


def run_child(
    root: Path, plan: list[tuple[int, int, bool]], *, opts: str = "", fault: str = ""
) -> subprocess.CompletedProcess[str]:
    return run_python(_CHILD.format(repo=REPO), root, json.dumps(plan), opts, faults=fault)


def assert_done(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0 and "done" in proc.stdout, (proc.returncode, proc.stderr)


def in_the_window(root: Path) -> None:
    """The state a crash between the two renames leaves: step 5 absent, the old copy
    in .trash/, the new one in .pending/."""
    assert "checkpoint-5" not in checkpoint_dirs(root)
    assert len(os.listdir(root / TRASH_DIR)) == 1 and len(os.listdir(root / PENDING_DIR)) == 1


# ------------------------------------------------------------------ 1: overwrite window
def test_overwrite_killed_between_its_renames_resumes_the_new_copy(tmp_path, caplog):
    # The named fault point between the two renames of an overwrite without exchange.
    root = tmp_path / "r"
    assert_done(run_child(root, [(5, 0, False)], opts="no-renameat2"))
    proc = run_child(root, [(5, 1, True)], opts="no-renameat2", fault="mid_replace@0=kill")
    assert_killed(proc)
    in_the_window(root)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = CheckpointManager(root, resume="must")
    assert mgr.latest().step == 5
    assert same(mgr.restore(), np_state(5, 1))  # the new copy: it was complete
    assert leftovers(root) == []
    assert "restored the new copy" in caplog.text
    mgr.close()


def test_overwrite_killed_between_its_renames_on_sshfs(sshfs_export, tmp_path):
    # sshfs refuses renameat2's flags (EINVAL): no exchange there, for real.
    mnt = sshfs_export.mount(tmp_path / "mnt").path
    root = mnt / "r"
    assert_done(run_child(root, [(5, 0, False)]))
    assert_killed(run_child(root, [(5, 1, True)], opts="kill-between-renames"))
    in_the_window(root)
    mgr = CheckpointManager(root)  # resume="auto": must not start from scratch
    assert mgr.latest() is not None and mgr.latest().step == 5
    assert same(mgr.restore(), np_state(5, 1))
    mgr.close()


def test_clean_restores_an_overwrite_killed_between_its_renames(tmp_path):
    root = tmp_path / "r"
    assert_done(run_child(root, [(4, 0, False), (5, 0, False)], opts="no-renameat2"))
    proc = run_child(root, [(5, 1, True)], opts="no-renameat2,kill-between-renames")
    assert_killed(proc)
    in_the_window(root)
    dry = json.loads(run_cli("clean", root, "--json", "--dry-run").stdout)
    assert [(r["name"], r["copy"]) for r in dry["restored"]] == [("checkpoint-5", "new")]
    assert [i["name"].split("/")[0] for i in dry["removed"]] == [TRASH_DIR]  # the old copy
    in_the_window(root)  # a dry run changes nothing
    out = run_cli("clean", root, "--json")
    doc = json.loads(out.stdout)
    assert [(r["name"], r["copy"]) for r in doc["restored"]] == [("checkpoint-5", "new")]
    assert checkpoint_dirs(root) == ["checkpoint-4", "checkpoint-5"]
    assert leftovers(root) == []
    mgr = CheckpointManager(root, read_only=True)
    assert same(mgr.restore(5), np_state(5, 1)) and same(mgr.restore(4), np_state(4, 0))


def test_incomplete_new_copy_restores_the_old_one(tmp_path):
    # The new copy lost a file (damaged after the crash): the old copy comes back.
    root = tmp_path / "r"
    assert_done(run_child(root, [(5, 0, False)], opts="no-renameat2"))
    assert_killed(run_child(root, [(5, 1, True)], opts="no-renameat2,kill-between-renames"))
    (pending,) = (root / PENDING_DIR).iterdir()
    next(p for p in pending.iterdir() if p.suffix == ".safetensors").unlink()
    mgr = CheckpointManager(root, resume="must")
    assert same(mgr.restore(), np_state(5, 0))
    assert leftovers(root) == []
    mgr.close()


@pytest.mark.parametrize(
    ("exchange", "fault"),
    [(True, "after_rename"), (False, "after_rename"), (False, "mid_replace")],
    ids=["exchange", "no-renameat2", "no-renameat2-between-renames"],
)
def test_an_overwrite_that_fails_before_it_is_durable_keeps_the_old_copy(
    tmp_path, monkeypatch, exchange, fault
):
    # An I/O error after the swap, before ROOT is fsync'd (an injected EIO): the save is
    # reported failed, so the old copy must be the committed one, and no copy is lost.
    if not exchange:
        monkeypatch.setattr(local_storage, "_renameat2", None)
    root = tmp_path / "r"
    mgr = CheckpointManager(root)
    mgr.save(5, np_state(5, 0))
    monkeypatch.setenv("ATOMIC_CHECKPOINT_FAULTS", f"{fault}@0=raise:5")
    with pytest.raises(OSError, match="injected fault"):
        mgr.save(5, np_state(5, 1), overwrite=True)
    monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
    assert same(mgr.restore(5), np_state(5, 0)) and leftovers(root) == []
    mgr.save(5, np_state(5, 2), overwrite=True)  # and the same manager saves it again
    assert same(mgr.restore(5), np_state(5, 2)) and leftovers(root) == []
    mgr.close()


# -------------------------------------------------- 7: clean-up after a durable overwrite
def _immutable(path: Path, on: bool) -> None:
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-renameat2"])
def test_overwrite_succeeds_when_the_replaced_copy_cannot_be_removed(
    small_disk, monkeypatch, caplog, exchange
):
    # An immutable file (ext4 refuses to unlink it, even for root; on NFS a file still
    # open elsewhere does the same as .nfsXXXX) keeps the replaced copy from going.
    if not exchange:
        monkeypatch.setattr(local_storage, "_renameat2", None)
    root = small_disk(64, "ext4").path / "r"
    committed: list[int] = []
    mgr = CheckpointManager(root, on_commit=lambda info: committed.append(info.step))
    mgr.save(5, np_state(5, 0))
    stuck = root / "checkpoint-5" / "rank-00000.safetensors"
    _immutable(stuck, True)
    try:
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            info = mgr.save(5, np_state(5, 1), overwrite=True)
        assert info.step == 5 and committed == [5, 5]
        assert same(mgr.restore(5), np_state(5, 1))
        assert "could not be removed" in caplog.text
        assert len(leftovers(root)) == 1  # the old copy, for the next sweep or `clean`
        mgr.close()
    finally:
        for p in root.rglob("rank-00000.safetensors"):
            _immutable(p, False)
    mgr = CheckpointManager(root, resume="must")
    assert leftovers(root) == [] and same(mgr.restore(), np_state(5, 1))
    mgr.close()


def test_a_retention_uncommit_never_comes_back(small_disk, monkeypatch):
    # A replaced copy left behind (its overwrite finished) and a retention un-commit of
    # the same step, both in .trash/ when the job dies: the step stays deleted.
    monkeypatch.setattr(local_storage, "_renameat2", None)
    root = small_disk(64, "ext4").path / "r"
    mgr = CheckpointManager(root, retention=KeepLast(1))
    mgr.save(5, np_state(5, 0))
    stuck = root / "checkpoint-5" / "rank-00000.safetensors"
    _immutable(stuck, True)
    mgr.save(5, np_state(5, 1), overwrite=True)
    (replaced,) = leftovers(root)
    assert replaced.startswith(f"{TRASH_DIR}/") and replaced.endswith(".replaced")
    _immutable(root / replaced / "rank-00000.safetensors", False)
    monkeypatch.setenv("ATOMIC_CHECKPOINT_FAULTS", "after_uncommit@0=raise:5")
    mgr.save(6, np_state(6, 0))
    mgr.wait()
    mgr.close()
    monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
    assert "checkpoint-5" not in checkpoint_dirs(root) and len(leftovers(root)) == 2
    mgr = CheckpointManager(root, retention=KeepLast(1))
    assert [c.step for c in mgr.checkpoints()] == [6] and leftovers(root) == []
    mgr.close()


# ------------------------------------------------------------ 6: a copied checkpoint
def test_a_checkpoint_copied_into_a_new_root_is_adopted(tmp_path, caplog):
    src = tmp_path / "src"
    mgr = CheckpointManager(src)
    mgr.save(7, np_state(7))
    run_id = mgr.run_id
    mgr.close()
    dst = tmp_path / "dst"
    dst.mkdir()
    shutil.copytree(src / "checkpoint-7", dst / "checkpoint-7")  # rsync of one checkpoint
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = CheckpointManager(dst)
    assert mgr.run_id == run_id and "adopting" in caplog.text
    assert mgr.latest().step == 7 and same(mgr.restore(), np_state(7))
    mgr.save(8, np_state(8))
    mgr.close()
    mgr = CheckpointManager(dst, resume="must")  # the run file now records the run
    assert mgr.run_id == run_id and [c.step for c in mgr.checkpoints()] == [7, 8]
    mgr.close()


def test_checkpoints_of_several_runs_without_a_run_file_need_run_id(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    runs = []
    for step in (3, 4):
        src = tmp_path / f"src{step}"
        mgr = CheckpointManager(src)
        mgr.save(step, np_state(step))
        runs.append(mgr.run_id)
        mgr.close()
        shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")
    with pytest.raises(ResumeError) as err:
        CheckpointManager(dst)
    assert all(r in str(err.value) for r in runs) and "run_id=" in str(err.value)
    mgr = CheckpointManager(dst, run_id=runs[1], resume="must")
    assert [c.step for c in mgr.checkpoints()] == [4]
    mgr.close()


@pytest.mark.parametrize("run_file", ["absent", "empty"])
def test_a_root_without_a_usable_run_file_whose_only_checkpoint_is_torn_is_refused(
    tmp_path, run_file
):
    # A copy cut short (a rank file of another size) of a root whose run file is gone
    # or empty: the start took the torn checkpoint for another run's and began a new
    # run from scratch beside it, where an intact run file gave ResumeError.
    root = tmp_path / "r"
    mgr = CheckpointManager(root)
    mgr.save(7, np_state(7))
    run_id = mgr.run_id
    mgr.close()
    with open(root / "checkpoint-7" / "rank-00000.safetensors", "ab") as f:
        f.write(b"x")
    if run_file == "absent":
        (root / RUN_FILE).unlink()
    else:
        (root / RUN_FILE).write_bytes(b"")
    with pytest.raises(ResumeError) as err:
        CheckpointManager(root)
    assert run_id in str(err.value) and "none is valid" in str(err.value)


# --------------------------------------------------------------- 8: the run file
@pytest.mark.parametrize(
    "content", [b"", b'{"run_id": "run-2', b"{}"], ids=["empty", "torn", "no-run-id"]
)
def test_a_damaged_run_file_is_recovered_at_start(tmp_path, caplog, content):
    root = tmp_path / "r"
    mgr = CheckpointManager(root)
    mgr.save(3, np_state(3))
    run_id = mgr.run_id
    mgr.close()
    (root / RUN_FILE).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = CheckpointManager(root, resume="must")
    assert mgr.run_id == run_id and same(mgr.restore(), np_state(3))
    assert "run.json" in caplog.text
    mgr.close()
    assert json.loads((root / RUN_FILE).read_bytes())["run_id"] == run_id


def test_an_empty_run_file_in_an_empty_root_starts_a_run(tmp_path):
    root = tmp_path / "r"
    (root / META_DIR).mkdir(parents=True)
    (root / RUN_FILE).write_bytes(b"")
    mgr = CheckpointManager(root)
    mgr.save(1, np_state(1))
    run_id = mgr.run_id
    mgr.close()
    assert json.loads((root / RUN_FILE).read_bytes())["run_id"] == run_id
    assert CheckpointManager(root, resume="must", read_only=True).run_id == run_id


@pytest.mark.parametrize(
    "how",
    [{"fault": "mid_create@*=kill"}, {"opts": "kill-writing-run-file"}],
    ids=["fault-point", "at-write"],
)
def test_killed_inside_the_run_file_create_leaves_no_torn_file(tmp_path, how):
    root = tmp_path / "r"
    assert_killed(run_child(root, [(1, 0, False)], **how))
    meta = sorted(os.listdir(root / META_DIR))
    assert "run.json" not in meta  # absent, never empty: the temporary file was not linked
    assert_done(run_child(root, [(1, 0, False)]))
    mgr = CheckpointManager(root, resume="must")
    assert json.loads((root / RUN_FILE).read_bytes())["run_id"] == mgr.run_id
    assert same(mgr.restore(), np_state(1))
    mgr.close()


# ------------------------------------------------------- 11: saving()'s directory fsyncs
_FSYNC_WATCH = """
import json, os, stat, sys
sys.path.insert(0, {repo!r})
from atomic_checkpoint import CheckpointManager

# Every directory fsync'd, by path, in order (the real fsync still runs).
dirs = []
real_fsync = os.fsync
def fsync(fd):
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        dirs.append(os.readlink(f"/proc/self/fd/{{fd}}"))
    return real_fsync(fd)
os.fsync = fsync

mgr = CheckpointManager(sys.argv[1])
with mgr.saving(2) as d:
    pending = str(d)
    (d / "a" / "b" / "c").mkdir(parents=True)     # a and a/b hold only a directory
    (d / "a" / "b" / "c" / "w.bin").write_bytes(b"x" * 100)
    (d / "x" / "y").mkdir(parents=True)
    (d / "x" / "y" / "z.bin").write_bytes(b"y" * 100)
    (d / "config.json").write_text("{{}}")
mgr.close()
print(json.dumps({{"pending": pending, "dirs": dirs}}))
"""


def test_saving_fsyncs_every_directory_bottom_up(tmp_path):
    proc = run_python(_FSYNC_WATCH.format(repo=REPO), tmp_path / "r")
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = last_json(proc)
    pending, dirs = out["pending"], out["dirs"]
    order = {}
    for i, d in enumerate(dirs):
        if d == pending or d.startswith(pending + "/"):
            order.setdefault(os.path.relpath(d, pending), i)
    want = ["a/b/c", "a/b", "a", "x/y", "x", "."]
    assert [w for w in want if w not in order] == [], f"never fsync'd: {dirs}"
    # Bottom-up: a directory only after everything below it.
    assert order["a/b/c"] < order["a/b"] < order["a"] < order["."]
    assert order["x/y"] < order["x"] < order["."]
