"""The Lightning CheckpointIO plugins with the real ``lightning`` package.

Multi-process runs are real ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``
jobs (Lightning re-executes the script for rank 1, as on a cluster), killed with
SIGKILL in the middle of a save; the stock plugins are run the same way, so the claims
about them stay true.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atomic_checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageFullError,
    UnsafeCheckpointError,
)
from atomic_checkpoint._faults import ENV as FAULTS_ENV
from atomic_checkpoint.integrations import lightning as al
from atomic_checkpoint.integrations.lightning import (
    MANIFEST_SUFFIX,
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    checkpoint_io_classes,
    latest_checkpoint,
    verify_checkpoint,
)
from tests.cli.helpers import run_cli, run_json
from tests.dist.launcher import run_ranks
from tests.dist.workers import states_equal
from tests.integrations.scripts.lightning_workers import (
    KILL_PHASES,
    w_overwrite_killed,
)
from tests.integrations.scripts.lightning_workers import checkpoint_dict as _state
from tests.testbed.disk import SmallDisk
from tests.testbed.pytest_fixtures import require_facility, strict_facilities

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "lightning_train.py"
RUN_TIMEOUT_S = 240


# ---------------------------------------------------------------------- helpers
def _strays(directory: Path) -> list[str]:
    """Pending files or manifest temporaries left in a checkpoint directory."""
    return [n for n in os.listdir(directory) if n.endswith(".pending") or ".tmp-" in n]


def _run_script(
    tmp: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def _run_until_killed(
    tmp: Path,
    argv: list[str],
    *,
    kill_when: Callable[[], bool] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int | None, str]:
    """Start ``argv`` in its own process group; SIGKILL the whole group once
    ``kill_when()`` holds (or once the first process ended: a fault point killed
    rank 0, and rank 1 must not linger). Returns (exit status of the first process,
    log)."""
    log_path = tmp / f"job-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            argv,
            cwd=tmp,
            env={**os.environ, **(env or {})},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if kill_when is not None and kill_when():
                    break
                time.sleep(0.02)
            else:
                pytest.fail(
                    f"job did not reach the kill point in {RUN_TIMEOUT_S} s: {log_path.read_text()}"
                )
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
    return proc.returncode, log_path.read_text(errors="replace")


def _assert_resumed_state_equals_saved(ref: Path, step: int, world: int) -> None:
    for r in range(world):
        saved = torch.load(ref / f"step-{step}-rank{r}.pt", weights_only=False)
        resumed = torch.load(ref / f"resumed-rank{r}.pt", weights_only=False)
        assert resumed["global_step"] == step
        for part in ("model", "optimizer", "scheduler", "rng", "python_rng"):
            assert states_equal(saved[part], resumed[part]), f"rank {r}: {part} differs"


def _report(ref: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((ref / f"report-rank{rank}.json").read_text())


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], SmallDisk]]:
    """``make(size_mb)``: a real tmpfs mounted under ``tmp_path``, unmounted after."""
    with contextlib.ExitStack() as stack:

        def make(size_mb: int) -> SmallDisk:
            require_facility("tmpfs")
            return stack.enter_context(SmallDisk(tmp_path / "disks", size_mb, "tmpfs"))

        yield make


def _require_strace() -> None:
    if shutil.which("strace"):
        return
    message = "strace is not installed (scripts/bootstrap.sh installs it)"
    if strict_facilities():
        pytest.fail(message + " (required under CI)")
    pytest.skip(message)


# ---------------------------------------------------------------------- multi-process
def _kill_stock_run_while_last_ckpt_is_truncated(
    tmp_path: Path, stage: SmallDisk, ckpt: Path, ref: Path
) -> str:
    """Run the stock plugin with $TMPDIR on another filesystem (``stage``) for 8 steps;
    SIGKILL it while its copy into ``last.ckpt`` at step 6 has truncated that file.

    strace delays the return of the third ``openat`` of ``CKPT/last.ckpt`` (``-P``
    counts only the calls on that path): each save opens it exactly once, for the
    copy's ``open(dst, "wb")``, so the third is step 6's copy, held after the truncate
    and before any byte is written. The kill waits for that state (step 6's own file,
    copied first, exists and last.ckpt is empty), which lasts as long as strace holds
    it; the saves of steps 2 to 6 take milliseconds, so no poll has to catch anything
    in between. Returns the job's log."""
    _require_strace()
    assert os.stat(stage.path).st_dev != os.stat(tmp_path).st_dev
    trace = tmp_path / "strace.log"
    argv = [
        "strace", "-qq", "-f", "-o", str(trace), "-P", str(ckpt / "last.ckpt"),
        "-e", "trace=openat", "-e", "inject=openat:delay_exit=120000000:when=3",
        sys.executable, str(SCRIPT), "--dir", str(ckpt), "--ref", str(ref),
        "--io", "stock", "--devices", "1", "--max-steps", "8",
    ]  # fmt: skip

    def held_at_step_6() -> bool:
        try:
            size = os.path.getsize(ckpt / "last.ckpt")
        except FileNotFoundError:
            return False
        return size == 0 and (ckpt / "epoch=0-step=6.ckpt").exists()

    _rc, log = _run_until_killed(
        tmp_path, argv, kill_when=held_at_step_6, env={"TMPDIR": str(stage.path)}
    )
    assert held_at_step_6(), log
    # Steps 2 and 4 had written last.ckpt whole; the third open, step 6's, truncated
    # it and was held there: the only "last" is gone.
    opens = [line for line in trace.read_text().splitlines() if "last.ckpt" in line]
    assert len(opens) == 3 and all("O_TRUNC" in line for line in opens), opens

    def returned(line: str) -> bool:
        return re.search(r"\) = \d+", line) is not None

    assert not any("(DELAYED)" in line for line in opens[:2]), opens
    # strace logs the held call's result with "(DELAYED)" once it has printed it; when
    # the kill (of strace too) comes first, the line ends at the call's arguments. A
    # third open that returned without a delay would fail both.
    assert "(DELAYED)" in opens[2] or not returned(opens[2]), opens
    assert (ckpt / "last.ckpt").stat().st_size == 0
    # Step 6's own file was copied before last.ckpt: complete, like step 4's.
    assert {"epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"} <= set(os.listdir(ckpt))
    return log


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stock_checkpoint_io_tears_last_ckpt_when_killed_and_resume_trips(tmp_path, tmpfs):
    """Stock TorchCheckpointIO stages in $TMPDIR. On another filesystem than the
    checkpoint directory (HPC: node-local /tmp, checkpoints on Lustre) its "rename"
    becomes an in-place copy that truncates the previous last.ckpt first: killed then,
    a stock resume from "last" trips. The same run continued with AtomicCheckpointIO
    and ``latest_checkpoint(dir, adopt=True)`` adopts the complete stock files (not the
    torn last.ckpt) and resumes from the newest complete one, step 6, with exactly the
    state saved there."""
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    _kill_stock_run_while_last_ckpt_is_truncated(tmp_path, tmpfs(64), ckpt, ref)
    # Stock resume from "last" loads the torn file and fails.
    stock = _run_script(
        tmp_path, "--dir", str(ckpt), "--ref", str(tmp_path / "ref2"), "--io", "stock",
        "--max-steps", "10", "--resume", "last",
    )  # fmt: skip
    assert stock.returncode != 0
    assert "EOFError" in stock.stderr or "zip archive" in stock.stderr, stock.stderr[-2000:]

    ours = _run_script(
        tmp_path, "--dir", str(ckpt), "--ref", str(ref), "--io", "atomic",
        "--max-steps", "10", "--resume", "latest", "--adopt", "1",
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "not adopting" not in ours.stderr  # last.ckpt names no step: not a candidate
    report = _report(ref)
    assert report["start_step"] == 6 and report["final_step"] == 10, report
    assert report["resumed_from"] == str(ckpt / "epoch=0-step=6.ckpt")
    _assert_resumed_state_equals_saved(ref, 6, world=1)
    # Adopted: checksum taken at adoption, marked so; the stock file itself untouched.
    info = verify_checkpoint(ckpt / "epoch=0-step=6.ckpt", require_manifest=True)
    assert (info.global_step, info.epoch, info.adopted) == (6, 0, True)
    # Training went on with ours: last.ckpt is now a complete, verified step 10.
    last = verify_checkpoint(ckpt / "last.ckpt", require_manifest=True)
    assert last.global_step == 10 and not last.adopted
    assert _strays(ckpt) == []


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_saves_rotates_and_resumes_from_newest_complete_after_kill(tmp_path):
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    common = ["--dir", str(ckpt), "--ref", str(ref), "--io", "atomic", "--devices", "2"]
    # SIGKILL rank 0 in the middle of writing step 6 (its top-k file, the first of
    # the two files of that save).
    rc, log = _run_until_killed(
        tmp_path,
        [sys.executable, str(SCRIPT), *common, "--max-steps", "8"],
        env={FAULTS_ENV: "mid_write@0=kill:6"},
    )
    assert rc == -signal.SIGKILL, log[-3000:]
    names = set(os.listdir(ckpt))
    # Steps 2 and 4 were committed (top-2 by step), 6 was being written: only its
    # pending file exists, under a name no reader looks at.
    assert {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"} <= names
    assert "epoch=0-step=6.ckpt" not in names
    assert any(n.startswith(".epoch=0-step=6.ckpt.") and n.endswith(".pending") for n in names)
    assert verify_checkpoint(ckpt / "last.ckpt").global_step == 4
    assert latest_checkpoint(ckpt, full=True) is not None
    assert verify_checkpoint(latest_checkpoint(ckpt, full=True)).global_step == 4

    # Resume with Lightning's own ckpt_path="last" on 2 ranks: the newest complete
    # checkpoint, identical model, optimizer, scheduler and RNG state on each rank.
    resumed = _run_script(tmp_path, *common, "--max-steps", "10", "--resume", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for r in (0, 1):
        report = _report(ref, r)
        assert report["start_step"] == 4 and report["final_step"] == 10, report
        assert report["world_size"] == 2
    _assert_resumed_state_equals_saved(ref, 4, world=2)

    # Training went on and rotated: top-2 by step plus last; the abandoned pending
    # file was swept; every file verifies and is a plain torch.save file.
    assert _report(ref)["best_k"] == ["epoch=0-step=10.ckpt", "epoch=0-step=8.ckpt"]
    assert sorted(n for n in os.listdir(ckpt) if n.endswith(".ckpt")) == [
        "epoch=0-step=10.ckpt",
        "epoch=0-step=8.ckpt",
        "last.ckpt",
    ]
    assert _strays(ckpt) == []
    assert not (ckpt / ("epoch=0-step=4.ckpt" + MANIFEST_SUFFIX)).exists()
    for name in ("epoch=0-step=8.ckpt", "epoch=0-step=10.ckpt", "last.ckpt"):
        assert (ckpt / (name + MANIFEST_SUFFIX)).exists()
        info = verify_checkpoint(ckpt / name, require_manifest=True)
        assert info.global_step == (8 if "step=8" in name else 10) and info.is_newest
        plain = torch.load(ckpt / name, weights_only=True)
        assert plain["global_step"] == info.global_step
    assert latest_checkpoint(ckpt).endswith(("last.ckpt", "epoch=0-step=10.ckpt"))


def _async_argv(io: str, ckpt: Path, ref: Path, save_last: str = "0") -> list[str]:
    # save_top_k=1 (without "last" by default): ModelCheckpoint removes the previous file
    # after it asked for the new one. The main thread holds after the save of step 4.
    return [
        sys.executable, str(SCRIPT), "--dir", str(ckpt), "--ref", str(ref), "--io", io,
        "--max-steps", "8", "--top-k", "1", "--save-last", save_last, "--hold-at", "4",
        "--settle", "1",
    ]  # fmt: skip


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stock_async_checkpoint_io_removes_previous_before_new_is_written(tmp_path):
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    argv = [*_async_argv("stock-async", ckpt, ref), "--slow-stock-at", "4"]
    # Killed while step 4 is still being written (the inner save takes long).
    _run_until_killed(tmp_path, argv, kill_when=lambda: (ref / "held").exists())
    # The previous checkpoint was already removed: nothing is left to resume from.
    assert [n for n in os.listdir(ckpt) if n.endswith(".ckpt")] == []
    resumed = _run_script(
        tmp_path, "--dir", str(ckpt), "--ref", str(tmp_path / "ref2"), "--io", "stock",
        "--max-steps", "3", "--top-k", "1", "--save-last", "0", "--resume", "last",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # Lightning's resume silently starts over from step 0.
    assert _report(tmp_path / "ref2")["start_step"] == 0


def _kill_while_step_4_is_written(tmp_path: Path, save_last: str) -> tuple[Path, Path, str]:
    """The async plugin's background write of step 4 hangs half way; the job is killed
    once the training thread has moved on past ModelCheckpoint's remove_checkpoint (and
    link) calls. Returns (checkpoint dir, reference dir, log)."""
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"

    def writing_and_moved_on() -> bool:
        return (ref / "held").exists() and any(n.endswith(".pending") for n in os.listdir(ckpt))

    _rc, log = _run_until_killed(
        tmp_path,
        _async_argv("atomic-async", ckpt, ref, save_last=save_last),
        kill_when=writing_and_moved_on,
        env={FAULTS_ENV: "mid_write@0=hang:4"},
    )
    return ckpt, ref, log


def _resume_from_step_2(tmp_path: Path, ckpt: Path, ref: Path, save_last: str, resume: str) -> None:
    """Resume the killed job with the async plugin to step 6: it starts from step 2 with
    exactly the state saved there."""
    resumed = _run_script(
        tmp_path, "--dir", str(ckpt), "--ref", str(ref), "--io", "atomic-async",
        "--max-steps", "6", "--top-k", "1", "--save-last", save_last, "--resume", resume,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _report(ref)["start_step"] == 2 and _report(ref)["final_step"] == 6
    _assert_resumed_state_equals_saved(ref, 2, world=1)


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_atomic_keeps_previous_until_new_is_committed(tmp_path):
    ckpt, ref, log = _kill_while_step_4_is_written(tmp_path, save_last="0")
    names = set(os.listdir(ckpt))
    assert "epoch=0-step=2.ckpt" in names, (names, log[-2000:])
    assert "epoch=0-step=4.ckpt" not in names
    assert any(n.endswith(".pending") for n in names)  # step 4, half written
    assert verify_checkpoint(ckpt / "epoch=0-step=2.ckpt").global_step == 2
    _resume_from_step_2(tmp_path, ckpt, ref, save_last="0", resume="latest")
    # Rotation after the resume: the async removals ran behind the commits.
    # (Lightning keeps the file it resumed from: ModelCheckpoint never removes it.)
    kept = sorted(n for n in os.listdir(ckpt) if n.endswith(".ckpt"))
    assert kept == ["epoch=0-step=2.ckpt", "epoch=0-step=6.ckpt"]
    assert _strays(ckpt) == []


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_atomic_links_last_ckpt_only_to_a_committed_file(tmp_path):
    # ModelCheckpoint(save_last="link") re-points last.ckpt right after it asks for the
    # save, before the background write commits.
    ckpt, ref, log = _kill_while_step_4_is_written(tmp_path, save_last="link")
    link = ckpt / "last.ckpt"
    # Still the link to the complete step-2 file (Lightning had re-pointed it at the
    # uncommitted step-4 file, leaving it dangling).
    assert link.is_symlink() and os.readlink(link) == "epoch=0-step=2.ckpt", log[-2000:]
    assert verify_checkpoint(link).global_step == 2
    _resume_from_step_2(tmp_path, ckpt, ref, save_last="link", resume="last")
    assert verify_checkpoint(latest_checkpoint(ckpt)).global_step == 6
    assert _strays(ckpt) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_lightning_checkpoint_io_runs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "lightning_checkpoint_io.py"),
            str(tmp_path / "ckpts"),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "resumed at step 6" in out, out
    assert "refused: CorruptCheckpointError" in out, out


# ---------------------------------------------------------------------- one process
@pytest.mark.timeout(60)
def test_save_writes_a_plain_torch_file_with_a_manifest_and_loads_it_verified(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "sub" / "dir" / "epoch=0-step=3.ckpt"
    io.save_checkpoint(_state(3), path)
    assert sorted(os.listdir(path.parent)) == [path.name, path.name + MANIFEST_SUFFIX]
    manifest = json.loads((tmp_path / "sub" / "dir" / (path.name + MANIFEST_SUFFIX)).read_text())
    (version,) = manifest["versions"]
    assert version["size"] == path.stat().st_size and version["global_step"] == 3
    # Anything that reads .ckpt files without the plugin still can.
    assert torch.equal(
        torch.load(path, weights_only=True)["state_dict"]["w"], _state(3)["state_dict"]["w"]
    )
    loaded = io.load_checkpoint(path)
    assert states_equal(loaded, _state(3))
    info = verify_checkpoint(path)
    assert (info.global_step, info.epoch, info.has_manifest, info.is_newest) == (3, 0, True, True)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_state(3), path, storage_options={"x": 1})
    with pytest.raises(CheckpointError, match="mounted filesystems"):
        io.save_checkpoint(_state(3), "s3://bucket/last.ckpt")
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError):  # what Lightning callers catch
        io.load_checkpoint(tmp_path / "missing.ckpt")
    # A directory in the way: refused before anything is written (the new manifest was
    # left beside it, and the directory then read as a torn checkpoint file).
    (tmp_path / "oops").mkdir()
    with pytest.raises(CheckpointError, match="it is a directory"):
        io.save_checkpoint(_state(3), tmp_path / "oops")
    assert not (tmp_path / ("oops" + MANIFEST_SUFFIX)).exists()


@pytest.mark.timeout(60)
def test_torn_and_corrupt_files_are_refused(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_state(5), path)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated, as by an in-place copy
    with pytest.raises(CorruptCheckpointError, match="torn or truncated"):
        io.load_checkpoint(path)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01  # same size: only the checksum sees it
    path.write_bytes(bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        io.load_checkpoint(path)
    assert latest_checkpoint(tmp_path, full=True) is None
    path.write_bytes(good)
    assert io.load_checkpoint(path)["global_step"] == 5


@pytest.mark.timeout(60)
def test_loading_is_weights_only_unless_asked(tmp_path, caplog):
    io = AtomicCheckpointIO()
    path = tmp_path / "obj.ckpt"
    state = _state(1)
    state["hparams"] = logging.LogRecord("x", 1, "p", 1, "m", None, None)  # an arbitrary object
    io.save_checkpoint(state, path)
    with pytest.raises(UnsafeCheckpointError, match="weights_only=False"):
        io.load_checkpoint(path)
    assert io.load_checkpoint(path, weights_only=False)["hparams"].msg == "m"
    # A file written without the plugin (no manifest) loads with a warning, or is
    # refused when a manifest is required.
    foreign = tmp_path / "foreign.ckpt"
    torch.save(_state(2), foreign)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert io.load_checkpoint(foreign)["global_step"] == 2
    assert "has no manifest" in caplog.text
    with pytest.raises(CorruptCheckpointError, match="no manifest"):
        AtomicCheckpointIO(require_manifest=True).load_checkpoint(foreign)


@pytest.mark.timeout(60)
def test_remove_checkpoint_removes_file_and_manifest_only(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "a.ckpt"
    io.save_checkpoint(_state(1), path)
    io.remove_checkpoint(path)
    assert os.listdir(tmp_path) == []
    io.remove_checkpoint(path)  # missing: fine
    d = tmp_path / "dir.ckpt"
    d.mkdir()
    (d / "keep").write_text("x")
    io.remove_checkpoint(d)  # never a directory
    assert (d / "keep").exists()


@pytest.mark.timeout(60)
def test_latest_checkpoint_orders_by_recorded_step_not_name_or_mtime(tmp_path):
    io = AtomicCheckpointIO()
    for step, name in ((10, "a-step=10.ckpt"), (9, "z-step=9.ckpt"), (2, "last.ckpt")):
        io.save_checkpoint(_state(step), tmp_path / name)
    os.utime(tmp_path / "z-step=9.ckpt", (time.time() + 100, time.time() + 100))
    torch.save(_state(99), tmp_path / "foreign-step=99.ckpt")  # no manifest: not ours
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a-step=10.ckpt")
    (tmp_path / "a-step=10.ckpt").write_bytes(b"torn")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "z-step=9.ckpt")
    assert latest_checkpoint(tmp_path / "nothing-here") is None


@pytest.mark.timeout(60)
def test_latest_checkpoint_takes_the_last_committed_file_of_the_newest_step(tmp_path):
    # PreemptionCallback saves preempted-step=4.ckpt at the batch end; that epoch's
    # validation then runs, and ModelCheckpoint writes epoch=3-step=4.ckpt and last.ckpt
    # with the new best in its state. Ranked by name, the preemption file won, and the
    # resumed ModelCheckpoint named a best file that top-k had already deleted.
    io = AtomicCheckpointIO()
    io.save_checkpoint(_state(4), tmp_path / "preempted-step=4.ckpt")
    time.sleep(0.01)
    io.save_checkpoint(_state(4), tmp_path / "epoch=3-step=4.ckpt")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "epoch=3-step=4.ckpt")
    time.sleep(0.01)
    io.save_checkpoint(_state(4), tmp_path / "last.ckpt")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")
    io.save_checkpoint(_state(3), tmp_path / "zz-step=3.ckpt")  # newer, but a lower step
    assert latest_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")


@pytest.mark.timeout(60)
def test_latest_checkpoint_skips_a_newest_file_whose_bytes_changed(tmp_path, caplog):
    """One flipped byte keeps the size: before, the default (sizes only) returned the
    file, and ``fit(ckpt_path=...)`` failed its checksum at every restart."""
    io = AtomicCheckpointIO()
    for step, name in ((5, "epoch=0-step=5.ckpt"), (10, "last.ckpt")):
        io.save_checkpoint(_state(step), tmp_path / name)
    with open(tmp_path / "last.ckpt", "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        got = latest_checkpoint(tmp_path)
    assert got == str(tmp_path / "epoch=0-step=5.ckpt")
    assert "last.ckpt" in caplog.text and "trying the next older checkpoint" in caplog.text
    assert io.load_checkpoint(got)["global_step"] == 5


@pytest.mark.timeout(60)
def test_fifos_and_links_planted_among_the_files_are_refused_without_waiting(tmp_path):
    # A FIFO where a sidecar manifest or a .ckpt is expected blocked every open of it
    # for ever (latest_checkpoint, adopt, verify); a sidecar that is a link made a file
    # outside the directory this one's manifest.
    io = AtomicCheckpointIO()
    for step, name in ((5, "epoch=0-step=5.ckpt"), (9, "b.ckpt"), (8, "c.ckpt"), (7, "d.ckpt")):
        io.save_checkpoint(_state(step), tmp_path / name)
    sidecar = tmp_path / ("b.ckpt" + MANIFEST_SUFFIX)
    sidecar.unlink()
    os.mkfifo(sidecar)
    (tmp_path / "c.ckpt").unlink()
    os.mkfifo(tmp_path / "c.ckpt")  # and its sidecar says 0 bytes, as a FIFO's size is
    doc = json.loads((tmp_path / ("c.ckpt" + MANIFEST_SUFFIX)).read_text())
    for version in doc["versions"]:
        version["size"] = 0
    (tmp_path / ("c.ckpt" + MANIFEST_SUFFIX)).write_text(json.dumps(doc))
    outside = tmp_path.parent / "elsewhere.manifest.json"
    outside.write_bytes((tmp_path / ("d.ckpt" + MANIFEST_SUFFIX)).read_bytes())
    (tmp_path / ("d.ckpt" + MANIFEST_SUFFIX)).unlink()
    (tmp_path / ("d.ckpt" + MANIFEST_SUFFIX)).symlink_to(outside)
    assert latest_checkpoint(tmp_path, full=True) == str(tmp_path / "epoch=0-step=5.ckpt")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        verify_checkpoint(tmp_path / "b.ckpt")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        verify_checkpoint(tmp_path / "c.ckpt", full=True)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        verify_checkpoint(tmp_path / "d.ckpt")


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_kill_during_an_overwrite_leaves_a_complete_verified_file(tmp_path):
    """SIGKILL at each point of overwriting ``last.ckpt`` (one process per point): it is
    always one complete version, verified against its manifest, and the next save
    cleans up."""
    faults = ",".join(f"{phase}@{r}=kill:6" for r, phase in enumerate(KILL_PHASES))
    results = run_ranks(w_overwrite_killed, 3, str(tmp_path), tmp_dir=str(tmp_path), faults=faults)
    for phase, result in zip(KILL_PHASES, results, strict=True):
        assert result.killed, (phase, result.error_text)
        directory = tmp_path / phase
        path = directory / "last.ckpt"
        info = verify_checkpoint(path, require_manifest=True)
        expected = 6 if phase == "after_rename" else 4
        assert info.global_step == expected, phase
        # After the manifest named step 6 but before the rename, the file is still
        # step 4: complete, and reported as not the newest save.
        assert info.is_newest == (phase != "after_manifest"), phase
        assert AtomicCheckpointIO().load_checkpoint(path)["global_step"] == expected
        # Before the rename, the new version is left as a pending file nobody loads.
        assert len(_strays(directory)) == (0 if phase == "after_rename" else 1), phase
        io = AtomicCheckpointIO()
        io.save_checkpoint(_state(8), path)
        assert _strays(directory) == []
        assert verify_checkpoint(path).global_step == 8


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_disk_full_keeps_the_previous_file(tmp_path, tmpfs):
    disk = tmpfs(2)
    io = AtomicCheckpointIO()
    path = Path(disk.path) / "last.ckpt"
    io.save_checkpoint(_state(1, n=1000), path)
    with pytest.raises(StorageFullError) as err:
        io.save_checkpoint(_state(2, n=1 << 20), path)  # 4 MiB on a 2 MiB disk
    # The advice works for a Lightning directory: prune refuses one (it is not a
    # manager's root) and there is no manager to apply_retention() with.
    assert "save_top_k" in str(err.value) and "prune" not in str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert _strays(Path(disk.path)) == []
    assert io.load_checkpoint(path)["global_step"] == 1


class _BlockingIO(AtomicCheckpointIO):
    """Holds the save of one step until released: a checkpoint that takes long."""

    def __init__(self, block_step: int):
        super().__init__()
        self.block_step = block_step
        self.started = threading.Event()
        self.release = threading.Event()

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if checkpoint["global_step"] == self.block_step:
            self.started.set()
            assert self.release.wait(30)
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.timeout(60)
def test_async_queues_removal_behind_the_save_and_skips_it_when_the_save_fails(tmp_path):
    inner = _BlockingIO(block_step=4)
    io = AsyncAtomicCheckpointIO(inner)
    old, new = tmp_path / "step=2.ckpt", tmp_path / "step=4.ckpt"
    io.save_checkpoint(_state(2), old)
    io.wait()
    state = _state(4)
    io.save_checkpoint(state, new)
    state["state_dict"]["w"].add_(1.0)  # training goes on: the snapshot is unaffected
    io.remove_checkpoint(old)  # what ModelCheckpoint does right after
    assert inner.started.wait(10)
    assert old.exists() and not new.exists()  # the previous one stays meanwhile
    inner.release.set()
    io.wait()
    assert not old.exists()
    assert torch.equal(io.load_checkpoint(new)["state_dict"]["w"], _state(4)["state_dict"]["w"])

    # A failing save: the removal queued behind it is skipped; the error is raised
    # once, by the next save.
    bad = _state(6)
    bad["state_dict"]["fn"] = lambda: 0  # torch.save cannot pickle it
    io.save_checkpoint(bad, tmp_path / "step=6.ckpt")
    io.remove_checkpoint(new)
    with pytest.raises(CheckpointError) as err:
        io.wait()
    assert "step=6.ckpt" in str(err.value)
    assert new.exists()
    io.wait()  # raised once only
    io.teardown()
    io.teardown()


@pytest.mark.timeout(60)
def test_stock_async_checkpoint_io_removes_before_the_new_file_exists(tmp_path):
    """The ordering bug of Lightning's AsyncCheckpointIO, in process."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    started, release = threading.Event(), threading.Event()

    class Slow(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            if checkpoint["global_step"] == 4:
                started.set()
                assert release.wait(30)
            super().save_checkpoint(checkpoint, path, storage_options)

    io = AsyncCheckpointIO(Slow())
    old, new = tmp_path / "step=2.ckpt", tmp_path / "step=4.ckpt"
    io.save_checkpoint(_state(2), old)
    deadline = time.monotonic() + 10
    while not old.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    io.save_checkpoint(_state(4), new)
    io.remove_checkpoint(old)
    assert started.wait(10)
    assert not old.exists() and not new.exists()  # no checkpoint at all
    release.set()
    io.teardown()
    assert new.exists()


@pytest.mark.parametrize("namespace", ["lightning", "pytorch_lightning"])
@pytest.mark.timeout(60)
def test_plugins_for_each_installed_namespace(namespace):
    package = "lightning" if namespace == "lightning" else "pytorch_lightning"
    if importlib.util.find_spec(package) is None:
        with pytest.raises(ImportError, match="pip install"):
            checkpoint_io_classes(namespace)
        return
    classes = checkpoint_io_classes(namespace)
    if namespace == "lightning":
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning.pytorch import Trainer
    else:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
        from pytorch_lightning import Trainer
    for cls in classes:
        assert issubclass(cls, CheckpointIO)
    plugin = classes.AsyncAtomicCheckpointIO()
    assert isinstance(plugin.checkpoint_io, classes.AtomicCheckpointIO)
    trainer = Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False)
    assert trainer.strategy.checkpoint_io is plugin
    # Spawn launchers pickle plugins.
    assert type(pickle.loads(pickle.dumps(plugin))) is classes.AsyncAtomicCheckpointIO
    assert (
        type(pickle.loads(pickle.dumps(classes.AtomicCheckpointIO()))) is classes.AtomicCheckpointIO
    )
    if namespace == "lightning":
        assert (al.AtomicCheckpointIO, al.AsyncAtomicCheckpointIO) == tuple(classes)
    with pytest.raises(ValueError, match="namespace"):
        checkpoint_io_classes("lightning.pytorch")


@pytest.mark.timeout(60)
def test_fabric_save_and_load_go_through_the_plugin(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AtomicCheckpointIO()])
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "global_step": 7})
    assert verify_checkpoint(path, require_manifest=True).global_step == 7
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optimizer": opt, "global_step": 0}
    fabric.load(path, state)
    assert state["global_step"] == 7
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_latest_checkpoint_finds_fabric_files_that_record_no_step(tmp_path):
    """``fabric.save`` states carry no ``global_step`` unless the user adds one: such
    files rank by when their save committed (in the manifest), not never (it returned
    None, and a resume loop silently started from scratch)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AtomicCheckpointIO()])
    model = fabric.setup(torch.nn.Linear(3, 2))
    for i, name in enumerate(("b.ckpt", "c.ckpt", "a.ckpt")):
        fabric.save(tmp_path / name, {"model": model, "iteration": i})
        assert verify_checkpoint(tmp_path / name).global_step is None
    os.utime(tmp_path / "c.ckpt", (time.time() + 100, time.time() + 100))  # mtime: ignored
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a.ckpt")
    state = {"model": model, "iteration": -1}
    fabric.load(latest_checkpoint(tmp_path), state)
    assert state["iteration"] == 2
    # A file that records a step outranks them.
    AtomicCheckpointIO().save_checkpoint(_state(1), tmp_path / "step.ckpt")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step.ckpt")


def test_latest_checkpoint_warns_when_only_files_without_a_manifest_are_there(tmp_path, caplog):
    """Stock ``.ckpt`` files and nothing of ours: None (never resumed from, unverified),
    but said, with the way to adopt them, not silently."""
    torch.save(_state(5), tmp_path / "epoch=0-step=5.ckpt")
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert latest_checkpoint(tmp_path) is None
    assert "epoch=0-step=5.ckpt" in caplog.text and "adopt=True" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert latest_checkpoint(tmp_path, adopt=True) == str(tmp_path / "epoch=0-step=5.ckpt")
    assert "without a manifest" not in caplog.text


def test_async_save_creates_the_directory_before_it_returns(tmp_path):
    """``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` into the directory right
    after ``save_checkpoint`` returns, on the training thread: the directory must exist
    by then, not when the background write reaches it (FileNotFoundError at the first
    save, most of the time)."""
    io = AsyncAtomicCheckpointIO()
    gate = threading.Event()
    io._submit(gate.wait, 30)  # the background writer is busy with an earlier job
    target = tmp_path / "new" / "deeper" / "epoch=0-step=1.ckpt"
    io.save_checkpoint(_state(1), target)
    assert target.parent.is_dir() and not target.exists()
    os.symlink(target.name, target.parent / "last.ckpt")  # what ModelCheckpoint does now
    gate.set()
    io.wait()
    assert verify_checkpoint(target.parent / "last.ckpt").global_step == 1
    io.teardown()


@pytest.mark.parametrize("plugin", [AtomicCheckpointIO, AsyncAtomicCheckpointIO])
def test_a_full_save_over_a_last_ckpt_link_replaces_the_link(tmp_path, plugin):
    """A run resumed with ``ModelCheckpoint(save_last="link")``: Lightning forgets the
    link it made and, at a save that is not a top-k file, writes a full last.ckpt over
    the link left by the first run. The plugin hashed the link's path to record the
    version it replaces and died (UnsafeCheckpointError: a symbolic link), ending the
    resumed job at its first such save; stock Lightning goes on."""
    io = plugin()
    target = tmp_path / "epoch=0-step=4.ckpt"
    io.save_checkpoint(_state(4), target)
    getattr(io, "wait", lambda: None)()  # the async plugin writes in the background
    last = tmp_path / "last.ckpt"
    os.symlink(target.name, last)  # what the first run's ModelCheckpoint left
    io.save_checkpoint(_state(6), last)
    getattr(io, "wait", lambda: None)()  # the async plugin writes in the background
    assert not last.is_symlink() and verify_checkpoint(last).global_step == 6
    assert verify_checkpoint(target).global_step == 4  # the link's target is untouched
    assert io.load_checkpoint(last)["global_step"] == 6
    io.teardown()


# ---------------------------------------------------------------------- links and adoption
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_save_last_link_loads_verified_through_its_target(tmp_path, caplog):
    """``ModelCheckpoint(save_last="link")`` makes last.ckpt a symbolic link to the
    newest file: the plugin verifies it through its target and that target's manifest
    (it used to load it "unverified", with a warning)."""
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    run = _run_script(
        tmp_path, "--dir", str(ckpt), "--ref", str(ref), "--io", "atomic",
        "--max-steps", "4", "--save-last", "link",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    last = ckpt / "last.ckpt"
    assert last.is_symlink() and not (ckpt / ("last.ckpt" + MANIFEST_SUFFIX)).exists()
    target = ckpt / "epoch=0-step=4.ckpt"
    info = verify_checkpoint(last, require_manifest=True)
    assert (info.path, info.link, info.global_step, info.has_manifest) == (
        str(target),
        str(last),
        4,
        True,
    )
    io = AtomicCheckpointIO(require_manifest=True)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert io.load_checkpoint(last)["global_step"] == 4
    assert "no manifest" not in caplog.text and "unverified" not in caplog.text
    # A corrupt target is refused through the link; a dangling link is "not found".
    good = target.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    target.write_bytes(bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        io.load_checkpoint(last)
    target.unlink()
    with pytest.raises(CheckpointNotFoundError, match="symbolic link"):
        io.load_checkpoint(last)


def _stock_save(path: Path, step: int) -> None:
    """What Lightning's own TorchCheckpointIO writes (no manifest)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    TorchCheckpointIO().save_checkpoint(_state(step), path)


@pytest.mark.timeout(120)
def test_stock_files_named_with_a_metric_after_the_step_are_adopted(tmp_path):
    # filename="{epoch}-{step}-{val_loss:.3f}": "nothing to adopt", latest_checkpoint
    # None (a fresh start), and a warning to pass the adopt=True already passed.
    from atomic_checkpoint import adopt

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step, loss in ((2, "0.512"), (4, "0.433")):
        _stock_save(ckpt / f"epoch=0-step={step}-val_loss={loss}.ckpt", step)
    assert adopt(ckpt, framework="lightning", dry_run=True).adopted == [2, 4]
    newest = latest_checkpoint(ckpt, adopt=True)
    assert newest == str(ckpt / "epoch=0-step=4-val_loss=0.433.ckpt")
    assert verify_checkpoint(newest, require_manifest=True).global_step == 4


def test_stock_files_of_one_step_with_a_version_suffix_are_each_adopted(tmp_path, caplog):
    # ModelCheckpoint writes epoch=0-step=4-v1.ckpt beside an existing
    # epoch=0-step=4.ckpt (a restarted run, a second monitor). Both were refused with
    # "several entries hold step 4: adopt with --framework naming the one that wrote
    # it", already named, and resume went back to step 2 with that warning.
    from atomic_checkpoint import adopt

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name, step in (("epoch=0-step=2", 2), ("epoch=0-step=4", 4), ("epoch=0-step=4-v1", 4)):
        _stock_save(ckpt / f"{name}.ckpt", step)
    dry = adopt(ckpt, framework="lightning", dry_run=True)
    assert (dry.adopted, dry.refused) == ([2, 4], {}), dry
    assert dry.size_bytes[4] == sum(
        os.path.getsize(ckpt / n) for n in ("epoch=0-step=4.ckpt", "epoch=0-step=4-v1.ckpt")
    )
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        newest = latest_checkpoint(ckpt, adopt=True)
    assert newest in (str(ckpt / "epoch=0-step=4.ckpt"), str(ckpt / "epoch=0-step=4-v1.ckpt"))
    assert "several entries" not in caplog.text, caplog.text
    for name in ("epoch=0-step=4.ckpt", "epoch=0-step=4-v1.ckpt"):
        info = verify_checkpoint(ckpt / name, require_manifest=True)
        assert (info.global_step, info.adopted) == (4, True), name
    again = adopt(ckpt, framework="lightning")
    assert (again.adopted, again.already, again.refused) == ([], [2, 4], {}), again


def test_a_newer_stock_last_ckpt_is_adopted_by_the_step_it_records(tmp_path, caplog):
    # save_top_k=1 with save_last=True: the newest state (step 8) is only in last.ckpt,
    # whose name carries no step. Adoption left it out, and resuming from the top-k file
    # of step 2 went back six steps (a warning said so; the run lost them all the same).
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _stock_save(ckpt / "epoch=0-step=2.ckpt", 2)
    _stock_save(ckpt / "last.ckpt", 8)
    older = os.path.getmtime(ckpt / "last.ckpt") - 60
    os.utime(ckpt / "epoch=0-step=2.ckpt", (older, older))
    # Without adoption, the newer stock last.ckpt is named in a warning.
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert latest_checkpoint(ckpt) is None
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert latest_checkpoint(ckpt, adopt=True) == str(ckpt / "last.ckpt")
    info = verify_checkpoint(ckpt / "last.ckpt", require_manifest=True)
    assert (info.global_step, info.adopted) == (8, True)
    assert AtomicCheckpointIO().load_checkpoint(ckpt / "last.ckpt")["global_step"] == 8


def test_a_torn_or_stepless_stock_last_ckpt_is_not_adopted_and_is_named(tmp_path, caplog):
    from atomic_checkpoint import adopt

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _stock_save(ckpt / "epoch=0-step=2.ckpt", 2)
    _stock_save(ckpt / "last.ckpt", 8)
    torn = (ckpt / "last.ckpt").read_bytes()[:-100]  # a kill during the stock copy
    (ckpt / "last.ckpt").write_bytes(torn)
    older = os.path.getmtime(ckpt / "last.ckpt") - 60
    os.utime(ckpt / "epoch=0-step=2.ckpt", (older, older))
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert latest_checkpoint(ckpt, adopt=True) == str(ckpt / "epoch=0-step=2.ckpt")
    assert "last.ckpt written without a manifest after epoch=0-step=2.ckpt" in caplog.text
    assert not (ckpt / ("last.ckpt" + MANIFEST_SUFFIX)).exists()
    # A whole last-v1.ckpt that records no global_step (fabric.save of a plain dict):
    # its name gives none either, so it is no candidate.
    torch.save({"model": {"w": torch.zeros(2)}}, ckpt / "last-v1.ckpt")
    result = adopt(ckpt, framework="lightning")
    assert result.adopted == [] and result.already == [2], result
    assert not (ckpt / ("last-v1.ckpt" + MANIFEST_SUFFIX)).exists()


def test_adopting_stock_files_records_complete_ones_and_refuses_torn_ones(tmp_path):
    from atomic_checkpoint import CheckpointManager, LockHeldError, adopt

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step in (2, 4, 6, 8):
        _stock_save(ckpt / f"epoch=0-step={step}.ckpt", step)
    _stock_save(ckpt / "last.ckpt", 8)
    # Torn as by a crash in the stock in-place copy: truncated...
    torn = ckpt / "epoch=0-step=8.ckpt"
    torn.write_bytes(torn.read_bytes()[:-100])
    # ...and one byte changed in the middle (same size: only the CRC-32 sees it).
    data = bytearray((ckpt / "epoch=0-step=6.ckpt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / "epoch=0-step=6.ckpt").write_bytes(bytes(data))
    before = {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt)}
    assert latest_checkpoint(ckpt) is None  # nothing verifiable yet

    dry = adopt(ckpt, framework="lightning", dry_run=True)
    # last.ckpt is whole: adopted by the step it records, beside the torn step-8 file.
    assert dry.adopted == [2, 4, 8] and sorted(dry.refused) == [6, 8]
    assert sorted(os.listdir(ckpt)) == sorted(before)  # a dry run writes nothing

    # A live job holds the run lock of the directory: adoption does not take it over,
    # and leaves no sidecar; once the job is gone, it adopts.
    holder = CheckpointManager(ckpt)
    with pytest.raises(LockHeldError):
        latest_checkpoint(ckpt, adopt=True)
    assert not any(n.endswith(MANIFEST_SUFFIX) for n in os.listdir(ckpt))
    holder.close()

    assert latest_checkpoint(ckpt, adopt=True) == str(ckpt / "last.ckpt")
    result = adopt(ckpt, framework="lightning")  # idempotent
    assert result.adopted == [] and result.already == [2, 4, 8], result
    assert "CRC" in result.refused[6] and "torn" in result.refused[8], result.refused
    for name, step in (("epoch=0-step=2.ckpt", 2), ("epoch=0-step=4.ckpt", 4), ("last.ckpt", 8)):
        info = verify_checkpoint(ckpt / name, require_manifest=True)
        assert (info.global_step, info.epoch, info.adopted) == (step, 0, True)
    for name in ("epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"):
        assert not (ckpt / (name + MANIFEST_SUFFIX)).exists(), name
    # Nothing a stock run wrote was changed or moved.
    assert all((ckpt / n).read_bytes() == b for n, b in before.items())
    # The plugin loads an adopted file verified, and refuses it once modified.
    io = AtomicCheckpointIO(require_manifest=True)
    assert io.load_checkpoint(ckpt / "epoch=0-step=4.ckpt")["global_step"] == 4
    (ckpt / "epoch=0-step=4.ckpt").write_bytes(before["epoch=0-step=2.ckpt"])
    with pytest.raises(CorruptCheckpointError):
        io.load_checkpoint(ckpt / "epoch=0-step=4.ckpt")
    assert al.stock_checkpoint_problem(ckpt / "epoch=0-step=8.ckpt") is not None


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_sigterm_to_the_whole_job_with_dataloader_workers_saves_and_exits_for_requeue(tmp_path):
    """SLURM signals every process of the job step, DataLoader workers included. Under
    torch's own worker handler the workers exit and the next batch raises ("DataLoader
    worker ... killed by signal") before anything is saved; PreemptionCallback gives
    every loader the trainer builds workers that go on, so the step is saved, the job
    exits with 75 and the checkpoint is the one a restart picks."""
    from atomic_checkpoint.preemption import REQUEUE_EXIT_CODE

    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(ckpt), "--ref", str(ref), "--io", "atomic",
         "--every", "100", "--preempt", "1", "--max-steps", "40", "--workers", "2",
         "--signal-self-at", "3", "--signal-group", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        start_new_session=True,  # the signal goes to this job's process group only
    )  # fmt: skip
    assert run.returncode == REQUEUE_EXIT_CODE, run.stderr[-3000:]
    assert "killed by signal" not in run.stderr
    report = _report(ref)
    assert report["final_step"] == 4, report
    assert report["preempted"] == str(ckpt / "preempted-step=4.ckpt")
    info = verify_checkpoint(ckpt / "preempted-step=4.ckpt", require_manifest=True)
    assert info.global_step == 4
    # The restart picks step 4: the preemption file, or a file of the same step that
    # ModelCheckpoint committed after it (last.ckpt at the end of training).
    picked = latest_checkpoint(ckpt, full=True)
    assert picked is not None and verify_checkpoint(picked).global_step == 4


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_second_preemption_removes_the_first_ones_checkpoint(tmp_path):
    # Nothing removed preempted-step=<N>.ckpt files (not ModelCheckpoint's top-k): a
    # job on spot instances kept one whole checkpoint per preemption.
    from atomic_checkpoint.preemption import REQUEUE_EXIT_CODE

    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    common = ["--dir", str(ckpt), "--ref", str(ref), "--io", "atomic", "--every", "100",
              "--preempt", "1", "--max-steps", "40"]  # fmt: skip
    first = _run_script(tmp_path, *common, "--signal-self-at", "3")
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-3000:]
    assert sorted(p.name for p in ckpt.glob("preempted-step=*.ckpt")) == ["preempted-step=4.ckpt"]
    second = _run_script(tmp_path, *common, "--resume", "latest", "--signal-self-at", "6")
    assert second.returncode == REQUEUE_EXIT_CODE, second.stderr[-3000:]
    assert _report(ref)["start_step"] == 4
    newer = f"preempted-step={_report(ref)['final_step']}.ckpt"
    assert sorted(p.name for p in ckpt.glob("preempted-step=*.ckpt*")) == [
        newer,
        newer + ".manifest.json",
    ]
    picked = latest_checkpoint(ckpt, full=True)  # that step's file committed last
    assert picked is not None
    assert verify_checkpoint(picked).global_step == _report(ref)["final_step"]


@pytest.mark.faults
def test_the_deadline_counts_model_checkpoint_saves(tmp_path):
    """ModelCheckpoint's save of step 2 takes 3 s; a SIGTERM in step 3 with a 3 s grace
    period: a preemption save would not fit, so the job stops without one (the step-2
    checkpoint stands) and exits 75 in time. Only the callback's own saves were timed:
    with none yet, it started a save the scheduler's SIGKILL would have cut."""
    from atomic_checkpoint.preemption import REQUEUE_EXIT_CODE

    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    slow = ",".join(["after_manifest@0=delay:2"] * 3)
    run = _run_script(
        tmp_path, "--dir", str(ckpt), "--ref", str(ref), "--io", "atomic", "--every", "2",
        "--preempt", "1", "--max-steps", "40", "--signal-self-at", "3",
        env={"ATOMIC_CHECKPOINT_FAULTS": slow, "ATOMIC_CHECKPOINT_GRACE_S": "3"},
    )  # fmt: skip
    assert run.returncode == REQUEUE_EXIT_CODE, run.stderr[-3000:]
    assert "WITHOUT saving" in run.stderr, run.stderr[-3000:]
    assert not list(ckpt.glob("preempted-step=*.ckpt"))
    assert latest_checkpoint(ckpt, full=True) is not None


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_one_rank_saves_the_current_step_on_all_and_exits_for_requeue(tmp_path):
    """PreemptionCallback in a 2-rank DDP job: a SIGTERM to rank 1 alone (rank 0 is the
    one that writes) stops both ranks at the next step boundary with one atomic
    checkpoint of that step, and the job exits with 75 (requeue); the requeued job
    resumes from it with exactly the state saved."""
    from atomic_checkpoint.preemption import REQUEUE_EXIT_CODE

    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    common = ["--dir", str(ckpt), "--ref", str(ref), "--io", "atomic", "--every", "4",
              "--devices", "2", "--preempt", "1"]  # fmt: skip
    run = _run_script(tmp_path, *common, "--max-steps", "40", "--signal-self-at", "5",
                      "--signal-rank", "1")  # fmt: skip
    assert run.returncode == REQUEUE_EXIT_CODE, run.stderr[-3000:]
    # Signalled at the start of step 5: that step ran to its end on both ranks, then
    # the save of step 6 (global_step after it), then the stop; not the 40 steps asked.
    for r in (0, 1):
        report = _report(ref, r)
        assert report["final_step"] == 6, report
        assert report["preempted"] == str(ckpt / "preempted-step=6.ckpt")
    info = verify_checkpoint(ckpt / "preempted-step=6.ckpt", require_manifest=True)
    assert info.global_step == 6 and not info.adopted
    assert latest_checkpoint(ckpt, full=True) == str(ckpt / "preempted-step=6.ckpt")
    assert _strays(ckpt) == []

    # The requeued job (one process is enough: the state is replicated across ranks).
    resumed = _run_script(
        tmp_path, "--dir", str(ckpt), "--ref", str(ref), "--io", "atomic", "--every", "4",
        "--preempt", "1", "--max-steps", "8", "--resume", "latest",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # ran to its end: exit 0
    assert _report(ref)["start_step"] == 6 and _report(ref)["final_step"] == 8
    _assert_resumed_state_equals_saved(ref, 6, world=1)


@pytest.mark.timeout(120)
def test_list_shows_what_a_save_killed_mid_write_left_as_pending_not_foreign(tmp_path):
    # A save of last.ckpt killed in its write leaves its pending sibling (the previous
    # last.ckpt stays whole). `list` showed it among "foreign: not checkpoints, left
    # alone" entries, as if someone else's file sat in the directory.
    code = (
        "import sys\n"
        "from atomic_checkpoint.integrations.lightning import AtomicCheckpointIO\n"
        "from tests.integrations.scripts.lightning_workers import checkpoint_dict\n"
        "AtomicCheckpointIO().save_checkpoint(checkpoint_dict(int(sys.argv[2])), sys.argv[1])\n"
    )
    last = tmp_path / "ckpt" / "last.ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    env.pop(FAULTS_ENV, None)
    first = subprocess.run([sys.executable, "-c", code, last, "2"], env=env, timeout=60)
    assert first.returncode == 0
    killed = subprocess.run(
        [sys.executable, "-c", code, last, "4"],
        env={**env, FAULTS_ENV: "mid_write@*=kill"},
        timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL
    (leftover,) = _strays(last.parent)
    assert leftover.startswith(".last.ckpt.") and leftover.endswith(".pending")
    assert verify_checkpoint(last).global_step == 2

    doc = run_json("list", last.parent)
    rows = {e["name"]: e for e in doc["entries"]}
    assert set(rows) == {"last.ckpt", leftover}, rows
    assert (rows["last.ckpt"]["status"], rows["last.ckpt"]["step"]) == ("ok", 2)
    assert rows[leftover]["status"] == "pending"
    assert "a save of last.ckpt in progress, or cut short by a crash" in rows[leftover]["problem"]
    text = run_cli("list", last.parent)
    assert text.returncode == 0 and "foreign" not in text.stdout, text.stdout
    assert "1 ok, 1 pending" in text.stdout, text.stdout
    # `inspect DIR 2` said "checkpoint steps there: none", contradicting `list`.
    inspected = run_cli("inspect", last.parent, 2)
    assert inspected.returncode == 2, (inspected.stdout, inspected.stderr)
    assert "is a Lightning ModelCheckpoint directory" in inspected.stderr, inspected.stderr


def _fit_with(directory: Path, max_steps: int, *checkpoints: Any, resume: str | None = None):
    """A single-process fit of the scripts' tiny model, logging its loss as
    ``train/loss`` and ``train_loss``, with ``AtomicCheckpointIO`` and ``checkpoints``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.integrations.scripts.lightning_train import TinyModel, cpu_trainer

    class Logged(TinyModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train/loss", loss)
            self.log("train_loss", loss)
            return loss

    made = [ModelCheckpoint(dirpath=directory, **c) for c in checkpoints]
    trainer = cpu_trainer(1, max_steps, made, [AtomicCheckpointIO()])
    with warnings.catch_warnings():  # Lightning's own hints: not ours
        warnings.simplefilter("ignore")
        trainer.fit(Logged(), ckpt_path=resume)
    return trainer, made


@pytest.mark.timeout(180)
def test_latest_checkpoint_passes_over_weights_only_files_that_cannot_resume_a_fit(
    tmp_path, caplog
):
    # A full last.ckpt and a weights-only best file in one dirpath, both of step 4, the
    # best committed last: latest_checkpoint returned it and fit(ckpt_path=...) raised
    # KeyError ("checkpoint contains only the model") at every restart of the job.
    ckpt = tmp_path / "ckpt"
    full = {"save_last": True, "every_n_train_steps": 2, "save_top_k": 0}
    best = {
        "monitor": "step",
        "mode": "max",
        "save_top_k": 1,
        "save_weights_only": True,
        "every_n_train_steps": 2,
        "filename": "best-{step}",
    }
    _fit_with(ckpt, 4, full, best)
    assert verify_checkpoint(ckpt / "best-step=4.ckpt").weights_only is True
    assert verify_checkpoint(ckpt / "last.ckpt").weights_only is False
    assert latest_checkpoint(ckpt) == str(ckpt / "last.ckpt")
    assert latest_checkpoint(ckpt, include_weights_only=True) == str(ckpt / "best-step=4.ckpt")
    trainer, _ = _fit_with(ckpt, 6, full, best, resume=latest_checkpoint(ckpt))
    assert trainer.global_step == 6
    # Only weights-only files newer than any full one: passed over, and said.
    os.remove(ckpt / "last.ckpt")
    os.remove(ckpt / ("last.ckpt" + MANIFEST_SUFFIX))
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert latest_checkpoint(ckpt) is None
    assert "saved with save_weights_only=True, it cannot resume a fit" in caplog.text


@pytest.mark.timeout(180)
def test_files_a_slash_in_the_filename_put_in_sub_folders_are_found_and_listed(tmp_path):
    # ModelCheckpoint(filename="{step}-{train/loss:.3f}") writes step=4-train/loss=...ckpt:
    # a sub-folder of dirpath. latest_checkpoint returned None (the resume silently
    # started from step 0) and `list`/`verify` saw no checkpoint.
    ckpt = tmp_path / "ckpt"
    top2 = {
        "monitor": "step",
        "mode": "max",
        "save_top_k": 2,
        "every_n_train_steps": 2,
        "filename": "{step}-{train/loss:.3f}",
    }
    _, (callback,) = _fit_with(ckpt, 6, top2)
    newest = Path(callback.best_model_path)
    assert newest.parent.name == "step=6-train" and newest.exists()
    assert latest_checkpoint(ckpt) == str(newest)
    trainer, _ = _fit_with(ckpt, 8, top2, resume=latest_checkpoint(ckpt))
    assert trainer.global_step == 8

    doc = run_json("list", ckpt)
    rows = {e["name"]: e for e in doc["entries"] if e["status"] == "ok"}
    assert sorted(e["step"] for e in rows.values()) == [6, 8], doc["entries"]
    assert all(name.split("/")[0].startswith("step=") for name in rows), rows
    verified = run_json("verify", ckpt)
    assert sorted(r["step"] for r in verified["checkpoints"] if r["status"] == "ok") == [6, 8]
