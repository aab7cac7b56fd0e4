"""Bad arguments to the integrations' entry points are refused when they are passed,
saying what to pass, before anything is written: a flag given as text ("false" is
truthy: `allow_pickle="false"` unpickled a checkpoint's objects, `preemption="false"`
armed the signal handlers, `missing_ok="false"` started from scratch,
`latest_checkpoint(adopt="false")` wrote manifests), a negative bound or step, a number
for a retention policy, something other than the framework object.

In one process, with the frameworks' real objects (an Accelerator, a DCP checkpoint, a
Lightning checkpoint file); no training runs."""

from __future__ import annotations

import os

import pytest
import torch

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.integrations import dcp as adcp


def _files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns
    )


class _Custom:  # not plain data: loads only with allow_pickle=True
    def __init__(self) -> None:
        self.x = 42


def test_load_dcp_refuses_flags_given_as_text_and_a_negative_step(tmp_path):
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        adcp.save_dcp(mgr, 1, {"w": torch.ones(2), "extra": _Custom()})
    with CheckpointManager(root) as mgr:
        sd = {"w": torch.zeros(2), "extra": None}
        for name in ("allow_pickle", "verify", "missing_ok", "adopt_existing"):
            with pytest.raises(TypeError, match=f"{name} must be True or False, got 'false'"):
                adcp.load_dcp(mgr, sd, **{name: "false"})
        assert sd["extra"] is None and torch.equal(sd["w"], torch.zeros(2))  # nothing loaded
        with pytest.raises(ValueError, match="step"):
            adcp.load_dcp(mgr, sd, step=-3)
    with CheckpointManager(tmp_path / "empty") as mgr, pytest.raises(TypeError, match="missing"):
        adcp.load_dcp(mgr, {"w": torch.zeros(2)}, missing_ok="false")


def test_accelerate_entry_points_check_their_arguments_before_writing(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from atomic_checkpoint.integrations import accelerate as aacc

    project = tmp_path / "project"
    project.mkdir()
    acc = accelerate.Accelerator(
        cpu=True, project_config=accelerate.utils.ProjectConfiguration(project_dir=str(project))
    )
    with pytest.raises(TypeError, match=r"expected an accelerate\.Accelerator, got NoneType"):
        aacc.make_atomic(None)
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        aacc.make_atomic(acc, timeout_s=-1)
    with pytest.raises(TypeError, match=r"retention must be a policy such as KeepLast\(3\)"):
        aacc.make_atomic(acc, retention=2)
    with pytest.raises(TypeError, match="verify must be True or False"):
        aacc.make_atomic(acc, verify="false")
    with pytest.raises(ValueError, match="step"):
        aacc.save_state(acc, step=-1)
    with pytest.raises(TypeError, match="missing_ok must be True or False"):
        aacc.load_state(acc, missing_ok="false")
    assert _files(project) == []  # nothing was opened or written
    assert aacc.load_state(acc, missing_ok=True) is None  # the good call still works


def test_hf_settings_are_checked_at_make_atomic_not_at_train():
    pytest.importorskip("transformers")
    from atomic_checkpoint.integrations import hf

    with pytest.raises(TypeError, match="preemption must be True or False, got 'false'"):
        hf.AtomicCheckpointCallback(preemption="false")
    with pytest.raises(TypeError, match="adopt_existing must be True or False"):
        hf.AtomicCheckpointCallback(adopt_existing="false")
    with pytest.raises(ValueError, match="grace_s must be a positive"):
        hf.make_atomic(None, grace_s=-5)
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        hf.make_atomic(None, timeout_s=-1)
    with pytest.raises(TypeError, match="retention must be a policy"):
        hf.AtomicCheckpointCallback(retention=3)
    assert hf.AtomicCheckpointCallback(grace_s=30).settings.grace_s == 30.0


def test_lightning_refuses_text_flags_and_a_non_plugin_before_writing(tmp_path):
    pytest.importorskip("lightning")
    from atomic_checkpoint.integrations import lightning as alt

    d = tmp_path / "ckpts"
    d.mkdir()
    torch.save({"global_step": 2, "state_dict": {}}, d / "epoch=0-step=2.ckpt")  # stock file
    for name in ("adopt", "full", "include_weights_only"):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            alt.latest_checkpoint(d, **{name: "false"})
    assert _files(d) == ["epoch=0-step=2.ckpt"]  # not adopted: no manifest written
    with pytest.raises(TypeError, match="checkpoint_io must be an AtomicCheckpointIO"):
        alt.AsyncAtomicCheckpointIO("x")
