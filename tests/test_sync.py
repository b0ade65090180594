"""Sync modes (thinwire.compress.sync) on 2 gloo ranks against closed-form references, their specs'
refusals, the bytes they put on the wire, and a mid-period resume through ``thinwire train``."""

from __future__ import annotations

import contextlib
import os
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.errors import ConfigError
from thinwire.syncspec import SyncSpec, parse_sync_spec
from tests.distributed import run_ranks

LR, STEPS = 0.1, 6


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _grads(w: dict, step: int, world: int) -> dict:
    """The rank-average of the gradient at parameters ``w`` on step ``step``'s data (closed form, autograd)."""
    net = _net()
    net.load_state_dict(w)
    for r in range(world):
        x, y = _data(step, r)
        (_loss(net, x, y) / world).backward()
    return {k: p.grad.clone() for k, p in net.named_parameters()}


def _steps(ddp, sync, opt, rank: int, steps: int = STEPS) -> list[int]:
    """``steps`` SGD steps of a user's loop on ``_data``; the bytes each step sent."""
    sent = []
    for step in range(steps):
        before = sync.comm.wire.bytes_sent
        x, y = _data(step, rank)
        with sync.no_sync():
            _loss(ddp, x, y).backward()
        sync.step(opt)
        opt.zero_grad(set_to_none=True)
        sent.append(sync.comm.wire.bytes_sent - before)
    return sent


def _train(rank: int, world: int, mode: str, codec: str, opt_name: str = "sgd") -> dict:
    ddp = DistributedDataParallel(_net())
    sync = thinwire.sync(ddp, mode, codec=codec)
    sent = _steps(ddp, sync, torch.optim.SGD(ddp.parameters(), lr=LR), rank)
    sync.close()
    return {"params": {k: v.clone() for k, v in ddp.module.state_dict().items()}, "sent": sent, "stats": sync.stats()}


def _sgd(w: dict, g: dict, lr: float = LR) -> dict:
    return {k: w[k] - lr * g[k] for k in w}


def _grads_at(points: list[dict], step: int) -> dict:
    """The rank-average of each rank's gradient on step ``step``'s data, rank r's taken at ``points[r]``."""
    world, out = len(points), None
    for r, w in enumerate(points):
        g = _grads_one(w, step, r)
        out = g if out is None else {k: out[k] + g[k] for k in g}
    return {k: v / world for k, v in out.items()}


@pytest.mark.parametrize("predict", ["off", "last", "own"])
def test_delayed_equals_one_step_stale_sgd(predict):
    """Step t applies the average of step t-1's gradients; step 0 applies nothing. Each rank takes its
    gradient at step t's parameters (``off``), there moved by their last update (``last``), or by the
    optimizer's step with that rank's own gradient of step t-1 (``own``, default: SGD's ``w - lr g``)."""
    out = run_ranks(_train, 2, "delayed" if predict == "own" else f"delayed:predict={predict}", "none")
    w, before, previous, own = _net().state_dict(), None, None, None
    for step in range(STEPS):
        if predict == "last" and before is not None:
            points = [{k: w[k] + (w[k] - before[k]) for k in w}] * 2
        elif predict == "own" and own is not None:
            points = [_sgd(w, own[r]) for r in range(2)]
        else:
            points = [w, w]
        g = _grads_at(points, step)
        own = [_grads_one(points[r], step, r) for r in range(2)]
        before = w
        w = _sgd(w, previous) if previous is not None else w
        previous = g
    for r in out:
        for k in w:
            torch.testing.assert_close(r["params"][k], w[k], rtol=1e-5, atol=1e-6)
    assert all(s > 0 for s in out[0]["sent"])  # every step's gradient went on the wire


def _predicting(rank: int, world: int, told: bool) -> dict:
    """delayed's weight prediction seen from a user's loop: where the parameters are at each point. ``told``:
    the loop sets ``sync.optimizer`` (as ``sync.step(opt)`` and the trainers do), else it steps by itself."""
    ddp = DistributedDataParallel(_net())
    sync = thinwire.sync(ddp, "delayed", codec="none")
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    w = lambda: [p.detach().clone() for p in ddp.parameters()]  # noqa: E731
    seen = {"eval": [], "forward": [], "before": [], "true": [], "own": []}
    for step in range(4):
        x, y = _data(step, rank)
        seen["true"].append(w())
        ddp.eval()
        with torch.no_grad():
            ddp(x)  # a forward in eval mode: no prediction
        ddp.train()
        seen["eval"].append(w())
        loss = _loss(ddp, x, y)  # the forward outside no_sync, as accelerate's loop has it
        seen["forward"].append(w())
        with sync.no_sync():
            loss.backward()
        seen["own"].append([p.grad.clone() for p in ddp.parameters()])
        sync.before_step()
        seen["before"].append(w())
        opt.step()
        if told:
            sync.optimizer = opt
        sync.after_step()
        opt.zero_grad(set_to_none=True)
    sync.close()
    return seen


@pytest.mark.parametrize("told", [True, False])
def test_delayed_predicts_only_in_training_forward_and_restores_the_true_weights_exactly(told):
    """With its optimizer known, a step's forward runs where SGD's step with this rank's own last gradient
    puts the weights (``predict=own``); without it, where the last update repeated does (``last``)."""
    seen = run_ranks(_predicting, 2, told)[0]
    for step in range(4):
        true = seen["true"][step]
        assert all(torch.equal(a, b) for a, b in zip(seen["eval"][step], true))    # eval forward: untouched
        assert all(torch.equal(a, b) for a, b in zip(seen["before"][step], true))  # back bit for bit
        moved = [f - t for f, t in zip(seen["forward"][step], true)]
        if told and step >= 1:
            expected = [-LR * g for g in seen["own"][step - 1]]
        elif not told and step >= 2:  # step 0 applies nothing, so step 1's last update is zero too
            expected = [t - b for t, b in zip(true, seen["true"][step - 1])]
        else:
            assert all(m.abs().max() == 0 for m in moved)
            continue
        assert any(m.abs().max() > 0 for m in moved)
        for m, u in zip(moved, expected):
            torch.testing.assert_close(m, u, rtol=1e-5, atol=1e-7)


