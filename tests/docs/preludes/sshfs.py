# What docs/storage/network.md's sample assumes: a network filesystem mounted at
# /mnt/nfs (here a real sshfs mount of an export on loopback, at mnt/nfs in the working
# directory; the test rewrites the sample's /mnt/nfs to it). After it, the manager has
# detected the mount and saves through it.
# needs: sshfs:mnt/nfs
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
from atomic_checkpoint import CheckpointManager, KeepLast
from atomic_checkpoint.storage.detect import mount_of

# --- sample ---
assert mount_of("mnt/nfs/runs").fstype == "fuse.sshfs", mount_of("mnt/nfs/runs")
assert mgr.storage.capabilities.coherent is False, mgr.storage.capabilities
assert mgr.commit_strategy == "rename", mgr.commit_strategy
for _step in (1, 2, 3, 4):
    mgr.save(_step, {"w": [float(_step)]})
assert [c.step for c in mgr.checkpoints()] == [2, 3, 4], mgr.checkpoints()
mgr.close()
