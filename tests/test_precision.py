"""precision/: int8 layers against fp32 at stated tolerances, proof the int8 kernels ran, the float
fallback, the module swap, fp16 overflow skipping, the memory budget, the auto choice, and an
end-to-end ``thinwire train --precision int8`` run under a memory budget."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import torch
from torch import nn

from thinwire.errors import ConfigError, ThinwireError
from thinwire.precision import (COUNTERS, Int8ComputeConfig, Int8Conv2d, Int8Linear, PeakMemory, PrecisionRunner,
                                autocast_context, conversion_report, convert, parse_size, plan_memory)
from thinwire.precision import attention
from thinwire.precision import int8 as int8_mod
from thinwire.precision import quant
from thinwire.precision.auto import Trial, _decide, choose_precision
from thinwire.precision.quant import Scaling, int8_matmul, quantize, relative_error
from thinwire.precision.memory import apply_checkpointing, search_micro_batch, split_evenly, step_peak

ROOT = Path(__file__).resolve().parents[1]
# Relative L2 error of int8 against fp32 on Gaussian data (measured ~0.02-0.03 pow2, ~0.01 rowwise).
TOL = {"pow2": 0.05, "rowwise": 0.025}


def _pair(float_layer: nn.Module, scaling: str, stochastic: bool = True):
    q = int8_mod.to_int8_(copy.deepcopy(float_layer), Int8ComputeConfig(scaling=scaling, stochastic=stochastic))
    return float_layer, q


def _fwd_bwd(layer, x, g):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("scaling", ["pow2", "rowwise"])
def test_int8_linear_matches_fp32_within_tolerance(scaling):
    torch.manual_seed(0)
    ref, q = _pair(nn.Linear(256, 96), scaling)
    x, g = torch.randn(4, 33, 256), torch.randn(4, 33, 96)
    for a, b in zip(_fwd_bwd(q, x, g), _fwd_bwd(ref, x, g)):
        assert relative_error(a, b) < TOL[scaling]
    assert q.stats.int8 == 3 and q.stats.float == 0  # output, input gradient, weight gradient


@pytest.mark.parametrize("scaling", ["pow2", "rowwise"])
@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=2, dilation=2), dict(padding="same")])
def test_int8_conv2d_matches_fp32_within_tolerance(scaling, kw):
    torch.manual_seed(0)
    ref, q = _pair(nn.Conv2d(3, 16, 3, **kw), scaling)
    x = torch.randn(5, 3, 11, 9)
    g = torch.randn_like(ref(x))
    for a, b in zip(_fwd_bwd(q, x, g), _fwd_bwd(ref, x, g)):
        assert a.shape == b.shape
        assert relative_error(a, b) < TOL[scaling]
    assert q.stats.int8 == 3 and q.stats.float == 0
    assert q(x[0]).shape == ref(x[0]).shape  # unbatched input


def test_int8_matmul_is_exact_and_splits_long_contractions(monkeypatch):
    a = torch.randint(-127, 128, (20, 70), dtype=torch.int8)
    b = torch.randint(-127, 128, (70, 9), dtype=torch.int8)
    exact = (a.long() @ b.long()).float()
    assert torch.equal(int8_matmul(a, b).float(), exact)
    monkeypatch.setattr(quant, "_MAX_K", 16)
    monkeypatch.setattr(quant, "_CHUNK_K", 16)  # 70 = 16 + 16 + 16 + 16 + 6
    before = COUNTERS.int8
    assert torch.equal(int8_matmul(a, b), exact)
    assert COUNTERS.int8 == before + 1


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    t = torch.full((256, 256), 0.3)
    t[0] = 127.0  # pins every scale to 1: codes of 0.3 are 0 or 1
    for scaling in Scaling:
        q, s = quantize(t, scaling, axis=0, stochastic=True)
        assert torch.all(s == 1)
        assert abs(float(q[1:].float().mean()) - 0.3) < 0.01
        q, s = quantize(t, scaling, axis=0, stochastic=False)
        assert float(q[1:].float().mean()) == 0.0


def test_non_finite_gradient_stays_non_finite():
    q = Int8Linear(16, 8)
    x = torch.randn(20, 16)
    (q(x).sum() * float("inf")).backward()
    assert not torch.isfinite(q.weight.grad).all()


@pytest.mark.parametrize("scaling", ["pow2", "rowwise"])
def test_int8_layers_take_one_sample_an_unbatched_image_and_an_empty_batch_as_torch_does(scaling):
    """A convolution's gradient on one sample reached the stochastic rounding as a strided view (a traceback in
    backward: at batch 1 and on an unbatched image, which nn.Conv2d takes); an empty batch failed in quantize."""
    torch.manual_seed(0)
    cfg = Int8ComputeConfig(scaling=scaling)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(1), nn.Linear(4 * 6 * 6, 2))
    net = convert(copy.deepcopy(conv), "int8", scaling=scaling)
    for x in (torch.randn(1, 3, 8, 8), torch.randn(2, 3, 8, 8)):
        net(x).sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    c = Int8Conv2d.from_float(nn.Conv2d(3, 4, 3), cfg)
    c(torch.randn(3, 8, 8, requires_grad=True)).sum().backward()
    assert c.weight.grad.shape == c.weight.shape
    lin, c2 = Int8Linear.from_float(nn.Linear(16, 8), cfg), Int8Conv2d.from_float(nn.Conv2d(3, 4, 3), cfg)
    assert lin(torch.zeros(0, 16)).shape == (0, 8) and c2(torch.zeros(0, 3, 8, 8)).shape == (0, 4, 6, 6)
    with pytest.raises(ConfigError, match="stochastic: must be True or False, got 'false'"):
        Int8ComputeConfig(stochastic="false")


def test_a_silent_float_fallback_fails_the_counter_check():
    """The check used everywhere: each swapped layer did its matmuls in int8, none in float."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    convert(model, "int8")
    model(torch.randn(8, 1, 8, 8)).sum().backward()
    for layer in (model[0], model[2]):
        assert layer.stats.float == 0
        assert layer.stats.int8 == (2 if layer is model[0] else 3)  # no input gradient for the first layer
    model[2].forward = lambda x: nn.functional.linear(x, model[2].weight, model[2].bias)  # a silent float path
    model[2].stats.int8 = 0
    model(torch.randn(8, 1, 8, 8)).sum().backward()
    assert model[2].stats.int8 == 0  # the counter exposes it


