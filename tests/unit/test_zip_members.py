"""``zip_members_problem``: an archive read for adoption (``torch.save`` files of the
HF and Accelerate rules, Lightning ``.ckpt`` files) is refused from its directory alone
when reading it whole could not end in reasonable time."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import torch

from atomic_checkpoint.adopt import zip_members_problem


def _listed_many_times(copies: int, inflated: int = 16 << 20) -> bytes:
    """One deflated member of ``inflated`` zero bytes at offset 0, listed ``copies``
    times by the central directory (what a zip bomb does)."""
    name = b"archive/data.pkl"
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    packed = co.compress(b"\0" * inflated) + co.flush()
    crc = zlib.crc32(b"\0" * inflated)
    local = struct.pack(
        "<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, crc, len(packed), inflated, len(name), 0
    )
    body = local + name + packed
    entry = (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50, 20, 20, 0, 8, 0, 0, crc, len(packed), inflated, len(name),
            0, 0, 0, 0, 0, 0,
        )
        + name
    )  # fmt: skip
    end = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, copies, copies, len(entry) * copies, len(body), 0
    )
    return body + entry * copies + end


def test_a_member_listed_many_times_is_refused_before_it_is_inflated() -> None:
    data = _listed_many_times(50)  # 800 MiB to inflate from about 17 KiB
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        problem = zip_members_problem(z, len(data), "x.ckpt")
    assert problem is not None and "overlaps another member" in problem, problem


def test_a_member_that_inflates_far_beyond_the_file_is_refused() -> None:
    data = _listed_many_times(1)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        problem = zip_members_problem(z, len(data), "x.ckpt")
    assert problem is not None and "inflate to" in problem, problem


def test_what_torch_save_writes_passes() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(1000.0), "step": 3}, buf)
    data = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert zip_members_problem(z, len(data), "x.pt") is None


def test_lightning_adoption_refuses_such_a_ckpt_at_once(tmp_path) -> None:
    # Adoption's completeness rule read every listed member (zipfile.testzip): the
    # review's 1.2 MB file listed a GiB 2,000 times (hours of inflating).
    from atomic_checkpoint import adopt

    (tmp_path / "epoch=0-step=10.ckpt").write_bytes(_listed_many_times(50))
    result = adopt(tmp_path, framework="lightning", dry_run=True)
    assert result.adopted == [] and "overlaps another member" in result.refused[10], result
