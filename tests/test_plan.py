"""The planner: uneven shares keep the update exact, decisions on the three evaluation clusters, the plan
file and its refusals, the hierarchical collective on 4 gloo ranks. Synthetic profiles: no measuring."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec, LinkSpec, load_cluster_spec
from thinwire.errors import ConfigError, ThinwireError
from thinwire.measure.file import BucketRecord, CodecCost, ComputePoint, Cost, Profile, save_profile
from thinwire.plan.planfile import PlanPolicy, load_plan, loss_weight, read_plan, save_plan
from thinwire.plan.planner import PlanOptions, make_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
CODECS = ("none", "bf16", "int8")


def profile(*, post_s: float = 0.002, buckets: int = 2, params: int = 800_000, act: float = 1e5) -> Profile:
    """A charlm-like profile: compute linear in the batch (about 6.5 ms per sample at speed 1)."""
    cost = lambda e, d: CodecCost(encode=Cost(per_byte_s=e), decode=Cost(per_byte_s=d))  # noqa: E731
    per = params // buckets
    return Profile(
        workload="charlm", model={}, parameters=per * buckets, threads=1, activation_bytes_per_sample=act,
        compute=[ComputePoint(batch=8, pre_s=0.02, backward_s=0.034, post_s=post_s),
                 ComputePoint(batch=4, pre_s=0.01, backward_s=0.017, post_s=post_s)],
        buckets=[BucketRecord(numel=per, ready_frac=(i + 1) / buckets, params=[2 * i, 2 * i + 1],
                              shapes=[[per // 400, 200], [per // 400, 200]]) for i in range(buckets)],
        kernels={"add": Cost(per_byte_s=1e-10), "feedback": Cost(per_byte_s=2e-10)},
        codecs={"bf16": cost(4e-10, 4e-10), "int8": cost(1.5e-9, 8e-10)})


def plan_for(spec: ClusterSpec, prof: Profile | None = None, batch: int = 32, codecs=CODECS, **kw):
    return make_plan(spec, prof or profile(), workload="charlm", model={},
                     options=PlanOptions(batch_size=batch, codecs=codecs, **kw))


def four(name="t", **by_host) -> ClusterSpec:
    hosts = [HostSpec(name=f"h{i}", **by_host.get(f"h{i}", {})) for i in range(4)]
    return ClusterSpec(name=name, defaults=DefaultsSpec(bandwidth="1gbit", cpu=0.5), hosts=hosts)


# -- the update with uneven shares is the uniform one -------------------------------------------------
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("shares,micro", [([6, 4, 2, 1], [6, 4, 2, 1]), ([9, 3, 1], [4, 2, 1])])
def test_uneven_shares_weighted_losses_give_the_full_batch_gradient(shares, micro):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(sum(shares), 5, generator=g, dtype=torch.float64), torch.randn(sum(shares), 3, generator=g,
                                                                                   dtype=torch.float64)
    full = _net()
    nn.functional.mse_loss(full(x), y).backward()
    model, total, start = _net(), None, 0
    for rank, (share, m) in enumerate(zip(shares, micro)):
        model.zero_grad()
        xs, ys = x[start:start + share], y[start:start + share]
        for xm, ym in zip(xs.split(m), ys.split(m)):  # accumulation as the trainer does it
            part = nn.functional.mse_loss(model(xm), ym) * (len(ym) / share) * loss_weight(rank, shares)
            part.backward()
        grads = _grads(model)
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
        start += share
    averaged = [t / len(shares) for t in total]  # what DDP's equal average does
    for a, b in zip(averaged, _grads(full)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _ddp_uneven(rank, world, shares):
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(sum(shares), 5, generator=g, dtype=torch.float64), torch.randn(sum(shares), 3, generator=g,
                                                                                   dtype=torch.float64)
    model = DDP(_net())
    start = sum(shares[:rank])
    loss = nn.functional.mse_loss(model(x[start:start + shares[rank]]), y[start:start + shares[rank]])
    (loss * loss_weight(rank, shares)).backward()
    full = _net()
    nn.functional.mse_loss(full(x), y).backward()
    return _grads(model.module), _grads(full)


def test_uneven_shares_under_ddp_on_three_gloo_ranks():
    for got, want in run_ranks(_ddp_uneven, 3, [7, 3, 1]):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_loss_weight_is_one_for_even_shares_and_checks_its_input():
    assert loss_weight(2, [8, 8, 8, 8]) == 1.0
    assert loss_weight(0, [6, 2]) == 1.5
    with pytest.raises(ValueError, match="rank must index shares"):
        loss_weight(3, [4, 4])


# -- decisions -----------------------------------------------------------------------------------------
def test_host_with_a_quarter_of_the_cpu_gets_a_smaller_share():
    plan = plan_for(load_cluster_spec(EXAMPLES / "plan-a-slow-cpu.yaml"), batch=64)
    d = plan.chosen
    assert "slow" in d.hosts, d.name
    share = dict(zip(d.hosts, d.shares))
    assert share["slow"] * 3 <= share["a0"] <= share["slow"] * 5  # about a quarter of a fast host's
    assert d.predicted_step_s * 1.3 < plan.baselines["uniform_ddp_fp32_s"]
    assert any("Uneven batch shares" in line for line in plan.explanation)


def test_a_hopeless_host_is_left_out_when_that_is_faster():
    plan = plan_for(four(h3={"cpu": 0.005}))
    assert plan.chosen.left_out == ["h3"] and "h3" not in plan.chosen.hosts
    assert any(line.startswith("Leaving out h3") for line in plan.explanation)
    kept = [a for a in plan.alternatives if "h3" in a.hosts]
    assert all(a.predicted_step_s > plan.chosen.predicted_step_s for a in kept)


def test_slow_link_between_groups_is_compressed_and_fast_groups_stay_dense():
    plan = plan_for(load_cluster_spec(EXAMPLES / "plan-b-two-groups.yaml"), prof=profile(params=1_000_000), batch=128)
    d = plan.chosen
    assert d.collective == "hierarchical" and d.groups == [["a1", "a2"], ["b1", "b2"]], d.name
    assert set(d.codecs) != {"none"}
    fast = plan_for(ClusterSpec(name="fast", defaults=DefaultsSpec(bandwidth="10gbit", cpu=0.5),
                                hosts=[HostSpec(name=f"h{i}") for i in range(4)]), prof=profile(params=1_000_000), batch=128)
    assert set(fast.chosen.codecs) == {"none"} and fast.chosen.collective == "ring"


def test_host_behind_a_slow_link_is_dropped_or_isolated():
    plan = plan_for(load_cluster_spec(EXAMPLES / "plan-c-slow-link.yaml"))
    d = plan.chosen
    assert "far" in d.left_out or d.collective == "hierarchical" or set(d.codecs) != {"none"}
    assert d.predicted_step_s * 1.3 < plan.baselines["uniform_ddp_fp32_s"]


@pytest.mark.parametrize("seed", range(6))
def test_never_predicted_slower_than_uniform_ddp(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda: float(torch.rand(1, generator=g))  # noqa: E731
    hosts = [HostSpec(name=f"h{i}", group=f"g{i % 2}", cpu=round(0.05 + r(), 3), bandwidth=f"{int(5 + 2000 * r())}mbit")
             for i in range(5)]
    spec = ClusterSpec(name="rand", hosts=hosts, links=[LinkSpec(between=["g0", "g1"], bandwidth=f"{int(10 + 900 * r())}mbit")])
    plan = plan_for(spec, prof=profile(post_s=0.02 * r()), batch=40)
    assert plan.chosen.predicted_step_s <= plan.baselines["uniform_ddp_fp32_s"] + 1e-12
    assert plan.chosen.predicted_step_s <= plan.baselines["best_single_codec_s"] + 1e-12
    assert sum(plan.chosen.shares) == 40


def test_batch_smaller_than_the_cluster_uses_fewer_hosts():
    fast = {"bandwidth": "10gbit"}  # a link on which two hosts beat one alone on the two samples
    plan = plan_for(four(h0=fast, h1={"cpu": 0.25, **fast}, h2=fast, h3=fast), batch=2)
    assert plan.baselines == {} and plan.chosen.hosts == ["h0", "h2"] and plan.chosen.shares == [1, 1]
    assert plan.explanation[0].startswith("Uniform DDP cannot run: the global batch (2) is smaller than the 4 hosts")


def test_memory_caps_the_micro_batch():
    plan = plan_for(four(h0={"memory": "22MiB"}), prof=profile(act=1e6))  # room for ~3-7 samples
    d = plan.chosen
    i = d.hosts.index("h0")
    assert d.micro[i] < d.shares[i] and plan.micro_sizes(i) and sum(plan.micro_sizes(i)) == d.shares[i]
    assert max(plan.micro_sizes(i)) <= d.micro[i]


def test_64_host_spec_plans():
    hosts = [HostSpec(name=f"n{i}", group=f"g{i % 4}", cpu=[1.0, 0.5, 0.25, 0.125][i % 4],
                      bandwidth=["1gbit", "100mbit", "20mbit"][i % 3]) for i in range(64)]
    links = [LinkSpec(between=[f"g{a}", f"g{b}"], bandwidth="50mbit") for a in range(4) for b in range(a + 1, 4)]
    spec = ClusterSpec(name="big", subnet="10.200.0.0/16", hosts=hosts, links=links)
    plan = plan_for(spec, prof=profile(buckets=8), batch=1024)
    assert plan.chosen is not None and sum(plan.chosen.shares) == 1024


# -- the plan file ---------------------------------------------------------------------------------------
def test_plan_file_round_trip_and_trainer_helpers(tmp_path):
    spec = load_cluster_spec(EXAMPLES / "plan-b-two-groups.yaml")
    plan = plan_for(spec, prof=profile(params=1_000_000), batch=128)
    path = save_plan(plan, tmp_path / "plan.yaml")
    back = load_plan(path, spec, "charlm", {"width": 128})  # the default, given explicitly: same workload
    assert back == plan
    world = len(back.hosts)
    assert back.shares(world) == plan.chosen.shares and sum(back.shares(world)) == back.global_batch
    assert back.rank_groups() == [[0, 1], [2, 3]]
    policy = back.policy()
    assert policy.codec_for(0, plan.bucket_numels[0], 5).name == plan.chosen.codecs[0].split(":")[0]
    assert back.codec_spec(99) == "none"
    other = back.select(0)
    assert other.chosen == plan.alternatives[0] and other.alternatives[0] == plan.chosen
    with pytest.raises(ThinwireError, match=r"plan: made for 4 workers \(a1, a2, b1, b2\), but this job has 3"):
        back.shares(3)


def test_plan_policy_describes_its_codecs():
    assert PlanPolicy(["int8", "int8"]).describe() == "plan[int8]"
    assert PlanPolicy(["none", "bf16"]).describe() == "plan[0:none, 1:bf16]"


def test_plan_from_another_cluster_is_refused(tmp_path):
    path = save_plan(plan_for(load_cluster_spec(EXAMPLES / "plan-a-slow-cpu.yaml")), tmp_path / "a.yaml")
    with pytest.raises(ThinwireError, match=r"was made for cluster 'plan-a-slow-cpu', not for this cluster "
                                            r"'plan-c-slow-link': a0: group default.* absent now"):
        load_plan(path, load_cluster_spec(EXAMPLES / "plan-c-slow-link.yaml"), "charlm", {})
    # the fix makes a plan in a new file: a.yaml is a good plan for its own cluster
    new = tmp_path / "a-plan-c-slow-link.yaml"
    with pytest.raises(ThinwireError, match=f"in a new file \\(leaving {path} as it is\\): thinwire plan --cluster SPEC "
                                            f"--workload charlm --out {new}, and train with --plan {new}\\.$"):
        load_plan(path, load_cluster_spec(EXAMPLES / "plan-c-slow-link.yaml"), "charlm", {})
    changed = load_cluster_spec(EXAMPLES / "plan-a-slow-cpu.yaml")
    changed.hosts[3].cpu = 0.25
    with pytest.raises(ThinwireError, match=r"slow: group default, cpu 0.125.* in the plan, group default, cpu 0.25"):
        load_plan(path, changed, "charlm", {})


def test_plan_from_another_workload_is_refused(tmp_path):
    spec = load_cluster_spec(EXAMPLES / "plan-a-slow-cpu.yaml")
    path = save_plan(plan_for(spec), tmp_path / "a.yaml")
    with pytest.raises(ThinwireError, match=r"made for another workload: model options width: 128 in the plan, 256 now"):
        load_plan(path, spec, "charlm", {"width": 256})
    with pytest.raises(ThinwireError, match=r"made for another workload: workload 'charlm', not 'digits'"):
        load_plan(path, spec, "digits", {})
    with pytest.raises(ThinwireError, match=r"--out \S+/a-my-wl-make\.yaml, and train with --plan \S+/a-my-wl-make\.yaml"):
        load_plan(path, spec, "my.wl:make", {})
    with pytest.raises(ConfigError, match=r"batch_size: must be the plan's global batch \(32\), got 64"):
        load_plan(path, spec, "charlm", {}, batch_size=64)


def test_a_plan_from_before_a_new_model_option_still_fits_while_the_option_is_at_its_default(tmp_path):
    """A plan records every model option of its day; a later thinwire adds options (charlm's drift_step):
    the plan stays valid for runs that leave them at their defaults, and only for those."""
    import dataclasses

    spec = load_cluster_spec(EXAMPLES / "plan-a-slow-cpu.yaml")
    plan = plan_for(spec)
    older = dataclasses.replace(plan, model={k: v for k, v in plan.model.items() if k not in ("drift_step", "drift")},
                                workload_fingerprint="0" * 16)
    path = save_plan(older, tmp_path / "old.yaml")
    assert load_plan(path, spec, "charlm", {}).chosen == plan.chosen
    assert load_plan(path, spec, "charlm", {"drift_step": 0}).chosen == plan.chosen
    with pytest.raises(ThinwireError, match=r"made for another workload: model options drift_step: 0 in the plan, 50 now\. "):
        load_plan(path, spec, "charlm", {"drift_step": 50})


def test_missing_plan_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ThinwireError, match="does not exist. Make one with `thinwire plan"):
        read_plan(tmp_path / "nope.yaml")


# -- bad input -------------------------------------------------------------------------------------------
def test_empty_cluster_is_refused():
    with pytest.raises(ConfigError, match=r"hosts: must be a non-empty list of hosts, got \[\]"):
        ClusterSpec(name="empty", defaults=DefaultsSpec(bandwidth="1gbit"), hosts=[])


def test_links_that_contradict_each_other_are_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("defaults: {bandwidth: 1gbit}\nhosts: [{name: a, group: A}, {name: b, group: B}]\n"
                    "links:\n  - {between: [A, B], bandwidth: 50mbit}\n  - {between: [B, A], bandwidth: 20mbit}\n")
    with pytest.raises(ConfigError, match=r"links\[1\]: must be one entry per pair of groups.*It contradicts links\[0\]"):
        load_cluster_spec(path)


def test_model_that_fits_nowhere_is_refused():
    with pytest.raises(ThinwireError, match=r"model: charlm with 800,000 parameters fits nowhere.*largest host h0 has "
                                            r"1.0 MiB"):
        plan_for(four(**{f"h{i}": {"memory": "1MiB"} for i in range(4)}))


def test_hosts_that_cannot_hold_the_worker_process_itself_are_told_so_not_to_shrink_the_model():
    import dataclasses as dc

    prof = dc.replace(profile(params=1000), runtime_bytes=240 * 2**20)  # Python and torch, before any model
    with pytest.raises(ThinwireError, match=r"needs 2\d\d\.\d MiB on a host \(the worker process itself 240\.0 MiB "
                                            r"\(Python, torch\), then parameters.*Give the hosts more memory "
                                            r"\(hosts\[\]\.memory\): at least 2\d\d MiB\.$"):
        plan_for(four(**{f"h{i}": {"memory": "200MiB"} for i in range(4)}), prof=prof)


def test_model_too_big_for_any_host_without_a_layer_list_fits_nowhere():
    with pytest.raises(ThinwireError, match=r"fits nowhere.*has no layer list to pipeline"):
        plan_for(four(**{f"h{i}": {"memory": "8MiB"} for i in range(4)}))  # 800k params need ~15 MiB


def test_profile_of_another_workload_is_refused():
    prof = dataclasses.replace(profile(), model={"width": 64})
    with pytest.raises(ThinwireError, match=r"profile: measured workload 'charlm' with model options .*'width': 64"):
        plan_for(four(), prof=prof)


# -- the command line ------------------------------------------------------------------------------------
def test_cli_writes_and_prints_a_plan(tmp_path, capsys):
    from thinwire.cli.main import main

    prof = save_profile(profile(), tmp_path / "p.yaml")
    out = tmp_path / "plan.yaml"
    rc = main(["plan", "--cluster", str(EXAMPLES / "plan-a-slow-cpu.yaml"), "--workload", "charlm", "--profile",
               str(prof), "--batch-size", "32", "--codecs", "bf16,int8", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.is_file() and "chosen" in text and "Uniform DDP fp32 over 4 hosts" in text
    assert read_plan(out).chosen is not None
    # the command that runs it names what the plan was made for: `--plan` alone ran charlm, refused for a user's workload
    assert (f"run it: thinwire train --cluster {EXAMPLES / 'plan-a-slow-cpu.yaml'} --plan {out} --workload charlm "
            "--batch-size 32") in " ".join(text.split())


def test_cli_builds_the_workload_once(tmp_path, monkeypatch):
    """For the default batch and to check the profile against the model: one build (a user's workload may load its
    data there)."""
    from thinwire.cli.main import main
    from thinwire.workloads import registry

    calls, real = [], registry.build_workload
    monkeypatch.setattr(registry, "build_workload", lambda *a, **k: calls.append(a) or real(*a, **k))
    prof = save_profile(profile(), tmp_path / "p.yaml")
    rc = main(["plan", "--cluster", str(EXAMPLES / "plan-a-slow-cpu.yaml"), "--workload", "charlm", "--profile",
               str(prof), "--codecs", "bf16", "--out", str(tmp_path / "plan.yaml")])
    assert rc == 0 and len(calls) == 1


def test_cli_refusals_exit_non_zero(tmp_path, capsys):
    from thinwire.cli.main import main

    prof = save_profile(profile(), tmp_path / "p.yaml")
    spec = tmp_path / "tiny.yaml"
    spec.write_text("defaults: {bandwidth: 1gbit, memory: 1MiB}\nhosts: [{name: a}, {name: b}]\n")
    rc = main(["plan", "--cluster", str(spec), "--profile", str(prof), "--batch-size", "8", "--out", str(tmp_path / "x")])
    assert rc == 2 and "fits nowhere" in capsys.readouterr().err
    rc = main(["plan", "--cluster", str(spec), "--profile", str(prof), "--set", "lr=0.1", "--out", str(tmp_path / "x")])
    assert rc == 2 and "--set: must be model.KEY=VALUE" in capsys.readouterr().err


# -- the hierarchical collective on gloo --------------------------------------------------------------------
N = 5000


class Probe(nn.Module):
    """loss = sum(w * c_rank): rank r's gradient is its known vector c_r."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(N))

    def forward(self, c):
        return (self.w * c).sum()


def _vector(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(10 + rank))


def _hier(rank, world, codec, groups):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thinwire.compress.hierarchical import attach_hierarchical

    model = DDP(Probe())
    policy = PlanPolicy([codec], [N]) if codec == "bf16" else codec  # a plan's policy, as attach_plan passes it
    state = attach_hierarchical(model, policy, groups=groups, min_compress_bytes=0)
    try:
        model(_vector(rank)).backward()
        return model.module.w.grad.clone(), state.stats()
    finally:
        state.close()


@pytest.mark.parametrize("codec,groups", [("none", [[0, 1], [2, 3]]), ("int8", [[0, 1], [2, 3]]),
                                          ("bf16", [[1, 0, 2], [3]])])
def test_hierarchical_collective_averages_on_four_gloo_ranks(codec, groups):
    want = sum(_vector(r) for r in range(4)) / 4
    results = run_ranks(_hier, 4, codec, groups)
    for grad, stats in results:
        bound = 0.0 if codec == "none" else 0.02
        assert torch.linalg.vector_norm(grad - want) <= bound * torch.linalg.vector_norm(want) + 1e-5
        torch.testing.assert_close(grad, results[0][0])  # every rank holds the same result
    for _, s in results:
        assert s["counts"] == ({codec: 1} if s["bytes_sent_between_leaders"] else {})
    inter = [s["bytes_sent_between_leaders"] for _, s in results]
    assert sum(1 for b in inter if b) == len(groups)  # only leaders talk across groups
    dense = 2 * (len(groups) - 1) * 4 * N // len(groups)
    assert all(b == 0 or (b == dense if codec == "none" else b < dense / 1.9) for b in inter)


def test_accuracy_guard_leaves_out_codecs_that_leave_most_of_the_gradient_behind():
    import dataclasses

    prof = profile()
    prof.codecs = {"bf16": dataclasses.replace(prof.codecs["bf16"], ef_error=0.002),
                   "int8": dataclasses.replace(prof.codecs["int8"], ef_error=0.9)}
    spec = four(h0={"bandwidth": "10mbit"})  # a slow ring: int8 would win on time
    plan = plan_for(spec, prof)
    used = {c for alt in [plan.chosen, *plan.alternatives] for c in alt.codecs}
    assert "int8" not in used and "bf16" in used
    assert any("codec int8 left out by the accuracy guard" in line and "90%" in line for line in plan.explanation)
    loose = plan_for(spec, prof, max_error=0.95)
    assert "int8" in {c for alt in [loose.chosen, *loose.alternatives] for c in alt.codecs}


def test_profile_measures_each_codecs_error_with_error_feedback_on_real_gradients():
    import torch

    from thinwire.measure.codec_costs import ef_errors

    g = torch.Generator().manual_seed(0)
    steps = [[torch.randn(50_000, generator=g), torch.randn(20_000, generator=g)] for _ in range(4)]
    errs = ef_errors(["none", "bf16", "topk:ratio=0.01"], steps)
    assert errs["none"] == 0.0 and errs["bf16"] < 0.01 and errs["topk"] > 0.9


# -- ranked by time to DDP fp32's loss (the convergence guard) ----------------------------------------
def _guarded(factors: dict[str, float | None], gaps: dict[str, float] | None = None) -> Profile:
    """A profile whose guard gave each codec ``factor``; its loss is ``gaps[codec]`` above fp32's (default
    +0.5%: it reaches fp32's loss within the 1% tolerance; a steep curve makes a small gap a large factor)."""
    from thinwire.measure.file import ConvergenceRecord

    prof = profile(params=2_000_000)
    for name, f in factors.items():
        gap = (gaps or {}).get(name, 0.005 if f is not None else 2.0)
        prof.codecs[name].convergence = ConvergenceRecord(factor=f, loss=2.0 * (1 + gap), reference_loss=2.0, steps=60,
                                                          world=4)
    return prof


def _slow() -> ClusterSpec:
    """Hosts slow enough that 4 of them beat one alone, on a link that makes the codec matter."""
    return ClusterSpec(name="slow", defaults=DefaultsSpec(bandwidth="50mbit", cpu=0.125),
                       hosts=[HostSpec(name=f"h{i}") for i in range(4)])


def test_rank_step_keeps_the_old_choice_and_rank_time_never_prefers_a_longer_time_to_target():
    step = plan_for(_slow(), prof=_guarded({"bf16": 1.0, "int8": 3.0}), rank="step")
    assert "int8" in step.chosen.codecs and step.chosen.sample_factor == 1.0  # fewest bytes: fastest step
    unguarded = plan_for(_slow(), prof=profile(params=2_000_000))
    assert (unguarded.chosen.name, unguarded.chosen.predicted_step_s) == (step.chosen.name, step.chosen.predicted_step_s)
    assert any("ranked by step time" in line for line in unguarded.explanation)
    timed = plan_for(_slow(), prof=_guarded({"bf16": 1.0, "int8": 3.0}))
    assert "int8" not in timed.chosen.codecs, timed.chosen.name  # 3x the samples outweighs the faster step
    for d in (timed.chosen, *timed.alternatives):
        assert d.predicted_step_s * d.sample_factor >= timed.chosen.predicted_step_s * timed.chosen.sample_factor * 0.98
    int8 = next(d for d in timed.alternatives if "int8" in d.codecs)
    assert int8.sample_factor == 3.0 and int8.predicted_step_s < timed.chosen.predicted_step_s
    assert any("Ranked by predicted time to DDP fp32's loss" in line and "int8 3.00x" in line
               for line in timed.explanation)
    cheap = plan_for(_slow(), prof=_guarded({"bf16": 1.0, "int8": 1.02}))
    assert "int8" in cheap.chosen.codecs  # a small factor does not outweigh its step


def test_a_codec_the_guard_could_not_price_is_left_out_unless_ranked_by_step():
    plan = plan_for(_slow(), prof=_guarded({"bf16": 1.0, "int8": None}))
    assert all("int8" not in d.codecs for d in (plan.chosen, *plan.alternatives))
    assert any("codec int8 left out" in line and "sample factor is unknown" in line for line in plan.explanation)
    assert "int8" in plan_for(_slow(), prof=_guarded({"bf16": 1.0, "int8": None}), rank="step").chosen.codecs


def test_a_codec_the_guard_says_does_not_reach_is_left_out_whatever_its_factor():
    # +3% after the guard's run with a factor of only 1.02: the gap may grow over a full run, so its time to the
    # target is not predicted; plan leaves it out as auto never tries it, and says why; --rank step keeps it
    prof = _guarded({"bf16": 1.0, "int8": 1.02}, gaps={"int8": 0.03})
    plan = plan_for(_slow(), prof=prof)
    assert all("int8" not in d.codecs for d in (plan.chosen, *plan.alternatives))
    assert any("codec int8 left out" in line and "does not reach" in line and "+3.0%" in line
               for line in plan.explanation), plan.explanation
    assert "int8" in plan_for(_slow(), prof=prof, rank="step").chosen.codecs
    assert "int8" in plan_for(_slow(), prof=_guarded({"bf16": 1.0, "int8": 1.02})).chosen.codecs  # +0.5%: reaches


def test_plan_prices_the_sync_modes_next_to_itself_and_says_their_loss_is_measured():
    from thinwire.syncspec import SHOWN as SYNC_MODES

    plan = plan_for(_slow(), prof=profile(params=2_000_000))
    line = next(l for l in plan.explanation if l.startswith("Sync modes on uniform DDP"))
    assert all(m in line for m in SYNC_MODES) and "measured, not predicted" in line
    # on a 50 Mbit/s link every mode, sending less often or overlapping, is predicted faster than allreduce
    import re

    speedups = [float(x) for x in re.findall(r"\(([0-9.]+)x\)", line)]
    assert len(speedups) == len(SYNC_MODES) and all(x > 1 for x in speedups), line


def test_plan_prices_the_sync_modes_as_simulate_does_on_a_noisy_profile():
    """The modes' steps in plan's explanation are simulate's: the compute with the slowest host's noise (plan
    once left the noise out of the modes but not out of the all-reduce step they are compared with)."""
    import re

    from thinwire.sim.sweep import SimOptions, simulate
    from thinwire.syncspec import SHOWN as SYNC_MODES
    from thinwire.syncspec import parse_sync_spec

    prof = profile(params=2_000_000)
    prof.compute = [dataclasses.replace(c, std_s=0.02) for c in prof.compute]  # 20 ms of noise per step
    plan = plan_for(_slow(), prof=prof, codecs=("none", "bf16"))
    line = next(l for l in plan.explanation if l.startswith("Sync modes on uniform DDP"))
    codec = re.search(r"uniform DDP with (\S+) ", line).group(1)
    for mode in SYNC_MODES:
        planned = float(re.search(re.escape(mode) + r" ([0-9.]+) ms", line).group(1))
        pt, = simulate(_slow(), prof, SimOptions(codec=codec, batch_size=32, sync=parse_sync_spec(mode)),
                       default_batch=32)
        assert planned == pytest.approx(pt.sync_step_s * 1e3, abs=0.051), (mode, line)


# -- the planner prices what simulate prices: the quota wait and an offload engine -------------------
def _uniform(spec: ClusterSpec, prof: Profile, codec: str):
    from thinwire.plan.planner import host_models, problem
    from thinwire.plan.search import uniform

    opts = PlanOptions(batch_size=32, codecs=("none", codec))
    pb, _ = problem(spec, prof, opts, host_models(spec, prof, opts))
    return uniform(pb, codec)


def test_the_planner_charges_the_quota_wait_of_each_ring_hop_during_backward():
    from thinwire.measure.file import NetworkRecord

    spec = four()
    prof = profile(buckets=2)
    plain = _uniform(spec, prof, "int8")
    prof.network = NetworkRecord(alpha_s=1e-4, efficiency=0.9, nominal_bps=1e9, measured_bps=0.9e9, hosts=4,
                                 cluster="t", busy_hop_s=0.002)
    busy = _uniform(spec, prof, "int8")
    # int8 gathers: 3 hops per bucket on 4 hosts, 2 ms each, for a bucket issued while backward runs
    assert plain.step_s < busy.step_s <= plain.step_s + 2 * 3 * 0.002 + 1e-9
    # the same per-bucket waits as the model's own timeline, bucket by bucket
    waits = [b.comm_s for b in busy.timeline.buckets]
    assert all(w >= p for w, p in zip(waits, [b.comm_s for b in plain.timeline.buckets]))


def test_the_planner_runs_codec_work_on_an_offload_engine_when_the_spec_has_one():
    from thinwire.cluster.spec import NicSpec

    prof = profile(buckets=2)
    prof.codecs["int8"] = CodecCost(encode=Cost(per_byte_s=2e-8), decode=Cost(per_byte_s=1e-8))  # a slow codec
    inline = _uniform(four(), prof, "int8")     # half-core hosts: codec work at half speed, taken from backward
    def engine(cores: float):
        return _uniform(ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="1gbit", cpu=0.5, nic=NicSpec(cpu=cores)),
                                    hosts=[HostSpec(name=f"h{i}") for i in range(4)]), prof, "int8")

    same, small = engine(0.5), engine(0.25)
    assert inline.steals and not same.steals and not small.steals   # the engine takes nothing from backward
    assert same.timeline.backward_s < inline.timeline.backward_s and same.step_s < inline.step_s
    encode = lambda s: sum(b.encode_s for b in s.timeline.buckets)  # noqa: E731
    assert encode(same) == pytest.approx(encode(inline))            # at the same speed as the host's half core
    assert encode(small) == pytest.approx(2 * encode(inline))       # a quarter core encodes at half that speed


