"""``atomic-checkpoint prune``: a retention policy applied by hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from tests.cli.helpers import (
    Holder,
    error_line,
    flip_byte,
    foreign_run,
    make_root,
    run_cli,
    run_json,
    state,
    state_file,
    truncate,
)

STEPS = (100, 200, 300, 400, 500, 600)
LOSSES = {100: 0.9, 200: 0.1, 300: 0.5, 400: 0.4, 500: 0.3, 600: 0.2}


def _root(tmp_path):
    root = tmp_path / "root"
    rid = make_root(root, STEPS, losses=LOSSES)
    return root, rid


def _committed(root):
    return sorted(int(p.name.split("-")[1]) for p in root.glob("checkpoint-*") if p.is_dir())


@pytest.mark.timeout(90)
def test_prune_dry_run_then_real_on_a_mixed_root(tmp_path):
    root, rid = _root(tmp_path)
    foreign_run(root, 1000, tmp_path / "other")  # another run's, newer: never counted
    (root / "notes.txt").write_text("keep me")
    # An older step of this run, restored from elsewhere (a save below the newest
    # step is refused: StepOrderError), then corrupted.
    make_root(tmp_path / "older", (50,), run_id=rid)
    shutil.copytree(tmp_path / "older" / "checkpoint-50", root / "checkpoint-50")
    truncate(state_file(root, 50))  # this run's, corrupt: not considered, not deleted
    args = ("prune", root, "--keep-last", "2", "--keep-best", "1", "--metric", "eval_loss")

    # The corrupt step is a problem found: exit 1 (a nightly `prune || alert` fires),
    # with the policy applied to the others all the same.
    doc = run_json(*args, "--dry-run", expect_rc=1)
    assert doc["dry_run"] is True and doc["run_id"] == rid
    assert doc["policy"] == "KeepLast(2) | KeepBest(1, metric='eval_loss', mode='min')"
    plan = {c["step"]: (c["kept"], c["reason"], c["deleted"]) for c in doc["checkpoints"]}
    assert plan == {
        100: (False, "not kept by " + doc["policy"], False),
        200: (True, "best eval_loss=0.1", False),  # older than the last 2, kept
        300: (False, "not kept by " + doc["policy"], False),
        400: (False, "not kept by " + doc["policy"], False),
        500: (True, "last 2", False),
        600: (True, "newest, last 2", False),
    }
    assert {s["name"]: s["status"] for s in doc["skipped"]} == {
        "checkpoint-50": "corrupt",
        "checkpoint-1000": "foreign",
        "notes.txt": "foreign",
    }
    sizes = {c["step"]: c["size_bytes"] for c in doc["checkpoints"]}
    assert doc["freed_bytes"] == sizes[100] + sizes[300] + sizes[400]
    assert _committed(root) == [50, 100, 200, 300, 400, 500, 600, 1000]  # untouched

    proc = run_cli(*args, "--dry-run")
    assert proc.returncode == 1
    assert "1 checkpoint(s) of the run are corrupt, kept and not counted (checkpoint-50)" in (
        proc.stderr
    )
    rows = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln.split()[0].isdigit()}
    assert "would delete" in rows["100"] and "keep" in rows["200"] and "best" in rows["200"]
    assert "would delete 3 checkpoint(s)" in proc.stdout
    assert "not considered: checkpoint-1000 (foreign: belongs to run 'other-run')" in proc.stdout

    doc = run_json(*args, entry_point=True, expect_rc=1)
    assert [c["step"] for c in doc["checkpoints"] if c["deleted"]] == [100, 300, 400]
    assert doc["failed"] == []
    assert _committed(root) == [50, 200, 500, 600, 1000]
    assert (root / "notes.txt").read_text() == "keep me"
    assert list((root / ".trash").iterdir()) == []  # un-committed, then deleted
    # What is left resumes: newest valid is 600, and it restores exactly.
    mgr = CheckpointManager(root, read_only=True, coordinator=SingleProcessCoordinator())
    assert [c.step for c in mgr.checkpoints()] == [200, 500, 600]
    np.testing.assert_array_equal(mgr.restore()["model"]["w"], state(600)["model"]["w"])
    mgr.close()
    # Converged: a second prune deletes nothing.
    doc = run_json(*args, expect_rc=1)
    assert not any(c["deleted"] for c in doc["checkpoints"]) and doc["freed_bytes"] == 0


@pytest.mark.timeout(60)
def test_prune_never_deletes_the_newest(root):
    make_root(root, (1, 2, 3), losses={1: 0.1, 2: 0.5, 3: 0.9})
    doc = run_json("prune", root, "--keep-best", "1")
    assert {c["step"]: c["reason"] for c in doc["checkpoints"] if c["kept"]} == {
        1: "best eval_loss=0.1",
        3: "newest",
    }
    assert _committed(root) == [1, 3]
    doc = run_json("prune", root, "--keep-best", "1", "--mode", "max", "--metric", "acc")
    assert _committed(root) == [3]


@pytest.mark.timeout(60)
def test_prune_never_deletes_the_last_restorable_checkpoint_for_a_corrupt_newest(root):
    """The newest checkpoint fails its checksums (sizes intact: ``list`` says ok).
    ``--keep-last 1`` used to keep it and delete every other one, leaving nothing that
    restores. The newest kept is verified first: a corrupt one is set aside (never
    deleted, not counted) and the next newest is kept in its place."""
    make_root(root, (10, 20, 30, 40))
    flip_byte(state_file(root, 40), 40)
    proc = run_cli("prune", root, "--keep-last", "1", "--json", "--progress")
    assert proc.returncode == 1, proc.stderr  # a problem found: the corrupt newest
    doc = json.loads(proc.stdout)
    # The full read says what it reads, and how fast (stderr: stdout stays pure JSON).
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("verifying ")]
    assert [ln.split(":")[0] for ln in lines if " verified " in ln] == [
        "verifying checkpoint-40",
        "verifying checkpoint-30",
    ], proc.stderr
    assert {c["step"] for c in doc["checkpoints"] if c["kept"]} == {30}
    assert [(s["step"], s["status"]) for s in doc["skipped"]] == [(40, "corrupt")]
    assert "failed verification" in doc["skipped"][0]["problem"]
    assert _committed(root) == [30, 40]
    with CheckpointManager(root, read_only=True) as reader:
        assert reader.restore()["step"] == 30  # 40 is skipped: 30 is what resumes


@pytest.mark.timeout(60)
def test_prune_keep_every_and_pin(tmp_path):
    root, _ = _root(tmp_path)
    proc = run_cli(
        "prune", root, "--pin", "100", "--keep-last", "1", "--keep-every", "200", "--pin", "300"
    )
    assert proc.returncode == 0, proc.stderr
    assert _committed(root) == [100, 200, 300, 400, 600]
    assert "deleted 1 checkpoint(s)" in proc.stdout
    row = next(ln for ln in proc.stdout.splitlines() if ln.split()[:1] == ["500"])
    assert "deleted" in row


@pytest.mark.timeout(60)
def test_prune_usage_errors_delete_nothing(tmp_path):
    root, _ = _root(tmp_path)
    cases = [
        ((), "say what to keep"),
        (("--metric", "eval_loss", "--keep-last", "1"), "go with --keep-best"),
        (("--keep-last", "0"), "invalid count '0'"),
        (("--keep-last", "x"), "invalid count 'x'"),
        (("--keep-best", "1", "--mode", "median"), "invalid choice"),
        (("--keep-best", "1", "--metric", "eval_los"), "records metric 'eval_los'"),
    ]
    for extra, message in cases:
        proc = run_cli("prune", root, *extra)
        assert proc.returncode == 2, (extra, proc.stderr)
        assert message in error_line(proc), (extra, proc.stderr)
    assert "recorded: acc, eval_loss" in run_cli("prune", root, "--keep-best", "1",
                                                 "--metric", "loss").stderr  # fmt: skip
    assert _committed(root) == list(STEPS)


@pytest.mark.timeout(60)
def test_prune_without_recorded_run_needs_run_id(tmp_path):
    # (A torn run file reads as none: test_prune_reads_a_torn_run_file_as_none.)
    root, rid = _root(tmp_path)
    os.unlink(root / ".atomic-checkpoint" / "run.json")
    doc = run_json("prune", root, "--keep-last", "1", "--run-id", "not-this-run")
    assert doc["checkpoints"] == [] and _committed(root) == list(STEPS)
    # No run file and another run's checkpoint beside this run's: whose to prune is
    # ambiguous, so --run-id is asked for.
    with CheckpointManager(root, run_id="another-run") as other:
        other.save(700, {"w": np.zeros(3)})
    os.unlink(root / ".atomic-checkpoint" / "run.json")  # recorded by the first job there
    proc = run_cli("prune", root, "--keep-last", "1")
    assert proc.returncode == 2 and "2 runs" in error_line(proc) and "--run-id" in proc.stderr
    assert _committed(root) == [*STEPS, 700]
    doc = run_json("prune", root, "--keep-last", "1", "--run-id", rid)
    assert _committed(root) == [600, 700]


def test_prune_of_a_root_without_run_file_holding_one_run_prunes_that_run(tmp_path):
    """A tiered job's persistent tier has no run file (its manager is opened with the
    run's id); every checkpoint there is the run's, so prune needs no --run-id. And a
    live job's lock is the first answer (exit 3), before anything about the run."""
    root, rid = _root(tmp_path)
    os.unlink(root / ".atomic-checkpoint" / "run.json")
    with CheckpointManager(root, run_id=rid):  # the live job
        proc = run_cli("prune", root, "--keep-last", "1")
        assert proc.returncode == 3, proc.stderr
    doc = run_json("prune", root, "--keep-last", "1")
    assert doc["run_id"] == rid and _committed(root) == [600]


