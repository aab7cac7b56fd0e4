"""Entries of FAILURE_MODES.md that no other test pins, one process at a time, on real
filesystems, with real kills (SIGKILL at a named fault point) and real signals.

Grouped by entry id; ``docs/failure-modes.md`` maps every entry to its tests.
"""

# pytest fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atomic_checkpoint import (
    CheckpointError,
    CheckpointManager,
    KeepBest,
    KeepLast,
    LocalStorage,
    catalog,
)
from atomic_checkpoint.layout import MANIFEST_NAME, PENDING_DIR, TRASH_DIR
from atomic_checkpoint.preemption import PreemptionGuard
from tests.helpers import last_json, run_python, same
from tests.testbed.pytest_fixtures import small_disk  # noqa: F401 - fixture used by name

pytestmark = pytest.mark.timeout(60)

REPO = str(Path(__file__).resolve().parents[2])


def np_state(step: int, variant: int = 0, elems: int = 1 << 14) -> dict[str, Any]:
    """A state unique per (step, variant), numpy only: child processes start fast."""
    rng = np.random.default_rng(step * 100 + variant)
    return {
        "w": rng.standard_normal(elems, dtype=np.float32),
        "b": np.arange(17, dtype=np.int64) * step,
        "step": step,
        "variant": variant,
    }


def checkpoint_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("checkpoint-"))


def leftovers(root: Path) -> list[str]:
    """Pending and trash entries (``.trash/`` exists only once something was deleted)."""
    return [
        f"{d}/{n}"
        for d in (PENDING_DIR, TRASH_DIR)
        if (root / d).is_dir()
        for n in os.listdir(root / d)
    ]


# A child that saves (step, variant) pairs; with ATOMIC_CHECKPOINT_FAULTS set it is
# SIGKILLed at the named point, like a job killed mid-save.
_SAVER = """
import json, sys
sys.path.insert(0, {repo!r})
from atomic_checkpoint import CheckpointManager, KeepLast
from tests.faults.test_failure_modes import np_state
root, plan, keep = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
mgr = CheckpointManager(root, retention=KeepLast(keep) if keep else None)
for step, variant, overwrite in plan:
    mgr.save(step, np_state(step, variant), overwrite=overwrite)
mgr.close()
print("done")
"""


def run_saver(
    root: Path, plan: list[tuple[int, int, bool]], *, keep: int = 0, fault: str = ""
) -> subprocess.CompletedProcess[str]:
    return run_python(_SAVER.format(repo=REPO), root, json.dumps(plan), keep, faults=fault)


def assert_killed(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)


# ----------------------------------------------------------------------------- A7
_DURABILITY_PROBE = """
import fcntl, json, os, stat, sys
sys.path.insert(0, {repo!r})
import numpy as np
from atomic_checkpoint import CheckpointManager, KeepLast, LocalStorage
from atomic_checkpoint.storage.base import StorageCapabilities

# Watch every fsync the library makes (the real fsync still runs): which kind of file
# descriptor it goes through.
seen = {{"dir": 0, "file_rw": 0, "file_ro": []}}
real_fsync = os.fsync
def fsync(fd):
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        seen["dir"] += 1
    elif fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
        seen["file_ro"].append(os.readlink(f"/proc/self/fd/{{fd}}"))
    else:
        seen["file_rw"] += 1
    return real_fsync(fd)
os.fsync = fsync

root, profile = sys.argv[1], sys.argv[2]
# "windows": what local_capabilities() reports on Windows, where a directory cannot be
# opened for fsync (transformers#28637).
caps = StorageCapabilities(name="local", dir_fsync=profile != "windows")
mgr = CheckpointManager(LocalStorage(root, capabilities=caps), retention=KeepLast(1))
mgr.save(1, {{"w": np.arange(1000.0)}})
with mgr.saving(2) as d:               # files written by arbitrary code (save_pretrained)
    (d / "config.json").write_text("{{}}")
    (d / "sub").mkdir()
    (d / "sub" / "weights.bin").write_bytes(b"x" * 5000)
mgr.save_async(3, {{"w": np.arange(2000.0)}}).result()
mgr.save(3, {{"w": np.arange(3000.0)}}, overwrite=True)
mgr.wait()
ok = float(mgr.restore(3)["w"].sum()) == float(np.arange(3000.0).sum())
steps = [c.step for c in mgr.checkpoints()]
mgr.close()
print(json.dumps({{"seen": seen, "ok": ok, "steps": steps}}))
"""


