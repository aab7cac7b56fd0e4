"""Every fault campaign of ``reliability/`` in its quick size: real processes, real
faults, the invariants of DESIGN.md checked after every trial. Any violation fails.

The large mode is ``python reliability/run.py --full`` (see its summary in the
project's notes); this is the bounded version CI runs.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from reliability import iofaults
from reliability.run import CAMPAIGNS, run_campaigns

from atomic_checkpoint import CoordinationTimeoutError, TorchDistributedCoordinator
from tests.testbed.pytest_fixtures import require_facility, strict_facilities

pytestmark = [pytest.mark.faults, pytest.mark.dist]

NEEDS = {
    "kill-sshfs": ["sshfs"],
    "kill-s3": ["moto", "s3fs_python"],
    "kill-s3fs": ["s3fs_fuse", "s3fs_python"],
    "libfiu": ["fiu"],
    "libfiu-s3fs": ["fiu", "s3fs_fuse", "s3fs_python"],
    "disk-full": ["tmpfs", "ext4", "xfs", "sshfs"],
    "hang": ["netns", "sshfs"],
    "s3-faults": ["moto", "s3fs_python"],
    "tiered": ["moto", "s3fs_python", "tmpfs"],
}
#: Trials each campaign must at least run, and faults it must at least land, in the
#: quick size: a campaign that silently stopped injecting would pass with zeros.
MINIMUM = {
    "kill-local": (20, 12),
    "kill-sshfs": (8, 4),
    "kill-s3": (6, 3),
    "kill-s3fs": (6, 3),
    "libfiu": (70, 25),
    "libfiu-s3fs": (7, 4),
    "disk-full": (8, 8),
    "hang": (9, 6),
    "bad-input": (40, 40),
    "crash-states": (200, 200),
    "s3-faults": (12, 8),
    "lifecycle": (6, 2),
    "preemption": (4, 3),
    "tiered": (7, 5),
}
TIMEOUTS = {
    "kill-local": 150,
    "kill-sshfs": 150,
    "kill-s3": 150,
    "kill-s3fs": 150,
    "libfiu": 200,
    "libfiu-s3fs": 200,
    "disk-full": 120,
    "hang": 150,
    "bad-input": 120,
    "crash-states": 240,
    "s3-faults": 150,
    "lifecycle": 150,
    "preemption": 240,
    "tiered": 150,
}


#: The lifecycle campaign is the state machine of tests/model run for a time budget with
#: random seeds; CI runs that machine there, derandomized with a fixed example budget.
IN_CI = [name for name in CAMPAIGNS if name != "lifecycle"]


@pytest.mark.parametrize("name", IN_CI)
def test_campaign_quick_has_no_violation(name, tmp_path, request):
    request.applymarker(pytest.mark.timeout(TIMEOUTS[name]))
    for facility in NEEDS.get(name, []):
        require_facility(facility)
    if name.startswith("libfiu"):
        ok, why = iofaults.available()  # also needs a C compiler for fiu_extra.so
        if not ok:
            if strict_facilities():
                pytest.fail(f"libfiu campaign unavailable: {why} (required under CI)")
            pytest.skip(f"libfiu campaign unavailable: {why}")
    lines: list[str] = []
    [tally] = run_campaigns([name], "quick", 11, lines.append, str(tmp_path))
    trials, faults = MINIMUM[name]
    assert tally.violations == 0, "\n".join(tally.details + lines)
    assert tally.trials >= trials, (tally.trials, tally.stats)
    assert tally.faults >= faults, (tally.faults, tally.stats)


@pytest.mark.timeout(30)
def test_a_rank_that_arrives_after_the_others_gave_up_fails_too():
    # Found by the hang campaign (a rank SIGSTOPped just before an exchange, resumed
    # after the others timed out): it found every key in place and returned success,
    # while every other rank had raised (DESIGN invariant 4: all ranks raise).
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    early = TorchDistributedCoordinator(store, rank=0, world_size=2, namespace="late")
    late = TorchDistributedCoordinator(store, rank=1, world_size=2, namespace="late")
    with pytest.raises(CoordinationTimeoutError) as gave_up:
        early.all_gather("save step 7: commit", "x", timeout_s=0.3)
    assert gave_up.value.missing_ranks == (1,)
    with pytest.raises(CoordinationTimeoutError, match="gave up") as err:
        late.all_gather("save step 7: commit", "y", timeout_s=0.3)
    assert err.value.missing_ranks == (1,) and "rank 0" in str(err.value)
    # Rounds that everyone reaches in time are unaffected.
    a = TorchDistributedCoordinator(store, rank=0, world_size=1, namespace="alone")
    assert a.all_gather("k", 1, timeout_s=1) == [1]


@pytest.mark.timeout(30)
def test_a_published_value_reaches_everyone_or_fails_everyone():
    # The prepare and commit rounds of a save are published by the leader. A receiver
    # that gives up names the leader, and a leader publishing after that fails too,
    # so no rank returns success while another raises (DESIGN invariant 4).
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    # One store connection per rank, as in separate processes.
    lead, r1, r2 = (
        TorchDistributedCoordinator(
            dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30)),
            rank=r,
            world_size=3,
            namespace="pub",
        )
        for r in range(3)
    )
    # On time: the leader does not wait; every receiver gets the value.
    assert lead.publish("save step 1: prepare", {"dir": "x"}, src=0, timeout_s=1) == {"dir": "x"}
    assert r1.publish("save step 1: prepare", None, src=0, timeout_s=1) == {"dir": "x"}
    assert r2.publish("save step 1: prepare", None, src=0, timeout_s=1) == {"dir": "x"}
    # Late leader: the receiver that gives up names it; the leader, publishing after
    # that, fails; a receiver arriving after the give-up fails as well.
    t = time.monotonic()
    with pytest.raises(CoordinationTimeoutError) as gone:
        r1.publish("save step 1: commit", None, src=0, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t < 5
    assert gone.value.missing_ranks == (0,) and "rank 0 did not answer" in str(gone.value)
    with pytest.raises(CoordinationTimeoutError, match="gave up") as late:
        lead.publish("save step 1: commit", ("ok",), src=0, timeout_s=0.3)
    assert late.value.missing_ranks == (0,)
    with pytest.raises(CoordinationTimeoutError, match="rank 1 gave up"):
        r2.publish("save step 1: commit", None, src=0, timeout_s=0.3)
    # The rounds after it are unaffected, and published keys are cleaned up once the
    # next all-gather shows every rank has read them.
    for c in (lead, r1, r2):
        assert c.publish("k", "v" if c is lead else None, src=0, timeout_s=1) == "v"
    key = "pub/3/0"  # the third round's, published by rank 0
    assert store.check([key])
    done = []
    threads = [
        threading.Thread(target=lambda c=c: done.append(c.all_gather("g", 1, timeout_s=5)))
        for c in (lead, r1, r2)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert done == [[1, 1, 1]] * 3
    deadline = time.monotonic() + 5
    while store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.check([key])


@pytest.mark.timeout(30)
def test_a_failure_outside_a_save_names_no_step(tmp_path):
    # Found by the libfiu campaign: a start-up failure on the coordinator reached every
    # rank as "checkpoint step -1 failed" (the internal marker of "not a save").
    import threading

    import torch.distributed as dist

    from atomic_checkpoint import CheckpointManager, DistributedCheckpointError

    root = tmp_path / "not-a-directory"
    root.write_text("x")
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    errors: dict[int, BaseException] = {}

    def start(rank: int) -> None:
        # One store connection per rank, as in separate processes (a client connection
        # serves one request at a time).
        client = dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))
        coord = TorchDistributedCoordinator(client, rank=rank, world_size=2, namespace="start")
        try:
            CheckpointManager(root, coordinator=coord, timeout_s=10).close()
        except Exception as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=start, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(errors) == [0, 1]
    for err in errors.values():
        assert isinstance(err, DistributedCheckpointError), err
        assert err.failed_ranks == (0,) and err.step is None
        assert "step -1" not in str(err) and "checkpoint operation failed" in str(err)
        assert "is a file" in str(err)
