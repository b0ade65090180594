"""thinwire's DDP hook on 2-4 gloo processes: averages within each codec's bound, any bucket layout."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from thinwire.compress.hook import Policy

N = 6000  # values per parameter; two parameters -> several buckets with a tiny bucket cap


class Probe(nn.Module):
    """loss = sum(w * c_rank): the gradient of w on each rank is the known vector c_rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(N))
        self.m = nn.Parameter(torch.zeros(60, 100))

    def forward(self, c_a, c_m):
        return (self.a * c_a).sum() + (self.m * c_m).sum()


def grads_of(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(100 * rank + step)
    scale = torch.logspace(-3, 1, N)[torch.randperm(N, generator=g)]  # mixed magnitudes
    return torch.randn(N, generator=g) * scale, torch.randn(60, 100, generator=g)


def _hook_average(rank, world, spec, steps, bucket_mb, nonfinite_rank=-1, policy="skip", ef=True, scale=1.0,
                  bad=float("nan")):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Probe(), bucket_cap_mb=bucket_mb)
    state = thinwire.attach(model, spec, error_feedback=ef, min_compress_bytes=0, nonfinite=policy)
    out = []
    try:
        for step in range(steps):
            model.zero_grad()
            c_a, c_m = (g * scale for g in grads_of(rank, step))
            if rank == nonfinite_rank:
                c_a[7] = bad
            model(c_a, c_m).backward()
            out.append((model.module.a.grad.clone(), model.module.m.grad.clone()))
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e), "stats": state.stats()}
    finally:
        state.close()
    return {"grads": out, "stats": state.stats(), "state": state.state_dict()}


def true_mean(world, step=0):
    parts = [grads_of(r, step) for r in range(world)]
    return sum(p[0] for p in parts) / world, sum(p[1] for p in parts) / world


def rel(a, b):
    return float((a - b).norm() / b.norm())


# codec spec -> bound on the relative error of one step's average (no residual yet)
BOUNDS = {"none": 1e-6, "fp16": 1e-3, "bf16": 8e-3, "int8": 0.02, "int8:stochastic=true": 0.03, "bfp": 0.02,
          "qsgd": 0.3, "topk:ratio=0.3": 0.6, "randomk:ratio=0.3": 0.9, "sign": 0.99, "powersgd:rank=4": 0.99}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("spec", list(BOUNDS))
def test_average_within_codec_bound(spec, world):
    # step 1 runs after DDP rebuilt its buckets with the 10 KB cap (step 0 has one 1 MB first bucket)
    results = run_ranks(_hook_average, world, spec, 2, 0.01, -1, "skip", False)
    ref_a, ref_m = true_mean(world, 1)
    first = results[0]["grads"][1]
    for r in results:  # every rank holds the same average
        assert torch.equal(r["grads"][1][0], first[0]) and torch.equal(r["grads"][1][1], first[1])
    err = rel(torch.cat([first[0], first[1].flatten()]), torch.cat([ref_a, ref_m.flatten()]))
    assert err <= BOUNDS[spec], f"{spec}: relative error {err:.4f}"
    stats = results[0]["stats"]
    assert stats["collectives"] >= 3, "one bucket at step 0, two after the rebuild"
    dense = stats["bytes_raw"] * 2 * (world - 1) / world  # what fp32 all-reduce would have sent
    if spec.startswith("topk"):  # falls back to dense when the all-gather would cost more
        assert stats["bytes_sent"] <= dense + 16 * stats["collectives"], stats
    elif spec != "none":
        assert stats["bytes_sent"] < 0.9 * dense, stats


def _local_average(spec, world):
    """What an all-gather scheme must produce: sum over ranks of each rank's own round trip."""
    from thinwire.compress.codecs.base import Meta
    from thinwire.compress.spec import parse_codec_spec

    codec = parse_codec_spec(spec)
    total = None
    for r in range(world):
        a, m = grads_of(r)
        x = torch.cat([a, m.flatten()]) / world  # a single bucket holds the parameters in order
        # seeds differ per bucket; deterministic codecs make the check exact
        y = codec.roundtrip(x, Meta(numel=x.numel(), rank=r))
        total = y if total is None else total + y
    return total[: a.numel()], total[a.numel():].view(60, 100)