def _wrapper_left_in_eval(rank: int, world: int) -> bool:
    """Lightning's validation puts the DDP wrapper in eval mode and then only the LightningModule back in train."""
    ddp = DistributedDataParallel(_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    sync = thinwire.sync(ddp, "delayed", codec="none", optimizer=opt)
    moved = []
    for step in range(2):
        x, y = _data(step, rank)
        ddp.eval()
        ddp.module.train()
        true = [p.detach().clone() for p in ddp.parameters()]
        with sync.no_sync():
            loss = _loss(ddp, x, y)
            moved.append(any(not torch.equal(p, t) for p, t in zip(ddp.parameters(), true)))
            loss.backward()
        sync.step(opt)
        opt.zero_grad(set_to_none=True)
    sync.close()
    return moved == [False, True]


def test_delayed_predicts_where_only_the_wrapped_module_is_in_training_mode():
    """The prediction looked at the DDP wrapper's mode: under Lightning, after the sanity check's validation,
    it never predicted again (a regression's loss 1.63 against 0.22 without validation)."""
    assert run_ranks(_wrapper_left_in_eval, 2) == [True, True]


def _forward_outside(rank: int, world: int, mode: str) -> list:
    ddp = DistributedDataParallel(_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    sync = thinwire.sync(ddp, mode, codec="none", optimizer=opt)
    x, y = _data(0, rank)
    loss = _loss(ddp, x, y)   # the forward outside no_sync, as accelerate's loops are written
    with sync.no_sync():
        loss.backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    sync.close()
    return grads


@pytest.mark.parametrize("mode", ["local:period=4", "diloco:period=4", "gossip", "delayed"])
def test_a_mode_that_averages_itself_keeps_each_ranks_gradient_though_the_forward_ran_outside_no_sync(mode):
    """DDP decides at the forward whether its backward all-reduces: with only backward in no_sync, every
    gradient crossed the wire in fp32 besides the mode's own averaging (accelerate's documented loop)."""
    got = run_ranks(_forward_outside, 2, mode)
    for rank in range(2):
        net = _net()
        _loss(net, *_data(0, rank)).backward()
        for g, p in zip(got[rank], net.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)


class _Branchy(torch.nn.Module):
    """A shared layer, a branch only rank 0's data takes, and a layer no forward calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.branch, self.dead = torch.nn.Linear(5, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x, take_branch: bool):
        h = self.shared(x)
        return self.branch(h) if take_branch else h


def _unused(rank: int, world: int, mode: str, resume_at: int | None = None) -> dict:
    def build(state=None):
        ddp = DistributedDataParallel(_Branchy(), find_unused_parameters=True)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)
        sync = thinwire.sync(ddp, mode, codec="none", optimizer=opt) if mode != "ddp" else None
        if state is not None:  # a resume: a new wrapper, optimizer and mode from the states saved
            ddp.module.load_state_dict(state[0])
            opt.load_state_dict(state[1])
            sync.load_state_dict(state[2])
        return ddp, opt, sync

    ddp, opt, sync = build()
    for step in range(STEPS):
        if step == resume_at:
            state = copy.deepcopy((ddp.module.state_dict(), opt.state_dict(), sync.state_dict()))
            sync.close()
            ddp, opt, sync = build(state)
        x, y = _data(step, rank)
        with sync.no_sync() if sync else contextlib.nullcontext():
            ((ddp(x, rank == 0) - y) ** 2).mean().backward()
        sync.step(opt) if sync else opt.step()
        grads = {k: p.grad is not None for k, p in ddp.module.named_parameters()}
        opt.zero_grad(set_to_none=True)
    if sync:
        sync.close()
    return {"params": {k: v.clone() for k, v in ddp.module.state_dict().items()}, "grads": grads}


@pytest.mark.parametrize("mode, resume_at", [("delayed:predict=off", None), ("delayed", None), ("delayed", 3),
                                             ("local:period=4", None)])
def test_a_parameter_no_rank_used_keeps_no_gradient_as_under_ddp_with_find_unused_parameters(mode, resume_at):
    """DDP wrapped with ``find_unused_parameters`` leaves a parameter no rank used without a gradient (AdamW skips
    it) and averages one only some ranks used; the modes averaged zeros for it, so weight decay and momentum moved
    a layer no forward called. ``local``'s warm-up steps average gradients as DDP does: the same parameters.
    ``delayed`` keeps which parameters its pending average left out through a resume."""
    got, ddp = run_ranks(_unused, 2, mode, resume_at), run_ranks(_unused, 2, "ddp")
    init = _Branchy().state_dict()
    for out in got:
        assert out["grads"]["dead.weight"] is False and out["grads"]["branch.weight"] is True, out["grads"]
        for k in ("dead.weight", "dead.bias"):
            assert torch.equal(out["params"][k], init[k]), k   # zeros averaged: weight decay moved it
        assert not torch.equal(out["params"]["branch.weight"], init["branch.weight"])  # rank 1 applies rank 0's part
        for k, v in out["params"].items():
            assert torch.equal(v, got[0]["params"][k]), k  # the ranks agree
            if mode.startswith("local"):
                torch.testing.assert_close(v, ddp[0]["params"][k], rtol=1e-5, atol=1e-6)


def _float64(rank: int, world: int, mode: str) -> torch.Tensor:
    ddp = DistributedDataParallel(_net().double())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    sync = thinwire.sync(ddp, mode, codec="none", optimizer=opt)
    for step in range(3):
        x, y = _data(step, rank)
        with sync.no_sync():
            _loss(ddp, x.double(), y.double()).backward()
        sync.step(opt)
        opt.zero_grad(set_to_none=True)
    sync.close()
    return ddp.module.weight.detach().clone()


@pytest.mark.parametrize("mode", ["local:period=1,warmup=0", "diloco:period=1,warmup=0,outer_lr=1,outer_momentum=0"])
def test_a_float64_model_is_averaged_in_float64(mode):
    """The modes' buckets were fp32: every average rounded a float64 model's parameters to fp32 (1e-8 off DDP)."""
    got, ddp = run_ranks(_float64, 2, mode)[0], run_ranks(_float64, 2, "allreduce")[0]
    assert got.dtype == torch.float64 and (got - ddp).abs().max() < 1e-14, (got - ddp).abs().max()
    assert (got.float().double() - got).abs().max() > 0  # not values fp32 can hold


def _sync_error(rank: int, world: int, mode: str, codec, sparse: bool) -> str | None:
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)) if sparse else _net()
    try:
        thinwire.sync(DistributedDataParallel(net), mode, codec=codec).close()
    except (TypeError, ValueError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("mode, codec, sparse, match", [
    ("delayed", "int8", True, r"sync delayed: 0 makes sparse gradients \(sparse=True\).*sparse=False"),
    ("local:period=4,warmup=2", "none", True, r"sync local: 0 makes sparse gradients"),
    ("local:period=4", 5, False, r"thinwire.sync: codec must be a spec string such as 'none', 'int8'.*got 5"),
])
def test_sync_refuses_what_it_cannot_average_in_one_line(mode, codec, sparse, match):
    """A sparse embedding failed at the first step in Buckets.flatten (reshape is not implemented for sparse
    tensors); codec=5 with AttributeError: 'int' object has no attribute 'text'."""
    (msg,) = run_ranks(_sync_error, 1, mode, codec, sparse)
    assert msg is not None and __import__("re").search(match, msg), msg


def _loop_resumed(rank: int, world: int, stop: int | None, mode_spec: str = "delayed", codec: str = "int8",
                  net=_net, optimizer=torch.optim.AdamW, comm_first: bool = False) -> dict:
    """A user's loop with ``mode_spec`` that saves its state at step ``stop`` as the README says and goes on in
    fresh objects, as a resumed process would; None: straight through. Each rank's own final state."""
    def fresh(saved=None):
        ddp = DistributedDataParallel(net())
        opt = optimizer(ddp.parameters(), lr=LR)
        mode = thinwire.sync(ddp, mode_spec, codec=codec, optimizer=opt)
        if saved is not None:
            ddp.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            mode.load_state_dict(saved["mode"])
            mode.comm.load_state_dict(saved["comm"])
        return ddp, opt, mode

    ddp, opt, mode = fresh()
    for step in range(STEPS):
        if step == stop:
            comm = mode.comm.state_dict() if comm_first else None  # the README names no order
            saved = copy.deepcopy({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                                   "mode": mode.state_dict(), "comm": comm or mode.comm.state_dict()})
            mode.close()
            ddp, opt, mode = fresh(saved)
        x, y = _data(step, rank)
        with mode.no_sync():
            _loss(ddp, x, y).backward()
        mode.step(opt)
        opt.zero_grad(set_to_none=True)
    mode.close()
    return {k: v.clone() for k, v in ddp.module.state_dict().items()}


def test_delayed_resumes_exactly_in_a_users_loop_given_its_optimizer():
    """The first step after a resume predicts with the optimizer (passed to thinwire.sync), not by the
    last update: a loop that steps with mode.step(opt) told it only after that step's forward."""
    straight = run_ranks(_loop_resumed, 2, None)[0]
    resumed = run_ranks(_loop_resumed, 2, 3)[0]
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


@pytest.mark.parametrize("mode, codec", [("delayed", "fp16"), ("delayed", "randomk:ratio=0.3"),
                                         ("diloco:period=2,fragments=2", "fp16")])
def test_a_resume_is_exact_whichever_state_is_saved_first_and_a_summable_codecs_residual_is_the_last_steps(mode, codec):
    """Two defects: the comm state saved before the mode's read the residuals while the last average was on the
    wire (the resume forked); and with a summable codec (fp16, random-k), whose collectives are issued on the
    caller's thread and whose residual is written when the average arrives, `delayed` sent step t before step
    t - 1's residual was written, so a residual was fed back twice (two identical runs ended apart)."""
    straight = [run_ranks(_loop_resumed, 2, None, mode, codec)[0] for _ in range(2)]
    resumed = run_ranks(_loop_resumed, 2, 3, mode, codec, _net, torch.optim.AdamW, True)[0]
    for k in straight[0]:
        assert torch.equal(straight[0][k], straight[1][k]), k
        assert torch.equal(straight[0][k], resumed[k]), k


def _residual_order(rank: int, world: int, codec: str) -> int:
    """`delayed` with a summable codec, each residual read and write seen: the reads that found an older residual than
    the step before's (step t's encode ran before step t - 1's average had arrived and written its residual)."""
    import torch.nn.functional as F

    import thinwire.compress.schemes.summed as summed

    events: list[tuple[str, int]] = []
    corrected, remember = summed.corrected, summed.remember

    def reading(job, key, x):
        events.append(("read", job.step))
        return corrected(job, key, x)

    def writing(job, key, c, sent):
        events.append(("write", job.step))
        return remember(job, key, c, sent)

    summed.corrected, summed.remember = reading, writing
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mode = thinwire.sync(ddp, "delayed", codec=codec, optimizer=opt)
    try:
        for step in range(12):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
            with mode.no_sync():
                F.cross_entropy(ddp(x), y).backward()
            mode.step(opt)
            opt.zero_grad()
    finally:
        mode.close()
        summed.corrected, summed.remember = corrected, remember
    written, stale = -1, 0
    for kind, step in events:
        if kind == "write":
            written = max(written, step)
        elif step > 0 and written < step - 1:
            stale += 1
    return stale


@pytest.mark.parametrize("codec", ["fp16", "randomk:ratio=0.3"])
def test_delayed_with_a_summable_codec_reads_each_residual_after_the_step_before_wrote_it(codec):
    """A summable codec's collectives are issued on the caller's thread and its residual written when the average
    arrives; `delayed` sends step t before it collects t - 1, and read t - 2's residual (half the reads, two identical
    runs ending apart): a residual fed back twice, the next one lost."""
    assert run_ranks(_residual_order, 2, codec) == [0, 0]


def _stepped_alone(rank: int, world: int, mode_spec: str, how: str) -> str:
    ddp = DistributedDataParallel(_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR)  # another model's optimizer: not refused
    mode = thinwire.sync(ddp, mode_spec, codec="int8", optimizer=opt)
    try:
        for step in range(3):
            with mode.no_sync():
                _loss(ddp, *_data(step, rank)).backward()
            other.step()
            if how == "mode.step":
                mode.step(opt)
            elif how == "three calls":
                mode.before_step()
                opt.step()
                mode.after_step()
            elif how == "two optimizers":  # one for a layer, one for the rest, both between before and after
                params = list(ddp.parameters())
                first, rest = torch.optim.SGD(params[:1], lr=LR), torch.optim.SGD(params[1:], lr=LR)
                mode.before_step()
                first.step()
                rest.step()
                mode.after_step()
            elif how == "twice":  # one before_step, then the same optimizer again: the second step is bare
                mode.before_step()
                opt.step()
                opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    except RuntimeError as e:
        return str(e)
    finally:
        mode.close()
    opt.step()  # after close(): the model's optimizer is the user's again
    return "trained"


@pytest.mark.parametrize("mode", ["delayed", "local:period=2,warmup=1", "diloco:period=2"])
def test_an_optimizer_step_that_no_before_step_prepared_is_refused(mode):
    """`opt.step()` where `mode.step(opt)` belongs averaged nothing, and the ranks drifted apart without a word."""
    for said in run_ranks(_stepped_alone, 2, mode, "opt.step"):
        assert said.startswith(f"thinwire.sync {mode.partition(':')[0]}: optimizer.step() was called without "
                               "mode.before_step()") and "call mode.step(optimizer) instead" in said, said
    assert run_ranks(_stepped_alone, 2, mode, "mode.step") == ["trained", "trained"]
    assert run_ranks(_stepped_alone, 2, mode, "three calls") == ["trained", "trained"]
    # two optimizers on one model (a layer of its own): the second one's step was refused as if bare
    assert run_ranks(_stepped_alone, 2, mode, "two optimizers") == ["trained", "trained"]
    assert all("was called without mode.before_step()" in said for said in run_ranks(_stepped_alone, 2, mode, "twice"))


def _state_of_another_mode(rank: int, world: int, saved_by: str, loaded_by: str) -> str:
    nets = [DistributedDataParallel(_net()) for _ in range(2)]
    opts = [torch.optim.SGD(n.parameters(), lr=LR) for n in nets]
    first, second = (thinwire.sync(n, spec, codec="none", optimizer=o)
                     for n, spec, o in zip(nets, (saved_by, loaded_by), opts))
    with first.no_sync():
        _loss(nets[0], *_data(0, rank)).backward()
    first.step(opts[0])
    try:
        second.load_state_dict(first.state_dict())
        return "loaded"
    except ValueError as e:
        return str(e)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("saved_by, loaded_by, names", [
    ("local:period=4,warmup=0", "diloco:period=4", ("LocalSGD", "DiLoCo")),
    ("local:period=4,warmup=0", "dynamic", ("LocalSGD", "Dynamic")),
    ("diloco:period=4,fragments=2", "local:period=4,fragments=2,warmup=0", ("StreamingDiLoCo", "StreamingLocal"))])
def test_another_modes_state_is_refused_though_its_keys_fit(saved_by, loaded_by, names):
    """Local SGD's keys are a subset of DiLoCo's and dynamic averaging's, and the two streaming modes' are the same:
    each took the other's state without a word."""
    said = run_ranks(_state_of_another_mode, 1, saved_by, loaded_by)[0]
    assert said.startswith(f"{names[1]}.load_state_dict: this is a {names[0]} mode's state"), said


def _auto_resumed(rank: int, world: int, stop: int | None) -> dict:
    """``auto`` that has chosen delayed (as a checkpoint taken after its choice holds it), in a user's loop."""
    import thinwire.compress.sync.choose as choose

    init = choose.ChooseSync.__init__

    def chosen(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.choice, self.delayed.active = "delayed", True

    choose.ChooseSync.__init__ = chosen
    return _loop_resumed(rank, world, stop, "auto")


def test_auto_resumed_on_delayed_predicts_with_the_optimizer_it_was_given():
    """``thinwire.sync(..., "auto", optimizer=opt)`` handed the optimizer to its delayed mode only after a step: a
    resumed run's first forward fell back to repeating the last update, saying no optimizer was passed."""
    straight = run_ranks(_auto_resumed, 2, None)[0]
    resumed = run_ranks(_auto_resumed, 2, 4)[0]
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def _delayed_with_a_nan(rank: int, world: int) -> list[int]:
    """A user's loop that skips the optimizer step on a non-finite gradient, as the trainer does; rank 1's loss is
    NaN at step 2 only. The steps it skipped."""
    ddp = DistributedDataParallel(_net())
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    mode = thinwire.sync(ddp, "delayed", codec="none", optimizer=opt)
    skipped = []
    for step in range(STEPS + 2):
        x, y = _data(step, rank)
        with mode.no_sync():
            loss = _loss(ddp, x, y)
            (loss * float("nan") if step == 2 and rank == 1 else loss).backward()
        mode.before_step()
        if all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()):
            opt.step()
        else:
            skipped.append(step)
        mode.after_step()
        opt.zero_grad(set_to_none=True)
    mode.close()
    return skipped


def test_delayed_skips_one_step_for_one_nan_gradient():
    """Step 2's NaN reaches the weights' update one step late, at step 3, which is skipped. Kept as rank 1's own
    gradient, it predicted step 3's weights as NaN, hence a NaN gradient, and so on: every later step skipped."""
    assert run_ranks(_delayed_with_a_nan, 2) == [[3], [3]]


def test_delayed_works_with_a_lossy_codec_and_keeps_ranks_identical():
    out = run_ranks(_train, 2, "delayed", "int8")
    fp32 = run_ranks(_train, 2, "delayed", "none")
    for k in out[0]["params"]:
        assert torch.equal(out[0]["params"][k], out[1]["params"][k]), k
        torch.testing.assert_close(out[0]["params"][k], fp32[0]["params"][k], rtol=0.05, atol=0.02)


def _ddp_sgd() -> dict:
    w = _net().state_dict()
    for step in range(STEPS):
        w = _sgd(w, _grads(w, step, 2))
    return w


@pytest.mark.parametrize("mode", ["allreduce", "local:period=1,warmup=0", "local:period=1,warmup=3",
                                  "diloco:period=1,outer_lr=1,outer_momentum=0"])
def test_period_one_equals_ddp_sgd(mode):
    out = run_ranks(_train, 2, mode, "none")
    w = _ddp_sgd()
    for r in out:
        for k in w:
            torch.testing.assert_close(r["params"][k], w[k], rtol=1e-5, atol=1e-6)


def test_diloco_equals_its_outer_nesterov_reference():
    """H=3 inner SGD steps per rank from the anchor, then a = a - lr (d + mu m), m = mu m + d (torch's Nesterov)."""
    out = run_ranks(_train, 2, "diloco:period=3,outer_lr=0.7,outer_momentum=0.9", "none")
    anchor, m = _net().state_dict(), None
    for start in range(0, STEPS, 3):
        deltas = []
        for r in range(2):
            w = dict(anchor)
            for step in range(start, start + 3):
                w = _sgd(w, _grads_one(w, step, r))
            deltas.append({k: anchor[k] - w[k] for k in w})
        d = {k: (deltas[0][k] + deltas[1][k]) / 2 for k in anchor}
        m = d if m is None else {k: 0.9 * m[k] + d[k] for k in d}
        anchor = {k: anchor[k] - 0.7 * (d[k] + 0.9 * m[k]) for k in anchor}
    for r in out:
        for k in anchor:
            torch.testing.assert_close(r["params"][k], anchor[k], rtol=1e-5, atol=1e-6)


def _streaming_reference(period: int, fragments: list[list[str]], delay: int, alpha: float,
                         lr: float = 0.7, mu: float = 0.9, keep: bool = False) -> list[dict]:
    """Each rank's parameters after STEPS of Streaming DiLoCo, written out by hand: inner SGD on each
    rank's own data; every period/F steps the next fragment (round robin) has its pseudo-gradient taken
    ``delay`` steps before and averaged, an outer Nesterov step moves its anchor, and its parameters
    become anchor + alpha (local - anchor); with ``keep`` (CoCoD-SGD) anchor + (local - the point it sent)."""
    every, w = period // len(fragments), [_net().state_dict() for _ in range(2)]
    anchor, momenta, sent, syncs, pending = dict(w[0]), [None] * len(fragments), [], 0, None
    for step in range(STEPS):
        w = [_sgd(w[r], _grads_one(w[r], step, r)) for r in range(2)]
        local = step + 1
        if (local + delay) % every == 0:
            names = fragments[syncs % len(fragments)]
            pending = {k: sum(anchor[k] - w[r][k] for r in range(2)) / 2 for k in names}
            sent = [{k: w[r][k].clone() for k in names} for r in range(2)]
        if local % every == 0:
            k_frag = syncs % len(fragments)
            m = momenta[k_frag]
            m = dict(pending) if m is None else {k: mu * m[k] + pending[k] for k in pending}
            momenta[k_frag] = m
            for k in pending:
                anchor[k] = anchor[k] - lr * (pending[k] + mu * m[k])
                for r in range(2):
                    w[r][k] = anchor[k] + ((w[r][k] - sent[r][k]) if keep else alpha * (w[r][k] - anchor[k]))
            syncs += 1
    return w


@pytest.mark.parametrize("mode, delay, alpha", [("diloco:period=4,fragments=2,delay=0,alpha=0", 0, 0.0),
                                                ("diloco:period=4,fragments=2", 1, 0.5),
                                                ("local:period=4,fragments=2,warmup=0", 1, 0.5)])
def test_streaming_diloco_equals_its_reference(mode, delay, alpha):
    """Linear(5, 3): the weight and the bias are the two fragments, synced at steps 2 (weight), 4, 6; local
    SGD streamed is the same with the average itself as the outer step (lr 1, no momentum)."""
    out = run_ranks(_train, 2, mode, "none")
    outer = {"lr": 1.0, "mu": 0.0} if mode.startswith("local") else {}
    ref = _streaming_reference(4, [["weight"], ["bias"]], delay, alpha, **outer)
    for r in range(2):
        for k in ref[r]:
            torch.testing.assert_close(out[r]["params"][k], ref[r][k], rtol=1e-5, atol=1e-6)
    sync_steps = [2 - delay, 4 - delay, 6 - delay]  # where each fragment's average starts
    expected = [0] * STEPS
    for i, numel in zip(sync_steps, [15, 3, 15]):
        expected[i - 1] = 4 * numel  # ring all-reduce on 2 ranks: 2(p-1)/p * 4n; one fragment at a time
    assert out[0]["sent"] == expected


@pytest.mark.parametrize("mode, fragments, delay", [
    ("local:period=4,merge=keep,warmup=0,delay=3", [["weight", "bias"]], 3),  # one fragment: in flight 3 of 4 steps
    ("diloco:period=4,fragments=2,merge=keep", [["weight"], ["bias"]], 1),
    ("diloco:period=6,merge=keep,delay=2", [["weight", "bias"]], 2)])
def test_streaming_keep_equals_its_reference(mode, fragments, delay):
    """merge=keep: the landed average's new anchor plus each rank's own progress since its send (CoCoD-SGD)."""
    spec = parse_sync_spec(mode)
    assert (spec.merge, spec.delay, spec.streaming) == ("keep", delay, True)
    out = run_ranks(_train, 2, mode, "none")
    outer = {"lr": 1.0, "mu": 0.0} if mode.startswith("local") else {}
    ref = _streaming_reference(spec.period, fragments, delay, 0.0, keep=True, **outer)
    assert not torch.equal(ref[0]["weight"], ref[1]["weight"])  # the ranks' own progress stays their own
    for r in range(2):
        for k in ref[r]:
            torch.testing.assert_close(out[r]["params"][k], ref[r][k], rtol=1e-5, atol=1e-6)


def test_streaming_refuses_more_fragments_than_parameter_tensors(tmp_path):
    from tests.test_cli import thinwire as cli

    proc = cli("train", "--workload", "digits", "--sync", "diloco:period=1000,fragments=1000", "--set",
               "model.hidden=8", "--out", str(tmp_path / "run"))
    assert proc.returncode != 0, proc.stdout
    assert "sync.fragments: must be at most" in proc.stderr + proc.stdout, proc.stderr
    assert not (tmp_path / "run").exists()


def _grads_one(w: dict, step: int, rank: int) -> dict:
    net = _net()
    net.load_state_dict(w)
    x, y = _data(step, rank)
    _loss(net, x, y).backward()
    return {k: p.grad.clone() for k, p in net.named_parameters()}


@pytest.mark.parametrize("mode", ["local:period=3,warmup=0", "diloco:period=3"])
def test_parameters_travel_once_per_period(mode):
    """Bytes are counted on the wire at steps 3 and 6 only: a mode that silently skipped averaging fails."""
    out = run_ranks(_train, 2, mode, "none")
    numel = 5 * 3 + 3
    assert out[0]["sent"] == [0, 0, 4 * numel, 0, 0, 4 * numel]  # ring all-reduce on 2 ranks: 2(p-1)/p * 4n
    for k in out[0]["params"]:
        assert torch.equal(out[0]["params"][k], out[1]["params"][k]), k  # the average makes ranks equal


def test_local_warmup_averages_gradients_every_step():
    out = run_ranks(_train, 2, "local:period=4,warmup=2", "none")
    numel = 5 * 3 + 3
    assert out[0]["sent"] == [4 * numel, 4 * numel, 0, 0, 0, 4 * numel]


class _EmptyFirst(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.extra, self.lin = torch.nn.Parameter(torch.zeros(0)), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(x)


def _state_of_another_model(rank: int, world: int, mode: str, codec: str) -> str:
    """A mode's state saved for a Linear(5, 3) loaded into the mode of a Linear(6, 3): the error it gives."""
    def trained(net):
        ddp = DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        mode = thinwire.sync(ddp, mode_spec, codec=codec, optimizer=opt)
        for step in range(3):
            x, y = _data(step, rank)
            with mode.no_sync():
                _loss(ddp, torch.cat([x, x], 1)[:, : net.in_features], y).backward()
            mode.step(opt)
            opt.zero_grad(set_to_none=True)
        return mode

    mode_spec = mode
    saved = trained(_net())
    sd = saved.state_dict()
    saved.close()
    other = trained(torch.nn.Linear(6, 3))
    try:
        other.load_state_dict(sd)
    except ValueError as e:
        return str(e)
    finally:
        other.close()
    return "loaded"


@pytest.mark.parametrize("mode, codec", [("delayed", "int8"), ("local:period=2,warmup=0", "none"),
                                         ("diloco:period=2,fragments=2", "none")])
def test_a_modes_state_of_another_model_is_refused(mode, codec):
    """delayed took another model's pending gradient (sliced to this one's first values) and trained on; local and
    gossip failed at the next average with a size mismatch deep in torch."""
    for said in run_ranks(_state_of_another_model, 2, mode, codec):
        assert said.startswith("a sync mode's state holds tensors of [") and "where this model's buckets hold [" in said \
            and "the state of another model" in said, said


def _gossip_state(rank: int, world: int, path: str, save: bool, spec: str = "gossip") -> str:
    ddp = DistributedDataParallel(_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    mode = thinwire.sync(ddp, spec, codec="int8", optimizer=opt)
    try:
        if save:
            with mode.no_sync():
                _loss(ddp, *_data(0, rank)).backward()
            mode.step(opt)
            torch.save(mode.state_dict(), f"{path}.{rank}")
            return "saved"
        mode.load_state_dict(torch.load(f"{path}.{min(rank, 1)}"))
    except ValueError as e:
        return str(e)
    finally:
        mode.close()
    return "loaded"


def test_a_gossip_state_of_another_world_size_is_refused(tmp_path):
    """Saved on 2 ranks, loaded on 3: a bare KeyError ('to:2') at the first step, and the other ranks hung."""
    assert run_ranks(_gossip_state, 2, str(tmp_path / "g"), True) == ["saved", "saved"]
    said = run_ranks(_gossip_state, 3, str(tmp_path / "g"), False)
    assert all(s.startswith("gossip: the state was saved with topology=exp2 on 2 ranks, and this mode runs "
                            "topology=exp2 on 3") for s in said), said
    # another topology on as many ranks was said to be another number of ranks
    assert run_ranks(_gossip_state, 2, str(tmp_path / "r"), True, "gossip:topology=ring") == ["saved", "saved"]
    said = run_ranks(_gossip_state, 2, str(tmp_path / "r"), False)
    assert all(s.startswith("gossip: the state was saved with topology=ring on 2 ranks, and this mode runs "
                            "topology=exp2 on 2") for s in said), said


def _warned(rank: int, world: int) -> list[str]:
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("thinwire.compress").addHandler(handler)
    ddp = DistributedDataParallel(_Branchy())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    mode = thinwire.sync(ddp, "delayed", codec="none", optimizer=opt)
    for step in range(3):
        x, y = _data(step, rank)
        with mode.no_sync():
            ((ddp(x, True) - y) ** 2).mean().backward()
        mode.step(opt)
        opt.zero_grad(set_to_none=True)
    mode.close()
    return [m for m in seen if "got no gradient" in m]


def test_a_parameter_without_a_gradient_and_no_find_unused_parameters_is_warned_of_once():
    """Without find_unused_parameters a mode averages zeros for it (DDP alone would refuse the model): said once."""
    for said in run_ranks(_warned, 2):
        assert len(said) == 1 and said[0].startswith("sync delayed: dead.weight, dead.bias got no gradient"), said


def _empty_first(rank: int, world: int, mode: str) -> torch.Tensor:
    ddp = DistributedDataParallel(_EmptyFirst())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    sync = thinwire.sync(ddp, mode, codec="none", optimizer=opt)
    _steps(ddp, sync, opt, rank, 2)
    sync.close()
    return ddp.module.lin.weight.detach().clone()


@pytest.mark.parametrize("mode", ["local:period=2", "delayed"])
def test_a_model_whose_first_parameter_is_empty_is_averaged(mode):
    """A 0-element first parameter left the buckets without a first group (IndexError in every mode but allreduce)."""
    got = run_ranks(_empty_first, 2, mode)
    assert torch.equal(got[0], got[1])


def _warmup_through(rank: int, world: int, codec: str) -> dict:
    ddp = DistributedDataParallel(_net())
    sync = thinwire.sync(ddp, "local:period=4,warmup=2", codec=codec, min_compress_bytes=0)
    sent = _steps(ddp, sync, torch.optim.SGD(ddp.parameters(), lr=LR), rank, 2)
    out = {"sent": sent, "counts": dict(sync.comm.stats()["counts"]), "params": copy.deepcopy(ddp.module.state_dict())}
    sync.close()
    return out


def test_local_warmup_averages_gradients_through_the_codec():
    """The warm-up's gradient averages travel as ``allreduce``'s do: int8's bytes, not fp32's (on a thin link
    100 fp32 warm-up steps cost twice int8's), and the ranks stay equal."""
    got, exact = run_ranks(_warmup_through, 2, "int8:block=8"), run_ranks(_warmup_through, 2, "none")
    assert got[0]["counts"].get("int8") == 2 and "fp32" not in got[0]["counts"], got[0]["counts"]
    assert all(a < b for a, b in zip(got[0]["sent"], exact[0]["sent"])), (got[0]["sent"], exact[0]["sent"])
    for k, v in got[0]["params"].items():
        assert torch.equal(v, got[1]["params"][k]), k
        torch.testing.assert_close(v, exact[0]["params"][k], rtol=0, atol=0.01)  # int8's rounding, not another step


def _consensus(rank: int, world: int, mode: str, steps: int = 2, norm: bool = False) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3)) if norm else _net()
    ddp = DistributedDataParallel(net)
    sync = thinwire.sync(ddp, mode, codec="none")
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(steps):  # local steps on each rank's own data: the ranks' parameters differ
        x, y = _data(step, rank)
        with sync.no_sync():
            _loss(ddp, x, y).backward()
        sync.step(opt)
        opt.zero_grad(set_to_none=True)
    own = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    sent = sync.comm.wire.bytes_sent
    with sync.consensus():
        inside = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    after = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    out = {"own": own, "inside": inside, "after": after, "training_bytes": sync.comm.wire.bytes_sent - sent,
           "consensus_bytes": sync.consensus_bytes}
    sync.close()
    return out


@pytest.mark.parametrize("mode", ["local:period=5,warmup=0", "dynamic:threshold=9", "diloco:period=5"])
def test_consensus_is_the_ranks_average_and_leaves_training_untouched(mode):
    """Validation and the checkpoint's model see the ranks' average; each rank's own comes back exactly,
    and the average's bytes are counted apart from training's."""
    out = run_ranks(_consensus, 2, mode)
    numel = 5 * 3 + 3
    assert not torch.equal(out[0]["own"]["weight"], out[1]["own"]["weight"])  # the ranks diverged
    for k in out[0]["own"]:
        mean = (out[0]["own"][k] + out[1]["own"][k]) / 2
        for r in (0, 1):
            torch.testing.assert_close(out[r]["inside"][k], mean, rtol=0, atol=1e-7)
            assert torch.equal(out[r]["after"][k], out[r]["own"][k]), k
    assert [r["training_bytes"] for r in out] == [0, 0]
    assert [r["consensus_bytes"] for r in out] == [4 * numel, 4 * numel]


def test_consensus_sends_nothing_where_ranks_agree():
    out = run_ranks(_consensus, 2, "delayed")
    assert out[0]["consensus_bytes"] == 0 and torch.equal(out[0]["inside"]["weight"], out[0]["own"]["weight"])


@pytest.mark.parametrize("mode", ["local:period=2,warmup=0", "diloco:period=2",
                                  "dynamic:threshold=0.000001,check_every=2"])
def test_consensus_at_an_average_sends_only_the_buffers(mode):
    """At the step of an average the ranks' parameters are equal: only BatchNorm's running statistics,
    which local steps leave apart, are averaged (3 means, 3 variances: 4 * 6 bytes per rank on a 2-ring)."""
    out = run_ranks(_consensus, 2, mode, 2, True)
    for k, v in out[0]["own"].items():
        if k.startswith("0."):  # the Linear layer: averaged by the mode, kept as it is
            assert torch.equal(v, out[1]["own"][k]) and torch.equal(out[0]["inside"][k], v), k
    mean = (out[0]["own"]["1.running_mean"] + out[1]["own"]["1.running_mean"]) / 2
    assert not torch.equal(out[0]["own"]["1.running_mean"], out[1]["own"]["1.running_mean"])
    torch.testing.assert_close(out[0]["inside"]["1.running_mean"], mean, rtol=0, atol=1e-7)
    assert [r["consensus_bytes"] for r in out] == [4 * 6, 4 * 6]
    mid = run_ranks(_consensus, 2, mode, 3, True)  # a step after it: parameters apart again, all averaged
    assert [r["consensus_bytes"] for r in mid] == [4 * (5 * 3 + 3 + 3 + 3 + 6)] * 2


def test_steps_to_agreement_follows_each_averaging_rule():
    from types import SimpleNamespace as NS

    from thinwire.compress.sync.local import LocalSGD
    from thinwire.train.peers import PeerLocalSGD

    # thinwire's local: after `steps` optimizer steps; warm-up 2, then an average every 3 local steps (5, 8)
    assert [LocalSGD.steps_to_agreement(NS(steps=k, warmup=2, period=3)) for k in range(10)] == \
           [0, 0, 0, 2, 1, 0, 2, 1, 0, 2]
    # PyTorch's PeriodicModelAverager(period=3, warmup_steps=2) averages at its calls 2, 5, 8 (after 3, 6, 9 steps)
    assert [PeerLocalSGD.steps_to_agreement(NS(averager=NS(step=k, warmup_steps=2, period=3))) for k in range(10)] == \
           [0, 0, 0, 0, 2, 1, 0, 2, 1, 0]


# -- the spec -----------------------------------------------------------------------------------------
def test_spec_defaults_and_text():
    assert parse_sync_spec("allreduce") == SyncSpec()
    d = parse_sync_spec("diloco")
    assert (d.period, d.outer_lr, d.outer_momentum, d.warmup) == (100, 0.7, 0.9, 0)
    assert parse_sync_spec(" Local:period=8 ").text == "local:period=8,warmup=100"
    assert parse_sync_spec(parse_sync_spec("diloco:period=5,outer_lr=0.5").text).outer_lr == 0.5
    assert "fragments" not in d.text and not d.streaming
    s = parse_sync_spec("diloco:period=16,fragments=4")
    assert (s.fragments, s.delay, s.alpha, s.streaming) == (4, 1, 0.5, True)  # the paper's overlap and mixing
    assert parse_sync_spec(s.text) == s
    assert (parse_sync_spec("diloco:fragments=2,delay=0").alpha, parse_sync_spec("diloco:delay=1").alpha) == (0.0, 0.5)
    s = parse_sync_spec("local:period=4,fragments=2")
    assert (s.fragments, s.delay, s.alpha, s.outer_lr, s.outer_momentum, s.warmup) == (2, 1, 0.5, 1.0, 0.0, 100)
    assert s.text == "local:period=4,warmup=100,fragments=2,delay=1,alpha=0.5" and parse_sync_spec(s.text) == s
    k = parse_sync_spec("local:period=8,merge=keep")  # keep: in flight one step by default, as streaming
    assert (k.merge, k.delay, k.streaming, k.text) == ("keep", 1, True, "local:period=8,warmup=100,fragments=1,delay=1,"
                                                       "merge=keep")
    assert parse_sync_spec(k.text) == k and parse_sync_spec("diloco:period=8,fragments=4,merge=keep").delay == 1


@pytest.mark.parametrize("text, match", [
    ("local:period=0", r"sync\.period: must be an integer in \[1, 1000000000\], got 0"),
    ("local", r"sync\.period: must be given: local:period=N, got 'local'"),
    ("diloco:outer_lr=0", r"sync\.outer_lr: must be a number in \(0, 10\], got 0\.0\. DiLoCo uses 0\.7"),
    ("diloco:outer_lr=nan", r"sync\.outer_lr: must be a number in \(0, 10\]"),
    ("diloco:outer_momentum=1", r"sync\.outer_momentum: must be a number in \[0, 1\), got 1\.0"),
    ("diloco:outer_momentum=-0.1", r"sync\.outer_momentum: must be a number in \[0, 1\)"),
    ("local:period=4,outer_lr=0.5", r"sync: must be local with keys period, warmup, fragments, delay, alpha"),
    ("local:period=8,alpha=0.5", r"sync\.alpha: must be given only with fragments > 1 or delay > 0, got 0\.5\. .* "
                                 r"E\.g\. local:period=H,fragments=F,alpha=0\.5"),
    ("diloco:period=16,fragments=3", r"sync\.fragments: must be a whole number that divides the period \(16\), got 3"),
    ("diloco:period=16,fragments=32", r"sync\.fragments: must be a whole number that divides the period"),
    ("diloco:period=16,fragments=4,delay=4", r"sync\.delay: must be a whole number in \[0, 3\] \(fewer than "
                                              r"period/fragments = 4 steps\), got 4"),
    ("diloco:fragments=2,alpha=1.5", r"sync\.alpha: must be a number in \[0, 1\], got 1\.5"),
    ("diloco:period=8,alpha=0.5", r"sync\.alpha: must be given only with fragments > 1 or delay > 0, got 0\.5"),
    ("local:period=4,merge=keep,alpha=0.5", r"sync\.alpha: must be not given with merge=keep, got 0\.5"),
    ("local:period=4,merge=mean", r"sync\.merge: must be one of lerp, keep \(local and diloco only\), got 'mean'"),
    ("delayed:period=2", r"sync: must be delayed with keys predict"),
    ("delayed:predict=2", r"sync\.predict: must be one of own, last, off, got '2'\. own \(default\) computes each gradient"),
    ("local:period=x", r"sync\.period: must be a whole number, got 'x'"),
    ("local:period=-3", r"sync\.period: must be an integer in \[1, 1000000000\], got -3"),  # not "a whole number"
    ("local:period=4,period=8", r"sync\.period: must be given once, got 'local:period=4,period=8'\. Remove the dup"),
    ("push", r"sync: must be one of allreduce, delayed, local, diloco, gossip, dynamic, auto, got 'push'"),
    ("", r"sync: must be one of"),
])
def test_bad_spec_is_refused(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_sync_spec(text)


@pytest.mark.parametrize("fields, match", [
    ({"sync": "local:period=4", "compression": "torch:bf16"}, r"compression: must be a thinwire codec .* with --sync local"),
    ({"sync": "diloco", "compression": "auto"}, r"compression: must be a thinwire codec .* with --sync diloco.*auto run only"),
    ({"sync": "delayed", "precision": "fp16"}, r"precision: must be fp32, bf16 or int8 with --sync delayed"),
    ({"sync": "local:period=0"}, r"sync\.period: must be an integer in \[1"),
])
def test_train_config_refuses_what_a_mode_cannot_run(fields, match):
    from thinwire.train.config import TrainConfig

    with pytest.raises(ConfigError, match=match):
        TrainConfig(**fields)


def test_cli_refuses_bad_sync_before_starting(tmp_path):
    from tests.test_cli import thinwire as cli

    proc = cli("train", "--workload", "digits", "--sync", "local:period=4", "--compression", "torch:bf16",
               "--out", str(tmp_path / "run"))
    assert proc.returncode != 0 and "with --sync local" in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


# -- resume in the middle of a period -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode, codec, averaged", [
    ("delayed", "int8", None),  # issued on the communication thread: which step's record counts them is a race
    ("local:period=5,warmup=2", "int8", {1, 2, 7}),   # 2 synchronous steps, then an average after 5 local ones
    ("diloco:period=4", "topk:ratio=0.05", {4, 8}),
    ("diloco:period=4,fragments=2,warmup=1", "int8", None),  # in flight across the resume at step 6
    ("local:period=4,fragments=2,warmup=1", "int8", None),
    ("local:period=4,merge=keep,warmup=1,delay=3", "int8", None),  # in flight steps 2-5 and 6-9: across the resume
])
def test_resume_mid_period_is_bit_identical(tmp_path, mode, codec, averaged):
    common = ["--workload", "digits", "--nproc", "2", "--compression", codec, "--sync", mode, "--eval-every", "5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    a, b = _straight_and_resumed(common, straight, split)
    assert a["step"] == b["step"] == 10
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    if "model" in a["ranks"][0]:  # ranks diverge: the checkpoint's model is their average (SyncMode.consensus)
        for name, value in a["model"].items():
            if value.is_floating_point():
                mean = sum(r["model"][name] for r in a["ranks"]) / len(a["ranks"])
                torch.testing.assert_close(value, mean, rtol=1e-6, atol=1e-7)
    for ra, rb in zip(a["ranks"], b["ranks"]):
        _assert_equal(ra["sync"], rb["sync"])
        _assert_equal(ra["comm"]["residuals"], rb["comm"]["residuals"])
        _assert_equal(ra.get("model"), rb.get("model"))
    sent = [json.loads((o / "summary.json").read_text())["bytes_sent_total"] for o in (straight, split)]
    assert sent[0] == sent[1] > 0
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    if averaged is not None:
        assert {r["step"] for r in records if r.get("bytes_sent")} == averaged  # the trainer's wire, step by step
    elif mode == "delayed":
        counts = json.loads((straight / "summary.json").read_text())["compression_stats"]["counts"]
        assert sum(counts.values()) == 10, counts  # every step's gradient averaged once (2 fp32 warm-up steps)


@pytest.mark.slow
def test_validation_waits_for_the_next_average_and_survives_a_resume(tmp_path):
    """Marks at 5 and 10, averages at 4, 8, 12: validations at 8 and 12 (the ranks' one model, no
    parameters sent) and the last step's. A checkpoint at 6 holds the pending mark: resumed, it still
    validates at 8."""
    import shutil

    from tests.test_cli import thinwire as cli

    common = ["--workload", "digits", "--nproc", "2", "--compression", "int8", "--sync", "local:period=4,warmup=0",
              "--eval-every", "5", "--checkpoint-every", "6", "--set", "keep_checkpoints=5"]
    straight, src, resumed = tmp_path / "straight", tmp_path / "src", tmp_path / "resumed"
    proc = cli("train", *common, "--steps", "14", "--out", str(straight))
    assert proc.returncode == 0, proc.stderr

    def vals(run: Path) -> list[int]:
        return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]

    assert vals(straight) == [8, 12, 14]
    assert (proc.stdout + proc.stderr).count("validation moves to step 8, the ranks' next average") == 1
    # one parameter average on the wire: step 14's validation, between averages (2 ranks: each sends its
    # 4-byte floats once around the ring). The checkpoints' (6, 12, 14) are made on rank 0 from the ranks'.
    last = torch.load(straight / "checkpoints" / "step_000000014.pt", weights_only=True)
    numel = sum(v.numel() for v in last["model"].values() if v.is_floating_point())
    assert json.loads((straight / "summary.json").read_text())["bytes_sent_consensus_all_ranks"] == 2 * 4 * numel
    for name, value in last["model"].items():
        if not value.is_floating_point():
            continue
        mean = sum(r["model"][name].double() for r in last["ranks"]) / 2
        assert torch.equal(value, mean.to(value.dtype)), name
    assert torch.load(straight / "checkpoints" / "step_000000006.pt", weights_only=True)["eval_due"] is True
    (src / "checkpoints").mkdir(parents=True)
    shutil.copy(straight / "config.yaml", src / "config.yaml")
    shutil.copy(straight / "checkpoints" / "step_000000006.pt", src / "checkpoints" / "step_000000006.pt")
    proc = cli("train", "--resume", str(src), "--steps", "14", "--out", str(resumed))
    assert proc.returncode == 0, proc.stderr
    assert vals(resumed) == [8, 12, 14]
    # on another number of ranks the ranks' own states cannot be handed out: it starts from their average, and says so
    proc = cli("train", "--resume", str(src), "--steps", "8", "--nproc", "1", "--out", str(tmp_path / "one"))
    assert proc.returncode == 0, proc.stderr
    assert "every rank starts from the ranks' average, and local's own state afresh" in " ".join(proc.stdout.split())


def batchnorm_workload():
    """A classifier with BatchNorm, whose running statistics each rank keeps apart where forward runs outside
    DDP's sync (delayed, local steps)."""
    from thinwire.workloads.base import Workload

    g = torch.Generator().manual_seed(0)
    data = [(x, int(x[:4].sum() > 0)) for x in torch.randn(512, 12, generator=g)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return Workload(model=model, train=data[:384], val=data[384:], loss=torch.nn.functional.cross_entropy,
                    task="classification", batch_size=32, steps=10)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["delayed", "local:period=4,warmup=2"])
def test_resume_keeps_each_ranks_batchnorm_statistics(tmp_path, mode):
    """Each rank's BatchNorm statistics are its own where forward runs outside DDP's sync: kept in the checkpoint
    (delayed's ranks share their parameters, so only the buffers), and not overwritten by rank 0's at the
    resumed first forward, which DDP broadcasts by default."""
    common = ["--workload", "tests.test_sync:batchnorm_workload", "--nproc", "2", "--compression", "int8", "--sync",
              mode, "--eval-every", "5"]
    a, b = _straight_and_resumed(common, tmp_path / "straight", tmp_path / "split")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for ra, rb in zip(a["ranks"], b["ranks"]):
        own_a, own_b = ra.get("model") or ra["buffers"], rb.get("model") or rb["buffers"]
        assert not torch.equal(a["ranks"][0].get("model", a["ranks"][0].get("buffers"))["1.running_mean"],
                               a["ranks"][1].get("model", a["ranks"][1].get("buffers"))["1.running_mean"])
        for name in own_a:
            assert torch.equal(own_a[name], own_b[name]), name


def _straight_and_resumed(common: list[str], straight: Path, split: Path) -> tuple[dict, dict]:
    """The last checkpoints of 10 steps straight and of 6 steps resumed to 10, with the same flags."""
    from tests.test_cli import thinwire as cli

    proc = cli("train", *common, "--steps", "10", "--out", str(straight))
    assert proc.returncode == 0, proc.stderr
    assert cli("train", *common, "--steps", "6", "--out", str(split)).returncode == 0
    proc = cli("train", "--resume", str(split), "--steps", "10")
    assert proc.returncode == 0, proc.stderr
    return tuple(torch.load(sorted((o / "checkpoints").glob("step_*.pt"))[-1], weights_only=True) for o in (straight, split))


def _assert_equal(x, y) -> None:
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y)
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            _assert_equal(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            _assert_equal(u, v)
    else:
        assert x == y


# -- pricing (thinwire.perf.sync) and `thinwire simulate --sync` ----------------------------------------
def test_delayed_step_is_the_slower_pipeline():
    from thinwire.perf.sync import delayed_step_s

    assert delayed_step_s(compute_s=0.100, comm_s=0.150, codec_s=0.010) == pytest.approx(0.160)  # wire-bound
    assert delayed_step_s(compute_s=0.200, comm_s=0.150, codec_s=0.010) == pytest.approx(0.200)  # compute-bound
    # no spare core: the communication thread's 10 ms of codec work is taken from compute
    assert delayed_step_s(compute_s=0.200, comm_s=0.150, codec_s=0.010, codec_steals_compute=True) == pytest.approx(0.210)


def test_periodic_step_spreads_one_average_over_the_period():
    from thinwire.compress.sync import StepParts, kind
    from thinwire.perf.sync import periodic_step_s

    assert periodic_step_s(compute_s=0.100, average_s=0.160, period=8) == pytest.approx(0.120)
    parts = StepParts(allreduce_step_s=0.230, compute_s=0.100, comm_s=0.150, codec_s=0.010)

    def price(text):
        spec = parse_sync_spec(text)
        return kind(spec).step_s(spec, parts)

    assert price("allreduce") == 0.230
    assert price("diloco:period=16") == pytest.approx(0.110)
    assert price("local:period=1") == pytest.approx(0.260)  # no overlap with backward at all
    # streaming, 4 fragments of 40 ms (wire and codec) every 4 steps, 1 step (100 ms) of compute hides each
    assert price("diloco:period=16,fragments=4") == pytest.approx(0.100)
    assert price("diloco:period=16,fragments=4,delay=0") == pytest.approx(0.110)  # one fragment at a time, exposed
    assert price("auto") == pytest.approx(0.160)  # delayed is priced where the run would choose it
    ruled_out = dataclasses.replace(parse_sync_spec("auto"), try_delayed=False)  # by a guard (check_sync_pairing)
    assert kind(ruled_out).step_s(ruled_out, parts) == 0.230
    near = StepParts(allreduce_step_s=0.162, compute_s=0.100, comm_s=0.150, codec_s=0.010)  # delayed 1.2% faster
    assert kind(parse_sync_spec("auto")).step_s(parse_sync_spec("auto"), near) == 0.162  # under MARGIN: allreduce
    local, delayed = (parse_sync_spec(t) for t in ("local:period=4", "delayed"))
    assert kind(local).bytes_per_step(local, 1_000_000) == 250_000
    assert kind(delayed).bytes_per_step(delayed, 1_000_000) == 1_000_000
    with pytest.raises(ValueError, match="period must be an integer >= 1, got 0"):
        periodic_step_s(compute_s=0.1, average_s=0.1, period=0)


def test_simulate_prices_each_mode(tmp_path, capsys):
    from tests.test_cli import ROOT
    from tests.test_perf import _cli, _profile_file

    prof, pts = _profile_file(tmp_path), {}
    for mode in ("allreduce", "delayed", "local:period=4", "diloco:period=16", "local:period=4,fragments=2"):
        rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile", prof,
                  "--compression", "bf16", "--sync", mode, "--out", tmp_path / "sim", "--json")
        assert rc == 0
        pts["streamed" if "fragments" in mode else mode.partition(":")[0]] = json.loads(capsys.readouterr().out)["points"][0]
    a = pts["allreduce"]
    assert a["sync_step_s"] == a["step_s"]
    compute = a["compute_s"] + a["noise_s"]
    # one core per host, one torch thread: the communication thread's codec work is taken from compute
    assert pts["delayed"]["sync_step_s"] == pytest.approx(max(compute + a["codec_s"], a["comm_s"] + a["codec_s"]))
    assert pts["local"]["sync_step_s"] == pytest.approx(compute + (a["comm_s"] + a["codec_s"]) / 4)
    assert pts["diloco"]["sync_bytes_per_step"] == pytest.approx(a["bytes_per_rank"] / 16)
    assert pts["diloco"]["sync_step_s"] < pts["local"]["sync_step_s"] < a["step_s"]
    # streamed: half the model every 2 steps, its wire hidden behind one step's compute (the codec's CPU not)
    half = (a["comm_s"] + a["codec_s"]) / 2
    hidden = compute - a["codec_s"] / 2
    exposed = max(0.0, half - hidden) + a["codec_s"] / 2
    assert pts["streamed"]["sync_step_s"] == pytest.approx(compute + exposed / 2)
    assert pts["streamed"]["sync_step_s"] < pts["local"]["sync_step_s"]
    assert pts["streamed"]["sync_bytes_per_step"] == pytest.approx(pts["local"]["sync_bytes_per_step"])


