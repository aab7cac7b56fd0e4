"""Rank functions of the multi-node atomic-checkpoint jobs (see ``launcher.run_ranks``).

Each rank works under its own root path: ranks on one "node" share one sshfs mount,
ranks on the other node use the other mount of the same export. States come from
``tests.dist.workers.make_state``, so any rank can rebuild what any other rank saved.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.dist.workers import make_state, states_equal

from atomic_checkpoint import CheckpointManager, KeepLast
from atomic_checkpoint.domains import HOST_ENV

#: Small states: the job measures the protocol on a network filesystem, not bandwidth.
SMALL = {"n_big": 1, "big_elems": 256}


def w_atomic_saves(
    rank: int,
    world: int,
    roots: list[str],
    hosts: list[str],
    saves: int,
    keep: int,
    check_every: int,
) -> dict[str, Any]:
    """Save steps ``1..saves`` with ``KeepLast(keep)``; every ``check_every`` saves,
    every rank asks for the latest checkpoint and restores the state of a rank on the
    other node (read through its own mount). At the end every rank lists the retained
    checkpoints and verifies each one's checksums through its own mount.

    ``hosts[r]`` names rank ``r``'s node, so storage-domain discovery probes across
    the two mounts instead of trusting one shared host name.
    """
    os.environ[HOST_ENV] = hosts[rank]
    t0 = time.monotonic()
    mgr = CheckpointManager(
        roots[rank], retention=KeepLast(keep), timeout_s=60, visibility_timeout_s=30
    )
    domain = mgr.domain
    peer = (rank + world // 2) % world
    commits: list[tuple[int, int, str]] = []
    checks: list[tuple[int, int | None, bool]] = []
    for step in range(1, saves + 1):
        info = mgr.save(step, make_state(step, rank, **SMALL))
        commits.append((info.step, info.commit_seq, info.run_id))
        if step % check_every == 0:
            latest = mgr.latest()
            peer_state = mgr.restore(rank=peer)
            checks.append(
                (
                    step,
                    latest.step if latest else None,
                    states_equal(peer_state, make_state(step, peer, **SMALL)),
                )
            )
    retained = [c.step for c in mgr.checkpoints()]
    verified = [mgr.verify(s).step for s in retained]
    own = mgr.restore()
    mgr.close()
    return {
        "domain": (domain.index, domain.leader, domain.members, domain.leaders),
        "is_coordinator": mgr.is_coordinator,
        "commits": commits,
        "checks": checks,
        "retained": retained,
        "verified": verified,
        "own_restore_ok": states_equal(own, make_state(saves, rank, **SMALL)),
        "seconds": time.monotonic() - t0,
    }
