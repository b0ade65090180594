"""The convergence guard (thinwire.measure.convergence) on two workloads built here, of different kinds
(neither charlm nor digits): a codec that ends worse than fp32 at equal samples gets a larger sample
factor and the verdict "does not reach", one that does not gets factor 1 and "reaches"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from thinwire.compress.spec import parse_codec_spec, spec_string
from thinwire.measure.convergence import GUARD_ORDERS, _record, measure_convergence, sample_factor, tail_gap
from thinwire.measure.file import ConvergenceRecord
from thinwire.workloads.base import Workload

ROOT = Path(__file__).resolve().parents[1]


def _regression() -> Workload:
    """A two-layer MLP fitting a fixed random teacher (continuous targets, MSE)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    torch.manual_seed(1)  # the teacher too: it was drawn from whatever the global generator held (run alone,
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))  # two calls fit two teachers)
    with torch.no_grad():
        y = teacher(x)
    torch.manual_seed(0)
    data = list(zip(x, y))
    return Workload(model=nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)), train=data[:1792],
                    val=data[1792:], loss=nn.functional.mse_loss, task="regression", lr=3e-3)


class _SeqClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rnn, self.head = nn.Embedding(12, 16), nn.GRU(16, 32, batch_first=True), nn.Linear(32, 2)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0][:, -1])


