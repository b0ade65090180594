"""``digits``: a small CNN on scikit-learn's bundled handwritten digits (1797 8x8 images, offline).

The set ships inside scikit-learn, so it is always present. A fixed, seeded 80/20 split gives 1437
training and 360 validation images. ``channels`` scales the network, so the same workload can be made
compute-bound (wide) or communication-bound (many parameters per FLOP via ``hidden``).

A concept-drift workload: ``--set model.drift_step=S`` changes the data from step S on, for training
and validation alike: ``model.drift=labels`` (default) renames every class (y -> y + 1 mod 10, so what
the model learned is now wrong), ``model.drift=inputs`` mirrors every image (the same classes, seen
differently). The validation curve then shows how fast training recovers its pre-drift quality.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from thinwire.config import check
from thinwire.workloads.base import Workload


@dataclasses.dataclass(kw_only=True)
class DigitsConfig:
    channels: int = 32
    hidden: int = 128
    drift_step: int = 0        # > 0: from this step on, train and validation data drift (a concept-drift workload)
    drift: str = "labels"      # labels: every class renamed (y -> y + 1 mod 10); inputs: images mirrored

    def __post_init__(self) -> None:
        check(1 <= self.channels <= 4096, "model.channels", self.channels, "an integer in [1, 4096]")
        check(1 <= self.hidden <= 65536, "model.hidden", self.hidden, "an integer in [1, 65536]")
        check(self.drift_step >= 0, "model.drift_step", self.drift_step, "an integer >= 0 (0: no drift)")
        check(self.drift in ("labels", "inputs"), "model.drift", self.drift, "labels or inputs")


class DigitsCNN(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = nn.Linear(2 * channels * 16, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class TensorPairs:
    """A map-style dataset over two aligned tensors, with a fast ``batch``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def batch(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.x[idx], self.y[idx]


def load() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``load_digits()`` data and target, read from the file it ships (``digits.csv.gz``: 64 pixel
    columns, then the label) without importing scikit-learn, which takes 1-2 s of every worker's start (it
    imports SciPy); ``load_digits`` itself where the file is not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data, bunch.target


def build(cfg: DigitsConfig, data: str | None = None) -> Workload:
    if data is not None:
        from thinwire.errors import ThinwireError

        raise ThinwireError(f"data: the digits workload uses scikit-learn's bundled set and takes no data path, got {data!r}. Remove --data.")
    images, labels = load()
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    n_val = len(x) // 5
    val, train = perm[:n_val], perm[n_val:]
    sets = (TensorPairs(x[train], y[train]), TensorPairs(x[val], y[val]))
    data_at = None
    if cfg.drift_step > 0:
        shift = (lambda a, b: (a, (b + 1) % 10)) if cfg.drift == "labels" else (lambda a, b: (a.flip(-1), b))
        drifted = tuple(TensorPairs(*shift(s.x, s.y)) for s in sets)
        data_at = lambda step: drifted if step >= cfg.drift_step else sets  # noqa: E731
    return Workload(
        model=DigitsCNN(cfg.channels, cfg.hidden),
        train=sets[0],
        val=sets[1],
        data_at=data_at,
        loss=F.cross_entropy,
        task="classification",
        info={"dataset": "sklearn digits", "train_size": len(train), "val_size": n_val},
        lr=2e-3, batch_size=64, steps=300,
    )
