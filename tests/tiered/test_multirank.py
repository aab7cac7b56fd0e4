"""Multi-rank tiered checkpoints in real gloo jobs: every rank a separate "node" with its
own local directory as tier 0, the persistent tier a local directory or the real S3
server. Each node's leader uploads its node's files, rank 0 publishes one manifest on
the persistent tier once every upload verified; a node whose local tier was wiped
restores its ranks' state from the persistent tier, bit-exactly."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.cli.helpers import run_cli
from tests.dist.launcher import ok_values, run_ranks
from tests.dist.workers import make_state, states_equal
from tests.integrations.helpers import read_all
from tests.testbed.pytest_fixtures import (  # noqa: F401
    s3_bucket,
    s3_server,
    small_disk,
    sshfs_export,
)
from tests.testbed.s3proxy import Rule, S3Proxy
from tests.tiered import workers
from tests.tiered.test_drain_cli import storage_option_args

from atomic_checkpoint import CheckpointManager, catalog
from atomic_checkpoint.domains import HOST_ENV
from atomic_checkpoint.layout import checkpoint_name, rank_state_file

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]
WORLD = 3


@pytest.fixture(
    params=[
        "dir",
        pytest.param("s3", marks=pytest.mark.netfs),
        pytest.param("sshfs", marks=pytest.mark.netfs),
    ]
)
def persistent(request, tmp_path):
    """The persistent tier: a local directory, a prefix on the real S3 server, or a
    directory on a real sshfs mount (a network filesystem that every node mounts)."""
    if request.param == "dir":
        return str(tmp_path / "persistent"), None
    if request.param == "sshfs":
        mount = request.getfixturevalue("sshfs_export").mount(tmp_path / "persistent-mnt")
        return str(Path(mount.path) / "run"), None
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", server.storage_options()


@dataclass
class S3Tiers:
    """The tiers of a job whose persistent tier is a prefix of the real S3 server: node
    N's tier 0 at ``base/nodeN``, the persistent tier at ``url`` (``opts`` reach the
    server directly)."""

    server: Any
    base: str
    url: str
    opts: dict[str, Any]
    tmp_dir: str

    def run_ranks_while_down(
        self,
        fn: Callable[..., Any],
        world: int,
        *args: Any,
        until: Path | None = None,
        once: Path | None = None,
        timeout_s: float,
    ) -> list[Any]:
        """Run ``fn(rank, world, base, url, PROXIED, *args, FLAG)`` on ``world`` ranks,
        PROXIED being the options of a proxy of the server that answers 503 to every
        request (one attempt each) until the file FLAG exists (``until=FLAG``), or once
        it does (``once=FLAG``). Every rank's value (the test fails at a rank that
        returned none); the proxy must have failed requests (the replicators tried)."""
        assert (until is None) != (once is None), "until or once, not both"
        flag = until or once
        assert flag is not None
        down_while_there = once is not None
        with S3Proxy(self.server, lifetime_s=120) as proxy:
            down = proxy.add(
                Rule(
                    "error",
                    status=503,
                    times=None,
                    when=lambda _r: flag.exists() == down_while_there,
                )
            )
            values = ok_values(
                run_ranks(
                    fn,
                    world,
                    self.base,
                    self.url,
                    proxy.storage_options(max_attempts=1),
                    *args,
                    str(flag),
                    tmp_dir=self.tmp_dir,
                    timeout_s=timeout_s,
                )
            )
        assert down.fired > 0  # the replicators did try, and failed
        return values

    def run_ranks_while_held(
        self, fn: Callable[..., Any], world: int, flag: Path, *, delay_s: float | None = None
    ) -> list[Any]:
        """Run ``fn(rank, world, base, url, PROXIED, FLAG)`` on ``world`` ranks, PROXIED
        being the options of a proxy of the server that holds every request made while
        the file FLAG exists: ``delay_s``, or until the job ends. Every rank's value;
        the proxy must have held requests."""
        with S3Proxy(self.server, lifetime_s=110) as proxy:
            held = proxy.add(
                Rule("delay", times=None, delay_s=delay_s, when=lambda _r: flag.exists())
            )
            try:
                args = (self.base, self.url, proxy.storage_options(max_attempts=1), str(flag))
                return ok_values(run_ranks(fn, world, *args, tmp_dir=self.tmp_dir, timeout_s=140))
            finally:
                held.release.set()
                proxy.remove(held)
                assert held.fired > 0


@pytest.fixture
def s3_tiers(tmp_path, s3_server, s3_bucket) -> S3Tiers:
    """A job's tiers with the persistent tier on the real S3 server (a fresh bucket)."""
    return S3Tiers(
        s3_server,
        str(tmp_path / "nodes"),
        f"s3://{s3_bucket}/run",
        s3_server.storage_options(),
        str(tmp_path),
    )


