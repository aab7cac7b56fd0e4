"""The original bug, reproduced and beaten: two sshfs mounts of one export are two nodes.

Two client mounts with default caching behave like two nodes on a network filesystem
(TESTBED.md, "sshfs"): each keeps its own cached names and attributes, so one node's
rename, create or delete shows up late on the other. A 4-rank job puts ranks 0 and 1 on
mount A and ranks 2 and 3 on mount B. The naive "stage, then rename" schemes
(``tests/netfs/naive.py``) fail there, the same job with atomic-checkpoint passes, and
readers on the other mount never act on a stale listing. Each test prints one
``OBSERVED:`` line (``pytest -rA``) with what it measured.
"""

# Fixtures are imported from tests.testbed.pytest_fixtures and requested by
# parameter name, which pyflakes reads as redefinitions of the imports.
# ruff: noqa: F811

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

try:
    import tests.testbed  # noqa: F401
except ModuleNotFoundError:  # Run without the repository root on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.netfs.naive import SCHEMES
from tests.netfs.nodes import dir_made_on_node_a
from tests.testbed import SshfsExport, SshfsMount, wait_until
from tests.testbed.pytest_fixtures import (  # noqa: F401 - fixtures used by name
    sshfs_export,
    sshfs_nodes,
)

from atomic_checkpoint import CheckpointManager, KeepLast, LocalStorage, catalog
from atomic_checkpoint.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from atomic_checkpoint.storage.detect import local_capabilities

pytestmark = pytest.mark.netfs

Test = TypeVar("Test", bound=Callable[..., None])

#: Ranks 0 and 1 are node A (mount A), ranks 2 and 3 node B (mount B).
NODES = [0, 0, 1, 1]
HOSTS = ["node-a", "node-a", "node-b", "node-b"]


def observed(**facts: object) -> None:
    """Prints one machine-readable line of what the test measured."""
    print("OBSERVED:", json.dumps(facts, default=str))


def per_node_roots(a: SshfsMount, b: SshfsMount, name: str) -> list[str]:
    """The root each rank uses: the same directory of the export, through its mount."""
    return [str((a if node == 0 else b).path / name) for node in NODES]


def failure_table(results: list, saves: int) -> dict[str, dict[str, object]]:
    """Per scheme: saves with an error on any rank, which ranks failed, and how."""
    table: dict[str, dict[str, object]] = {}
    for name in SCHEMES:
        per_save = [[r.value[name][i] for r in results] for i in range(saves)]
        table[name] = {
            "failed_saves": sum(1 for ranks in per_save if any(ranks)),
            "failing_ranks": sorted({r for ranks in per_save for r, e in enumerate(ranks) if e}),
            "errors": dict(collections.Counter(e for ranks in per_save for r in ranks for e in r)),
        }
    return table


def four_rank_job(timeout_s: float) -> Callable[[Test], Test]:
    """Marks a test that runs a 4-rank job across the two nodes (:func:`launch`): real
    processes (``dist``), ``slow``, and bounded at ``timeout_s``."""

    def mark(test: Test) -> Test:
        for marker in (pytest.mark.timeout(timeout_s), pytest.mark.slow, pytest.mark.dist):
            test = marker(test)
        return test

    return mark


def launch(fn: object, *args: object, tmp_path: Path, timeout_s: float) -> list:
    from tests.dist.launcher import run_ranks

    results = run_ranks(fn, 4, *args, tmp_dir=str(tmp_path), timeout_s=timeout_s)
    bad = [
        f"rank {r.rank} (exit {r.exitcode}): {r.error_text[-1500:]}" for r in results if not r.ok
    ]
    assert not bad, "\n".join(bad)
    return results


# --------------------------------------------------------------------------
# The naive schemes fail on two sshfs nodes (and not on one coherent disk)
# --------------------------------------------------------------------------

NAIVE_SAVES = 12
NAIVE_KEEP = 2