@pytest.mark.parametrize("spec", ["int8", "bfp", "topk:ratio=0.1", "sign:block=64"])
def test_two_ranks_equal_mean_of_round_trips(spec):
    results = run_ranks(_hook_average, 2, spec, 1, 100.0)  # one bucket
    exp_a, exp_m = _local_average(spec, 2)
    got_a, got_m = results[0]["grads"][0]
    torch.testing.assert_close(got_a, exp_a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_m, exp_m, rtol=1e-6, atol=1e-7)


def test_powersgd_matches_reference_low_rank():
    from thinwire.compress.codecs.powersgd import orthogonalize_

    world, rank = 2, 4
    results = run_ranks(_hook_average, world, f"powersgd:rank={rank}", 1, 100.0)
    ms = [grads_of(r)[1] / world for r in range(world)]
    q = torch.randn(100, rank, generator=torch.Generator().manual_seed(1))  # parameter index 1: m
    p = sum(m @ q for m in ms)
    orthogonalize_(p)
    q = sum(m.t() @ p for m in ms)
    expected_m = p @ q.t()
    got_a, got_m = results[0]["grads"][0]
    torch.testing.assert_close(got_m, expected_m, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_a, true_mean(world)[0], rtol=1e-6, atol=1e-6)  # vectors go uncompressed


def _powersgd_rank_one(rank, world, bad_step):
    """PowerSGD rank 4 on a Linear layer whose gradient is rank 1 on every rank (batch 1, inputs along one
    direction); rank 1's input infinite at ``bad_step``. Each step's average against the exact one."""
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    d = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ddp = DDP(nn.Linear(64, 64, bias=False))
    state = thinwire.attach(ddp, "powersgd:rank=4", min_compress_bytes=0)
    errors = []
    for step in range(6):
        x = (d * (step + 1 + rank)).unsqueeze(0)
        if rank == 1 and step == bad_step:
            x[0, 0] = float("inf")
        ddp.module.weight.grad = None
        ddp(x).sum().backward()
        exact = torch.ones(64, 1) @ (d * (step + 1 + (world - 1) / 2)).unsqueeze(0)
        errors.append(rel(ddp.module.weight.grad, exact))
    state.close()
    return errors


@pytest.mark.parametrize("bad_step", [None, 2])
def test_powersgd_sends_a_gradient_of_lower_rank_exactly_and_recovers_from_a_non_finite_step(bad_step):
    """A gradient of rank below r is captured exactly (PyTorch's hook: relative error 0): Gram-Schmidt turned the
    dependent columns' rounding noise into unit vectors, so a step delivered 2x the gradient, then 0.8x, ... A
    non-finite step was kept in the warm-start Q, and every later step was NaN."""
    errors = run_ranks(_powersgd_rank_one, 2, bad_step)[0]
    for step, e in enumerate(errors):
        if step == bad_step:
            assert e != e, errors  # NaN: the step every rank skips
        else:
            assert e < 1e-4, errors