# -- validation is part of the time to target ------------------------------------------------------------
def test_a_validation_is_priced_as_the_trainer_splits_it_and_says_so():
    """64 items (2 global batches of 32) over 4 even hosts of 8: 16 items each, two forwards of 8 at the
    profile's data + forward phase (20 ms at batch 8), on a half-core host: 80 ms, 8 ms a step at every 10."""
    plan = plan_for(four(), eval_every=10, eval_batches=2)
    assert plan.chosen.hosts == ["h0", "h1", "h2", "h3"] and plan.chosen.shares == [8, 8, 8, 8]
    assert plan.chosen.validation_s == pytest.approx(2 * 0.02 / 0.5)
    line = next(l for l in plan.explanation if l.startswith("Validation:"))
    assert "64 items every 10 steps" in line and "80.0 ms each" in line and "8.0 ms per step" in line
    assert plan.planning["validation"] == {"every": 10, "batches": 2, "items": 64}
    assert plan_for(four()).chosen.validation_s == 0.0  # eval_every 0 (the API's default): not priced
    assert plan_for(four(), eval_every=10, eval_batches=2, rank="step").chosen.validation_s == 0.0  # step time alone


def test_a_plan_on_fewer_hosts_pays_for_validating_more_items_on_each():
    """On two groups behind a thin link the step alone is best on one group's 2 hosts; when the run
    validates 20 global batches every step, each of those 2 hosts forwards twice the items it would
    among 4, and the planner keeps all 4."""
    spec, prof = load_cluster_spec(EXAMPLES / "plan-b-two-groups.yaml"), profile(params=800_000)
    alone = plan_for(spec, prof=prof, batch=32)
    assert len(alone.chosen.hosts) == 2
    heavy = plan_for(spec, prof=prof, batch=32, eval_every=1, eval_batches=20)
    assert len(heavy.chosen.hosts) == 4, heavy.chosen.name
    two = next(a for a in heavy.alternatives if len(a.hosts) == 2)
    assert two.validation_s == pytest.approx(2 * heavy.chosen.validation_s)
    assert heavy.chosen.predicted_step_s > two.predicted_step_s  # chosen for its time to target, not its step
    # the table's "time to fp32 loss" column is the ranking's quantity: the chosen plan's is the largest
    from thinwire.cli.plan import candidates_table

    table = candidates_table(heavy)
    times = [float(v.rstrip("x")) for v in table.columns[4]._cells]
    assert times[0] == max(times) and times[0] > next(
        t for t, d in zip(times, [heavy.chosen, *heavy.alternatives]) if d is two), times
    light = plan_for(spec, prof=prof, batch=32, eval_every=1000, eval_batches=1)
    assert light.chosen.name == alone.chosen.name


