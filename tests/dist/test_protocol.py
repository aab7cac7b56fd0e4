"""The commit protocol across real processes with real gloo process groups."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, catalog
from atomic_checkpoint._faults import SAVE_PHASES
from atomic_checkpoint.layout import PENDING_DIR
from tests.dist import workers
from tests.dist.launcher import ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def _job(tmp_path: Path, fn: Callable[..., Any], world: int, *args: Any) -> tuple[Path, list[Any]]:
    """Run ``fn(rank, world, ROOT, *args)`` on ``world`` ranks, ROOT being
    ``tmp_path/ckpt``: ROOT and every rank's value (the test fails at a rank that
    returned none)."""
    root = tmp_path / "ckpt"
    return root, ok_values(run_ranks(fn, world, str(root), *args, tmp_dir=str(tmp_path)))


def test_four_ranks_round_trip_per_rank_and_replicated(tmp_path):
    root, values = _job(tmp_path, workers.w_roundtrip, 4, [10, 20, 30])
    # Every rank returns the same CheckpointInfo for every step.
    assert all(v["infos"] == values[0]["infos"] for v in values)
    assert [i[0] for i in values[0]["infos"]] == [10, 20, 30]
    assert [i[4] for i in values[0]["infos"]] == [1, 2, 3]  # commit sequence numbers
    assert all(v["restore_ok"] and v["replicated_ok"] for v in values)
    assert all(v["latest"] == 31 for v in values)
    # Phase timings are reported.
    assert {"write", "fsync", "gather", "commit", "total"} <= set(values[0]["timings"][0])
    # On disk: 4 rank files per per-rank checkpoint, one file for the replicated one.
    reader = CheckpointManager(root, read_only=True)
    steps = [c.step for c in reader.checkpoints()]
    assert steps == [10, 20, 30, 31]
    assert sorted(os.listdir(root / "checkpoint-10")) == [
        "checkpoint.manifest.json",
        *[f"rank-{r:05d}.safetensors" for r in range(4)],
    ]
    assert sorted(os.listdir(root / "checkpoint-31")) == [
        "checkpoint.manifest.json",
        "replicated.safetensors",
    ]
    assert os.listdir(root / PENDING_DIR) == []
    for s in steps:
        reader.verify(s)


def test_files_mode_collects_files_of_every_rank(tmp_path):
    root, values = _job(tmp_path, workers.w_files_mode, 3, 5)
    assert {v["path"] for v in values} == {str(root / "checkpoint-5")}
    # The block ran in the pending directory, never in the final one.
    assert all(PENDING_DIR in v["pending"] for v in values)
    m = catalog.load_checkpoint(CheckpointManager(root, read_only=True).storage, 5, full=True)
    assert sorted(f.path for f in m.files) == [
        "config.json",
        "shard-0.bin",
        "shard-1.bin",
        "shard-2.bin",
        "sub/nested.txt",
    ]
    assert (root / "checkpoint-5" / "shard-2.bin").read_bytes() == bytes([2]) * 1002


@pytest.mark.parametrize("bad_rank", [0, 2])
def test_failure_on_one_rank_raises_same_error_everywhere(tmp_path, bad_rank):
    root, values = _job(tmp_path, workers.w_bad_state_on, 4, bad_rank, 8)
    assert {v["error_type"] for v in values} == {"DistributedCheckpointError"}
    assert all(v["failed_ranks"] == (bad_rank,) for v in values)
    assert len({v["message"] for v in values}) == 1
    msg = values[0]["message"]
    assert f"rank {bad_rank}" in msg and "prepare" in msg and "weird" in msg
    # The previous checkpoint is intact and nothing of the failed save is listed.
    assert all(v["listed"] == [7] for v in values)
    assert os.listdir(root / PENDING_DIR) == []


def test_a_restore_into_a_mismatched_target_on_one_rank_is_a_state_mismatch_everywhere(tmp_path):
    # `except StateMismatchError:` around restore(into=) worked with one process and
    # missed the DistributedCheckpointError every rank raised under torchrun.
    _root, values = _job(tmp_path, workers.w_restore_into_mismatch_on, 2, 1)
    assert {v["caught"] for v in values} == {"DistributedStateMismatchError"}, values
    assert all(v["failed_ranks"] == (1,) for v in values)
    assert len({v["message"] for v in values}) == 1 and "rank 1" in values[0]["message"]


@pytest.mark.parametrize(("kind", "strategy"), [("metrics", None), ("metadata", "marker")])
def test_one_ranks_bad_metrics_or_metadata_fail_the_save_on_every_rank(tmp_path, kind, strategy):
    # Checked on that rank alone, its error left the other ranks in the save while it
    # went on to the next one: every later save failed ("asked to save different
    # steps"), then timed out. Now the commit's first step shares it.
    root, values = _job(tmp_path, workers.w_bad_input_on, 3, 1, kind, strategy)
    for how in ("sync", "async", "saving"):
        seen = [v["errors"].get(how) for v in values]
        assert all(e is not None and e[0] == "DistributedCheckpointError" for e in seen), seen
        assert all(e[1] == (1,) for e in seen), seen
        assert len({e[2] for e in seen}) == 1
        assert "rank 1" in seen[0][2] and kind[:-1] in seen[0][2], seen[0][2]
    assert all(v["listed"] == [1, 5] for v in values)  # the next save worked everywhere
    if strategy is None:
        assert os.listdir(root / PENDING_DIR) == []
    # Nothing of the failed saves is left once the job closed. With the marker strategy
    # (object stores), their markers stayed until the next start's sweep: `list` called
    # them pending and `verify ROOT` failed after a clean close.
    assert sorted(n for n in os.listdir(root) if n.startswith("checkpoint")) == [
        "checkpoint-1",
        "checkpoint-5",
    ]


@pytest.mark.parametrize("how", ["raise", "close"])
def test_a_rank_that_left_fails_the_others_next_saves_at_once_naming_it(tmp_path, how):
    # Rank 1's with block ended (an exception in its training step, or its loop
    # ended early) while the others went on saving: each of their saves waited
    # timeout_s (600 s by default) for it. Its close now marks it gone.
    root, values = _job(tmp_path, workers.w_one_rank_leaves, 3, 1, how)
    assert values[1] == {"left": True}
    for rank in (0, 2):
        for kind, error, message, elapsed in values[rank]["errors"]:
            assert error == "CollectiveMismatchError", (kind, error, message)
            assert "rank 1 in 'close()'" in message and "closed its manager" in message
            assert elapsed < 10.0, (kind, elapsed)  # not the 30 s timeout
    assert (
        [e[0] for e in values[0]["errors"]]
        == ["sync", "async"]
        == [e[0] for e in values[2]["errors"]]
    )
    with CheckpointManager(root, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [1]
    assert os.listdir(root / PENDING_DIR) == []


def test_hung_rank_makes_the_others_time_out_naming_it(tmp_path):
    root = tmp_path / "ckpt"
    faults = "before_write@3=hang:5"
    results = run_ranks(
        workers.w_hang_one, 4, str(root), 5, 3.0, tmp_dir=str(tmp_path), faults=faults, timeout_s=12
    )
    assert results[3].exitcode is None  # still hanging at the deadline: killed by us
    for r in results[:3]:
        assert r.ok, r.error_text
        assert r.value["error_type"] == "CoordinationTimeoutError"
        assert r.value["missing"] == (3,)
        assert "did not arrive" in r.value["message"]
        assert r.value["elapsed"] < 3.0 + 5.0
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [4]
    assert os.listdir(root / PENDING_DIR) == []


def _kill_trial(tmp_path, phase: str, rank: int, world: int = 4):
    root = tmp_path / f"ckpt-{phase}-{rank}"
    results = run_ranks(
        workers.w_save_steps,
        world,
        str(root),
        [1, 2, 3, 4],
        None,
        4.0,
        tmp_dir=str(tmp_path),
        faults=f"{phase}@{rank}=kill:3",
        timeout_s=40,
    )
    assert results[rank].killed, f"rank {rank} was not killed at {phase}"
    # No surviving rank may report success for step 3.
    for r in results:
        if r.rank != rank and r.ok:
            pytest.fail(f"rank {r.rank} completed all saves although rank {rank} died")
    return root


# (phase, rank): the coordinator passes every phase; other ranks only those they run.
KILL_POINTS = [(p, 0) for p in SAVE_PHASES] + [
    (p, r) for r in (1, 3) for p in ("before_write", "mid_write", "after_write", "during_broadcast")
]


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "rank"), KILL_POINTS, ids=[f"{p}@{r}" for p, r in KILL_POINTS])
def test_sigkill_at_every_phase_leaves_only_complete_checkpoints(tmp_path, phase, rank):
    from atomic_checkpoint.layout import checkpoint_name, rank_state_file
    from atomic_checkpoint.serialization import load_state

    root = _kill_trial(tmp_path, phase, rank)
    # Whatever is discoverable right after the crash is complete.
    for e in catalog.scan(CheckpointManager(root, read_only=True).storage):
        assert e.status in ("ok", "pending"), e
    # The restarted job's coordinator sweeps pending data; latest() restores exactly.
    mgr = CheckpointManager(root)
    assert os.listdir(root / PENDING_DIR) == []
    steps = [c.step for c in mgr.checkpoints()]
    # The commit of step 3 happens at the rename: a kill before it loses step 3 (and
    # only step 3), a kill after it does not.
    committed_3 = phase in ("after_rename", "during_broadcast")
    assert steps == ([1, 2, 3] if committed_3 else [1, 2])
    latest = mgr.latest()
    assert latest is not None and latest.step == steps[-1]
    mgr.verify(latest.step)
    for r in range(4):
        with mgr.storage.open_read(f"{checkpoint_name(latest.step)}/{rank_state_file(r)}") as f:
            state = load_state(f)
        assert workers.states_equal(state, workers.make_state(latest.step, r, big_elems=1 << 15))
    # And the job goes on: the next save of the killed step commits.
    mgr.save(3, {"x": 1}, overwrite=committed_3)
    assert mgr.latest().step == 3


def test_an_on_commit_callback_that_raises_on_the_coordinator_fails_no_rank(tmp_path):
    # on_commit runs on the coordinator only: if its exception escaped there, rank 0
    # would raise while the others returned, and the next collective would hang them.
    root, values = _job(tmp_path, workers.w_failing_on_commit, 2)
    assert [v["saved"] for v in values] == [[1, 2, 3], [1, 2, 3]]
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 2, 3]
