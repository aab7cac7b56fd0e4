"""The tiered manager's view round with peer copies (``tiered._merge_views``, run once on
rank 0): every rank reads one merged answer instead of every rank's view, in which each
node leader's step infos travelled to every rank."""

from __future__ import annotations

import pickle
from typing import Any

from atomic_checkpoint.manifest import CheckpointInfo
from atomic_checkpoint.tiered import _merge_views

STEPS = (100, 200, 300)


def _views(world: int, per_node: int) -> list[tuple[Any, ...]]:
    """Every rank's view of a healthy job with peer copies (peers=1), as each rank sends
    it: its node's steps, tier 1's steps and rank 0's infos (rank 0 only), its leader,
    and, on leaders, the peer copies it holds and the infos of its steps."""
    nodes = world // per_node
    views = []
    for r in range(world):
        leader, node = r - r % per_node, r // per_node
        infos = {
            s: CheckpointInfo(s, f"/local/run/checkpoint-{s}", 1 << 30, run_id="run-1")
            for s in STEPS
        }
        held = {s: [((node - 1) % nodes, tuple(range(leader, leader + per_node)))] for s in STEPS}
        is_leader = r == leader
        views.append(
            (
                set(STEPS),
                set(STEPS) if r == 0 else None,
                infos if r == 0 else None,
                leader,
                held if is_leader else {},
                infos if is_leader else {},
                None,
            )
        )
    return views


def _packed(views: list[Any]) -> int:
    """The bytes a rank read from the all-gather, which stores equal neighbours once."""
    total, prev = 0, object()
    for v in views:
        if v != prev:
            total += len(pickle.dumps(v))
        prev = v
    return total


def test_every_rank_reads_one_answer_with_each_steps_info_once():
    # 256 ranks on 32 nodes: the all-gather sent every leader's view (its step infos
    # and peer holdings) to every rank; the merged answer holds each step's info once.
    views = _views(256, per_node=8)
    merged = _merge_views(views)
    # The same answer an all-gather gave every rank, computed once.
    assert merged.locals_ == [set(STEPS)] * 256
    assert merged.slow == set(STEPS) and sorted(merged.infos) == list(STEPS)
    assert merged.leader == [r - r % 8 for r in range(256)]
    assert sorted(merged.held) == list(range(0, 256, 8))
    assert merged.held[8][200] == [(0, tuple(range(8, 16)))]
    before, now = _packed(views), len(pickle.dumps(merged))
    assert now < before / 3, (before, now)  # 17,963 -> 4,487 bytes per rank here


def test_without_peer_copies_the_ranks_of_a_node_share_one_set():
    views = [
        ({1, 2} if r < 4 else {1}, {1} if r == 0 else None, {} if r == 0 else None)
        for r in range(8)
    ]
    merged = _merge_views(views)
    assert merged.locals_ == [{1, 2}] * 4 + [{1}] * 4
    assert merged.locals_[0] is merged.locals_[3] and merged.locals_[4] is merged.locals_[7]
    assert merged.leader == [] and merged.held == {} and merged.slow == {1}