@four_rank_job(timeout_s=180)
def test_naive_schemes_fail_on_two_sshfs_nodes_but_not_on_one_disk(
    sshfs_nodes: tuple[SshfsMount, SshfsMount], tmp_path: Path
) -> None:
    from tests.netfs.naive import w_naive

    a, b = sshfs_nodes
    args = (NODES, list(SCHEMES), NAIVE_SAVES, NAIVE_KEEP, 4096)
    on_sshfs = failure_table(
        launch(w_naive, per_node_roots(a, b, ""), *args, tmp_path=tmp_path, timeout_s=150),
        NAIVE_SAVES,
    )
    local = tmp_path / "local-disk"
    local.mkdir()
    on_disk = failure_table(
        launch(w_naive, [str(local)] * 4, *args, tmp_path=tmp_path, timeout_s=150), NAIVE_SAVES
    )
    observed(saves=NAIVE_SAVES, keep=NAIVE_KEEP, sshfs=on_sshfs, local_disk=on_disk)

    # DeepSpeed layout: node B still sees the staging name A renamed away, renames it,
    # and gets FileNotFoundError, in (nearly) every save. On one disk it never fails:
    # the network filesystem's stale names are the cause.
    for name, renamers in (
        ("deepspeed-layout-every-rank-renames", [2, 3]),
        ("deepspeed-layout-node-main-renames", [2]),
    ):
        row = on_sshfs[name]
        assert row["failed_saves"] >= 0.9 * NAIVE_SAVES, (name, row)
        assert row["failing_ranks"] == renamers, (name, row)
        assert set(row["errors"]) == {"FileNotFoundError(ENOENT)"}, (name, row)
        assert on_disk[name]["failed_saves"] == 0, (name, on_disk[name])

    # Every rank rotating: concurrent (and, on node B, stale) deletions of the same
    # checkpoint make rmtree raise in most saves that rotate.
    rotating_saves = NAIVE_SAVES - NAIVE_KEEP
    row = on_sshfs["flat-every-rank-rotates"]
    assert row["failed_saves"] >= rotating_saves / 2, row
    assert "FileNotFoundError(ENOENT)" in row["errors"], row

    # The honest control: flat files in the staging directory pass on sshfs too.
    assert on_sshfs["flat-control"]["failed_saves"] == 0, on_sshfs["flat-control"]
    assert on_disk["flat-control"]["failed_saves"] == 0, on_disk["flat-control"]


# --------------------------------------------------------------------------
# The same job with atomic-checkpoint: 100 saves with rotation, no errors
# --------------------------------------------------------------------------

ATOMIC_SAVES = 100
ATOMIC_KEEP = 3


@four_rank_job(timeout_s=240)
def test_atomic_checkpoint_passes_100_saves_with_rotation_on_two_sshfs_nodes(
    sshfs_export: SshfsExport, sshfs_nodes: tuple[SshfsMount, SshfsMount], tmp_path: Path
) -> None:
    from tests.netfs.scripts.jobs import w_atomic_saves

    a, b = sshfs_nodes
    caps = local_capabilities(a.path)
    assert (caps.name, caps.coherent, caps.dir_fsync) == ("sshfs", False, False)
    start = time.monotonic()
    results = launch(
        w_atomic_saves,
        per_node_roots(a, b, "run"),
        HOSTS,
        ATOMIC_SAVES,
        ATOMIC_KEEP,
        10,
        tmp_path=tmp_path,
        timeout_s=220,
    )
    elapsed = time.monotonic() - start
    values = [r.value for r in results]

    # Two mounts of one export are ONE storage domain, found by probing across the
    # mounts (the ranks name two different hosts), with rank 0 its only coordinator.
    assert {v["domain"] for v in values} == {(0, 0, (0, 1, 2, 3), (0,))}
    assert [v["is_coordinator"] for v in values] == [True, False, False, False]

    # Every save committed once, and every rank got the same answer.
    commits = values[0]["commits"]
    assert all(v["commits"] == commits for v in values)
    assert [c[0] for c in commits] == list(range(1, ATOMIC_SAVES + 1))
    seqs = [c[1] for c in commits]
    assert seqs == sorted(set(seqs))
    # Right after each tenth commit every rank, on either node, saw it as the latest
    # and read the other node's state back bit for bit.
    for v in values:
        assert v["checks"] == [(s, s, True) for s in range(10, ATOMIC_SAVES + 1, 10)]
        assert v["retained"] == v["verified"] == list(range(98, 101))
        assert v["own_restore_ok"]

    # From the server's side: only the retained checkpoints, each complete and intact,
    # and nothing left pending or half-deleted.
    server = LocalStorage(sshfs_export.export / "run")
    assert _server_names(sshfs_export.export, "run") == [f"checkpoint-{s}" for s in (98, 99, 100)]
    for step in range(98, 101):
        catalog.load_checkpoint(server, step, full=True)
    assert server.listdir(".pending") == [] and server.listdir(".trash") == []
    observed(
        saves=ATOMIC_SAVES,
        keep=ATOMIC_KEEP,
        failed_saves=0,
        job_s=round(elapsed, 1),
        saving_s_per_rank=[round(v["seconds"], 1) for v in values],
        domain=values[0]["domain"],
    )


