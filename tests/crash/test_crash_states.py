"""Power loss at every point of every protocol operation (``reliability/crashsim.py``,
model in ``docs/crash-model.md``).

The first half checks the model on toy protocols written here, so the checker is seen
to fail: a protocol that forgets an fsync, or that moves the old copy away before the
new one is in, is caught; the correct one passes. The second half runs the library's
operations (save, overwrite with and without RENAME_EXCHANGE, retention, rollback,
sweep, lock takeover, first start with run.json, marker publish and delete, async
and O_DIRECT saves, ``saving()``) and recovers every crash state they can leave, with
a sampled budget per crash point. On ``memory://`` (object-store semantics: a request
is atomic and durable once it returns) every prefix of the completed requests is
recovered. The large mode explores over 100,000 states::

    python reliability/run.py --full --campaign crash-states
    python -m reliability.crashstates --scenario overwrite/no-exchange --per-cut 64
"""

from __future__ import annotations

import os

import pytest
from reliability import crashsim, crashstates, crashstore
from reliability.crashsim import Recorder, RecorderError, crash_states, explore

from atomic_checkpoint.storage import LocalStorage
from tests.crash.recovery import every_state_recovers

NEW = b"n" * 10_000  # three 4 KiB blocks: torn variants exist
OLD = b"o" * 6_000


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: str, data: bytes, *, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _publish(root: str, *, fsync_file: bool = True, fsync_dir: bool = True) -> None:
    """Toy atomic publish: temp file, fsync, rename, fsync of the directory."""
    tmp, final = os.path.join(root, "f.tmp"), os.path.join(root, "f")
    _write(tmp, NEW, fsync=fsync_file)
    os.rename(tmp, final)
    if fsync_dir:
        _fsync_dir(root)


def _explore_publish(tmp_path, **kw):
    root = tmp_path / "root"
    root.mkdir()
    with Recorder(root) as rec:
        _publish(str(root), **kw)
        rec.mark("returned")

    def expect(state):
        return any(m.label == "returned" for m in state.marks)

    def check(path, state, returned):
        f = os.path.join(path, "f")
        if os.path.exists(f):
            with open(f, "rb") as fh:
                if fh.read() != NEW:
                    return [("torn", "f is visible but incomplete")]
        elif returned:
            return [("lost", "f was published and is gone")]
        return []

    work = tmp_path / "states"
    work.mkdir()
    return explore(rec.baseline, rec.ops, check, str(work), expect=expect)


def test_correct_toy_publish_survives_every_crash_state(tmp_path):
    result = _explore_publish(tmp_path)
    assert result.violations == []
    assert (
        result.states >= 8
        and result.cuts == len(["create", "write", "fsync", "rename", "dsync", "mark"]) + 1
    )


def test_toy_publish_without_file_fsync_is_torn(tmp_path):
    result = _explore_publish(tmp_path, fsync_file=False)
    assert result.counts.get("torn", 0) > 0
    # The unsynced data reaches the state as lost, size-only, torn and cut variants.
    assert any("f=torn@1" in v.state for v in result.violations)
    assert any("f=old" in v.state for v in result.violations)


def test_toy_publish_without_directory_fsync_is_lost(tmp_path):
    result = _explore_publish(tmp_path, fsync_dir=False)
    # After the return: the rename lost (f.tmp left), or the create and the rename.
    assert result.counts == {"lost": 2}
    assert sorted(v.state.split("; lost: ")[1] for v in result.violations) == [
        "create f.tmp; rename f.tmp -> f",
        "rename f.tmp -> f",
    ]


def _toy_overwrite(root: str) -> None:
    """Overwrite without an atomic exchange, as on sshfs: old copy out, new copy in."""
    os.mkdir(os.path.join(root, "trash"))
    os.rename(os.path.join(root, "final"), os.path.join(root, "trash", "old"))
    os.rename(os.path.join(root, "pending"), os.path.join(root, "final"))
    _fsync_dir(root)


def _toy_recover(path: str, *, careful: bool) -> None:
    """The start-up sweep: the careless one deletes pending and trash outright; the
    careful one first puts a complete copy back when ``final`` is missing."""
    final = os.path.join(path, "final")
    for leftover in (os.path.join(path, "pending"), os.path.join(path, "trash", "old")):
        if careful and not os.path.exists(final) and os.path.exists(leftover):
            os.rename(leftover, final)
        elif os.path.exists(leftover):
            os.remove(os.path.join(leftover, "data"))
            os.rmdir(leftover)


