"""Roots on mounts, however they are spelled: a relative path, ``./out/``, ``~/...`` or
a symlink to an s3fs-fuse or sshfs mount is that mount (the commit strategy and the
network-filesystem rules follow the mount table), and a FUSE filesystem of a kind the
library does not know is treated with caution, with one warning naming it.

All on real mounts: s3fs-fuse over moto on 127.0.0.1, and sshfs over a private sshd
on loopback (see tests/testbed).
"""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.cli.helpers import run_json
from tests.testbed._util import require_binary, resolve_mountpoint, unmount, wait_for_mount
from tests.testbed.pytest_fixtures import (  # noqa: F401
    s3_bucket,
    s3_server,
    s3fs_fuse_mount,
    sshfs_export,
    sshfs_nodes,
)
from tests.testbed.sshfs import _HOST_ALIAS

from atomic_checkpoint import CheckpointManager, LocalStorage, StorageCapabilities
from atomic_checkpoint.layout import MANIFEST_NAME

pytestmark = pytest.mark.netfs


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": np.full(1000, step, dtype=np.float32)}


def keys(server: Any, bucket: str, prefix: str = "") -> list[str]:
    out = server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


@pytest.mark.timeout(120)
def test_relative_symlinked_and_home_roots_on_s3fs_commit_with_markers(
    s3fs_fuse_mount, s3_server, s3_bucket, tmp_path, monkeypatch
):
    mnt = s3fs_fuse_mount.path
    link = tmp_path / "link-to-bucket"
    link.symlink_to(mnt)
    monkeypatch.chdir(mnt.parent)
    monkeypatch.setenv("HOME", str(mnt.parent))
    roots = {
        "rel": f"{mnt.name}/rel",  # "ckpt"
        "dot": f"./{mnt.name}/dot/",  # the Trainer's usual "./out", with a trailing slash
        "sym": str(link / "sym"),  # a symlink to the mount
        "home": f"~/{mnt.name}/home",  # "~/..." as a config file writes it
    }
    for prefix, root in roots.items():
        mgr = CheckpointManager(root)
        assert mgr.storage.capabilities.name == "fuse.s3fs", (root, mgr.storage.capabilities)
        assert mgr.commit_strategy == "marker", root
        mgr.save(1, state(1))
        assert mgr.restore()["step"] == 1
        mgr.close()
        # The files are in the bucket under that prefix, committed in place: nothing
        # was staged and renamed (a rename here is a copy per object).
        listed = keys(s3_server, s3_bucket, f"{prefix}/")
        assert f"{prefix}/checkpoint-1/{MANIFEST_NAME}" in listed, (root, listed)
        assert not [k for k in listed if "/.pending/checkpoint-" in k], listed
    assert not (mnt.parent / "~").exists()  # "~" was never a directory name

    # The command line normalises a relative root the same way.
    listed = run_json("list", f"{mnt.name}/rel", cwd=str(mnt.parent))
    assert listed["root"] == str(mnt / "rel")
    assert [e["step"] for e in listed["entries"] if e["status"] == "ok"] == [1]


@pytest.mark.timeout(120)
def test_relative_and_symlinked_roots_on_sshfs_follow_network_rules(
    sshfs_nodes, tmp_path, monkeypatch
):
    node_a, node_b = sshfs_nodes
    monkeypatch.chdir(node_a.path.parent)
    link = tmp_path / "link-to-node-b"
    link.symlink_to(node_b.path)
    writer = CheckpointManager(f"./{node_a.path.name}/run/")  # node A, relative
    reader_root = link / "run"  # node B, through a symlink
    try:
        for mgr_storage in (writer.storage, LocalStorage(str(reader_root))):
            caps = mgr_storage.capabilities
            assert caps.name == "sshfs" and not caps.coherent and not caps.dir_fsync, caps
        reader = CheckpointManager(str(reader_root), read_only=True)
        assert reader.storage.capabilities.name == "sshfs"
        # Node B lists the root before node A saves: its sshfs client now caches an
        # empty listing for ~20 s. The network rules refresh before listing.
        assert reader.latest() is None
        writer.save(1, state(1))
        latest = reader.latest()
        assert latest is not None and latest.step == 1
        assert reader.restore()["step"] == 1
    finally:
        writer.close()


def _mount_unknown_fuse(export: Any, target: Path, subtype: str) -> None:
    """sshfs, but listed in the mount table as ``fuse.<subtype>`` (FUSE's ``subtype``
    option): a real FUSE filesystem whose kind the library cannot know."""
    subprocess.run(
        [
            require_binary("sshfs"),
            "-F",
            str(export.ssh_config),
            f"{_HOST_ALIAS}:{export.export}",
            str(target),
            "-o",
            f"subtype={subtype}",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    wait_for_mount(target, f"fuse.{subtype}", None, 10.0, "sshfs mount with a subtype")


@pytest.mark.timeout(120)
def test_an_unknown_fuse_mount_is_treated_as_unknown_with_one_warning(
    sshfs_export, tmp_path, caplog
):
    target = resolve_mountpoint(tmp_path / "mystery")
    _mount_unknown_fuse(sshfs_export, target, "mysteryfs")
    caplog.set_level(logging.INFO, logger="atomic_checkpoint")
    try:
        root = target / "run"
        mgr = CheckpointManager(root)
        caps = mgr.storage.capabilities
        assert caps.name == "fuse.mysteryfs", caps
        assert not caps.atomic_dir_rename and not caps.coherent and not caps.exclusive_create
        assert mgr.commit_strategy == "marker"
        mgr.save(1, state(1))
        assert mgr.restore()["step"] == 1
        mgr.close()
        CheckpointManager(root, read_only=True).latest()
        warnings = [r.getMessage() for r in caplog.records if "unknown kind" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "fuse.mysteryfs" in warnings[0] and "capabilities=StorageCapabilities" in warnings[0]
        # It named strategy='rename' too, which warns that the rename is not atomic and
        # leaves the mount incoherent: the capabilities are what says what it does.
        assert "strategy=" not in warnings[0], warnings[0]
        assert "atomic_dir_rename=True, coherent=True" in warnings[0], warnings[0]
        # The override the warning names: this mount's rename is sshfs', atomic.
        told = LocalStorage(
            root,
            capabilities=StorageCapabilities(
                name="fuse.mysteryfs", atomic_dir_rename=True, coherent=True
            ),
        )
        with CheckpointManager(told) as mgr:
            assert mgr.commit_strategy == "rename"
            assert mgr.latest().step == 1
    finally:
        unmount(target, fuse=True)