def test_a_slow_host_validates_in_proportion_to_its_share_and_is_kept():
    """A quarter-core host steps fine with a smaller share, and validates a part of each validation in proportion
    to it (as the trainer splits it, workloads.base.eval_part): the plan keeps it. When validation was split
    evenly, the host forwarded a quarter of the items at a quarter of the speed and the plan left it out."""
    from thinwire.plan.search import validation_s

    plan = plan_for(four(h3={"cpu": 0.25}), eval_every=1, eval_batches=20)
    assert plan.chosen.left_out == [] and plan.chosen.shares == [10, 9, 9, 4]
    three = next(a for a in plan.alternatives if a.hosts == ["h0", "h1", "h2"])
    assert plan.chosen.validation_s < three.validation_s
    assert not any(line.startswith("Leaving out") for line in plan.explanation)
    # 640 items: 200, 180, 180 and 80 (20 forwards each); priced on the slowest, the half-core host with 10
    assert plan.chosen.validation_s == pytest.approx(20 * 0.025 / 0.5)
    slow = plan_for(four(h3={"cpu": 0.1}), eval_every=1, eval_batches=20)  # this one does slow every step
    assert "slower (h3: its compute)" in next(line for line in slow.explanation if line.startswith("Leaving out h3"))


def test_hosts_left_out_are_each_given_their_own_reason():
    """Leaving out several hosts said "every step would otherwise wait for it (its compute or its link)" of all of
    them, a fast host on a fast link included."""
    spec = ClusterSpec(name="lab", defaults=DefaultsSpec(bandwidth="1gbit", cpu=0.5),
                       hosts=[HostSpec(name="ws0"), HostSpec(name="ws1"), HostSpec(name="old", cpu=0.1),
                              HostSpec(name="laptop", bandwidth="20mbit")])
    plan = plan_for(spec, prof=profile(params=2_000_000))
    assert plan.chosen.hosts == ["ws0", "ws1"]
    line = next(line for line in plan.explanation if line.startswith("Leaving out old"))
    assert "keeping them (balanced shares" in line and line.endswith("slower (old: its compute; laptop: its link).")