def test_each_node_uploads_its_files_and_a_wiped_node_restores_from_the_persistent_tier(
    tmp_path, persistent
):
    slow, opts = persistent
    base = str(tmp_path / "nodes")
    first = ok_values(
        run_ranks(workers.w_tiered, WORLD, base, slow, opts, [1, 2, 3], tmp_dir=str(tmp_path))
    )
    assert all(v["latest"] is None and v["replicated"] and v["left"] == [] for v in first)
    assert len({v["run_id"] for v in first}) == 1
    # Every rank got the same answer: every step on tier 1, and on every node's tier 0
    # until replicated (held past KeepLast(1)); a step replicated before the next
    # save's rotation may be gone from tier 0 by then.
    assert all([s for s, _t in v["listed"]] == [1, 2, 3] for v in first), first
    assert all(v["listed"][-1] == (3, (0, 1)) for v in first), first
    assert all(t in ((0, 1), (1,)) for v in first for _s, t in v["listed"]), first
    assert len({tuple(v["listed"]) for v in first}) == 1
    # Without peers= each node holds its own ranks' files of what tier 0 keeps: one
    # node copy (it said 0, as if no node held them).
    assert all(v["node_copies"][3] == 1 for v in first), first
    for r in range(WORLD):  # node r's disk holds rank r's file only
        names = os.listdir(Path(base) / f"node{r}" / "checkpoint-3")
        assert rank_state_file(r) in names and len([n for n in names if "rank-" in n]) == 1

    # The persistent tier holds one manifest per step with every rank's file, the
    # checksums of the save, and bytes that match them.
    reader = CheckpointManager(slow, storage_options=opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 2, 3]
    for s in (1, 2, 3):
        m = catalog.load_checkpoint(reader.storage, s, full=True)
        assert m.world_size == WORLD and m.domain_count == 1
        assert sorted(f.path.rsplit("/", 1)[-1] for f in m.files) == sorted(
            rank_state_file(r) for r in range(WORLD)
        )
        for r in range(WORLD):
            assert states_equal(reader.restore(step=s, rank=r), make_state(s, r, big_elems=4096))
    saved = catalog.load_checkpoint(
        CheckpointManager(Path(base) / "node1", read_only=True).storage, 3
    )
    there = catalog.load_checkpoint(reader.storage, 3)
    mine = {f.path.rsplit("/", 1)[-1]: f.checksum for f in there.files}
    assert all(mine[f.path.rsplit("/", 1)[-1]] == f.checksum for f in saved.files)
    # So `verify NODE --tier PERSISTENT` verifies it as a replica on every node (it said
    # "ANOTHER COPY" and exited 1: a node's copy holds its own ranks' files only).
    tier_opts = [
        a
        for k, v in (opts or {}).items()
        for a in ("--tier-storage-option", f"{k}={json.dumps(v)}")
    ]
    for r in range(WORLD):
        proc = run_cli("verify", Path(base) / f"node{r}", "3", "--tier", slow, *tier_opts)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "verified on tier(s) 0,1" in proc.stdout, proc.stdout

    # Node 1 is replaced: its local tier is empty. Every rank agrees on step 3; ranks 0
    # and 2 load it from their own disks, rank 1 from the persistent tier; all exact.
    shutil.rmtree(Path(base) / "node1")
    second = ok_values(
        run_ranks(workers.w_tiered, WORLD, base, slow, opts, [4], tmp_dir=str(tmp_path))
    )
    assert all(v["latest"] == (3, (1,)) for v in second)
    assert all(v["restored_ok"] and v["restored"] == (3, (0, 1)) for v in second)
    # Tier 0 lacks step 3 on node 1, the job does not: no "the job starts from scratch"
    # (which alarmed operators of restarts that resumed).
    assert not [w for v in second for w in v["warned"] if "from scratch" in w], second
    assert len({v["run_id"] for v in second} | {first[0]["run_id"]}) == 1
    # Step 4 replicated; tier 0's next rotation dropped the replicated steps (tier
    # 1's own rotation may still run: close() waits for it, checked below).
    assert all(v["replicated"] and v["listed"][-1] == (4, (0, 1)) for v in second), second
    assert all(t == (1,) for v in second for _s, t in v["listed"][:-1])
    assert len({tuple(v["listed"]) for v in second}) == 1
    assert [c.step for c in reader.checkpoints()] == [2, 3, 4]
    for r in range(WORLD):
        assert states_equal(reader.restore(step=4, rank=r), make_state(4, r, big_elems=4096))
    assert os.path.isdir(Path(base) / "node1" / checkpoint_name(4))

    # Node 2's copy of step 4 rots (one byte, same size): rank 2's checksum fails while
    # it reads, it reads its file from the persistent tier instead, and every rank
    # still restores step 4, exactly.
    m = catalog.load_checkpoint(CheckpointManager(Path(base) / "node2", read_only=True).storage, 4)
    data = Path(base) / "node2" / checkpoint_name(4) / m.files[0].path
    raw = bytearray(data.read_bytes())
    raw[-50] ^= 0xFF
    data.write_bytes(bytes(raw))
    third = ok_values(
        run_ranks(workers.w_tiered, WORLD, base, slow, opts, [], tmp_dir=str(tmp_path))
    )
    assert all(v["restored_ok"] and v["restored"] == (4, (0, 1)) for v in third)


