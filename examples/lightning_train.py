"""PyTorch Lightning with thinwire: the digits classifier trained on 2 CPU processes, gradients int8
on the wire. Either launcher works:

    torchrun --nproc-per-node 2 examples/lightning_train.py --codec int8
    python examples/lightning_train.py --codec int8          # Lightning starts the 2 processes
    torchrun --nproc-per-node 2 examples/lightning_train.py --sync diloco:period=20

Needs ``pip install 'thinwire[lightning]'``. The only thinwire line is the strategy.
"""

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from thinwire.integrations.lightning import ThinwireStrategy


class Digits(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def loaders(batch: int):
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    train, val = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])
    return DataLoader(train, batch_size=batch, shuffle=True), DataLoader(val, batch_size=256)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8", help="thinwire codec spec (thinwire codecs lists them)")
    ap.add_argument("--sync", default="allreduce", help="a sync mode, e.g. local:period=4 or diloco:period=50")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/lightning", help="checkpoints go here")
    args = ap.parse_args()
    torch.manual_seed(0)
    train, val = loaders(batch=32)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
                         strategy=ThinwireStrategy(args.codec, sync=args.sync),   # <- thinwire
                         max_steps=args.steps, default_root_dir=args.out, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = Digits()
    trainer.fit(model, train)
    acc = trainer.validate(model, val, verbose=False)[0]["val_acc"]
    if trainer.is_global_zero:
        s = trainer.strategy.comm.stats()
        print(f"val accuracy {acc:.3f}; {s['bytes_sent'] / 1e6:.2f} MB sent for "
              f"{s['bytes_raw'] / 1e6:.2f} MB averaged ({args.codec}, {args.sync}); world {trainer.world_size}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ static destructors, which can abort a finished run at exit ("terminate called ...")