def test_validation_items_follow_the_trainers_subset():
    from thinwire.plan.planner import validation_items
    from thinwire.workloads.base import eval_subset

    prof = dataclasses.replace(profile(), val_items=500)
    for batches in (0, 2, 100):
        items, note = validation_items(prof, PlanOptions(batch_size=32, eval_every=5, eval_batches=batches))
        assert items == len(eval_subset(500, batches, 32)) and note is None
    old = profile()  # a profile from before val_items: the asked batches, or nothing priced for a whole pass
    assert validation_items(old, PlanOptions(batch_size=32, eval_every=5, eval_batches=3)) == (96, None)
    items, note = validation_items(old, PlanOptions(batch_size=32, eval_every=5, eval_batches=0))
    assert items == 0 and "--eval-batches 0" in note
    with pytest.raises(ConfigError, match="--eval-every"):
        PlanOptions(batch_size=32, eval_every=-1)


def test_train_notes_a_validation_cadence_the_plan_did_not_price():
    from thinwire.cli.train import validation_mismatch
    from thinwire.train.config import TrainConfig

    cfg = TrainConfig(eval_every=50, eval_batches=0)
    note = validation_mismatch({"every": 15, "batches": 50, "items": 800}, cfg)
    assert "every 15 steps on 50" in note and "every 50 steps on all" in note and "--eval-every 50 --eval-batches 0" in note
    assert validation_mismatch({"every": 50, "batches": 0, "items": 800}, cfg) is None
    assert validation_mismatch({"every": 0, "batches": 20, "items": 0}, cfg) is None  # not priced
    assert validation_mismatch(None, cfg) is None  # a plan from before