def test_a_smaller_job_refuses_per_rank_state_of_a_larger_one_on_every_rank(tmp_path):
    """Each rank reads its own file by rank number: a 2-rank job restoring a 3-rank
    job's checkpoint loaded ranks 0 and 1's states and dropped rank 2's, without a
    word, from tier 0 and from tier 1 alike. The plain manager refused it already."""
    base, slow = str(tmp_path / "nodes"), str(tmp_path / "persistent")
    ok_values(run_ranks(workers.w_tiered, WORLD, base, slow, None, [1, 2], tmp_dir=str(tmp_path)))
    got = ok_values(
        run_ranks(workers.w_tiered_restore_outcome, 2, base, slow, None, tmp_dir=str(tmp_path))
    )
    assert len(set(got)) == 1, got  # the same error on every rank
    kind, msg = got[0]
    assert kind == "CheckpointError", got
    assert "per-rank state of 3 rank(s) but this job has 2" in msg
    # The same world size still restores.
    again = ok_values(
        run_ranks(workers.w_tiered_restore_outcome, WORLD, base, slow, None, tmp_dir=str(tmp_path))
    )
    assert again == [("ok", "2")] * WORLD
    # rank= (another rank's part, for one process) was ignored: each rank got its own.
    other = ok_values(
        run_ranks(
            workers.w_tiered_restore_outcome, WORLD, base, slow, None, 0, tmp_dir=str(tmp_path)
        )
    )
    assert {kind for kind, _m in other} == {"ValueError"}, other
    assert all("each rank restores its own" in m and slow in m for _k, m in other), other


def test_a_job_that_grows_back_resumes_from_the_newest_step_every_rank_can_load(tmp_path):
    """3 nodes save step 1; the job shrinks to 2 nodes and saves step 2; the 3 nodes
    again: step 2 holds 2 ranks' files only. restore() raised on it at every start
    (each rank loaded the newest step on some tier, whatever its shape); it loads step
    1, says why, and after rollback(1) the job saves on."""
    base, slow = str(tmp_path / "nodes"), str(tmp_path / "persistent")

    def job(world: int, save: int | None) -> list[dict[str, Any]]:
        return ok_values(
            run_ranks(
                workers.w_tiered_resized, world, base, slow, None, save, tmp_dir=str(tmp_path)
            )
        )

    assert all(v["replicated"] for v in job(WORLD, 1) + job(2, 2))
    regrown = job(WORLD, None)
    assert all("error" not in v for v in regrown), regrown
    assert all(v["restored"] == 1 and v["restored_ok"] for v in regrown), regrown
    assert any("saved by a job of 2 rank(s)" in w for w in regrown[0]["warned"]), regrown[0]
    assert all(v["replicated"] and v["listed"] == [1, 2] for v in regrown), regrown


