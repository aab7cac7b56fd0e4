"""Storage domains: node-local disks get one coordinator per node, and all nodes agree."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from atomic_checkpoint import CheckpointError, CheckpointManager, CorruptCheckpointError, KeepLast
from atomic_checkpoint.layout import PENDING_DIR
from tests.dist import workers
from tests.dist.launcher import ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _files(root, step):
    return sorted(os.listdir(os.path.join(root, f"checkpoint-{step}")))


def test_node_local_disks_are_found_and_each_node_commits_its_own_copy(tmp_path):
    base = str(tmp_path)
    values = ok_values(run_ranks(workers.w_node_local, 4, base, [1, 2, 3, 4], 2, tmp_dir=base))
    # Found by probing, not assumed: two domains, leaders 0 and 2.
    assert [v["domain"] for v in values] == [
        (0, 0, (0, 1), (0, 2)),
        (0, 0, (0, 1), (0, 2)),
        (1, 2, (2, 3), (0, 2)),
        (1, 2, (2, 3), (0, 2)),
    ]
    assert all(v["listed"] == [3, 4] for v in values)
    # Each node's copy holds its own ranks' files; retention ran on both nodes (B8).
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        root = os.path.join(base, f"node{node}")
        assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint-")) == [
            "checkpoint-3",
            "checkpoint-4",
        ]
        assert _files(root, 4) == [
            "checkpoint.manifest.json",
            *[f"rank-{r:05d}.safetensors" for r in ranks],
        ]
        mgr = CheckpointManager(root, read_only=True)
        mgr.verify(4)


def test_apply_retention_with_node_local_disks_deletes_alike_on_every_node(tmp_path):
    base = str(tmp_path)
    values = ok_values(
        run_ranks(workers.w_node_local, 4, base, [1, 2, 3, 4], None, None, 2, tmp_dir=base)
    )
    # Every rank reports the same deletions, decided from the steps both nodes hold.
    assert [v["applied"] for v in values] == [[1, 2]] * 4
    assert all(v["listed"] == [3, 4] for v in values)
    for node in (0, 1):
        names = os.listdir(os.path.join(base, f"node{node}"))
        assert sorted(n for n in names if n.startswith("checkpoint-")) == [
            "checkpoint-3",
            "checkpoint-4",
        ]


def test_shared_storage_is_one_domain_even_across_hosts(tmp_path):
    # Same directory for every rank, different host names: the probe finds one domain.
    def_root = str(tmp_path / "shared")
    values = ok_values(run_ranks(workers.w_shared_two_hosts, 4, def_root, tmp_dir=str(tmp_path)))
    assert all(v == (0, 0, (0, 1, 2, 3), (0,)) for v in values)


def _node_1_dies_saving(base: str, step: int, before: list[int]) -> list[Any]:
    """Save ``before`` on two nodes, then ``step``, whose save node 1's leader (rank 2)
    dies in before its rename, after a pause that lets node 0 commit its copy first."""
    if before:
        ok_values(run_ranks(workers.w_node_local, 4, base, before, None, tmp_dir=base))
    faults = f"after_manifest@2=delay:{step},after_manifest@2=kill:{step}"
    crashed = run_ranks(
        workers.w_node_local, 4, base, [step], None, tmp_dir=base, faults=faults, timeout_s=40
    )
    assert crashed[2].killed
    assert os.path.isdir(os.path.join(base, "node0", f"checkpoint-{step}"))
    return crashed


def test_node_dies_after_the_other_committed_both_resume_from_the_same_older_step(tmp_path):
    base = str(tmp_path)
    crashed = _node_1_dies_saving(base, 3, [1, 2])
    assert not any(r.ok for r in crashed)
    node0, node1 = (os.path.join(base, f"node{n}") for n in (0, 1))
    assert os.path.isdir(os.path.join(node0, "checkpoint-3"))  # half-committed step
    assert not os.path.isdir(os.path.join(node1, "checkpoint-3"))
    # Restart: every rank resumes from step 2, restores exactly, and re-saving step 3
    # replaces node 0's leftover instead of failing with "already exists".
    values = ok_values(run_ranks(workers.w_node_local, 4, base, [], None, 3, tmp_dir=base))
    assert [v["latest"] for v in values] == [2, 2, 2, 2]
    assert all(v["restored_ok"] for v in values)
    assert all(v["listed"] == [1, 2, 3] for v in values)
    for root in (node0, node1):
        assert os.listdir(os.path.join(root, PENDING_DIR)) == []
        CheckpointManager(root, read_only=True).verify(3)


def test_a_step_one_node_failed_to_commit_is_taken_back_on_the_node_that_committed(tmp_path):
    # Node 1's leader fails before its rename (an I/O error), after node 0 committed
    # its copy: every rank was told "No partial checkpoint is visible", yet node 0's
    # checkpoint-3 stayed committed there, `verify` called it ok and a reader of that
    # node (an uploader, an evaluator) took it.
    base = str(tmp_path)
    ok_values(run_ranks(workers.w_node_local, 4, base, [1, 2], None, tmp_dir=base))
    faults = "after_manifest@2=delay:3,after_manifest@2=raise:3"
    failed = run_ranks(
        workers.w_node_local, 4, base, [3], None, tmp_dir=base, faults=faults, timeout_s=40
    )
    assert all(r.error is not None for r in failed), failed
    assert all("No partial checkpoint is visible" in r.error_text for r in failed), failed
    for node in ("node0", "node1"):
        root = os.path.join(base, node)
        assert not os.path.exists(os.path.join(root, "checkpoint-3")), os.listdir(root)
        assert [c.step for c in CheckpointManager(root, read_only=True).checkpoints()] == [1, 2]
    values = ok_values(run_ranks(workers.w_node_local, 4, base, [3], None, tmp_dir=base))
    assert all(v["latest"] == 2 and v["listed"] == [1, 2, 3] for v in values), values


@pytest.mark.parametrize("saved", [[1, 2], [1]])
def test_a_node_whose_disk_was_wiped_is_never_a_silent_fresh_start(tmp_path, saved):
    # Node 1's root is gone (a replaced node); node 0 holds the saved steps. A step
    # counts only once every node has it, so nothing can be resumed: the job used to
    # start from scratch without a word, and its rotation then deleted node 0's copies.
    # With one step (KeepLast(1) keeps one), the wiped node's missing run file tells it
    # from a save that failed half way.
    base = str(tmp_path)
    ok_values(run_ranks(workers.w_node_local, 4, base, saved, 5, tmp_dir=base))
    node0 = os.path.join(base, "node0")
    shutil.rmtree(os.path.join(base, "node1"))
    results = run_ranks(workers.w_node_local, 4, base, [3], 5, tmp_dir=base, timeout_s=40)
    for r in results:
        assert not r.ok and "ResumeError" in r.error_text, r.error_text
        assert f"steps {saved}) are on some nodes only" in r.error_text, r.error_text
        # Not "with a new run_id": a new run in this root could not save these steps.
        assert "or start a separate run in another root" in r.error_text, r.error_text
    assert sorted(n for n in os.listdir(node0) if n.startswith("checkpoint-")) == [
        f"checkpoint-{s}" for s in saved
    ]


def w_node_local_logged(rank: int, world: int, base: str, *args: Any) -> dict[str, Any]:
    """``workers.w_node_local``, with the warnings the manager logged on this rank."""
    import logging

    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = _Keep(logging.WARNING)
    logging.getLogger("atomic_checkpoint").addHandler(handler)
    try:
        return {**workers.w_node_local(rank, world, base, *args), "warnings": seen}
    finally:
        logging.getLogger("atomic_checkpoint").removeHandler(handler)


def w_shrunk_to_node_0(
    rank: int, world: int, base: str, steps: list[int], keep_last: int | None
) -> list[int]:
    """The job on node 0 alone (its ranks' state is of this world size: it saves
    without restoring the steps of the larger job, as after a reshard)."""
    from atomic_checkpoint.domains import HOST_ENV

    os.environ[HOST_ENV] = "node0"
    retention = KeepLast(keep_last) if keep_last else None
    with CheckpointManager(os.path.join(base, "node0"), timeout_s=10, retention=retention) as mgr:
        for s in steps:
            mgr.save(s, workers.make_state(s, rank, big_elems=256))
        return [c.step for c in mgr.checkpoints()]


def test_steps_a_shrunk_job_saved_on_one_node_are_named_so_when_the_job_grows_back(tmp_path):
    # Two nodes save steps 1-2; the job shrinks to node 0 alone (2 ranks), which saves
    # 3-4 and rotates 1-2 away there; then both nodes start again. No step is on every
    # node, so none can be resumed: the error said "a node's disk was replaced or
    # wiped" of disks that lost nothing. It names the job that saved each step.
    base = str(tmp_path)
    ok_values(run_ranks(workers.w_node_local, 4, base, [1, 2], 2, tmp_dir=base))
    shrunk = ok_values(run_ranks(w_shrunk_to_node_0, 2, base, [3, 4], 2, tmp_dir=base))
    assert shrunk == [[3, 4], [3, 4]]
    results = run_ranks(workers.w_node_local, 4, base, [5], 2, tmp_dir=base, timeout_s=40)
    for r in results:
        assert not r.ok and "ResumeError" in r.error_text, r.error_text
        assert "steps [3, 4] were saved by a job of 2 ranks on 1 node" in r.error_text
        assert "(this job: 4 ranks on 2 nodes)" in r.error_text, r.error_text
        assert "wiped" not in r.error_text, r.error_text
    # Nothing was touched: each node still holds what it held.
    for node, kept in ((0, [3, 4]), (1, [1, 2])):
        names = os.listdir(os.path.join(base, f"node{node}"))
        assert sorted(n for n in names if n.startswith("checkpoint-")) == [
            f"checkpoint-{s}" for s in kept
        ]


def test_a_job_grown_back_over_a_shrunk_jobs_newer_steps_warns_before_replacing_them(tmp_path):
    # As above without retention: both nodes hold step 2, so the job of two nodes resumes
    # from it; the newer steps node 0 alone saved (3 and 4) are replaced by its next
    # saves. That happened without a word.
    base = str(tmp_path)
    ok_values(run_ranks(workers.w_node_local, 4, base, [1, 2], None, tmp_dir=base))
    ok_values(run_ranks(w_shrunk_to_node_0, 2, base, [3, 4], None, tmp_dir=base))
    values = ok_values(run_ranks(w_node_local_logged, 4, base, [], None, tmp_dir=base))
    assert [v["latest"] for v in values] == [2, 2, 2, 2]
    said = [w for w in values[0]["warnings"] if "were saved by a job of" in w]
    assert len(said) == 1, values[0]["warnings"]
    assert "steps [3, 4] were saved by a job of 2 ranks on 1 node" in said[0]
    assert "resumes from step 2" in said[0] and "saves of steps [3, 4] replace them" in said[0]
    assert not any("were saved by a job of" in w for v in values[1:] for w in v["warnings"])


def test_a_first_save_that_failed_half_way_is_replaced_by_the_restart(tmp_path):
    # One step on one node only is what a save that failed half way leaves: the restart
    # starts from scratch (with a warning) and its save of that step replaces it.
    base = str(tmp_path)
    _node_1_dies_saving(base, 1, [])
    values = ok_values(run_ranks(workers.w_node_local, 4, base, [1, 2], None, tmp_dir=base))
    assert [v["latest"] for v in values] == [None] * 4
    assert all(v["listed"] == [1, 2] for v in values)


def test_restore_of_a_step_only_some_nodes_committed_fails_alike_on_every_rank(tmp_path):
    # Node 1's leader died before its commit of step 3. restore(step=3): ranks on node 1
    # raised CheckpointNotFoundError at once, ranks on node 0 loaded it and then timed
    # out naming the others, and every later collective was out of step.
    base = str(tmp_path)
    _node_1_dies_saving(base, 3, [1, 2])
    values = ok_values(run_ranks(workers.w_node_local_restore_step, 4, base, 3, tmp_dir=base))
    assert {v["error"][0] for v in values} == {"CheckpointNotFoundError"}, values
    assert len({v["error"][1] for v in values}) == 1  # one error, the same on every rank
    assert all(v["seconds"] < 5 for v in values), values  # at once, not at the timeout
    assert [v["latest"] for v in values] == [2, 2, 2, 2]  # and the next call works


def test_ranks_placed_on_other_nodes_than_at_the_save_are_told_so(tmp_path):
    # An elastic restart put ranks 0-1 on node 1 and 2-3 on node 0: each node's copy
    # holds the other ranks' files. restore() called the intact step corrupt ("has no
    # file 'rank-00000.safetensors' ... only after repairing it").
    base = str(tmp_path)
    ok_values(run_ranks(workers.w_node_local, 4, base, [1, 2], None, tmp_dir=base))
    values = ok_values(
        run_ranks(workers.w_node_local_restore_step, 4, base, None, True, tmp_dir=base)
    )
    for v in values:
        assert v["error"] is not None and "Corrupt" not in v["error"][0], v
        assert "start the job with the same ranks on the same nodes" in v["error"][1], v
    assert [v["latest"] for v in values] == [2, 2, 2, 2]  # nothing was set aside as corrupt


def test_restore_of_another_nodes_rank_from_one_nodes_copy_says_so(tmp_path):
    # One process reads each rank's part (docs/faq.md: restore(rank=r)) from node 0's
    # copy, which holds ranks 0 and 1 only. Ranks 2 and 3's files are missing there by
    # design: restore called the step corrupt and fell back to an older step (a loop
    # over the ranks mixed steps), or raised "no checkpoint verifies".
    base = str(tmp_path)
    ok_values(run_ranks(workers.w_node_local, 4, base, [1, 2], None, tmp_dir=base))
    with CheckpointManager(os.path.join(base, "node0"), read_only=True) as mgr:
        for r in (0, 1):
            assert mgr.restore(rank=r)["rank"] == r
            assert mgr.last_restored is not None and mgr.last_restored.step == 2
        for r in (2, 3):
            with pytest.raises(CheckpointError, match="one node's copy") as err:
                mgr.restore(rank=r)
            assert not isinstance(err.value, CorruptCheckpointError)
        assert [c.step for c in mgr.checkpoints()] == [1, 2]  # nothing set aside


def w_restore_declared_shared(rank: int, world: int, base: str) -> str:
    """The node-local job restarted with ``storage_domains="shared"`` (a job script
    edited for a cluster with shared storage): what its restore raised."""
    from atomic_checkpoint.domains import HOST_ENV

    os.environ[HOST_ENV] = f"node{rank // 2}"
    root = os.path.join(base, f"node{rank // 2}")
    with CheckpointManager(root, timeout_s=10, storage_domains="shared") as mgr:
        try:
            mgr.restore()
            return "restored"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"


def test_a_restore_on_node_local_disks_declared_shared_says_the_ranks_do_not_share_root(
    tmp_path,
):
    # Each rank but the coordinator's node sees its own node's copy: it read as a step
    # being replaced, and after 8 reads every rank said "restore it once the writer
    # stops", with no writer anywhere.
    base = str(tmp_path)
    ok_values(run_ranks(workers.w_node_local, 4, base, [1], None, tmp_dir=base))
    said = ok_values(run_ranks(w_restore_declared_shared, 4, base, tmp_dir=base, timeout_s=90))
    for text in said:
        assert "do not share one ROOT" in text and "per-host" in text, text
        assert "writer" not in text, text