# --------------------------------------------------------------------------
# Readers on the other mount never act on a stale listing
# --------------------------------------------------------------------------


def _state(step: int) -> dict[str, object]:
    return {"step": step, "payload": bytes([step % 256]) * 1000}


def _server_names(export: Path, run: str) -> list[str]:
    """The checkpoint directories on the server (the export), ascending by step."""
    names = [n for n in os.listdir(export / run) if n.startswith("checkpoint-")]
    return sorted(names, key=lambda n: int(n.split("-", 1)[1]))


@pytest.mark.timeout(120)
def test_reader_on_other_node_sees_each_commit_and_deletion_at_once(
    sshfs_export: SshfsExport, sshfs_nodes: tuple[SshfsMount, SshfsMount]
) -> None:
    a, b = sshfs_nodes
    writer = CheckpointManager(a.path / "run", retention=KeepLast(2), timeout_s=30)
    writer.save(0, _state(0))
    reader = CheckpointManager(b.path / "run", read_only=True)
    assert not reader.storage.capabilities.coherent
    answers = []
    for step in range(1, 9):
        writer.save(step, _state(step))
        # Right after node A committed: node B's previous listing of ROOT is cached
        # (~20 s on sshfs), yet B must see the new checkpoint as the latest.
        latest = reader.latest()
        assert latest is not None and latest.step == step
        assert reader.restore()["step"] == step
        # Right after node A deleted one (its rotation thread): B must not list it.
        gone = f"checkpoint-{step - 2}"
        wait_until(
            lambda gone=gone: gone not in _server_names(sshfs_export.export, "run"),
            10.0,
            f"rotation on node A deleting {gone}",
        )
        listed = [c.step for c in reader.checkpoints()]
        assert listed == [step - 1, step], listed
        answers.append((step, latest.step, listed))
    writer.close()
    reader.close()
    observed(rounds=len(answers), stale_answers=0, last=answers[-1])


@pytest.mark.timeout(120)
def test_rotation_and_resume_on_the_other_node_right_after_a_commit(
    sshfs_export: SshfsExport,
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = sshfs_nodes
    caplog.set_level(logging.WARNING, logger="atomic_checkpoint")
    # Node B lists ROOT while job 1 runs on node A, so B's cached listing is stale.
    with CheckpointManager(a.path / "run", retention=KeepLast(2)) as job1:
        job1.save(1, _state(1))
        with CheckpointManager(b.path / "run", read_only=True) as look:
            assert [c.step for c in look.checkpoints()] == [1]
        for step in range(2, 6):
            job1.save(step, _state(step))
    assert _server_names(sshfs_export.export, "run") == ["checkpoint-4", "checkpoint-5"]

    # Job 2 on node B, at once: it resumes from A's newest commit, and its rotation
    # deletes exactly what is old, not names A already deleted.
    with CheckpointManager(b.path / "run", retention=KeepLast(2), resume="must") as job2:
        assert job2.run_id == job1.run_id
        latest = job2.latest()
        assert latest is not None and latest.step == 5
        assert job2.restore()["step"] == 5
        job2.save(6, _state(6))
    assert _server_names(sshfs_export.export, "run") == ["checkpoint-5", "checkpoint-6"]

    # Back on node A, whose own listing is from before job 2.
    with CheckpointManager(a.path / "run", retention=KeepLast(2), resume="must") as job3:
        assert [c.step for c in job3.checkpoints()] == [5, 6]
        job3.save(7, _state(7))
    assert _server_names(sshfs_export.export, "run") == ["checkpoint-6", "checkpoint-7"]
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == []
    observed(job2_resumed_from=5, rotation_on_b="deleted checkpoint-4 only", warnings=0)


@pytest.mark.timeout(90)
def test_a_step_rolled_back_on_the_other_node_is_saved_again_here(
    sshfs_export: SshfsExport,
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
) -> None:
    # Node B rolls the run back to step 2; the job restarts on node A, whose cached
    # listing still shows checkpoint-3: its save of step 3 was refused ("exists but is
    # not a committed checkpoint ... Move it away") for a directory only its cache held.
    a, b = sshfs_nodes
    with CheckpointManager(a.path / "run") as job1:
        for step in range(1, 6):
            job1.save(step, _state(step))
        assert [c.step for c in job1.checkpoints()] == [1, 2, 3, 4, 5]  # A has looked
    with CheckpointManager(b.path / "run") as back:
        assert back.rollback(2) == [5, 4, 3]
    assert _server_names(sshfs_export.export, "run") == ["checkpoint-1", "checkpoint-2"]
    with CheckpointManager(a.path / "run", resume="must") as job2:
        assert job2.restore()["step"] == 2
        job2.save(3, _state(3))
    assert _server_names(sshfs_export.export, "run") == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
    ]
    observed(saved_again_on_a=3)