def test_a_node_leader_killed_mid_upload_loses_nothing_and_the_restart_replicates(tmp_path):
    slow = str(tmp_path / "persistent")
    base = str(tmp_path / "nodes")
    # Rank 1 (node 1's leader) is SIGKILLed while it uploads its file of step 2.
    crashed = run_ranks(
        workers.w_tiered,
        WORLD,
        base,
        slow,
        None,
        [1, 2, 3],
        5.0,
        tmp_dir=str(tmp_path),
        faults="mid_replicate@1=kill:2",
        timeout_s=40,
    )
    assert crashed[1].killed
    assert not any(r.ok for r in crashed)
    # Tier 1 never shows step 2: its manifest is published only after every node's
    # upload verified. Every node still holds it (never deleted before replicated).
    reader = CheckpointManager(slow, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1]
    on_nodes = [
        {c.step for c in CheckpointManager(Path(base) / f"node{r}", read_only=True).checkpoints()}
        for r in range(WORLD)
    ]
    committed = set.intersection(*on_nodes)
    # Step 2 never reached tier 1: every node holds it. Step 1 did, so tier 0's
    # KeepLast(1) may have dropped it already.
    assert 2 in committed

    # Restart on the same nodes: every step committed everywhere reaches tier 1.
    again = ok_values(
        run_ranks(workers.w_tiered, WORLD, base, slow, None, [], tmp_dir=str(tmp_path))
    )
    newest = max(committed)
    assert all(v["replicated"] and v["left"] == [] for v in again)
    assert all(v["restored_ok"] and v["restored"] == (newest, (0,)) for v in again)
    assert [c.step for c in reader.checkpoints()] == sorted(committed | {1})
    for s in sorted(committed):
        catalog.load_checkpoint(reader.storage, s, full=True)
        for r in range(WORLD):
            assert states_equal(reader.restore(step=s, rank=r), make_state(s, r, big_elems=4096))


@pytest.mark.netfs
def test_saves_go_on_while_s3_is_unreachable_and_every_rank_catches_up(tmp_path, s3_tiers):
    base, url, opts = s3_tiers.base, s3_tiers.url, s3_tiers.opts
    ok_values(run_ranks(workers.w_tiered, WORLD, base, url, opts, [1], tmp_dir=str(tmp_path)))
    # Every request fails with 503 until rank 0 says every rank saw its steps held.
    until = tmp_path / "link-is-back"
    values = s3_tiers.run_ranks_while_down(workers.w_tiered_cut, WORLD, until=until, timeout_s=120)
    assert all(v["tried"] and v["waiting"] is False for v in values)
    assert all(v["held"] == [1, 2, 3] and 3 in v["backlog"] for v in values)
    assert all(v["replicated"] and v["left"] == [] for v in values)
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 2, 3]
    for s in (2, 3):
        catalog.load_checkpoint(reader.storage, s, full=True)
        for r in range(WORLD):
            assert states_equal(reader.restore(step=s, rank=r), make_state(s, r, big_elems=4096))


def test_close_keeps_its_timeout_on_every_rank_while_s3_holds_every_request(tmp_path, s3_tiers):
    # A preempted job's close(timeout_s=guard.time_left_s): with the persistent tier
    # silent, each rank's close waited for its replicator up to the manager's timeout_s
    # on top of its own (23 s for close(timeout_s=3) with timeout_s=20; 600 s more by
    # default), past the scheduler's SIGKILL.
    values = s3_tiers.run_ranks_while_held(
        workers.w_close_within_its_timeout, WORLD, tmp_path / "silent-from-now-on"
    )
    assert all(v["replicated"] for v in values)
    assert all(v["took"] < 3 + 4 for v in values), [v["took"] for v in values]
    assert all(v["left"] == [2] for v in values), values