def test_simulate_shows_every_mode_side_by_side(tmp_path, capsys):
    from tests.test_cli import ROOT
    from tests.test_perf import _cli, _profile_file
    from thinwire.syncspec import SHOWN

    rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile", _profile_file(tmp_path),
              "--compression", "bf16", "--sync", "all", "--out", tmp_path / "sim")
    out = capsys.readouterr().out
    assert rc == 0 and "sync modes at 2 hosts" in out
    assert all(mode in out for mode in ("allreduce", *SHOWN)), out
    rows = json.loads((tmp_path / "sim" / "simulate.json").read_text())["sync_modes"]  # the file has them too
    assert [r["sync"] for r in rows] == ["allreduce", *SHOWN] and all(r["step_s"] > 0 for r in rows)


def test_simulate_refuses_a_bad_sync(tmp_path, capsys):
    from tests.test_cli import ROOT
    from tests.test_perf import _cli, _profile_file

    rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile",
              _profile_file(tmp_path), "--sync", "local:period=0", "--out", tmp_path / "sim")
    assert rc == 2 and "sync.period: must be an integer in [1" in capsys.readouterr().err


# -- PyTorch's post-local SGD, the peer of --sync local -----------------------------------------------
def _train_torch_localsgd(rank: int, world: int, period: int, warmup: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    ddp = DistributedDataParallel(_net())
    state = plsgd.PostLocalSGDState(None, None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, plsgd.post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _data(step, rank)
        _loss(ddp, x, y).backward()
        opt.step()
        averager.average_parameters(ddp.parameters())
        opt.zero_grad(set_to_none=True)
    return {"params": {k: v.clone() for k, v in ddp.module.state_dict().items()}}


def test_period_one_local_equals_pytorch_post_local_sgd():
    """The peer in the benchmarks, PyTorch's hook + averager, and thinwire's local mode agree where their
    schedules coincide (H=1; for H>1 PyTorch also averages right after its warm-up)."""
    theirs = run_ranks(_train_torch_localsgd, 2, 1, 2)
    ours = run_ranks(_train, 2, "local:period=1,warmup=2", "none")
    for a, b in zip(theirs, ours):
        for k in a["params"]:
            torch.testing.assert_close(a["params"][k], b["params"][k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_trainer_runs_pytorch_post_local_sgd_and_resumes_mid_period(tmp_path):
    """``--compression torch:localsgd``: fp32 gradients for the warm-up (2 steps), then PyTorch's averager
    after its step counter reaches 2, 6 (optimizer steps 3, 7); a resume at step 6 ends bit-identical."""
    common = ["--workload", "digits", "--nproc", "2", "--compression", "torch:localsgd:period=4,warmup=2",
              "--eval-every", "5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    a, b = _straight_and_resumed(common, straight, split)
    for ra, rb in zip(a["ranks"], b["ranks"]):
        _assert_equal(ra["sync"], rb["sync"])
        _assert_equal(ra["model"], rb["model"])
    assert not all(torch.equal(a["ranks"][0]["model"][k], a["ranks"][1]["model"][k]) for k in a["model"])  # local steps
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records if r.get("bytes_sent")} == {1, 2, 3, 7}


@pytest.mark.parametrize("mode", ["delayed", "local:period=8,warmup=20", "diloco:period=16",
                                  "diloco:period=16,fragments=2", "gossip:topology=exp2,overlap=1",
                                  "dynamic:rule=spread"])
def test_example_script_runs_every_mode(mode):
    """examples/sync_modes.py, as its docstring launches it (torchrun, 2 workers)."""
    import subprocess
    import sys

    from tests.test_cli import ROOT

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "sync_modes.py"), "--sync", mode, "--codec", "int8", "--steps", "40"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{mode}: held-out loss" in proc.stdout


@pytest.mark.parametrize("text", ["torch:localsgd", "torch:localsgd:period=0", "torch:localsgd:period=x",
                                  "torch:localsgd:rank=2"])
def test_pytorch_post_local_sgd_spec_refuses_bad_input(text):
    from thinwire.commspec import parse_comm_spec

    with pytest.raises(ConfigError, match=r"compression: must be torch:localsgd:period=H\[,warmup=W\] .*got '"
                                          + text + "'"):
        parse_comm_spec(text)
    assert parse_comm_spec("torch:localsgd:period=16").text == "torch:localsgd:period=16,warmup=100"


# -- auto: allreduce or delayed, by the clock -------------------------------------------------------
AUTO_STEPS = 16


def _train_auto(rank: int, world: int, forced: str | None, mode: str = "auto:trial=5,warmup=2") -> dict:
    """``mode`` (auto) for AUTO_STEPS steps; ``forced``: the clock's verdict replaced."""
    import thinwire.compress.sync.choose as choose

    if forced is not None:
        choose.decide = lambda times: forced
    ddp = DistributedDataParallel(_net())
    sync = thinwire.sync(ddp, mode, codec="none")
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    modes = []
    for step in range(AUTO_STEPS):
        x, y = _data(step, rank)
        modes.append(sync.current)
        with sync.no_sync():
            _loss(ddp, x, y).backward()
        sync.step(opt)
        opt.zero_grad(set_to_none=True)
    stats, sd = sync.stats(), sync.state_dict()
    sync.close()
    again = thinwire.sync(DistributedDataParallel(_net()), mode, codec="none")
    again.load_state_dict(sd)   # a resume after the choice keeps it
    resumed = (again.current, again.stats())
    again.close()
    return {"params": {k: v.clone() for k, v in ddp.module.state_dict().items()}, "modes": modes, "stats": stats,
            "resumed": resumed}


@pytest.mark.parametrize("forced", ["allreduce", "delayed"])
def test_auto_times_allreduce_then_delayed_then_keeps_its_choice(forced):
    """Steps 0-6 all-reduce (2 warm-up + 5 timed), 7-11 delayed (its fill at 7, its weight prediction from 8),
    then the choice; switching back to all-reduce drops the one stale average in flight. Equal to SGD
    written out by hand."""
    out = run_ranks(_train_auto, 2, forced)
    w, previous, own = _net().state_dict(), None, None
    for step in range(AUTO_STEPS):
        mode = "allreduce" if step < 7 else "delayed" if step < 12 else forced
        # delayed's weight prediction, from its second step on: SGD's step with each rank's own last gradient
        points = [_sgd(w, own[r]) for r in range(2)] if mode == "delayed" and own is not None else [w, w]
        g = _grads_at(points, step)
        if mode == "allreduce":
            w, previous = _sgd(w, g), None
        else:
            own = [_grads_one(points[r], step, r) for r in range(2)]
            w = _sgd(w, previous) if previous is not None else w
            previous = g
    for r in out:
        assert r["modes"] == ["allreduce"] * 7 + ["delayed"] * 5 + [forced] * 4
        assert r["stats"]["choice"] == forced and r["stats"]["allreduce_median_step_s"] > 0
        assert r["resumed"] == (forced, r["stats"])
        for k in w:
            torch.testing.assert_close(r["params"][k], w[k], rtol=1e-5, atol=1e-6)


def _guard_profile(path, delayed_gap: float | None, workload: str = "w") -> str:
    """A profile whose convergence guard ran delayed ``delayed_gap`` above fp32's loss (None: no record)."""
    from thinwire.measure.file import BucketRecord, ComputePoint, ConvergenceRecord, Profile, save_profile

    sync = {} if delayed_gap is None else {"delayed": ConvergenceRecord(
        factor=None, loss=2.0 * (1 + delayed_gap), reference_loss=2.0, steps=60, world=4)}
    save_profile(Profile(workload=workload, model={}, parameters=10, threads=1,
                         compute=[ComputePoint(batch=8, pre_s=0.01, backward_s=0.01, post_s=0.001)],
                         buckets=[BucketRecord(numel=10, ready_frac=1.0, params=[0], shapes=[[10]])], sync=sync), path)
    return str(path)


def test_auto_with_a_guard_that_says_delayed_does_not_reach_stays_on_allreduce(tmp_path):
    guard = _guard_profile(tmp_path / "Guard.yaml", 0.3)  # the path keeps its case
    out = run_ranks(_train_auto, 2, None, f"auto:trial=5,warmup=2,guard={guard}")
    w = _net().state_dict()
    for step in range(AUTO_STEPS):
        w = _sgd(w, _grads(w, step, 2))
    for r in out:
        assert r["modes"] == ["allreduce"] * AUTO_STEPS, r["modes"]  # nothing tried, nothing timed
        assert r["stats"]["choice"] == "allreduce" and r["stats"]["allreduce_median_step_s"] is None
        assert "guard" in r["stats"]["chosen_by"] and r["resumed"] == ("allreduce", r["stats"])
        for k in w:
            torch.testing.assert_close(r["params"][k], w[k], rtol=1e-5, atol=1e-6)


def test_auto_guard_is_checked_before_anything_starts(tmp_path):
    from thinwire.commspec import check_sync_pairing, parse_comm_spec

    int8 = parse_comm_spec("int8")
    reaches = _guard_profile(tmp_path / "ok.yaml", 0.005)
    spec = check_sync_pairing(parse_sync_spec(f"auto:guard={reaches}"), int8)
    assert spec.try_delayed and spec.text == f"auto:trial=20,warmup=10,guard={reaches}"
    assert not check_sync_pairing(parse_sync_spec(f"auto:guard={_guard_profile(tmp_path / 'no.yaml', 0.3)}"),
                                  int8).try_delayed
    with pytest.raises(ConfigError, match=r"sync.guard: .*the path of an existing profile.*thinwire profile"):
        check_sync_pairing(parse_sync_spec(f"auto:guard={tmp_path / 'missing.yaml'}"), int8)
    with pytest.raises(ConfigError, match=r"sync.guard: .*record of delayed.*--guard-steps 0"):
        check_sync_pairing(parse_sync_spec(f"auto:guard={_guard_profile(tmp_path / 'none.yaml', None)}"), int8)
    with pytest.raises(ConfigError, match=r"sync.guard"):
        parse_sync_spec("auto:guard=")


def test_auto_chooses_by_the_median_with_a_margin_for_staleness():
    from thinwire.compress.sync.choose import decide

    assert decide({"allreduce": [1.0, 5.0, 1.0], "delayed": [0.9, 0.9, 9.0]}) == "delayed"   # medians, not means
    assert decide({"allreduce": [1.0], "delayed": [0.985]}) == "allreduce"                 # within 2%
    with pytest.raises(ConfigError, match="sync.trial"):
        parse_sync_spec("auto:trial=2")
    assert parse_sync_spec("auto").text == "auto:trial=20,warmup=10"


def _frozen_first(rank: int, world: int, mode: str) -> list[tuple]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 3))  # 17 KB trained: compressed, so residuals are kept
    net[0].requires_grad_(False)  # a frozen layer ahead of the trained ones (fine-tuning a head)
    ddp = DistributedDataParallel(net)
    sync = thinwire.sync(ddp, mode, codec="int8")
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=LR)
    for step in range(16):  # auto: 1 untimed step, 5 timed in allreduce, then 5 in delayed
        x, y = _data(step, rank)
        with sync.no_sync():
            _loss(ddp, x, y).backward()
        sync.step(opt)
        opt.zero_grad(set_to_none=True)
    layouts = [layout for layout, _ in sync.comm.feedback.residuals.values()]
    sync.close()
    return layouts


