# What the Lightning preludes share (each names it on a line "include: _regressor"):
# a LightningModule, a linear regressor with its data (8 batches an epoch), and the
# Trainer arguments that keep a run quiet on the CPU.
import lightning.pytorch as pl
import torch


class _Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=8)


_quiet = dict(
    accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
)
