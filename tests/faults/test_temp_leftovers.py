"""Temporary files of atomic writes killed half way are removed once their writer is gone.

Every small document (marker, manifest, run record, lock, claim) is written to a
temporary file beside its name, fsync'd, then renamed or linked into place. A SIGKILL
between the two leaves the temporary file; the start-up sweep and ``clean`` must remove
it (and only it), or it stays in ROOT for ever: found by the kill campaign on s3fs-fuse,
where a kill inside retention's marker write left
``checkpoint-9/checkpoint.pending-<attempt>.json.tmp-<pid>-<ns>`` beside a manifest.

The child process is killed at the n-th rename or link of one of our temporary files,
for every n its lifecycle reaches (the first start's run record and lock, a save, two
saves with retention), on both commit strategies. Then one copy of the root recovers
through a new manager, the other through ``atomic-checkpoint clean``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.layout import META_DIR
from atomic_checkpoint.storage.temps import parse_temp_name
from tests.cli.helpers import run_cli
from tests.faults.test_failure_modes import REPO, assert_killed, np_state
from tests.helpers import run_python, same

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]

_CHILD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from atomic_checkpoint import CheckpointManager, KeepLast
from tests.faults.test_failure_modes import np_state

root, strategy, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = 0


def patched(real):
    def call(src, dst, *args, **kwargs):
        global seen
        if ".tmp-" in os.path.basename(os.fsdecode(src)):
            seen += 1
            if seen == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *args, **kwargs)

    return call


os.replace = patched(os.replace)
os.link = patched(os.link)
mgr = CheckpointManager(root, retention=KeepLast(1), strategy=strategy)
mgr.save(1, np_state(1))
mgr.save(2, np_state(2))
mgr.save(3, np_state(3))
mgr.close()
print("done", seen)
"""


def temps(root: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root)
        for d, _, names in os.walk(root)
        for n in names
        if parse_temp_name(n) is not None
    )


def run_child(root: Path, strategy: str, kill_at: int) -> subprocess.CompletedProcess[str]:
    return run_python(_CHILD.format(repo=REPO), root, strategy, kill_at)


@pytest.mark.parametrize("strategy", ["marker", "rename"])
def test_a_kill_inside_any_atomic_write_leaves_no_temporary_file_after_recovery(tmp_path, strategy):
    killed_with_temp = 0
    kinds: set[str] = set()
    for kill_at in range(1, 40):
        root = tmp_path / f"r{kill_at}"
        proc = run_child(root, strategy, kill_at)
        if proc.returncode == 0 and proc.stdout.startswith("done"):
            break  # past the last atomic write of the lifecycle
        assert_killed(proc)
        left = temps(root)
        assert left, f"killed at rename/link {kill_at}: no temporary file was left"
        killed_with_temp += 1
        copy = tmp_path / f"c{kill_at}"
        shutil.copytree(root, copy, symlinks=True)

        # 1. The next start sweeps them, and the job goes on.
        mgr = CheckpointManager(root, strategy=strategy)
        assert temps(root) == [], f"killed at {kill_at}: left {left}; after a start {temps(root)}"
        newest = mgr.latest()
        if newest is not None:
            assert same(mgr.restore(), np_state(newest.step))
        mgr.save(4, np_state(4))
        mgr.close()
        assert temps(root) == []

        # 2. `clean`, without any job, removes them too, and says so.
        proc = run_cli("clean", copy)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert temps(copy) == [], f"killed at {kill_at}: left {left}; after clean {temps(copy)}"
        assert "temporary" in proc.stdout or "stale" in proc.stdout or "pending" in proc.stdout
        kinds.update(k for k in ("temporary", "stale", "pending") if k in proc.stdout)
    else:
        pytest.fail("the child never finished: more atomic writes than the bound")
    assert killed_with_temp >= 3, f"only {killed_with_temp} kills landed inside an atomic write"
    assert "temporary" in kinds  # `clean` names what it removed