def test_prune_reads_a_torn_run_file_as_none(tmp_path):
    # Exit 2 ("run.json is not valid JSON: pass --run-id RUN"), where a manager replaces
    # it and goes on with the one run whose checkpoints are there.
    root, _ = _root(tmp_path)
    (root / ".atomic-checkpoint" / "run.json").write_text('{"run_id": "ru')
    proc = run_cli("prune", root, "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert "run.json is not valid JSON" in proc.stderr and "taken as no run file" in proc.stderr
    assert _committed(root) == [600]


def test_prune_of_an_empty_root_has_nothing_to_prune(tmp_path):
    """Before, it exited 2: "holds checkpoints of 0 runs ... pass --run-id"."""
    root = tmp_path / "empty"
    root.mkdir()
    proc = run_cli("prune", root, "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert "nothing to prune" in proc.stdout
    doc = run_json("prune", root, "--keep-best", "1")
    assert doc["run_id"] is None and doc["checkpoints"] == [] and doc["freed_bytes"] == 0
    assert os.listdir(root) == []  # and nothing written


@pytest.mark.timeout(60)
def test_prune_a_failed_deletion_is_named_and_the_rest_still_done(tmp_path):
    root, _ = _root(tmp_path)
    stuck = root / "checkpoint-200"
    # An immutable directory cannot be renamed away (EPERM, even for root): a real
    # failure of the un-commit step.
    chattr = subprocess.run(["chattr", "+i", str(stuck)], capture_output=True, text=True)
    if chattr.returncode != 0:
        pytest.skip(f"the filesystem of tmp_path has no immutable flag: {chattr.stderr.strip()}")
    try:
        proc = run_cli("prune", root, "--keep-last", "2", "--json")
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert proc.returncode == 1
    assert "could not delete 1 checkpoint(s): checkpoint-200" in error_line(proc)
    assert "Operation not permitted" in proc.stderr
    doc = json.loads(proc.stdout)
    assert [f["step"] for f in doc["failed"]] == [200]
    assert [c["step"] for c in doc["checkpoints"] if c["deleted"]] == [100, 300, 400]
    assert _committed(root) == [200, 500, 600]
    assert run_cli("verify", root).returncode == 0  # 200 is whole, not half-deleted


@pytest.mark.timeout(90)
def test_prune_refuses_while_a_live_job_holds_the_lock(tmp_path):
    root, _ = _root(tmp_path)
    holder = Holder(root)
    try:
        proc = run_cli("prune", root, "--keep-last", "1")
        assert proc.returncode == 3
        assert "refusing to prune" in error_line(proc) and f"pid {holder.pid}" in proc.stderr
        assert _committed(root) == list(STEPS)
        proc = run_cli("prune", root, "--keep-last", "1", "--dry-run")
        assert proc.returncode == 0 and "would refuse" in proc.stderr
        assert _committed(root) == list(STEPS)
        proc = run_cli("prune", root, "--keep-last", "5", "--force", "--json")
        assert proc.returncode == 0 and "warning: --force" in proc.stderr
        # It says what it costs the job: its lock, for good, not only a save in progress.
        assert "loses the run lock for good" in proc.stderr and "Restart it" in proc.stderr
        assert json.loads(proc.stdout)["lock"]["pid"] == holder.pid
        assert _committed(root) == [200, 300, 400, 500, 600]
        holder.save()  # the idle job's next save: fenced, naming what took its lock
        said = holder.readline()
        assert said.startswith("FAILED FencedError") and "prune --force" in said, said
    finally:
        holder.close()
    assert run_cli("prune", root, "--keep-last", "4").returncode == 0  # dead: proceeds
    assert _committed(root) == [300, 400, 500, 600]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["before_uncommit", "after_uncommit", "mid_delete"])
def test_prune_killed_mid_deletion_leaves_nothing_torn(tmp_path, phase):
    root, _ = _root(tmp_path)
    proc = run_cli(
        "prune", root, "--keep-last", "2", env={"ATOMIC_CHECKPOINT_FAULTS": f"{phase}@0=kill:300"}
    )
    assert proc.returncode == -9
    # 100 and 200 went before the kill; 300 is either still committed or wholly gone
    # from sight (in .trash/), never half there.
    listed = run_json("list", root)["entries"]
    assert all(e["status"] == "ok" for e in listed), listed
    expected = [400, 500, 600] if phase != "before_uncommit" else [300, 400, 500, 600]
    assert [e["step"] for e in listed] == expected
    assert (root / "checkpoint-300").exists() == (phase == "before_uncommit")
    assert run_cli("verify", root).returncode == 0
    # Running it again converges; clean removes what the kill left in .trash.
    assert run_cli("prune", root, "--keep-last", "2").returncode == 0
    assert _committed(root) == [500, 600]
    assert run_cli("clean", root).returncode == 0
    assert not any((root / ".trash").iterdir())


@pytest.mark.timeout(60)
def test_commands_that_change_a_root_refuse_one_checkpoint_as_root(tmp_path, root):
    # `prune .../checkpoint-300` said "nothing to prune", exit 0: a nightly job pointed
    # one level too deep never pruned anything, and nobody was told.
    make_root(root, (100, 200, 300))
    one = root / "checkpoint-300"
    for args in (
        ("prune", one, "--keep-last", "1"),
        ("clean", one),
        ("drain", one, "--to", tmp_path),
    ):
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "is one checkpoint (it holds checkpoint.manifest.json)" in proc.stderr
        assert f"({root})" in proc.stderr, proc.stderr
    assert _committed(root) == [100, 200, 300]


def test_prune_verifies_every_checkpoint_it_keeps_not_only_the_newest(tmp_path):
    # A bit-rotted checkpoint-300 (same size) was counted as one of the two kept, the
    # good 200 deleted, and prune exited 0: one good checkpoint left where --keep-last 2
    # promised two.
    root = tmp_path / "root"
    make_root(root, (100, 200, 300, 400))
    flip_byte(state_file(root, 300))
    quick = run_cli("prune", root, "--keep-last", "2", "--quick", "--dry-run", "--json")
    plan = {c["step"]: c["kept"] for c in json.loads(quick.stdout)["checkpoints"]}
    assert plan == {100: False, 200: False, 300: True, 400: True}  # --quick: as before
    proc = run_cli("prune", root, "--keep-last", "2")
    assert proc.returncode == 1, proc.stderr
    assert "checkpoint-300" in error_line(proc) and "corrupt" in error_line(proc)
    assert _committed(root) == [200, 300, 400]  # 300 set aside, never deleted
    with CheckpointManager(root, read_only=True) as mgr:
        mgr.verify(200)
        mgr.verify(400)


@pytest.mark.timeout(90)
def test_prune_with_every_checkpoint_bit_rotted_names_all_of_them_and_deletes_none(tmp_path):
    # Once the newest were found corrupt, the rest (kept, since nothing was left to
    # delete) were shown as kept, and the error counted 2 corrupt checkpoints of 4.
    root = tmp_path / "root"
    make_root(root, (100, 200, 300, 400))
    for step in (100, 200, 300, 400):
        flip_byte(state_file(root, step))
    proc = run_cli("prune", root, "--keep-last", "2")
    assert proc.returncode == 1, proc.stderr
    assert "4 checkpoint(s) of the run are corrupt" in error_line(proc), proc.stderr
    assert "no checkpoint of this run passed verification" in proc.stdout, proc.stdout
    assert _committed(root) == [100, 200, 300, 400]
    doc = run_json("prune", root, "--keep-last", "2", "--dry-run", expect_rc=1)
    assert sorted(s["step"] for s in doc["skipped"] if s["status"] == "corrupt") == [
        100,
        200,
        300,
        400,
    ]
    assert doc["checkpoints"] == []


@pytest.mark.timeout(120)
def test_a_job_cannot_start_in_the_middle_of_a_prune(tmp_path):
    # prune checked the lock only when it began: a job that opened ROOT meanwhile, rolled
    # back and saved again had its new checkpoints deleted by name (none left at all).
    import signal
    import sys

    from atomic_checkpoint import LockHeldError
    from tests.cli.helpers import cli_env

    root = tmp_path / "root"
    make_root(root, range(1, 41))
    proc = subprocess.Popen(
        [sys.executable, "-m", "atomic_checkpoint", "prune", str(root), "--keep-last", "1", "-v"],
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # ends with the process at the latest
            if "retention: deleted" in line:
                proc.send_signal(signal.SIGSTOP)  # a slow prune (a large root on S3)
                break
        with pytest.raises(LockHeldError, match="atomic-checkpoint prune"):
            CheckpointManager(root)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert not (root / ".atomic-checkpoint" / "lock.json").exists()  # released at its end
    with CheckpointManager(root) as mgr:
        assert [c.step for c in mgr.checkpoints()] == [40]


@pytest.mark.timeout(60)
def test_prune_of_a_directory_of_other_files_leaves_nothing_behind(tmp_path):
    # It printed "nothing to prune" and left .atomic-checkpoint/lock.token there.
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    proc = run_cli("prune", home, "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert "nothing to prune" in proc.stdout
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]
