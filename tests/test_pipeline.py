"""Pipelined training (``--pipeline``): stages on 4 processes equal one process at equal samples, for
GPipe and 1F1B, alone and as 2 x 2 pipeline x data parallel; the spec, the layout and bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.test_cli import thinwire
from tests.test_resume import _final_model, kill_a_worker_mid_run
from thinwire.errors import ConfigError, ThinwireError
from thinwire.train import checkpoint as ckpt
from thinwire.pipeline.layout import default_microbatches, layout_of as layout
from thinwire.pipeline.stages import Layer, balanced_split, layer_list, layer_params, stage_state
from thinwire.pipespec import parse_pipeline_spec
from thinwire.workloads.charlm import CharGPT, CharLMConfig, layers as charlm_layers, lm_loss

CFG = CharLMConfig(layers=2, width=32, heads=2, context=16)
STEPS, BATCH = 5, 8
# Float tolerance against the single process: the stages compute the same float ops; what differs is the
# order of sums (the gradient norm over stages, micro-batch gradients accumulated then divided, a tied
# weight's two halves summed across ranks), ~1e-7 relative per step, which Adam's division by sqrt(v)
# can amplify on near-zero gradients over 5 steps at lr 3e-3 (measured: at most 5e-6).
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5


def _data(cfg=CFG):
    g = torch.Generator().manual_seed(5)
    windows = [torch.randint(0, 256, (BATCH, cfg.context + 1), generator=g) for _ in range(STEPS)]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def _reference(cfg=CFG):
    torch.manual_seed(0)
    model = CharGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in _data(cfg):
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _pipelined(rank, world, stages, schedule, microbatches, recompute=False, virtual=1, cfg=CFG, order=None):
    from thinwire.commspec import parse_comm_spec
    from thinwire.compress.sync import Unwrapped, create
    from thinwire.pipeline.runner import Placement, build_rank
    from thinwire.syncspec import parse_sync_spec

    torch.manual_seed(0)
    model = CharGPT(cfg)
    layers = layer_list(model, charlm_layers)
    runs = balanced_split([layer_params(layer) for layer in layers], stages * virtual)
    place = Placement(stages, world // stages, rank, order)
    pipe, stage, cut = build_rank(model, layers, runs, place=place, device=torch.device("cpu"), loss_fn=lm_loss,
                                  microbatches=microbatches, schedule=schedule)
    if recompute:
        from thinwire.precision.memory import apply_checkpointing
        apply_checkpointing(stage)
    calls = []  # forwards inside the stage's first layer: twice per micro-batch when its activations are recomputed
    first = (stage.stages[0] if virtual > 1 else stage).layers[0]
    leaf = next(m for m in first.modules() if m is not first and not list(m.children()))
    leaf.register_forward_hook(lambda *_: calls.append(1))
    sync = create(Unwrapped(stage), parse_sync_spec("allreduce"), parse_comm_spec("none").policy(),
                  process_group=pipe.dp_group)
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3)
    share = BATCH // place.replicas
    losses = []
    for x, y in _data(cfg):
        part = slice(place.replica * share, (place.replica + 1) * share)
        loss = pipe.train_step(x[part], y[part])
        sync.before_step()
        pipe.clip(list(stage.parameters()), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses, stage_state(stage, cut.names), place.replica, len(calls)


CFG6 = CharLMConfig(layers=6, width=32, heads=2, context=16)  # 8 layers: 4 ranks x 2 interleaved stages


@pytest.mark.parametrize("schedule, stages, recompute, virtual, order", [
    ("gpipe", 4, False, 1, None), ("1f1b", 4, False, 1, None), ("gpipe", 2, False, 1, None),
    ("1f1b", 2, False, 1, None), ("1f1b", 4, True, 1, None), ("interleaved", 4, False, 2, None),
    ("interleaved", 2, False, 2, None), ("interleaved", 2, True, 2, None), ("interleaved", 4, False, 2, [2, 0, 3, 1])])
def test_pipeline_on_4_processes_equals_one_process(schedule, stages, recompute, virtual, order):
    """4 stages x 1 replica, and 2 stages x 2 replicas (pipeline x data parallel), against one process:
    the charlm's tied embedding lives on the first and last stage; clipping at 0.5 is active; with
    ``recompute`` every layer's activations are recomputed in backward (activation checkpointing).
    Interleaved: each rank holds 2 stages (4 ranks: 8 stages of an 8-layer list; 2 ranks: 4 stages, the
    tied embedding's two halves on ranks 0 and 1); ``order``: positions taken by other ranks, as a plan
    orders them by host (global rank 2 runs position 0's stages 0 and 4)."""
    cfg = CFG6 if stages * virtual > 4 else CFG
    ref_losses, ref_state = _reference(cfg)
    out = run_ranks(_pipelined, 4, stages, schedule, 4, recompute, virtual, cfg, order)
    state = {}
    for _, part, replica, _ in out:
        if replica == 0:
            state.update(part)
    once = STEPS * 4  # 4 micro-batches per step; the schedule's shape inference adds a forward or two
    counts = [n for *_, n in out]
    assert all(n >= 2 * once for n in counts) if recompute else all(n <= once + 2 for n in counts), counts
    assert set(state) == set(ref_state)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=0, atol=PARAM_ATOL, msg=name)
    last = [losses for losses, *_ in out if losses[0] is not None]
    assert len(last) == 4 // stages
    replica_mean = [sum(step) / len(last) for step in zip(*last)]
    torch.testing.assert_close(torch.tensor(replica_mean), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    if stages == 2:  # the replicas saw different halves of each batch, yet hold the same parameters
        a = [p for losses, p, r, _ in out if r == 0 and losses[0] is None][0]
        b = [p for losses, p, r, _ in out if r == 1 and losses[0] is None][0]
        assert all(torch.equal(a[k], b[k]) for k in a)


class _Tied(nn.Module):
    """Four layers, the third's weight the first's: interleaved on 2 ranks puts both on rank 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.head(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))


def _tied_layers(m):
    return [Layer("a", nn.Sequential(m.a, nn.Tanh())), Layer("b", nn.Sequential(m.b, nn.Tanh())), Layer("c", m.c),
            Layer("head", m.head)]


def _tied_grads(rank, world, schedule, runs):
    from thinwire.pipeline.runner import Placement, build_rank

    model = _Tied()
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1)
    pipe, _, _ = build_rank(model, _tied_layers(model), runs, place=Placement(2, 1, rank), device=torch.device("cpu"),
                            loss_fn=nn.functional.mse_loss, microbatches=8, schedule=schedule)
    pipe.train_step(x, y)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule, runs", [("1f1b", [[0, 1], [2, 3]]), ("interleaved", [[0], [1], [2], [3]])])
def test_a_weight_two_stages_of_one_rank_share_gets_the_one_process_gradient(schedule, runs):
    """torch's multi-stage runtime divides each stage's gradients by M at that stage's last backward: a
    tensor two stages of one rank share was divided twice (0.14x here). Gradients are divided once, after."""
    model = _Tied()
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1)
    nn.functional.mse_loss(model(x), y).backward()
    got = {}
    for grads in run_ranks(_tied_grads, 2, schedule, runs):
        got.update(grads)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


# -- spec, layout, refusals ---------------------------------------------------------------------------
def test_pipeline_spec_parses_and_refuses_with_the_field():
    s = parse_pipeline_spec("GPipe:stages=2,microbatches=8")
    assert (s.schedule, s.stages, s.microbatches, s.text) == ("gpipe", 2, 8, "gpipe:stages=2,microbatches=8")
    assert not parse_pipeline_spec("none").enabled and parse_pipeline_spec("1f1b").text == "1f1b"
    for bad, field in [("zigzag", "pipeline.schedule"), ("1f1b:stages=0", "pipeline.stages"),
                       ("1f1b:stage=2", "pipeline.key"), ("1f1b:recompute=yes", "pipeline.recompute"), ("1f1b:layers=2/x", "pipeline.layers"),
                       ("1f1b:stages=3,layers=1/1", "pipeline.layers"), ("", "pipeline"),
                       ("1f1b:virtual=2", "pipeline.virtual"), ("interleaved:virtual=1", "pipeline.virtual"),
                       ("interleaved:stages=2,layers=1/1/1", "pipeline.layers"),
                       ("interleaved:layers=1/1/1", "pipeline.layers")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            parse_pipeline_spec(bad)


def test_balanced_split_minimizes_the_largest_stage():
    assert balanced_split([1, 1, 4, 1, 1], 3) == [[0, 1], [2], [3, 4]]
    assert balanced_split([5, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert balanced_split([1, 2, 3], 3) == [[0], [1], [2]]
    assert default_microbatches(32, 4) == 16 and default_microbatches(12, 4) == 12 and default_microbatches(10, 2) == 5


def _layers(n):
    return [Layer(f"l{i}", nn.Linear(2, 2)) for i in range(n)]


def test_layout_refuses_what_cannot_be_laid_out():
    spec = parse_pipeline_spec("1f1b")
    got = layout(spec, _layers(4), 4, 32)
    assert (got.stages, got.replicas, got.microbatches, got.replica_batch) == (4, 1, 16, 32)
    assert layout(parse_pipeline_spec("gpipe:stages=2"), _layers(4), 4, 32).replicas == 2
    with pytest.raises(ConfigError, match=r"pipeline\.stages.*at most the model's 3 layers"):
        layout(spec, _layers(3), 4, 32)
    with pytest.raises(ConfigError, match=r"pipeline\.stages.*divisor of the number of workers \(6\)"):
        layout(parse_pipeline_spec("1f1b:stages=4"), _layers(4), 6, 32)
    with pytest.raises(ConfigError, match=r"pipeline\.microbatches.*divisor of a replica's batch \(32\)"):
        layout(parse_pipeline_spec("1f1b:microbatches=5"), _layers(4), 4, 32)
    with pytest.raises(ConfigError, match=r"pipeline\.microbatches.*at least the 4 stages with 1f1b"):
        layout(parse_pipeline_spec("1f1b:microbatches=2"), _layers(4), 4, 32)
    with pytest.raises(ConfigError, match=r"batch_size.*3 pipeline replicas"):
        layout(parse_pipeline_spec("1f1b:stages=1"), _layers(4), 3, 32)
    with pytest.raises(ThinwireError, match=r"pipeline\.layers.*add up to the model's 4 layers"):
        layout(parse_pipeline_spec("1f1b:layers=1/1"), _layers(4), 2, 32)
    inter = parse_pipeline_spec("interleaved:stages=2")
    assert (inter.virtual, inter.text, parse_pipeline_spec("interleaved:virtual=3").text) == (
        2, "interleaved:stages=2", "interleaved:virtual=3")
    got = layout(inter, _layers(5), 2, 8)
    assert (got.stages, got.virtual, len(got.runs), got.links, got.rank_stages(1)) == (2, 2, 4, ["fp32"] * 3, [1, 3])
    assert layout(parse_pipeline_spec("interleaved:layers=2/1/1/1"), _layers(5), 2, 8).runs == [[0, 1], [2], [3], [4]]
    with pytest.raises(ConfigError, match=r"pipeline\.virtual: must be at most 1: 2 ranks x virtual stages each hold "
                                          r"at least one of the model's 3 layers.*got 2"):  # 2 stages fit, 4 do not
        layout(inter, _layers(3), 2, 8)
    with pytest.raises(ConfigError, match=r"pipeline\.stages.*at most the model's 3 layers.*over virtual=2"):
        layout(parse_pipeline_spec("interleaved:stages=4"), _layers(3), 4, 8)
    with pytest.raises(ConfigError, match=r"pipeline\.stages: must be at least 2 with the interleaved schedule.*got 1"):
        layout(parse_pipeline_spec("interleaved:stages=1"), _layers(4), 1, 8)  # torch's schedule fails on one rank
    with pytest.raises(ConfigError,
                       match=r"pipeline\.microbatches.*multiple of its rounds \(micro-batches // stages = 2\)"):
        layout(parse_pipeline_spec("interleaved:stages=2,microbatches=5"), _layers(4), 2, 10)
    # the defaults interleaved takes are ones it can run: 4 micro-batches of 5, not 5 of 4 (its rounds)
    assert [layout(parse_pipeline_spec("interleaved"), _layers(4), 2, b).microbatches for b in (20, 28, 10)] == [4, 4, 2]
    with pytest.raises(ConfigError, match=r"pipeline\.layers: must be one layer count per stage: with interleaved.*"
                                          r"4 or more.*got '2/2'"):
        layout(parse_pipeline_spec("interleaved:layers=2/2"), _layers(4), 2, 8)
    with pytest.raises(ConfigError, match=r"pipeline\.layers:.*4 counts are 4 stages.*run 4 of them, or give 2 counts"):
        layout(parse_pipeline_spec("1f1b:layers=1/1/1/1"), _layers(4), 2, 8)
    with pytest.raises(ConfigError, match=r"stages defaults to one per worker: 4 workers"):
        layout(spec, _layers(3), 4, 32)
    for bad, match in (("1f1b:stages=2,stages=4", r"pipeline\.stages: must be given once"),
                       ("none:stages=2", r"pipeline: must be none alone.*takes no keys")):
        with pytest.raises(ConfigError, match=match):
            parse_pipeline_spec(bad)


def test_a_model_without_a_layer_list_is_refused_with_the_fix():
    with pytest.raises(ThinwireError, match="has no layer list.*layers=lambda model"):
        layer_list(nn.Linear(2, 2), None, "mypkg.mod:make")
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert [layer.name for layer in layer_list(seq, None)] == ["0", "1"]


def test_a_sequential_that_runs_a_module_twice_is_cut_with_both_and_a_list_that_is_not_the_forward_refused():
    """``named_children()`` lists a repeated module once: the stages then trained a model without its second
    use. And a layer list whose chain is not the model's forward (a residual around layers) would train another
    model: the chain check compares one sample through the list with ``model(x)``."""
    from thinwire.pipeline.stages import check_chain

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    seq = nn.Sequential(lin, nn.Tanh(), lin, nn.Linear(4, 1))
    layers = layer_list(seq, None)
    assert [layer.name for layer in layers] == ["0", "1", "2", "3"] and layers[0].module is layers[2].module
    x = torch.randn(1, 4)
    check_chain(layers, x, [[0, 1], [2, 3]], ["fp32"], model=seq)

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) + x

    res = Residual()
    listed = [Layer("a", res.a), Layer("b", res.b)]
    with pytest.raises(ThinwireError, match="does not compute the model's forward"):
        check_chain(listed, x, [[0], [1]], ["fp32"], model=res)
    check_chain(listed, x, [[0], [1]], ["fp32"])  # without the model: only whether it chains
    with pytest.raises(ThinwireError, match=r"layer 0 \(b\) cannot take the model's input"):
        check_chain([Layer("b", nn.Linear(3, 4))], x, [[0]], [], model=None)
    with pytest.raises(ThinwireError, match=r"bf16 on the link after layer a packs float32 .* outputs float64"):
        check_chain([Layer("a", nn.Linear(4, 4).double()), Layer("b", nn.Linear(4, 1).double())], x.double(),
                    [[0], [1]], ["bf16"])


def test_the_chain_check_takes_a_batchnorm_model_and_leaves_it_as_it_was():
    """One sample through BatchNorm in training mode is refused ("Expected more than 1 value per channel"):
    the check runs in eval mode, so a model that trains fine is not taken for a list that does not chain,
    and the probe moves no running statistics."""
    from thinwire.pipeline.stages import check_chain

    seq = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in seq.state_dict().items()}
    check_chain(layer_list(seq, None), torch.randn(1, 4), [[0, 1], [2, 3]], ["fp32"])
    assert seq.training and all(m.training for m in seq.modules())
    assert all(torch.equal(v, seq.state_dict()[k]) for k, v in before.items())
    seq[2].eval()  # a mode the user set stays
    check_chain(layer_list(seq, None), torch.randn(1, 4), [[0, 1], [2, 3]], ["fp32"])
    assert not seq[2].training and seq[1].training


SMALL = ["--set", "model.layers=2", "--set", "model.width=32", "--set", "model.heads=2", "--set", "model.context=16",
         "--set", "model.max_bytes=200000", "--batch-size", "8"]


@pytest.mark.parametrize("args, match", [
    (["--nproc", "4", "--pipeline", "1f1b:stages=8"], r"pipeline\.stages.*at most the model's 4 layers"),
    (["--nproc", "3", "--pipeline", "1f1b:stages=2"], r"pipeline\.stages.*divisor of the number of workers \(3\)"),
    (["--nproc", "2", "--pipeline", "gpipe:layers=1/2"], r"pipeline\.layers.*add up to the model's 4 layers"),
    (["--nproc", "2", "--pipeline", "1f1b", "--precision", "int8"], r"precision.*fp32 or bf16 with --pipeline"),
    (["--nproc", "2", "--pipeline", "1f1b", "--sync", "delayed"], r"sync.*allreduce, local:period=H or diloco"),
    (["--nproc", "2", "--pipeline", "1f1b", "--compression", "auto"], r"compression.*thinwire codec"),
    (["--nproc", "2", "--pipeline", "gpipe:layers=2/2", "--sync", "diloco:period=15,fragments=15"],
     r"sync\.fragments: must be at most 14, the trainable parameter tensors of pipeline stage 0 \(embed, blocks\.0\)"),
    (["--nproc", "2", "--workload", "digits", "--pipeline", "1f1b"],
     r"the built-in workload digits \(DigitsCNN\) has no layer list.*charlm has one"),
    (["--nproc", "2", "--workload", "tests.test_pipeline:odd_width", "--pipeline", "gpipe:activations=int8"],
     r"pipeline\.activations: int8 packs rows of an even length; layer 0 outputs width 15"),
    (["--nproc", "2", "--workload", "tests.test_pipeline:wrong_order", "--pipeline", "gpipe"],
     r"pipeline: layer 1 \(1\) cannot take the output of layer 0 \(0\)"),
    (["--nproc", "2", "--workload", "tests.test_pipeline:layers_leave_out", "--pipeline", "gpipe"],
     r"pipeline: tests.test_pipeline:layers_leave_out's layer list leaves out 0.weight, 0.bias of the model"),
    (["--nproc", "2", "--workload", "tests.test_pipeline:layers_foreign", "--pipeline", "gpipe"],
     r"pipeline: tests.test_pipeline:layers_foreign's layer extra holds parameters that are not the model's"),
    (["--nproc", "2", "--workload", "tests.test_pipeline:layers_raise", "--pipeline", "gpipe"],
     r"pipeline: tests.test_pipeline:layers_raise's layers\(model\) raised RuntimeError: my layers function broke"),
    (["--nproc", "2", "--workload", "tests.test_pipeline:layers_not_module", "--pipeline", "gpipe"],
     r"layers\(model\)\[1\] must be a \(name, nn.Module\) pair, got int"),
    (["--nproc", "2", "--workload", "tests.test_pipeline:dict_between", "--pipeline", "gpipe"],
     r"pipeline: layer 0 \(0\) ends a stage and outputs dict; what goes from one stage to the next must be a tensor"),
])
def test_train_refuses_a_bad_pipeline_before_anything_starts(tmp_path, args, match):
    out = tmp_path / "run"
    base = [] if any(w == "digits" or w.startswith("tests.test_pipeline:") for w in args) else SMALL
    r = thinwire("train", *base, "--steps", "2", *args, "--out", str(out))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert __import__("re").search(match, r.stderr), r.stderr
    assert not out.exists()


def _toy(model):
    from thinwire.workloads.base import Workload

    g = torch.Generator().manual_seed(0)
    data = [(x, int(x.sum() > 0)) for x in torch.randn(64, 16, generator=g)]
    return Workload(model=model, train=data, val=data, loss=nn.functional.cross_entropy, task="classification",
                    batch_size=8, steps=2)


def odd_width():
    """A user workload whose first stage outputs 15 values per row: no int8 link for it."""
    return _toy(nn.Sequential(nn.Linear(16, 15), nn.ReLU(), nn.Linear(15, 2)))


class _ToDict(nn.Module):
    def forward(self, x):
        return {"h": x}


class _FromDict(nn.Linear):
    def forward(self, d):
        return super().forward(d["h"])


def dict_between():
    """A user workload whose first stage outputs a dict, which torch's pipeline runtime cannot send."""
    return _toy(nn.Sequential(_ToDict(), _FromDict(16, 2)))


def parameter_free_tail():
    """A user workload whose last layer has no parameters: a stage of it alone steps nothing."""
    return _toy(nn.Sequential(nn.Linear(16, 2), nn.Tanh()))


def wrong_order():
    """A user workload whose layer list does not chain (a 16-wide layer after an 8-wide one)."""
    return _toy(nn.Sequential(nn.Linear(16, 8), nn.Linear(16, 2)))


def _listed(layers):
    """A user workload (a Linear, a ReLU, a Linear) with the layer list ``layers(model)``."""
    wl = _toy(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)))
    return dataclasses.replace(wl, layers=layers)