@pytest.mark.parametrize("profile", ["windows", "posix"])
def test_a7_fsync_goes_through_writable_handles_and_directory_fsync_is_optional(tmp_path, profile):
    proc = run_python(_DURABILITY_PROBE.format(repo=REPO), tmp_path / "r", profile)
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc)
    # Every save kind committed and the newest restores (the durability steps that the
    # platform cannot do did not break the save).
    assert out["ok"] and out["steps"] == [3]
    seen = out["seen"]
    # Windows: fsync needs a handle opened for writing (FlushFileBuffers needs
    # GENERIC_WRITE; a read-only fd gives EBADF: ScrollPrize/villa#1267).
    assert seen["file_ro"] == [], f"files fsync'd through read-only handles: {seen['file_ro']}"
    assert seen["file_rw"] >= 8
    if profile == "windows":
        assert seen["dir"] == 0  # no directory is ever opened for fsync there
    else:
        assert seen["dir"] >= 8  # POSIX: entries made durable by directory fsyncs


# ----------------------------------------------------------------------------- B1
def test_b1_retention_and_resume_ignore_mtime(tmp_path):
    # #26961: ordering by mtime deleted the checkpoint just saved. Here every older
    # checkpoint is made to look newer than the one just committed (and FUSE mounts
    # may fake mtimes this way): retention and resume must not care.
    root = tmp_path / "r"
    mgr = CheckpointManager(root, retention=KeepLast(3))
    future = time.time() + 10_000
    for step in (200, 400, 600, 800, 1000):
        mgr.save(step, np_state(step))
        mgr.wait()
        for name in checkpoint_dirs(root):
            fake = future - int(name.split("-")[1])  # the older, the "newer"
            for p in (root / name, *(root / name).iterdir()):
                os.utime(p, (fake, fake))
    assert checkpoint_dirs(root) == ["checkpoint-1000", "checkpoint-600", "checkpoint-800"]
    assert mgr.latest().step == 1000
    assert same(mgr.restore(), np_state(1000))
    mgr.close()


# ----------------------------------------------------------------------------- B2
def test_b2_checkpoint_10000_is_newer_than_9900(tmp_path):
    # #27138: KeepLast(10) kept 9000..9900 and deleted checkpoint-10000 (string order).
    root = tmp_path / "r"
    (root / "checkpoint-010000").mkdir(parents=True)  # not a strict step name: not ours
    mgr = CheckpointManager(root, retention=KeepLast(10))
    for step in range(9000, 10001, 100):
        mgr.save(step, {"step": step})
    mgr.wait()
    assert [c.step for c in mgr.checkpoints()] == list(range(9100, 10001, 100))
    assert mgr.latest().step == 10000 and mgr.restore()["step"] == 10000
    assert (root / "checkpoint-010000").is_dir()
    mgr.close()


# ----------------------------------------------------------------------------- B4
def test_b4_crash_during_a_save_with_keep_last_1_keeps_the_previous(tmp_path):
    # Lightning #1150 / Accelerate save_state: the old checkpoint was deleted before
    # the new one existed, and a crash left nothing. Killed after writing everything
    # of step 3 but before its commit, with KeepLast(1): step 2 must still be there.
    root = tmp_path / "r"
    assert run_saver(root, [(1, 0, False), (2, 0, False)], keep=1).returncode == 0
    assert_killed(run_saver(root, [(3, 0, False)], keep=1, fault="after_manifest@0=kill:3"))
    assert checkpoint_dirs(root) == ["checkpoint-2"]
    mgr = CheckpointManager(root, retention=KeepLast(1))
    assert mgr.latest().step == 2 and same(mgr.restore(), np_state(2))
    mgr.verify(2)
    # Once step 3 is committed, and only then, step 2 goes.
    mgr.save(3, np_state(3))
    mgr.wait()
    assert checkpoint_dirs(root) == ["checkpoint-3"]
    mgr.close()