def test_a_full_local_disk_fails_the_save_on_every_rank_and_loses_nothing(tmp_path, small_disk):
    # Node 1's tier 0 is a real 8 MiB tmpfs that fills up between two saves: the save
    # of step 2 fails on every rank with the same error naming node 1's disk, nothing
    # of it is committed anywhere, step 1 stays restorable on both tiers, and once the
    # space is back step 3 saves and replicates as usual.
    disk = small_disk(8, "tmpfs")
    node1 = str(Path(disk.path) / "node1")
    filler = str(Path(disk.path) / "filler")
    slow = str(tmp_path / "persistent")
    base = str(tmp_path / "nodes")
    values = ok_values(
        run_ranks(
            workers.w_tiered_disk_full,
            WORLD,
            base,
            slow,
            None,
            node1,
            filler,
            tmp_dir=str(tmp_path),
            timeout_s=120,
        )
    )
    assert all(v["replicated1"] and v["replicated"] and v["left"] == [] for v in values)
    errors = [v["saved"][2] for v in values]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert "rank 1" in errors[0][1] and "No space left" in errors[0][1], errors[0]
    assert errors[0][2], f"not catchable as StorageFullError: {errors[0]}"
    assert all(v["saved"][3] is None for v in values)
    assert all([s for s, _t in v["listed"]] == [1, 3] for v in values), values
    reader = CheckpointManager(slow, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 3]
    for s in (1, 3):
        for r in range(WORLD):
            assert states_equal(reader.restore(step=s, rank=r), make_state(s, r, big_elems=4096))
    for r in range(WORLD):
        where = node1 if r == 1 else str(Path(base) / f"node{r}")
        assert not os.path.exists(os.path.join(where, checkpoint_name(2)))
        assert values[r]["tier0"] == [3]


@pytest.mark.netfs
@pytest.mark.parametrize("replaced", [False, True])
def test_drain_with_one_process_per_node_finishes_a_multi_node_jobs_replication(
    tmp_path, s3_tiers, replaced
):
    # A job of 4 ranks on 2 nodes ends while S3 is unreachable: steps 1-3 exist only as
    # the two nodes' tier 0 copies, each holding its own 2 ranks' files. Neither copy
    # alone can be published; `atomic-checkpoint drain` run on both nodes at once under
    # torchrun (--nnodes 2 --nproc-per-node 1: one process per node) can.
    base, url, opts = s3_tiers.base, s3_tiers.url, s3_tiers.opts
    # Every request fails with 503 once every rank has opened the tiers.
    job = s3_tiers.run_ranks_while_down(
        workers.w_two_per_node_cut, 4, once=tmp_path / "tiers-opened", timeout_s=120
    )
    assert [v["domain"] for v in job] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert all(v["left"] == [1, 2, 3] for v in job)
    # One node alone is refused: its copy lacks the other node's ranks.
    to_opts = storage_option_args(opts)
    alone = run_cli("drain", f"{base}/node0", "--to", url, *to_opts, "--timeout", "20")
    assert alone.returncode == 1 and "one node's copy of a 2-node save" in alone.stderr
    if replaced:
        # Node 1's disk was replaced since: its copy of step 3 is gone. Drain said
        # "0 failed, 0 left", exit 0, while step 3 stayed on node 0 only.
        shutil.rmtree(f"{base}/node1/{checkpoint_name(3)}")
    # Two nodes, each one torchrun with one process (static rendezvous on loopback).
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={n}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "atomic_checkpoint",
                "drain",
                f"{base}/node{n}",
                "--to",
                url,
                *to_opts,
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, HOST_ENV: f"node{n}", "OMP_NUM_THREADS": "1"},
            start_new_session=True,  # its own process group: killed whole on timeout
        )
        for n in (0, 1)
    ]
    outs = wait_nodes(nodes, timeout_s=150)
    docs = [json.loads(out[out.index("{") :]) for out, _ in outs]
    steps = [1, 2] if replaced else [1, 2, 3]
    if replaced:
        assert [p.returncode for p in nodes] == [1, 0], outs
        assert [f["step"] for f in docs[0]["failed"]] == [3], docs[0]
        assert "not on every node's tier 0" in docs[0]["failed"][0]["problem"], docs[0]
    else:
        assert [p.returncode for p in nodes] == [0, 0], outs
        assert all(d["ok"] and d["left"] == [] for d in docs), docs
    assert [d["root"] for d in docs] == [f"{base}/node0", f"{base}/node1"]
    # Every node reports the steps replicated (node 1 said none: tier 1's commits are
    # rank 0's, and a script reading node 1's report concluded nothing was drained).
    assert all([r["step"] for r in d["replicated"]] == steps for d in docs), docs
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == steps
    for s in steps:
        catalog.load_checkpoint(reader.storage, s, full=True)
        for r in range(4):
            assert states_equal(reader.restore(step=s, rank=r), make_state(s, r, big_elems=4096))