def _subgroups(rank, world):
    """Two DDP replicas groups of two ranks each: plain DDP, thinwire's hook and a sync mode, one step each."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = []
    for how in ("ddp", "attach", "sync"):
        torch.manual_seed(0)
        ddp = DDP(nn.Linear(8, 1), process_group=groups[rank // 2])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        mode = thinwire.attach(ddp, "none") if how == "attach" else \
            thinwire.sync(ddp, "local:period=1,warmup=0", optimizer=opt) if how == "sync" else None
        with mode.no_sync() if how == "sync" else contextlib.nullcontext():
            ddp(torch.full((1, 8), float(rank + 1))).sum().backward()
        mode.step(opt) if how == "sync" else opt.step()
        out.append(ddp.module.weight.detach().clone())
        if mode is not None:
            mode.close()
    return out


def test_a_ddp_model_over_a_group_of_its_own_is_averaged_over_that_group():
    """thinwire averaged over a new group of every rank, whatever group DDP was given (replicas of a sharded
    model): each replica group got the average of all four."""
    for rank, (ddp, attached, synced) in enumerate(run_ranks(_subgroups, 4)):
        assert torch.equal(attached, ddp) and torch.allclose(synced, ddp, atol=1e-7), (rank, ddp, attached, synced)


def test_powersgd_result_scales_with_the_gradient():
    """Tiny gradients (deep layers, divided by the world size) get the same approximation, scaled:
    an absolute epsilon in Gram-Schmidt, or a warm-start Q of the gradient's own scale, shrank it
    (entries of 1e-5 delivered about half of the projection)."""
    world, steps = 2, 3
    unit = run_ranks(_hook_average, world, "powersgd:rank=2", steps, 100.0)
    tiny = run_ranks(_hook_average, world, "powersgd:rank=2", steps, 100.0, -1, "skip", True, 1e-6)
    for (a1, m1), (a2, m2) in zip(unit[0]["grads"], tiny[0]["grads"]):
        torch.testing.assert_close(m2 / 1e-6, m1, rtol=1e-3, atol=1e-3 * float(m1.abs().max()))
        torch.testing.assert_close(a2 / 1e-6, a1, rtol=1e-3, atol=1e-3 * float(a1.abs().max()))


@pytest.mark.parametrize("spec", ["powersgd:rank=2", "int8", "topk:ratio=0.05"])
def test_many_buckets_many_steps_on_gloo(spec):
    """PyTorch's PowerSGD hook aborts here on gloo; thinwire's ordered comm thread does not."""
    results = run_ranks(_hook_average, 3, spec, 4, 0.005)
    assert len(results[0]["grads"]) == 4
    for step in range(4):
        assert torch.equal(results[0]["grads"][step][0], results[2]["grads"][step][0])


def test_error_feedback_accumulates_what_was_dropped():
    """With top-k and error feedback, the running sum of sent averages tracks the true running sum."""
    world, steps = 2, 12
    results = run_ranks(_hook_average, world, "topk:ratio=0.1", steps, 100.0)
    sent = sum(g[0] for g in results[0]["grads"])
    truth = sum(true_mean(world, s)[0] for s in range(steps))
    residual = sum(r["state"]["residuals"]["params"]["0"] for r in results)  # what is still held back
    torch.testing.assert_close(sent + residual, truth, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec,bad", [("int8", float("nan")), ("bf16", float("inf")), ("bf16", float("nan")),
                                     ("fp16", -float("inf")), ("randomk:ratio=0.1", float("nan"))])
def test_nonfinite_gradient_skips_and_keeps_residuals(spec, bad):
    """Every scheme: a summable payload carries the news in band (bf16 clamps an infinity to a finite
    value, so the codec's output alone would not show it), the others in a flag."""
    results = run_ranks(_hook_average, 2, spec, 2, 100.0, 1, "skip", True, 1.0, bad)
    for r in results:
        a, _ = r["grads"][0]
        assert torch.isnan(a).all(), "every rank must see the non-finite step"
        assert r["stats"]["skipped_nonfinite"] >= 1
        for res in r["state"]["residuals"]["params"].values():
            assert torch.isfinite(res).all()


def test_nonfinite_raise_policy():
    results = run_ranks(_hook_average, 2, "int8", 1, 100.0, 0, "raise")
    for r in results:
        assert "non-finite gradient in bucket 0 at step 0" in r["error"]  # DDP re-raises it as RuntimeError
        # a job on the engine thread fails as an error, not an exception object DDP tries to read as its result
        assert "Unable to cast" not in r["error"]


def test_error_feedback_invariant():
    from thinwire.compress.codecs.base import Meta
    from thinwire.compress.feedback import ErrorFeedback
    from thinwire.compress.spec import parse_codec_spec

    fb, codec = ErrorFeedback(), parse_codec_spec("sign")
    layout = ((0, 1000),)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grad = torch.randn(1000, generator=g)
        old = fb.residuals.get("b", ((), torch.zeros(1000)))[1].clone()
        corrected = fb.corrected("b", grad, layout)
        sent = codec.roundtrip(corrected, Meta(numel=1000))
        kept = corrected - sent
        fb.update("b", corrected, sent, layout)
        new = fb.residuals["b"][1]
        assert new is corrected and torch.equal(new, kept)  # in place: no new buffer per step
        torch.testing.assert_close(sent + new, grad + old, rtol=0, atol=1e-6)
        assert not torch.equal(new, torch.zeros(1000))
    sd = fb.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(sd)
    torch.testing.assert_close(other.corrected("b", torch.zeros(1000), layout), fb.residuals["b"][1])


def test_a_residual_of_another_size_is_not_added_to_a_parameter(caplog):
    """Pieces kept by parameter index (a checkpoint, a re-bucketing) whose size is not the parameter's belong to
    another parameter (a checkpoint that indexed them otherwise): dropped with a warning, not a size clash."""
    from thinwire.compress.feedback import ErrorFeedback

    fb = ErrorFeedback()
    fb.load_state_dict({"params": {"0": torch.ones(6), "1": torch.full((4,), 2.0)}, "buckets": {}})
    with caplog.at_level("WARNING", logger="thinwire.compress"):
        got = fb.corrected("b", torch.zeros(7), ((0, 3), (1, 4)))  # parameter 0 now has 3 values, not 6
    assert got.tolist() == [0.0] * 3 + [2.0] * 4 and "does not fit bucket b's parameters" in caplog.text


def test_all_finite_sees_nan_and_both_infinities_in_any_float_dtype():
    from thinwire.compress.schemes import all_finite

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1000).to(dtype)
        assert all_finite(x) and all_finite(x[:0])
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[517] = bad
            assert not all_finite(y), (dtype, bad)