# ----------------------------------------------------------------------------- B6
def test_b6_retention_after_a_restart_is_recomputed_from_disk(tmp_path):
    # Lightning #5173 (save_top_k stops deleting after a resume), NeMo #12804 and
    # transformers #48315 (a remembered checkpoint deleted by hand crashes the run).
    root = tmp_path / "r"
    policy = KeepLast(1) | KeepBest(1, metric="loss")
    first = CheckpointManager(root, retention=policy)
    for step, loss in ((1, 0.1), (2, 0.5), (3, 0.6)):
        first.save(step, {"step": step}, metrics={"loss": loss})
    first.close()
    assert checkpoint_dirs(root) == ["checkpoint-1", "checkpoint-3"]
    # A second job, no memory of the first: the best (step 1) is still protected.
    second = CheckpointManager(root, retention=policy)
    second.save(4, {"step": 4}, metrics={"loss": 0.7})
    second.close()
    assert checkpoint_dirs(root) == ["checkpoint-1", "checkpoint-4"]
    # The user deletes the best by hand between runs: no crash, nothing dangling.
    shutil.rmtree(root / "checkpoint-1")
    third = CheckpointManager(root, retention=policy)
    third.save(5, {"step": 5}, metrics={"loss": 0.8})
    third.save(6, {"step": 6}, metrics={"loss": 0.9})
    third.wait()
    # The best of what exists (step 4, loss 0.7) and the newest: exactly the limit.
    assert checkpoint_dirs(root) == ["checkpoint-4", "checkpoint-6"]
    third.close()


# ----------------------------------------------------------------------------- B7
def test_b7_rotation_ignores_and_keeps_entries_that_are_not_this_runs(tmp_path):
    # unsloth-zoo #782: an old run's checkpoint-1000 made a fresh run delete its own
    # newest; Accelerate counts every entry of the directory, stray files included.
    root = tmp_path / "r"
    other = CheckpointManager(root, run_id="old-run")
    other.save(1000, {"step": 1000})
    other.close()
    strays = {
        "notes.txt": b"mine",
        "checkpoint-7.tmp/weights.bin": b"partial",
        "checkpoint-007/model.bin": b"zero-padded",
        "checkpoint-3/model.bin": b"no manifest: not a checkpoint",
        "best_model.pth": b"someone else's",
    }
    for rel, data in strays.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    mgr = CheckpointManager(root, run_id="new-run", retention=KeepLast(1))
    assert mgr.latest() is None  # nothing here is ours to resume from
    for step in (10, 20, 30):
        mgr.save(step, {"step": step})
    mgr.wait()
    assert [c.step for c in mgr.checkpoints()] == [30]
    for rel, data in strays.items():
        assert (root / rel).read_bytes() == data, rel
    reader = CheckpointManager(root, run_id="old-run", read_only=True)
    assert reader.latest().step == 1000 and reader.restore()["step"] == 1000
    mgr.close()


