"""What the tests of two sshfs nodes (two default-caching mounts of one export,
``sshfs_nodes``) share."""

from __future__ import annotations

from pathlib import Path

from tests.testbed import SshfsMount


def dir_made_on_node_a(nodes: tuple[SshfsMount, SshfsMount], name: str) -> tuple[Path, Path]:
    """Makes the directory ``name`` of the export through node A; returns its path
    through node A and through node B."""
    a, b = nodes
    (a.path / name).mkdir()
    return a.path / name, b.path / name
