"""Peer replicas in real 3-rank gloo jobs (every rank its own "node" with its own local
directory as tier 0): each node's files of every step also go to the next node's tier
0 (``peers=1``, over a gloo group of their own), verified and committed there; a node
whose local tier was wiped restores from a peer's copy, bit-exactly, even while the
persistent tier cannot be reached; a corrupt peer copy is rejected."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from tests.dist.launcher import RankResult, ok_values, run_ranks
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import Rule, S3Proxy
from tests.tiered import workers

from atomic_checkpoint import CheckpointManager, catalog
from atomic_checkpoint.layout import MANIFEST_NAME, checkpoint_name, rank_state_file

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]
WORLD = 3


def _peer_copy(base: Path, holder: int, node: int, step: int) -> Path:
    return base / f"node{holder}" / ".peers" / f"node-{node}" / checkpoint_name(step)


def _rank_file(copy: Path, rank: int) -> Path:
    return next(p for p in copy.rglob(rank_state_file(rank)))


def test_a_wiped_node_restores_from_a_peer_and_a_corrupt_peer_copy_is_rejected(tmp_path):
    slow = tmp_path / "persistent"
    base = tmp_path / "nodes"
    # Steps 1 and 2 reach the persistent tier, then step 3 is saved: tier 0's
    # KeepLast(1) drops steps 1 and 2 (replicated), and their peer copies go with them.
    first = ok_values(
        run_ranks(
            workers.w_peers,
            WORLD,
            str(base),
            str(slow),
            None,
            1,
            [1, 2],
            [3],
            tmp_dir=str(tmp_path),
        )
    )
    assert all(v["replicated"] and v["peered"] and v["peered_held"] for v in first), first
    assert all(v["recoverable"] == [1, 2, 3] and v["left"] == [] for v in first), first
    # Two nodes hold each rank's file of step 3 (its own and the next one).
    assert all(v["listed"][-1][0] == 3 and v["listed"][-1][2] == 2 for v in first), first
    # Ring order: node n's files on node n+1, byte for byte, beside their manifest.
    for node in range(WORLD):
        holder = (node + 1) % WORLD
        copy = _peer_copy(base, holder, node, 3)
        own = base / f"node{node}" / checkpoint_name(3)
        assert _rank_file(copy, node).read_bytes() == _rank_file(own, node).read_bytes()
        assert (copy / "checkpoint.manifest.json").read_bytes() == (
            own / "checkpoint.manifest.json"
        ).read_bytes()
        for old in (1, 2):
            assert not (base / f"node{node}" / checkpoint_name(old)).exists()
            assert not _peer_copy(base, holder, node, old).exists()
        # Each node holds its own files and one other node's, nothing more.
        assert sorted(p.name for p in (base / f"node{holder}" / ".peers").iterdir()) == [
            f"node-{node}"
        ]

    # Node 1 is replaced and the persistent tier is gone (moved away): only node 2's
    # peer copy holds rank 1's file (one node: copies 1). Every rank agrees on step 3;
    # rank 1's file comes over from node 2, verified, and restores exactly.
    shutil.rmtree(base / "node1")
    moved = tmp_path / "persistent-away"
    slow.rename(moved)
    second = ok_values(
        run_ranks(workers.w_peers, WORLD, str(base), str(slow), None, 1, [], tmp_dir=str(tmp_path))
    )
    assert all(v["latest"] == (3, (0,)) and v["copies"] == 1 for v in second), second
    assert all(v["restored_ok"] and v["restored"] == (3, (0,), (1,)) for v in second), second
    fetched = _rank_file(_peer_copy(base, 1, 1, 3), 1).read_bytes()
    assert fetched == _rank_file(_peer_copy(base, 2, 1, 3), 1).read_bytes()

    # Node 1 is wiped again and node 2's copy of its files rots (one byte, same size):
    # rank 1 rejects what node 2 sends (checksum of the save) and reads its file from
    # the persistent tier, back in place; still exact, and nothing of the bad copy stays.
    shutil.rmtree(base / "node1")
    shutil.rmtree(slow, ignore_errors=True)
    moved.rename(slow)
    rotten = _rank_file(_peer_copy(base, 2, 1, 3), 1)
    raw = bytearray(rotten.read_bytes())
    raw[-50] ^= 0xFF
    rotten.write_bytes(bytes(raw))
    third = ok_values(
        run_ranks(workers.w_peers, WORLD, str(base), str(slow), None, 1, [], tmp_dir=str(tmp_path))
    )
    assert all(v["restored_ok"] and v["restored"] == (3, (0, 1), ()) for v in third), third
    # Rank 1 learns of the rejection in the fetch round and says so; no rank tries to
    # load the rejected copy (which would fail and fall back with a warning of its own).
    assert any("peer copy of step 3 from rank 2 is rejected" in w for w in third[1]["warnings"])
    for v in third:
        assert not any("trying the next copy" in w for w in v["warnings"]), v["warnings"]
    assert not _peer_copy(base, 1, 1, 3).exists()
    assert not list((base / "node1" / ".peers" / "node-1").glob(".incoming-*"))
    # .peers/ is the library's own, like .pending/: not a foreign entry of the root.
    from tests.cli.helpers import run_json

    listed = run_json("list", base / "node2")
    assert (base / "node2" / ".peers").is_dir()
    assert not [e for e in listed["entries"] if e["name"].startswith(".peers")], listed


def test_ranks_holding_their_own_file_load_it_while_the_peer_fetch_runs(tmp_path):
    """A node that holds its files need not wait for another node's fetch to load them:
    the sender of node 1's files loads its own during the transfer. (On the base, the
    sender's wait for its own load timed out: loads came after the fetch.)"""
    slow, base = tmp_path / "persistent", tmp_path / "nodes"
    args = (str(base), str(slow), None)
    first = ok_values(run_ranks(workers.w_peers, WORLD, *args, 1, [1], tmp_dir=str(tmp_path)))
    assert all(v["replicated"] and v["peered"] for v in first), first
    shutil.rmtree(base / "node1")
    got = ok_values(run_ranks(workers.w_overlapped_restore, WORLD, *args, tmp_dir=str(tmp_path)))
    assert all(v["restored_ok"] and v["restored"] == (1, (0,), (1,)) for v in got), got
    assert got[2]["loaded_before_send"], got[2]
    assert got[0]["waited"] == [] and got[1]["waited"] == [], got


