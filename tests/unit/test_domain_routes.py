"""What rank 0 sends each rank at the start: its storage domain, in a few bytes.

Discovery gathers every rank's host on rank 0, which sends each rank its own domain
(``domains._routes``) rather than every host name to every rank. Members and leaders
travel as ranges where ranks are evenly spaced; whatever the layout, each rank must
rebuild exactly the domain that every rank's view would give.
"""

from __future__ import annotations

import pickle

import pytest

from atomic_checkpoint import domains
from atomic_checkpoint.preemption import _check_summary


@pytest.mark.parametrize(
    "leader_of",
    [
        [0] * 8,  # one host
        [0, 0, 0, 0, 4, 4, 4, 4],  # ranks numbered node by node
        [0, 1, 0, 1, 0, 1],  # round robin over two hosts
        [0, 0, 2, 0, 4, 2, 4],  # irregular
        [0, 1, 2, 3],  # a rank per host
    ],
)
def test_each_rank_rebuilds_its_own_domain_from_what_rank_0_sends(leader_of):
    expected = domains._build(leader_of)
    routes = domains._routes(leader_of)
    assert routes is not None and sorted(routes) == list(range(len(leader_of)))
    for rank, sent in routes.items():
        got = domains._unpack(pickle.loads(pickle.dumps(sent)))
        assert got == expected[rank]
        assert isinstance(got.members, tuple) and isinstance(got.leaders, tuple)
    assert domains._routes(None) is None


def test_a_domain_costs_the_same_bytes_at_any_size_when_ranks_go_node_by_node():
    def size(world: int) -> int:
        leader_of = [r - r % 8 for r in range(world)]
        return max(len(pickle.dumps(v)) for v in domains._routes(leader_of).values())

    assert size(4096) <= size(64) + 8  # a few more digits, not 4096 members


def test_preemption_check_summary_is_what_every_rank_decides_from():
    # (step, signal, time left, a save's time now, slowest recent save, work announced
    # before the save); rank 1 has an async save in flight, so a save there now takes
    # longer than its slowest save; the ranks timed their evaluations differently.
    views = [
        (10, None, None, 2.0, 2.0, 1.5),
        (10, 15, 30.0, 3.5, 2.5, 2.0),
        (10, 10, 12.5, None, None, None),
    ]
    summary = _check_summary(views)
    assert summary == {
        "work": 2.0,
        "slowest": 2.5,
        "by_rank": None,
        "signalled": (1, 2),
        "signals": [10, 15],
        "left": 12.5,
        "estimate": 3.5,
    }
    none = (None, None, None, None, None)
    apart = _check_summary([(10, *none), (11, *none)])
    assert apart["work"] is None
    assert apart["by_rank"] == {0: 10, 1: 11} and apart["signalled"] == ()


def test_visibility_that_is_not_a_partition_is_one_error_naming_the_ranks(tmp_path):
    # Rank 0 decides from every rank's probe report and sends the verdict: a rank that
    # sees no probe, or sees other probes than its leader does, is every rank's error.
    from atomic_checkpoint import CheckpointError
    from atomic_checkpoint.storage.local import LocalStorage

    storage = LocalStorage(tmp_path)
    assert domains._leaders_seen(storage, [[0], [0], [2], [2]]) == [0, 0, 2, 2]
    with pytest.raises(CheckpointError, match="rank 1 sees no storage probe"):
        domains._leaders_seen(storage, [[0], [], [2], [2]])
    with pytest.raises(CheckpointError, match=r"rank 1 sees the probes of ranks \[0, 2\]"):
        domains._leaders_seen(storage, [[0], [0, 2], [2], [2]])