def layers_leave_out():
    return _listed(lambda m: [("in", m[0]), ("out", m[2])][1:])


def layers_foreign():
    extra = nn.Linear(16, 16)
    return _listed(lambda m: [("in", m[0]), ("extra", extra), ("act", m[1]), ("out", m[2])])


def layers_raise():
    def broken(m):
        raise RuntimeError("my layers function broke")
    return _listed(broken)


def layers_not_module():
    return _listed(lambda m: [("in", m[0]), ("x", 3)])


# -- the CLI: equal to data parallelism, resume, a killed stage ---------------------------------------


def _val_losses(out) -> list[float]:
    return [json.loads(l)["val_loss"] for l in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in l]


@pytest.mark.slow
class _Front(nn.Module):
    """A first stage that hands on a hidden layer and an integer mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.lin(x)), (x > 0).long()


class _Back(nn.Module):
    """A last stage with a BatchNorm, an embedding of the mask, and the first stage's weight (tied: its bias, also
    held here, gets no gradient on this stage)."""

    def __init__(self, front: _Front) -> None:
        super().__init__()
        self.front, self.bn, self.emb = front, nn.BatchNorm1d(16), nn.Embedding(2, 16)

    def forward(self, h, mask):
        z = self.bn(h) + self.emb(mask).mean(1)
        return (z @ self.front.lin.weight)[:, :2]


def probed_stages():
    """A user workload whose second stage torch's shape inference ran on torch.empty tensors: its BatchNorm's
    running statistics took in that memory, its embedding indexed out of range."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.front = _Front()
            self.back = _Back(self.front)

        def forward(self, x):
            return self.back(*self.front(x))

    torch.manual_seed(0)
    wl = _toy(Net())
    return dataclasses.replace(wl, batch_size=16, steps=6, lr=1e-2,
                               layers=lambda m: [("front", m.front), ("back", m.back)])


