"""Large checkpoint roots, made fast: thousands of real checkpoints for discovery tests
and benchmarks.

One checkpoint is saved the normal way (``CheckpointManager.save``); every other step
is a copy of its files with its manifest rewritten for that step (step, commit sequence
number, commit time), written straight to the filesystem or the S3 server. Each copy is
a valid checkpoint in every respect that discovery checks (manifest, names, sizes and
checksums), at a fraction of a real save's cost (no coordination, no fsync).

Example::

    root = make_local_root(tmp_path / "root", steps=range(2000))
    mgr = CheckpointManager(root)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.layout import MANIFEST_NAME, checkpoint_name
from atomic_checkpoint.manifest import Manifest


def _template_state() -> dict[str, Any]:
    return {"w": np.arange(256, dtype=np.float32)}


def _step_manifest(template: Manifest, step: int) -> bytes:
    """The template's manifest as the commit of ``step`` (a later, distinct commit)."""
    return dataclasses.replace(
        template,
        step=step,
        commit_seq=template.commit_seq + step + 1,
        created_unix=template.created_unix + step,
        metrics={"loss": 1.0 / (step + 1)},
    ).to_json_bytes()


def make_local_root(root: Path, steps: Iterable[int], *, run_id: str | None = None) -> Path:
    """``root`` holding a valid checkpoint of every step in ``steps`` (one run).

    The first step is saved by a real ``CheckpointManager``; the others copy it.
    """
    steps = sorted(steps)
    with CheckpointManager(root, run_id=run_id) as mgr:
        mgr.save(steps[0], _template_state())
    first = root / checkpoint_name(steps[0])
    template = Manifest.from_json_bytes((first / MANIFEST_NAME).read_bytes())
    files = {f.path: (first / f.path).read_bytes() for f in template.files}
    for step in steps[1:]:
        d = root / checkpoint_name(step)
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
        (d / MANIFEST_NAME).write_bytes(_step_manifest(template, step))
    return root


def make_s3_root(
    server: Any,
    bucket: str,
    prefix: str,
    steps: Iterable[int],
    *,
    run_id: str | None = None,
    threads: int = 8,
) -> str:
    """``s3://bucket/prefix`` holding a valid checkpoint of every step in ``steps``; the
    copies are put through boto3 from ``threads`` threads. Returns the URL."""
    steps = sorted(steps)
    url = f"s3://{bucket}/{prefix}"
    with CheckpointManager(url, run_id=run_id, storage_options=server.storage_options()) as mgr:
        mgr.save(steps[0], _template_state())
    client = server.boto3_client()
    base = f"{prefix}/{checkpoint_name(steps[0])}"
    template = Manifest.from_json_bytes(
        client.get_object(Bucket=bucket, Key=f"{base}/{MANIFEST_NAME}")["Body"].read()
    )
    files = {
        f.path: client.get_object(Bucket=bucket, Key=f"{base}/{f.path}")["Body"].read()
        for f in template.files
    }

    def put(step: int) -> None:
        d = f"{prefix}/{checkpoint_name(step)}"
        for rel, data in files.items():
            client.put_object(Bucket=bucket, Key=f"{d}/{rel}", Body=data)
        client.put_object(
            Bucket=bucket, Key=f"{d}/{MANIFEST_NAME}", Body=_step_manifest(template, step)
        )

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, steps[1:]))
    return url