def _persistent_tier_holds_steps_1_and_2(s3_tiers: S3Tiers) -> None:
    """Steps 1 and 2 of a 2-rank job, and no other, are on the persistent tier, and
    each rank's state of step 2 restores from it exactly."""
    reader = CheckpointManager(s3_tiers.url, storage_options=s3_tiers.opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 2]
    for r in range(2):
        assert states_equal(reader.restore(step=2, rank=r), make_state(2, r, big_elems=4096))


@pytest.mark.netfs
def test_a_persistent_tier_that_stalls_past_timeout_s_is_a_slow_round_not_a_dead_rank(
    tmp_path, s3_tiers
):
    # Every request to the persistent tier is held 8 s, twice timeout_s, for a while.
    # The replicators waited for the stalled rank at the round's next exchange, timed
    # out after timeout_s, took it for dead and stopped replication for the rest of the
    # job. Now they meet while it works: the round waits, the stall is reported in
    # last_replication_error, and step 2 reaches the persistent tier on every rank.
    values = s3_tiers.run_ranks_while_held(
        workers.w_tier1_stalls, 2, tmp_path / "slow-from-now-on", delay_s=8
    )
    assert all(v["first"] is True for v in values), values
    assert any("has waited" in v["during"] for v in values), values
    assert all(v["caught_up"] is True for v in values), values
    assert all(v["after"] == "None" and v["backlog"] == [] for v in values), values
    assert all(v["left"] == [] for v in values), values
    _persistent_tier_holds_steps_1_and_2(s3_tiers)


@pytest.mark.netfs
def test_a_rollback_every_rank_gave_up_on_loses_nothing_when_the_persistent_tier_answers_late(
    tmp_path, s3_tiers
):
    # S3 stalls during rollback(1): every rank's call gives up after timeout_s and says
    # nothing was rolled back. Tier 0 keeps the newest step only (3); the persistent
    # tier holds 1-3. The held request landed later, and rank 0's replicator rolled the
    # persistent tier back then, removing steps 2 and 3: step 2, which the user then
    # kept (rollback(2)), was on no tier, while wait_replicated() and close() said all
    # was replicated (before that, the round also forgot step 3 on every rank, leaving
    # it on the node-local tiers only). Now a meeting of the round hears that the
    # callers gave up, rank 0 removes nothing more from the persistent tier, and the
    # ranks agree to replicate again whatever it had removed.
    values = s3_tiers.run_ranks_while_held(
        workers.w_rollback_late, 2, tmp_path / "held-from-now-on", delay_s=8
    )
    for v in values:
        assert "was not rolled back" in v.pop("first"), values
    # Every rank alike: the first rollback removed nothing from tier 0, the second only
    # step 3, and the persistent tier caught up with what tier 0 holds.
    rank_saw = {
        "replicated": True,
        "tier0_after_first": [3],
        "removed": [3],
        "caught_up": True,
        "backlog": [],
        "left": [],
    }
    assert values == [rank_saw, rank_saw], values
    _persistent_tier_holds_steps_1_and_2(s3_tiers)


