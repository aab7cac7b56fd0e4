"""``atomic-checkpoint drain`` and the tier columns of ``list``/``verify``: a tiered job
that ended with replication unfinished (its process SIGKILLed on the replicator thread
at a named fault point), drained afterwards by the real command line in a subprocess,
to a local directory and to the real S3 server; a cut link is the fault-injecting proxy
answering 503."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from pathlib import Path

import pytest
from tests.cli.helpers import flip_byte, run_cli
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import Rule, S3Proxy
from tests.tiered.test_tiered import fast_root, killed_job, same, state  # noqa: F401

from atomic_checkpoint import CheckpointManager, Tier, TieredCheckpointManager, catalog
from atomic_checkpoint.layout import checkpoint_name

JOB = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_tiered import state
    from atomic_checkpoint import Tier, TieredCheckpointManager

    cfg = json.loads(os.environ["TIERED_CFG"])
    mgr = TieredCheckpointManager(
        [Tier(cfg["fast"]), Tier(cfg["slow"], storage_options=cfg.get("opts"))]
    )
    for s in (1, 2, 3):
        mgr.save(s, state(s))
        print("saved", s, flush=True)
    mgr.wait_replicated(timeout_s=60)
    print("replicated", flush=True)
    """
)


def crashed_job(fast: Path, slow: str, opts: dict | None = None) -> None:
    """A tiered job SIGKILLed while its replicator copies step 2: steps 2 and 3 are
    committed on tier 0 only."""
    child = killed_job(JOB, "mid_replicate@0=kill:2", 60, fast=str(fast), slow=slow, opts=opts)
    assert "saved 1" in child.stdout and "replicated" not in child.stdout


@pytest.fixture
def crashed_slow(fast_root: Path, tmp_path: Path) -> str:
    """Tier 1, a local directory, of a job on ``fast_root`` that ``crashed_job`` killed."""
    slow = str(tmp_path / "persistent")
    crashed_job(fast_root, slow)
    return slow


def storage_option_args(opts: dict) -> list[str]:
    """``opts`` as the command line's ``--to-storage-option KEY=JSON`` arguments."""
    return [a for k, v in opts.items() for a in ("--to-storage-option", f"{k}={json.dumps(v)}")]


def steps(root: str, **kw) -> list[int]:
    return [c.step for c in CheckpointManager(root, read_only=True, **kw).checkpoints()]


@pytest.mark.timeout(90)
def test_drain_finishes_a_crashed_jobs_replication_and_list_verify_show_the_tiers(
    fast_root, crashed_slow
):
    slow = crashed_slow
    before = steps(slow)
    assert 3 not in before  # the job died with step 3 (at least) on tier 0 only

    # list --tier: which tiers hold each step, before the drain.
    doc = json.loads(run_cli("list", fast_root, "--tier", slow, "--json").stdout)
    assert doc["tiers"] == [str(fast_root), slow]
    held = {e["step"]: e["tiers"] for e in doc["entries"] if e["step"] is not None}
    assert held[3] == [0] and all(held[s] == [0, 1] for s in before)

    proc = run_cli("drain", fast_root, "--to", slow)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    drained = [s for s in (1, 2, 3) if s not in before]
    for s in drained:  # progress: one line per step, as it is committed
        assert f"checkpoint-{s}: replicated and verified" in proc.stdout
    assert f"{len(drained)} replicated, 0 failed, 0 left" in proc.stdout

    assert steps(slow) == [1, 2, 3]
    reader = CheckpointManager(slow, read_only=True)
    for s in (1, 2, 3):
        there = catalog.load_checkpoint(reader.storage, s, full=True)
        here = catalog.load_checkpoint(CheckpointManager(fast_root, read_only=True).storage, s)
        assert {(f.size_bytes, f.checksum) for f in there.files} == {
            (f.size_bytes, f.checksum) for f in here.files
        }
        assert same(reader.restore(step=s), state(s))
    # Nothing was deleted on tier 0: drain never applies retention.
    assert steps(str(fast_root)) == [1, 2, 3]

    # A second drain has nothing to do and says so.
    again = json.loads(run_cli("drain", fast_root, "--to", slow, "--json").stdout)
    assert again["ok"] and again["replicated"] == [] and again["left"] == []

    # verify --tier checks every copy on every tier; a corrupt persistent copy fails it.
    doc = json.loads(run_cli("verify", fast_root, "--tier", slow, "--json").stdout)
    assert doc["ok"] and sorted((r["step"], r["tier"]) for r in doc["checkpoints"]) == [
        (s, t) for s in (1, 2, 3) for t in (0, 1)
    ]
    m = catalog.load_checkpoint(reader.storage, 2)
    data = Path(slow) / checkpoint_name(2) / m.files[0].path
    flip_byte(data, -10)
    proc = run_cli("verify", fast_root, "--tier", slow)
    assert proc.returncode == 1
    assert "checkpoint-2 (tier 1): CORRUPT" in proc.stdout
    assert "checkpoint-2: verified on tier(s) 0\n" in proc.stdout