def test_bf16_sends_like_pytorchs_bf16_hook_and_keeps_no_residual():
    """bf16 needs no error feedback (unbiased rounding, fp32's range): the hook's average is exactly
    PyTorch's bf16 hook's (divide, cast, sum in bf16, cast back) and no residual memory is held."""
    results = run_ranks(_hook_average, 2, "bf16", 2, 100.0)
    for step in range(2):
        (a0, m0), (a1, m1) = grads_of(0, step), grads_of(1, step)
        for got, x, y in ((results[0]["grads"][step][0], a0, a1), (results[0]["grads"][step][1], m0, m1)):
            want = ((x / 2).to(torch.bfloat16).float() + (y / 2).to(torch.bfloat16).float()).to(torch.bfloat16).float()
            assert torch.equal(got, want)
    for r in results:
        assert r["stats"]["residual_bytes"] == 0 and not r["state"]["residuals"]["params"]


def test_unbiased_randomk_keeps_no_residual_and_its_average_stays_the_gradients_scale():
    """randomk:rescale=true is unbiased (values scaled by numel/k): with a residual it added back what the scaled
    values already carried, and the residual grew by about numel/k each step (a diverged run's val loss 11.5)."""
    steps = 6
    results = run_ranks(_hook_average, 2, "randomk:ratio=0.1,rescale=true", steps, 100.0)
    for r in results:
        assert r["stats"]["residual_bytes"] == 0 and not r["state"]["residuals"]["params"]
    mean = torch.cat([g.flatten() for g in true_mean(2, steps - 1)])
    got = torch.cat([g.flatten() for g in results[0]["grads"][steps - 1]])
    assert got.norm() < 10 * mean.norm()  # with the residual: ~steps x numel/k times larger


class _Int8ThenBf16(Policy):
    def codec_for(self, bucket, numel, step):
        from thinwire.compress.spec import parse_codec_spec

        return parse_codec_spec("int8" if step == 0 else "bf16")

    def describe(self):
        return "int8, then bf16"


def _switch(rank, world):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Probe(), bucket_cap_mb=100.0)
    state = thinwire.attach(model, _Int8ThenBf16(), min_compress_bytes=0)
    sent = []
    for step in range(2):
        model.zero_grad()
        model(*grads_of(rank, step)).backward()
        sent.append(model.module.a.grad.clone())
    state.close()
    return {"sent": sent, "residual_bytes": state.stats()["residual_bytes"]}


def test_a_bucket_switched_to_bf16_sends_what_the_earlier_codec_held_back():
    results = run_ranks(_switch, 2)
    truth = [true_mean(2, s)[0] for s in range(2)]
    int8_error = rel(results[0]["sent"][0], truth[0])
    assert rel(results[0]["sent"][0] + results[0]["sent"][1], truth[0] + truth[1]) < int8_error / 2
    assert all(r["residual_bytes"] == 0 for r in results)


class _Alternate(Policy):
    """Even buckets bf16 (one all-reduce: issued from DDP's thread when the communication thread is
    idle), odd buckets int8 (all-gather: always on the communication thread)."""

    def codec_for(self, bucket, numel, step):
        from thinwire.compress.spec import parse_codec_spec

        return parse_codec_spec("int8" if bucket % 2 else "bf16")

    def describe(self):
        return "bf16 / int8 by bucket"


def _mixed_paths(rank, world, policy, steps, bucket_mb, offload=False):
    import threading

    import thinwire
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    issued = []

    def recording(plain):
        def collective(*args, **kwargs):
            issued.append((threading.current_thread().name, bool(kwargs.get("async_op"))))
            return plain(*args, **kwargs)
        return collective

    for name in ("all_reduce", "all_gather", "all_to_all_single"):
        setattr(dist, name, recording(getattr(dist, name)))
    model = DDP(Probe(), bucket_cap_mb=bucket_mb)
    state = thinwire.attach(model, policy, min_compress_bytes=0)
    state.offload = offload
    grads = []
    for step in range(steps):
        model.zero_grad()
        model(*grads_of(rank, step)).backward()
        grads.append((model.module.a.grad.clone(), model.module.m.grad.clone()))
    engine = [t for t in os.listdir("/proc/self/task") if open(f"/proc/self/task/{t}/comm").read().strip() == "tw-engine"]
    state.close()
    return {"grads": grads, "issued": issued, "engine_threads": len(engine)}