def test_a_live_writers_temporary_file_is_never_removed(tmp_path):
    # Our own pid is alive: its temporary file (an atomic write in progress on this host)
    # must survive a start and `clean`. One from a process that is gone must not.
    root = tmp_path / "r"
    CheckpointManager(root).close()
    from atomic_checkpoint.storage.temps import temp_name

    live = root / META_DIR / os.path.basename(temp_name("claim.json"))
    live.write_bytes(b"{}")
    dead_proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]);"
            "from atomic_checkpoint.storage.temps import temp_name; print(temp_name('x'))",
            str(Path(REPO) / "src"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = root / META_DIR / ("run.json" + dead_proc.stdout.strip()[1:])
    dead.write_bytes(b"{}")
    assert parse_temp_name(dead.name) is not None and parse_temp_name(live.name) is not None
    proc = run_cli("clean", root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert live.exists() and not dead.exists()
    dead.write_bytes(b"{}")
    CheckpointManager(root).close()
    assert live.exists() and not dead.exists()


def test_a_checkpoint_directory_holding_only_a_killed_writes_temporary_file_is_ours(tmp_path):
    # A delete killed inside its un-commit marker's write, once the rest of the step was
    # gone, leaves checkpoint-<step>/ holding only that temporary file (seen in the kill
    # campaign on s3fs-fuse). Readers must call it what it is (our pending remains, which
    # `clean` and the next start remove), not a foreign directory "never committed by
    # this library"; the next start removes it.
    from atomic_checkpoint import catalog, layout
    from atomic_checkpoint.storage.local import LocalStorage

    root = tmp_path / "r"
    with CheckpointManager(root, strategy="marker") as mgr:
        mgr.save(1, np_state(1))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    from atomic_checkpoint._process import writer_tag

    marker = layout.marker_name("0123456789abcdef")
    left = root / "checkpoint-7" / f"{marker}.tmp-{writer_tag()}-{gone.stdout.strip()}-1-2"
    left.parent.mkdir()
    left.write_bytes(b"{}")
    assert parse_temp_name(left.name) is not None

    entries = {e.name: e for e in catalog.scan(LocalStorage(str(root)))}
    assert entries["checkpoint-7"].status == "pending", entries["checkpoint-7"]
    proc = run_cli("verify", root)
    out = proc.stdout + proc.stderr
    assert "never committed by this library" not in out, out
    assert "interrupted write" in out and "clean" in out, out

    with CheckpointManager(root, strategy="marker") as mgr:
        assert not (root / "checkpoint-7").exists()
        assert [c.step for c in mgr.checkpoints()] == [1]


_KILLED_BEFORE_RMDIR = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from atomic_checkpoint import CheckpointManager, KeepLast, strategies
from tests.faults.test_failure_modes import np_state

def killed(storage, rel):
    os.kill(os.getpid(), signal.SIGKILL)  # the delete's last marker is gone, rmdir not yet

strategies._drop_if_empty = killed
mgr = CheckpointManager(sys.argv[1], strategy="marker", retention=KeepLast(1))
mgr.save(1, np_state(1))
mgr.save(2, np_state(2))
mgr.checkpoints()  # waits for the rotation that deletes step 1
print("the rotation was not killed")
"""


def test_an_empty_directory_left_by_a_delete_killed_before_its_rmdir_goes_at_the_next_start(
    tmp_path,
):
    # The marker strategy's delete removes a step's data, then its markers, then the
    # directory: a kill between the last two leaves checkpoint-<step>/ empty (found by
    # the kill campaign on s3fs-fuse, in CI). The campaigns count it as what a killed
    # delete leaves, not as a foreign directory; the next start's sweep removes it.
    from reliability.checks import inspect_root

    root = tmp_path / "r"
    assert_killed(run_python(_KILLED_BEFORE_RMDIR.format(repo=str(REPO)), root))
    assert sorted(os.listdir(root / "checkpoint-1")) == []
    view = inspect_root(str(root), world=1, size=1)
    assert view.killed_deletes == ["checkpoint-1"] and view.orphans == [], view

    with CheckpointManager(root, strategy="marker") as mgr:
        assert not (root / "checkpoint-1").exists()
        assert [c.step for c in mgr.checkpoints()] == [2]
        assert same(mgr.restore(), np_state(2))
    assert inspect_root(str(root), world=1, size=1).killed_deletes == []
