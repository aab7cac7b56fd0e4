"""Tiered checkpoints (``atomic_checkpoint.tiered``): save to a fast tier, replicate to a
persistent tier in the background, restore from the fastest valid copy.

Real parts only: the fast tier is a local directory (tmpfs under /dev/shm where there
is one, as a RAM disk), the persistent tier a local directory or the real S3 server
(moto on 127.0.0.1), a cut link is the fault-injecting proxy of
``tests/testbed/s3proxy.py`` answering every request with 503, and a crash is a SIGKILL
of a child process at a named fault point of the replicator."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.cli.helpers import flip_byte
from tests.helpers import run_python
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import Rule, S3Proxy

from atomic_checkpoint import (
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KeepLast,
    Tier,
    TieredCheckpointManager,
    catalog,
)
from atomic_checkpoint.layout import checkpoint_name, rank_state_file

REPO = Path(__file__).resolve().parents[2]
ELEMS = 40_000


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"step": step, "w": rng.standard_normal(ELEMS).astype(np.float32), "lr": 0.1 * step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and a["lr"] == b["lr"] and a["w"].tobytes() == b["w"].tobytes()


@pytest.fixture
def fast_root(tmp_path: Path) -> Iterator[Path]:
    """Tier 0: a RAM disk (tmpfs) where the machine has /dev/shm, else a local dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="tiered-fast-", dir=shm))
        yield d / "run"
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path / "fast"


def steps_on(mgr: CheckpointManager) -> list[int]:
    return [c.step for c in mgr.checkpoints()]


def fully_verified(storage: Any, step: int) -> catalog.Manifest:
    """The manifest of ``step`` after every byte of every file matched its checksum."""
    return catalog.load_checkpoint(storage, step, full=True)


def checksums(m: Any) -> dict[str, tuple[int, str]]:
    return {f.path.rsplit("/", 1)[-1]: (f.size_bytes, f.checksum) for f in m.files}


def killed_job(
    code: str, faults: str, timeout_s: float, **cfg: Any
) -> subprocess.CompletedProcess[str]:
    """Run the tiered job ``code`` (``python -c``; ``cfg``, its tiers, in ``TIERED_CFG``;
    this folder on ``TEST_DIR`` for it to import ``state``) until the fault point
    ``faults`` SIGKILLs it; fail the test unless it died so. Returns the finished
    child, its output captured."""
    env = {
        "TIERED_CFG": json.dumps(cfg),
        "TEST_DIR": str(Path(__file__).parent),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
    }
    child = run_python(code, faults=faults, env=env, timeout_s=timeout_s)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    return child


# ------------------------------------------------------------ save, replicate, restore


@pytest.mark.timeout(60)
def test_replicates_each_step_with_the_saved_checksums_and_restores_bit_exact(fast_root, tmp_path):
    slow_root = tmp_path / "persistent"
    seen: list[tuple[int, int]] = []
    mgr = TieredCheckpointManager(
        [Tier(fast_root, retention=KeepLast(2)), Tier(slow_root, retention=KeepLast(3))],
        on_commit=lambda tier, info: seen.append((tier, info.step)),
    )
    for s in range(1, 6):
        mgr.save(s, state(s))
    assert mgr.wait_replicated(timeout_s=30)
    assert mgr.replication_backlog() == []
    # Every step reached both tiers, in order, each reported once per tier.
    assert sorted(t for t, s in seen if t == 0) == [0] * 5
    assert [s for t, s in seen if t == 1] == [1, 2, 3, 4, 5]
    listed = {c.step: c.tiers for c in mgr.checkpoints()}
    assert listed[5] == (0, 1) and 1 in listed[3], listed
    assert mgr.latest().step == 5 and mgr.latest().tiers == (0, 1)
    # Steps held for replication are released once replicated: tier 0's next rotation
    # applies its own policy again.
    mgr.save(6, state(6))
    assert steps_on(mgr.fast) == [5, 6]
    assert mgr.wait_replicated(6, timeout_s=30)
    restored = mgr.restore()
    assert same(restored, state(6)) and mgr.last_restored.tiers == (0,)
    # The persistent copy carries the checksums recorded at save time, and its bytes
    # match them.
    for s in (5, 6):
        here = fully_verified(mgr.fast.storage, s)
        there = fully_verified(mgr._slow_storage, s)
        assert checksums(there) == checksums(here)
        assert there.created_unix == here.created_unix and there.world_size == 1
    assert mgr.close() == []
    reader = CheckpointManager(slow_root, read_only=True)
    assert steps_on(reader) == [4, 5, 6]
    assert same(reader.restore(step=4), state(4))


