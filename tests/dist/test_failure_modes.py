"""Entries of FAILURE_MODES.md that need several real processes and no other test pins:
one 4-rank gloo job walks through them in order (a launch costs more than a save).

The job runs with faults armed so that a violated role is a dead process, not a log
line: every rank but the coordinator is SIGKILLed if it ever reaches a point only the
committer (``after_manifest``, ``after_rename``) or the rotator (``before_uncommit``,
``mid_delete``) may reach (A2, A4, B5). ``docs/failure-modes.md`` maps every entry to
its tests.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, KeepLast, catalog
from atomic_checkpoint.layout import META_DIR, PENDING_DIR, TRASH_DIR, rank_state_file
from tests.dist import workers
from tests.dist.launcher import ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORLD = 4
ELEMS = 1 << 12
PG_TIMEOUT_S = 2.0  # the training's collectives give up after this
SLOW_S = 4  # rank 1's write of step 4 takes this much longer than the others'

COORDINATOR_ONLY = ("after_manifest", "after_rename", "before_uncommit", "mid_delete")
FAULTS = ",".join(
    [f"{phase}@{r}=kill" for phase in COORDINATOR_ONLY for r in range(1, WORLD)]
    # A3: rank 3 starts writing step 3 (and the files of step 5) a second late.
    + ["before_write@3=delay:3", "before_write@3=delay:5"]
    # A8: rank 1's write of step 4 takes SLOW_S s more than the others'.
    + ["after_write@1=delay:4"] * SLOW_S
)


def _outcome(fn: Any) -> tuple[str, str, list[tuple[int, str]]]:
    """(error type, message, [(rank, error type)] of a distributed error's failures)."""
    try:
        fn()
    except Exception as exc:
        failures = [(f.rank, f.error_type) for f in getattr(exc, "failures", ())]
        return type(exc).__name__, str(exc), failures
    return "ok", "", []


_MUTATIONS = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")


def _watch_namespace(root: str) -> list[tuple[str, str]]:
    """Record every directory creation, rename and deletion this process makes in the
    checkpoint namespace of ``root`` (everything under it but the run's metadata
    directory, where every rank writes its storage probe). Python audit events: the real calls
    still happen. The commit rename goes through ``renameat2`` (ctypes, not audited):
    the kill faults cover it."""
    seen: list[tuple[str, str]] = []
    base = os.path.realpath(root)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event not in _MUTATIONS or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        if event != "shutil.rmtree" and args[-1] not in (None, -1):  # relative to a dir fd
            return
        rel = os.path.relpath(os.path.abspath(os.fsdecode(args[0])), base)
        if rel != "." and not rel.startswith(("..", META_DIR)):  # ROOT itself: ensured by all
            seen.append((event.split(".")[-1], rel))

    sys.addaudithook(hook)
    return seen


def w_failure_modes(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from atomic_checkpoint.domains import HOST_ENV

    # A4: predicates that lie. Every rank claims to be local rank 0 on a host of its
    # own (a launcher with one process per node, or a wrong LOCAL_RANK), while the
    # storage is shared: roles must come from the storage, not from these.
    os.environ["LOCAL_RANK"] = "0"
    os.environ[HOST_ENV] = f"host{rank}"
    out: dict[str, Any] = {"mutations": _watch_namespace(root)}
    mgr = CheckpointManager(root, timeout_s=30, retention=KeepLast(2))
    out["domain"] = (mgr.domain.leader, mgr.domain.members, mgr.is_coordinator)

    def state(step: int) -> dict[str, Any]:
        return workers.make_state(step, rank, big_elems=ELEMS)

    # Steps 1-3; rotation deletes step 1 after step 3 (B5: on the coordinator only).
    # A3: rank 3 is late for step 3 and its file must be in the checkpoint.
    infos = [mgr.save(s, state(s)) for s in (1, 2, 3)]
    out["infos"] = [(i.step, i.path, i.commit_seq) for i in infos]
    out["late_ok"] = [
        workers.states_equal(mgr.restore(3, rank=r), workers.make_state(3, r, big_elems=ELEMS))
        for r in range(world)
    ]

    # A8: the slow rank keeps the others waiting twice the process group's timeout,
    # yet neither the save nor the training's next collective fails.
    t = time.monotonic()
    mgr.save(4, state(4))
    out["slow_save_s"] = time.monotonic() - t
    grad = torch.tensor([float(rank)])
    dist.all_reduce(grad)
    out["all_reduce"] = float(grad)

    # C5/F2: saving the newest committed step again is refused on every rank alike (one rank
    # decides whether it exists), and the checkpoint is untouched.
    out["resave"] = _outcome(lambda: mgr.save(4, state(40)))
    out["after_resave_ok"] = workers.states_equal(mgr.restore(4), state(4))

    # A10: one staging location for every rank, chosen by the coordinator.
    with mgr.saving(5) as d:
        (d / f"shard-{rank}.bin").write_bytes(bytes([rank]) * 1000)
        out["pending"] = str(d)
    out["files_5"] = [f.path for f in catalog.load_checkpoint(mgr.storage, 5, full=True).files]

    # C6: ranks that disagree about the step save nothing, and all say so.
    step = 6 if rank != 2 else 7
    out["split_step"] = _outcome(lambda: mgr.save(step, state(step)))
    out["after_split"] = [c.step for c in mgr.checkpoints()]

    # C7: step 7 loses rank 2's shard after its commit. Every rank, including those
    # whose own file is fine, must see it as invalid: resume picks step 6 together.
    mgr.save(6, state(6))
    mgr.save(7, state(7))
    mgr.wait()
    if rank == 0:
        os.unlink(os.path.join(root, "checkpoint-7", rank_state_file(2)))
    mgr.checkpoints()  # a collective: rank 0 has deleted the shard once this returns
    latest = mgr.latest()
    out["latest_after_loss"] = latest.step if latest else None
    out["restored_6"] = workers.states_equal(mgr.restore(), state(6))
    out["restore_7"] = _outcome(lambda: mgr.restore(7))
    out["listed"] = [c.step for c in mgr.checkpoints()]
    mgr.close()
    return out


def test_roles_barriers_and_agreement_in_one_four_rank_job(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(
        w_failure_modes,
        WORLD,
        str(root),
        tmp_dir=str(tmp_path),
        faults=FAULTS,
        pg_timeout_s=PG_TIMEOUT_S,
        timeout_s=120,
    )
    v = ok_values(results)

    # A2, A4, B5: one domain, rank 0 its only committer and rotator (no rank was
    # killed at a coordinator-only point), whatever LOCAL_RANK and host names say.
    assert [x["domain"] for x in v] == [
        (0, (0, 1, 2, 3), True),
        *[(0, (0, 1, 2, 3), False)] * 3,
    ]
    assert all(x["infos"] == v[0]["infos"] for x in v)
    # A6, B5, D8: nothing but the coordinator creates, renames or deletes anything in
    # the checkpoint namespace (it creates every pending directory and deletes every
    # rotated checkpoint; the others only write their own files into what it made).
    assert [x["mutations"] for x in v[1:]] == [[], [], []]
    done_by_0 = {(op, rel.split("/")[0]) for op, rel in v[0]["mutations"]}
    assert {("mkdir", PENDING_DIR), ("rmtree", TRASH_DIR)} <= done_by_0, done_by_0

    # A3: the late rank's state is in step 3 and its files in step 5, whole: the
    # commit waited for it, and it never wrote into a directory already renamed.
    assert all(x["late_ok"] == [True] * WORLD for x in v)
    assert all(x["files_5"] == [f"shard-{r}.bin" for r in range(WORLD)] for x in v)
    # A8: the save waited for the slow rank past the process group's timeout.
    assert all(x["slow_save_s"] >= SLOW_S - 0.5 for x in v)
    assert all(x["all_reduce"] == 6.0 for x in v)

    # A10: the same pending directory on every rank, under .pending/.
    assert len({x["pending"] for x in v}) == 1
    assert os.path.dirname(v[0]["pending"]) == str(root / PENDING_DIR)

    # C5/F2: the same refusal everywhere, nothing changed.
    assert {x["resave"][0] for x in v} == {"CheckpointExistsError"}
    assert len({x["resave"][1] for x in v}) == 1 and "overwrite=True" in v[0]["resave"][1]
    assert all(x["after_resave_ok"] for x in v)

    # C6: everyone refused, naming the disagreement; nothing committed or left.
    assert {x["split_step"][0] for x in v} == {"CommitError"}
    assert "different steps" in v[0]["split_step"][1] and "2: 7" in v[0]["split_step"][1]
    assert all(x["after_split"] == [4, 5] for x in v)

    # C7: a missing shard of another rank is a hard error on every rank, and all of
    # them resume from the newest step whose every file is there.
    assert all(x["latest_after_loss"] == 6 and x["restored_6"] for x in v)
    # The coordinator validated the whole manifest and every rank raised its finding:
    # the same CorruptCheckpointError, message included (DESIGN invariant 11).
    assert all(x["restore_7"][0] == "CorruptCheckpointError" for x in v)
    assert len({x["restore_7"][1] for x in v}) == 1
    assert all("rank-00002" in x["restore_7"][1] and "missing" in x["restore_7"][1] for x in v)
    assert all(x["listed"] == [6] for x in v)

    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [6]
    reader.verify(6)
    assert os.listdir(root / PENDING_DIR) == []
    assert not (root / TRASH_DIR).exists() or os.listdir(root / TRASH_DIR) == []