# -- the switch's aggregator as a collective ---------------------------------------------------------
def _switched(bandwidth: str, switch_cpu: float | None) -> ClusterSpec:
    from thinwire.cluster.spec import SwitchSpec

    # hosts slow enough that 4 of them beat one alone on these links
    return ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth=bandwidth, cpu=0.125),
                       switch=SwitchSpec(cpu=switch_cpu), hosts=[HostSpec(name=f"h{i}") for i in range(4)])


def test_the_planner_sends_int8_through_the_switch_where_it_is_faster_and_says_so(tmp_path):
    """On thin links an uncapped aggregator halves int8's bytes on each host's link (1 against 2(p-1)/p = 1.5
    times its payload): the plan takes it; without a switch in the spec nothing is priced through one."""
    prof = profile(buckets=2)
    plan = plan_for(_switched("20mbit", None), prof, codecs=("none", "int8"))
    assert plan.chosen.collective == "switch" and set(plan.chosen.codecs) == {"int8"}
    assert "int8 through the switch's aggregator" in plan.chosen.name
    assert any(l.startswith("Codec int8 through the switch's aggregator:") for l in plan.explanation)
    assert any("the slowest link to the switch is h0's at 20 Mbit/s" in l for l in plan.explanation), plan.explanation
    ring = [a for a in plan.alternatives if a.collective == "ring" and set(a.codecs) == {"int8"}
            and a.hosts == plan.chosen.hosts and a.shares == plan.chosen.shares]
    assert ring and ring[0].predicted_step_s > plan.chosen.predicted_step_s
    assert plan.chosen.bytes_per_step < ring[0].bytes_per_step
    plain = plan_for(ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="20mbit", cpu=0.5),
                                 hosts=[HostSpec(name=f"h{i}") for i in range(4)]), prof, codecs=("none", "int8"))
    assert all(d.collective != "switch" for d in [plain.chosen, *plain.alternatives])
    back = read_plan(save_plan(plan, tmp_path / "plan.yaml"))
    assert back.chosen.collective == "switch" and back.chosen == plan.chosen
    assert not any("aggregator" in l and "did not measure" in l for l in plan.explanation)  # uncapped: no CPU priced
    capped = plan_for(_switched("20mbit", 0.5), prof, codecs=("none", "int8"))
    assert any("switch's aggregator (0.5 core) is priced from" in l and "did not measure it" in l
               for l in capped.explanation), capped.explanation


