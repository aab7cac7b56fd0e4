"""Restore agreement over many states, not one scenario (DESIGN invariant 11): a real
3-rank job (every rank its own node, tier 0 keeping 3 steps, one peer copy of each
node's files, tier 1 keeping 6) is reset to the same saved state again and again, each
time with random copies rotten and sometimes a node's tier 0 wiped; every rank then
restores. A reference model of the restore's rules (a rank loads its own tier 0 copy,
else a peer's, else tier 1, falling back to its tier 1 copy when the first one fails;
the newest step every rank can load wins) predicts each outcome, and every rank must
return that step, bit-exactly, or all raise the same error. The states reach both of
the restore's paths: the newest-first read of tier 1 and its full re-read when every
step the fast tiers hold fails."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.dist.launcher import ok_values, run_ranks
from tests.tiered import workers
from tests.tiered.test_peers import _peer_copy

from atomic_checkpoint.layout import checkpoint_name, rank_state_file

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]
WORLD = 3
STEPS = 6
SEED = 20261203


@dataclass
class Copies:
    """Where each rank's file of each step lies after the saves."""

    own: dict[tuple[int, int], Path] = field(default_factory=dict)  # (rank, step)
    peer: dict[tuple[int, int], list[tuple[int, Path]]] = field(default_factory=dict)
    slow: dict[tuple[int, int], Path] = field(default_factory=dict)

    def files(self, wipe: list[int] | None = None) -> list[Path]:
        """Every copy but those on the ``wipe`` nodes' tier 0 (gone with it)."""
        gone = set(wipe or ())
        own = [p for (r, _s), p in self.own.items() if r not in gone]
        peer = [p for held in self.peer.values() for h, p in held if h not in gone]
        return sorted([*own, *peer, *self.slow.values()])


def _inventory(base: Path, slow: Path) -> Copies:
    c = Copies()
    for rank in range(WORLD):
        for step in range(1, STEPS + 1):
            name = checkpoint_name(step)
            own = list((base / f"node{rank}" / name).rglob(rank_state_file(rank)))
            if own:
                c.own[rank, step] = own[0]
            for holder in range(WORLD):
                copy = _peer_copy(base, holder, rank, step)
                found = list(copy.rglob(rank_state_file(rank))) if copy.is_dir() else []
                if found:
                    c.peer.setdefault((rank, step), []).append((holder, found[0]))
            on_slow = list((slow / name).rglob(rank_state_file(rank)))
            if on_slow:
                c.slow[rank, step] = on_slow[0]
    return c


def _expected(c: Copies, wipe: set[int], rot: set[Path]) -> int | str:
    """The reference model: the step every rank restores, or the error all raise."""

    def chain(rank: int, step: int) -> list[Path]:
        first: list[Path] = []
        if rank not in wipe and (rank, step) in c.own:
            first = [c.own[rank, step]]
        else:
            # The nearest holder after the rank's node (the fetch plan's order); a
            # rejected peer copy leaves tier 1.
            held = sorted(
                (((h - rank) % WORLD, p) for h, p in c.peer.get((rank, step), []) if h not in wipe)
            )
            first = [held[0][1]] if held else []
        return first + ([c.slow[rank, step]] if (rank, step) in c.slow else [])

    candidates = [s for s in range(STEPS, 0, -1) if all(chain(r, s) for r in range(WORLD))]
    for s in candidates:
        if all(any(p not in rot for p in chain(r, s)) for r in range(WORLD)):
            return s
    return "CorruptCheckpointError" if candidates else "CheckpointNotFoundError"


def _scenarios(c: Copies, n: int) -> list[dict]:
    rng = random.Random(SEED)
    newest = set(c.files()) - {p for (_r, s), p in c.slow.items() if s <= STEPS - 3}
    out: list[dict] = [
        {"wipe": [], "rot": []},  # a plain restart: the newest step from tier 0
        {"wipe": [1], "rot": []},  # a replaced node: its file from a peer
        {"wipe": [], "rot": [str(p) for p in c.files()]},  # nothing verifies
        # Every rank's newest three steps rotten everywhere: only tier 1's older steps
        # are left, below where the newest-first read stopped.
        {"wipe": [2], "rot": [str(p) for p in c.files([2]) if p in newest]},
    ]
    while len(out) < n:
        wipe = [rng.randrange(WORLD)] if rng.random() < 0.4 else []
        rot = [str(p) for p in c.files(wipe) if rng.random() < (0.45 if p in newest else 0.2)]
        out.append({"wipe": wipe, "rot": rot})
    return out


def test_every_rank_restores_what_the_model_predicts_over_random_rotten_states(tmp_path):
    base, slow, pristine = tmp_path / "nodes", tmp_path / "persistent", tmp_path / "pristine"
    args = (str(base), str(slow), str(pristine), STEPS)
    saved = ok_values(run_ranks(workers.w_restore_states, WORLD, *args, [], tmp_dir=str(tmp_path)))
    assert all(v["replicated"] and v["peered"] for v in saved), saved
    c = _inventory(base, slow)
    # What the model assumes of the saved state: tier 1 holds every step, tier 0 and
    # one peer the newest three of every node.
    assert len(c.slow) == WORLD * STEPS, sorted(c.slow)
    assert sorted(c.own) == sorted((r, s) for r in range(WORLD) for s in (4, 5, 6))
    assert sorted(c.peer) == sorted(c.own) and all(len(h) == 1 for h in c.peer.values())
    shutil.copytree(base, pristine / "nodes")
    shutil.copytree(slow, pristine / "persistent")

    scenarios = _scenarios(c, 24)
    results = ok_values(
        run_ranks(
            workers.w_restore_states,
            WORLD,
            *args,
            scenarios,
            tmp_dir=str(tmp_path),
            timeout_s=60 + 10 * len(scenarios),
        )
    )
    seen: set[str] = set()
    for i, sc in enumerate(scenarios):
        want = _expected(c, set(sc["wipe"]), {Path(p) for p in sc["rot"]})
        got = [r["outcomes"][i] for r in results]
        where = f"scenario {i} (wipe {sc['wipe']}, {len(sc['rot'])} rotten): {got}"
        if isinstance(want, int):
            assert all(o[0] == "ok" and o[1] == want and o[3] for o in got), where
            seen.add("newest" if want == STEPS else "tier 0" if want > STEPS - 3 else "tier 1")
            if any(1 in o[2] for o in got):
                seen.add("from tier 1")
        else:
            assert all(o[0] == want for o in got), where
            seen.add(want)
    # The states cover every kind of outcome, the full re-read of tier 1 among them.
    assert seen >= {"newest", "tier 0", "tier 1", "from tier 1", "CorruptCheckpointError"}, seen