def test_a_single_all_reduce_bucket_is_issued_from_ddps_thread():
    """bf16 (one bucket) goes out as PyTorch's hook sends it: async, from the backward's thread, no
    hand-over to the communication thread; the average is PyTorch's bf16 hook's, bit for bit."""
    results = run_ranks(_mixed_paths, 2, "bf16", 2, 100.0)
    for r in results:
        assert r["issued"] and all(name == "MainThread" and is_async for name, is_async in r["issued"]), r["issued"]
    (a0, _), (a1, _) = grads_of(0, 1), grads_of(1, 1)
    want = ((a0 / 2).to(torch.bfloat16).float() + (a1 / 2).to(torch.bfloat16).float()).to(torch.bfloat16).float()
    assert torch.equal(results[0]["grads"][1][0], want)


def test_offloaded_every_bucket_runs_on_the_engine_thread_with_the_same_result():
    """With an offload engine (cluster spec ``nic:``) nothing is issued from DDP's thread, even a bucket of
    one all-reduce; the engine thread carries the OS name the emulator moves onto the engine's CPU; the
    averages are the inline path's, bit for bit."""
    inline = run_ranks(_mixed_paths, 2, "bf16", 2, 100.0)
    offloaded = run_ranks(_mixed_paths, 2, "bf16", 2, 100.0, True)
    for r, ref in zip(offloaded, inline):
        assert r["issued"] and all(name == "thinwire-comm" for name, _ in r["issued"]), r["issued"]
        assert r["engine_threads"] == 1
        for got, want in zip(r["grads"][1], ref["grads"][1]):
            assert torch.equal(got, want)


def test_buckets_on_both_paths_keep_one_collective_order():
    """Many buckets, bf16 and int8 alternating, 3 ranks: some buckets go out from DDP's thread and some
    from the communication thread, and every rank still issues the same sequence (else gloo aborts
    or mixes buckets up)."""
    results = run_ranks(_mixed_paths, 3, _Alternate(), 4, 0.005)
    threads = {name for r in results for name, _ in r["issued"]}
    assert {"MainThread", "thinwire-comm"} <= threads, threads
    for step in range(1, 4):
        truth = true_mean(3, step)
        for r in results:
            for got, want, ref in zip(r["grads"][step], results[0]["grads"][step], truth):
                assert torch.equal(got, want)
                assert rel(got, ref) < 0.1  # int8 twice (3 ranks) with error feedback; mixed-up buckets read ~1


def _backward_after_close(rank, world, how):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "attach":
        state = thinwire.attach(model, "int8", min_compress_bytes=0)
        model(torch.randn(2, 8)).sum().backward()
    else:
        state = thinwire.sync(model, "local:period=1,warmup=0", codec="int8")
    state.close()
    try:
        if how == "attach":
            model(torch.randn(2, 8)).sum().backward()
        else:
            with state.no_sync():
                model(torch.randn(2, 8)).sum().backward()
            state.step(opt)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("how", ["attach", "sync"])
def test_a_closed_state_refuses_to_average_instead_of_hanging(how):
    """Work handed to a closed communication thread never ran: DDP's reducer (or the sync mode) waited forever."""
    for r in run_ranks(_backward_after_close, 1, how):
        assert "thinwire state was closed" in r


def _saved_at_another_world(rank, world):
    import logging

    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("thinwire.compress").addHandler(handler)
    model = DDP(nn.Linear(8, 8))
    state = thinwire.attach(model, "int8", min_compress_bytes=0)
    model(torch.randn(2, 8)).sum().backward()
    sd = state.state_dict()
    state.load_state_dict(sd)                        # this job's own: its residuals
    kept = {k: v.clone() for k, v in state.feedback.state_dict()["params"].items()}
    state.load_state_dict({**sd, "world": 3})        # saved by 3 ranks: not this rank's residuals
    after = len(state.feedback.state_dict()["params"])
    state.load_state_dict({**sd, "policy": "topk:ratio=0.01"})  # another codec's errors: not int8's
    other_codec = len(state.feedback.state_dict()["params"])
    try:  # one file for every rank: another rank's residuals, swapped in silence before
        state.load_state_dict({**sd, "rank": 1})
        refused = ""
    except ValueError as e:
        refused = str(e)
    out = {"world": sd["world"], "kept": len(kept), "after": after, "other_codec": other_codec, "refused": refused,
           "said": [r.getMessage() for r in records]}
    state.close()
    return out


