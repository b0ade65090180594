"""What the framework workers share with the tests that check them: one small model, each rank's
batch at each step, and the reference gradient (every rank's gradient, averaged in fp32)."""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT, BATCH = 16, 64, 4, 32


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 2) + 0.1 * torch.randn(BATCH, OUT, generator=g)


def loss_fn(net, x, y):
    return nn.functional.mse_loss(net(x), y)


def grads(net) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in net.parameters()]


def reference_grads(world: int, step: int = 0) -> list[torch.Tensor]:
    """The fp32 average of every rank's gradient at the initial parameters."""
    total = None
    for r in range(world):
        net = make_net()
        loss_fn(net, *batch(r, step)).backward()
        g = grads(net)
        total = g if total is None else [a + b for a, b in zip(total, g)]
    return [t / world for t in total]


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(got, want))
    den = sum(float(b.pow(2).sum()) for b in want)
    return (num / den) ** 0.5
