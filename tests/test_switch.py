"""Switch aggregation (thinwire.compress.switch): trainers send int8 at agreed block scales to an aggregator
rank, which sums them exactly and returns the re-encoded sum; against the exact sum and the ring's int8
(the Decoded scheme, compressed reduce-scatter + all-gather) on 2, 3 and 4 trainers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from thinwire.compress import switch
from thinwire.compress.codecs.common import n_blocks


def _inputs(rank: int, n: int, calls: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g) * (1 + 10 * rank) for _ in range(calls)]  # scales differ by rank


def _switch_and_ring(rank: int, world: int, n: int, calls: int) -> dict:
    from thinwire.compress.hook import CommState, StaticPolicy
    from thinwire.compress.schemes import scheme_for
    from thinwire.compress.schemes.base import BucketJob
    from thinwire.compress.spec import parse_codec_spec

    p = world - 1
    trainers = dist.new_group(list(range(p)))  # every rank takes part in creating it
    if rank == p:
        return {"served": switch.serve(dist.group.WORLD, list(range(p)))}
    port = switch.SwitchPort(dist.group.WORLD, aggregator=p)
    codec = parse_codec_spec("int8")
    state = CommState(StaticPolicy(codec), error_feedback=True, warmup_steps=0, min_compress_bytes=0,
                      nonfinite="skip", group=trainers)
    out = {"switch": [], "sent": [], "ring": [], "x": []}
    for step, x in enumerate(_inputs(rank, n, calls)):
        total, sent = port.all_reduce(x, key=7)
        buf = x.clone()
        ring, _ = scheme_for(codec).run(BucketJob(key="0", buf=buf, step=step, shapes=[(n,)], layout=((0, n),),
                                                  codec=codec, state=state))
        out["switch"].append(total)
        out["sent"].append(sent)
        out["ring"].append(ring.clone())
        out["x"].append(x)
    port.close()
    out["bytes"] = port.bytes_sent
    return out


@pytest.mark.parametrize("p,n", [(2, 1000), (3, 1000), (4, 1000), (3, 200_000)])  # 200k: 4 chunks, the last short
def test_switch_sum_is_exact_before_its_one_rounding_and_agrees_with_the_ring(p, n):
    calls = 3
    results = run_ranks(_switch_and_ring, p + 1, n, calls)
    trainers, agg = results[:p], results[p]
    assert agg["served"] == calls
    for c in range(calls):
        for r in trainers[1:]:  # every trainer gets the same bytes
            assert torch.equal(r["switch"][c], trainers[0]["switch"][c])
        exact = sum(r["x"][c] for r in trainers)
        sent = sum(r["sent"][c] for r in trainers)  # what the aggregator summed, exactly
        # one value per block: the agreed scale (uplink) and the re-encoded sum's scale (downlink)
        blocks = torch.nn.functional.pad(exact, (0, n_blocks(n, 256) * 256 - n)).view(-1, 256)
        up = torch.stack([r["x"][c] for r in trainers]).abs().amax(0)
        up = torch.nn.functional.pad(up, (0, blocks.numel() - n)).view(-1, 256).amax(1).repeat_interleave(256)[:n] / 127
        down = blocks.abs().amax(1).repeat_interleave(256)[:n] / 127
        assert ((sent - exact).abs() <= p * up / 2 * 1.0001).all()
        if c == 0:  # no residual yet on the aggregator: one rounding of the exact int sum
            assert ((trainers[0]["switch"][0] - sent).abs() <= (down + p * up / 2) / 2 * 1.001 + 1e-6).all()
        ring = trainers[0]["ring"][c]
        err_switch = (trainers[0]["switch"][c] - exact).abs().mean()
        err_ring = (ring - exact).abs().mean()
        # the same quantization, a different order of roundings: comparable errors, far below the signal
        assert err_switch < 2 * err_ring + 1e-6 and err_switch < 0.02 * exact.abs().mean()
    # bytes up: header, maxima + flag, int8 values (no scales: they are agreed)
    assert trainers[0]["bytes"] == calls * switch.bytes_up(n)


def _nonfinite(rank: int, world: int) -> dict:
    p = world - 1
    if rank == p:
        return {"served": switch.serve(dist.group.WORLD, list(range(p)))}
    port = switch.SwitchPort(dist.group.WORLD, aggregator=p)
    x = torch.ones(300)
    if rank == 1:
        x[5] = float("inf")
    total, _ = port.all_reduce(x)
    after, _ = port.all_reduce(torch.ones(300))  # the protocol stays in step after a skipped payload
    small, _ = port.all_reduce(torch.arange(300.0) * (rank + 1), key=1, block=64)  # int8:block=64's buckets
    port.close()
    return {"nan": bool(total.isnan().all()), "after": after, "small": small}


def test_a_nonfinite_gradient_on_one_trainer_makes_every_result_nan_and_the_next_bucket_works():
    results = run_ranks(_nonfinite, 4)
    assert all(r["nan"] for r in results[:3])
    assert all(torch.allclose(r["after"], torch.full((300,), 3.0)) for r in results[:3])
    assert results[3]["served"] == 2  # the non-finite bucket's payload was skipped
    exact = torch.arange(300.0) * 6  # 1 + 2 + 3 trainers' multiples
    assert all(torch.allclose(r["small"], exact, atol=float(exact.max()) / 127) for r in results[:3])


def _idle(rank: int, world: int) -> dict:
    import datetime
    import time

    p = world - 1
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=1))
    if rank == p:
        return {"served": switch.serve(group, list(range(p)))}
    port = switch.SwitchPort(group, aggregator=p)
    first, _ = port.all_reduce(torch.ones(300))
    time.sleep(2.5)  # idle for longer than the group's timeout: a validation pass, a checkpoint
    second, _ = port.all_reduce(torch.ones(300) * 2)
    port.close()
    return {"first": first, "second": second}


def test_the_aggregator_waits_out_trainers_that_idle_longer_than_the_timeout():
    results = run_ranks(_idle, 3, timeout=60)
    assert results[2]["served"] == 2
    for r in results[:2]:  # the sum, to int8's rounding
        assert torch.allclose(r["first"], torch.full((300,), 2.0), atol=2 / 127)
        assert torch.allclose(r["second"], torch.full((300,), 4.0), atol=4 / 127)


def _mismatch(rank: int, world: int) -> str:
    p = world - 1
    if rank == p:
        try:
            switch.serve(dist.group.WORLD, list(range(p)))
        except Exception as e:  # noqa: BLE001
            return str(e)
        return "served"
    port = switch.SwitchPort(dist.group.WORLD, aggregator=p)
    try:
        port.all_reduce(torch.ones(100 + rank))  # different bucket sizes: lost step
    except Exception:  # noqa: BLE001 - the aggregator stopped answering
        pass
    return "trainer"


def test_trainers_out_of_step_are_an_error_naming_both():
    msg = run_ranks(_mismatch, 3, timeout=60)[2]
    assert "rank 1" in msg and "rank 0" in msg and "lost step" in msg, msg


def test_train_config_refuses_what_the_switch_cannot_sum():
    from thinwire.errors import ConfigError
    from thinwire.train.config import TrainConfig

    ok = dict(workload="digits", cluster="spec.yaml", compression="int8", aggregation="switch")
    assert TrainConfig(**ok).aggregation == "switch"
    assert TrainConfig(**{**ok, "compression": "int8:block=64"}).comm.codec.config.block == 64
    assert TrainConfig(**{**ok, "compression": "auto"}).aggregation == "switch"  # int8 is a default candidate
    cases = [({"cluster": None}, r"^cluster: must be a cluster spec with --aggregation switch"),
             ({"compression": "auto:candidates=none|bf16"}, r"^compression: must be int8 .*, or auto with int8 among"),
             ({"compression": "bf16"}, r"^compression: must be int8 \(8 bits, nearest rounding, any block\), or auto with int8 among its candidates, with --aggregation switch"),
             ({"compression": "int8:stochastic=true"}, r"^compression: must be int8"),
             ({"compression": "int8:bits=4"}, r"^compression: must be int8 \(8 bits"),
             ({"sync": "delayed"}, r"^sync: must be allreduce with --aggregation switch"),
             ({"min_hosts": 2, "max_restarts": 1}, r"^min_hosts: must be left out with --aggregation switch"),
             ({"aggregation": "tree"}, r"^aggregation: must be ring or switch, got 'tree'")]
    for change, match in cases:
        with pytest.raises(ConfigError, match=match):
            TrainConfig(**{**ok, **change})


def test_the_model_prices_the_switch_as_the_hook_sends_it():
    from thinwire.compress.schemes import traffic
    from thinwire.compress.spec import parse_codec_spec
    from thinwire.perf import collectives as coll
    from thinwire.perf.model import Network, bucket_cost
    from thinwire.sim.inputs import codec_model

    codec, n, p = parse_codec_spec("int8"), 1_000_000, 8
    ring, sw = traffic(codec, n, p), traffic(codec, n, p, switch=True)
    assert sw.scheme == "switch" and sw.bytes_sent == switch.bytes_up(n)      # what Switched.run counts
    assert ring.bytes_sent / sw.bytes_sent == pytest.approx(2 * (p - 1) / p, rel=0.02)
    assert traffic(parse_codec_spec("bf16"), n, p, switch=True).scheme == "summable"  # only int8 goes to the switch
    beta = 8 / 100e6
    net = Network(alpha_s=1e-3, beta_s_per_byte=beta)
    ring_s = bucket_cost(codec_model("int8", None), 0, n, p, net).comm_s
    switch_s = bucket_cost(codec_model("int8", None, switch=True), 0, n, p, net).comm_s
    assert switch_s == pytest.approx(4e-3 + (sw.bytes_sent + coll.SWITCH_CHUNK_BYTES) * beta)
    assert 1.6 < ring_s / switch_s < 1.8  # bandwidth-bound at 8 hosts: 2(p-1)/p = 1.75 fewer bytes each way
    assert coll.SWITCH_CHUNK_BYTES == switch.CHUNK_BYTES


def test_a_slow_aggregator_is_priced_by_its_cores():
    """With ``switch: {cpu: C}`` the bucket lasts the longer of the wire and the aggregator's work at C
    cores: p hosts' bytes through the transport, p payloads added, the sum re-encoded with feedback."""
    import dataclasses

    from thinwire.perf.model import LinearCost, Network, aggregator_s, bucket_cost
    from thinwire.sim.inputs import codec_model

    n, p = 1_000_000, 4
    per = LinearCost(per_byte_s=1e-9)  # each kernel 1 ns per fp32 byte
    cm = dataclasses.replace(codec_model("int8", None, switch=True), add=per, decode=per, feedback=per, encode=per)
    fast = Network(alpha_s=1e-4, beta_s_per_byte=8 / 1e9, cpu_s_per_byte=2e-9)
    size = switch.bytes_up(n)
    assert aggregator_s(cm, n, size, p, fast) == 0.0  # no cap given: it keeps up
    slow = dataclasses.replace(fast, switch_speed=0.25)
    work = (p + 2 + 1 + 1) * 4 * n * 1e-9 + p * size * 2e-9
    assert aggregator_s(cm, n, size, p, slow) == pytest.approx(work / 0.25)
    # slower than the 1 Gbit/s wire: the aggregator's work, with one chunk up before it and one down after
    # (the last chunk is the part left over: (size - (k-1) chunk) on its way up)
    k = -(-size // switch.CHUNK_BYTES)
    ends = (size - (k - 1) * switch.CHUNK_BYTES + switch.CHUNK_BYTES) * 8 / 1e9
    assert bucket_cost(cm, 0, n, p, slow).comm_s == pytest.approx(4e-4 + ends + work / 0.25)
    assert bucket_cost(cm, 0, n, p, fast).comm_s < work / 0.25 / 4


def test_an_aggregator_slower_or_faster_than_the_link_lags_the_wire_by_the_chunk_pipeline():
    """k chunks through three stages (up, the aggregator, down): u + a + u + (k-1) max(u, a)."""
    from thinwire.perf.model import Network, aggregator_lag_s

    net = Network(alpha_s=0.0, beta_s_per_byte=1e-9)
    size = 4 * switch.CHUNK_BYTES                                   # k = 4 chunks, u = 65.5 us each
    u = switch.CHUNK_BYTES * 1e-9
    assert aggregator_lag_s(0.0, size, net) == 0.0
    assert aggregator_lag_s(4 * 0.5 * u, size, net) == pytest.approx(0.5 * u)       # the link is the slower stage
    agg = 4 * 3 * u                                                  # the aggregator is: 3u per chunk
    assert aggregator_lag_s(agg, size, net) == pytest.approx(3 * u + 3 * (3 * u - u))
    wire = (size + switch.CHUNK_BYTES) * 1e-9                       # switch_s at alpha 0: k u + u
    assert wire + aggregator_lag_s(agg, size, net) == pytest.approx(u + agg + u)
    assert aggregator_lag_s(agg, 1000, net) == pytest.approx(agg)  # one chunk: up, its sum, down


def test_simulate_takes_the_switch_for_int8_only():
    from thinwire.errors import ConfigError
    from thinwire.sim.sweep import SimOptions

    assert SimOptions(codec="int8:block=64", aggregation="switch").aggregation == "switch"
    with pytest.raises(ConfigError, match=r"^--compression: must be int8 \(nearest rounding\) with --aggregation switch, got 'bf16'"):
        SimOptions(codec="bf16", aggregation="switch")
    with pytest.raises(ConfigError, match=r"^--aggregation: must be ring or switch"):
        SimOptions(codec="int8", aggregation="tree")


def test_switch_bench_builds_a_valid_spec_and_prices_the_wire(tmp_path):
    import sys as _sys

    from thinwire.cluster.spec import load_cluster_spec

    _sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "benchmarks"))
    import switch_bench

    path = tmp_path / "s.yaml"
    path.write_text(switch_bench.spec_text(8, "100mbit", 0.5))
    spec = load_cluster_spec(path)
    assert len(spec.hosts) == 8 and spec.switch.cpu == 0.5 and spec.hosts[0].cpu is None
    ring, sw = (switch_bench.wire_s(8 << 20, 8, 1e8, s) for s in (False, True))
    assert ring / sw == pytest.approx(1.75, rel=0.02)  # 2(p-1)/p of the payload against once


