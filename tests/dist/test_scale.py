"""Coordination that grows O(N) (issue 14), on one real TCPStore.

- The real commit path (``commit.save``) with ranks as threads, each with its own client
  connection, counted by ``benchmarks/scale.py``'s counting store: store requests, keys
  touched and bytes per save grow linearly with the number of ranks, and every rank
  but the leader makes the same few requests whatever the number of ranks. Counts are
  deterministic; nothing is timed.
- A round's failure is one answer: whoever gives up first names the missing rank, and
  a leader that arrives later learns it from the store at once rather than waiting out
  its own timeout; a leader that never answers is named by the others.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from benchmarks import scale

from atomic_checkpoint import CoordinationTimeoutError
from atomic_checkpoint.coordination import TorchDistributedCoordinator

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def test_store_operations_per_save_grow_linearly(tmp_path):
    rows = {
        n: scale.run_saves(n, 2, str(tmp_path / f"r{n}"), timeout_s=60, procs=0)
        for n in (1, 8, 16, 32)
    }
    for n, row in rows.items():
        assert row["deterministic"], (n, row["per_save"])
    assert rows[1]["requests"] == 0  # one rank coordinates nothing
    # Linear, exactly: equal steps in N add equal counts (N^2 would not).
    for what in ("requests", "keys"):
        step8 = rows[16][what] - rows[8][what]
        assert step8 > 0 and rows[32][what] - rows[16][what] == 2 * step8, (what, rows)
    # Bytes: linear within what the values hold (a rank number grows a digit).
    assert rows[32]["bytes"] <= 4 * rows[8]["bytes"] * 1.1, rows
    # The ranks other than the leader each make the same few requests, touch the same
    # few keys and read the same few bytes whatever N; the leader's requests are constant
    # too (its one wait and one read cover every rank's key).
    for what in ("max_other_requests", "max_other_keys", "leader_requests"):
        assert rows[8][what] == rows[16][what] == rows[32][what], (what, rows)
    assert rows[32]["max_other_bytes"] <= rows[8]["max_other_bytes"] * 1.1, rows
    assert rows[32]["leader_keys"] - rows[16]["leader_keys"] == 2 * (
        rows[16]["leader_keys"] - rows[8]["leader_keys"]
    )


def test_several_storage_domains_cost_linear_bytes_too(tmp_path):
    # Node-local disks: domains of 4 ranks, each committing its own copy. Each leader
    # needs its members' reports and each rank its own leader's answer; an all-gather
    # of them (every rank reading every value) grew the bytes as N^2 (41 KB, 144 KB,
    # 529 KB for 8, 16, 32 ranks).
    rows = {
        n: scale.run_saves(n, 2, str(tmp_path / f"r{n}"), timeout_s=60, procs=0, per_domain=4)
        for n in (8, 16, 32)
    }
    for n, row in rows.items():
        assert row["deterministic"], (n, row["per_save"])
        # Every domain committed its own copy of every save.
        assert sorted(p.name for p in (tmp_path / f"r{n}").iterdir()) == [
            f"node-{d}" for d in range(n // 4)
        ]
    # Twice the ranks, twice the bytes (within what rank numbers add); N^2 was 3.7x.
    assert rows[32]["bytes"] <= 2 * rows[16]["bytes"] * 1.1, rows
    for what in ("requests", "keys"):
        step8 = rows[16][what] - rows[8][what]
        assert step8 > 0 and rows[32][what] - rows[16][what] == 2 * step8, (what, rows)
    # No rank reads more as the job grows; the collecting leader's requests stay the same.
    assert rows[32]["max_other_bytes"] <= rows[8]["max_other_bytes"] * 1.1, rows
    assert rows[8]["leader_requests"] == rows[32]["leader_requests"], rows


def _clients(world: int, namespace: str) -> tuple[object, list[TorchDistributedCoordinator]]:
    """A TCPStore server and one client connection per rank, as in separate processes."""
    server, _, coords = _counted_clients(world, namespace)
    return server, list(coords)


def _counted_clients(
    world: int, namespace: str
) -> tuple[object, list[Any], tuple[TorchDistributedCoordinator, ...]]:
    """A TCPStore server and, per rank, a client counted by ``scale.CountingStore``
    (what goes through it) and a coordinator on it."""
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    stores = [
        scale.CountingStore(
            dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
        )
        for _ in range(world)
    ]
    coords = tuple(
        TorchDistributedCoordinator(s, rank=r, world_size=world, namespace=namespace)
        for r, s in enumerate(stores)
    )
    return server, stores, coords


def _bytes_used(counts: Any, c: TorchDistributedCoordinator, call: Any) -> tuple[Any, int]:
    """``call()``'s result and the bytes this rank's client moved for it, the deferred
    deletes of its rounds included."""
    before = counts.snapshot()["bytes"]
    got = call()
    c._worker.run(lambda: None, 10)
    return got, counts.snapshot()["bytes"] - before


def _most_read(out: dict[int, Any]) -> dict[str, int]:
    """Per measured call, the most bytes any rank but the collector (rank 0) read."""
    return {what: max(o["bytes"][what] for r, o in out.items() if r) for what in out[1]["bytes"]}


def _no_rank_reads_more_at_16_ranks_than_at_4(bytes_per_rank: Any) -> None:
    """Rank 0 collects; what matters is that no other rank reads more as N grows."""
    small, large = bytes_per_rank(4), bytes_per_rank(16)
    for what in small:
        assert large[what] <= small[what] * 1.2, (what, small, large)


def _thread_node() -> str:
    """``domains.current_host`` for ranks run by ``_as_nodes``: the thread's node."""
    return threading.current_thread().name.split("/")[0]