@pytest.mark.netfs
@pytest.mark.timeout(60)
def test_a_wiped_fast_tier_restores_from_s3_and_the_run_goes_on(s3_server, s3_bucket, fast_root):
    url = f"s3://{s3_bucket}/run"
    tiers = [
        Tier(fast_root, retention=KeepLast(1)),
        Tier(url, retention=KeepLast(3), storage_options=s3_server.storage_options()),
    ]
    mgr = TieredCheckpointManager(tiers)
    run_id = mgr.run_id
    for s in (10, 20):
        mgr.save(s, state(s))
    assert mgr.close() == []
    shutil.rmtree(fast_root)  # the node was replaced: its local tier is empty

    mgr = TieredCheckpointManager(tiers)
    assert mgr.run_id == run_id  # the persistent tier says which run continues
    latest = mgr.latest()
    assert (latest.step, latest.tiers) == (20, (1,))
    assert same(mgr.restore(), state(20))
    assert mgr.last_restored.tiers == (1,) and mgr.last_restored.step == 20
    mgr.save(30, state(30))
    assert mgr.wait_replicated(30, timeout_s=30)
    assert [(c.step, c.tiers) for c in mgr.checkpoints()] == [(10, (1,)), (20, (1,)), (30, (0, 1))]
    mgr.close()


@pytest.mark.timeout(60)
def test_a_torn_only_copy_on_tier_0_restarts_from_the_persistent_tier(fast_root, tmp_path, caplog):
    # Tier 0 keeps one step; its file was cut to 0 bytes. The fast tier's manager
    # refused to start "from scratch over" a corrupt-only root, so the job could not
    # restart at all, though tier 1 held both steps.
    tiers = [Tier(fast_root, retention=KeepLast(1)), Tier(tmp_path / "slow", retention=KeepLast(3))]
    with TieredCheckpointManager(tiers) as mgr:
        for s in (100, 200):
            mgr.save(s, state(s))
        assert mgr.wait_replicated(timeout_s=30)
    os.truncate(fast_root / checkpoint_name(200) / rank_state_file(0), 0)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        mgr = TieredCheckpointManager(tiers)
    assert "holds no valid checkpoint of run" in caplog.text
    assert same(mgr.restore(), state(200))
    assert mgr.last_restored.tiers == (1,)
    mgr.save(300, state(300))
    assert mgr.wait_replicated(300, timeout_s=30)
    assert mgr.close() == []
    with TieredCheckpointManager(tiers, resume="must") as mgr:
        assert same(mgr.restore(), state(300))


# ------------------------------------------------------------ a crash mid-replication

CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_tiered import state
    from atomic_checkpoint import KeepLast, Tier, TieredCheckpointManager

    cfg = json.loads(os.environ["TIERED_CFG"])
    mgr = TieredCheckpointManager([
        Tier(cfg["fast"], retention=KeepLast(1)),
        Tier(cfg["url"], retention=KeepLast(5), storage_options=cfg["opts"]),
    ])
    for s in (1, 2, 3):
        mgr.save(s, state(s))
        print("saved", s, flush=True)
    mgr.wait_replicated(timeout_s=60)
    print("replicated", flush=True)
    """
)


@pytest.mark.netfs
@pytest.mark.timeout(90)
@pytest.mark.parametrize("point", ["mid_replicate", "before_replica_commit"])
def test_a_kill_mid_replication_leaves_no_torn_step_and_replication_resumes(
    s3_server, s3_bucket, fast_root, point
):
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    # SIGKILL the process on its replicator thread while it copies step 3.
    child = killed_job(CHILD, f"{point}@0=kill:3", 60, fast=str(fast_root), url=url, opts=opts)
    assert "saved 3" in child.stdout and "replicated" not in child.stdout

    # The persistent tier shows steps 1 and 2, whole, and nothing of step 3.
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert steps_on(reader) == [1, 2]
    for s in (1, 2):
        fully_verified(reader.storage, s)
    fast = CheckpointManager(fast_root, read_only=True)
    assert 3 in steps_on(fast)  # held on tier 0: it never reached tier 1

    # Restart: step 3 is queued again and replicated, bit-exact.
    mgr = TieredCheckpointManager(
        [
            Tier(fast_root, retention=KeepLast(1)),
            Tier(url, retention=KeepLast(5), storage_options=opts),
        ]
    )
    assert mgr.wait_replicated(3, timeout_s=30)
    mgr.close()
    assert steps_on(reader) == [1, 2, 3]
    there = fully_verified(reader.storage, 3)
    assert checksums(there) == checksums(fully_verified(fast.storage, 3))
    assert same(reader.restore(step=3), state(3))


PENDING_CHILD = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_tiered import state
    from atomic_checkpoint import Tier, TieredCheckpointManager

    cfg = json.loads(os.environ["TIERED_CFG"])
    mgr = TieredCheckpointManager([Tier(cfg["fast"]), Tier(cfg["slow"])])
    mgr.save(1, state(1))
    mgr.wait_replicated(1, timeout_s=60)
    print("replicated 1", flush=True)
    mgr.save(2, state(2))  # killed after its manifest is written, before its commit
    print("saved 2", flush=True)
    """
)


@pytest.mark.timeout(60)
def test_a_pending_save_is_never_replicated(fast_root, tmp_path):
    # Step 2's save is SIGKILLed on tier 0 with its files and manifest written in the
    # pending directory, not renamed into place: valid-looking, never committed.
    slow_root = tmp_path / "persistent"
    child = killed_job(
        PENDING_CHILD, "after_manifest@0=kill:2", 50, fast=str(fast_root), slow=str(slow_root)
    )
    assert "replicated 1" in child.stdout and "saved 2" not in child.stdout
    assert os.listdir(fast_root / ".pending")  # the pending save is there, manifest and all

    mgr = TieredCheckpointManager([Tier(fast_root), Tier(slow_root)])
    assert mgr.wait_replicated(timeout_s=30)
    with pytest.raises(CheckpointNotFoundError):
        mgr.wait_replicated(2, timeout_s=0)
    assert [(c.step, c.tiers) for c in mgr.checkpoints()] == [(1, (0, 1))]
    mgr.close()
    assert steps_on(CheckpointManager(slow_root, read_only=True)) == [1]
    assert not (slow_root / checkpoint_name(2)).exists()


@pytest.mark.timeout(60)
def test_a_timeout_passed_as_the_step_is_named_in_the_error(fast_root, tmp_path):
    # wait_replicated(30) waits for step 30, not for 30 s: the error says which call
    # was meant.
    with TieredCheckpointManager([Tier(fast_root), Tier(tmp_path / "persistent")]) as mgr:
        mgr.save(1, state(1))
        with pytest.raises(CheckpointNotFoundError, match=r"wait_replicated\(timeout_s=30\)"):
            mgr.wait_replicated(30)
        assert mgr.wait_replicated(timeout_s=30)


# ------------------------------------------------------------ the link to S3 is cut


@dataclass
class CutLink:
    """What ``s3_link_cut`` gives a test: the tiers, the job's manager on them, and the
    proxy with the rule that cut the link (removing it restores the link)."""

    url: str
    proxy: S3Proxy
    tiers: list[Tier]
    mgr: TieredCheckpointManager
    cut: Rule  # the proxy's rule answering every request with 503


