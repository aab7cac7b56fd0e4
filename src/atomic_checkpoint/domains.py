"""Storage domains: which ranks see the same storage, found out rather than assumed.

A storage domain is a set of ranks that see the same files under ROOT. With a shared
filesystem (NFS, Lustre, sshfs, an object store) every rank is in one domain and one
coordinator commits for everyone. With node-local disks each node is its own domain:
its leader commits its node's copy, and a checkpoint counts as the run's only when
every domain has committed it.

Trainers that guess this from flags (``save_on_each_node``, ``local_rank == 0``) get
it wrong in both directions (FAILURE_MODES A4, A5, B8): several nodes renaming the same
shared directory, or nodes whose disks never rotate. So we probe:

1. Ranks exchange host names; the first rank on each host is a candidate leader.
2. Each candidate writes a probe file with a random token under ROOT.
3. Every rank opens (never ``stat``: network filesystems cache attributes) each
   candidate's probe and reports which ones it sees.
4. A rank's domain leader is the lowest candidate it sees; the ranks with the same
   leader form a domain. Everyone computes the same answer from the same gathered
   reports. Visibility that does not form a partition is an error.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from .coordination import Coordinator
from .errors import CheckpointError, CheckpointNotFoundError
from .layout import META_DIR
from .lock import HOST_ENV as HOST_ENV
from .lock import current_host
from .storage.base import Storage


@dataclass(frozen=True)
class Domain:
    """This rank's storage domain.

    Attributes:
        index: position of this domain among all domains (0 holds rank 0).
        leader: the rank that commits, rotates and cleans this domain.
        members: ranks in this domain, ascending.
        leaders: the leader of every domain, by index.
    """

    index: int
    leader: int
    members: tuple[int, ...]
    leaders: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.leaders)


def single_domain(world_size: int) -> Domain:
    return Domain(0, 0, tuple(range(world_size)), (0,))


def _build(leader_of: list[int]) -> list[Domain]:
    leaders = tuple(sorted(set(leader_of)))
    out = []
    for leader in leader_of:
        members = tuple(m for m, lead in enumerate(leader_of) if lead == leader)
        out.append(Domain(leaders.index(leader), leader, members, leaders))
    return out


def discover(
    storage: Storage,
    coord: Coordinator,
    *,
    mode: str,
    timeout_s: float,
    visibility_timeout_s: float,
) -> Domain:
    """Find this rank's domain; collective (every rank calls it once, in order).

    Args:
        mode: "auto" (probe), "shared" (one domain: trust the user), or "per-host"
            (one domain per host, no probe).
    """
    world = coord.world_size
    if world == 1 or mode == "shared":
        return single_domain(world)
    if mode not in ("auto", "per-host"):
        raise ValueError(f"storage_domains must be 'auto', 'shared' or 'per-host', got {mode!r}")
    hosts = coord.all_gather("domains: hosts", current_host(), timeout_s=timeout_s)
    candidates = [r for r in range(world) if hosts.index(hosts[r]) == r]
    if mode == "per-host" or len(candidates) == 1:
        # One host: every rank sees the same local filesystem namespace.
        leader_of = [
            candidates[[hosts[c] for c in candidates].index(hosts[r])] for r in range(world)
        ]
        return _build(leader_of)[coord.rank]
    token = coord.broadcast("domains: token", uuid.uuid4().hex, timeout_s=timeout_s)
    me = coord.rank
    probe = f"{META_DIR}/probe-{token}-{me}"
    error = None
    if me in candidates:
        try:
            storage.makedirs(META_DIR)
            storage.write_bytes_atomic(probe, token.encode())
        except CheckpointError as exc:
            error = f"rank {me} could not write its storage probe {storage.url(probe)}: {exc}"
    errors = coord.all_gather("domains: probes written", error, timeout_s=timeout_s)
    if any(errors):
        raise CheckpointError("; ".join(e for e in errors if e))
    seen = [
        c
        for c in candidates
        if _sees(
            storage,
            f"{META_DIR}/probe-{token}-{c}",
            token,
            wait_s=visibility_timeout_s if c == me else 2.0,
        )
    ]
    reports = coord.all_gather("domains: probes seen", seen, timeout_s=timeout_s)
    if me in candidates:
        try:
            storage.delete_file(probe)
        except CheckpointError:
            pass  # a stale probe is harmless: the token is never reused
    leader_of = []
    for r in range(world):
        if not reports[r]:
            raise CheckpointError(
                f"rank {r} sees no storage probe under {storage.url('')}, not even its own "
                "host's: is ROOT on a filesystem this rank can write?"
            )
        leader_of.append(min(reports[r]))
    for r in range(world):
        if reports[r] != reports[leader_of[r]]:
            raise CheckpointError(
                f"inconsistent storage visibility under {storage.url('')}: rank {r} sees the "
                f"probes of ranks {reports[r]}, its domain leader rank {leader_of[r]} sees "
                f"{reports[leader_of[r]]}. Pass storage_domains='shared' or 'per-host' to "
                "say how the storage is laid out"
            )
    return _build(leader_of)[me]


def _sees(storage: Storage, path: str, token: str, *, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if storage.read_bytes(path) == token.encode():
                return True
        except CheckpointNotFoundError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