def test_fallback_without_int8_kernel_warns_once_and_counts_float(monkeypatch):
    torch.manual_seed(0)
    layer = Int8Linear(32, 16, config=Int8ComputeConfig(stochastic=False))
    x = torch.randn(24, 32)
    want = layer(x)
    monkeypatch.delattr(torch, "_int_mm")
    quant._reset_kernel_probe()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallback = Int8Linear(32, 16)
            fallback.load_state_dict(layer.state_dict())
            for _ in range(3):
                got = fallback(x)
                got.sum().backward()
        msgs = [str(w.message) for w in caught if "no int8 matmul kernel" in str(w.message)]
        assert len(msgs) == 1, msgs
        assert "has no torch._int_mm" in msgs[0]
        assert fallback.stats.int8 == 0 and fallback.stats.float == 6  # output and weight gradient, 3 times
        torch.testing.assert_close(got, want)  # same quantized numerics, computed in float
    finally:
        quant._reset_kernel_probe()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.conv1d = nn.Conv1d(4, 4, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_convert_takes_one_exclude_pattern_as_a_string_and_refuses_one_that_matches_nothing():
    """exclude="head" was read as the patterns h, e, a, d: the head was converted, silently."""
    net = convert(_Net(), "int8", exclude="head")
    assert conversion_report(net)["kept_float"]["head"] == "excluded" and type(net.head) is nn.Linear
    with pytest.raises(ValueError, match=r"exclude pattern 'haed' matches no module of the model; its modules are "
                                         r"named like emb, conv"):
        convert(_Net(), "int8", exclude=["haed"])


def test_convert_swaps_exactly_the_int8_capable_layers_and_keeps_parameters():
    net = _Net()
    keys, params = set(net.state_dict()), {n: p for n, p in net.named_parameters()}
    convert(net, "int8", exclude=["blocks.1.*"])
    rep = conversion_report(net)
    assert rep["layers"] == ["conv", "blocks.0.0", "head"]
    assert rep["swapped"] == 3
    assert set(rep["kept_float"]) == {"depthwise", "blocks.1.0"}
    assert "groups=4" in rep["kept_float"]["depthwise"] and rep["kept_float"]["blocks.1.0"] == "excluded"
    assert type(net.conv1d) is nn.Conv1d and type(net.blocks[1][0]) is nn.Linear
    assert isinstance(net.head, Int8Linear) and isinstance(net.conv, Int8Conv2d)
    assert net.head.weight is net.emb.weight  # tying survives
    assert set(net.state_dict()) == keys
    assert all(p is params[n] for n, p in net.named_parameters())
    convert(net, "fp32")
    assert type(net.head) is nn.Linear and type(net.conv) is nn.Conv2d and conversion_report(net)["swapped"] == 0


def test_convert_bf16_runs_the_forward_under_autocast_and_returns_fp32():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = net(x).float()
    convert(net, "bf16")
    got = net(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert conversion_report(net)["swapped"] == 2
    convert(net, "fp32")
    assert net(x).dtype == torch.float32 and not torch.equal(net(x), want)
    with pytest.raises(ValueError, match=r"convert: mode must be one of fp32, int8, bf16, got 'fp16'. fp16 needs a loss scaler"):
        convert(net, "fp16")


@pytest.mark.skipif(not attention.bf16_attention_is_slow(), reason="this CPU has AMX: bf16 attention stays in bf16")
def test_bf16_attention_runs_in_fp32_on_cpus_without_amx():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fp32 = nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    bf16 = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # no autocast: the bf16 kernel
    assert not torch.equal(bf16, fp32)  # the two kernels differ in the low bits, so equality below tells them apart
    with autocast_context("bf16", "cpu"):
        got = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, fp32)
    got.sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()


def test_fp16_overflow_step_is_skipped_and_logged(caplog):
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    runner = PrecisionRunner("fp16", "cpu")
    x = torch.randn(4, 8)
    before = net.weight.detach().clone()
    with runner.context():
        out = net(x)
    assert out.dtype == torch.float16
    runner.backward(out.float().sum() * 1e30)  # scaled by 2^16 the fp16 gradient overflows
    with caplog.at_level(logging.WARNING, logger="thinwire.precision"):
        assert runner.step(opt, clip=1.0) is True
    opt.zero_grad(set_to_none=True)
    assert torch.equal(net.weight, before)
    assert runner.skipped_steps == 1 and runner.report()["loss_scale"] == 2.0**15
    assert "step 1: non-finite gradient" in caplog.text and "optimizer step skipped; loss scale now 32768" in caplog.text
    with runner.context():
        loss = net(x).float().mean()  # scaled by 2^15 its fp16 gradient stays in range
    runner.backward(loss)
    assert runner.step(opt, clip=1.0) is False
    assert not torch.equal(net.weight, before)


# -- memory budget ---------------------------------------------------------------------------------
def test_parse_size():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("800k") == 800 * 1024
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match=r"size: must be a size > 0 .* got '12 parsecs'"):
        parse_size("12 parsecs")