@contextmanager
def s3_link_cut(
    s3_server: Any, s3_bucket: str, fast_root: Path, saved: Sequence[int] = (), **slow: Any
) -> Iterator[CutLink]:
    """A tiered job: tier 0 at ``fast_root`` keeping one step, tier 1 on S3 (``slow``: its
    other ``Tier`` options) reached through a proxy with no retries, so that a 503
    fails a request at once. Step 1 is saved and replicated, then the link is cut, then
    the steps ``saved`` are saved and the replicator has tried (and failed) to copy."""
    url = f"s3://{s3_bucket}/run"
    with S3Proxy(s3_server, lifetime_s=120) as proxy:
        tiers = [
            Tier(fast_root, retention=KeepLast(1)),
            Tier(url, storage_options=proxy.storage_options(max_attempts=1), **slow),
        ]
        mgr = TieredCheckpointManager(tiers, retry_max_s=0.2)
        mgr._slow_storage.fs.retries = 1  # s3fs' own retry loop, on top of botocore's
        mgr.save(1, state(1))
        assert mgr.wait_replicated(1, timeout_s=30)
        link = CutLink(url, proxy, tiers, mgr, proxy.add(Rule("error", status=503, times=None)))
        for step in saved:
            mgr.save(step, state(step))
        assert not saved or link.cut.arrived.wait(30)
        yield link


@pytest.mark.netfs
@pytest.mark.timeout(90)
def test_saves_go_on_while_s3_is_unreachable_and_replication_catches_up(
    s3_server, s3_bucket, fast_root
):
    with s3_link_cut(s3_server, s3_bucket, fast_root, (2, 3, 4, 5), retention=KeepLast(3)) as link:
        mgr = link.mgr
        # Nothing older than KeepLast(1) was deleted on tier 0: those steps exist
        # nowhere else.
        assert mgr.replication_backlog() == [2, 3, 4, 5]
        assert steps_on(mgr.fast) == [2, 3, 4, 5]
        assert mgr.wait_replicated(timeout_s=0) is False
        link.proxy.remove(link.cut)  # the link is back
        assert mgr.wait_replicated(timeout_s=60)
        opts = s3_server.storage_options()
        reader = CheckpointManager(link.url, storage_options=opts, read_only=True)
        for s in (2, 3, 4, 5):
            fully_verified(reader.storage, s)
        # Replicated: tier 0's own policy applies again at its next save.
        mgr.save(6, state(6))
        assert steps_on(mgr.fast) == [6]
        assert mgr.wait_replicated(6, timeout_s=30)
        assert mgr.close() == []
        # close() waited for tier 1's retention too.
        assert steps_on(reader) == [4, 5, 6]


@pytest.mark.netfs
@pytest.mark.timeout(90)
def test_close_drains_then_applies_tier_0_retention_to_what_the_drain_released(
    s3_server, s3_bucket, fast_root
):
    # Steps 2-5 wait on tier 0 for the persistent tier (held beyond KeepLast(1)); the
    # link comes back just as the job closes: close() replicates them, and tier 0's
    # policy then applies, as it would have at a next save.
    with s3_link_cut(s3_server, s3_bucket, fast_root, (2, 3, 4, 5)) as link:
        mgr = link.mgr
        assert steps_on(mgr.fast) == [2, 3, 4, 5]
        link.proxy.remove(link.cut)
        assert mgr.close() == []  # drained
    opts = s3_server.storage_options()
    reader = CheckpointManager(link.url, storage_options=opts, read_only=True)
    assert steps_on(reader) == [1, 2, 3, 4, 5]
    for s in (2, 3, 4, 5):
        fully_verified(reader.storage, s)
    assert steps_on(CheckpointManager(fast_root, read_only=True)) == [5]


# ------------------------------------------------------------ a corrupt fast copy