@pytest.mark.netfs
@pytest.mark.timeout(300)
def test_a_wiped_node_restores_from_a_peer_while_s3_answers_503(tmp_path, s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    base = tmp_path / "nodes"
    flag = tmp_path / "s3-is-down"
    with S3Proxy(s3_server, lifetime_s=150) as proxy:
        down = proxy.add(Rule("error", status=503, times=None, when=lambda _r: flag.exists()))
        opts = proxy.storage_options(max_attempts=1)

        def job(steps: list[int], held: list[int]) -> list[RankResult]:
            # One run of the 3-node job on S3 through the proxy (down while flag exists).
            return run_ranks(
                workers.w_peers,
                WORLD,
                str(base),
                url,
                opts,
                1,
                steps,
                held,
                str(flag),
                tmp_dir=str(tmp_path),
                timeout_s=120,
            )

        # Step 1 reaches S3; then S3 answers 503 to everything: steps 2 and 3 exist on
        # the nodes' tier 0 and their peers only.
        first = ok_values(job([1], [2, 3]))
        assert all(v["replicated"] and v["peered"] and v["peered_held"] for v in first), first
        assert all(v["recoverable"] == [1, 2, 3] and 3 in v["left"] for v in first), first
        assert down.fired > 0
        reader = CheckpointManager(url, storage_options=s3_server.storage_options(), read_only=True)
        assert [c.step for c in reader.checkpoints()] == [1]

        # Node 1 is replaced, S3 still answers 503: rank 1 gets its file of step 3
        # from node 2 and every rank restores step 3, bit-exactly.
        shutil.rmtree(base / "node1")
        fired = down.fired
        second = ok_values(job([], []))
        assert down.fired > fired  # the persistent tier was asked, and failed
        assert all(v["latest"] == (3, (0,)) for v in second), second
        assert all(v["restored_ok"] and v["restored"] == (3, (0,), (1,)) for v in second)
        m = catalog.load_checkpoint(CheckpointManager(base / "node2", read_only=True).storage, 3)
        assert m.domain_ranks == (2,)

        # The same while S3 takes every request and never answers: each read of tier 1
        # is bounded within half the ranks' timeout_s, so the wiped node still restores
        # from its peer (every rank's start failed: the wiped rank, reading tier 1 for
        # the run id as long as the others waited for it, arrived after they gave up).
        proxy.remove(down)
        hung = proxy.add(Rule("delay", times=None, when=lambda _r: flag.exists()))
        shutil.rmtree(base / "node1")
        still = ok_values(job([], []))
        assert hung.fired > 0
        assert all(v["restored_ok"] and v["restored"] == (3, (0,), (1,)) for v in still), still
        hung.release.set()
        proxy.remove(hung)
        down = proxy.add(Rule("error", status=503, times=None, when=lambda _r: flag.exists()))

        # Node 1 wiped again and node 2's copy of its files lost too: no rank can tell
        # whether a checkpoint exists (S3 does not answer), so every rank raises rather
        # than start the run over.
        shutil.rmtree(base / "node1")
        shutil.rmtree(base / "node2" / ".peers")
        third = job([], [])
    assert not any(r.ok for r in third)
    assert all("cannot be read" in r.error_text for r in third), [r.error_text for r in third]


def test_peers_zero_changes_nothing(tmp_path):
    slow = tmp_path / "persistent"
    base = tmp_path / "nodes"
    first = ok_values(
        run_ranks(
            workers.w_peers, WORLD, str(base), str(slow), None, 0, [1, 2], tmp_dir=str(tmp_path)
        )
    )
    assert all(v["replicated"] and v["recoverable"] == [] for v in first)
    # Step 1 may be gone from tier 0 already (KeepLast(1), replicated before step 2).
    # Each node holds its own ranks' files: one node copy (0 once tier 0 dropped it).
    assert all(v["listed"][1:] == [(2, (0, 1), 1)] for v in first), first
    assert all(v["listed"][0] in ((1, (0, 1), 1), (1, (1,), 0)) for v in first), first
    assert not any((base / f"node{r}" / ".peers").exists() for r in range(WORLD))
    # A wiped node reads its file from the persistent tier, as before.
    shutil.rmtree(base / "node1")
    second = ok_values(
        run_ranks(workers.w_peers, WORLD, str(base), str(slow), None, 0, [], tmp_dir=str(tmp_path))
    )
    assert all(v["latest"] == (2, (1,)) for v in second), second
    assert all(v["restored_ok"] and v["restored"] == (2, (0, 1), ()) for v in second), second


def test_a_restarted_job_gives_the_steps_saved_before_it_their_peer_copies(tmp_path):
    # Steps 1 and 2 were saved by a run without peer replicas (or whose peer rounds
    # never ran: a crash right after the save). The restart with peers=1 finds step 2
    # on every node but on no peer and sends it round the ring, so the job is again
    # recoverable without the persistent tier; a wiped node then restores from a peer.
    slow = tmp_path / "persistent"
    base = tmp_path / "nodes"
    args = (str(base), str(slow), None)
    first = ok_values(run_ranks(workers.w_peers, WORLD, *args, 0, [1, 2], tmp_dir=str(tmp_path)))
    assert all(v["replicated"] and v["recoverable"] == [] for v in first), first
    assert not any((base / f"node{n}" / ".peers").exists() for n in range(WORLD))

    again = ok_values(
        run_ranks(workers.w_peers, WORLD, *args, 1, [], [], None, True, tmp_dir=str(tmp_path))
    )
    assert all(v["restored"] == (2, (0,), ()) and v["restored_ok"] for v in again), again
    assert all(v["peered"] and v["recoverable"] == [2] for v in again), again
    for node in range(WORLD):
        copy = _peer_copy(base, (node + 1) % WORLD, node, 2)
        own = base / f"node{node}" / checkpoint_name(2)
        assert _rank_file(copy, node).read_bytes() == _rank_file(own, node).read_bytes()
    # A third start finds the copies complete: nothing is sent again.
    before = {p: p.stat().st_mtime_ns for p in base.glob("node*/.peers/*/checkpoint-2/*")}
    third = ok_values(
        run_ranks(workers.w_peers, WORLD, *args, 1, [], [], None, True, tmp_dir=str(tmp_path))
    )
    assert all(v["recoverable"] == [2] for v in third), third
    assert {p: p.stat().st_mtime_ns for p in base.glob("node*/.peers/*/checkpoint-2/*")} == before

    # Node 1 is replaced and the persistent tier is gone: rank 1's file of step 2 comes
    # from node 2's peer copy, and every rank restores exactly.
    shutil.rmtree(base / "node1")
    slow.rename(tmp_path / "persistent-away")
    fourth = ok_values(run_ranks(workers.w_peers, WORLD, *args, 1, [], tmp_dir=str(tmp_path)))
    assert all(v["restored_ok"] and v["restored"] == (2, (0,), (1,)) for v in fourth), fourth


def test_a_bug_in_one_replicator_ends_every_rank_s_wait_within_the_timeout(tmp_path):
    """An unexpected exception in rank 0's replicator thread (not a storage or
    coordination error) must not leave a dead thread that every wait then waits on until
    its own timeout: it stops replication with an error naming it, at once on rank 0 and
    within the exchange timeout (10 s here) on the other ranks."""
    base, slow = tmp_path / "nodes", tmp_path / "persistent"
    got = ok_values(
        run_ranks(
            workers.w_replicator_bug,
            WORLD,
            str(base),
            str(slow),
            tmp_dir=str(tmp_path),
            timeout_s=150,
        )
    )
    assert all(v["peered"] is False for v in got), got
    assert all(v["waited_s"] < 30 for v in got), got
    assert "ValueError: a bug in the sender" in got[0]["replicated"], got[0]
    assert all(isinstance(v["replicated"], str) for v in got), got
    # Said without waiting too: it stayed None once replication had stopped.
    assert "a bug in the sender" in got[0]["last_error"], got[0]
    assert all(v["last_error"] != "None" for v in got), got


def _node_1_replaced_while_s3_is_down(
    tmp_path: Path, s3_server: Any, url: str, *runs: tuple[Any, ...]
) -> list[list[dict[str, Any]]]:
    """A job saves step 1 (replicated), then 2 and 3 with S3 answering 503 (tier 0 and
    the peers only); node 1's tier 0 is wiped; then each of ``runs`` is a restart running
    ``w_peers`` with those arguments (its steps, held steps, "down" to keep S3 down or
    None to bring it back, ...). Every restart's values."""
    base = tmp_path / "nodes"
    flag = tmp_path / "s3-is-down"
    with S3Proxy(s3_server, lifetime_s=240) as proxy:
        proxy.add(Rule("error", status=503, times=None, when=lambda _r: flag.exists()))
        args = (str(base), url, proxy.storage_options(max_attempts=1), 1)
        first = ok_values(
            run_ranks(workers.w_peers, WORLD, *args, [1], [2, 3], str(flag), tmp_dir=str(tmp_path))
        )
        assert all(v["recoverable"] == [1, 2, 3] and 3 in v["left"] for v in first), first
        shutil.rmtree(base / "node1")
        out = []
        for then in runs:
            if then[2] is None:
                flag.unlink(missing_ok=True)
            else:
                then = (*then[:2], str(flag), *then[3:])
            out.append(
                ok_values(run_ranks(workers.w_peers, WORLD, *args, *then, tmp_dir=str(tmp_path)))
            )
        return out


def test_a_step_restored_from_a_peer_copy_is_replicated_to_the_persistent_tier(
    tmp_path, s3_server, s3_bucket
):
    # Steps 2 and 3 were on the nodes' tier 0 and their peers only (S3 down); node 1
    # was replaced. The restart restored step 3, node 1's files from node 2's peer copy,
    # but never replicated it: node 1's tier 0 lacks it, so the start's reconcile (steps
    # every node holds) left it out, wait_replicated() said True and close() returned [];
    # losing node 2 as well then lost step 3.
    url = f"s3://{s3_bucket}/run"
    (second,) = _node_1_replaced_while_s3_is_down(tmp_path, s3_server, url, ([], [], None, True))
    assert all(v["restored_ok"] and v["restored"] == (3, (0,), (1,)) for v in second), second
    assert all(v["replicated"] and v["left"] == [] for v in second), second
    reader = CheckpointManager(url, storage_options=s3_server.storage_options(), read_only=True)
    assert 3 in [c.step for c in reader.checkpoints()]
    reader.verify(3)


def test_peer_copies_go_on_while_the_persistent_tier_holds_every_request(
    tmp_path, s3_server, s3_bucket
):
    # The replicator ran each step's peer round before its tier 1 round; with the
    # persistent tier silent (requests held, not refused), the tier 1 round of step 1's
    # successor never ended, and no step saved meanwhile got peer copies: the
    # redundancy was missing exactly while the persistent tier could not be reached.
    url = f"s3://{s3_bucket}/run"
    flag = tmp_path / "s3-is-silent"
    with S3Proxy(s3_server, lifetime_s=150) as proxy:
        held = proxy.add(Rule("delay", times=None, when=lambda _r: flag.exists()))
        opts = proxy.storage_options(max_attempts=1)
        try:
            got = ok_values(
                run_ranks(
                    workers.w_peers,
                    WORLD,
                    str(tmp_path / "nodes"),
                    url,
                    opts,
                    1,
                    [1],
                    [2, 3],
                    str(flag),
                    False,
                    20.0,
                    3.0,  # step 2's tier 1 round has begun, and is held, when 3 is saved
                    tmp_dir=str(tmp_path),
                    timeout_s=150,
                )
            )
        finally:
            held.release.set()
    assert held.fired > 0  # the persistent tier was asked, and held
    assert all(v["replicated"] and v["peered_held"] for v in got), got
    assert all(v["recoverable"] == [1, 2, 3] for v in got), got


def test_a_replaced_node_does_not_make_the_others_delete_steps_tier_1_never_got(
    tmp_path, s3_server, s3_bucket
):
    # S3 down; steps 2 and 3 on every node's tier 0 and their peers only; node 1
    # replaced. The restart restored 3 and saved 4 (S3 still down). Once 4 was on every
    # node, the other nodes removed 2 and 3 as the leftovers of saves that failed half
    # way (not on every node), although tier 1 never got them: close() said they
    # "stay on tier 0", and losing another node then lost them for good.
    url = f"s3://{s3_bucket}/run"
    (second,) = _node_1_replaced_while_s3_is_down(tmp_path, s3_server, url, ([], [4], "down"))
    brief = [(v["restored"], v["peered_held"], v["left"], v["recoverable"]) for v in second]
    assert all(v["restored"] == (3, (0,), (1,)) and v["peered_held"] for v in second), brief
    assert all({3, 4} <= set(v["left"]) for v in second), brief
    base = tmp_path / "nodes"
    for node in (0, 2):  # what close() said stays there, does
        kept = [
            s
            for s in (2, 3, 4)
            if (base / f"node{node}" / checkpoint_name(s) / MANIFEST_NAME).exists()
        ]
        assert kept == [2, 3, 4], (node, sorted(p.name for p in (base / f"node{node}").iterdir()))


def test_a_step_restored_from_a_peer_copy_while_s3_was_down_is_replicated_at_the_next_start(
    tmp_path, s3_server, s3_bucket
):
    # The restart after node 1 was replaced restored step 3 from the peers with S3 still
    # down, and close() said 3 "stays on tier 0 and is replicated at the next start".
    # The next start, S3 back, queued only the steps every node's tier 0 holds; node 1
    # holds 3 only as the copy its restore committed under .peers/node-1/: never
    # replicated, while wait_replicated() said True and close() returned []. (That
    # start restores nothing: a restore from the peers queues the step by itself.)
    url = f"s3://{s3_bucket}/run"
    second, third = _node_1_replaced_while_s3_is_down(
        tmp_path, s3_server, url, ([], [], "down"), ([], [], None, True, 60.0, 0.0, False)
    )
    assert all(v["restored"] == (3, (0,), (1,)) and 3 in v["left"] for v in second), second
    assert all(v["replicated"] and v["left"] == [] for v in third), third
    reader = CheckpointManager(url, storage_options=s3_server.storage_options(), read_only=True)
    assert 3 in [c.step for c in reader.checkpoints()]
    reader.verify(3)


def test_ranks_with_other_peers_or_another_persistent_tier_are_refused_alike(tmp_path):
    # One node with peers=1 and the others without: its peer rounds never met theirs
    # (a raw store timeout); one node naming another persistent tier: rank 0's was
    # used silently. Every rank is refused at once, with each rank's settings.
    slow = str(tmp_path / "persistent")
    got = ok_values(
        run_ranks(
            workers.w_settings_differ, WORLD, str(tmp_path / "nodes"), slow, tmp_dir=str(tmp_path)
        )
    )
    assert all(v["error"] == "CollectiveMismatchError" for v in got), got
    assert len({v["message"] for v in got}) == 1, got
    assert "rank(s) [1]: " in got[0]["message"] and "peers=1" in got[0]["message"], got[0]
    assert f"{slow}-other" in got[0]["message"], got[0]