@pytest.mark.parametrize("careful", [False, True])
def test_toy_overwrite_with_two_renames_needs_a_careful_sweep(tmp_path, careful):
    root = tmp_path / "root"
    for name, data in (("final", OLD), ("pending", NEW)):
        (root / name).mkdir(parents=True)
        (root / name / "data").write_bytes(data)
    with Recorder(root) as rec:
        _toy_overwrite(str(root))

    def check(path, state, _):
        _toy_recover(path, careful=careful)
        f = os.path.join(path, "final", "data")
        if not os.path.exists(f):
            return [("lost", "the step has no copy left")]
        with open(f, "rb") as fh:
            return [] if fh.read() in (OLD, NEW) else [("torn", "final is neither copy")]

    work = tmp_path / "states"
    work.mkdir()
    result = explore(rec.baseline, rec.ops, check, str(work))
    if careful:
        assert result.violations == []
    else:
        # The crash between the two renames, then the sweep deletes both copies.
        assert result.counts.get("lost", 0) >= 1
        assert any("rename final -> trash/old" in v.state for v in result.violations)
    assert result.states == 4  # before, trash made, old moved out, new moved in


def test_a_rename_is_atomic_and_needs_its_new_directory(tmp_path):
    """No state loses an object a rename moves, even into a directory made just
    before; the move persists only with that directory's own creation."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_bytes(OLD)
    with Recorder(root) as rec:
        os.mkdir(root / "t")
        os.rename(root / "a", root / "t" / "a")
        _fsync_dir(str(root / "t"))
    seen = set()
    for state in crash_states(rec.baseline, rec.ops):
        files = state.tree.files()
        assert ("a" in files) != ("t/a" in files), files
        seen.add(tuple(sorted(files)))
    assert seen == {("a",), ("a", "t/"), ("t/", "t/a")}


def test_unsynced_data_is_torn_at_block_granularity(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with Recorder(root) as rec:
        _write(str(root / "f"), NEW, fsync=False)
        _fsync_dir(str(root))
    sizes = {
        (len(s.tree.files()["f"]), s.data.get("f"))
        for s in crash_states(rec.baseline, rec.ops)
        if "f" in s.tree.files()
    }
    assert (0, "old") in sizes and (len(NEW), "size-only") in sizes
    assert (4096, "cut@1") in sizes and (len(NEW), "torn@1") in sizes


def test_the_recorder_refuses_to_miss_a_mutation(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    with (
        pytest.raises(RecorderError, match=r"missed mutations.*only in the real tree: f"),
        Recorder(root),
        open(root / "f", "wb") as f,  # io.FileIO: not an os.write
    ):
        f.write(b"x")


@pytest.mark.parametrize("exchange", [True, False])
def test_the_no_exchange_profile_is_what_sshfs_gives(tmp_path, exchange):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    storage = LocalStorage(root)
    with Recorder(root, exchange=exchange) as rec:
        swapped = storage.exchange_dirs("a", "b")
        storage.rename_dir("a", "c") if not swapped else None
    assert swapped is exchange
    assert [op.kind for op in rec.ops] == (["exchange"] if exchange else ["rename"])
    with crashsim.capability_profile(exchange):
        assert storage.exchange_dirs("b", "c" if not exchange else "a") is exchange


# ------------------------------------------------------------------- the library
#: The operations CI recovers from every sampled crash state of; the others (*-wide,
#: rollback, the no-exchange variants of operations that never rename onto an existing
#: name) run in the campaign's quick size (tests/faults/test_campaigns.py).
CI_SCENARIOS = crashstates.CI_SCENARIOS
PER_CUT = 4
MAX_STATES = 40
#: At least this many distinct states per operation, so a recorder that stopped
#: seeing the library's writes (or an enumerator that stopped) cannot pass quietly.
FLOOR = 8


@pytest.mark.parametrize("name", CI_SCENARIOS)
def test_every_crash_state_recovers(name, tmp_path):
    res = every_state_recovers(name, tmp_path, per_cut=PER_CUT, max_states=MAX_STATES, floor=FLOOR)
    ex = res.exploration
    if ex.states >= MAX_STATES:  # the cap is spread over the crash points
        assert ex.cuts_checked * 2 >= ex.cuts
    assert res.ops >= 10  # the operation really wrote: every fsync and rename recorded


def test_ci_and_the_quick_campaign_cover_every_operation():
    names = set(crashstates.scenarios())
    assert set(CI_SCENARIOS) < names
    kinds = {n.split("/")[0] for n in names}
    assert kinds >= {"save", "overwrite", "retention", "sweep", "takeover", "first-start"}
    assert kinds >= {"async-save", "saving", "rollback", "retention-wide", "sweep-wide"}
    assert kinds >= {"retention-full-disk", "rollback-full-disk"}
    assert {n.split("/")[1] for n in names} >= {"local", "no-exchange", "marker", "local-odirect"}


@pytest.mark.parametrize("name", ["rollback-full-disk/local", "retention-full-disk/no-exchange"])
def test_on_a_full_disk_checkpoints_are_un_committed_into_pending_and_every_crash_state_recovers(
    name, tmp_path
):
    """Where ``.trash/`` cannot be created (ENOSPC: the deletions are what would free the
    space), retention and rollback rename into ``.pending/`` instead, newest first, with
    the same fsyncs: no crash state may bring a rolled-back step back or lose a kept one."""
    (tmp_path / "recorded").mkdir()
    trace = crashstates.record_trace(name, str(tmp_path / "recorded"))
    moved = [op.where.split(" ")[0] for op in trace.ops if op.kind == "rename"]
    moved = [m for m in moved if m.startswith("checkpoint-")]
    # retention deletes the oldest first; rollback un-commits the newest first
    assert moved == (
        ["checkpoint-3", "checkpoint-2"] if "rollback" in name else ["checkpoint-1", "checkpoint-2"]
    )
    assert all(
        ".pending/" in op.where
        for op in trace.ops
        if op.kind == "rename" and op.where.startswith("checkpoint-")
    )
    assert not [op for op in trace.ops if ".trash" in op.where]
    (tmp_path / "states").mkdir()
    every_state_recovers(name, tmp_path / "states", per_cut=PER_CUT, max_states=30, floor=FLOOR)


def test_a_prune_on_a_full_disk_without_pending_un_commits_into_the_meta_dir(tmp_path):
    """``atomic-checkpoint prune`` on a root with no ``.pending/`` (its checkpoints were
    adopted, never staged there), on a disk with no room for ``.trash/`` nor
    ``.pending/``: the un-commit renames into ``.atomic-checkpoint/`` (which holds the run
    lock), oldest first, and every crash state recovers, the next start sweeping what is
    left there."""
    name = "prune-full-disk-adopted/local"
    (tmp_path / "recorded").mkdir()
    trace = crashstates.record_trace(name, str(tmp_path / "recorded"))
    renames = [op.where for op in trace.ops if op.kind == "rename"]
    moved = [r for r in renames if r.startswith("checkpoint-")]
    assert [r.split(" ")[0] for r in moved] == ["checkpoint-1", "checkpoint-2"], renames
    assert all(" -> .atomic-checkpoint/checkpoint-" in r for r in moved), moved
    assert not [op for op in trace.ops if ".trash" in op.where or ".pending" in op.where]
    (tmp_path / "states").mkdir()
    every_state_recovers(name, tmp_path / "states", per_cut=PER_CUT, max_states=30, floor=FLOOR)


@pytest.mark.parametrize("name", sorted(crashstore.scenarios()))
def test_every_prefix_of_object_store_requests_recovers(name):
    """Object stores: a PUT or DELETE is atomic and durable once it returns, so the
    crash states are the prefixes of the completed requests (memory://)."""
    ex = crashstore.run_scenario(name)
    assert ex.violations == [], "\n".join(str(v) for v in ex.violations[:10])
    assert ex.cuts >= 8  # the recorder saw the manifest, data, marker and lock requests
    assert ex.states >= ex.cuts // 2


def test_a_non_atomic_object_store_rewrite_is_lost():
    """The object-store checker can fail: rewriting a committed manifest by DELETE then
    PUT (instead of one PUT) loses the step if the writer dies in between."""

    def rewrite(url, mark):
        import fsspec

        fs, path = fsspec.core.url_to_fs(f"{url}/checkpoint-1/checkpoint.manifest.json")
        data = fs.cat_file(path)
        fs.rm_file(path)
        fs.pipe_file(path, data)

    scen = crashstore.StoreScenario("rewrite/memory", crashstore._prepare({1: 0}), rewrite, {1: 0})
    ex = crashstore.run_scenario(scen)
    assert ex.counts == {"lost": 1}
    assert (
        "DELETE" in ex.violations[0].state and "checkpoint.manifest.json" in ex.violations[0].state
    )
