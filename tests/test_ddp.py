"""DDP through thinwire's hook averages gradients exactly like a single process on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(n: int = 24):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def _reference_grads() -> list[torch.Tensor]:
    model = _model()
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _ddp_grads(rank: int, world: int, spec: str, bucket_mb: float) -> list[torch.Tensor]:
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(), bucket_cap_mb=bucket_mb)
    state = thinwire.attach(model, spec, error_feedback=False, min_compress_bytes=0)
    x, y = _batch()
    share = len(x) // world
    for _ in range(2):  # the second step runs after DDP rebuilt its buckets
        model.zero_grad()
        xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        nn.functional.mse_loss(model(xs), ys).backward()
    state.close()
    return [p.grad.clone() for p in model.parameters()], state.stats()


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_hook_matches_single_process(world):
    ref = _reference_grads()
    for grads, stats in run_ranks(_ddp_grads, world, "none", 0.001):
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        assert stats["counts"]["none"] >= 4 and stats["bytes_sent"] > 0  # several buckets, all via the hook


def test_attach_refuses_plain_module_and_double_attach():
    import thinwire

    with pytest.raises(TypeError, match=r"thinwire.attach needs a DistributedDataParallel model, got Sequential"):
        thinwire.attach(_model(), "none")

    def twice(rank, world):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(_model())
        state = thinwire.attach(model, "none")
        try:
            thinwire.attach(model, "int8")
        except ValueError as e:
            return str(e)
        finally:
            state.close()

    (msg,) = run_ranks(twice, 1)
    assert "already attached" in msg