def test_a_slow_aggregator_keeps_int8_on_the_ring():
    """The same thin links with an aggregator of a twentieth of a core whose CPU the profile measured:
    4 hosts' 400K-value bucket costs it 42 ms of CPU, 0.84 s at its quota, where the ring's extra bytes cost
    the hosts' links about 80 ms."""
    from thinwire.measure.file import AggregatorRecord

    prof = dataclasses.replace(profile(buckets=2), aggregator=AggregatorRecord(trainers=4, per_bucket_s=0.002,
                                                                               per_value_s=1e-7))
    plan = plan_for(_switched("20mbit", 0.05), prof, codecs=("none", "int8"))
    assert plan.chosen.collective == "ring" and set(plan.chosen.codecs) == {"int8"}
    switched = [a for a in plan.alternatives if a.collective == "switch"]
    assert switched and all(a.predicted_step_s > plan.chosen.predicted_step_s for a in switched)


def test_a_switch_plan_is_checked_and_runs_with_the_aggregator(tmp_path):
    from thinwire.cli.train import _pipeline_from_plan
    from thinwire.plan.planfile import Decision
    from thinwire.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"^codecs: must be an int8 codec with nearest rounding in some bucket"):
        Decision(name="x", hosts=["h0"], shares=[8], micro=[8], collective="switch", codecs=["bf16"],
                 predicted_step_s=0.1)
    with pytest.raises(ConfigError, match=r"^groups: must be none with collective switch"):
        Decision(name="x", hosts=["h0", "h1"], shares=[8, 8], micro=[8, 8], collective="switch", codecs=["int8"],
                 groups=[["h0", "h1"]], predicted_step_s=0.1)
    sw = save_plan(plan_for(_switched("20mbit", None), profile(buckets=2), codecs=("none", "int8")),
                   tmp_path / "sw.yaml")
    ring = save_plan(plan_for(four(), codecs=("none", "int8")), tmp_path / "ring.yaml")
    cfg = TrainConfig(workload="charlm", cluster="spec.yaml", plan=str(sw))
    assert _pipeline_from_plan(cfg).aggregation == "switch"
    assert _pipeline_from_plan(TrainConfig(workload="charlm", cluster="spec.yaml", plan=str(ring))).aggregation == "ring"
    with pytest.raises(ConfigError, match=r"^aggregation: must be ring with a plan whose collective is ring"):
        _pipeline_from_plan(TrainConfig(workload="charlm", cluster="spec.yaml", plan=str(ring), aggregation="switch"))