@pytest.mark.timeout(60)
def test_a_corrupt_fast_copy_is_never_replicated(fast_root, tmp_path):
    slow_root = tmp_path / "persistent"
    plain = CheckpointManager(fast_root)
    for s in (1, 2):
        plain.save(s, state(s))
    plain.close()
    # Flip one byte of step 2's data, keeping the size: only a checksum tells.
    m = catalog.load_checkpoint(plain.storage, 2)
    data = fast_root / checkpoint_name(2) / m.files[0].path
    flip_byte(data, -100)

    mgr = TieredCheckpointManager([Tier(fast_root, retention=KeepLast(1)), Tier(slow_root)])
    assert mgr.wait_replicated(1, timeout_s=30)
    with pytest.raises(CorruptCheckpointError, match="not replicated"):
        mgr.wait_replicated(2, timeout_s=30)
    # "Every step committed so far" is not on the persistent tier while tier 0 holds
    # step 2: raised at every call (only failures new to the call were, and a second
    # call, or one made after the failure was recorded, returned True).
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError, match="not replicated"):
            mgr.wait_replicated(timeout_s=30)
    reader = CheckpointManager(slow_root, read_only=True)
    assert steps_on(reader) == [1]
    assert os.listdir(slow_root / ".pending") == []  # the attempt was discarded
    # Restore skips the corrupt copy and loads the newest that verifies.
    assert same(mgr.restore(), state(1))
    assert mgr.last_restored.step == 1
    assert mgr.close() == [2]  # it returned []: "drained"


@pytest.mark.netfs
@pytest.mark.timeout(90)
def test_close_and_restart_while_s3_is_unreachable_keep_every_step_until_it_answers(
    s3_server, s3_bucket, fast_root
):
    with s3_link_cut(s3_server, s3_bucket, fast_root, (2, 3)) as link:
        mgr = link.mgr
        # close() says what did not reach S3 instead of claiming success.
        assert mgr.close(timeout_s=0) == [2, 3]
        assert steps_on(CheckpointManager(fast_root, read_only=True)) == [2, 3]
        # The next start, with S3 still unreachable: it opens (tier 0 names the run),
        # saves go on, and every step stays held until S3 answers.
        mgr = TieredCheckpointManager(link.tiers, retry_max_s=0.2)
        mgr.save(4, state(4))
        assert steps_on(mgr.fast) == [2, 3, 4]
        assert mgr.wait_replicated(timeout_s=0) is False
        link.proxy.remove(link.cut)
        assert mgr.wait_replicated(timeout_s=30)
        assert mgr.replication_backlog() == []
        assert mgr.close() == []
    reader = CheckpointManager(
        link.url, storage_options=s3_server.storage_options(), read_only=True
    )
    assert steps_on(reader) == [1, 2, 3, 4]
    for s in (2, 3, 4):
        assert same(reader.restore(step=s), state(s))


@pytest.mark.netfs
@pytest.mark.timeout(90)
def test_close_of_a_run_that_never_reached_s3_does_not_say_its_steps_are_missing(
    s3_server, s3_bucket, fast_root, caplog
):
    # A run that could not reach tier 1 at all reports every step tier 0 holds (it
    # cannot tell which are there), and said they were "not replicated", also those
    # an earlier run had replicated (the tiered pass's suggestion S1).
    with s3_link_cut(s3_server, s3_bucket, fast_root, (2,)) as link:
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            assert link.mgr.close(timeout_s=0) == [2]
        assert "closed with steps [2] not replicated to" in caplog.text
        caplog.clear()
        mgr = TieredCheckpointManager(link.tiers, retry_max_s=0.2)  # S3 still cut
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            assert mgr.close(timeout_s=0) == [2]
        assert "closed with steps [2] not known to be on" in caplog.text, caplog.text
        assert "which this run never reached" in caplog.text


@pytest.mark.timeout(60)
def test_an_async_save_is_replicated_once_it_commits_on_tier_0(fast_root, tmp_path):
    slow_root = tmp_path / "persistent"
    seen: list[tuple[int, int]] = []
    mgr = TieredCheckpointManager(
        [Tier(fast_root), Tier(slow_root)],
        on_commit=lambda tier, info: seen.append((tier, info.step)),
    )
    handle = mgr.save_async(7, state(7))
    assert handle.result().step == 7
    assert mgr.wait_replicated(7, timeout_s=30)
    assert sorted(seen) == [(0, 7), (1, 7)]
    assert mgr.close() == []
    assert same(CheckpointManager(slow_root, read_only=True).restore(step=7), state(7))