# ----------------------------------------------------------------------------- C4
def test_c4_every_reader_agrees_on_the_latest_checkpoint_after_a_crash(tmp_path):
    # Megatron-Bridge #5070: config followed "the highest directory", weights followed
    # the tracker. Killed after the manifest of step 3 was written (in .pending/, not
    # renamed): the manager, a read-only reader, the catalog, the CLI and a plain
    # "highest checkpoint-N directory" lookup (what HF Trainer resume does) must agree.
    root = tmp_path / "r"
    assert run_saver(root, [(1, 0, False), (2, 0, False)]).returncode == 0
    assert_killed(run_saver(root, [(3, 0, False)], fault="after_manifest@0=kill:3"))
    pending = list((root / PENDING_DIR).iterdir())
    assert len(pending) == 1 and (pending[0] / MANIFEST_NAME).is_file()  # complete, uncommitted
    reader = CheckpointManager(root, read_only=True)
    highest_dir = max(int(n.split("-")[1]) for n in checkpoint_dirs(root))
    listed = subprocess.run(
        [sys.executable, "-m", "atomic_checkpoint", "list", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    cli_ok = [e["step"] for e in json.loads(listed.stdout)["entries"] if e["status"] == "ok"]
    views = {
        "reader": reader.latest().step,
        "catalog": catalog.committed(reader.storage, run_id=reader.run_id)[-1].step,
        "cli": max(cli_ok),
        "highest_dir": highest_dir,
    }
    writer = CheckpointManager(root)  # the restarted job (sweeps the pending save)
    views["writer"] = writer.latest().step
    assert set(views.values()) == {2}, views
    assert same(writer.restore(), np_state(2))
    assert os.listdir(root / PENDING_DIR) == []
    writer.close()


# ----------------------------------------------------------------------------- D3
def test_d3_a_copied_checkpoint_stays_committed_and_unmarked_data_is_never_swept(tmp_path):
    # Orbax #394: checkpoints copied to GCS had no success file there, were taken for
    # temporary directories and deleted. The commit record is inside the checkpoint,
    # so a copy to any backend is a checkpoint there too.
    from atomic_checkpoint.storage import FsspecStorage

    src = CheckpointManager(tmp_path / "src")  # rename commits
    src.save(1, np_state(1))
    run_id = src.run_id
    src.close()
    # (a) to a directory whose manager uses marker commits; next to it, a directory
    # under a checkpoint name with no manifest and no marker of ours.
    dst = tmp_path / "dst"
    shutil.copytree(tmp_path / "src" / "checkpoint-1", dst / "checkpoint-1")
    (dst / "checkpoint-7").mkdir()
    (dst / "checkpoint-7" / "model.bin").write_bytes(b"uploaded by hand")
    mgr = CheckpointManager(dst, run_id=run_id, strategy="marker", retention=KeepLast(2))
    assert mgr.latest().step == 1 and same(mgr.restore(), np_state(1))
    mgr.verify(1)
    mgr.save(2, np_state(2))
    mgr.save(3, np_state(3))
    mgr.close()
    assert [
        c.step for c in CheckpointManager(dst, run_id=run_id, read_only=True).checkpoints()
    ] == [
        2,
        3,
    ]
    assert (dst / "checkpoint-7" / "model.bin").read_bytes() == b"uploaded by hand"
    # (b) to an object store (fsspec memory://: marker semantics, no rename).
    store = FsspecStorage(f"memory://d3-{os.getpid()}-{time.monotonic_ns()}/root")
    for rel, _size in LocalStorage(tmp_path / "src").walk_files("checkpoint-1"):
        w = store.open_write(f"checkpoint-1/{rel}")
        w.write((tmp_path / "src" / "checkpoint-1" / rel).read_bytes())
        w.close()
    remote = CheckpointManager(store, run_id=run_id, read_only=True)
    assert remote.commit_strategy == "marker"
    assert remote.latest().step == 1 and same(remote.restore(), np_state(1))
    remote.verify(1)


# ----------------------------------------------------------------------------- D4
def test_d4_overwrite_while_readers_hold_the_old_files_open(tmp_path):
    # TF #19440 (SMB): a publish failed because the target was open. Replacing a
    # committed step must work while readers hold its files open, and they keep
    # reading the old version whole.
    root = tmp_path / "r"
    mgr = CheckpointManager(root)
    mgr.save(5, np_state(5, 0))
    old_state = (root / "checkpoint-5" / "rank-00000.safetensors").read_bytes()
    held = [
        open(root / "checkpoint-5" / "rank-00000.safetensors", "rb"),  # noqa: SIM115
        open(root / "checkpoint-5" / MANIFEST_NAME, "rb"),  # noqa: SIM115
    ]
    try:
        mgr.save(5, np_state(5, 1), overwrite=True)
        assert held[0].read() == old_state
        assert json.loads(held[1].read())["step"] == 5
    finally:
        for f in held:
            f.close()
    assert same(mgr.restore(5), np_state(5, 1))
    mgr.verify(5)
    assert leftovers(root) == []
    assert [n for n in os.listdir(root / "checkpoint-5") if ".tmp" in n] == []
    mgr.close()


# ----------------------------------------------------------------------------- D5
_TMPDIR_SAVER = """
import json, os, sys, tempfile
sys.path.insert(0, {repo!r})
from atomic_checkpoint import CheckpointManager
from tests.faults.test_failure_modes import np_state
root = sys.argv[1]
mgr = CheckpointManager(root)
info = mgr.save(1, np_state(1, elems=1 << 20))   # 4 MiB: more than $TMPDIR holds
with mgr.saving(2) as d:
    (d / "big.bin").write_bytes(os.urandom(3 << 20))
    where = {{"pending": str(d), "dev": os.stat(d).st_dev, "root_dev": os.stat(root).st_dev}}
mgr.close()
print(json.dumps({{"tmpdir": tempfile.gettempdir(), "size": info.size_bytes, **where}}))
"""


def test_d5_staging_is_a_sibling_of_the_checkpoints_never_in_tmpdir(tmp_path, small_disk):
    # Lightning #20270 (EXDEV from /tmp) and #21744 (a small $TMPDIR filled up).
    tmpdir = small_disk(1)  # a 1 MiB tmpfs as $TMPDIR
    root = tmp_path / "r"
    proc = run_python(_TMPDIR_SAVER.format(repo=REPO), root, env={"TMPDIR": str(tmpdir.path)})
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc)
    assert out["tmpdir"] == str(tmpdir.path)  # $TMPDIR was really in effect
    assert out["size"] > 4 << 20
    assert Path(out["pending"]).parent == root / PENDING_DIR  # a sibling of the checkpoints
    assert out["dev"] == out["root_dev"]  # same filesystem: the commit is a rename
    assert os.listdir(tmpdir.path) == []
    assert [c.step for c in CheckpointManager(root, read_only=True).checkpoints()] == [1, 2]


# ----------------------------------------------------------------------------- D7
def test_d7_published_files_and_directories_get_umask_modes(tmp_path):
    # MONAI #1863: a temp file's 0600 leaked onto the final checkpoint.
    old = os.umask(0o027)
    try:
        mgr = CheckpointManager(tmp_path / "r")
        mgr.save(1, np_state(1))
        mgr.save(1, np_state(1, 1), overwrite=True)
        with mgr.saving(2) as d:
            (d / "sub").mkdir()
            (d / "sub" / "w.bin").write_bytes(b"x")
        mgr.close()
    finally:
        os.umask(old)
    for step in (1, 2):
        top = tmp_path / "r" / f"checkpoint-{step}"
        assert stat.S_IMODE(top.stat().st_mode) == 0o750, top
        for p in top.rglob("*"):
            want = 0o750 if p.is_dir() else 0o640
            assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


# ----------------------------------------------------------------------------- D8
def test_d8_racing_directory_creation_tolerates_eexist(tmp_path):
    # Automodel #3686, mlcommons/storage #699: makedirs(exist_ok=True) raised
    # FileExistsError under a race. Eight threads create the same fresh tree at once.
    storage = LocalStorage(tmp_path / "r")
    errors: list[BaseException] = []
    for round_ in range(20):
        barrier = threading.Barrier(8)

        def create(path: str = f"run/round-{round_}/a/b/c", barrier=barrier) -> None:
            barrier.wait(timeout=10)
            try:
                storage.makedirs(path)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=create) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert (tmp_path / "r" / f"run/round-{round_}/a/b/c").is_dir()
    assert errors == []
    # EEXIST is tolerated only when the entry is a directory.
    (tmp_path / "r" / "run" / "file").write_text("x")
    with pytest.raises(CheckpointError, match="a file with that name exists"):
        storage.makedirs("run/file")