def _as_nodes(coords: tuple[TorchDistributedCoordinator, ...], job: Any, per_node: int) -> None:
    """``job(c)`` for every rank at once, a thread each, ``per_node`` ranks per node
    (rank r on ``node-<r // per_node>``, as ``_thread_node`` reports); bounded."""
    threads = [
        threading.Thread(target=job, args=(c,), name=f"node-{c.rank // per_node}/{c.rank}")
        for c in coords
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def _at_once(clients: tuple[TorchDistributedCoordinator, ...], call: Any) -> dict[int, Any]:
    """``call(c)`` for every client at the same time, a thread each (as ranks would):
    what each returned, by rank."""
    out: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda c=c: out.__setitem__(c.rank, call(c))) for c in clients
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def _raises(fn) -> CoordinationTimeoutError:
    with pytest.raises(CoordinationTimeoutError) as err:
        fn()
    return err.value


@pytest.mark.timeout(60)
def test_a_slow_round_costs_only_the_collecting_rank_more_requests(monkeypatch):
    # Past SLOW_ROUND_S the collecting rank announces its call (to find ranks in other
    # calls before timeout_s) and logs who is missing: a compare-set each, the rest of
    # its wait, and the delete of the call key. The many ranks waiting for its outcome
    # (a save's slow write round) make no more requests. Counted against the same
    # round made fast.
    import time

    from atomic_checkpoint import coordination

    monkeypatch.setattr(coordination, "SLOW_ROUND_S", 0.2)
    server, stores, coords = _counted_clients(4, "announce")

    def requests_of(late_s: float) -> tuple[list[int], dict[int, Any]]:
        before = [s.counts.snapshot()["requests"] for s in stores]

        def call(c: TorchDistributedCoordinator) -> Any:
            if c.rank == 3:
                time.sleep(late_s)
            got = c.all_gather("save step 1: write", c.rank * 10, timeout_s=20)
            c._worker.run(lambda: None, 10)  # the round's deferred deletes
            return got

        got = _at_once(coords, call)
        after = [s.counts.snapshot()["requests"] for s in stores]
        return [a - b for a, b in zip(after, before, strict=True)], got

    requests_of(0.0)  # from now on each round deletes the keys of the one before
    fast, got_fast = requests_of(0.0)
    slow, got_slow = requests_of(1.5)
    assert got_fast == got_slow == {r: [0, 10, 20, 30] for r in range(4)}
    # Rank 0: the announcement, the arrival list, the rest of its wait, the delete.
    assert [s - f for s, f in zip(slow, fast, strict=True)] == [4, 0, 0, 0], (fast, slow)
    assert not server.check(["announce/3/call"])  # the call key is gone


