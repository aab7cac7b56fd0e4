"""Power cuts on a real filesystem: what the disk holds when a job dies, not what its
page cache holds.

A SIGKILL keeps every page the job wrote, so a kill campaign cannot see a missing
fsync: the files are complete in the cache, and a reader finds them. Here the job writes
to a real ext4 or XFS filesystem on a loop device and is killed at a named fault point
(``ATOMIC_CHECKPOINT_FAULTS``); then the loop device's image is copied, which holds only
the blocks the filesystem wrote out (its fsyncs and journal commits), and the copy is
mounted as a reboot would find it (``tests.testbed.PowerCutImage``). On that copy:

- every step whose save returned is listed and restores exactly (durable on return);
- every listed checkpoint restores exactly (a torn one is never listed);
- a new job resumes from at least the newest returned step and saves again.

ext4 is mounted with ``commit=600``, so that nothing reaches the disk by the journal's
timer during a test: only what an fsync forced. The control tests run the same job with
the fsyncs of its files, or of its directories, made no-ops, and must see the loss: the
harness is seen to catch a missing fsync of either kind (without directory fsyncs, 5 of
the 8 cuts below lose a returned save; without file fsyncs, all 8). The crash
state enumerator (``test_crash_states.py``) covers every prefix of the operations under
the weak model; this is the same promise on the kernel's real filesystems.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, KeepLast
from tests.faults.test_failure_modes import REPO, np_state
from tests.helpers import run_python, same
from tests.testbed import PowerCutImage, SmallDisk
from tests.testbed.pytest_fixtures import require_facility

pytestmark = pytest.mark.timeout(240)

# The job: saves steps 1-4 with KeepLast(2) (a sync save, the same under the marker
# strategy, an async save waited for, or files written in a saving() block) and prints
# "returned N" once save N has returned.
# Its third argument makes some fsyncs no-ops, as a library that forgot them would behave:
# "files" (of regular files), "dirs" (of directories), or "" (none skipped).
_JOB = """
import os, stat, sys
if sys.argv[3]:
    real_fsync, skip = os.fsync, sys.argv[3]
    def fsync(fd):
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        if (skip == "dirs") != is_dir:
            real_fsync(fd)
    os.fsync = os.fdatasync = fsync
sys.path.insert(0, {repo!r})
from atomic_checkpoint import CheckpointManager, KeepLast
from tests.faults.test_failure_modes import np_state
from tests.crash.test_power_cut import file_bytes
root, mode = sys.argv[1], sys.argv[2]
strategy = "marker" if mode == "marker" else None
mgr = CheckpointManager(root, retention=KeepLast(2), strategy=strategy)
for step in range(1, 5):
    if mode in ("save", "marker"):
        mgr.save(step, np_state(step))
    elif mode == "async":
        mgr.save_async(step, np_state(step)).result(timeout=60)
    else:
        with mgr.saving(step) as d:
            (d / "weights.bin").write_bytes(file_bytes(step))
            (d / "sub").mkdir()
            (d / "sub" / "config.txt").write_text(f"step {{step}}")
    sys.stdout.write(f"returned {{step}}\\n")
    sys.stdout.flush()