# ----------------------------------------------------------------------------- E1
@pytest.mark.parametrize("phase", ["mid_write", "after_manifest", "after_rename"])
def test_e1_kill_during_an_overwrite_leaves_one_complete_version(tmp_path, phase):
    # physicsnemo #1967: killed while replacing a checkpoint, "the previous good
    # checkpoint at that path is gone". Overwriting step 5 is killed at each phase.
    root = tmp_path / "r"
    assert run_saver(root, [(4, 0, False), (5, 0, False)]).returncode == 0
    assert_killed(run_saver(root, [(5, 1, True)], fault=f"{phase}@0=kill:5"))
    for e in catalog.scan(LocalStorage(root)):
        assert e.status in ("ok", "pending"), e
    mgr = CheckpointManager(root)
    replaced = phase == "after_rename"
    assert [c.step for c in mgr.checkpoints()] == [4, 5]
    assert same(mgr.restore(5), np_state(5, 1 if replaced else 0))
    mgr.verify(5)
    assert leftovers(root) == []
    mgr.save(5, np_state(5, 2), overwrite=True)
    assert same(mgr.restore(5), np_state(5, 2))
    mgr.close()


# ----------------------------------------------------------------------------- E4
def test_e4_the_handler_only_records_and_close_puts_the_old_handlers_back(tmp_path):
    seen: list[int] = []

    def theirs(signum: int, frame: object) -> None:
        seen.append(signum)

    previous_usr1 = signal.signal(signal.SIGUSR1, theirs)
    previous_term = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(tmp_path / "r")
    try:
        with PreemptionGuard(mgr) as guard:
            assert not guard.requested and guard.should_save(1) is False
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not guard.requested and time.monotonic() < deadline:
                time.sleep(0.001)  # the handler runs between two bytecodes
            assert guard.requested and guard.signum == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
            time.sleep(0.01)
            # The handler saved nothing and did not stop the process: the loop decides.
            assert mgr.checkpoints() == [] and seen == []
            assert guard.should_save(2) is True and guard.decided_step == 2
            assert guard.requested_by == (0,) and guard.signum == signal.SIGTERM
            assert guard.should_save(3) is True  # stays decided
            mgr.save(2, {"step": 2})
        # Preempted: the guard's handler stays after close (it only records), so the
        # launcher's SIGTERM to the remaining ranks cannot kill this one while it closes
        # its manager; the job exits with guard.exit() next.
        assert signal.getsignal(signal.SIGUSR1) is not theirs
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        with pytest.raises(CheckpointError, match="closed"):
            guard.should_save(4)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert seen == [] and mgr.latest().step == 2
        # Not preempted, a closed guard puts the old handlers back.
        signal.signal(signal.SIGUSR1, theirs)
        signal.signal(signal.SIGTERM, previous_term)
        with PreemptionGuard(mgr) as calm:
            assert calm.should_save(3) is False
        assert signal.getsignal(signal.SIGUSR1) is theirs
        assert signal.getsignal(signal.SIGTERM) == previous_term
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert seen == [signal.SIGUSR1]  # the old handler is in charge again
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        signal.signal(signal.SIGTERM, previous_term)
        mgr.close()