def test_a_state_saved_at_another_world_size_leaves_its_residuals_out_and_says_so():
    """Each residual is what one rank's own sends left behind: a 2-rank job's loaded into a 3-rank one without a
    word (a user's loop that saves and loads state_dict() per rank)."""
    (r,) = run_ranks(_saved_at_another_world, 1)
    assert r["world"] == 1 and r["kept"] > 0 and r["after"] == 0
    assert any("saved by a job of 3 ranks, this one has 1: error-feedback residuals start empty" in m for m in r["said"])
    assert r["other_codec"] == 0 and any("saved with compression topk:ratio=0.01, this one sends with int8" in m
                                         for m in r["said"])
    assert "this CommState is rank 0's, and the state loaded was saved by rank 1" in r["refused"]
    assert "Save one file per rank" in r["refused"]


@pytest.mark.parametrize("bad, match", [(None, "got NoneType"), ({"foo": 1}, r"got a dict with keys \['foo'\]")])
def test_loading_something_else_than_a_hook_state_says_what_it_takes(bad, match):
    from thinwire.compress.hook import CommState, StaticPolicy
    from thinwire.compress.spec import parse_codec_spec

    state = CommState.__new__(CommState)  # no process group needed to refuse the input
    state.policy = StaticPolicy(parse_codec_spec("int8"))
    with pytest.raises(ValueError, match="CommState.load_state_dict takes what CommState.state_dict.. returned.*" + match):
        state.load_state_dict(bad)


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_sums_a_finite_gradient_past_its_range_without_overflow(world):
    """Each rank's fp16 payload was clamped to 65504, so the ranks' sum overflowed: a finite average past 65504
    came back NaN, and the step was skipped as 'non-finite on some rank'. Now it arrives clamped, finite,
    and error feedback holds back the rest."""
    results = run_ranks(_hook_average, world, "fp16", 1, 100.0, -1, "skip", True, 3e5)
    truth = true_mean(world)[0] * 3e5
    assert truth.abs().max() > 65504
    for r in results:
        a, _ = r["grads"][0]
        assert torch.isfinite(a).all() and r["stats"]["skipped_nonfinite"] == 0, r["stats"]
        assert a.abs().max() <= 65504
    residual = sum(r["state"]["residuals"]["params"]["0"] for r in results)
    # (the fp16 sum rounds once more, at most a few units of its last place, 32 at the top of its range)
    torch.testing.assert_close(results[0]["grads"][0][0] + residual, truth, rtol=2e-3, atol=64.0)


def _static_graph_resume(rank: int, world: int) -> bool:
    """20 steps straight, and 11 then a fresh DDP model (as a resumed process builds) loading the states, to 20."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 50))
        ddp = DDP(net, static_graph=True)
        return net, ddp, torch.optim.Adam(net.parameters(), lr=1e-2), thinwire.attach(ddp, "int8", min_compress_bytes=0)

    def train(ddp, opt, steps):
        for step in steps:
            x = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(1000 * step + rank))
            opt.zero_grad()
            F.cross_entropy(ddp(x), (x * 7 + 3) % 50).backward()
            opt.step()

    net, ddp, opt, comm = build()
    train(ddp, opt, range(20))
    straight = [p.detach().clone() for p in net.parameters()]
    comm.close()
    net, ddp, opt, comm = build()
    train(ddp, opt, range(11))
    saved = {"model": net.state_dict(), "opt": opt.state_dict(), "comm": comm.state_dict()}
    comm.close()
    net, ddp, opt, comm = build()
    net.load_state_dict(saved["model"]), opt.load_state_dict(saved["opt"]), comm.load_state_dict(saved["comm"])
    train(ddp, opt, range(11, 20))
    comm.close()
    return all(torch.equal(a, b) for a, b in zip(straight, net.parameters()))


def test_a_static_graph_resume_is_bit_identical():
    """DDP(static_graph=True) rebuilds its buckets after its second iteration, not its first: the resumed second
    step was averaged in DDP's initial layout, and int8's blocks fell otherwise than in the straight run."""
    assert run_ranks(_static_graph_resume, 2) == [True, True]