mgr.close()
"""

STEPS = 4
KEEP = 2

# Where the job dies: each phase of save 3 (retention deletes step 1 behind it), each
# phase of that deletion, and just after save 3 returned (at the start of save 4).
CUTS = [
    "before_write@0=kill:3",
    "after_write@0=kill:3",
    "after_manifest@0=kill:3",
    "after_rename@0=kill:3",
    "before_uncommit@0=kill:1",
    "after_uncommit@0=kill:1",
    "mid_delete@0=kill:1",
    "before_write@0=kill:4",
]


def file_bytes(step: int) -> bytes:
    """The weights file of step ``step`` in ``saving()`` mode: 3 MiB, unique per step."""
    return bytes([step]) * (3 << 20) + step.to_bytes(8, "little")


@pytest.fixture
def power_cut_disks(tmp_path: Path):
    """Factory ``make(kind)`` of 64 MiB loop-mounted disks, unmounted at teardown."""
    counter = itertools.count()
    with contextlib.ExitStack() as stack:

        def make(kind: str) -> SmallDisk:
            require_facility(kind)
            options = "commit=600" if kind == "ext4" else ""
            disk = SmallDisk(tmp_path / f"disk-{next(counter)}", 64, kind, options=options)
            return stack.enter_context(disk)

        yield make


def _run_job(root: Path, mode: str, fault: str, *, skip_fsync: str = "") -> list[int]:
    """Runs the job until the fault kills it; the steps whose save returned."""
    proc = run_python(_JOB.format(repo=REPO), root, mode, skip_fsync, faults=fault, timeout_s=120)
    assert proc.returncode == -9, (fault, proc.returncode, proc.stdout, proc.stderr)
    # A line the kill cut short (the retention thread died mid-print) is not counted.
    return [int(m[1]) for m in re.finditer(r"^returned (\d+)$", proc.stdout, re.MULTILINE)]


def _content(mgr: CheckpointManager, step: int, mode: str) -> Any:
    if mode != "files":
        return mgr.restore(step)
    info = mgr.verify(step)  # every file's size and checksum, against the manifest
    files = Path(info.files_path)
    return {
        "weights.bin": (files / "weights.bin").read_bytes(),
        "sub/config.txt": (files / "sub" / "config.txt").read_text(),
    }


def _expected(step: int, mode: str) -> Any:
    if mode != "files":
        return np_state(step)
    return {"weights.bin": file_bytes(step), "sub/config.txt": f"step {step}"}


def _problems_after_the_cut(root: Path, mode: str, returned: list[int]) -> list[str]:
    """What the disk after the cut breaks of the promises; empty when it keeps them all."""
    problems: list[str] = []
    reader = CheckpointManager(root, read_only=True)
    listed = [info.step for info in reader.checkpoints()]
    for step in returned:
        # Retention may remove a step once KEEP newer ones are committed, not before.
        if step not in listed and sum(other > step for other in listed) < KEEP:
            problems.append(f"save {step} returned, but it is not listed after the cut: {listed}")
    for step in listed:
        try:
            if not same(_content(reader, step, mode), _expected(step, mode)):
                problems.append(f"checkpoint {step} is listed but restores other values")
        except Exception as exc:
            problems.append(f"checkpoint {step} is listed but cannot be read: {exc!r}")
    reader.close()
    if problems:
        return problems
    strategy = "marker" if mode == "marker" else None
    job = CheckpointManager(root, retention=KeepLast(KEEP), strategy=strategy)
    try:
        latest = job.latest()
        newest = max(returned, default=0)
        if newest and (latest is None or latest.step < newest):
            problems.append(f"the restart resumes from {latest} below step {newest}")
        elif latest is not None and not same(
            _content(job, latest.step, mode), _expected(latest.step, mode)
        ):
            problems.append(f"the restart's latest() ({latest.step}) restores other values")
        job.save(STEPS + 10, np_state(STEPS + 10))
        assert same(job.restore(STEPS + 10), np_state(STEPS + 10))
    finally:
        job.close()
    return problems


@pytest.mark.parametrize("kind", ["ext4", "xfs"])
@pytest.mark.parametrize("mode", ["save", "marker", "async", "files"])
def test_a_power_cut_at_every_phase_keeps_every_returned_save_and_lists_nothing_torn(
    power_cut_disks, tmp_path, kind, mode
):
    for i, cut in enumerate(CUTS):
        disk = power_cut_disks(kind)
        root = disk.path / "ckpts"
        returned = _run_job(root, mode, cut)
        assert returned[:2] == [1, 2], (cut, returned)  # the cuts are in save 3 or later
        with PowerCutImage(disk, tmp_path / f"cut-{i}") as after:
            problems = _problems_after_the_cut(after.path / "ckpts", mode, returned)
        assert problems == [], f"{kind}, {mode}, power cut at {cut}: {problems}"
        disk.close()


@pytest.mark.parametrize("skipped", ["files", "dirs"])
def test_the_harness_sees_a_returned_save_lost_when_some_fsyncs_do_nothing(
    power_cut_disks, tmp_path, skipped
):
    """The controls: the job above with the fsyncs of its files, or of its directories,
    made no-ops. Save 3 has returned and the disk after the cut does not hold it (without
    file fsyncs nothing at all; without directory fsyncs the names of the newest steps)."""
    disk = power_cut_disks("ext4")
    returned = _run_job(disk.path / "ckpts", "save", "before_write@0=kill:4", skip_fsync=skipped)
    assert returned == [1, 2, 3]
    with PowerCutImage(disk, tmp_path / "cut") as after:
        problems = _problems_after_the_cut(after.path / "ckpts", "save", returned)
    assert "save 3 returned, but it is not listed after the cut" in " ".join(problems), problems