def test_e4_guard_needs_the_main_thread(tmp_path):
    mgr = CheckpointManager(tmp_path / "r")
    box: list[BaseException] = []

    def make() -> None:
        try:
            PreemptionGuard(mgr)
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=make)
    t.start()
    t.join(10)
    assert len(box) == 1 and isinstance(box[0], CheckpointError)
    assert "main thread" in str(box[0])
    with pytest.raises(ValueError, match="at least one signal"):
        PreemptionGuard(mgr, signals=())
    mgr.close()


_FORKED_WORKER = """
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.preemption import PreemptionGuard
mgr = CheckpointManager(sys.argv[1])
guard = PreemptionGuard(mgr)
r, w = os.pipe()
pid = os.fork()                     # like a DataLoader worker: inherits the handler
if pid == 0:
    os.close(r)
    os.write(w, b"x")
    time.sleep(30)
    os._exit(0)                     # reached only if SIGTERM was swallowed
os.close(w)
os.read(r, 1)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
out = {{
    "signaled": os.WIFSIGNALED(status),
    "sig": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    "parent_requested": guard.requested,
    "checkpoints": [c.step for c in mgr.checkpoints()],
}}
guard.close()
mgr.close()
print(json.dumps(out))
"""


def test_e4_a_forked_worker_never_saves_and_still_dies_of_sigterm(tmp_path):
    # EgoVerse #621: forked DataLoader workers inherit the handler and must not save;
    # swallowing their SIGTERM would also leave them running.
    proc = run_python(_FORKED_WORKER.format(repo=REPO), tmp_path / "r")
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc)
    assert out == {
        "signaled": True,
        "sig": signal.SIGTERM,
        "parent_requested": False,
        "checkpoints": [],
    }