def _sequences() -> Workload:
    """A GRU classifying token sequences by whether token 3 occurs more often than token 7 (cross-entropy)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 12, (2048, 12), generator=g)
    y = ((x == 3).sum(1) > (x == 7).sum(1)).long()
    torch.manual_seed(0)
    data = list(zip(x, y))
    return Workload(model=_SeqClassifier(), train=data[:1792], val=data[1792:], loss=nn.functional.cross_entropy,
                    task="classification", lr=3e-3)


@pytest.mark.parametrize("build", [_regression, _sequences], ids=["mlp-regression", "gru-sequences"])
def test_guard_ranks_a_codec_that_ends_worse_below_one_that_does_not(build):
    wl = build()
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    out = measure_convergence(wl, ["int8", "topk:ratio=0.01"], world=4, batch=32, steps=60)
    good, bad = out["int8"], out[spec_string(parse_codec_spec("topk:ratio=0.01"))]
    assert good.reaches and good.factor < 1.05, good
    assert not bad.reaches and bad.loss > good.loss, bad
    assert bad.factor is None or bad.factor > 1.5, bad  # measured: 2.6 (mlp), 2.3 (gru)
    assert all(torch.equal(before[k], v) for k, v in wl.model.state_dict().items())  # the user's weights are kept


def test_guard_is_deterministic_and_fp32_is_its_own_reference():
    a = measure_convergence(_regression(), ["none", "topk:ratio=0.05"], world=2, batch=16, steps=20)
    b = measure_convergence(_regression(), ["none", "topk:ratio=0.05"], world=2, batch=16, steps=20)
    assert a == b
    assert a["none"].loss == a["none"].reference_loss and a["none"].factor == 1.0


def test_verdict_is_the_median_over_data_orders_of_the_second_half_gap():
    ref = [(10, 4.0), (20, 3.0), (30, 2.0), (40, 2.0)]
    even = [(10, 4.2), (20, 3.1), (30, 2.01), (40, 2.01)]          # +0.5% over the second half
    off = [(10, 4.2), (20, 3.1), (30, 2.2), (40, 2.2)]             # +10%
    late = [(10, 4.2), (20, 3.1), (30, 2.0), (40, 2.05)]           # its last point is +2.5%, its second half +1.25%
    assert tail_gap(ref, even) == pytest.approx(0.005) and tail_gap(ref, late) == pytest.approx(0.0125)
    one_bad_order = _record([ref] * 3, [even, off, even], world=4)  # one order's divergence is not the codec's
    assert one_bad_order.reaches and one_bad_order.gap == pytest.approx(0.005) and one_bad_order.orders == 3
    every_order = _record([ref] * 3, [off, even, off], world=4)     # a gap in most orders is
    assert not every_order.reaches and every_order.gap == pytest.approx(0.1)
    assert every_order.factor == sample_factor(ref, 2.2)
    unknown = _record([ref] * 3, [[(10, 9.0), (20, 9.0)]] * 2 + [off], world=4)  # two orders worse than fp32's start
    assert unknown.factor is None and not unknown.reaches


def test_guard_runs_every_comparison_on_several_data_orders():
    seen = []
    out = measure_convergence(_regression(), ["int8"], world=2, batch=16, steps=20, progress=seen.append)
    assert out["int8"].orders == GUARD_ORDERS == len(seen) == 3 and "data order 3 of 3" in seen[-1]
    single = measure_convergence(_regression(), ["int8"], world=2, batch=16, steps=20, orders=1)
    assert single["int8"].orders == 1


def test_a_profile_from_before_the_gap_keeps_its_verdict():
    old = ConvergenceRecord(factor=1.1, loss=2.03, reference_loss=2.0, steps=60, world=4)  # no gap: last loss
    assert old.relative_gap == pytest.approx(0.015) and not old.reaches
    assert ConvergenceRecord(factor=1.1, loss=2.03, reference_loss=2.0, steps=60, world=4, gap=0.004).reaches


def test_a_gap_near_a_zero_loss_reads_as_a_multiple_of_fp32s():
    near_zero = ConvergenceRecord(factor=None, loss=5.8e-3, reference_loss=1.0e-6, steps=60, world=4)
    assert near_zero.gap_text() == "5,800x fp32's loss" and not near_zero.reaches
    assert ConvergenceRecord(factor=1.1, loss=2.03, reference_loss=2.0, steps=60, world=4, gap=0.004).gap_text() == "+0.4%"
    assert ConvergenceRecord(factor=None, loss=4.0, reference_loss=2.0, steps=60, world=4).gap_text(2) == "+100.00%"
    assert ConvergenceRecord(factor=None, loss=25.0, reference_loss=2.0, steps=60, world=4).gap_text() == "12.5x fp32's loss"


def test_sample_factor_rule():
    ref = [(10, 4.0), (20, 3.0), (30, 2.5), (40, 2.0)]
    assert sample_factor(ref, 2.0) == 1.0 and sample_factor(ref, 1.0) == 1.0  # at or below fp32's end
    assert sample_factor(ref, 3.0) == 2.0                                      # fp32 got there at step 20 of 40
    assert sample_factor(ref, 2.75) == pytest.approx(40 / 25)                  # interpolated
    assert sample_factor(ref, 4.5) is None                                     # worse than fp32's first look


def test_bad_arguments_are_refused():
    from thinwire.errors import ConfigError

    with pytest.raises(ConfigError, match="batch: must be at least one sample per shard"):
        measure_convergence(_regression(), ["int8"], world=4, batch=2)
    with pytest.raises(ConfigError, match="steps: must be at least two evaluations"):
        measure_convergence(_regression(), ["int8"], world=2, batch=8, steps=5)


def test_profile_records_the_guard_and_plan_ranks_by_it(tmp_path):
    from tests.test_cli import thinwire as cli

    prof, plan = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    proc = cli("profile", "--workload", "digits", "--set", "model.hidden=32", "--batch-sizes", "16", "--codecs",
               "none,int8,topk:ratio=0.01", "--reps", "3", "--no-corun", "--guard-steps", "20", "--out", str(prof))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "guard:" in proc.stdout
    for part in ("step timed at batch 16 (3 repetitions) in", "convergence guard in", "3 codecs timed in"):
        assert part in proc.stderr, proc.stderr  # a line as each part ends: minutes of measuring are never silent
    from thinwire.measure.file import load_profile

    loaded = load_profile(prof)
    assert loaded.guarded and loaded.codecs["int8"].convergence.steps == 20
    spec = tmp_path / "c.yaml"
    spec.write_text("name: g\ndefaults: {bandwidth: 20mbit, cpu: 0.5}\nhosts:\n  - {name: a}\n  - {name: b}\n")
    proc = cli("plan", "--cluster", str(spec), "--workload", "digits", "--set", "model.hidden=32", "--profile", str(prof),
               "--batch-size", "16", "--codecs", "none,int8,topk:ratio=0.01", "--out", str(plan))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = " ".join(proc.stdout.split())
    assert "Ranked by predicted time to DDP fp32's loss" in out and "samples" in out
    assert loaded.sync["delayed"].steps == 20 and "the samples by the guard" in out  # delayed, priced with its factor


@pytest.mark.parametrize("cores, warned", [(1.5, True), (0.1, False)])
def test_profile_warns_when_other_processes_ran_while_it_measured(tmp_path, monkeypatch, capsys, cores, warned):
    import thinwire.cli.profile as cli_profile
    import thinwire.measure.run as measure_run
    from thinwire.cli.main import main
    from thinwire.measure.file import load_profile

    stored = load_profile(ROOT / "benchmarks/results/plan_target/profile-charlm.yaml")
    monkeypatch.setattr(measure_run, "profile_workload", lambda **kw: stored)

    class Busy:  # other processes used `cores` on average while the profile measured
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.cores = cores

    monkeypatch.setattr(cli_profile, "ForeignCpu", Busy)
    assert main(["profile", "--workload", "charlm", "--no-corun", "--out", str(tmp_path / "p.yaml")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert (f"Other processes used {cores:.1f} of this machine's" in err) == warned, err
    assert (tmp_path / "p.yaml").exists()


def test_profile_refuses_a_guard_too_short_to_measure(tmp_path):
    from tests.test_cli import thinwire as cli

    proc = cli("profile", "--workload", "digits", "--batch-sizes", "8", "--guard-steps", "5", "--out", str(tmp_path / "p"))
    assert proc.returncode != 0 and "--guard-steps: must be 0 (no guard) or at least 10" in proc.stderr + proc.stdout
    assert not (tmp_path / "p").exists()


def test_delayed_sync_mode_is_guarded_too():
    """The guard runs delayed one step stale, each shard's gradient at its own predicted weights, and judges it
    by the codecs' rule. On the GRU workload it ends close to fp32 (measured: gap +0.99%, factor 1.005; with
    the last update repeated as the prediction +1.7%, plain staleness factor 1.36)."""
    from thinwire.measure.file import REACH_TOL

    out = measure_convergence(_sequences(), ["int8"], world=4, batch=32, steps=60, delayed=True)
    d = out["delayed"]
    assert d.loss != d.reference_loss and d.reference_loss == out["int8"].reference_loss
    assert 0 < d.gap < 0.05 and d.reaches == (d.gap <= REACH_TOL), d

def test_the_guards_stale_run_on_one_shard_is_fp32_one_step_behind():
    """On one shard a rank's own gradient is the average, so ``delayed``'s prediction is exact: after k + 1
    steps (the first applies nothing) the stale run holds fp32's weights after k, held-out loss for loss.
    Repeating the last update, or no prediction, would not."""
    from thinwire.measure.convergence import _curve
    from thinwire.workloads.base import eval_subset

    wl = _sequences()
    start = {k: v.clone() for k, v in wl.model.state_dict().items()}
    evals = eval_subset(len(wl.val), 2, 16)
    kw = dict(world=1, batch=16, steps=10, every=1, seed=0, start=start, evals=evals)  # steps < 20: no lr warm-up
    fresh, stale = _curve(wl, None, **kw), _curve(wl, None, stale=True, **kw)
    assert [s for s, _ in stale] == list(range(1, 11))
    for (_, f), (_, s) in zip(fresh[:-1], stale[1:]):
        assert s == pytest.approx(f, rel=1e-6, abs=1e-7)
    assert stale[1][1] != fresh[1][1]  # one step behind, not equal


def test_losses_near_zero_are_compared_to_a_floor_not_to_each_other():
    """A workload fit to a loss of 4.5e-8: int8 at 4.6e-8 was "+2.5%: does not reach fp32's loss" and dropped by plan,
    doctor and auto. Losses are relative to at least 1e-4 of fp32's first held-out loss."""
    ref = [(5, 1.2), (10, 0.01), (15, 4.4e-8), (20, 4.5e-8)]
    near = [(5, 1.2), (10, 0.01), (15, 4.5e-8), (20, 4.6e-8)]
    assert abs(tail_gap(ref, near)) < 1e-4 and sample_factor(ref, 4.6e-8) == 1.0  # were +2.2% and 1.3x
    far = [(5, 1.2), (10, 0.05), (15, 0.02), (20, 0.01)]  # 0.01 where fp32 is at 0: not reached, and priced
    assert tail_gap(ref, far) > 10 and sample_factor(ref, 0.01) == pytest.approx(2.0)
    # an ordinary loss is compared as before
    assert tail_gap([(5, 4.0), (10, 2.0)], [(5, 4.0), (10, 2.1)]) == pytest.approx(0.05)