def test_memory_budget_config_is_validated():
    from thinwire.train.config import TrainConfig

    with pytest.raises(ThinwireError, match=r"memory_budget: must be a positive size such as 512MiB.*got 'lots'"):
        TrainConfig(memory_budget="lots")
    assert TrainConfig(memory_budget="64MiB", precision="int8").memory_budget == "64MiB"


def test_search_picks_the_largest_micro_batch_and_reaches_the_batch():
    measure = lambda sizes: 1000 + 100 * max(sizes)  # noqa: E731  (bytes of a step)
    plan = search_micro_batch(48, 2300, measure, margin=0.0)
    # 13 fits, 14 does not: the fewest micro-batches of <= 13 is 4, split evenly
    assert plan.micro_sizes == [12, 12, 12, 12] and plan.fit == (1000.0, 100.0)
    assert plan.measured_peak_bytes <= 2300
    assert search_micro_batch(48, 100_000, measure).micro_sizes == [48]
    assert search_micro_batch(48, 1050, measure) is None
    assert split_evenly(10, 4) == [4, 3, 3]


def _mlp_sample(n: int, i: int = 0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 32, 64, generator=g), torch.randint(0, 8, (n, 32), generator=g)


def _mlp():  # per token: activation memory grows with the batch, parameters are small
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def _token_loss(out, y):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