@pytest.mark.timeout(120)
def test_a_root_deleted_on_the_other_node_is_made_again_here_once_the_cache_lets_go(
    sshfs_export: SshfsExport,
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # To start over, the root is deleted through node A; a job starts on node B, whose
    # kernel still caches the root (about 20 s): its makedirs found the cached entries
    # and made nothing, and the start failed with "create .../run.json.tmp-... failed:
    # No such file or directory". It now waits for the cached entry to go, and says so.
    a, b = sshfs_nodes
    with CheckpointManager(a.path / "run") as job1:
        job1.save(1, _state(1))
    assert "checkpoint-1" in os.listdir(b.path / "run")  # B has looked: cached
    shutil.rmtree(a.path / "run")
    caplog.set_level(logging.WARNING, logger="atomic_checkpoint")
    started = time.monotonic()
    with CheckpointManager(b.path / "run") as job2:
        assert job2.latest() is None
        job2.save(1, _state(1))
    waited = time.monotonic() - started
    assert _server_names(sshfs_export.export, "run") == ["checkpoint-1"]
    said = [
        r.getMessage() for r in caplog.records if "cache still shows the root" in r.getMessage()
    ]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    observed(waited_for_stale_root_s=round(waited, 1))


@pytest.mark.timeout(60)
def test_reader_on_other_node_reads_a_step_saved_again_not_its_cached_size(
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
) -> None:
    a, b = sshfs_nodes
    writer = CheckpointManager(a.path / "run", timeout_s=30)
    writer.save(1, _state(1))
    reader = CheckpointManager(b.path / "run", read_only=True)
    assert reader.restore()["step"] == 1  # B now caches the files' sizes
    # The same step saved again with other content (and other sizes): same paths.
    bigger = {"step": 1, "payload": b"x" * 50_000}
    writer.save(1, bigger, overwrite=True)
    infos = reader.checkpoints()
    assert [c.step for c in infos] == [1], "the re-saved step was judged corrupt on node B"
    assert reader.restore() == bigger
    writer.close()
    reader.close()
    observed(resaved_step=1, reader_saw_new_size=True)


@pytest.mark.timeout(60)
def test_storage_decides_existence_from_the_server_not_a_stale_stat(
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
) -> None:
    dir_a, dir_b = dir_made_on_node_a(sshfs_nodes, "r")
    on_a, on_b = LocalStorage(dir_a), LocalStorage(dir_b)
    assert not on_b.capabilities.coherent
    on_a.makedirs("checkpoint-5")
    on_a.write_bytes_atomic("checkpoint-5/f", b"old")
    assert on_b.size("checkpoint-5/f") == 3  # B caches it
    on_a.delete_tree("checkpoint-5")
    # The premise: node B's stat still shows the name node A deleted...
    assert on_b.is_dir("checkpoint-5")
    # ...yet a commit through B to that name is not refused as "already exists".
    on_b.makedirs("pending")
    on_b.write_bytes_atomic("pending/f", b"new!")
    on_b.rename_dir("pending", "checkpoint-5")
    assert on_a.read_bytes("checkpoint-5/f") == b"new!"

    # Renames racing from both nodes onto one name: one wins, the loser is told the
    # target exists (sshfs says EPERM, ext4 ENOTEMPTY), never a permission error.
    outcomes = collections.Counter()
    for i in range(10):
        for side, storage in (("a", on_a), ("b", on_b)):
            storage.makedirs(f"p{i}{side}")
            storage.write_bytes_atomic(f"p{i}{side}/f", side.encode())
        barrier = threading.Barrier(2, timeout=10)
        results: list[str] = []

        def contender(
            storage: LocalStorage,
            side: str,
            i: int = i,
            barrier: threading.Barrier = barrier,
            results: list[str] = results,
        ) -> None:
            barrier.wait()
            try:
                storage.rename_dir(f"p{i}{side}", f"c{i}")
                results.append("won")
            except CheckpointExistsError:
                results.append("exists")
            except Exception as exc:  # reported by the assertion below
                results.append(repr(exc))

        threads = [threading.Thread(target=contender, args=(on_a, "a")),
                   threading.Thread(target=contender, args=(on_b, "b"))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert sorted(results) == ["exists", "won"], results
        outcomes.update(results)
    observed(stale_stat_then_commit="ok", rename_races=dict(outcomes))


def test_a_step_rotated_away_on_the_other_node_is_missing_here_not_never_committed(
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
) -> None:
    # The job on node A rotates step 2 away; node B's mount still stats it (cached).
    # `inspect`/`verify ROOT 2` through B said "not_a_checkpoint ... never committed (a
    # crashed save or another tool wrote it)": an upload gate could not tell rotation,
    # the normal case, from a torn or foreign folder. A local disk says "missing".
    from tests.cli.helpers import run_json

    dir_a, dir_b = dir_made_on_node_a(sshfs_nodes, "run")
    job = CheckpointManager(dir_a, retention=KeepLast(2))
    for step in (1, 2, 3):
        job.save(step, _state(step))
    assert [c.step for c in job.checkpoints()] == [2, 3]  # its rotation has ended
    with CheckpointManager(dir_b, read_only=True) as monitor:
        assert [c.step for c in monitor.checkpoints()] == [2, 3]  # B caches checkpoint-2
    job.save(4, _state(4))  # retention deletes step 2
    assert [c.step for c in job.checkpoints()] == [3, 4]
    job.close()
    assert LocalStorage(dir_b).is_dir("checkpoint-2"), "premise: B's stat is stale"
    doc = run_json("inspect", dir_b, 2, expect_rc=1)
    assert doc["status"] == "missing", doc
    with (
        CheckpointManager(dir_b, read_only=True) as monitor,
        pytest.raises(CheckpointNotFoundError, match="no checkpoint step 2"),
    ):
        monitor.verify(2)
    observed(rotated_away_seen_from_b="missing")


# --------------------------------------------------------------------------
# A mount that vanishes under a running job
# --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_lost_mount_raises_instead_of_writing_to_the_local_disk(
    sshfs_export: SshfsExport, tmp_path: Path
) -> None:
    node = sshfs_export.mount(tmp_path / "node")
    mgr = CheckpointManager(node.path / "run", timeout_s=10, visibility_timeout_s=5)
    mgr.save(1, _state(1))
    assert node.kill_transport(), "no ssh transport to kill"
    # sshfs exits on the lost link and unmounts itself: the mount point is now the
    # empty local directory underneath.
    wait_until(lambda: not node.is_mounted(), 10.0, "sshfs unmounting itself")
    start = time.monotonic()
    with pytest.raises(StorageError, match="changed since it was opened") as info:
        mgr.save(2, _state(2))
    elapsed = time.monotonic() - start
    with pytest.raises(StorageError, match="changed since it was opened"):
        mgr.latest()
    assert "Mount the same filesystem there again" in str(info.value)
    # Nothing landed on the local disk under the mount point...
    assert os.listdir(node.path) == []
    # ...and on the server the job's checkpoint is intact, the failed step absent.
    server = LocalStorage(sshfs_export.export / "run")
    assert _server_names(sshfs_export.export, "run") == ["checkpoint-1"]
    catalog.load_checkpoint(server, 1, full=True)

    # The same export mounted again at the same place (what an automounter does after
    # an idle expiry) is the same filesystem: the job carries on.
    again = sshfs_export.mount(node.path)
    assert again.path == node.path
    latest = mgr.latest()
    assert latest is not None and latest.step == 1
    mgr.save(2, _state(2))
    mgr.close()
    assert _server_names(sshfs_export.export, "run") == ["checkpoint-1", "checkpoint-2"]
    observed(raised_after_s=round(elapsed, 3), error=str(info.value)[:200], after_remount="ok")
