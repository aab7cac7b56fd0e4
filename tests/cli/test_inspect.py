"""``atomic-checkpoint inspect``: manifest, files, tensor names/shapes/dtypes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from atomic_checkpoint.layout import MANIFEST_NAME
from tests.cli.helpers import (
    error_line,
    make_root,
    mixed_root,
    rewrite_manifest,
    run_cli,
    run_json,
    state_file,
    truncate,
)

EXPECTED_TENSORS = [
    {"name": "model.b", "dtype": "I64", "shape": [5]},
    {"name": "model.w", "dtype": "F32", "shape": [3, 4]},
    {"name": "model.mask", "dtype": "BOOL", "shape": [2, 3]},
]


@pytest.mark.timeout(60)
def test_inspect_healthy_checkpoint(root):
    rid = make_root(root, (100, 200))
    on_disk = json.loads((root / "checkpoint-200" / MANIFEST_NAME).read_text())

    doc = run_json("inspect", root, 200)
    assert doc["status"] == "ok" and doc["problem"] is None
    assert doc["name"] == "checkpoint-200" and doc["path"] == str(root / "checkpoint-200")
    m = doc["manifest"]
    assert m["step"] == 200 and m["run_id"] == rid and m["commit_seq"] == 2
    assert m["world_size"] == 1 and m["state_kind"] == "per_rank"
    assert m["metrics"] == {"eval_loss": 1 / 200, "acc": 0.2}
    assert m["metadata"] == {"s": 200}
    assert m["created_unix"] == on_disk["created_unix"]
    assert m["size_bytes"] == state_file(root, 200).stat().st_size
    [f] = doc["files"]
    assert (f["path"], f["size_bytes"], f["checksum"], f["rank"]) == (
        "rank-00000.safetensors",
        on_disk["files"][0]["size"],
        on_disk["files"][0]["checksum"],
        0,
    )
    assert sorted(f["tensors"], key=lambda t: t["name"]) == sorted(
        EXPECTED_TENSORS, key=lambda t: t["name"]
    )

    proc = run_cli("inspect", root, 200, entry_point=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("checkpoint-200\n")
    # "ok" is what inspect checked (it reads no data), not a verification.
    assert (
        "status:      ok (manifest and file sizes; no data read: `atomic-checkpoint verify` " in out
    )
    for text in (
        f"run id:      {rid}",
        "commit seq:  2",
        "world size:  1",
        "state kind:  per_rank",
        "metrics:     acc=0.2 eval_loss=0.005",
        '"s": 200',
        on_disk["files"][0]["checksum"],
        "3 tensor(s), 23 element(s)",
    ):
        assert text in out, text
    tensor_rows = {ln.split()[0]: ln.split(None, 2)[1:] for ln in out.splitlines()[-3:]}
    assert tensor_rows == {"model.b": ["I64", "[5]"], "model.w": ["F32", "[3, 4]"],
                           "model.mask": ["BOOL", "[2, 3]"]}  # fmt: skip


@pytest.mark.timeout(120)
def test_inspect_torch_state_and_files_checkpoint(root):
    import torch
    from safetensors.numpy import save_file

    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
    mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
    with mgr.saving(2) as d:
        save_file({"emb": np.zeros((4, 8), dtype=np.float16)}, str(d / "model.safetensors"))
        (d / "config.json").write_text('{"hidden": 8}')
    mgr.close()

    doc = run_json("inspect", root, 1)
    tensors = {t["name"]: (t["dtype"], t["shape"]) for t in doc["files"][0]["tensors"]}
    assert tensors["model.weight"] == ("BF16", [2, 3])
    assert tensors["model.bias"] == ("BF16", [2])
    assert tensors["optim.state.0.momentum_buffer"] == ("BF16", [2, 3])

    doc = run_json("inspect", root, 2)
    assert doc["manifest"]["state_kind"] == "files"
    files = {f["path"]: f for f in doc["files"]}
    assert files["config.json"]["tensors"] is None and files["config.json"]["problem"] is None
    assert files["model.safetensors"]["tensors"] == [
        {"name": "emb", "dtype": "F16", "shape": [4, 8]}
    ]


@pytest.mark.timeout(90)
def test_inspect_corrupt_foreign_and_missing(tmp_path):
    root, _ = mixed_root(tmp_path)
    secret = (tmp_path / "outside" / "secret.safetensors").read_bytes()

    # Truncated state file: the manifest is shown, the problem named, exit 1.
    doc = run_json("inspect", root, 200, expect_rc=1)
    assert doc["status"] == "corrupt" and "is 10 bytes" in doc["problem"]
    assert doc["manifest"]["step"] == 200
    assert doc["files"][0]["tensors"] is None
    assert "runs past the end" in doc["files"][0]["problem"]
    proc = run_cli("inspect", root, 200)
    assert proc.returncode == 1
    assert "status:      corrupt: file 'rank-00000.safetensors' is 10 bytes" in proc.stdout
    assert "is corrupt" in error_line(proc)

    # A symlink leading out of the checkpoint is never read.
    doc = run_json("inspect", root, 800, expect_rc=1)
    assert doc["files"][0]["tensors"] is None
    assert "resolves outside the checkpoint" in doc["files"][0]["problem"]
    assert "model.w" not in json.dumps(doc) and secret.decode("latin-1")[20:60] not in json.dumps(
        doc
    )

    # A manifest naming "../" is refused as a whole.
    doc = run_json("inspect", root, 700, expect_rc=1)
    assert doc["manifest"] is None and doc["files"] == [] and "'..'" in doc["problem"]
    proc = run_cli("inspect", root, 700)
    assert proc.returncode == 1 and "'..'" in error_line(proc) and proc.stdout == ""

    # Another run's checkpoint: shown, marked foreign, not an error.
    doc = run_json("inspect", root, 1000)
    assert doc["status"] == "foreign" and "other-run" in doc["problem"]

    proc = run_cli("inspect", root, 600)
    assert proc.returncode == 1 and "has no manifest" in error_line(proc)
    proc = run_cli("inspect", root, 4242)
    assert proc.returncode == 1 and "no checkpoint step 4242" in error_line(proc)
    proc = run_cli("inspect", root)
    assert proc.returncode == 2 and "STEP" in error_line(proc)


@pytest.mark.timeout(60)
def test_inspect_header_problem_with_right_size(root):
    """A state file whose size matches but whose header is garbage: the header read
    fails cleanly (no traceback), names the problem, and the checkpoint is corrupt
    (restore rejects it), although the sizes match."""
    make_root(root, (1,))
    path = state_file(root, 1)
    size = path.stat().st_size
    path.write_bytes(b"\xff" * size)
    doc = run_json("inspect", root, 1, expect_rc=1)
    assert doc["status"] == "corrupt" and "header length" in doc["problem"]
    assert doc["files"][0]["tensors"] is None
    assert "header length" in doc["files"][0]["problem"]
    truncate(path, 0)
    assert run_json("inspect", root, 1, expect_rc=1)["status"] == "corrupt"


@pytest.mark.timeout(60)
def test_inspect_shows_the_storage_domain_of_a_node_local_copy(root):
    make_root(root, (1,))
    assert run_json("inspect", root, 1)["manifest"]["domain_count"] == 1
    # What a node-local copy of a 2-domain checkpoint records (see domains.py).
    rewrite_manifest(root, 1, domain={"ranks": [0], "count": 2})
    m = run_json("inspect", root, 1)["manifest"]
    assert (m["domain_count"], m["domain_ranks"]) == (2, [0])
    assert "domains:     2 (this copy holds ranks 0)" in run_cli("inspect", root, 1).stdout