MEM = dict(sample=_mlp_sample, loss_fn=_token_loss, device=torch.device("cpu"),
           optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def test_memory_plan_fits_the_budget_and_accumulation_equals_the_full_batch():
    model, batch = _mlp(), 64
    full = step_peak(model, [batch], **MEM)
    one = step_peak(model, [1, 1], **MEM)
    budget = (one + full) // 2
    plan = plan_memory(model, budget=budget, batch=batch, **MEM)
    assert 1 < plan.micro_batch < batch and sum(plan.micro_sizes) == batch and not plan.checkpointing
    # the exact accumulated step, measured again, stays under the budget
    assert step_peak(model, plan.micro_sizes, **MEM) <= budget
    # and gives the full batch's gradient
    x, y = _mlp_sample(batch)
    ref, acc = _mlp(), _mlp()
    _token_loss(ref(x), y).backward()
    for xm, ym in zip(x.split(plan.micro_sizes), y.split(plan.micro_sizes)):
        (_token_loss(acc(xm), ym) * (len(ym) / batch)).backward()
    for a, b in zip(acc.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


class _Deep(nn.Module):
    """Blocks with big inner activations: checkpointing keeps only the block inputs."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 4096), nn.GELU(), nn.Linear(4096, 32)) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x[..., :8]


def _deep_sample(n: int, i: int = 0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 512, 32, generator=g), torch.randint(0, 8, (n, 512), generator=g)


DEEP = dict(MEM, sample=_deep_sample)


def test_checkpointing_when_one_sample_does_not_fit_and_a_clear_error_when_nothing_does():
    model = _Deep()
    one = step_peak(model, [1], **DEEP)
    torch.manual_seed(0)
    ckpt_model = _Deep()
    assert apply_checkpointing(ckpt_model) == [f"blocks.{i}" for i in range(4)]
    one_ckpt = step_peak(ckpt_model, [1], **DEEP)
    assert one_ckpt < 0.7 * one
    plan = plan_memory(model, budget=(one + one_ckpt) // 2, batch=2, **DEEP)
    assert plan.checkpointing and plan.micro_sizes == [1, 1] and plan.measured_peak_bytes <= (one + one_ckpt) // 2
    with pytest.raises(ThinwireError, match=r"memory_budget: must be at least .* MiB for this model \(the measured peak "
                                            r"of a training step on micro-batches of one sample with activation checkpointing\), got 1MiB"):
        plan_memory(_Deep(), budget=2**20, budget_text="1MiB", batch=2, **DEEP)


def _bn_sample(n: int, i: int = 0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 16384, generator=g), torch.randint(0, 8, (n,), generator=g)


def _bn_mlp():  # BatchNorm in training refuses a batch of one sample; wide rows: activations grow with the batch
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(16384), nn.ReLU(), nn.Linear(16384, 8))


BN = dict(MEM, sample=_bn_sample, loss_fn=nn.functional.cross_entropy)


def test_a_model_that_cannot_train_on_one_sample_is_planned_from_two():
    """The plan measured micro-batches of one sample first, and BatchNorm's ValueError came out as a traceback
    whatever the budget; no micro-batch of the plan may hold one sample (9 = 5 + 4, not 5 + 2 + 2 ... + 1)."""
    big = plan_memory(_bn_mlp(), budget=2**30, batch=9, **BN)
    assert big.micro_sizes == [9]
    two, nine = step_peak(_bn_mlp(), [2, 2], **BN), step_peak(_bn_mlp(), [9], **BN)
    plan = plan_memory(_bn_mlp(), budget=two + (nine - two) // 2, batch=9, checkpoint_fallback=False, **BN)
    assert len(plan.micro_sizes) > 1 and min(plan.micro_sizes) >= 2 and sum(plan.micro_sizes) == 9
    with pytest.raises(ThinwireError, match=r"micro-batches of 2 samples \(the model cannot train on one\)"):
        plan_memory(_bn_mlp(), budget=two // 2, batch=9, checkpoint_fallback=False, **BN)


def test_the_refusal_names_a_minimum_above_the_budget_it_refuses():
    """It measured again and named that peak: a minimum of 18.2 MiB for a budget of 18.5 MiB it refused."""
    model = _mlp()
    one = step_peak(model, [1, 1], **MEM)
    calls = []

    def noisy(model, sizes, **kw):  # the second measurement of the same step reads 10% lower
        calls.append(tuple(sizes))
        return one if calls.count(tuple(sizes)) == 1 else int(one * 0.9)
    import thinwire.precision.memory as memory
    orig, memory.step_peak = memory.step_peak, noisy
    try:
        with pytest.raises(ThinwireError) as e:
            plan_memory(model, budget=one - 1, budget_text="X", batch=8, checkpoint_fallback=False, **MEM)
    finally:
        memory.step_peak = orig
    number, unit = re.search(r"must be at least ([\d.]+) (KiB|MiB|GiB)", str(e.value)).groups()
    assert float(number) * 2 ** {"KiB": 10, "MiB": 20, "GiB": 30}[unit] > one - 1, str(e.value)


def test_peak_memory_counts_live_tensors():
    keep = torch.zeros(1000)  # 4000 bytes, existing before
    with PeakMemory(torch.device("cpu"), keep) as m:
        a = torch.ones(2000)  # +8000
        b = a * 2  # +8000
        del a, b
        c = torch.ones(1000)  # +4000 after the peak
    assert m.peak == 4000 + 16000
    del c


def test_a_freed_storage_runs_no_python_code_so_a_stop_signal_is_not_dropped():
    """A stop signal's handler raises in whatever Python code runs; raised inside a weakref callback it is
    printed and dropped (a Ctrl-C in a run's first steps was lost 1 time in 10). The frees still count."""
    import types

    from thinwire.precision.memory import LiveTensorBytes

    with LiveTensorBytes() as live:
        a = torch.ones(2000)
        b = a * 2
        callbacks = [entry[0].__callback__ for entry in live._seen.values()]
        del a
        c = torch.ones(10)
        assert live.live == 8000 + 40 and live.peak == 16000
    assert callbacks and all(isinstance(cb, types.BuiltinMethodType) for cb in callbacks), callbacks
    del b, c


# -- auto ------------------------------------------------------------------------------------------
def test_auto_decision_rules():
    ref = [2.0, 1.9, 1.8, 1.7]
    trials = [Trial("fp32", 0.10, ref), Trial("bf16", 0.05, [2.0, 1.9, 1.81, 1.71]),
              Trial("int8", 0.04, [2.0, 1.9, 1.9, 1.9])]
    choice = _decide(trials, tolerance=0.02, min_speedup=1.05, steps=4)
    assert choice.mode == "bf16" and choice.reason.startswith("bf16: 2.00x faster per step than fp32")
    assert "int8 2.50x" in choice.reason and "fails parity" in choice.reason
    slow = [Trial("fp32", 0.10, ref), Trial("bf16", 0.099, ref)]
    assert _decide(slow, 0.02, 1.05, 4).mode == "fp32"
    nan = [Trial("fp32", 0.10, ref), Trial("int8", 0.01, [2.0, float("nan"), 1.8, 1.7])]
    assert _decide(nan, 0.02, 1.05, 4).mode == "fp32"


def test_choose_precision_measures_every_candidate():
    choice = choose_precision(_mlp(), lambda i: _mlp_sample(16, i), _token_loss,
                              device=torch.device("cpu"), steps=4, warmup=1)
    assert [t.mode for t in choice.trials] == ["fp32", "bf16", "int8"]
    assert choice.mode in {"fp32", "bf16", "int8"} and choice.reason.startswith(choice.mode)
    assert all(t.losses and t.step_s > 0 for t in choice.trials)


# -- end to end ------------------------------------------------------------------------------------
def test_train_digits_int8_under_a_memory_budget_end_to_end(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "digits", "--precision", "int8",
                           "--steps", "30", "--eval-every", "30", "--out", str(out), "--set", "memory_budget=12MiB"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    rep = summary["precision_report"]
    assert summary["precision"] == "int8" and rep["mode"] == "int8" and summary["steps"] == 30
    assert rep["conversion"]["layers"] == ["conv1", "conv2", "fc1", "fc2"]
    assert rep["int8_matmuls"] >= 30 * 11 and rep["float_matmuls"] == 0
    plan = rep["memory_plan"]
    assert sum(plan["micro_sizes"]) == 64 and plan["accumulation_steps"] > 1  # the batch, reached by accumulation
    assert 0 < summary["peak_memory_bytes"] <= parse_size("12MiB")
    assert summary["val_accuracy"] > 0.5


def test_int8_conversion_says_which_kinds_of_layer_compute_in_fp32(caplog):
    """An LSTM language model: only its output Linear becomes int8, and the log said "1 layers converted"
    with no word of the embedding and the LSTM left in fp32."""
    from thinwire.precision.convert import convert

    model = nn.Sequential(nn.Embedding(50, 16), nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 50))
    with caplog.at_level(logging.INFO, logger="thinwire"):
        convert(model, "int8")
    assert "precision int8: 1 layer converted; Embedding, LSTM compute in fp32" in caplog.text, caplog.text


def test_auto_that_does_not_choose_int8_drops_its_trials_noise_buffer_and_counts(monkeypatch):
    """--precision auto's int8 trial left its 4 MB noise buffer in every later measurement: a budget refused at
    int8's minimum after bf16 was chosen, and an fp32 run's peak reported 2.3x a plain fp32 run's."""
    from thinwire.precision import setup as setup_mod
    from thinwire.precision.auto import PrecisionChoice
    from thinwire.precision.int8 import COUNTERS, DITHER

    def trial_then_fp32(model, *a, **kw):
        trial = copy.deepcopy(model)
        convert(trial, "int8", stochastic=True)
        x, _ = _mlp_sample(2)
        trial(x).sum().backward()  # the trial's int8 steps: noise drawn, int8 matmuls counted
        assert DITHER.tensors() and COUNTERS.int8 > 0
        return PrecisionChoice("fp32", "faster", [])

    monkeypatch.setattr(setup_mod, "choose_precision", trial_then_fp32)
    setup = setup_mod.prepare_precision(_mlp(), "auto", device=torch.device("cpu"), batch=4, sample=_mlp_sample,
                                        loss_fn=_token_loss, optimizer_fn=MEM["optimizer_fn"], ddp=False)
    assert setup.mode == "fp32" and DITHER.tensors() == [] and COUNTERS.int8 == 0


def test_the_reported_peak_leaves_out_the_validation_set_a_first_step_check_looks_at(tmp_path):
    """A plain TensorDataset: the first step checks the validation set's first item, a view of the whole set's
    storage, inside the step's memory meter: the reported peak was ~90x the budget (the set exists before the step)."""
    (tmp_path / "tinywl.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nimport thinwire\n\n"
        "def _set(n, seed):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    x = torch.randn(n, 13, generator=g)\n"
        "    return TensorDataset(x, (x[:, 0] > 0).long())\n\n"
        "def build():\n"
        "    model = nn.Sequential(nn.Linear(13, 29), nn.ReLU(), nn.Linear(29, 2))\n"
        "    return thinwire.Workload(model=model, train=_set(2000, 0), val=_set(100000, 1),\n"
        "                             loss=nn.functional.cross_entropy,\n"
        "                             task='classification', lr=3e-3, batch_size=32, steps=10)\n")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    proc = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "tinywl:build", "--steps", "3",
                           "--eval-every", "100", "--memory-budget", "64KiB", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((out / "summary.json").read_text())["precision_report"]
    assert 0 < rep["peak_memory_bytes"] <= rep["memory_plan"]["budget_bytes"], rep  # the set is 6 MB
