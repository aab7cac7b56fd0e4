"""The commit's requests on an object store stay few as ranks grow (issue 14): on the S3
test server, a save by 4 ranks (threads, one real TCPStore, ``benchmarks/scale.py``)
checks that every rank's file is there with one listing, not one HEAD request per file
from the leader (16,384 of them, one after another, at 4096 ranks of four files).
"""

from __future__ import annotations

import pytest
from benchmarks import scale
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401

pytestmark = [pytest.mark.netfs, pytest.mark.timeout(120)]


def test_a_save_on_s3_costs_one_put_per_file_and_one_listing(request, tmp_path):
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    row = scale.s3_saves(4, 1, str(tmp_path), server=server, bucket=bucket)
    for http in row["http_per_save"]:
        # The ranks' 4 files, the in-progress marker and the manifest.
        assert http.get("PUT") == 6, http
        # No size query per file: one listing of the attempt (one per 1,000 files), and
        # one of the step's directory before anything is written.
        assert http.get("HEAD", 0) == 0 and http.get("LIST") == 2, http
        assert sum(http.values()) <= 10, http
