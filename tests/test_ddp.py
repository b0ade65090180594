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


def _compiled_first(rank, world, who):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    compiled = torch.compile(DDP(_model()))  # wrapped, not yet compiled (compiling happens at the first call)
    try:
        thinwire.attach(compiled, "int8") if who == "attach" else thinwire.sync(compiled, "delayed", codec="int8")
    except TypeError as e:
        return str(e)
    return "taken"


@pytest.mark.parametrize("who", ["attach", "sync"])
def test_a_compiled_ddp_model_is_told_to_attach_before_compiling(who):
    """`attach(torch.compile(DDP(net)))` was told to wrap the model in DDP, which it was."""
    (msg,) = run_ranks(_compiled_first, 1, who)
    assert msg.startswith(f"thinwire.{who} needs the DistributedDataParallel model itself, got it compiled "
                          "(OptimizedModule)") and f"call thinwire.{who} on the DDP model first, then torch.compile" in msg, msg


def _attach_error(rank, world, model_kind, kwargs):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 2)) if model_kind == "sparse" \
        else _model()
    try:
        thinwire.attach(DDP(net), "int8", **kwargs).close()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind, kwargs, match", [
    ("sparse", {}, r"thinwire.attach: 0 makes sparse gradients \(sparse=True\).*build the embedding with sparse=False"),
    ("dense", {"timeout_s": -1}, r"thinwire.attach: timeout_s must be a number of seconds > 0 or None .*got -1"),
    ("dense", {"timeout_s": 0}, r"timeout_s must be a number of seconds > 0 or None .*got 0"),
    ("dense", {"error_feedback": "no"}, r"error_feedback must be True or False, got 'no'"),
    ("dense", {"warmup_steps": 2.5}, r"warmup_steps must be an integer >= 0, got 2.5"),
])
def test_attach_refuses_what_its_hook_cannot_run_in_one_line(kind, kwargs, match):
    """A sparse embedding failed at its first backward inside a codec (aten::aminmax on SparseCPU); a negative
    timeout inside gloo (enforce fail), and 0 silently meant no timeout; error_feedback="no" was true."""
    (msg,) = run_ranks(_attach_error, 1, kind, kwargs)
    assert msg is not None and __import__("re").search(match, msg), msg


def _peer_hangs(rank: int, world: int, spec: str):
    """Rank 2 stops answering at the fourth step (a host whose link went down); the others' step must fail."""
    import time

    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    state = thinwire.attach(model, spec, min_compress_bytes=0, timeout_s=2)
    x, y = _batch()
    try:
        for step in range(5):
            if rank == 2 and step == 3:
                time.sleep(4)
                return "gone"
            nn.functional.mse_loss(model(x), y).backward()
        return "trained on"
    except RuntimeError as e:
        return f"failed at step {step}: {str(e)[:60]}"
    finally:
        state.close()


@pytest.mark.parametrize("spec", ["none", "bf16", "randomk:ratio=0.5", "int8"])
def test_a_peer_that_stops_answering_fails_the_step_with_every_codec(spec):
    """The all-reduces issued from DDP's thread (fp32, bf16, random-k) completed their step after the timeout
    without an error, leaving the bucket's own values as the "average": a host killed in an elastic run left
    the others stepping on their own gradients, ~10x faster, until the next checkpoint's collective failed."""
    got = run_ranks(_peer_hangs, 3, spec, timeout=60)
    assert got[2] == "gone"
    assert all(r.startswith("failed at step 3") for r in got[:2]), got


def _float64_grads(rank: int, world: int, spec: str):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model().double())
    state = thinwire.attach(model, spec, min_compress_bytes=0)
    x, y = _batch()
    share = len(x) // world
    try:
        for _ in range(2):
            model.zero_grad()
            nn.functional.mse_loss(model(x[rank * share:(rank + 1) * share].double()),
                                   y[rank * share:(rank + 1) * share].double()).backward()
        return [p.grad.clone() for p in model.parameters()]
    finally:
        state.close()


def test_powersgd_runs_on_float64_parameters():
    """Its Q started as float32 and the product with a float64 gradient failed ("double != float")."""
    a, b = run_ranks(_float64_grads, 2, "powersgd:rank=2")
    assert all(g.dtype == torch.float64 and torch.isfinite(g).all() for g in a)
    assert all(torch.equal(g, h) for g, h in zip(a, b))


def _another_models_state(rank, world):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    small, big = DDP(torch.nn.Linear(4, 2)), DDP(torch.nn.Linear(8, 2))
    first, second = (thinwire.attach(m, "int8", warmup_steps=0, min_compress_bytes=0) for m in (small, big))
    try:
        small(torch.randn(3, 4)).sum().backward()
        saved = first.state_dict()
        assert saved["residuals"]["params"], "int8 leaves residuals"
        try:
            second.load_state_dict(saved)
        except ValueError as e:
            return str(e)
        return "loaded"
    finally:
        first.close()
        second.close()


def test_a_comm_state_of_another_model_is_refused():
    """Another model's residuals were taken without a word and dropped where their sizes did not fit."""
    msg = run_ranks(_another_models_state, 2)[0]
    assert msg.startswith("CommState.load_state_dict: this state is another model's: its residual of parameter 0 "
                          "holds 8 values, and this model's parameter 0 has 16"), msg