@pytest.mark.timeout(30)
def test_a_missing_rank_is_named_by_the_first_to_give_up_and_a_late_leader_learns_it():
    server, (lead, r1, r2, r3) = _clients(4, "missing")
    # Rank 3 never comes, the leader comes late. Ranks 1 and 2 give up after their own
    # timeout: whoever gives up first names both, and the other reads that.
    errors = _at_once(
        (r1, r2),
        lambda c: _raises(lambda: c.all_gather("save step 4: write", c.rank, timeout_s=0.3)),
    )
    assert sorted(errors) == [1, 2]
    assert {e.missing_ranks for e in errors.values()} == {(0, 3)}
    assert all("did not arrive" in str(e) and "3" in str(e) for e in errors.values())
    # The leader arrives afterwards with a long timeout: the give-up marks tell it at
    # once (this test's own 30 s limit would end a leader waiting out 600 s).
    late_lead = _raises(lambda: lead.all_gather("save step 4: write", 0, timeout_s=600))
    assert late_lead.missing_ranks == (0, 3) and "arrived at 'save step 4: write' after" in str(
        late_lead
    )
    # Rank 3 arriving now fails too, as the other one that was late.
    late = _raises(lambda: r3.all_gather("save step 4: write", 3, timeout_s=600))
    assert late.missing_ranks == (0, 3) and "arrived at 'save step 4: write' after" in str(late)
    del server


@pytest.mark.timeout(30)
def test_a_leader_that_never_answers_is_named_and_fails_when_it_comes_back():
    server, (lead, r1, r2) = _clients(3, "leader")
    errors = _at_once(
        (r1, r2),
        lambda c: _raises(
            lambda: c.gather_and_route(
                "save step 9: write", c.rank, dst=0, timeout_s=0.3, reduce=len
            )
        ),
    )
    assert sorted(errors) == [1, 2]
    assert all(e.missing_ranks == (0,) for e in errors.values())
    assert any("rank 0, which collects" in str(e) for e in errors.values())
    late = _raises(
        lambda: lead.gather_and_route("save step 9: write", 0, dst=0, timeout_s=600, reduce=len)
    )
    assert late.missing_ranks == (0,) and "after rank" in str(late)
    # The next round, everyone on time: the leader gets every value, the others only
    # the summary.
    out = _at_once(
        (lead, r1, r2),
        lambda c: c.gather_and_route("g", c.rank * 10, dst=0, timeout_s=10, reduce=sum),
    )
    assert out == {0: ([0, 10, 20], 30, None), 1: (None, 30, None), 2: (None, 30, None)}
    del server


@pytest.mark.timeout(30)
def test_routed_values_reach_only_their_rank_and_leave_no_keys_behind():
    server, coords = _clients(3, "routed")

    def tens(values: list[int]) -> dict[int, int]:
        return {r: v * 10 for r, v in enumerate(values) if r}

    def round_of(c: TorchDistributedCoordinator) -> Any:
        return c.gather_and_route(
            "r", c.rank + 1, dst=0, timeout_s=10, reduce=sum, route=tens, routed=c.rank > 0
        )

    out = _at_once(tuple(coords), round_of)
    assert out == {0: ([1, 2, 3], 6, None), 1: (None, 6, 20), 2: (None, 6, 30)}
    for c in coords:
        c._worker.run(lambda: None, 5)  # the deferred deletes have run
    # Each routed key was read by its rank alone, which deleted it; the round's outcome
    # key stays until the next round (whoever is slow may still read it).
    assert not any(server.check([coords[0]._routed_key(1, r)]) for r in (1, 2))
    assert server.check([f"{coords[0]._ns}/1/0"])
    # A rank that never arrives: nothing is routed, every rank that came names it.
    errors = _at_once(
        tuple(coords[:2]),
        lambda c: _raises(
            lambda: c.gather_and_route(
                "r2", c.rank, dst=0, timeout_s=0.3, reduce=sum, route=tens, routed=c.rank > 0
            )
        ),
    )
    assert {e.missing_ranks for e in errors.values()} == {(2,)}
    del server


