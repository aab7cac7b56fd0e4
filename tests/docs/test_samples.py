"""Every Python sample of README.md and of the documentation site runs as written.

The samples are found and run as ``tests/docs/samples.py`` says: each runnable one in a
fresh interpreter, in an empty temporary directory, after its prelude (tests/docs/preludes/)
and with the real services that prelude needs: the testbed's S3 server (one for the module),
a real sshfs mount, a real s3fs-fuse mount. The site itself is built, in strict
mode, by ``scripts/docs.sh``; these tests check what can go stale without building it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import samples as S
from tests.testbed.pytest_fixtures import require_facility, s3_server  # noqa: F401 (fixture)
from tests.testbed.s3 import ACCESS_KEY, REGION, SECRET_KEY, S3fsFuseMount
from tests.testbed.sshfs import SshfsExport

SAMPLES = S.samples()


def test_every_python_block_says_whether_it_runs() -> None:
    blocks = S.all_blocks()
    where = {b.path.relative_to(S.REPO).as_posix() for b in blocks}
    assert "README.md" in where and "docs/getting-started.md" in where, where
    assert S.problems(blocks) == []


def test_an_unmarked_or_unexplained_block_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)\n```\n\n"
        "<!-- sample: skip -->\n```python\nprint(2)\n```\n\n"
        "<!-- sample: run setup=nope -->\n```python\nprint(3)\n```\n\n"
        "<!-- sample: run prelude=nope -->\n```python\nprint(4)\n```\n\n"
        "<!-- sample: run continue prelude=s3 -->\n```python\nprint(5)\n```\n"
    )
    found = S.problems(S.python_blocks(page))
    assert len(found) == 5, found
    assert "without a marker" in found[0]
    assert "must say why" in found[1]
    assert "unknown setup 'nope'" in found[2]
    assert "no prelude tests/docs/preludes/nope.py" in found[3]
    assert "a `continue` sample runs after the one above" in found[4]


def test_a_prelude_takes_in_the_parts_it_includes() -> None:
    (hf,) = [s for s in SAMPLES if s.blocks[0].prelude == "hf"]
    script = hf.script()
    assert "# include:" not in script
    # The shared part stands where the prelude names it: before the sample uses it.
    assert script.index("import Tokens as _Tokens") < script.index(hf.blocks[0].code)
    assert hf.needs_torch


def test_a_prelude_wraps_its_sample_and_says_what_it_needs(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- sample: run prelude=s3fs_fuse exit=3 -->\n```python\nmgr = CheckpointManager("
        '"/mnt/bucket/x", storage_options={"endpoint_url": "http://127.0.0.1:9000"})\n```\n'
    )
    (sample,) = S.samples([page])
    assert sample.needs() == ["s3fs:mnt/bucket"] and sample.exit == 3
    script = sample.script("http://127.0.0.1:4567")
    prelude, rest = script.split("mgr = CheckpointManager(")
    assert "import mount_of" in prelude and S.SHOWN_S3_ENDPOINT not in rest
    assert rest.startswith('"mnt/bucket/x"') and "http://127.0.0.1:4567" in rest
    assert "fuse.s3fs" in rest  # the check after the sample
    assert "fuse.s3fs" not in sample.script(check=False).split("CheckpointManager(")[1]


_buckets = itertools.count(1)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.where for s in SAMPLES])
def test_sample_runs(sample: S.Sample, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if sample.needs_torch:
        pytest.importorskip("torch", reason="this sample needs torch (pip install torch)")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOMIC_CHECKPOINT_", "AWS_"))}
    needs = sample.needs()
    endpoint = None
    with contextlib.ExitStack() as services:
        if any(n == "s3" or n.startswith("s3fs:") for n in needs):
            server = request.getfixturevalue("s3_server")
            endpoint = server.endpoint_url
            env.update(
                SAMPLE_S3_ENDPOINT=endpoint,
                AWS_ACCESS_KEY_ID=ACCESS_KEY,
                AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                AWS_DEFAULT_REGION=REGION,
            )
        for need in needs:
            kind, _, where = need.partition(":")
            if kind == "sshfs":
                require_facility("sshfs")
                export = services.enter_context(SshfsExport(tmp_path / "sshfs-srv"))
                export.mount(work / where)
            elif kind == "s3fs":
                require_facility("s3fs_fuse")
                bucket = server.create_bucket(f"docs-{os.getpid()}-{next(_buckets)}")
                services.enter_context(S3fsFuseMount(server, bucket, work / where))
            elif kind not in ("s3", "launch"):
                raise AssertionError(f"{sample.where}: its prelude needs {need!r}: unknown")
        ranks = sample.launch_ranks()
        if ranks is None:
            script = tmp_path / "sample.py"
            script.write_text(sample.script(endpoint))
            argv = [sys.executable, str(script)]
        else:  # a training script, as its first line names it, on `ranks` processes
            script = work / "train.py"
            script.write_text(sample.script(endpoint, check=False))
            (tmp_path / "tmp").mkdir()  # torchrun leaves its torchelastic_* dirs in $TMPDIR
            env["TMPDIR"] = str(tmp_path / "tmp")
            argv = [sys.executable, "-m", "atomic_checkpoint.launch", "--standalone"]
            argv += [f"--nproc-per-node={ranks}", "--monitor-interval=0.1", script.name]
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    report = (
        f"--- script\n{script.read_text()}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    if ranks is not None and proc.returncode == sample.exit and sample.after_script().strip():
        check = tmp_path / "check.py"
        check.write_text(sample.after_script())
        after = subprocess.run(
            [sys.executable, str(check)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert after.returncode == 0, (
            f"what the sample at {sample.where} did is not what its text says:\n{report}\n"
            f"--- check\n{check.read_text()}\n--- its stdout\n{after.stdout}\n"
            f"--- its stderr\n{after.stderr}"
        )
    if sample.raises is not None:
        last = proc.stderr.strip().splitlines()[-1:] or [""]
        assert proc.returncode != 0 and last[0].split(":")[0].endswith(sample.raises), (
            f"the sample at {sample.where} should end with {sample.raises}, as its comment "
            f"shows (exit {proc.returncode}):\n{report}"
        )
        return
    assert proc.returncode == sample.exit, (
        f"the sample at {sample.where} failed (exit {proc.returncode}, expected "
        f"{sample.exit}):\n{report}"
    )
    missing = S.missing_output(sample.shown_output(), proc.stdout)
    assert missing == [], (
        f"the sample at {sample.where} does not print what its comments show: {missing}\n"
        f"--- stdout\n{proc.stdout}"
    )


def test_shown_output_is_checked_against_what_is_printed() -> None:
    shown = ["[200, 300]: step 100 rotated out", "200 True", "[3.0]"]
    assert S.missing_output(shown, "[200, 300]\nnoise\n200 True\n[3.0]\n") == []
    assert S.missing_output(shown, "[200, 3000]\n200 True\n[3.0]\n") == [shown[0]]
    assert S.missing_output(["[2]"], "[\n") == ["[2]"]
