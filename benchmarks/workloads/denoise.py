"""A benchmark workload that is neither charlm nor digits: image denoising, a regression.

    thinwire train --workload benchmarks.workloads.denoise:build --nproc 2   # from the repo root

Data (real, always present): the two photographs scikit-learn ships (``load_sample_images``: a
Chinese temple and a flower, 427 x 640 RGB). Training patches are cut from the left 512 columns of
both, validation patches from the right 112 (no pixel in both). The input is a patch with Gaussian
noise of standard deviation ``noise`` added (drawn once per patch), the target the clean patch,
scored by mean squared error on pixels in [0, 1] (the noisy input itself scores ``noise**2``).

Model: a small fully convolutional network in the manner of DnCNN (Zhang et al. 2017): ``depth`` 3x3
convolutions of ``width`` channels with ReLU, predicting the noise, which is subtracted from the input
(residual learning). Unlike charlm (a transformer, cross-entropy over bytes) and digits (a classifier),
it is compute-heavy per parameter (every weight is used at every pixel) and its outputs are continuous.
Options are keyword arguments (``--set model.width=96``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from thinwire import Workload
from thinwire.config import check

TRAIN_COLS = 512   # columns [0, 512) train, [528, 640) validation: a 16-column gap
VAL_FROM = 528


class ResidualDenoiser(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU()]
        layers.append(nn.Conv2d(width, 3, 3, padding=1))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.body(x)


class Patches:
    """Map-style patches of fixed images with fixed noise (drawn once per patch from a seeded generator,
    so every rank, restart and world size sees the same input for the same index)."""

    def __init__(self, images: torch.Tensor, corners: list[tuple[int, int, int]], size: int, noise: float,
                 seed: int) -> None:
        self.images, self.corners, self.size = images, corners, size
        g = torch.Generator().manual_seed(seed)
        self.noise = noise * torch.randn(len(corners), images.shape[1], size, size, generator=g)

    def __len__(self) -> int:
        return len(self.corners)

    def _target(self, i: int) -> torch.Tensor:
        k, r, c = self.corners[i]
        return self.images[k, :, r:r + self.size, c:c + self.size]

    def __getitem__(self, i: int):
        y = self._target(i)
        return y + self.noise[i], y

    def batch(self, indices: list[int]):
        y = torch.stack([self._target(i) for i in indices])
        return y + self.noise[torch.as_tensor(indices, dtype=torch.long)], y


def _corners(n_images: int, rows: int, col_from: int, col_to: int, size: int, stride: int) -> list[tuple[int, int, int]]:
    return [(k, r, c) for k in range(n_images) for r in range(0, rows - size + 1, stride)
            for c in range(col_from, col_to - size + 1, stride)]


def build(width: int = 64, depth: int = 5, patch: int = 16, stride: int = 8, noise: float = 0.1) -> Workload:
    check(isinstance(width, int) and 1 <= width <= 1024, "model.width", width, "an integer in 1..1024")
    check(isinstance(depth, int) and 2 <= depth <= 64, "model.depth", depth, "an integer in 2..64")
    check(isinstance(patch, int) and patch in range(4, 129, 2), "model.patch", patch, "an even integer in 4..128")
    check(isinstance(stride, int) and 1 <= stride <= patch, "model.stride", stride, f"an integer in 1..{patch}")
    check(isinstance(noise, (int, float)) and 0 < noise <= 1, "model.noise", noise, "a number in (0, 1]")
    from sklearn.datasets import load_sample_images

    images = torch.from_numpy(np.stack(load_sample_images().images)).float().permute(0, 3, 1, 2) / 255.0
    n, _, rows, cols = images.shape
    train = Patches(images, _corners(n, rows, 0, TRAIN_COLS, patch, stride), patch, noise, seed=1)
    val = Patches(images, _corners(n, rows, VAL_FROM, cols, patch, stride), patch, noise, seed=2)
    return Workload(model=ResidualDenoiser(width, depth), train=train, val=val, loss=F.mse_loss, task="regression",
                    info={"dataset": "sklearn sample images (china.jpg, flower.jpg)", "train_size": len(train),
                          "val_size": len(val), "patch": patch, "noise": noise},
                    lr=1e-3, batch_size=32, steps=300)