_DATALOADER_JOB = """
import json, os, subprocess, sys, time
sys.path.insert(0, {repo!r})
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from atomic_checkpoint import CheckpointManager, preemption
from atomic_checkpoint.preemption import PreemptionGuard

class Batches(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        return torch.tensor([i])

preemption.arm()
init = preemption.dataloader_worker_init if sys.argv[2] == "protected" else None
loader = iter(DataLoader(Batches(), batch_size=4, num_workers=2, worker_init_fn=init,
                         persistent_workers=True))
mgr = CheckpointManager(sys.argv[1])
out = {{"saved": None, "error": None}}
with PreemptionGuard(mgr) as guard:
    next(loader), next(loader)  # a batch from each worker: both have run their init
    # The scheduler (another process) signals every process of the job step: the
    # trainer and its DataLoader workers.
    pids = [w.pid for w in loader._workers] + [os.getpid()]
    subprocess.run(["kill", "-TERM", *map(str, pids)], check=True)
    time.sleep(0.5)
    try:
        for step in range(1, 20):
            for _ in range(8):  # the step's batches (gradient accumulation)
                next(loader)
            if guard.should_save(step):
                out["saved"] = mgr.save(step, {{"w": np.full(4, step, np.float32)}}).step
                break
    except Exception as exc:
        out["error"] = type(exc).__name__ + ": " + str(exc)[:80]
out["checkpoints"] = [c.step for c in mgr.checkpoints()]
mgr.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("workers", ["protected", "stock"])
def test_e4_dataloader_workers_signalled_with_the_trainer_do_not_stop_the_save(tmp_path, workers):
    # SLURM signals every process of the job step, DataLoader workers included: torch's
    # own worker handler makes a worker exit, and the trainer's next batch raises before
    # its guard can save, unless the worker goes on (dataloader_worker_init); the
    # loader's own shutdown at exit (a signal from the trainer) still stops it.
    proc = run_python(_DATALOADER_JOB.format(repo=REPO), tmp_path / "r", workers)
    if workers == "protected":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert last_json(proc) == {"saved": 1, "error": None, "checkpoints": [1]}
    else:  # what the worker init prevents, as torch ships it: the trainer dies unsaved
        assert proc.returncode != 0
        assert "DataLoader worker" in proc.stderr and "killed by signal" in proc.stderr
        assert not list((tmp_path / "r").glob("checkpoint-*"))


_ARMED_SCRIPT = """
import json, multiprocessing as mp, sys, time
sys.path.insert(0, {repo!r})
from atomic_checkpoint import preemption
preemption.arm()  # the first lines of train.py, as the README shows

def work():
    time.sleep(60)

def trainer(q):
    preemption.arm()  # a target that arms itself (torch's mp.spawn trainers) is armed
    q.put(preemption.armed() is not None)
    time.sleep(60)

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    p = ctx.Process(target=work)
    p.start()
    time.sleep(2)  # the child has imported this module again
    t0 = time.monotonic()
    p.terminate()
    p.join(10)
    q = ctx.Queue()
    armed = ctx.Process(target=trainer, args=(q,))
    armed.start()
    out = {{"exitcode": p.exitcode, "seconds": round(time.monotonic() - t0, 1),
            "target_armed": q.get(timeout=30)}}
    armed.kill()
    armed.join(10)
    print(json.dumps(out))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_e4_arm_in_the_main_module_does_not_arm_spawned_children(tmp_path, method):
    # preemption.arm() at the top of train.py ran again in every spawn or forkserver
    # child as it imported the main module: the children ignored SIGTERM, and
    # Process.terminate() and Pool.terminate() hung.
    script = tmp_path / "train.py"
    script.write_text(_ARMED_SCRIPT.format(repo=REPO))
    proc = subprocess.run(
        [sys.executable, str(script), method], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json(proc)
    assert out["exitcode"] == -signal.SIGTERM and out["seconds"] < 5, out
    assert out["target_armed"] is True, out