def test_a_frozen_layer_keeps_the_hook_and_a_modes_residuals_on_the_same_parameters():
    """``--sync auto`` runs the DDP hook, then ``delayed``, on one error feedback: a residual the hook kept for a
    parameter is picked up by delayed's bucket. Delayed indexed the parameters among the trainable ones only,
    the hook among all: with a frozen layer first, the residuals went to the wrong parameters and the sizes
    clashed ("The size of tensor a (8320) must match the size of tensor b (4355)")."""
    layouts = run_ranks(_frozen_first, 2, "auto:trial=5,warmup=1")[0]
    trained = {2: 4096, 3: 64, 4: 192, 5: 3}  # model.parameters(): 0, 1 the frozen layer's weight and bias
    assert layouts and all(dict(layout) == trained for layout in layouts if layout), layouts


def test_delayed_prediction_leaves_the_optimizers_state_and_hooks_alone():
    """preview_step moves the weights where AdamW's step would, on a copy of its state: the moments, the
    step count and the gradients are as before, and a hook on the optimizer's step (an EMA) does not run."""
    from thinwire.compress.sync.delayed import preview_step

    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    x, y = _data(0, 0)
    _loss(net, x, y).backward()
    opt.step()  # a real step: state exists
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    state = {k: v.clone() for k, v in opt.state[net.weight].items()}
    params, grads = list(net.parameters()), [torch.randn_like(p) for p in net.parameters()]
    start = [p.detach().clone() for p in params]
    twin, twin_opt = copy.deepcopy(net), torch.optim.AdamW(_net().parameters(), lr=0.01)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.01)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, g in zip(twin.parameters(), grads):
        p.grad = g.clone()
    twin_opt.step()
    grads_before = [p.grad for p in params]
    preview_step(opt, params, [g.clone() for g in grads])
    for p, q, s0 in zip(params, twin.parameters(), start):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # where the step would put them
        assert not torch.equal(p, s0)
    assert calls == [] and all(a is b for a, b in zip(grads_before, (p.grad for p in params)))
    for k, v in opt.state[net.weight].items():
        assert torch.equal(v, state[k]), k
    opt.step()  # the hook is back
    assert calls == [1]


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [
    ("diloco:period=4,warmup=0", "diloco:period=2,warmup=0"),
    ("diloco:period=4,fragments=2,warmup=0", "diloco:period=4,fragments=4,warmup=0"),
])
def test_a_resume_with_another_sync_mode_starts_every_rank_from_the_average(tmp_path, first, then):
    """Each rank's state is its mode's (its own parameters mid-period, an anchor, fragments' pending sends):
    under another mode it is meaningless. Loaded anyway, the ranks never agreed again (each anchored at its own
    parameters) or the run failed with a traceback; now they start from the checkpoint's average."""
    from tests.test_cli import thinwire as cli

    out = tmp_path / "run"
    common = ["--workload", "digits", "--nproc", "2", "--eval-every", "100", "--checkpoint-every", "6"]
    proc = cli("train", *common, "--sync", first, "--steps", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = cli("train", "--resume", str(out), "--sync", then, "--steps", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint trained with --sync {first}, this job with {then}: every rank starts from the ranks' " \
           "average" in " ".join(proc.stdout.split())
    last = torch.load(out / "checkpoints" / "step_000000008.pt", weights_only=False)
    if "fragments" not in then:  # step 8 ends an outer step: the ranks hold one model again
        for name, value in last["ranks"][0]["model"].items():
            assert torch.equal(value, last["ranks"][1]["model"][name]), name


@pytest.mark.slow
def test_a_relative_guard_path_is_kept_absolute_so_a_resume_from_elsewhere_finds_it(tmp_path):
    from tests.test_cli import thinwire as cli

    here = tmp_path / "here"
    here.mkdir()
    _guard_profile(here / "g.yaml", 0.3, workload="digits")
    proc = cli("train", "--workload", "digits", "--steps", "2", "--sync", "auto:trial=5,warmup=2,guard=g.yaml",
               "--out", "run", cwd=here)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"guard={here / 'g.yaml'}" in (here / "run" / "config.yaml").read_text()
    again = cli("train", "--resume", str(here / "run"), "--steps", "3", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_guard_profile_of_another_workload_is_refused(tmp_path):
    from tests.test_cli import assert_refused, thinwire as cli

    guard = _guard_profile(tmp_path / "g.yaml", 0.3)  # workload "w"
    for flag in ("--sync",):  # --compression auto:guard= is checked alike (test_perf's guard profiles)
        assert_refused(cli("train", "--workload", "digits", "--steps", "2", flag, f"auto:guard={guard}",
                           "--out", str(tmp_path / "run")),
                       rf"{flag[2:]}\.guard: must be a profile of this run's workload \('digits' with model options "
                       r"\{\}\), got '.*g.yaml'\. it profiles 'w' with \{\}; profile this workload")
    assert not (tmp_path / "run").exists()


def test_sync_names_what_it_needs_for_a_module_outside_ddp_or_a_mode_that_is_no_spec():
    """A plain module gave AttributeError: 'Linear' object has no attribute 'module' (local, delayed); mode=None an
    AttributeError too."""
    with pytest.raises(TypeError, match=r"thinwire\.sync needs a DistributedDataParallel model, got Linear; wrap it"):
        thinwire.sync(torch.nn.Linear(2, 2), "local:period=4")
    with pytest.raises(TypeError, match=r"thinwire\.sync: mode must be a sync spec string .* got None"):
        thinwire.sync(DistributedDataParallel.__new__(DistributedDataParallel), None)
    with pytest.raises(TypeError, match=r"thinwire\.sync\(\) got an unexpected keyword argument 'error_feedbak' \(did you "
                                        r"mean 'error_feedback'\?\); it takes error_feedback, warmup_steps"):
        thinwire.sync(DistributedDataParallel.__new__(DistributedDataParallel), "local:period=4", error_feedbak=False)
    with pytest.raises(TypeError, match=r"thinwire\.attach\(\) got an unexpected keyword argument 'min_compres_bytes' "
                                        r"\(did you mean 'min_compress_bytes'\?\); it takes error_feedback, .*, process_group"):
        thinwire.attach(DistributedDataParallel.__new__(DistributedDataParallel), "int8", min_compres_bytes=0)  # was bare
    with pytest.raises(TypeError, match=r"thinwire\.sync: optimizer must be the torch\.optim\.Optimizer the loop steps "
                                        r"\(or None\), got str 'sgd'"):   # was taken, and nothing said
        thinwire.sync(DistributedDataParallel.__new__(DistributedDataParallel), "delayed", optimizer="sgd")


def _delayed_bn_consensus(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mode = thinwire.sync(ddp, "delayed", codec="none", optimizer=opt)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + rank)
        with mode.no_sync():
            ddp(x).sum().backward()
        mode.step(opt)
        opt.zero_grad(set_to_none=True)
    own = ddp.module[1].running_var.clone()
    with mode.consensus():
        inside = ddp.module[1].running_var.clone()
    after = ddp.module[1].running_var.clone()
    mode.close()
    return {"own": own, "inside": inside, "after": after}


def test_delayed_consensus_averages_the_ranks_batchnorm_statistics():
    """delayed's forward runs outside DDP's sync: each rank keeps its own running statistics, which consensus
    (validation, the checkpoint's model) returned unaveraged, as the parameters need no average."""
    a, b = run_ranks(_delayed_bn_consensus, 2)
    assert not torch.equal(a["own"], b["own"])  # the ranks saw different data
    torch.testing.assert_close(a["inside"], (a["own"] + b["own"]) / 2)
    assert torch.equal(a["inside"], b["inside"]) and torch.equal(a["after"], a["own"])


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))


@pytest.mark.parametrize("mode", ["local:period=4,warmup=0", "delayed"])
def test_a_users_loop_resumed_keeps_each_ranks_batchnorm_statistics(mode):
    """Forward runs outside DDP's sync, so each rank's running statistics are its own: a resumed loop's new
    DDP wrapper sent rank 0's to every rank at its first forward, which the loop that went on never did."""
    straight = run_ranks(_loop_resumed, 2, None, mode, "none", _bn_net, torch.optim.SGD)
    resumed = run_ranks(_loop_resumed, 2, 3, mode, "none", _bn_net, torch.optim.SGD)
    assert not torch.equal(straight[0]["1.running_mean"], straight[1]["1.running_mean"])
    for rank in range(2):
        for k in straight[rank]:
            assert torch.equal(straight[rank][k], resumed[rank][k]), (rank, k)


def _small_model_counts(rank, world, mode, kwargs):
    import thinwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)))  # 2 KiB of parameters: under the 4 KiB default
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = thinwire.sync(model, mode, codec="int8", **kwargs)
    for _ in range(2):
        with sync.no_sync():
            model(torch.randn(4, 16)).sum().backward()
        sync.step(opt)
    sync.flush()
    counts = dict(sync.comm.counts)
    sync.close()
    return counts