@pytest.mark.timeout(60)
def test_verify_checks_every_copy_and_names_the_corrupt_tier(fast_root, tmp_path):
    slow = tmp_path / "persistent"
    tiers = [Tier(fast_root, retention=KeepLast(2)), Tier(slow, retention=KeepLast(2))]
    with TieredCheckpointManager(tiers) as mgr:
        assert mgr.is_coordinator
        for s in (1, 2):
            mgr.save(s, state(s))
        assert mgr.wait_replicated(timeout_s=30)
        assert mgr.verify(2).tiers == (0, 1)
        # One byte of tier 1's copy rots (same size: only the checksums tell).
        m = catalog.load_checkpoint(CheckpointManager(slow, read_only=True).storage, 2)
        flip_byte(slow / checkpoint_name(2) / m.files[0].path, -100)
        with pytest.raises(CorruptCheckpointError, match=r"tier 1: .*\(tier 0's copy verified\)"):
            mgr.verify(2)
        assert mgr.verify(1).tiers == (0, 1)
        with pytest.raises(CheckpointNotFoundError, match="neither tier"):
            mgr.verify(3)
        assert same(mgr.restore(2), state(2))  # tier 0's copy


def test_each_tiers_retention_is_checked_when_the_tiers_open(tmp_path):
    # Tier 0's policy is wrapped (never delete an unreplicated step), and the wrapper
    # looked valid whatever it wrapped: KeepLast, the class, kept every step, with a
    # traceback at each save and a TypeError at close.
    from atomic_checkpoint import KeepLast

    for tiers in (
        [Tier(tmp_path / "fast", retention=KeepLast), Tier(tmp_path / "slow")],
        [Tier(tmp_path / "fast"), Tier(tmp_path / "slow", retention=3)],
    ):
        with pytest.raises(TypeError, match="retention must be a policy"):
            TieredCheckpointManager(tiers)
    assert not (tmp_path / "fast").exists() and not (tmp_path / "slow").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peers", [0, 1])
def test_wait_peers_says_false_when_the_job_makes_no_peer_copies(fast_root, tmp_path, peers):
    # peers=0, or peers=1 in a job on one node: no step is ever recoverable without the
    # persistent tier, and wait_peers() returned True ("recoverable").
    with TieredCheckpointManager(
        [Tier(fast_root), Tier(tmp_path / "persistent")], peers=peers
    ) as mgr:
        mgr.save(1, state(1))
        assert mgr.wait_peers(timeout_s=5) is False
        assert mgr.wait_peers(1, timeout_s=5) is False
        assert mgr.peer_recoverable() == []


@pytest.mark.timeout(120)
def test_a_second_job_on_a_live_jobs_persistent_tier_is_refused(tmp_path: Path) -> None:
    # Job B (its own empty tier 0, no run_id) read the run id from the persistent tier,
    # then took the live job A's lock of that tier "because this job declared the same
    # run id": A was fenced there, and B's step 2 landed between A's steps 1 and 3.
    import sys

    from atomic_checkpoint import LockHeldError

    persistent, release = tmp_path / "p", tmp_path / "release"
    job_a = textwrap.dedent(
        f"""
        import os, time
        from atomic_checkpoint import Tier, TieredCheckpointManager
        m = TieredCheckpointManager([Tier({str(tmp_path / "fA")!r}), Tier({str(persistent)!r})])
        m.save(1, {{"w": [1.0]}})
        assert m.wait_replicated(timeout_s=30)
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        m.save(3, {{"w": [3.0]}})
        assert m.wait_replicated(timeout_s=30)
        m.close()
        print("done", flush=True)
        """
    )
    a = subprocess.Popen([sys.executable, "-c", job_a], stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout is not None and a.stdout.readline().strip() == "ready"
        with pytest.raises(LockHeldError, match="locked by another job"):
            TieredCheckpointManager([Tier(tmp_path / "fB"), Tier(persistent)], timeout_s=15)
    finally:
        release.touch()
        out, _ = a.communicate(timeout=60)
    assert a.returncode == 0 and "done" in out
    with CheckpointManager(persistent, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [1, 3]
