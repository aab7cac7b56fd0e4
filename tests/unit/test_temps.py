"""When a temporary file of an atomic write counts as abandoned (``storage.temps``)."""

from __future__ import annotations

import os
import time

from atomic_checkpoint.storage.temps import (
    STALE_TEMP_S,
    abandoned_reason,
    parse_temp_name,
    temp_name,
)


def _dead_pid() -> int:
    """A pid no process has: the highest free one below the kernel's limit (tests/unit
    starts no process to get one)."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while pid > 300:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1
    raise AssertionError("no free pid found")


def test_names_parse_back_to_their_final_name_and_writer():
    name = temp_name("checkpoint.manifest.json")
    parsed = parse_temp_name(name)
    assert parsed is not None and parsed.final == "checkpoint.manifest.json"
    assert parsed.pid == os.getpid() and parsed.tag is not None
    assert temp_name("x") != temp_name("x")
    # Names written before the writer tag, by LocalStorage and the fsspec file:// path.
    assert parse_temp_name("lock.json.tmp-123-456").tag is None
    assert parse_temp_name("lock.json.tmp-123-456-789").final == "lock.json"
    for other in ("checkpoint-5", "model.tmp", "a.tmp-", "a.tmp-x-1", "rank-00000.safetensors"):
        assert parse_temp_name(other) is None


def test_a_live_writer_keeps_its_file_a_dead_one_does_not():
    now = time.time()
    mine = temp_name("run.json")
    assert abandoned_reason(mine, now, now=now) is None  # this process is alive
    dead = mine.replace(f"-{os.getpid()}-", f"-{_dead_pid()}-", 1)
    assert "gone" in (abandoned_reason(dead, now, now=now) or "")


def test_another_hosts_file_goes_only_once_it_is_old():
    now = time.time()
    other = "run.json.tmp-0123456789-4242-1-2"  # a tag that is not this host's
    assert parse_temp_name(other) is not None
    assert abandoned_reason(other, now - 60, now=now) is None
    assert abandoned_reason(other, None, now=now) is None  # age unknown: never
    assert "old" in (abandoned_reason(other, now - STALE_TEMP_S - 1, now=now) or "")
    legacy = "lock.json.tmp-1-2"  # pid 1 is alive, and untagged names only go by age
    assert abandoned_reason(legacy, now, now=now) is None
    assert abandoned_reason(legacy, now - STALE_TEMP_S - 1, now=now) is not None
    assert abandoned_reason("checkpoint.manifest.json", 0.0, now=now) is None