def test_plan_and_profile_refuse_an_out_that_is_one_of_their_inputs(tmp_path):
    """`plan --out` the spec or the profile replaced it with the plan: refused before anything is measured."""
    import shutil

    from tests.test_cli import assert_refused, thinwire

    spec = tmp_path / "spec.yaml"
    shutil.copy(EXAMPLES / "plan-a-slow-cpu.yaml", spec)
    before = spec.read_bytes()
    assert_refused(thinwire("plan", "--cluster", str(spec), "--out", str(spec)),
                   r"--out: must be a file other than the --cluster input, got '.*spec.yaml'\. writing it would replace")
    assert_refused(thinwire("plan", "--cluster", str(EXAMPLES / "plan-a-slow-cpu.yaml"), "--profile", str(spec),
                            "--out", str(tmp_path / "." / "spec.yaml")), r"other than the --profile input")
    assert_refused(thinwire("profile", "--cluster", str(spec), "--out", str(spec)), r"other than the --cluster input")
    assert spec.read_bytes() == before


def test_a_links_latency_slows_only_the_rings_that_cross_it():
    """Four hosts on a LAN and one behind a 40 ms link: the LAN's ring waits for no 40 ms hop, so the plan keeps
    the LAN hosts (it trained on the far host alone, every LAN ring priced at 40 ms a hop)."""
    from thinwire.plan.planner import host_models, problem
    from thinwire.plan.search import ring_network
    from thinwire.sim import inputs

    lan = [HostSpec(name=f"a{i}", group="lab") for i in range(4)]
    spec = ClusterSpec(name="lat", defaults=DefaultsSpec(bandwidth="1gbit", cpu=1.0),
                       hosts=[*lan, HostSpec(name="far", group="remote")],
                       links=[LinkSpec(between=["lab", "remote"], bandwidth="1gbit", latency="40ms")])
    prof = profile()
    opts = PlanOptions(batch_size=32, codecs=CODECS)
    pb, _ = problem(spec, prof, opts, host_models(spec, prof, opts))
    assert ring_network(pb, [0, 1, 2, 3]).alpha_s == pb.alpha_s
    assert ring_network(pb, [0, 1, 2, 3, 4]).alpha_s == pytest.approx(pb.alpha_s + 0.040)
    sim_lan = inputs.ring_network(spec, spec.hosts[:4], prof).alpha_s
    assert inputs.ring_network(spec, spec.hosts, prof).alpha_s == pytest.approx(sim_lan + 0.040)
    assert "far" not in plan_for(spec).hosts


def test_a_lossy_codec_must_gain_min_gain_to_be_recommended():
    """On one host nothing is sent: every codec's plan takes the same time, and the lightest (none) is recommended,
    not the first codec in alphabetical order (bf16); on fast links a 0.2% gain does not buy int8's rounding."""
    one = ClusterSpec(name="one", defaults=DefaultsSpec(bandwidth="1gbit", cpu=1.0), hosts=[HostSpec(name="h0")])
    plan = plan_for(one)
    assert set(plan.chosen.codecs) == {"none"}, plan.chosen
    fast = ClusterSpec(name="fast", defaults=DefaultsSpec(bandwidth="100gbit", cpu=1.0),
                       hosts=[HostSpec(name=f"h{i}") for i in range(2)])
    plan = plan_for(fast, codecs=("none", "int8"))
    top = plan.chosen
    lossless = [d for d in [plan.chosen, *plan.alternatives] if set(d.codecs) == {"none"}]
    assert set(top.codecs) == {"none"} or top.predicted_step_s < 0.98 * min(d.predicted_step_s for d in lossless)


