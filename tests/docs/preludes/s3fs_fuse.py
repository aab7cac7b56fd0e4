# What docs/storage/s3fs-fuse.md's sample assumes: a bucket mounted with s3fs-fuse at
# /mnt/bucket (here a real s3fs mount of a bucket of the testbed's S3 server, at
# mnt/bucket in the working directory; the test rewrites the sample's /mnt/bucket to it).
# After it, the manager has detected the mount and commits by marker.
# needs: s3fs:mnt/bucket
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.storage.detect import mount_of

# --- sample ---
assert mount_of("mnt/bucket/runs").fstype == "fuse.s3fs", mount_of("mnt/bucket/runs")
assert mgr.commit_strategy == "marker", mgr.commit_strategy
mgr.save(1, {"w": [1.0]})
assert mgr.restore(1)["w"] == [1.0]
mgr.close()
