"""Storage domains: which ranks see the same storage, found out rather than assumed.

A storage domain is a set of ranks that see the same files under ROOT. With a shared
filesystem (NFS, Lustre, sshfs, an object store) every rank is in one domain and one
coordinator commits for everyone. With node-local disks each node is its own domain:
its leader commits its node's copy, and a checkpoint counts as the run's only when
every domain has committed it.

Trainers that guess this from flags (``save_on_each_node``, ``local_rank == 0``) get
it wrong in both directions (FAILURE_MODES A4, A5, B8): several nodes renaming the same
shared directory, or nodes whose disks never rotate. So we probe:

1. Rank 0 collects the host names; the first rank on each host is a candidate leader.
   With one host, rank 0 sends each rank its domain and we are done. With ``per-host``
   it sends each rank its host's domain, and the probes of 2-3 below only check that no
   host's first rank sees another host's probe (then the hosts share ROOT: an error).
2. Each candidate writes a probe file with a random token under ROOT.
3. Every rank opens (never ``stat``: network filesystems cache attributes) each
   candidate's probe and reports which ones it sees.
4. A rank's domain leader is the lowest candidate it sees; the ranks with the same
   leader form a domain. Rank 0 computes it once from every rank's report and sends
   each rank its own domain; visibility that does not form a partition is every
   rank's error.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from .coordination import Coordinator, gather_routed
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
    me = coord.rank

    # Rank 0 collects every rank's host and sends each rank its own domain (one host, or
    # per-host) or every rank the candidates to probe: O(N) bytes through the store,
    # where every rank reading every host name put N x hosts (4096 ranks on 512 hosts:
    # 512 names to each rank).
    def candidates_of(hosts: list[str]) -> list[int]:
        return [r for r in range(world) if hosts.index(hosts[r]) == r]

    def by_host(hosts: list[str]) -> list[int] | None:
        candidates = candidates_of(hosts)
        if mode != "per-host" and len(candidates) > 1:
            return None  # several hosts: the probes decide
        first = {hosts[c]: c for c in candidates}
        return [first[h] for h in hosts]

    def probe_list(hosts: list[str]) -> list[int] | None:
        candidates = candidates_of(hosts)
        if mode == "per-host" and len(candidates) > 1:
            return candidates  # probed only to check that the hosts do not share ROOT
        return None if by_host(hosts) is not None else candidates

    # (Not the first round of a new manager: that one, which says "create it on every
    # rank" when a rank never comes, is its settings' check.)
    _, candidates, routed = gather_routed(
        coord,
        "domains: hosts",
        "storage domains",
        current_host,
        probe_list,
        lambda hosts: _routes(by_host(hosts)),
        dst=0,
        routed=True,
        timeout_s=timeout_s,
    )
    if candidates is None:
        return _unpack(routed)
    per_host = routed if mode == "per-host" else None
    token = coord.broadcast("domains: token", uuid.uuid4().hex, timeout_s=timeout_s)
    probe = f"{META_DIR}/probe-{token}-{me}"

    def write_probe() -> str | None:
        if me not in candidates:
            return None
        try:
            storage.makedirs(META_DIR)
            storage.write_bytes_atomic(probe, token.encode())
        except CheckpointError as exc:
            return f"rank {me} could not write its storage probe {storage.url(probe)}: {exc}"
        return None

    _, errors, _ = gather_routed(
        coord,
        "domains: probes written",
        "storage domains",
        write_probe,
        lambda errors: "; ".join(e for e in errors if e) or None,
        _none,
        dst=0,
        routed=False,
        timeout_s=timeout_s,
    )
    if errors:
        raise CheckpointError(errors)
    # With per-host, one domain per host as told: only the hosts' first ranks look,
    # once each (another host's probe is expected not to be there: no waiting for it).
    look = candidates if per_host is None or me in candidates else []
    seen = [
        c
        for c in look
        if _sees(
            storage,
            f"{META_DIR}/probe-{token}-{c}",
            token,
            wait_s=0.0 if per_host is not None else visibility_timeout_s if c == me else 2.0,
        )
    ]

    def check(reports: list[list[int]]) -> str | None:
        if per_host is not None:
            return _shared_across_hosts(storage, candidates, reports)
        try:
            _leaders_seen(storage, reports)
        except CheckpointError as exc:
            return str(exc)
        return None

    _, problem, routed = gather_routed(
        coord,
        "domains: probes seen",
        "storage domains",
        lambda: seen,
        check,
        lambda reports: (
            None
            if per_host is not None or check(reports)
            else _routes(_leaders_seen(storage, reports))
        ),
        dst=0,
        routed=True,
        timeout_s=timeout_s,
    )
    if me in candidates:
        try:
            storage.delete_file(probe)
        except CheckpointError:
            pass  # a stale probe is harmless: the token is never reused
    if problem is not None:
        raise CheckpointError(problem)
    return _unpack(per_host if per_host is not None else routed)


def _shared_across_hosts(
    storage: Storage, candidates: list[int], reports: list[list[int]]
) -> str | None:
    """With ``storage_domains="per-host"``: the error when the first rank of one host
    sees another host's probe under ROOT (the hosts share it), else None. Each host's
    leader then took the run lock of the same ROOT: the second was told another job
    held it (its own job), or, with a run_id, the two took it from each other."""
    for c in candidates:
        others = [o for o in reports[c] if o != c]
        if others:
            return (
                f"storage_domains='per-host' says each host has its own {storage.url('')}, "
                f"but rank {c} sees the storage probe that rank {others[0]} (another host) "
                "wrote there: the hosts share ROOT. Pass storage_domains='auto' (or "
                "'shared')"
            )
    return None


def _leaders_seen(storage: Storage, reports: list[list[int]]) -> list[int]:
    """Each rank's domain leader, from the candidates' probes every rank saw: the lowest
    one it sees. Visibility that does not form a partition is an error."""
    leader_of = []
    for r, seen in enumerate(reports):
        if not seen:
            raise CheckpointError(
                f"rank {r} sees no storage probe under {storage.url('')}, not even its own "
                "host's: is ROOT on a filesystem this rank can write?"
            )
        leader_of.append(min(seen))
    for r, seen in enumerate(reports):
        if seen != reports[leader_of[r]]:
            raise CheckpointError(
                f"inconsistent storage visibility under {storage.url('')}: rank {r} sees the "
                f"probes of ranks {seen}, its domain leader rank {leader_of[r]} sees "
                f"{reports[leader_of[r]]}. Pass storage_domains='shared' or 'per-host' to "
                "say how the storage is laid out"
            )
    return leader_of


def _routes(leader_of: list[int] | None) -> dict[int, tuple[Any, ...]] | None:
    """Each rank's domain, as rank 0 sends it (None: not decided here). Members and
    leaders go as ranges where they are evenly spaced (ranks numbered node by node),
    so a domain costs a few bytes whatever the number of ranks."""
    if leader_of is None:
        return None
    return {
        r: (d.index, d.leader, _compact(d.members), _compact(d.leaders))
        for r, d in enumerate(_build(leader_of))
    }


def _compact(ranks: tuple[int, ...]) -> range | tuple[int, ...]:
    if len(ranks) > 2 and ranks[1] > ranks[0]:
        spaced = range(ranks[0], ranks[-1] + 1, ranks[1] - ranks[0])
        if tuple(spaced) == ranks:
            return spaced
    return ranks


def _unpack(routed: tuple[Any, ...]) -> Domain:
    index, leader, members, leaders = routed
    return Domain(index, leader, tuple(members), tuple(leaders))


def _none(*_args: Any) -> None:
    return None


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