@pytest.mark.timeout(60)
def test_drain_refuses_a_live_job_and_never_replicates_a_corrupt_fast_copy(fast_root, tmp_path):
    slow = str(tmp_path / "persistent")
    os.mkdir(slow)
    plain = CheckpointManager(fast_root)
    for s in (1, 2):
        plain.save(s, state(s))
    # The job is alive (it holds tier 0's run lock): drain refuses, exit 3.
    proc = run_cli("drain", fast_root, "--to", slow)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "lock" in proc.stderr
    plain.close()

    m = catalog.load_checkpoint(plain.storage, 2)
    data = fast_root / checkpoint_name(2) / m.files[0].path
    flip_byte(data, -100)  # same size: only the checksum tells
    proc = run_cli("drain", fast_root, "--to", slow)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "checkpoint-2: NOT REPLICATED" in proc.stdout and "corrupt" in proc.stdout
    assert "step 2" in proc.stderr
    assert steps(slow) == [1]
    assert os.listdir(Path(slow) / ".pending") == []


@pytest.mark.timeout(120)
def test_drain_and_verify_tier_name_what_the_replicator_never_looks_at(tmp_path):
    # Two copies of one root (same run) each saved step 3 with other weights: draining
    # the second into where the first went said "0 replicated, 0 failed" (exit 0), and
    # `verify --tier` called the other copy "verified on tier(s) 0,1". A step torn on
    # ROOT was left out without a word (exit 0), and so were steps TO lacks below its
    # newest.
    base = tmp_path / "base"
    with CheckpointManager(base) as mgr:
        mgr.save(1, state(1))
    for name, seed in (("a", 3), ("b", 30)):
        shutil.copytree(base, tmp_path / name)
        with CheckpointManager(tmp_path / name) as mgr:
            mgr.save(2, state(2))
            mgr.save(3, state(seed))
    dest = str(tmp_path / "dest")
    os.mkdir(dest)
    first = run_cli("drain", tmp_path / "a", "--to", dest)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_cli("drain", tmp_path / "b", "--to", dest)
    assert second.returncode == 1, second.stdout + second.stderr
    assert "checkpoint-3: NOT REPLICATED" in second.stdout
    assert "another copy of step 3" in second.stdout
    assert "checkpoint-2: NOT REPLICATED" not in second.stdout  # the same bytes: fine
    check = run_cli("verify", tmp_path / "b", "--tier", dest)
    assert check.returncode == 1, check.stdout
    assert "checkpoint-3 (tier 1): ANOTHER COPY" in check.stdout
    assert "checkpoint-3: verified on tier(s) 0\n" in check.stdout
    assert "checkpoint-2: verified on tier(s) 0,1" in check.stdout

    # Step 1 removed from TO by hand: below its newest, so not copied back; said.
    shutil.rmtree(Path(dest) / checkpoint_name(1))
    again = run_cli("drain", tmp_path / "a", "--to", dest)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "not copied: step(s) [1]" in again.stdout
    assert json.loads(run_cli("drain", tmp_path / "a", "--to", dest, "--json").stdout)[
        "not_copied_below_newest"
    ] == [1]

    # A step torn on ROOT (a file truncated) and not on TO: named, exit 1.
    torn = tmp_path / "torn"
    with CheckpointManager(torn) as mgr:
        for s in (1, 2):
            mgr.save(s, state(s))
    m = catalog.load_checkpoint(mgr.storage, 2)
    with open(torn / checkpoint_name(2) / m.files[0].path, "r+b") as f:
        f.truncate(100)
    os.mkdir(tmp_path / "torn-dest")
    proc = run_cli("drain", torn, "--to", str(tmp_path / "torn-dest"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "checkpoint-2: NOT REPLICATED: ROOT's copy is corrupt" in proc.stdout
    assert steps(str(tmp_path / "torn-dest")) == [1]


def test_drains_audit_reads_only_what_it_compares_on_a_long_persistent_tier(tmp_path):
    # The audit read every manifest of TO: a persistent tier keeping a run's every
    # checkpoint (thousands) cost as many reads per drain. It needs TO's newest valid
    # step and TO's copies of the steps ROOT holds.
    from tests.helpers import CountingLocalStorage

    from atomic_checkpoint.cli import _drain_audit
    from atomic_checkpoint.storage.local import LocalStorage

    dest, fast = tmp_path / "dest", tmp_path / "fast"
    with CheckpointManager(dest) as mgr:
        run_id = mgr.run_id
        for s in range(1, 61):
            mgr.save(s, {"s": s})
    shutil.copytree(
        dest,
        fast,
        ignore=lambda d, names: [n for n in names if n[:11] == "checkpoint-" and int(n[11:]) < 58],
    )
    with CheckpointManager(fast) as mgr:
        mgr.save(61, {"s": 61})  # not on TO yet
    shutil.rmtree(dest / checkpoint_name(30))  # below TO's newest, and not on ROOT
    slow = CountingLocalStorage(str(dest))
    failed: dict[int, object] = {}
    below = _drain_audit(LocalStorage(str(fast)), slow, run_id, failed)
    assert failed == {} and below == []
    assert slow.manifest_reads <= 4, slow.manifest_reads  # newest (60) and 58, 59, 60

    # What it compares it still reads: another copy of step 59 on TO is named.
    with CheckpointManager(tmp_path / "other", run_id=run_id) as mgr:
        mgr.save(59, {"s": -59})
    shutil.rmtree(dest / checkpoint_name(59))
    shutil.copytree(tmp_path / "other" / checkpoint_name(59), dest / checkpoint_name(59))
    _drain_audit(LocalStorage(str(fast)), slow, run_id, failed)
    assert list(failed) == [59] and "another copy of step 59" in failed[59]


@pytest.mark.netfs
@pytest.mark.timeout(120)
def test_drain_to_s3_and_a_cut_link_exits_2_keeping_the_steps(s3_server, s3_bucket, fast_root):
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    crashed_job(fast_root, url, opts)
    before = steps(url, storage_options=opts)
    opt_args = storage_option_args(opts)

    # The link to S3 is cut: drain gives up after --timeout, exit 2, nothing lost.
    with S3Proxy(s3_server, lifetime_s=60) as proxy:
        cut = proxy.add(Rule("error", status=503, times=None))
        popt_args = storage_option_args(proxy.storage_options(max_attempts=1))
        proc = run_cli("drain", fast_root, "--to", url, *popt_args, "--json")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "nothing was copied" in proc.stderr and "drain` again" in proc.stderr
        proxy.remove(cut)
        # The endpoint holds every request: --timeout bounds the whole command (its run
        # file read and its lock check each waited a whole --timeout: twice as long).
        hung = proxy.add(Rule("delay", times=None))
        t0 = time.monotonic()
        proc = run_cli("drain", fast_root, "--to", url, *popt_args, "--timeout", "8")
        took = time.monotonic() - t0
        assert proc.returncode == 2 and "did not answer within" in proc.stderr, proc.stderr
        assert took < 1.5 * 8 + 3, took
        hung.release.set()
        proxy.remove(hung)
        # Reads answer, every write fails: the lock check passes, the copies do not.
        proxy.add(Rule("error", method="PUT", status=503, times=None))
        popt_args = storage_option_args(proxy.storage_options(max_attempts=1))
        proc = run_cli("drain", fast_root, "--to", url, *popt_args, "--timeout", "1", "--json")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert not doc["ok"] and 3 in doc["left"] and doc["replicated"] == []
    assert "run `atomic-checkpoint drain` again" in proc.stderr
    assert steps(str(fast_root)) == [1, 2, 3] and steps(url, storage_options=opts) == before

    proc = run_cli("drain", fast_root, "--to", url, *opt_args, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["root_missing"] is False
    assert doc["ok"] and [r["step"] for r in doc["replicated"]] == [
        s for s in (1, 2, 3) if s not in before
    ]
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 2, 3]
    for s in (1, 2, 3):
        catalog.load_checkpoint(reader.storage, s, full=True)
        assert same(reader.restore(step=s), state(s))

    # list and verify --tier reach the S3 tier with options on the command line (no
    # credentials in the environment); --storage-option, which is ROOT's, says so.
    tier_args = [a.replace("--to-", "--tier-") for a in opt_args]
    no_aws = {"AWS_ENDPOINT_URL": "", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    doc = json.loads(
        run_cli("list", fast_root, "--tier", url, *tier_args, "--json", env=no_aws).stdout
    )
    assert {e["step"]: e["tiers"] for e in doc["entries"]} == {s: [0, 1] for s in (1, 2, 3)}
    proc = run_cli("verify", fast_root, "--tier", url, *tier_args, env=no_aws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wrong = [a.replace("--to-", "--") for a in opt_args]
    proc = run_cli("list", fast_root, "--tier", url, *wrong, env=no_aws)
    assert proc.returncode == 2 and "--tier-storage-option" in proc.stderr


def test_drain_of_a_root_never_created_is_exit_2_unless_missing_ok(tmp_path):
    # A node whose job died before its first save never created its tier 0. A script
    # that drains every node passes --missing-ok: that node has nothing to drain (exit
    # 0, said so). Without it, a missing ROOT is exit 2 (it may be a mistyped path,
    # and exit 0 would let the user delete the real tier 0 undrained).
    root, slow = tmp_path / "node0", tmp_path / "persistent"
    proc = run_cli("drain", root, "--to", slow)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not exist" in proc.stderr and "--missing-ok" in proc.stderr
    proc = run_cli("drain", root, "--to", slow, "--missing-ok")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "does not exist: nothing to drain" in proc.stdout
    proc = run_cli("drain", root, "--to", slow, "--missing-ok", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["root_missing"] and doc["replicated"] == doc["left"] == []
    assert doc["root"] == str(root) and doc["to"] == str(slow)
    # Nothing was created on either side.
    assert not root.exists() and not slow.exists()
    # A ROOT that exists and holds no checkpoint: nothing to drain, nothing written
    # (before, both tiers got a .atomic-checkpoint/ and a .pending/).
    root.mkdir()
    proc = run_cli("drain", root, "--to", slow)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 replicated, 0 failed, 0 left" in proc.stdout
    assert os.listdir(root) == [] and not slow.exists()
    # A ROOT that exists but is not a directory is still an error, flag or not.
    (tmp_path / "file").write_text("x")
    proc = run_cli("drain", tmp_path / "file", "--to", slow, "--missing-ok")
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
    # A timeout that is not a positive number of seconds is a usage error, not a
    # drain that "did not finish within -1 s".
    for bad in ("-1", "0", "nan", "inf", "soon"):
        proc = run_cli("drain", root, "--to", slow, "--missing-ok", "--timeout", bad)
        assert proc.returncode == 2 and "seconds > 0" in proc.stderr, (bad, proc.stderr)


def test_drain_refuses_a_missing_to_and_another_runs_tier(tmp_path):
    # A mistyped or unmounted --to was created, parents and all, on this node's disk
    # ("2 replicated", exit 0); another run's tier got this run's steps among its own.
    root = tmp_path / "node0"
    with CheckpointManager(root) as mgr:
        mgr.save(1, state(1))
    unmounted = tmp_path / "mnt" / "lustre" / "run"
    proc = run_cli("drain", root, "--to", unmounted)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not exist (check the path, and that its filesystem is mounted)" in proc.stderr
    assert not (tmp_path / "mnt").exists()
    other = tmp_path / "other"
    with CheckpointManager(other) as mgr:
        mgr.save(5, state(5))
        theirs = mgr.run_id
    proc = run_cli("drain", root, "--to", other)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"is the persistent tier of run {theirs!r}" in proc.stderr
    assert steps(str(other)) == [5]
    unmounted.mkdir(parents=True)  # created by hand: a new persistent tier
    proc = run_cli("drain", root, "--to", unmounted)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert steps(str(unmounted)) == [1]


def test_drain_and_tiers_refuse_one_location_for_both_tiers(tmp_path):
    # "Replicating" a tier onto itself (or into a folder inside it) protects nothing,
    # and each tier's manager would take the other's files for its own: refused with
    # exit 2 before any lock is touched, and by TieredCheckpointManager itself.
    root = tmp_path / "node0"
    with CheckpointManager(root) as mgr:
        mgr.save(1, state(1))
    before = sorted(str(p) for p in root.rglob("*"))
    for to in (root, root / "persistent", tmp_path / "node0" / "." / ""):
        proc = run_cli("drain", root, "--to", to)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "must be two separate locations" in proc.stderr, proc.stderr
        assert "WARNING" not in proc.stderr  # no lock was taken over
    assert sorted(str(p) for p in root.rglob("*")) == before
    with pytest.raises(ValueError, match="separate locations"):
        TieredCheckpointManager(
            [Tier(tmp_path / "persistent" / "fast"), Tier(tmp_path / "persistent")]
        )
    assert not (tmp_path / "persistent").exists()


@pytest.mark.netfs
def test_drain_missing_ok_reads_an_empty_s3_prefix_as_a_root_never_created(
    s3_server, s3_bucket, tmp_path
):
    opts = s3_server.storage_options()
    root = f"s3://{s3_bucket}/never-saved"
    root_opts = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={json.dumps(v)}")]
    proc = run_cli("drain", root, *root_opts, "--to", tmp_path / "slow")
    assert proc.returncode == 2 and "--missing-ok" in proc.stderr, proc.stderr
    proc = run_cli("drain", root, *root_opts, "--to", tmp_path / "slow", "--missing-ok")
    assert proc.returncode == 0 and "nothing to drain" in proc.stdout, proc.stderr


@pytest.mark.timeout(90)
def test_inspect_tier_says_which_tiers_hold_a_step_and_shows_another_tiers_copy(
    fast_root, crashed_slow
):
    slow = crashed_slow
    replicated = steps(slow)
    assert 1 in replicated and 3 not in replicated

    def tiers(step: int) -> list[tuple[int, str]]:
        doc = json.loads(run_cli("inspect", fast_root, step, "--tier", slow, "--json").stdout)
        return [(t["tier"], t["status"]) for t in doc["tiers"]]

    assert tiers(1) == [(0, "ok"), (1, "ok")]
    assert tiers(3) == [(0, "ok"), (1, "missing")]  # not replicated when the job died
    proc = run_cli("inspect", fast_root, 3, "--tier", slow)
    assert proc.returncode == 0 and "tiers:       0 ok; 1 missing" in proc.stdout

    # A torn copy on the persistent tier is named, with what is wrong (inspect checks
    # presence and sizes, as for ROOT's copy; verify reads every byte).
    m = catalog.load_checkpoint(CheckpointManager(slow, read_only=True).storage, 1)
    data = Path(slow) / checkpoint_name(1) / m.files[0].path
    good = data.read_bytes()
    data.write_bytes(good[:-10])
    doc = json.loads(run_cli("inspect", fast_root, 1, "--tier", slow, "--json").stdout)
    assert doc["status"] == "ok" and doc["tiers"][1]["status"] == "corrupt"
    assert str(len(good)) in doc["tiers"][1]["problem"]
    data.write_bytes(good)

    # ROOT's copy gone (a wiped node): the persistent tier's copy is the one shown.
    shutil.rmtree(fast_root / checkpoint_name(1))
    proc = run_cli("inspect", fast_root, 1, "--tier", slow, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["path"] == str(Path(slow) / checkpoint_name(1)) and doc["status"] == "ok"
    assert "does not exist; showing the copy at" in proc.stderr