@pytest.mark.timeout(90)
def test_restore_sends_each_rank_only_its_own_file_entries(tmp_path):
    # restore() resolves the manifest once, on the leader. Every other rank used to
    # receive all of it, N file entries each: O(N^2) bytes through the store per
    # restore. Now each receives its own entries: the bytes a rank reads stay the same
    # whatever N.
    import torch

    from atomic_checkpoint import CheckpointManager

    def restore_bytes(world: int) -> int:
        server, stores, coords = _counted_clients(world, f"restore{world}")
        root = tmp_path / f"world{world}"

        def job(c: TorchDistributedCoordinator) -> tuple[bool, int]:
            mgr = CheckpointManager(root, coordinator=c, storage_domains="shared", timeout_s=30)
            mine = {"w": torch.full((8,), float(c.rank))}
            mgr.save(1, mine)
            c._worker.run(lambda: None, 10)  # the save's deferred deletes are counted
            before = stores[c.rank].counts.snapshot()["bytes"]
            got = mgr.restore()
            c._worker.run(lambda: None, 10)
            used = stores[c.rank].counts.snapshot()["bytes"] - before
            mgr.close()
            return bool(torch.equal(got["w"], mine["w"])), used

        out = _at_once(coords, job)
        assert sorted(out) == list(range(world)), out
        assert all(ok for ok, _ in out.values()), out  # each rank restored its own state
        del server
        return max(used for r, (_, used) in out.items() if r)

    small, large = restore_bytes(4), restore_bytes(16)
    assert large <= small * 1.2, (small, large)