def test_a_stage_trains_as_in_one_process_whatever_shape_inference_fed_it(tmp_path):
    """One micro-batch per step: a BatchNorm sees the batch one process does, so the runs must agree. torch's
    shape inference fed the second stage torch.empty tensors: its BatchNorm's running statistics went to 1e34 (the
    validation stuck at chance), its integer input indexed out of range (IndexError), and the tied weight's bias,
    unused there, had no gradient to all-reduce (TypeError)."""
    common = ["--workload", "tests.test_pipeline:probed_stages", "--eval-every", "3"]
    one = thinwire("train", *common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    piped = thinwire("train", *common, "--nproc", "2", "--pipeline", "gpipe:microbatches=1", "--out", str(tmp_path / "p"))
    assert piped.returncode == 0, piped.stderr[-2000:]
    losses = [json.loads((tmp_path / o / "summary.json").read_text())["val_loss"] for o in ("one", "p")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4), losses
    # a BatchNorm given one sample per micro-batch: one line that says what to change, no traceback
    r = thinwire("train", *common, "--nproc", "2", "--pipeline", "gpipe:microbatches=16", "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "a BatchNorm got a micro-batch of one sample" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_stage_without_parameters_trains_and_resumes(tmp_path):
    """The planner may give a slow host a stage of one activation layer: its optimizer had nothing to step
    ("optimizer got an empty parameter list") and the job died."""
    out = tmp_path / "run"
    args = ["--workload", "tests.test_pipeline:parameter_free_tail", "--nproc", "2", "--pipeline", "gpipe:layers=1/1",
            "--checkpoint-every", "2", "--eval-every", "2"]
    r = thinwire("train", *args, "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    r = thinwire("train", "--resume", str(out), "--steps", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    # a shard lost: refused once, before any worker starts, saying which file to move to go on from the one before
    (out / "checkpoints" / "shards" / "step_000000004.rank00001.pt").unlink()
    before = (out / "config.yaml").read_bytes()
    r = thinwire("train", "--resume", str(out), "--steps", "6")
    assert r.returncode == 2 and r.stderr.count("is incomplete") == 1, r.stderr[-3000:]
    assert "Move step_000000004.pt out of" in " ".join(r.stderr.split()) and "Traceback" not in r.stderr
    assert (out / "config.yaml").read_bytes() == before
    (out / "checkpoints" / "shards" / "step_000000004.rank00001.pt").write_bytes(b"not a checkpoint")  # damaged
    r = thinwire("train", "--resume", str(out), "--steps", "6")
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and "has a damaged shard, step_000000004.rank00001.pt" in text, text[-2000:]
    assert "Move step_000000004.pt and its shards out of" in text and "Remove it" not in text


def test_train_pipeline_matches_one_process_and_resumes_exactly(tmp_path):
    """charlm on 4 stages (1F1B) against 1 process at equal samples; then stopped at step 4 and resumed
    to 8: the same checkpoint as the straight pipelined run, bit for bit. Validation walks all 512 windows
    in batches of 12, so its last batch is padded (and the padding not counted)."""
    common = [*SMALL, "--batch-size", "12", "--eval-every", "4", "--checkpoint-every", "4", "--set", "eval_batches=0"]
    single, piped, split = tmp_path / "single", tmp_path / "piped", tmp_path / "split"
    assert thinwire("train", *common, "--steps", "8", "--out", str(single)).returncode == 0
    r = thinwire("train", *common, "--nproc", "4", "--pipeline", "1f1b", "--steps", "8", "--out", str(piped))
    assert r.returncode == 0, r.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(_val_losses(piped)), torch.tensor(_val_losses(single)), rtol=1e-5, atol=0)
    a, b = _final_model(single), _final_model(piped)
    b_model = _merged(piped, b)
    assert set(a["model"]) == set(b_model) and a["signature"] == b["signature"] and not b["model"]
    for name in a["model"]:
        torch.testing.assert_close(b_model[name], a["model"][name], rtol=0, atol=PARAM_ATOL, msg=name)
    summary = json.loads((piped / "summary.json").read_text())
    assert summary["pipeline"]["stages"] == 4 and summary["pipeline"]["activation_bytes_sent"] > 0
    per_step = [json.loads(line)["activation_bytes"] for line in (piped / "metrics.jsonl").read_text().splitlines()
                if "activation_bytes" in line]  # torch's shape inference (steps 1 and 5, after a validation) sends none
    assert len(per_step) == 8 and len(set(per_step)) == 1, per_step
    clock = summary["pipeline"]["stage_compute"]  # each rank's compute per micro-batch, timed in torch's chunks
    assert [(c["rank"], c["stages"]) for c in clock] == [(k, [k]) for k in range(4)], clock
    assert all(c["forward_s_per_microbatch"] > 0 and c["backward_s_per_microbatch"] > 0 and 0 < c["busy"] <= 1
               and c["cpu"] > 0 for c in clock), clock
    assert "stage compute" in r.stdout and "ms per micro-batch, busy" in " ".join(r.stdout.split())
    r = thinwire("train", *common, "--nproc", "4", "--pipeline", "1f1b", "--steps", "4", "--out", str(split))
    assert r.returncode == 0, r.stderr[-3000:]
    r = thinwire("train", "--resume", str(split), "--steps", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    c = _final_model(split)
    c_model = _merged(split, c)
    for name in b_model:
        assert torch.equal(b_model[name], c_model[name]), name
    acts = [json.loads((o / "summary.json").read_text())["pipeline"]["activation_bytes_sent"] for o in (piped, split)]
    assert acts[1] >= acts[0], acts  # the whole run's hand-overs (the resumed one's first step infers shapes again)
    for rank in range(4):  # every stage's optimizer state continued exactly
        sb, sc = (ckpt.load_shard(_last(o), rank)["stage_optimizer"]["state"] for o in (piped, split))
        assert all(torch.equal(sb[i]["exp_avg_sq"], sc[i]["exp_avg_sq"]) for i in sb)
    # a data-parallel run resumes the pipelined run's checkpoint (the model merged from its stages)
    r = thinwire("train", "--resume", str(split), "--steps", "9", "--pipeline", "none", "--nproc", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer's moments start fresh" in " ".join((r.stdout + r.stderr).split())


def test_train_interleaved_pipeline_matches_one_process_resumes_exactly_and_counts_every_hand_over(tmp_path):
    """``--pipeline interleaved`` on 2 ranks (4 stages of charlm's 4-layer list, stages 0 and 2 on rank 0):
    the single process's losses at equal samples; stopped at step 2 and resumed to 4, the straight run's
    parameters bit for bit; each rank counts the activations (or their gradients) of 3 hand-overs per
    micro-batch, twice what 1F1B's ranks send."""
    common = [*SMALL, "--eval-every", "2", "--checkpoint-every", "2", "--set", "eval_batches=2", "--nproc", "2"]
    single, piped, split, plain = (tmp_path / n for n in ("single", "piped", "split", "plain"))
    assert thinwire("train", *common[:-2], "--steps", "4", "--out", str(single)).returncode == 0
    r = thinwire("train", *common, "--pipeline", "interleaved", "--steps", "4", "--out", str(piped))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4-stage pipeline, 2 per rank" in " ".join(r.stdout.split())
    torch.testing.assert_close(torch.tensor(_val_losses(piped)), torch.tensor(_val_losses(single)), rtol=1e-5, atol=0)
    r = thinwire("train", *common, "--pipeline", "interleaved", "--steps", "2", "--out", str(split))
    assert r.returncode == 0, r.stderr[-3000:]
    assert thinwire("train", "--resume", str(split), "--steps", "4").returncode == 0
    b, c = (_merged(o, _final_model(o)) for o in (piped, split))
    assert all(torch.equal(b[k], c[k]) for k in b)
    assert thinwire("train", *common, "--pipeline", "1f1b", "--steps", "4", "--out", str(plain)).returncode == 0
    inter, one = (json.loads((o / "summary.json").read_text())["pipeline"] for o in (piped, plain))
    assert inter["runs"] == [[0], [1], [2], [3]] and inter["stages"] == 2
    assert [c["stages"] for c in inter["stage_compute"]] == [[0, 2], [1, 3]]  # both of a rank's stages timed
    assert inter["activation_bytes_sent"] == 3 * one["activation_bytes_sent"]  # 3 links against 1, both ranks


def _last(out):
    return sorted((out / "checkpoints").glob("step_*.pt"))[-1]


def _merged(out, state):
    return ckpt.model_state(str(_last(out)), state)  # as the README writes it: a path string (Path() raised there)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_a_killed_stage_restarts_from_the_last_checkpoint(tmp_path, schedule):
    out = tmp_path / "run"
    killed_at = kill_a_worker_mid_run([*SMALL, "--nproc", "2", "--pipeline", schedule, "--max-restarts", "1", "--steps",
                                       "300", "--checkpoint-every", "25", "--eval-every", "150", "--set", "eval_batches=2"],
                                      out, at_step=60, steps=300)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["restarts"] == 1
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    restart = [r for r in records if r.get("event") == "restart"]
    assert len(restart) == 1 and killed_at - 25 <= restart[0]["step"] <= killed_at and restart[0]["step"] % 25 == 0


# -- compressed activations between stages ------------------------------------------------------------
def test_int8_and_bf16_links_pack_forward_and_backward_within_their_error():
    from thinwire.pipeline.wire import Decode, Encode, pack_int8, payload_bytes, unpack_int8

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * torch.logspace(-3, 2, 64)).requires_grad_()  # outliers in a row
    packed = pack_int8(x)
    assert packed.dtype == torch.bfloat16 and packed.numel() * 2 == payload_bytes("int8", x.numel(), 64) == 15 * 2 * 36
    blocks = x.detach().reshape(3, 5, 2, 32)
    half_scale = (blocks.abs().amax(-1, keepdim=True) / 254).expand_as(blocks).reshape(3, 5, 64)
    assert ((unpack_int8(packed) - x.detach()).abs() <= half_scale * (1 + 1e-6)).all()
    for codec in ("int8", "bf16"):
        enc, dec = Encode(codec), Decode(codec)
        wire = enc(x)
        received = wire.detach().requires_grad_()  # what the next stage's schedule hands it
        y = dec(received)
        grad_y = torch.randn(y.shape, generator=g)
        y.backward(grad_y)
        assert received.grad.dtype == torch.bfloat16 and received.grad.shape == wire.shape  # sent back packed
        wire.backward(received.grad)
        err = (x.grad - grad_y).abs()
        if codec == "int8":  # stochastic rounding: below one scale of the gradient's block
            gb = grad_y.reshape(3, 5, 2, 32)
            assert (err <= (gb.abs().amax(-1, keepdim=True) / 127).expand_as(gb).reshape(3, 5, 64) * (1 + 1e-6)).all()
            assert ((y.detach() - x.detach()).abs() <= half_scale * (1 + 1e-6)).all()
        else:
            assert (err <= grad_y.abs() * 2**-8).all() and ((y.detach() - x.detach()).abs() <= x.detach().abs() * 2**-8).all()
        x.grad = None
    with pytest.raises(ThinwireError, match=r"pipeline\.activations: int8 packs rows of an even length.*width 3"):
        pack_int8(torch.zeros(2, 3))


def test_stochastic_rounding_of_gradients_is_unbiased():
    from thinwire.pipeline.wire import pack_int8, unpack_int8

    torch.manual_seed(0)
    g = torch.full((4000, 32), 0.3)
    g[:, 0] = 1.0  # scale 1/127: 0.3 sits between two levels, rounding to nearest would always go one way
    mean = unpack_int8(pack_int8(g, stochastic=True))[:, 1:].mean()
    nearest = unpack_int8(pack_int8(g))[:, 1].mean()
    assert abs(mean - 0.3) < 2e-4 < abs(nearest - 0.3)


@pytest.mark.slow
def test_int8_activations_send_a_quarter_of_the_bytes_at_nearly_the_same_loss(tmp_path):
    common = [*SMALL, "--nproc", "2", "--steps", "6", "--eval-every", "6", "--set", "eval_batches=2"]
    runs = {}
    for codec in ("fp32", "int8"):
        out = tmp_path / codec
        r = thinwire("train", *common, "--pipeline", f"gpipe:activations={codec}", "--out", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[codec] = json.loads((out / "summary.json").read_text())
    fp32, int8 = (runs[c]["pipeline"]["activation_bytes_sent"] for c in ("fp32", "int8"))
    assert int8 / fp32 == pytest.approx((32 + 4) / (4 * 32))  # a byte per value and a 4-byte scale per block of 32
    assert runs["int8"]["val_loss"] == pytest.approx(runs["fp32"]["val_loss"], rel=1e-2)


# -- the model of a pipeline step and the planner's split --------------------------------------------
def test_pipeline_step_simulated_by_hand():
    from thinwire.perf.pipeline import bubble_fraction, schedule_actions, simulate_schedule, split_for_speeds

    # torch's orders: 1F1B warms up with S - s forwards; GPipe runs every forward first
    assert schedule_actions("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert schedule_actions("1f1b", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert schedule_actions("gpipe", 1, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    # equal stages, free links: (M + S - 1)(f + b) for both schedules
    for sched in ("1f1b", "gpipe"):
        assert simulate_schedule(forward_s=[1] * 3, backward_s=[2] * 3, send_forward_s=[0] * 3, send_backward_s=[0] * 3,
                                 microbatches=5, schedule=sched) == pytest.approx((5 + 3 - 1) * 3)
    # S = 2, M = 2, f = b = 1, every message 1 s on its sender's egress, sent as gloo sends: once the receiver
    # has posted its receive. Stage 0: F0 0-1 (sent 1-2), F1 1-2, then it fires F1's send with B0's receive.
    # Stage 1: F0 2-3, B0 3-4 (sent back 4-5), then posts F1's receive, whose notice leaves behind B0's data
    # at 5: F1 sent 5-6. Stage 1: F1 6-7, B1 7-8 (sent 8-9). Stage 0: B0 5-6, B1 9-10.
    assert simulate_schedule(forward_s=[1, 1], backward_s=[1, 1], send_forward_s=[1, 0], send_backward_s=[0, 1],
                             microbatches=2) == pytest.approx(10)
    # a latency per message and per notice on top: F0 arrives at 2.5 (its notice came at 0.5), B0 leaves
    # 4.5-5.5, F1's notice reaches stage 0 at 6, F1 arrives at 7.5, B1 leaves 9.5-10.5 and arrives at 11
    assert simulate_schedule(forward_s=[1, 1], backward_s=[1, 1], send_forward_s=[1, 0], send_backward_s=[0, 1],
                             microbatches=2, alpha=0.5) == pytest.approx(12)
    # torch's 1F1B program for the middle of 3 stages: each send waited with the next receive
    from thinwire.perf.pipeline import stage_program
    middle = stage_program("1f1b", 1, 3, 2)
    assert ("post", [("send", "F", 1), ("recv", "B", 0)]) in middle
    assert ("post", [("send", "B", 0), ("recv", "F", 1)]) not in middle  # M = 2 = warm-up: no forward left
    assert middle[-1] == ("wait", [("send", "B", 1)])
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert split_for_speeds([1] * 6, [1.0, 0.5]) == [[0, 1, 2, 3], [4, 5]]
    assert split_for_speeds([1] * 6, [1.0, 1.0], link_s=[0, 0, 9, 0, 0, 0]) == [[0, 1], [2, 3, 4, 5]]  # not after 2
    assert split_for_speeds([1] * 4, [1.0, 1.0], fits=lambda s, a, b: b - a < 2) == [[0, 1], [2, 3]]
    assert split_for_speeds([1] * 4, [1.0, 1.0], fits=lambda s, a, b: False) is None


def test_interleaved_model_plays_torchs_program_and_gives_megatrons_bubble():
    """The interleaved schedule's programs come from torch's own lowering; played out with equal stages and
    free links they give Megatron-LM's step, ``M (f + b) + (S - 1)(f + b) / V`` (Narayanan et al. SC 2021)
    for a full stage's f, b split over V stages per rank, where 1F1B gives ``(M + S - 1)(f + b)``. With a
    slow link every hand-over pays it: 2 ranks x 2 stages send 3 messages each way per micro-batch."""
    from thinwire.perf.pipeline import simulate_schedule
    from thinwire.pipeline.programs import interleaved_programs

    def step(S, V, M, send=0.0):
        C = S * V
        return simulate_schedule(forward_s=[1 / V] * C, backward_s=[2 / V] * C, send_forward_s=[send] * C,
                                 send_backward_s=[send] * C, microbatches=M, programs=interleaved_programs(S, V, M))

    for S, V, M in [(4, 2, 8), (4, 2, 4), (2, 2, 4), (4, 4, 8), (4, 2, 16), (4, 2, 6)]:
        assert step(S, V, M) == pytest.approx(M * 3 + (S - 1) * 3 / V), (S, V, M)
    prog = interleaved_programs(2, 2, 4)
    assert sum(what == "F" for what, _ in prog[0]) == 8 and prog[1][-1][0] == "wait"
    assert {op[2] for what, ops in prog[1] if what == "post" for op in ops if op[0] == "send"} == {1, 3}
    # the link's time: 1F1B sends 1 message per micro-batch each way, interleaved 3
    one = simulate_schedule(forward_s=[1, 1], backward_s=[2, 2], send_forward_s=[5, 5], send_backward_s=[5, 5],
                            microbatches=4)
    assert step(2, 2, 4, send=5.0) > one > step(2, 2, 4)


def test_a_layers_call_has_a_fixed_part_measured_from_two_batches_and_priced_per_micro_batch():
    """charlm's block: a call of 1 sample is far more than half a call of 2 (measured). The fixed part comes
    from the line through two batch sizes, clamped to [0, the call]; the model prices a micro-batch of m as
    the fixed part plus the rest in proportion, so 8 micro-batches of 1 cost more compute than 4 of 2."""
    import dataclasses as dc

    from thinwire.measure.file import LayerRecord
    from thinwire.measure.layers import fixed_part, measure_layers
    from thinwire.sim.pipeline import predict_pipeline

    assert fixed_part(0.84, 1, 1.18, 2, 1.18) == pytest.approx(0.50)
    assert fixed_part(1.0, 1, 0.9, 2, 0.9) == pytest.approx(0.9)  # noise: no negative slope, at most the call
    assert fixed_part(0.5, 1, 1.0, 2, 1.0) == 0.0
    rec = LayerRecord(name="b", parameters=1, forward_s=0.6, backward_s=0.9, output_bytes=4, saved_bytes=4,
                      forward_fixed_s=0.4, backward_fixed_s=0.0)  # measured at a batch of 2: calls 1.2 and 1.8
    assert rec.forward_call_s(2, 2) == pytest.approx(1.2) and rec.forward_call_s(1, 2) == pytest.approx(0.8)
    assert rec.backward_call_s(1, 2) == pytest.approx(0.9)  # no fixed part: per sample, as before
    assert dc.replace(rec, forward_fixed_s=0.0).forward_call_s(4, 2) == pytest.approx(2.4)

    torch.manual_seed(0)
    model = CharGPT(CFG)
    from thinwire.workloads.base import Workload
    data = [(w[0][i], w[1][i]) for w in _data() for i in range(BATCH)]
    wl = Workload(model=model, train=data, val=data, loss=lm_loss)
    for r in measure_layers(wl, layer_list(model, charlm_layers), 4, reps=3, warmup=1):
        assert 0 <= r.forward_fixed_s <= r.forward_s * 4 and 0 <= r.backward_fixed_s <= r.backward_s * 4

    prof, spec = _layered_profile(), _cluster()
    fixed = dc.replace(prof, layers=[dc.replace(l, forward_fixed_s=l.forward_s * 4, backward_fixed_s=l.backward_s * 4)
                                     for l in prof.layers])  # half of a call of 8 is fixed
    runs = [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]]

    def step(p, m):
        return predict_pipeline(spec, p, list(spec.hosts), runs, microbatches=m, replica_batch=8,
                                activations=["fp32"] * 3, threads=1).step_s

    assert step(prof, 8) < step(prof, 4)  # per sample only: more micro-batches, a smaller bubble
    assert step(fixed, 8) > step(fixed, 4) and step(fixed, 4) > step(prof, 4)


def test_the_overhead_probe_times_both_schedules_and_the_model_charges_the_interleaved_ones():
    """The probe's two trivial 2-rank pipelines: an interleaved rank (2 stages, 3 hand-overs each way per
    micro-batch, posted by torch's multi-stage runtime) spends more per micro-batch than a 1F1B stage; the model
    charges an interleaved pipeline that measured overhead, split over a rank's stages (an old profile without
    it: 1F1B's per stage)."""
    import dataclasses as dc

    from thinwire.measure.pipeline_overhead import pipeline_overhead
    from thinwire.sim.pipeline import predict_pipeline

    got = pipeline_overhead(reps=3)
    assert got["interleaved_per_microbatch_s"] > got["per_microbatch_s"] > 0
    prof, spec = _layered_profile(), _cluster()
    runs = [[0, 1], [2], [3], [4], [5], [6], [7], [8, 9]]

    def step(p):
        return predict_pipeline(spec, p, list(spec.hosts), runs, microbatches=4, replica_batch=8,
                                activations=["fp32"] * 7, threads=1, schedule="interleaved").step_s

    cheap = dc.replace(prof, pipeline_overhead_s=1e-3)
    assert step(cheap) == pytest.approx(step(dc.replace(cheap, interleaved_overhead_s=2e-3)))
    assert step(dc.replace(cheap, interleaved_overhead_s=6e-3)) > step(cheap) + 4 * 2e-3


def _layered_profile(**kw):
    from tests.test_plan import profile
    from thinwire.measure.file import LayerRecord

    def layer(name, params, ms, saved=4e4):
        return LayerRecord(name=name, parameters=params, forward_s=ms / 3e3, backward_s=2 * ms / 3e3,
                           output_bytes=16384, saved_bytes=saved, width=64)

    layers = [layer("embed", 24_000, 0.05, 1e3)] + [layer(f"blocks.{i}", 94_000, 0.7) for i in range(8)] + \
             [layer("head", 24_000, 0.2)]
    import dataclasses as dc
    return dc.replace(profile(**kw), layers=layers, layers_batch=8)


def _cluster(rate="1gbit", **by_host):
    from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec
    hosts = [HostSpec(name=f"h{i}", **by_host.get(f"h{i}", {})) for i in range(4)]
    return ClusterSpec(name="pp", defaults=DefaultsSpec(bandwidth=rate, cpu=0.5), hosts=hosts)


def _plan(spec, batch=32):
    from thinwire.plan.planner import PlanOptions, make_plan
    return make_plan(spec, _layered_profile(), workload="charlm", model={},
                     options=PlanOptions(batch_size=batch, codecs=("none",), pipeline=True))


def test_planner_leaves_out_a_host_too_slow_for_any_stage_and_says_what_it_saves():
    """A host at a hundredth of a core holding only the head paced every micro-batch (6.75x slower than the
    pipeline over the other hosts): the planner tries the hosts without the slowest and keeps the fastest."""
    snail = _plan(_cluster(h3={"cpu": 0.005}))
    p = snail.pipeline
    assert snail.hosts == ["h0", "h1", "h2"] and p.left_out == ["h3"] and sum(
        s.last_layer - s.first_layer + 1 for s in p.stages) == 10
    assert p.with_all_hosts_step_s > 2 * p.predicted_step_s
    assert any(line.startswith("Leaving out h3: the best pipeline over every host is predicted at")
               for line in snail.explanation), snail.explanation
    slow = _plan(_cluster(h2={"cpu": 0.25}))  # a slower host that still pays for its layers keeps a stage
    assert slow.hosts == ["h0", "h1", "h2", "h3"] and slow.pipeline.left_out == []


def test_planner_gives_a_slow_host_fewer_layers_and_says_what_it_buys():
    even = _plan(_cluster())
    uneven = _plan(_cluster(h2={"cpu": 0.25}))
    counts = lambda plan: [s.last_layer - s.first_layer + 1 for s in plan.pipeline.stages]  # noqa: E731
    assert uneven.executable and uneven.hosts == ["h0", "h1", "h2", "h3"]
    assert counts(uneven)[2] < counts(even)[2] and sum(counts(uneven)) == 10
    p = uneven.pipeline
    assert p.predicted_step_s < p.even_split_step_s and p.schedule == "1f1b" and p.microbatches == 16
    assert any("even split by parameters" in line for line in uneven.explanation)
    spec = parse_pipeline_spec(p.spec_text())  # what `train --plan` runs
    assert spec.layers == tuple(counts(uneven)) and spec.microbatches == 16
    with pytest.raises(ThinwireError, match="pipeline plan"):
        uneven.shares(4)


def test_planner_takes_fewer_microbatches_where_their_fixed_cost_outweighs_the_bubble():
    """A micro-batch's fixed cost (hand-offs, a slow host's per-call overhead) times 16 micro-batches paced a small
    model's pipeline: the planner tried only 16 and more. In a scratch run on the emulator (a 12-layer conv net on
    examples/clusters/uneven-4.yaml, two runs each, not a benchmark): 16 micro-batches 58 ms per step, the 4 the
    planner now chooses 22 ms."""
    import dataclasses as dc

    from thinwire.plan.pipeline import microbatch_counts
    from thinwire.plan.planner import PlanOptions, make_plan

    assert microbatch_counts(32, 4) == [4, 8, 16, 32]
    from thinwire.sim.pipeline import predict_pipeline

    costly, spec = dc.replace(_layered_profile(), pipeline_overhead_s=5e-3), _cluster()
    p = make_plan(spec, costly, workload="charlm", model={},
                  options=PlanOptions(batch_size=32, codecs=("none",), pipeline=True)).pipeline
    runs = [list(range(s.first_layer, s.last_layer + 1)) for s in p.stages]
    at16 = predict_pipeline(spec, costly, list(spec.hosts), runs, microbatches=16, replica_batch=32,
                            activations=list(p.links), threads=1)
    assert p.microbatches < 16 and p.predicted_step_s < at16.step_s
    assert _plan(_cluster()).pipeline.microbatches == 16  # where compute dominates, the bubble still decides


def test_planner_interleaves_only_where_the_model_says_it_pays_and_the_plan_runs_as_planned():
    """A batch of 4 over 4 hosts: 1F1B idles 3/7 of its step. With a cheap runtime the planner gives each host 2
    stages (interleaved) and says what 1F1B would take; where the interleaved runtime's own cost per micro-batch
    is high, it keeps 1F1B and says so. The plan's pipeline spec parses back to its layout."""
    import dataclasses as dc

    from thinwire.plan.planner import PlanOptions, make_plan

    def plan(**kw):
        return make_plan(_cluster(), dc.replace(_layered_profile(), **kw), workload="charlm", model={},
                         options=PlanOptions(batch_size=4, codecs=("none",), pipeline=True))

    cheap = plan(pipeline_overhead_s=1e-4, interleaved_overhead_s=2e-4)
    p = cheap.pipeline
    assert (p.schedule, p.virtual, len(p.stages), p.hosts) == ("interleaved", 2, 8, ["h0", "h1", "h2", "h3"])
    assert p.alternative_step_s["1f1b"] > p.predicted_step_s / 0.97
    assert any("best 1f1b plan" in line for line in cheap.explanation)
    spec = parse_pipeline_spec(p.spec_text())
    assert (spec.schedule, spec.stages, spec.virtual, sum(spec.layers)) == ("interleaved", 4, 2, 10)
    costly = plan(pipeline_overhead_s=1e-4, interleaved_overhead_s=0.05)
    assert costly.pipeline.schedule == "1f1b" and "interleaved" in costly.pipeline.alternative_step_s
    assert any("best interleaved plan" in line and "not 3% faster" in line for line in costly.explanation)


def test_simulate_prices_an_interleaved_pipeline_per_stage_and_says_when_the_profile_cannot(tmp_path):
    """``simulate --pipeline interleaved``: a row per stage on its host (stage k on host k % 4); a profile
    from before the interleaved runtime's probe is priced at 1F1B's overhead, and the table says so."""
    import dataclasses as dc

    from thinwire.measure.file import save_profile

    spec = tmp_path / "c.yaml"
    spec.write_text("name: pp\ndefaults: {bandwidth: 1gbit, cpu: 0.5}\nhosts: [{name: h0}, {name: h1}, {name: h2}, "
                    "{name: h3}]\n")
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    save_profile(_layered_profile(), old)
    save_profile(dc.replace(_layered_profile(), interleaved_overhead_s=1e-3), new)
    outs = {}
    for name, prof in (("old", old), ("new", new)):
        r = thinwire("simulate", "--profile", str(prof), "--cluster", str(spec), "--pipeline", "interleaved",
                     "--batch-size", "8", "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = " ".join(r.stdout.split())
    assert "8-stage pipeline, 2 per rank" in outs["new"] and "│ 7 │ h3 │ blocks.7+head" in outs["new"]
    assert "has no interleaved runtime's overhead" in outs["old"]
    assert "has no interleaved runtime's overhead" not in outs["new"]
    pipe = json.loads((tmp_path / "new" / "simulate.json").read_text())["pipeline"]  # the file has the table's numbers
    assert pipe["spec"] == "interleaved" and len(pipe["stages"]) == 8 and pipe["predicted_step_s"] > 0
    assert pipe["stages"][7]["host"] == "h3" and pipe["stages"][7]["layers"] == ["blocks.7", "head"]
    for bad in ("2f2b", "interleaved:virtual=1"):  # refused before anything is written
        r = thinwire("simulate", "--profile", str(new), "--cluster", str(spec), "--pipeline", bad, "--batch-size", "8",
                     "--out", str(tmp_path / "bad"))
        assert r.returncode == 2 and "pipeline" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert not (tmp_path / "bad").exists()


def test_planner_compresses_only_links_that_pace_the_pipeline():
    fast, slow = _plan(_cluster("10gbit")), _plan(_cluster("5mbit"))
    assert set(fast.pipeline.links) == {"fp32"}
    assert "int8" in slow.pipeline.links and slow.pipeline.predicted_step_s > fast.pipeline.predicted_step_s


def test_a_memory_limit_no_split_meets_names_the_smallest_that_would_fit():
    from thinwire.plan.pipeline import smallest_stage_memory

    need = smallest_stage_memory(_layered_profile(), 4, batch=32)
    with pytest.raises(ThinwireError, match=rf"fits nowhere.*smallest split still needs {need / 2**20:.1f} MiB"):
        _plan(_cluster(**{f"h{i}": {"memory": int(need * 0.9)} for i in range(4)}))
    fits = _plan(_cluster(**{f"h{i}": {"memory": need} for i in range(4)}))
    assert all(s.memory_bytes <= need for s in fits.pipeline.stages)
    # one host without a limit holds the whole model: not "fits nowhere", but plan without --pipeline
    with pytest.raises(ThinwireError, match=r"--pipeline: no pipeline over all 4 hosts fits.*more than h1, h2, h3 "
                                            r"have. Data parallelism fits.*plan without --pipeline"):
        _plan(_cluster(**{f"h{i}": {"memory": 2**20} for i in range(1, 4)}))


def test_planner_recomputes_activations_or_takes_smaller_microbatches_only_when_memory_asks():
    import dataclasses as dc

    from thinwire.plan.pipeline import stage_memory

    roomy = _plan(_cluster())
    assert not roomy.pipeline.recompute and roomy.pipeline.microbatches == 16
    heavy = dc.replace(_layered_profile(), layers=[dc.replace(l, saved_bytes=2e6) for l in _layered_profile().layers])
    from thinwire.plan.planner import PlanOptions, make_plan

    def plan(memory):
        spec = _cluster(**{f"h{i}": {"memory": memory} for i in range(4)})
        return make_plan(spec, heavy, workload="charlm", model={},
                         options=PlanOptions(batch_size=32, codecs=("none",), pipeline=True)).pipeline

    free = plan(None)
    tight = plan(int(max(s.memory_bytes for s in free.stages) * 0.5))
    assert tight.recompute or tight.microbatches > free.microbatches
    assert all(s.memory_bytes <= int(max(x.memory_bytes for x in free.stages) * 0.5) for s in tight.stages)
    assert tight.predicted_step_s >= free.predicted_step_s
    assert parse_pipeline_spec(tight.spec_text()).recompute == tight.recompute
    run = list(range(1, 4))
    assert stage_memory(heavy, run, micro=2, inflight=4, recompute=True) < stage_memory(heavy, run, micro=2, inflight=4)


def test_pipeline_model_takes_host_speeds_measured_on_that_cluster_and_the_probed_hand_off_latency():
    import dataclasses as dc

    from thinwire.measure.file import HostSpeedRecord, NetworkRecord
    from thinwire.sim.pipeline import predict_pipeline

    spec, prof = _cluster(), _layered_profile()
    runs = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    price = dict(microbatches=8, replica_batch=32, activations=["fp32"] * 3, threads=1)
    base = predict_pipeline(spec, prof, list(spec.hosts), runs, **price)
    # h2 measured at a quarter of a core where the spec says half: its stage takes twice as long per micro-batch
    # at full speed, and longer than that in all, its quota running out sooner
    measured = HostSpeedRecord(cluster="pp", threads=1, batch=8, speed={"h0": 0.5, "h1": 0.5, "h2": 0.25, "h3": 0.5})
    slow = predict_pipeline(spec, dc.replace(prof, host_speed=measured), list(spec.hosts), runs, **price)
    # (stage 0's own work is unchanged; when its quota's periods fall differs, so its throttled time may, a little)
    assert slow.stage_s[2] >= 2 * base.stage_s[2] - 1e-12 and slow.stage_s[0] == pytest.approx(base.stage_s[0], rel=0.1)
    assert slow.step_s > base.step_s
    # measured on another cluster, or not for every host: the spec's cores, as before
    for other in (dc.replace(measured, cluster="elsewhere"), dc.replace(measured, speed={"h0": 0.1})):
        assert predict_pipeline(spec, dc.replace(prof, host_speed=other), list(spec.hosts), runs,
                                **price).step_s == pytest.approx(base.step_s)
    # hand-offs wait the probed point-to-point latency; the step's scalar all-reduces, a collective's alpha
    net = NetworkRecord(alpha_s=0.0, efficiency=0.95, nominal_bps=1e9, measured_bps=0.95e9, hosts=4, cluster="pp",
                        p2p_latency_s=0.0)
    free = predict_pipeline(spec, dc.replace(prof, network=net), list(spec.hosts), runs, **price)
    late = predict_pipeline(spec, dc.replace(prof, network=dc.replace(net, p2p_latency_s=0.01)), list(spec.hosts), runs,
                            **price)
    hops = predict_pipeline(spec, dc.replace(prof, network=dc.replace(net, alpha_s=0.01)), list(spec.hosts), runs,
                            **price)
    assert late.step_s - free.step_s >= 2 * 3 * 0.01 - 1e-9  # at least the first micro-batch's way there and back
    assert late.after_s == pytest.approx(free.after_s)
    assert hops.after_s - free.after_s == pytest.approx((2 * 3 + 2 * 3) * 0.01)  # 4 stages: norm and loss rings


def test_a_cpu_quota_runs_short_work_between_idle_gaps_at_full_speed_and_work_without_pause_at_its_share():
    """The emulator's ``cpu:`` is a CFS quota: one period's quota may be spent at once, at full speed, and a
    host that has spent it waits for the next period."""
    from thinwire.perf.pipeline import simulate_schedule

    def step(quota=None, forward=1.0, busy=None):
        return simulate_schedule(forward_s=[forward] * 2, backward_s=[2 * forward] * 2, send_forward_s=[0] * 2,
                                 send_backward_s=[0] * 2, microbatches=8, quota=quota, busy_s=busy)

    full = step()
    assert full == 27.0  # (M + S - 1)(f + b)
    assert step([(0.5, 0.0)] * 2) == pytest.approx(2 * full)  # no bucket: every computation at half speed
    assert step([(0.5, 1e9)] * 2) == pytest.approx(full)  # a quota that never runs out: full speed
    # periods of 4 s holding 2 s of running: full speed while a period's quota lasts, a wait for the next after
    busy = []
    some = step([(0.5, 2.0)] * 2, busy=busy)
    assert full < some < 2 * full and all(24 < b < 48 for b in busy)  # 24 s of work each, some of it waiting
    # short work with idle gaps between (stage 1 waits for a slow stage 0): full speed within its quota
    busy = []
    simulate_schedule(forward_s=[1.0, 0.1], backward_s=[2.0, 0.2], send_forward_s=[0, 0], send_backward_s=[0, 0],
                      microbatches=8, quota=[(1.0, 0.0), (0.5, 1.0)], busy_s=busy)
    assert busy == pytest.approx([24.0, 2.4])  # 0.3 s of work every 3 s: never more than a period's 1 s


def test_the_pipeline_model_runs_a_stage_at_full_speed_while_its_cpu_quota_lasts(monkeypatch):
    """A stage host's ``cpu:`` quota (0.5 core, 10 ms periods of 5 ms running): stages whose micro-batch fits a
    period's 5 ms compute at full speed (twice the sustained speed) but where a period's quota ran out; the
    busiest is throttled more of the time."""
    from thinwire.sim import pipeline as P

    spec, prof = _cluster(), _layered_profile()
    assert P.cpu_quotas(list(spec.hosts)) == [(0.5, 0.005)] * 4
    runs = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    price = dict(microbatches=8, replica_batch=32, activations=["fp32"] * 3, threads=1)
    burst = P.predict_pipeline(spec, prof, list(spec.hosts), runs, **price)
    monkeypatch.setattr(P, "cpu_quotas", lambda hosts, **_: [(1.0, 0.0)] * len(hosts))
    flat = P.predict_pipeline(spec, prof, list(spec.hosts), runs, **price)  # every stage at the sustained speed
    for k in range(4):
        assert flat.stage_s[k] / 2 - 1e-12 <= burst.stage_s[k] < 0.9 * flat.stage_s[k]
    assert burst.stage_s[1] / flat.stage_s[1] > burst.stage_s[3] / flat.stage_s[3]  # stage 1 the busiest
    assert burst.step_s < flat.step_s


def test_the_pipeline_model_scales_the_layers_costs_to_the_whole_models_step_at_the_same_batch(monkeypatch):
    """Layers timed one by one give each stage's share; the whole model's measured forward and backward at the
    profile's layer batch give the total (a 25M-parameter charlm's backward: 110 ms where its layers add up to 78)."""
    import dataclasses as dc

    from thinwire.measure.file import ComputePoint
    from thinwire.sim import pipeline as P

    monkeypatch.setattr(P, "cpu_quotas", lambda hosts, **_: [(1.0, 0.0)] * len(hosts))
    spec, prof = _cluster(), _layered_profile()
    b = prof.layers_batch
    fsum = sum(l.forward_call_s(b, b) for l in prof.layers)
    bsum = sum(l.backward_call_s(b, b) for l in prof.layers)

    def at(forward, backward, batch=b):
        point = ComputePoint(batch=batch, pre_s=forward, forward_s=forward, backward_s=backward, post_s=0.003)
        return dc.replace(prof, compute=[point])

    runs = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    price = dict(microbatches=8, replica_batch=32, activations=["fp32"] * 3, threads=1)
    assert P.layer_scales(at(fsum, bsum)) == pytest.approx((1.0, 1.0))
    assert P.layer_scales(at(2 * fsum, 3 * bsum)) == pytest.approx((2.0, 3.0))
    assert P.layer_scales(at(2 * fsum, 3 * bsum, batch=b + 1)) == (1.0, 1.0)  # measured at another batch: as timed
    assert P.layer_scales(at(0.0, bsum)) == pytest.approx((1.0, 1.0))  # an older profile without forward_s
    same = P.predict_pipeline(spec, at(fsum, bsum), list(spec.hosts), runs, **price)
    slow = P.predict_pipeline(spec, at(fsum, 3 * bsum), list(spec.hosts), runs, **price)
    assert slow.step_s > 1.5 * same.step_s
    assert slow.stage_s[1] > 2 * same.stage_s[1]


def test_a_token_bucket_lets_messages_between_idle_gaps_pass_free_and_back_to_back_ones_pay_the_rate():
    """tc's tbf (the emulator's links): credit gathers while an egress idles, up to the bucket."""
    from thinwire.perf.pipeline import simulate_schedule

    def step(send, credit=None):
        return simulate_schedule(forward_s=[1] * 4, backward_s=[2] * 4, send_forward_s=[send] * 4,
                                 send_backward_s=[send] * 4, microbatches=8, credit_s=credit)

    free = step(0.0)
    assert step(0.3, [0.0] * 4) == step(0.3) > free  # no bucket: every message pays the rate
    assert step(0.3, [0.3] * 4) == pytest.approx(free)  # compute-bound: each message within the credit regained
    # link-bound (3 s of sending per 3 s of compute a micro-batch, twice per middle host): the buckets help
    # in the fill and drain, and a bigger one more, but the rate is paid in between
    assert step(3.0) > step(3.0, [0.5] * 4) > step(3.0, [1.0] * 4) > 2 * free


def test_pipeline_model_spends_the_probed_token_bucket_on_hand_overs():
    import dataclasses as dc

    from thinwire.measure.file import NetworkRecord
    from thinwire.sim.pipeline import predict_pipeline

    runs = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    price = dict(microbatches=8, replica_batch=32, activations=["fp32"] * 3, threads=1)
    net = NetworkRecord(alpha_s=0.0, efficiency=0.95, nominal_bps=1e7, measured_bps=0.95e7, hosts=4, cluster="pp",
                        p2p_latency_s=0.0)
    prof = dc.replace(_layered_profile(), network=net)

    def step(rate, burst):
        spec = _cluster(rate)
        return predict_pipeline(spec, dc.replace(prof, network=dc.replace(net, burst_bytes=burst)), list(spec.hosts),
                                runs, **price).step_s

    assert step("10mbit", None) == step("10mbit", 0.0) > step("10mbit", 32 * 1024) > step("10mbit", 10**9)
    assert step("10mbit", 10**9) == pytest.approx(step("10tbit", None), rel=1e-4)  # a bucket it never empties


def test_pipeline_model_charges_each_stage_its_links_wire_formats(monkeypatch):
    """int8 links cost the stages their packing: the sender packs its output and unpacks the gradient that
    comes back, the receiver unpacks its input and packs its gradient (stochastically), per micro-batch, at
    the stage host's speed (here its sustained speed: no bursts under the quota)."""
    import dataclasses as dc

    from thinwire.measure.file import Cost, HostSpeedRecord
    from thinwire.sim import pipeline as P
    from thinwire.sim.pipeline import predict_pipeline

    monkeypatch.setattr(P, "cpu_quotas", lambda hosts, **_: [(1.0, 0.0)] * len(hosts))

    spec = _cluster()
    half = HostSpeedRecord(cluster="pp", threads=1, batch=8, speed={f"h{i}": 0.5 for i in range(4)})
    prof = dc.replace(_layered_profile(), host_speed=half)
    runs = [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    price = dict(microbatches=8, replica_batch=32, threads=1)
    pack, unpack, pack_grad = 1e-9, 2e-9, 4e-9
    costed = dc.replace(prof, kernels={**prof.kernels, "wire_int8_pack": Cost(fixed_s=0.0, per_byte_s=pack),
                                       "wire_int8_unpack": Cost(fixed_s=0.0, per_byte_s=unpack),
                                       "wire_int8_pack_grad": Cost(fixed_s=0.0, per_byte_s=pack_grad)})
    plain = predict_pipeline(spec, prof, list(spec.hosts), runs, activations=["int8"] * 3, **price)
    int8 = predict_pipeline(spec, costed, list(spec.hosts), runs, activations=["int8"] * 3, **price)
    cut = [prof.layers[r[-1]].output_bytes * 32 // 8 for r in runs]  # a micro-batch's output of each stage
    sender, receiver = pack + unpack, unpack + pack_grad
    expected = [cut[0] * sender, cut[0] * receiver + cut[1] * sender, cut[1] * receiver + cut[2] * sender,
                cut[2] * receiver]
    assert [a - b for a, b in zip(int8.stage_s, plain.stage_s)] == pytest.approx([e / 0.5 for e in expected])
    assert int8.step_s > plain.step_s
    # fp32 links pack nothing; a profile without these kernels (older) charges nothing
    fp32 = dict(activations=["fp32"] * 3, **price)
    assert predict_pipeline(spec, costed, list(spec.hosts), runs, **fp32).stage_s == \
        predict_pipeline(spec, prof, list(spec.hosts), runs, **fp32).stage_s


def test_wire_formats_are_measured_per_byte_for_the_pipeline_model():
    from thinwire.measure.codec_costs import measure_wire

    costs = measure_wire(64, 4096, 3)
    assert set(costs) == {f"wire_{c}_{k}" for c in ("bf16", "int8") for k in ("pack", "pack_grad", "unpack")}
    big = 4 * 16 * 16_384  # bytes of fp32 activation at the larger size measured
    assert all(c.per_byte_s >= 0 and c.fixed_s >= 0 and c.fixed_s + c.per_byte_s * big > 0 for c in costs.values())
    # int8's stochastic gradient packing draws a random number per value: never cheaper than bf16's cast
    assert costs["wire_int8_pack_grad"].per_byte_s * big + costs["wire_int8_pack_grad"].fixed_s > \
        costs["wire_bf16_pack_grad"].per_byte_s * big + costs["wire_bf16_pack_grad"].fixed_s


def test_a_pipeline_plan_for_another_model_is_refused_as_such_not_by_its_layer_counts(tmp_path):
    """`train --plan` with a pipeline plan made for another model said that the plan's layer counts do not add
    up to this model's layers: true, but the cause (a plan for another workload) went unsaid."""
    from thinwire.config import save_yaml
    from thinwire.plan.planfile import save_plan

    spec = _cluster()
    save_yaml(spec, tmp_path / "spec.yaml")
    save_plan(_plan(spec), tmp_path / "plan.yaml")
    r = thinwire("train", "--workload", "charlm", "--set", "model.layers=3", "--plan", str(tmp_path / "plan.yaml"),
                 "--cluster", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "was made for another workload: model options" in r.stderr and "pipeline.layers" not in r.stderr


def test_plan_refuses_to_pipeline_a_model_without_a_layer_list_before_profiling_it(tmp_path):
    from tests.test_cli import ROOT

    r = thinwire("plan", "--workload", "digits", "--pipeline", "--cluster", str(ROOT / "examples/clusters/uneven-4.yaml"),
                 "--out", str(tmp_path / "plan.yaml"))
    assert r.returncode == 2 and "has no layer list to cut into stages" in r.stderr, r.stderr[-2000:]
    assert "measuring digits" not in r.stderr and not (tmp_path / "plan.yaml").exists()
