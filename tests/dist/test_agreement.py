"""Collective answers are one answer (DESIGN invariant 11), in real multi-process gloo
jobs.

- ``restore()`` when one rank's file of the newest checkpoint is corrupt: every rank
  resumes from the same older step, warning about the corrupt file; ``restore(step=N)``
  of that checkpoint raises the same ``CorruptCheckpointError`` on every rank, and no
  rank is left behind in the next collective (issue 11, defect 4).
- A read-only job racing another job's overwrite of the step reads one copy, never the
  old manifest with the new files (issue 11, defect 13).
- A rank stalled while the outcome of a save is published, past its own timeout, finds
  out what happened before it reports: it returns the committed checkpoint like the
  others (issue 11, defect 14).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.dist import agreement_workers as aw
from tests.dist.launcher import ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORLD = 4


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restore_skips_a_corrupt_rank_file_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(aw.w_save, WORLD, root, [10, 20], tmp_dir=str(tmp_path), timeout_s=90)
    ok_values(saved)
    # One byte of rank 2's tensor data in the newest checkpoint: the file keeps its size
    # and its header parses, so only the checksum can tell.
    bad = os.path.join(root, "checkpoint-20", "rank-00002.safetensors")
    _flip_byte(bad, os.path.getsize(bad) // 2)

    results = run_ranks(
        aw.w_resume_with_corrupt, WORLD, root, 20, tmp_dir=str(tmp_path), timeout_s=90
    )

    values = ok_values(results)
    # latest() stays a cheap check of sizes: step 20 is complete as far as it can tell.
    assert [v["latest"] for v in values] == [20] * WORLD
    # Every rank resumed from the same older step, with its exact state.
    assert [v.get("resume_error") for v in values] == [None] * WORLD
    assert [v["resumed_step"] for v in values] == [10] * WORLD
    assert [v["last_restored"] for v in values] == [10] * WORLD
    assert all(v["resumed_exact"] for v in values)
    # Every rank says why, naming the corrupt file.
    for v in values:
        assert any(bad in w and "step 20" in w for w in v["warnings"]), v["warnings"]
    # By step: the same error type and message on every rank, naming the rank and file.
    errors = [v["by_step"] for v in values]
    assert errors[0] is not None and errors[0][0] == "CorruptCheckpointError", errors[0]
    assert errors == [errors[0]] * WORLD
    assert "rank 2" in errors[0][1] and bad in errors[0][1]
    # And nobody was left behind: the next collective completed on every rank.
    assert [v["after"] for v in values] == [[10, 20]] * WORLD


def test_reader_racing_an_overwrite_reads_one_copy(tmp_path):
    """Issue 11, defect 13: a separate read-only job reads step 5 while another job saves
    it again (overwrite=True). Each overwrite is made to land between the reader's
    manifest read and its open of a file (the reader announces the open, the writer
    overwrites, then the open goes on), so the reader holds the old manifest and opens
    the new copy's file. It must notice and read one copy: no mix of copies across its
    ranks, no false checksum failure, for ``restore`` (unverified and verified),
    ``verify`` and ``atomic-checkpoint verify``."""
    import threading

    root, gates = str(tmp_path / "ckpt"), str(tmp_path / "gates")
    os.makedirs(gates)
    os.close(os.open(os.path.join(gates, "go-1"), os.O_CREAT | os.O_WRONLY))  # no reader yet
    first = run_ranks(aw.w_overwriter, 2, root, gates, [1], tmp_dir=str(tmp_path), timeout_s=60)
    assert all(r.ok for r in first), [r.error_text for r in first]

    writer: list = []
    t = threading.Thread(
        target=lambda: writer.extend(
            run_ranks(
                aw.w_overwriter, 2, root, gates, [2, 3, 4, 5], tmp_dir=str(tmp_path), timeout_s=120
            )
        )
    )
    t.start()
    try:
        reader = run_ranks(aw.w_gated_reader, 2, root, gates, tmp_dir=str(tmp_path), timeout_s=120)
    finally:
        t.join(150)
    assert all(r.ok for r in writer), [r.error_text for r in writer]
    for r in reader:
        assert r.ok, f"rank {r.rank}: {r.error_text}"
    # Both ranks read the same copy (the one there after overwrite 2, then 3); verify
    # and the CLI check the copy that is there after overwrite 4, then 5.
    assert [r.value for r in reader] == [
        {"unverified": 2, "verified": 3, "verify": 5, "cli_verify": 0},
        {"unverified": 2, "verified": 3},
    ]


#: The save timeout of the stalled-outcome jobs; a rank's exchange gives up after this
#: plus ``coordination._STALL_GRACE_S`` (5 s).
OUTCOME_TIMEOUT_S = 1.0


def _same_success(results, step):
    outcomes = [(v["error"], v.get("saved")) for v in ok_values(results)]
    assert outcomes == [(None, step)] * len(results), outcomes


def test_rank_whose_outcome_exchange_hangs_reports_the_published_outcome(tmp_path):
    """Issue 11, defect 14: rank 2's exchange thread hangs while the leader publishes the
    commit's outcome (a store connection that stops answering, for this rank only), so
    its main thread gives up. The others return success; rank 2 must not raise a timeout
    for a committed step: it reads the published outcome through a new connection."""
    root = str(tmp_path / "ckpt")
    results = run_ranks(
        aw.w_stalled_outcome,
        3,
        root,
        8,
        OUTCOME_TIMEOUT_S,
        2,
        "hang",
        tmp_dir=str(tmp_path),
        timeout_s=90,
    )
    _same_success(results, 8)


def test_rank_frozen_at_the_outcome_broadcast_reports_the_same_outcome(tmp_path):
    """Issue 11, defect 14, as the hang campaign's frozen trial met it: rank 1 is frozen
    (SIGSTOP, every thread) while it waits for the commit's outcome, and woken (SIGCONT)
    after the others returned and after its own exchange deadline passed. Waking, it
    must report the outcome the others reported, not a timeout."""
    import signal

    from reliability.jobs import ForkJob

    def stopped(pid: int) -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")

    root = str(tmp_path / "ckpt")
    job = ForkJob(
        aw.w_stalled_outcome, 3, root, 8, OUTCOME_TIMEOUT_S, 1, "stop", tmp_dir=str(tmp_path)
    )
    try:
        victim = job.procs[1].pid
        deadline = time.monotonic() + 60
        while not stopped(victim) and time.monotonic() < deadline and job.procs[1].is_alive():
            time.sleep(0.01)
        assert stopped(victim), "rank 1 never reached the outcome broadcast"
        t_stop = time.monotonic()
        assert job.join([0, 2], 60), "the other ranks did not finish"
        # Frozen past its deadline (timeout + grace): the moment the defect needs.
        while time.monotonic() < t_stop + OUTCOME_TIMEOUT_S + 5.0 + 1.0:
            time.sleep(0.05)
        job.signal(1, signal.SIGCONT)
        results = job.wait(timeout_s=60)
    finally:
        job.close()
    _same_success(results, 8)


def test_flags_that_differ_by_rank_fail_the_save_on_every_rank_at_once(tmp_path):
    # replicated= on rank 0 only: committed as one replicated copy, and rank 1's
    # restore() returned rank 0's state. overwrite= on rank 0 only: rank 1 raised
    # CheckpointExistsError alone while rank 0 waited for it until timeout_s, and the
    # ranks were out of step for every later call.
    root = str(tmp_path / "ckpt")
    values = ok_values(run_ranks(aw.w_mismatched_flags, 2, root, tmp_dir=str(tmp_path)))
    for name, flag in (("replicated", "replicated="), ("overwrite", "overwrite=")):
        outcomes = [v[name] for v in values]
        assert [o[0] for o in outcomes] == ["CommitError"] * 2, outcomes
        assert outcomes[0][1] == outcomes[1][1] and flag in outcomes[0][1], outcomes
        assert "{0: True, 1: False}" in outcomes[0][1], outcomes
        assert all(o[2] < 15 for o in outcomes), outcomes  # at once, not at timeout_s
    saving = [v["saving"] for v in values]
    assert [o[0] for o in saving] == ["CommitError"] * 2 and "overwrite=" in saving[0][1]
    # Nothing committed or changed by them, and the next save passed alike works.
    assert [v["next"][:2] for v in values] == [("ok", 3)] * 2
    assert [v["steps"] for v in values] == [[1, 3]] * 2
    assert [v["restored_1"] for v in values] == [[0, 0, 0, 0], [1, 1, 1, 1]]


def test_a_job_restarted_in_place_never_reads_its_last_incarnations_rounds(tmp_path, monkeypatch):
    # torchrun --max-restarts restarts the workers in place, and with its c10d
    # rendezvous they connect to the same store again, where the last incarnation's
    # keys still are: the new processes numbered their rounds from 1 again, and one
    # rank's save(1) returned the last incarnation's step 0 while the other failed.
    # Two incarnations of 2 ranks (threads) on one real TCPStore, as the agent's.
    from datetime import timedelta

    import torch.distributed as dist

    from atomic_checkpoint import CheckpointManager, coordination

    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    monkeypatch.setattr(coordination, "_next_namespace", lambda: 1)  # a new process's first
    root = tmp_path / "root"

    def incarnation(step: int) -> dict[int, str]:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(step))
        out: dict[int, str] = {}

        def rank(r: int) -> None:
            store = dist.TCPStore("127.0.0.1", server.port, 1, False)
            coord = coordination.TorchDistributedCoordinator(store, rank=r, world_size=2)
            try:
                with CheckpointManager(root, coordinator=coord, timeout_s=5) as mgr:
                    out[r] = f"saved {mgr.save(step, {'r': r}).step}"
            except Exception as exc:
                out[r] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    assert incarnation(0) == {0: "saved 0", 1: "saved 0"}
    for step in (1, 2):
        assert incarnation(step) == {0: f"saved {step}", 1: f"saved {step}"}
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [0, 1, 2]
    assert reader.restore(2, rank=1) == {"r": 1}