@pytest.mark.timeout(180)
def test_a_job_on_node_local_disks_costs_each_rank_the_same_bytes_whatever_n(tmp_path, monkeypatch):
    # Everything but the saves, with a storage domain per node: the start (finding the
    # domains, the leaders' views of their roots), checkpoints(), restore(), rollback()
    # and apply_retention(). Each used to be an all-gather: every rank read every
    # rank's host name and every leader's view or manifest list, so a rank's bytes grew
    # with N (an open of 16 ranks read 4x what one of 4 did). Now rank 0 collects and
    # each rank reads its own domain, its own leader's answer and one summary.
    import torch

    from atomic_checkpoint import CheckpointManager, KeepLast, domains

    # Ranks are threads here: each one's host is its thread's node.
    monkeypatch.setattr(domains, "current_host", _thread_node)
    per_node = 2

    def bytes_per_rank(world: int) -> dict[int, int]:
        server, stores, coords = _counted_clients(world, f"nodes{world}")
        out: dict[int, Any] = {}

        def job(c: TorchDistributedCoordinator) -> None:
            root = tmp_path / f"world{world}" / f"node-{c.rank // per_node}"
            counts = stores[c.rank].counts

            def used(call: Any) -> tuple[Any, int]:
                return _bytes_used(counts, c, call)

            mgr, opened = used(
                lambda: CheckpointManager(
                    root, coordinator=c, storage_domains="per-host", timeout_s=30
                )
            )
            mine = {"w": torch.full((4,), float(c.rank))}
            for step in (1, 2, 3):
                mgr.save(step, mine)
            listed, listing = used(mgr.checkpoints)
            got, restoring = used(mgr.restore)
            removed, rolling = used(lambda: mgr.rollback(2))
            mgr.retention = KeepLast(1)
            deleted, retaining = used(mgr.apply_retention)
            mgr.close()
            out[c.rank] = {
                "domains": mgr.domain.count,
                "listed": [i.step for i in listed],
                "restored": bool(torch.equal(got["w"], mine["w"])),
                "removed": removed,
                "deleted": deleted,
                "bytes": {
                    "open": opened,
                    "checkpoints": listing,
                    "restore": restoring,
                    "rollback": rolling,
                    "apply_retention": retaining,
                },
            }

        _as_nodes(coords, job, per_node)
        assert sorted(out) == list(range(world)), f"ranks that finished: {sorted(out)}"
        for r, o in out.items():
            assert o["domains"] == world // per_node, (r, o)
            assert o["listed"] == [1, 2, 3] and o["restored"], (r, o)
            assert o["removed"] == [3] and o["deleted"] == [1], (r, o)
        for d in range(world // per_node):
            node = tmp_path / f"world{world}" / f"node-{d}"
            assert sorted(p.name for p in node.glob("checkpoint-*")) == ["checkpoint-2"]
        del server
        return _most_read(out)

    _no_rank_reads_more_at_16_ranks_than_at_4(bytes_per_rank)


@pytest.mark.timeout(60)
def test_shared_failures_names_every_failing_rank_on_every_rank_at_constant_bytes():
    # The DCP and Accelerate integrations exchange failures around every framework
    # write and read: every rank gets the same list, naming each failing rank, and
    # reads one answer of the same size whatever the number of ranks.
    from atomic_checkpoint.coordination import shared_failures
    from atomic_checkpoint.errors import RankFailure

    def run(world: int) -> tuple[dict[int, Any], int]:
        server, stores, coords = _counted_clients(world, f"failures{world}")

        def call(c: TorchDistributedCoordinator) -> Any:
            failure = RankFailure(c.rank, "write", "OSError", "disk full") if c.rank == 2 else None
            before = stores[c.rank].counts.snapshot()["bytes"]
            got = shared_failures(c, "write", failure, timeout_s=20)
            c._worker.run(lambda: None, 10)
            return got, stores[c.rank].counts.snapshot()["bytes"] - before

        out = _at_once(coords, call)
        del server
        return {r: got for r, (got, _) in out.items()}, max(b for r, (_, b) in out.items() if r)

    (small, small_bytes), (large, large_bytes) = run(4), run(16)
    for world, answers in ((4, small), (16, large)):
        assert sorted(answers) == list(range(world))
        assert all(a == [RankFailure(2, "write", "OSError", "disk full")] for a in answers.values())
    assert large_bytes <= small_bytes * 1.2, (small_bytes, large_bytes)


def test_a_tiered_job_costs_each_rank_the_same_bytes_whatever_n(tmp_path, monkeypatch):
    # A tiered job with a tier 0 per node (2 ranks each) and a shared persistent tier:
    # saving and replicating a step (the replicators' rounds: what tier 1 lacks, the
    # plan, the nodes' copies, the outcome), then checkpoints() and restore(). Every
    # rank used to read every node leader's steps and every node's copy report (4 to
    # 16 ranks: 3,316 to 5,336 bytes per rank); now rank 0 collects them and each rank
    # reads one answer. The views of checkpoints() and restore() are equal on the
    # ranks of this job, which an all-gather stores once: flat before and now.
    import torch

    from atomic_checkpoint import Tier, TieredCheckpointManager, domains

    monkeypatch.setattr(domains, "current_host", _thread_node)
    per_node = 2

    def bytes_per_rank(world: int) -> dict[str, int]:
        server, stores, coords = _counted_clients(world, f"tiered{world}")
        slow = tmp_path / f"world{world}" / "persistent"
        out: dict[int, Any] = {}

        def job(c: TorchDistributedCoordinator) -> None:
            counts = stores[c.rank].counts
            mgr = TieredCheckpointManager(
                [Tier(tmp_path / f"world{world}" / f"node-{c.rank // per_node}"), Tier(slow)],
                coordinator=c,
                fast_domains="per-host",
                timeout_s=30,
            )
            mine = {"w": torch.full((4,), float(c.rank))}

            def save_and_replicate() -> bool:
                mgr.save(1, mine)
                return mgr.wait_replicated(timeout_s=60)

            replicated, saved = _bytes_used(counts, c, save_and_replicate)
            (listed, got), viewed = _bytes_used(
                counts,
                c,
                lambda: ([(i.step, i.tiers) for i in mgr.checkpoints()], mgr.restore()),
            )
            mgr.close()
            out[c.rank] = {
                "replicated": replicated,
                "listed": listed,
                "restored": bool(torch.equal(got["w"], mine["w"])),
                "bytes": {"save and replicate": saved, "checkpoints and restore": viewed},
            }

        _as_nodes(coords, job, per_node)
        assert sorted(out) == list(range(world)), f"ranks that finished: {sorted(out)}"
        for r, o in out.items():
            assert o["replicated"] and o["restored"], (r, o)
            assert o["listed"] == [(1, (0, 1))], (r, o)
        del server
        return _most_read(out)

    _no_rank_reads_more_at_16_ranks_than_at_4(bytes_per_rank)


def test_a_peer_fetch_and_a_gather_to_cost_each_rank_the_same_bytes_whatever_n():
    # A restore after a node wipe: every wiped node's leader receives its node's
    # manifest from the holding peer's leader, then every rank learns which receivers
    # rejected their copy. An all-gather of the holders' manifests (every rank reading
    # every one) would grow each rank's bytes with the number of wiped nodes; routed
    # through rank 0, each receiver reads its own. gather_to (the replicators' round)
    # likewise: only its destination reads every rank's value. Every value here is
    # distinct, so no sharing of equal values can hide an all-gather.
    from atomic_checkpoint.coordination import gather_to
    from atomic_checkpoint.tiered import _route_fetch_metas, _share_rejections

    def meta(node: int) -> dict[str, str]:
        return {"manifest": f"node {node}: " + "m" * 2000}  # a manifest of a few files

    def bytes_per_rank(world: int) -> dict[str, int]:
        server, stores, coords = _counted_clients(world, f"fetch{world}")
        # Two ranks per node; every odd node was wiped and fetches from the node below:
        # (receiving leader, holding leader, node whose files move).
        plan = [(2 * k, 2 * (k - 1), k) for k in range(1, world // 2, 2)]
        rejecting = plan[-1][0]

        def job(c: TorchDistributedCoordinator) -> dict[str, Any]:
            counts = stores[c.rank].counts
            metas = {lead: meta(n) for lead, h, n in plan if h == c.rank}
            routed, fetch = _bytes_used(
                counts, c, lambda: _route_fetch_metas(c, 7, plan, metas, 20)
            )
            why = "checksum mismatch" if c.rank == rejecting else None
            rejected, rejections = _bytes_used(counts, c, lambda: _share_rejections(c, 7, why, 20))
            copied = f"rank {c.rank} copied " + "c" * 300
            gathered, gather = _bytes_used(
                counts, c, lambda: gather_to(c, "copied", copied, dst=0, timeout_s=20)
            )
            return {
                "routed": routed,
                "rejected": rejected,
                "gathered": gathered,
                "bytes": {"peer fetch": fetch, "rejections": rejections, "gather_to": gather},
            }

        out = _at_once(coords, job)
        assert sorted(out) == list(range(world)), f"ranks that finished: {sorted(out)}"
        receivers = {lead: n for lead, _h, n in plan}
        for r, o in out.items():
            assert o["routed"] == (meta(receivers[r]) if r in receivers else None), r
            assert o["rejected"] == {rejecting: "checksum mismatch"}, (r, o["rejected"])
            expected = [f"rank {i} copied " + "c" * 300 for i in range(world)]
            assert o["gathered"] == (expected if r == 0 else None), r
        del server
        return _most_read(out)

    _no_rank_reads_more_at_16_ranks_than_at_4(bytes_per_rank)


def test_the_deprecated_gather_warns_and_answers_as_gather_and_route():
    server, (only,) = _clients(1, "deprecated")
    with pytest.warns(DeprecationWarning, match="gather_and_route"):
        got = only.gather("g", 7, dst=0, timeout_s=10, reduce=sum)
    assert got == ([7], 7)
    assert only.gather_and_route("g", 8, dst=0, timeout_s=10, reduce=sum) == ([8], 8, None)
    del server


def test_the_manifest_figures_of_the_scale_benchmark_run(tmp_path):
    # docs/scale.md's manifest table (`benchmarks/scale.py --manifests 8,64,...`, and the
    # default run that writes scale.json and the plot): the manifest it built listed
    # each rank's files in a folder of its own as per-rank state, which the manifest
    # check refuses (no rank-<r>.safetensors), so the run died before writing anything.
    row = scale.manifest_figures(8, 4, str(tmp_path), repeat=1)
    assert row["world"] == 8 and row["files"] >= 8 * 4 and row["size_bytes"] > 0
    assert row["write_s"] >= 0 and row["read_s"] >= 0 and row["validate_s"] >= 0
