"""``--timeout S`` on the commands that read or clean a root: an object-store endpoint
that accepts connections and never answers (a hung gateway, a stopped server) made
``list``, ``verify``, ``inspect``, ``prune`` and ``clean`` wait for their client's retries
(read timeouts of 60 s, retried by botocore and again by s3fs: many minutes, seen past
400 s). With ``--timeout`` each gives up after S seconds with exit 2 and one error line.

The endpoint here is a real listening socket on loopback whose connections are accepted
by the kernel and never read, so the S3 client waits exactly as it would on a hung one.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.cli.helpers import error_line, make_root, run_cli, run_json


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)  # never accepted: connections complete, requests are never read
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("command", "extra"),
    [
        ("list", []),
        ("verify", []),
        ("inspect", ["100"]),
        ("prune", ["--keep-last", "1"]),
        ("clean", []),
    ],
)
def test_a_command_on_a_silent_endpoint_gives_up_at_its_timeout(silent_endpoint, command, extra):
    root = "s3://bucket/run"
    args = [command, root, *extra]
    t0 = time.monotonic()
    proc = run_cli(*args, "--timeout", "2", env=_env(silent_endpoint), timeout_s=60)
    took = time.monotonic() - t0
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    line = error_line(proc)
    assert f"{command} {root} did not finish within 2 s (--timeout)" in line, line
    assert "run it again" in line
    assert took < 30, took  # the interpreter's start and the 2 s, not the client's retries


@pytest.mark.timeout(120)
def test_a_timeout_that_is_not_reached_changes_nothing(root):
    make_root(root, steps=(100, 200, 300))
    listed = run_json("list", root, "--timeout", "60")
    assert [e["step"] for e in listed["entries"]] == [100, 200, 300]
    assert run_json("verify", root, "--timeout", "60")["ok"] is True
    run_json("prune", root, "--keep-last", "1", "--timeout", "60")
    assert [e["step"] for e in run_json("list", root)["entries"]] == [300]


def test_the_timeout_must_be_a_positive_number_of_seconds(root):
    make_root(root, steps=(100,))
    proc = run_cli("list", root, "--timeout", "-1")
    assert proc.returncode == 2
    assert "--timeout" in proc.stderr