@pytest.mark.parametrize("mode", ["allreduce", "delayed", "local:period=1,warmup=0", "diloco:period=1"])
def test_a_sync_mode_takes_the_hooks_options_as_attach_does(mode):
    """min_compress_bytes (and nonfinite, timeout_s) reach the mode's averaging, not only allreduce's hook."""
    small = run_ranks(_small_model_counts, 2, mode, {})
    assert all("int8" not in c for c in small)  # below the default threshold: sent as is
    every = run_ranks(_small_model_counts, 2, mode, dict(min_compress_bytes=0, timeout_s=60, nonfinite="raise"))
    assert all(c.get("int8", 0) > 0 for c in every)
    with pytest.raises(AssertionError, match="ValueError: timeout_s must be a number of seconds > 0"):
        run_ranks(_small_model_counts, 1, mode, dict(timeout_s=-1))


def _twice(rank, world, first, second):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(4, 4))
    thinwire.attach(model, "int8") if first == "attach" else thinwire.sync(model, first, codec="int8")
    try:
        thinwire.attach(model, "int8") if second == "attach" else thinwire.sync(model, second, codec="int8")
    except (ConfigError, ValueError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("first, second, match", [
    ("local:period=2", "local:period=2", "thinwire.attach (or an earlier thinwire.sync) already averages this model"),
    ("attach", "diloco:period=2", "thinwire.attach (or an earlier thinwire.sync) already averages this model"),
    ("local:period=2", "attach", "a thinwire hook is already attached to this model"),
])
def test_thinwire_on_a_model_twice_says_it_is_thinwires_own(first, second, match):
    """Not "a DDP communication hook of its own": the hook there is thinwire's, and the fix is one call."""
    assert match in run_ranks(_twice, 1, first, second)[0]


def _misloaded(rank: int, world: int) -> dict:
    """Each mode's load_state_dict given what it never returned."""
    got = {}
    ddp = DistributedDataParallel(_net())
    local = thinwire.sync(ddp, "local:period=4", codec="none")
    diloco = thinwire.sync(DistributedDataParallel(_net()), "diloco:period=8", codec="none")
    for name, mode, sd in (("none", local, None), ("foo", local, {"foo": 1}), ("diloco", local, diloco.state_dict()),
                           ("comm", diloco, local.comm.state_dict())):
        try:
            mode.load_state_dict(sd)
            got[name] = "accepted"
        except (TypeError, ValueError) as e:
            got[name] = str(e)
    local.load_state_dict({})  # a fresh state (a checkpoint that predates the mode's)
    old = local.state_dict()
    del old["mode"]  # a state saved before the mode's name was: told apart by its keys, which DiLoCo's hold
    diloco.load_state_dict(old)
    local.close(), diloco.close()
    return got


def test_a_modes_load_state_dict_refuses_what_no_state_dict_of_it_returned():
    got = run_ranks(_misloaded, 2)[0]
    assert got["none"] == "LocalSGD.load_state_dict needs the dict its state_dict() returned, got NoneType"
    assert "keys ['foo'] are not a local mode's state (it holds steps, anchor)" in got["foo"]
    assert got["diloco"].startswith("LocalSGD.load_state_dict: this is a DiLoCo mode's state")
    assert "are not a diloco mode's state" in got["comm"] and "the CommState's?" in got["comm"]


def test_a_script_that_ends_without_close_exits_cleanly(tmp_path):
    """The README's snippets end without close(): `delayed`'s last average, still on the wire at exit, met the process
    group's teardown, and every worker died of SIGABRT ("terminate called without an active exception") after
    training had finished; thinwire now closes what the script left open when the interpreter exits."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "import thinwire\n"
        "dist.init_process_group('gloo')\n"
        "m = DDP(torch.nn.Linear(2000, 4))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "mode = thinwire.sync(m, 'delayed', codec='int8', optimizer=opt)\n"
        "for i in range(3):\n"
        "    opt.zero_grad()\n"
        "    with mode.no_sync():\n"
        "        m(torch.randn(8, 2000)).sum().backward()\n"
        "    mode.step(opt)\n"
        "print('done', dist.get_rank(), flush=True)\n")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1",
                              "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    said = out.stdout + out.stderr
    assert out.returncode == 0 and "terminate called" not in said and said.count("done") == 2, said[-3000:]


def _gossip_without_feedback(rank: int, world: int) -> str:
    try:
        thinwire.sync(DistributedDataParallel(_net()), "gossip:topology=ring", codec="int8", error_feedback=False)
    except ConfigError as e:
        return str(e)
    return "taken"


def test_compressed_gossip_refuses_error_feedback_off():
    """CHOCO's public copies are its error feedback; error_feedback=False was taken and ignored without a word."""
    for said in run_ranks(_gossip_without_feedback, 2):
        assert said.startswith("error_feedback: must be true with compressed gossip (--compression int8), got False. "
                               "CHOCO-SGD's public copies are its error feedback"), said


def _refused_then_retried(rank: int, world: int) -> dict:
    ddp = DistributedDataParallel(_net())  # Linear: 2 parameter tensors
    try:
        thinwire.sync(ddp, "diloco:period=4,fragments=4", codec="none")
    except ConfigError as e:
        said = str(e)
    state = getattr(ddp, "_thinwire_state", None)
    mode = thinwire.sync(ddp, "diloco:period=4,fragments=2", codec="none")  # registers DDP's hook: there was none
    mode.close()
    return {"said": said, "state": state}


def test_a_refused_sync_leaves_the_ddp_model_as_it_was():
    """The mode's own refusal (here: more fragments than parameter tensors) came after DDP got the no-op hook and
    thinwire's mark: the retry was refused as a second attach, and plain DDP on the model averaged nothing."""
    for r in run_ranks(_refused_then_retried, 2):
        assert r["said"].startswith("sync.fragments: must be at most 2"), r["said"]
        assert r["state"] is None, r


def _loads_the_other_ranks_state(rank: int, world: int, mode_text: str) -> str:
    import torch.distributed as dist

    ddp = DistributedDataParallel(_net())
    mode = thinwire.sync(ddp, mode_text, codec="int8")
    _steps(ddp, mode, torch.optim.SGD(ddp.parameters(), lr=LR), rank)
    states = [None] * world
    dist.all_gather_object(states, mode.state_dict())
    own = mode.state_dict()
    try:
        mode.load_state_dict(states[1 - rank])
    except ValueError as e:
        said = str(e)
    else:
        said = "taken"
    mode.load_state_dict(own)  # its own is taken
    mode.close()
    return said


@pytest.mark.parametrize("mode_text", ["delayed", "local:period=4,merge=keep,warmup=0", "diloco:period=4"])
def test_a_sync_state_saved_by_another_rank_is_refused(mode_text):
    """delayed's own gradient, merge=keep's sent part: each rank's state is its own; another rank's was taken without
    a word and the run went on 0.02 away from the straight one (the CommState and gossip refused it already)."""
    for r, said in enumerate(run_ranks(_loads_the_other_ranks_state, 2, mode_text)):
        assert f"this state was saved by rank {1 - r}, and this is rank {r} of 2" in said, said


def _two_mode_steps(rank: int, world: int) -> list[str]:
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("thinwire.compress").addHandler(handler)
    ddp = DistributedDataParallel(_net())
    mode = thinwire.sync(ddp, "local:period=4,warmup=0", codec="none")
    a = torch.optim.SGD([ddp.module.weight], lr=LR)
    b = torch.optim.SGD([ddp.module.bias], lr=LR)
    for step in range(3):
        x, y = _data(step, rank)
        with mode.no_sync():
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        mode.step(a)
        mode.step(b)  # the mode's period counts this as a step of its own
    mode.close()
    return [m for m in said if "a second step with no forward" in m]


def test_two_mode_steps_per_iteration_are_told():
    """mode.step(opt_a); mode.step(opt_b): local SGD averaged every 2 iterations instead of 4, without a word."""
    for said in run_ranks(_two_mode_steps, 2):
        assert len(said) == 1 and "with several optimizers call mode.before_step(), each optimizer.step()" in said[0]
