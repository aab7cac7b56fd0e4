"""Watches a root while a job saves: how many checkpoints are discoverable at once, and
whether any discoverable one is torn.

Usage: observer.py ROOT STOP_FILE OUT_JSON DEADLINE_S
"""

import json
import os
import sys
import time

from atomic_checkpoint import CheckpointError, LocalStorage
from atomic_checkpoint.catalog import read_manifest, validate
from atomic_checkpoint.layout import parse_checkpoint_name

root, stop_file, out, deadline_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
storage = LocalStorage(root)
polls = max_seen = torn = checked = 0
problems = []
deadline = time.monotonic() + deadline_s
while time.monotonic() < deadline and not os.path.exists(stop_file):
    committed = []
    for name in storage.listdir(""):
        if parse_checkpoint_name(name) is None:
            continue
        try:
            manifest = read_manifest(storage, name)
        except CheckpointError:
            continue  # no manifest: not discoverable
        try:
            validate(storage, name, manifest)
            committed.append(name)
            checked += 1
        except CheckpointError as exc:
            try:
                read_manifest(storage, name)
            except CheckpointError:
                continue  # un-committed by rotation between the two reads
            torn += 1
            problems.append(f"{name}: {exc}")
    polls += 1
    time.sleep(0.001)  # leave the two cores to the job being watched
    max_seen = max(max_seen, len(committed))
with open(out, "w") as f:
    json.dump(
        {
            "polls": polls,
            "max_seen": max_seen,
            "torn": torn,
            "checked": checked,
            "problems": problems[:10],
        },
        f,
    )