@pytest.mark.netfs
def test_ranks_that_close_one_by_one_while_s3_fails_stop_replicating_together(tmp_path, s3_tiers):
    # Once the tiers are open, the persistent tier answers 503 to everything, so the 3
    # ranks' replicators retry their rounds in lockstep. Rank 0 closes at once, the
    # others 3 s later: every replicator stops at the start of its next round, agreed,
    # instead of ranks 1 and 2 waiting in a round that rank 0 left until the exchange
    # times out (30 s here).
    down = tmp_path / "s3-is-down"
    job = s3_tiers.run_ranks_while_down(
        workers.w_close_one_by_one, WORLD, 3.0, once=down, timeout_s=150
    )
    assert all(v["left"] == [1] for v in job), job
    assert all(v["fatal"] == "None" for v in job), job  # no exchange timed out
    # Rank 0's replicator stopped the others' at their next round: by the time they
    # close, replication has ended (before, ranks 1 and 2 waited about 30 s here).
    assert all(v["close_s"] < 10 for v in job), job
    for n in range(WORLD):
        kept = CheckpointManager(tmp_path / "nodes" / f"node{n}", read_only=True)
        assert [c.step for c in kept.checkpoints()] == [1]  # held on tier 0


def wait_nodes(nodes: list[subprocess.Popen[str]], timeout_s: float) -> list[tuple[str, str]]:
    """Every node's (stdout, stderr). A node that fails makes torchrun on the others wait
    at its exit barrier: on timeout the test fails with what each node printed (the
    first failure is in one of them)."""
    outs, late = read_all(nodes, timeout_s)
    if late:
        shown = "\n".join(
            f"--- node {i} (rc {p.returncode}{', killed' if i in late else ''}) ---\n"
            f"{outs[i][0][-3000:]}\n{outs[i][1][-6000:]}"
            for i, p in enumerate(nodes)
        )
        pytest.fail(f"nodes {late} did not exit within {timeout_s:g} s:\n{shown}")
    return outs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_restore_reads_a_handful_of_tier_1_manifests_however_many_it_keeps(tmp_path):
    """Tier 1 keeps 24 steps. ``latest()`` and ``restore()`` read its manifests newest
    first, down to the newest step every rank can load: a process restart reads none
    past the newest, a wiped node one. Below that, only a fallback reads on: with rank
    1's file of the newest step rotten on tier 1, the restore falls back to the step
    before it, which only tier 1 holds, and restores it exactly."""
    slow, base = tmp_path / "persistent", tmp_path / "nodes"
    args = (str(base), str(slow), None)
    n = 24
    saved = ok_values(run_ranks(workers.w_counted_restore, WORLD, *args, n, tmp_dir=str(tmp_path)))
    assert all(v["replicated"] for v in saved), saved

    restart = ok_values(
        run_ranks(workers.w_counted_restore, WORLD, *args, 0, tmp_dir=str(tmp_path))
    )
    assert all(v["restored_ok"] and v["restored"] == (n, (0,)) for v in restart), restart
    assert restart[0]["latest"] == (n, (0, 1)), restart[0]
    # The newest step's manifest on tier 1 (is it there?), nothing older.
    assert restart[0]["latest_reads"] <= 2 and restart[0]["restore_reads"] <= 2, restart[0]

    shutil.rmtree(base / "node1")
    wiped = ok_values(run_ranks(workers.w_counted_restore, WORLD, *args, 0, tmp_dir=str(tmp_path)))
    assert all(v["restored_ok"] and v["restored"] == (n, (0, 1)) for v in wiped), wiped
    assert wiped[0]["latest_reads"] <= 2 and wiped[0]["restore_reads"] <= 2, wiped[0]

    shutil.rmtree(base / "node1")
    rotten = next((slow / checkpoint_name(n)).rglob(rank_state_file(1)))
    raw = bytearray(rotten.read_bytes())
    raw[-20] ^= 0xFF
    rotten.write_bytes(bytes(raw))
    fell = ok_values(run_ranks(workers.w_counted_restore, WORLD, *args, 0, tmp_dir=str(tmp_path)))
    assert all(v["restored_ok"] and v["restored"] == (n - 1, (1,)) for v in fell), fell
    assert any(f"step {n}" in w and "trying the next copy" in w for w in fell[1]["warnings"])
    # Only the fallback read the rest of tier 1 (a full listing: every manifest).
    assert fell[0]["latest_reads"] <= 2 and fell[0]["restore_reads"] >= n, fell[0]