def test_codecs_with_several_parameters_are_one_codec_each():
    """`--codecs none,int8:block=64,stochastic=true` is two codecs (split at every comma, the second parameter was
    refused as a codec named 'stochastic=true'); a typo is still refused naming it."""
    from thinwire.cli.plan import codec_list

    assert codec_list("int8:block=64,stochastic=true,topk:ratio=0.05,approx=true,bf16") == (
        "none", "int8:block=64,stochastic=true", "topk:ratio=0.05,approx=true", "bf16")
    with pytest.raises(ConfigError, match=r"^--codecs: must be one of .*got .int9."):
        codec_list("none,int9")
    # a codec left out by mistake is not "the default list" (it was: `--codecs ''` planned every codec)
    for text in ("", "none,,int8", "int8,"):
        with pytest.raises(ConfigError, match=r"--codecs: .*Name every codec"):
            codec_list(text)


def test_more_hosts_like_the_best_ones_never_make_the_plan_slower():
    """Where communication costs more than another host's compute saves, the plan keeps fewer of the same hosts:
    a class of identical hosts was taken whole (8 hosts at 20 Mbit/s: 2365 ms per step where one host alone
    takes 218 ms; given 64 more hosts like its two best, a plan took four of them)."""
    def spec(n, bw):
        return ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth=bw, cpu=1.0),
                           hosts=[HostSpec(name=f"h{i}") for i in range(n)])

    alone = plan_for(spec(8, "20mbit"))
    assert alone.chosen.hosts == ["h0"] and alone.chosen.name == "1 host without h1, h2, h3, h4 and 3 more, no communication"
    assert "No compression: one host sends nothing." in alone.explanation
    for bw in ("100mbit", "1gbit"):
        steps = [plan_for(spec(n, bw)).chosen.predicted_step_s for n in (2, 4, 8, 16)]
        assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:])), (bw, steps)
    assert plan_for(spec(16, "100mbit")).chosen.hosts == ["h0", "h1"]


def test_a_host_count_left_out_of_simulate_hosts_is_refused():
    from thinwire.cli.simulate import parse_hosts

    assert parse_hosts("2, 4") == [2, 4]
    for text in ("2,,4", "2,4,", ""):
        with pytest.raises(ConfigError, match=r"--hosts: "):
            parse_hosts(text)


def test_plan_colocated_applies_the_profiles_co_run_speed_as_simulate_does():
    """`--colocated` hosts share cores: simulate slowed them by the profile's measured co-run speed, plan did not."""
    import dataclasses as dc

    from thinwire.plan.planner import host_models
    from thinwire.sim import inputs

    spec = load_cluster_spec(EXAMPLES / "plan-a-slow-cpu.yaml")
    prof = dc.replace(profile(), corun_speed={"2": 0.6, "3": 0.5, "4": 0.45})
    opts = PlanOptions(batch_size=32, codecs=CODECS, colocated_cores=2)
    planned = [h.speed for h in host_models(spec, prof, opts)]
    hosts = inputs.replicate_hosts(spec, len(spec.hosts))
    cores = inputs.host_cores(hosts, threads=prof.threads, colocated_cores=2)
    simulated = inputs.host_speeds(cores, profile_threads=prof.threads, threads=prof.threads, profile=prof,
                                   colocated_cores=2)
    assert planned == pytest.approx(simulated)
    alone = [h.speed for h in host_models(spec, prof, PlanOptions(batch_size=32, codecs=CODECS))]
    assert all(a < b for a, b in zip(planned, alone)), (planned, alone)


def test_the_slowest_ring_edge_is_named_by_what_limits_it():
    """An edge across two groups is limited by both access links and its share of the link between: a 10 Mbit/s
    access link behind a 50 Mbit/s group link is the access link (it was named the group link, at 10 Mbit/s)."""
    from thinwire.plan.explain import ring_bottleneck
    from thinwire.plan.search import HostModel, Problem

    def hosts(slow_access: float):
        return [HostModel("h0", "A", 1, 1, 100e6), HostModel("h1", "A", 1, 1, 100e6),
                HostModel("h2", "B", 1, 1, slow_access), HostModel("h3", "B", 1, 1, 100e6)]

    def words(slow_access: float, link: float) -> str:
        pb = Problem(hosts=hosts(slow_access), buckets=[], compute=None, codecs={}, links={frozenset("AB"): link},
                     alpha_s=0.0, efficiency=1.0, batch=4)
        return ring_bottleneck(pb, (0, 1, 2, 3))

    assert words(10e6, 50e6) == "the access link of h2 at 10 Mbit/s (h1 -> h2)"
    assert words(100e6, 50e6).startswith("the A-B link at 50 Mbit/s")


def test_compute_below_the_smallest_measured_batch_is_at_least_in_proportion_to_it():
    """Superlinear points (15 / 37 / 90 ms at 16 / 32 / 64) fit a line with a negative intercept: 8 samples were
    priced at 1.6 ms and 4 at 0.5 (the optimizer only), so the planner spread a batch over many hosts for free."""
    from thinwire.sim.inputs import compute_line

    prof = dataclasses.replace(profile(), compute=[
        ComputePoint(batch=b, pre_s=f / 3, backward_s=2 * f / 3, post_s=0.001) for b, f in ((16, 0.015), (32, 0.037),
                                                                                             (64, 0.090))])
    at16, at8, at4 = (compute_line(prof, b) for b in (16, 8, 4))
    assert at8.pre_s + at8.backward_s >= 0.5 * (at16.pre_s + at16.backward_s) * 0.999
    assert at4.pre_s + at4.backward_s >= 0.25 * (at16.pre_s + at16.backward_s) * 0.999
    at48 = compute_line(prof, 48)  # inside the measured range: the line itself
    assert 0.05 < at48.pre_s + at48.backward_s < 0.07


def test_a_plan_is_for_its_clusters_offload_engines_switch_and_loss_too():
    """Specs that differ in nic:, switch: or a link's loss had one fingerprint: a plan made for one was taken on the
    other, where the planner would have chosen otherwise. Specs without them keep the fingerprints of plans made
    before (a committed plan's)."""
    import yaml

    from thinwire.cluster.spec import NicSpec, SwitchSpec
    from thinwire.plan.planfile import cluster_fingerprint

    committed = yaml.safe_load((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "plan_eval" /
                                "plan-a.yaml").read_text())
    assert committed["cluster_fingerprint"] == cluster_fingerprint(load_cluster_spec(EXAMPLES / "plan-a-slow-cpu.yaml"))
    base = four()
    nic = dataclasses.replace(base, hosts=[dataclasses.replace(h, nic=NicSpec(cpu=0.25)) for h in base.hosts])
    switch = dataclasses.replace(base, switch=SwitchSpec(cpu=0.5))
    assert len({cluster_fingerprint(s) for s in (base, nic, switch)}) == 3
