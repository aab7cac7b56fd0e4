"""Adopting what a stock Lightning run left (``latest_checkpoint(adopt=True)``,
``atomic-checkpoint adopt --framework lightning``): checkpoints written by a real
``Trainer`` with its own plugin, named as ``ModelCheckpoint`` names them."""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from atomic_checkpoint import adopt
from atomic_checkpoint.integrations.lightning import (
    MANIFEST_SUFFIX,
    latest_checkpoint,
    verify_checkpoint,
)
from tests.cli.helpers import run_cli, run_json

pytest.importorskip("lightning")


def _stock_run(directory: Path, **checkpoint: object) -> None:
    """Four steps of a tiny model with Lightning's own plugin, saving every 2 steps."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=torch.Generator()))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    callback = ModelCheckpoint(
        dirpath=directory, every_n_train_steps=2, save_top_k=-1, **checkpoint
    )
    with warnings.catch_warnings():  # Lightning's own (hints, deprecations): not ours
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            max_steps=4,
            callbacks=[callback],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
        )
        trainer.fit(Model(), loader)


@pytest.mark.timeout(120)
def test_zero_padded_step_names_are_adopted_and_listed(tmp_path: Path) -> None:
    # filename="{epoch}-{step:05d}": `list` said adopt checks them, adopt said there
    # was nothing to adopt, and latest_checkpoint(adopt=True) returned None.
    ckpt = tmp_path / "ckpt"
    _stock_run(ckpt, filename="{epoch}-{step:05d}")
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["epoch=0-step=00002.ckpt", "epoch=0-step=00004.ckpt"], names
    assert adopt(ckpt, framework="lightning", dry_run=True).adopted == [2, 4]
    newest = latest_checkpoint(ckpt, adopt=True)
    assert newest == str(ckpt / "epoch=0-step=00004.ckpt")
    for step in (2, 4):
        info = verify_checkpoint(ckpt / f"epoch=0-step={step:05d}.ckpt", require_manifest=True)
        assert (info.global_step, info.epoch, info.adopted) == (step, 0, True)
    rows = {e["name"]: e for e in run_json("list", ckpt)["entries"]}
    assert (rows["epoch=0-step=00004.ckpt"]["step"], rows["epoch=0-step=00004.ckpt"]["status"]) == (
        4,
        "ok",
    ), rows
    again = run_cli("adopt", ckpt, "--framework", "lightning")
    assert again.returncode == 0, (again.stdout, again.stderr)


@pytest.mark.timeout(120)
def test_a_renamed_copy_is_refused_by_the_global_step_it_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A copy of the step-2 file named epoch=9-step=99.ckpt was adopted as step 99 (the
    # step taken from its name) and returned as the newest: a resume went back to 2.
    ckpt = tmp_path / "ckpt"
    _stock_run(ckpt)
    shutil.copy(ckpt / "epoch=0-step=2.ckpt", ckpt / "epoch=9-step=99.ckpt")
    dry = adopt(ckpt, framework="lightning", dry_run=True)
    assert dry.adopted == [2, 4], dry
    assert dry.refused[99] == "it records global_step 2, not 99: a copied or renamed file?"
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        newest = latest_checkpoint(ckpt, adopt=True)
    assert newest == str(ckpt / "epoch=0-step=4.ckpt")
    assert "a copied or renamed file?" in caplog.text
    assert not (ckpt / ("epoch=9-step=99.ckpt" + MANIFEST_SUFFIX)).exists()
    assert verify_checkpoint(newest, require_manifest=True).global_step == 4
    cli = run_cli("adopt", ckpt, "--framework", "lightning")
    assert cli.returncode == 1, (cli.stdout, cli.stderr)
    assert "not 99: a copied or renamed file?" in cli.stdout + cli.stderr


class _Config:
    """A hyper-parameter object: unpickling it needs code from outside torch."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


@pytest.mark.timeout(60)
def test_a_file_whose_step_needs_unsafe_unpickling_is_adopted_by_its_name(
    tmp_path: Path,
) -> None:
    # Its global_step is read with weights_only=True (no code from the file runs): a
    # file whose hyper-parameters need more keeps the step of its name, as before.
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {"epoch": 0, "global_step": 2, "hyper_parameters": {"config": _Config(0.1)}}
    TorchCheckpointIO().save_checkpoint(state, ckpt / "epoch=0-step=2.ckpt")
    dry = adopt(ckpt, framework="lightning", dry_run=True)
    assert dry.adopted == [2] and not dry.refused, dry
    assert latest_checkpoint(ckpt, adopt=True).endswith("epoch=0-step=2.ckpt")
    assert (ckpt / ("epoch=0-step=2.ckpt" + MANIFEST_SUFFIX)).exists()


@pytest.mark.timeout(120)
def test_a_torn_last_ckpt_is_refused_and_said_by_adopt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # save_top_k=1 kept step 2's file, last.ckpt held step 4 and a crash tore it.
    # `adopt --framework lightning` adopted step 2 and said "0 refused", exit 0: the
    # newest state was not mentioned, and the job resumed from an older step.
    ckpt = tmp_path / "ckpt"
    _stock_run(ckpt, save_last=True)
    last = ckpt / "last.ckpt"
    last.write_bytes(last.read_bytes()[:3000])
    dry = adopt(ckpt, framework="lightning", dry_run=True)
    assert "last.ckpt" in dry.unreadable and not dry.ok, dry
    assert "torn by a crash during the save" in dry.unreadable["last.ckpt"]
    cli = run_cli("adopt", ckpt, "--framework", "lightning")
    assert cli.returncode == 1, (cli.stdout, cli.stderr)
    assert "REFUSED last.ckpt: its step cannot be read" in cli.stdout, cli.stdout
    assert "1 refused" in cli.stdout and "last.ckpt" in cli.stderr, (cli.stdout, cli.stderr)
    doc = run_json("adopt", ckpt, "--framework", "lightning", expect_rc=1)
    assert [r["name"] for r in doc["refused"] if r["step"] is None] == ["last.ckpt"], doc
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        newest = latest_checkpoint(ckpt, adopt=True)
    assert newest is not None and newest.endswith("step=4.ckpt"), newest
