"""Damaged and malicious checkpoints: precise errors, no code execution, no reads
outside the checkpoint, no blocking.

``tests/unit/test_manager.py`` covers the basic damages (truncation, flipped bytes,
deleted files, mangled or future manifests, ``..`` and symlinked state files) for
discovery and restore. These tests add the proofs: a watch (inotify) on the files
outside the checkpoint shows that no reader ever opens them, a live pickle payload
shows that no reader executes it, and the cases the bad-input campaign
(``reliability.badinput``) found broken stay fixed.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
from reliability import badinput
from reliability.badinput import STATE, Ctx
from reliability.checks import expected_state, states_equal
from reliability.inotify import OpenWatch

from atomic_checkpoint import (
    CheckpointManager,
    CorruptCheckpointError,
    SingleProcessCoordinator,
    UnsafeCheckpointError,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(60)]


@pytest.fixture
def ctx(tmp_path) -> Ctx:
    """Steps 1 and 2 committed in ROOT; a valid state file of step 99 outside ROOT."""
    return badinput._setup(str(tmp_path / "case"))


def reader(ctx: Ctx, **kw) -> CheckpointManager:
    return CheckpointManager(ctx.root, read_only=True, coordinator=SingleProcessCoordinator(), **kw)


def bounded(fn, timeout_s: float = 10.0):
    """Run ``fn`` in a thread; fail the test if it blocks."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn} blocked for {timeout_s} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_the_proofs_can_fail(ctx):
    """The watch sees a read of the secret, and the payload runs when trusted: so the
    tests below that see neither prove something."""
    with OpenWatch([ctx.secret, ctx.outside]) as watch:
        with open(ctx.secret, "rb") as f:
            f.read(1)
        assert watch.events()
    badinput._pickle_payload(ctx)
    reader(ctx, allow_pickle=True).restore(2)
    assert os.path.exists(ctx.marker)


@pytest.mark.parametrize("case", ["pickle-payload", "pickle-payload-as-key"])
def test_a_pickle_payload_never_runs(ctx, case, caplog):
    damage = {c.name: c for c in badinput.CASES}[case].damage
    damage(ctx)
    mgr = reader(ctx)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert mgr.latest().step == 2  # the bytes match their manifest
        with pytest.raises(UnsafeCheckpointError, match="allow_pickle") as err:
            mgr.restore(2)
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore()
    assert STATE in str(err.value) and "checkpoint-2" in str(err.value)
    mgr.verify(2)  # integrity against the manifest is fine: nothing is unpickled
    assert not os.path.exists(ctx.marker)


@pytest.mark.parametrize(
    "case", ["escape-dotdot", "escape-absolute", "symlink-state-out", "symlink-manifest-out"]
)
def test_files_outside_the_checkpoint_are_never_read(ctx, case, caplog):
    # The manifest is made to match the outside file exactly: only the path checks
    # keep the secret (a valid state of step 99) from being restored as step 2.
    {c.name: c for c in badinput.CASES}[case].damage(ctx)
    with OpenWatch([ctx.secret, ctx.outside]) as watch:
        mgr = reader(ctx)
        with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
            latest = mgr.latest()
        assert latest.step == 1
        assert any("checkpoint-2" in r.getMessage() for r in caplog.records)
        with pytest.raises(UnsafeCheckpointError, match=r"outside|absolute|'\.\.'"):
            mgr.restore(2)
        with pytest.raises(UnsafeCheckpointError):
            mgr.verify(2)
        assert states_equal(mgr.restore(), expected_state(1, 0, badinput.SIZE))
        assert watch.events() == []


def test_a_fifo_in_place_of_a_state_file_never_blocks(ctx, caplog):
    # Found by the campaign: the manifest said 0 bytes, the FIFO's size is 0, so it
    # passed discovery, and opening it for reading blocked restore, verify and the CLI
    # forever (no writer ever comes).
    badinput._fifo_state(ctx)
    mgr = reader(ctx)
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        assert bounded(mgr.latest).step == 1
    assert any("regular" in r.getMessage() for r in caplog.records)
    with pytest.raises(CorruptCheckpointError, match="regular file"):
        bounded(lambda: mgr.restore(2))
    with pytest.raises(CorruptCheckpointError, match="regular file"):
        bounded(lambda: mgr.verify(2))


@pytest.mark.parametrize(
    "case",
    [
        "flip-length",
        "header-length-2**63",
        "offsets-overlap",
        "shape-bomb",
        "shape-[0,2**63]",
        "shape-[0,2**40,2**40]",
        "tree-nesting-bomb",
        "header-nesting-bomb",
        "dunder-attributes",
        "future-format-version",
    ],
)
def test_malicious_state_files_give_errors_that_name_the_file(ctx, case):
    # Found by the campaign: errors from parsing a state file did not say which file
    # (in a job of many ranks, which of them) was bad.
    {c.name: c for c in badinput.CASES}[case].damage(ctx)
    mgr = reader(ctx)
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError) as err:
            bounded(lambda v=verify: mgr.restore(2, verify=v))
        assert os.path.join("checkpoint-2", STATE) in str(err.value), err.value
