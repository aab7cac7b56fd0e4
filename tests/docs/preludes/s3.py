# An S3 endpoint for the samples that show one: the testbed's S3 server (moto, on loopback),
# whose address replaces the http://127.0.0.1:9000 they show; the credentials are in the
# environment (AWS_ACCESS_KEY_ID...), as on a machine with an instance role.
# needs: s3
# ruff: noqa: F401, F821  (the sample uses these names, or defines them)
import os

import boto3

from atomic_checkpoint import (
    CheckpointManager,
    KeepEvery,
    KeepLast,
    Tier,
    TieredCheckpointManager,
)

_s3 = boto3.client("s3", endpoint_url=os.environ["SAMPLE_S3_ENDPOINT"])
_s3.create_bucket(Bucket="my-bucket")
# --- sample ---
# What the sample built saves to the bucket, committed there by its manifest.
mgr.save(1000, {"w": [1.0]})
mgr.close()
_keys = [o["Key"] for o in _s3.list_objects_v2(Bucket="my-bucket")["Contents"]]
assert any(k.endswith("checkpoint-1000/checkpoint.manifest.json") for k in _keys), _keys
print("ok")