def test_switch_cpu_bench_reports_the_aggregators_cost(capsys):
    import sys

    from tests.test_cli import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import switch_cpu

    assert switch_cpu.main(["--numel", "5000", "--trainers", "2", "--calls", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "aggregator:" in out and "ms CPU per bucket" in out and "0.25-core quota" in out
    assert switch_cpu.tensor_work_s(5000, 2, reps=2) > 0


def _routed(rank: int, world: int) -> dict:
    """A policy that sends bucket 0's int8 through the switch and bucket 1's around the ring."""
    from thinwire.compress.hook import CommState, Policy
    from thinwire.compress.spec import parse_codec_spec

    class ByBucket(Policy):
        def codec_for(self, bucket, numel, step):
            return parse_codec_spec("int8")

        def via_switch(self, bucket):
            return bucket == 0

        def describe(self):
            return "int8, bucket 0 through the switch"

    p = world - 1
    trainers = dist.new_group(list(range(p)))
    if rank == p:
        return {"served": switch.serve(dist.group.WORLD, list(range(p)))}
    state = CommState(ByBucket(), error_feedback=True, warmup_steps=0, min_compress_bytes=0, nonfinite="skip",
                      group=trainers)
    state.switch = switch.SwitchPort(dist.group.WORLD, aggregator=p)
    out = [state.send(torch.full((1000,), float(rank + 1)) * p, i, 0, [(1000,)], ((i, 1000),)).wait() for i in (0, 1)]
    calls = state.switch.calls
    state.close()
    return {"out": out, "calls": calls}


def test_a_policy_routes_each_int8_bucket_through_the_switch_or_around_the_ring():
    results = run_ranks(_routed, 3, timeout=60)
    assert results[2]["served"] == 1  # bucket 0 only
    for r in results[:2]:
        assert r["calls"] == 1
        for out in r["out"]:  # the mean of 1 and 2, by either route
            assert torch.allclose(out, torch.full((1000,), 3.0), atol=3 / 127)


def test_auto_sends_int8_through_the_switch_where_it_pays_and_around_the_ring_once_the_switch_is_timed_slow():
    """With an aggregator on the switch, auto's candidates include int8 through it (``int8@switch``), first
    priced from the link's pace (the aggregator taken to keep up), then from the switch's as timed; without
    one, int8 goes around the ring as before."""
    from types import SimpleNamespace

    from thinwire.auto import AutoConfig, AutoPolicy
    from thinwire.auto.agree import Measurements

    link = 8 / 20e6  # 20 Mbit/s

    def window(step_s, switch_beta=None):
        return Measurements(alpha=1e-4, beta=link, pre_s=0.02, backward_s=0.04, step_s=step_s, errors={0: 0.01},
                            shadow={0: {"bf16": 0.002, "int8": 0.01}}, window=[step_s] * 5, switch_beta=switch_beta)

    def policy_seeing(windows, port):
        policy = AutoPolicy(AutoConfig(warmup_steps=1, baseline_steps=0, check_every=1,
                                       candidates=("none", "bf16", "int8")))
        policy.numels, policy.costs = {0: 400_000}, {"bf16": (1e-10, 1e-11), "int8": (1e-9, 1e-10)}
        policy._state = SimpleNamespace(wire=SimpleNamespace(world=4), switch=port)
        seen = iter(windows)
        policy._measured = lambda: None  # _agree below stands in for every rank's merged record
        policy._agree = lambda measured: lambda: next(seen)
        for step in range(1, 1 + len(windows)):
            policy._check(step)
            policy.sent(0, step)
            policy._conclude(step + 1)
        return policy

    port = SimpleNamespace(bytes_sent=0, all_reduce=lambda *a, **k: None)
    # 4 hosts: the switch sends 1.5x fewer bytes than int8's ring: chosen; the clock keeps it
    kept = policy_seeing([window(0.4), window(0.2)], port)
    assert kept.choices == {0: "int8@switch"}, kept.decisions
    assert kept.via_switch(0) and kept.codec_for(0, 400_000, 9).name == "int8"
    # then timed at a quarter of the link's pace (a slow aggregator): decided again, int8 around the ring
    slow = policy_seeing([window(0.4), window(0.2), window(0.2, switch_beta=4 * link)], port)
    assert [d["reason"].split(":")[0] for d in slow.decisions] == ["warm-up done", "kept", "the switch timed"]
    assert slow.choices == {0: "int8"} and not slow.via_switch(0)
    # timed as fast as it was priced: no change
    fine = policy_seeing([window(0.4), window(0.2), window(0.2, switch_beta=link)], port)
    assert fine.choices == {0: "int8@switch"} and len(fine.decisions) == 3
    # no aggregator: int8 around the ring
    ring = policy_seeing([window(0.4), window(0.2)], None)
    assert ring.choices == {0: "int8"} and not ring.via_switch(0)


def test_auto_moves_to_the_switch_when_the_two_moves_together_pay_though_the_second_alone_would_not():
    """From bf16, int8 around the ring is predicted 20% faster and int8 through the switch 7% faster again:
    a search that asked every move for min_gain stopped at int8; the plan found is held to min_gain once,
    against the plan in use."""
    from thinwire.auto.agree import Measurements
    from thinwire.auto.decide import Guards, decide

    m = Measurements(alpha=1e-4, beta=8 / 93e6, pre_s=0.05, backward_s=0.1, step_s=0.2, errors={0: 0.01},
                     shadow={0: {"bf16": 0.002, "int8": 0.01}}, window=[0.2] * 5)
    args = dict(numels={0: 450_000}, shapes={}, candidates=("none", "bf16", "int8"), shared=m, world=4,
                costs={"bf16": (1e-10, 1e-11), "int8": (1e-9, 1e-10)}, guards=Guards(banned={}, tried={}, max_error=0.1))
    choices, d = decide(plan={0: "bf16"}, min_gain=0.1, switch=True, **args)
    assert choices == {0: "int8@switch"} and d.step_s < 0.9 * d.initial_s
    # from int8 the switch alone is not 10% faster: the plan in use stays
    assert decide(plan={0: "int8"}, min_gain=0.1, switch=True, **args)[0] == {0: "int8"}
