"""The performance model: formulas against hand-computed values, monotonicity, the overlap timeline on
constructed cases, bytes priced exactly as the hook sends them, and the profile/simulate commands."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import math
import os
import statistics
import types
from pathlib import Path

import pytest
import yaml

from thinwire.perf import collectives as coll
from thinwire.perf.devices import DEVICES, get_device
from thinwire.perf.energy import J_PER_BIT_INTERNET, run_energy, step_energy
from thinwire.perf.memory import memory_per_rank, residual_values, transformer_activation_bytes
from thinwire.perf.model import Bucket, CodecModel, Compute, LinearCost, Network, Traffic, bucket_cost, predict_step
from thinwire.perf.straggler import blom_z, colocated_speeds, corun_factor, cpu_shares, expected_max_normal, slowest_time
from thinwire.perf.timeline import ddp_bucket_assignment, overlap_timeline

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
BETA_100M = 8 / 100e6  # seconds per byte at 100 Mbit/s


# ---- collectives ------------------------------------------------------------------------------------

def test_ring_allreduce_by_hand():
    # 4 ranks, 8 MB, 1 ms latency, 100 Mbit/s: 6 * 1e-3 + 1.5 * 8e6 * 8e-8 = 0.006 + 0.96
    assert coll.ring_allreduce_s(8 * MB, 4, alpha=1e-3, beta=BETA_100M) == pytest.approx(0.966)
    assert coll.ring_allreduce_bytes(8 * MB, 4) == pytest.approx(12 * MB)
    assert coll.ring_allreduce_s(8 * MB, 1, alpha=1e-3, beta=BETA_100M) == 0.0


def _fake(name: str, payload) -> CodecModel:
    """The model of codec ``name`` (its traits and scheme) with ``payload`` as its payload size."""
    from thinwire.compress.spec import codec_class
    from thinwire.sim.inputs import codec_model

    cls = codec_class(name)
    fake = type(f"Fake{cls.__name__}", (cls,), {"payload_bytes": lambda self, n, dtype=None: payload(n)})
    return codec_model(fake(cls.config_cls()), None)


def test_other_collectives_by_hand():
    a, b = 1e-3, BETA_100M
    assert coll.reduce_scatter_s(8 * MB, 4, alpha=a, beta=b) == pytest.approx(3e-3 + 0.48)
    assert coll.allgather_s(1 * MB, 4, alpha=a, beta=b) == pytest.approx(3e-3 + 3 * 0.08)
    assert coll.alltoall_s(8 * MB, 4, alpha=a, beta=b) == pytest.approx(3e-3 + 0.48)
    # power of two: 2 log2(8) alpha + 2 * 7/8 * n * beta
    assert coll.halving_doubling_allreduce_s(8 * MB, 8, alpha=a, beta=b) == pytest.approx(6e-3 + 1.12)
    # p = 6: the 4-rank core plus two exchanges of n
    assert coll.halving_doubling_allreduce_s(8 * MB, 6, alpha=a, beta=b) == pytest.approx(
        4e-3 + 0.96 + 2 * (a + 0.64))
    # 2 groups of 4: 2*(3/4)*8MB at 1 Gbit/s inside, 2*(1/2)*(2 MB) at 100 Mbit/s between
    h = coll.hierarchical_allreduce_s(8 * MB, 4, 2, alpha_in=0, beta_in=8e-9, alpha_out=0, beta_out=b)
    assert h == pytest.approx(1.5 * 8e6 * 8e-9 + 1.0 * 2e6 * b)
    # parameter server: 4 hosts at 100 Mbit/s, server at 1 Gbit/s -> host links are the bottleneck
    assert coll.parameter_server_s(1 * MB, 4, alpha=0, beta_host=b, beta_server=8e-9) == pytest.approx(0.08)
    assert coll.parameter_server_s(1 * MB, 40, alpha=0, beta_host=b, beta_server=8e-9) == pytest.approx(0.32)


def test_slowest_link_sets_the_ring_pace():
    rates = coll.ring_edge_rates([1e9, 1e9, 50e6, 1e9], ["a"] * 4, {})
    assert rates == [1e9, 50e6, 50e6, 1e9]
    assert coll.ring_beta(rates) == pytest.approx(8 / 50e6)
    # two groups joined by a 50 Mbit/s link: one ring edge crosses it each way
    rates = coll.ring_edge_rates([100e6, 100e6, 20e6], ["A", "A", "B"], {frozenset({"A", "B"}): 50e6})
    assert rates == [100e6, 20e6, 20e6]
    # the ring crosses A->B twice in an interleaved order: the link is shared by two edges each way
    rates = coll.ring_edge_rates([1e9] * 4, ["A", "B", "A", "B"], {frozenset({"A", "B"}): 100e6})
    assert rates == [50e6] * 4


@pytest.mark.parametrize("p", [2, 3, 8, 64, 1024])
def test_more_bandwidth_never_predicts_slower(p):
    times = [coll.ring_allreduce_s(10 * MB, p, alpha=1e-4, beta=8 / r) for r in (10e6, 50e6, 1e8, 1e9, 1e10)]
    assert times == sorted(times, reverse=True)
    steps = [_step(p, rate).step_s for rate in (10e6, 50e6, 1e8, 1e9, 1e10)]
    assert all(a >= b for a, b in zip(steps, steps[1:]))


def test_more_hosts_never_shrink_ring_bytes_per_rank():
    per_rank = [coll.ring_allreduce_bytes(10 * MB, p) for p in range(1, 1025)]
    assert all(a <= b for a, b in zip(per_rank, per_rank[1:]))
    codec = _fake("none", lambda n: 4 * n)
    net = Network(alpha_s=0.0, beta_s_per_byte=BETA_100M)
    sent = [bucket_cost(codec, 0, 1_000_000, p, net).bytes_sent for p in range(1, 300)]
    assert all(a <= b for a, b in zip(sent, sent[1:]))


# ---- timeline ---------------------------------------------------------------------------------------

def test_bucket_assignment_follows_ddp():
    mib = 2**20
    assert ddp_bucket_assignment([mib // 2, mib // 2, 10]) == [[0, 1], [2]]  # first bucket closes at 1 MiB
    assert ddp_bucket_assignment([30 * mib, 1, 26 * mib, 5], first_cap=25 * mib) == [[0], [1, 2], [3]]
    assert ddp_bucket_assignment([]) == []
    with pytest.raises(ValueError, match="bucket caps must be > 0 bytes"):
        ddp_bucket_assignment([1], cap=0)


def test_timeline_fully_hidden_and_fully_exposed():
    hidden = overlap_timeline(ready_s=[0.1, 0.2], comm_s=[0.05, 0.05], backward_s=0.3, pre_s=0.1, post_s=0.02)
    assert hidden.exposed_comm_s == 0.0
    assert hidden.step_s == pytest.approx(0.1 + 0.3 + 0.02)
    # one bucket ready at the very end: all of its communication is exposed
    exposed = overlap_timeline(ready_s=[0.3], comm_s=[0.2], backward_s=0.3, encode_s=[0.01], decode_s=[0.02])
    assert exposed.exposed_comm_s == pytest.approx(0.23)
    assert exposed.step_s == pytest.approx(0.53)


def test_timeline_link_busy_delays_the_next_bucket():
    # bucket 1 is ready at 0.2 but the link is busy with bucket 0 until 0.1 + 0.3
    t = overlap_timeline(ready_s=[0.1, 0.2, 0.25], comm_s=[0.3, 0.1, 0.1], backward_s=0.25)
    assert [b.start_s for b in t.buckets] == pytest.approx([0.1, 0.4, 0.5])
    assert t.last_done_s == pytest.approx(0.6)
    assert t.exposed_comm_s == pytest.approx(0.35)


def test_codec_work_on_a_busy_core_pushes_backward_back():
    # encode of bucket 0 (0.05 s) runs at 0.1 while backward lasts until 0.3: one core, so backward ends at 0.35
    t = overlap_timeline(ready_s=[0.1, 0.3], comm_s=[0.01, 0.01], encode_s=[0.05, 0.0], backward_s=0.3,
                         codec_steals_compute=True)
    assert t.backward_s == pytest.approx(0.35)
    assert t.buckets[1].ready_s == pytest.approx(0.35)
    free = overlap_timeline(ready_s=[0.1, 0.3], comm_s=[0.01, 0.01], encode_s=[0.05, 0.0], backward_s=0.3)
    assert free.backward_s == pytest.approx(0.3)


def test_a_collective_issued_during_backward_waits_for_the_quota_only_until_backward_ends():
    # bucket 0 starts at 0.1 of a 0.3 s backward: its 0.05 s of hop waits all fall inside backward;
    # bucket 1 starts at 0.25 with 0.2 s of waits, of which only the 0.05 s before backward ends count;
    # bucket 2 goes out after backward: the host is idle, no wait
    t = overlap_timeline(ready_s=[0.1, 0.25, 0.3], comm_s=[0.02, 0.02, 0.02], backward_s=0.3,
                         busy_wait_s=[0.05, 0.2, 0.2])
    assert [b.comm_s for b in t.buckets] == pytest.approx([0.07, 0.07, 0.02])
    plain = overlap_timeline(ready_s=[0.1, 0.25, 0.3], comm_s=[0.02, 0.02, 0.02], backward_s=0.3)
    assert t.step_s == pytest.approx(plain.step_s + 0.02)  # bucket 1 ends at 0.32 (not 0.27), bucket 2 at 0.34
    with pytest.raises(ValueError, match="busy_wait_s needs one entry per bucket"):
        overlap_timeline(ready_s=[0.1], comm_s=[0.1], backward_s=0.2, busy_wait_s=[0.1, 0.1])


def test_the_quota_wait_counts_each_collectives_ring_hops():
    from thinwire.perf.model import ring_hops

    assert [ring_hops("all-reduce", 4), ring_hops("all-gather", 4), ring_hops("all-to-all", 3)] == [6, 3, 2]
    gather = lambda index, numel, p: Traffic(scheme="q", collectives=(("all-to-all", numel), ("all-gather", numel)),
                                             bytes_sent=numel)
    codec = CodecModel(name="q", traffic=gather)
    net = Network(alpha_s=0.0, beta_s_per_byte=1e-9, busy_hop_s=0.001)
    assert bucket_cost(codec, 0, 1000, 4, net).hops == 6
    pred = predict_step(buckets=[Bucket(numel=1000, ready_frac=0.5)], compute=Compute(pre_s=0.0, backward_s=0.2, post_s=0.0),
                        speeds=[1.0] * 4, network=net, codec=codec)
    idle = predict_step(buckets=[Bucket(numel=1000, ready_frac=0.5)], compute=Compute(pre_s=0.0, backward_s=0.2, post_s=0.0),
                        speeds=[1.0] * 4, network=Network(alpha_s=0.0, beta_s_per_byte=1e-9), codec=codec)
    assert pred.timeline.buckets[0].comm_s == pytest.approx(idle.timeline.buckets[0].comm_s + 0.006)


def test_timeline_rejects_inconsistent_input():
    with pytest.raises(ValueError, match="one entry per bucket"):
        overlap_timeline(ready_s=[0.1], comm_s=[0.1, 0.2], backward_s=0.2)
    with pytest.raises(ValueError, match=r"ready times must lie in \[0, backward_s"):
        overlap_timeline(ready_s=[0.5], comm_s=[0.1], backward_s=0.2)


# ---- stragglers, memory, energy, devices ------------------------------------------------------------

def test_stragglers_and_cpu_shares():
    assert cpu_shares([1.0, 1.0, 1.0, 1.0], 2) == [0.5] * 4
    assert cpu_shares([1.0, 1.0], 2) == [1.0, 1.0]
    assert cpu_shares([1.0, 0.25, 1.0], 2) == [0.875, 0.25, 0.875]
    assert cpu_shares([None, 0.5], 4) == [3.5, 0.5]
    assert slowest_time(1.0, [1.0, 0.25, 0.875]) == 4.0
    # busy cores run slower than one alone (measured co-run speed): only when more than one is busy
    assert colocated_speeds([1.0, 1.0], 2, {2: 0.8}) == pytest.approx([0.8, 0.8])
    assert corun_factor([0.5] * 4, 2, {2: 0.8}) == 0.8 and corun_factor([1.0], 2, {2: 0.8}) == 1.0
    # more hosts than cores, filling them: they time-share, priced by the measurement for that many
    measured = {2: 0.95, 3: 0.85, 4: 0.8}
    assert corun_factor([0.5] * 4, 2, measured) == 0.8 and corun_factor([0.5] * 6, 3, measured) == 0.8
    assert corun_factor([0.875, 0.25, 0.875], 2, measured) == 0.85
    assert corun_factor([0.5, 0.5], 2, measured) == 1.0  # capped hosts leaving a core idle: nobody time-shares
    assert corun_factor([1.0, 1.0], 2, measured) == 0.95 and corun_factor([0.4] * 5, 4, measured) == 0.95  # capped, 2 of 4 cores busy
    # two single-thread hosts on more cores keep two busy, not their fair shares' worth: more cores is not slower
    from thinwire.sim.inputs import host_speeds

    prof = types.SimpleNamespace(corun_speed={"2": 0.9, "3": 0.8, "4": 0.7})
    got = [host_speeds(cpu_shares([None, None], c), profile_threads=1, threads=1, profile=prof, colocated_cores=c)
           for c in (2, 4, 16)]
    assert got == [[0.9, 0.9]] * 3, got
    assert blom_z(1) == 0.0
    z = [blom_z(p) for p in (2, 8, 64, 1024)]
    assert z == sorted(z) and 3.0 < z[-1] < 3.3  # the expected max of 1024 normals is ~3.2 sigma
    assert expected_max_normal(1.0, 0.0, 1000) == 1.0


def test_memory_by_hand():
    m = memory_per_rank(1000, optimizer="adamw", residual_values=1000, activation_bytes=500)
    assert (m.params, m.grads, m.optimizer, m.buckets, m.residuals, m.activations) == (4000, 4000, 8000, 4000, 4000, 500)
    assert memory_per_rank(1000, optimizer="sgd", gradient_as_bucket_view=True).total == 8000
    assert residual_values([100, 10], compressed=True, p=4, reduced_chunk=True) == 110 + 25 + 3
    assert residual_values([100], compressed=False, p=4, reduced_chunk=True) == 0
    # Korthikanti et al.: s b h (34 + 5 a s / h) bytes per layer with 2-byte values
    assert transformer_activation_bytes(layers=2, seq=64, batch=2, width=64, heads=2) == 2 * 64 * 2 * 64 * 44 * 2
    with pytest.raises(ValueError, match="optimizer must be one of"):
        memory_per_rank(1, optimizer="lion")


def test_energy_by_hand():
    e = step_energy(busy_s=[0.2, 0.4], step_s=0.5, busy_w=100.0, idle_w=20.0, bytes_sent=1e6, j_per_bit=1e-9, pue=1.5)
    assert e.compute_j == pytest.approx(60.0) and e.idle_j == pytest.approx(8.0)
    assert e.network_j == pytest.approx(8e-3)
    assert e.total_j == pytest.approx(1.5 * 68.0 + 8e-3)
    assert run_energy(e, 100).total_j == pytest.approx(100 * e.total_j)
    assert J_PER_BIT_INTERNET == pytest.approx(2.7e-5)  # 0.06 kWh/GB


def test_device_table_has_sources_and_sane_numbers():
    kinds = {d.kind for d in DEVICES.values()}
    assert {"gpu", "edge-gpu", "sbc", "cpu-core"} <= kinds
    for d in DEVICES.values():
        assert d.source and d.peak_fp32 > 0 and d.memory > 0 and d.busy_w > d.idle_w > 0
    h100 = get_device("h100-sxm")
    assert h100.compute_s(989e12 * 0.5, utilization=0.5, low_precision=True) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="device must be one of .*raspberry-pi-4.* got 'pi9'"):
        get_device("pi9")


def test_perf_imports_no_other_thinwire_layer():
    for path in (ROOT / "thinwire" / "perf").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith("thinwire") or name.startswith("thinwire.perf"), f"{path.name}: {name}"
                assert name.split(".")[0] not in ("torch", "numpy"), f"{path.name} imports {name}: keep perf/ pure"


# ---- the step model -----------------------------------------------------------------------------------

def _step(p, rate_bps, codec=None, buckets=None):
    codec = codec or _fake("none", lambda n: 4 * n)
    buckets = buckets or [Bucket(numel=500_000, ready_frac=0.5), Bucket(numel=500_000, ready_frac=1.0)]
    return predict_step(buckets=buckets, compute=Compute(pre_s=0.05, backward_s=0.1, post_s=0.01),
                        speeds=[1.0] * p, network=Network(alpha_s=1e-4, beta_s_per_byte=8 / rate_bps), codec=codec)


def test_predict_step_by_hand():
    pred = _step(2, 100e6)
    # bucket 0: ready 0.05 into backward, 2 MB ring on 2 ranks = 2 MB sent: 2e-4 + 0.16 s -> done 0.2102
    # bucket 1: ready 0.1, starts when the link is free at 0.2102, done 0.3704; step = 0.05 + 0.3704 + 0.01
    assert pred.step_s == pytest.approx(0.4304)
    assert pred.bytes_per_rank == 4_000_000
    assert pred.exposed_comm_s == pytest.approx(0.2704)
    slow = predict_step(buckets=[Bucket(numel=1000, ready_frac=1.0)], compute=Compute(pre_s=0.1, backward_s=0.2, post_s=0.0),
                        speeds=[1.0, 0.25], network=Network(alpha_s=0, beta_s_per_byte=0),
                        codec=_fake("none", lambda n: 4 * n))
    assert slow.step_s == pytest.approx(1.2) and slow.compute_s == pytest.approx(1.2)  # the quarter-core host


def test_collective_host_cpu_sets_the_pace_on_fast_links_and_takes_backward_time_on_a_busy_core():
    # one 4 MB bucket ready at the end of backward, 2 ranks (4 MB sent each), 2 ns of host CPU per byte
    net = lambda rate, cpu: Network(alpha_s=0.0, beta_s_per_byte=8 / rate, cpu_s_per_byte=cpu)
    one = [Bucket(numel=1_000_000, ready_frac=1.0)]
    comp = Compute(pre_s=0.0, backward_s=0.1, post_s=0.0)
    codec = _fake("none", lambda n: 4 * n)
    step = lambda rate, cpu, speeds, **kw: predict_step(buckets=one, compute=comp, speeds=speeds,
                                                        network=net(rate, cpu), codec=codec, **kw)
    assert step(100e9, 0.0, [1.0, 1.0]).comm_s == pytest.approx(4e6 * 8 / 100e9)
    assert step(100e9, 2e-9, [1.0, 1.0]).comm_s == pytest.approx(8e-3)        # the CPU, not the 0.32 ms wire
    assert step(100e9, 2e-9, [1.0, 0.5]).comm_s == pytest.approx(16e-3)       # on a half-speed host
    assert step(100e6, 2e-9, [1.0, 0.5]).comm_s == pytest.approx(0.32)        # hidden under a slow wire
    # a bucket ready halfway through backward on a host with no core to spare: its 16 ms of CPU delay backward
    half = [Bucket(numel=1_000_000, ready_frac=0.5)]
    busy = predict_step(buckets=half, compute=comp, speeds=[1.0, 0.5], network=net(100e6, 2e-9), codec=codec,
                        codec_steals_compute=True)
    assert busy.timeline.backward_s == pytest.approx(0.2 + 0.016)
    free = predict_step(buckets=half, compute=comp, speeds=[1.0, 0.5], network=net(100e6, 2e-9), codec=codec)
    assert free.timeline.backward_s == pytest.approx(0.2)


def test_collective_cpu_probe_measures_a_plausible_per_byte_cost():
    from thinwire.measure.collective import collective_cpu, per_byte

    assert per_byte([1 << 20, 16 << 20], [0.001, 0.016]) == pytest.approx(0.015 / (15 << 20))
    got = collective_cpu(reps=2, timeout=120)
    # two local ranks over loopback: a few hundred MB/s at worst, some tens of GB/s at best
    assert 1e-11 < got["per_byte_s"] < 1e-8, got
    assert got["times_s"][1] > got["times_s"][0]


def test_aggregator_probe_measures_its_cpu_per_bucket_and_the_profile_keeps_it(tmp_path):
    from thinwire.measure.aggregator import aggregator_cpu, fit
    from thinwire.measure.file import AggregatorRecord, load_profile, save_profile
    from thinwire.measure.run import profile_workload

    assert fit([10, 110], [0.002, 0.003]) == pytest.approx((0.0019, 1e-5))
    assert fit([10, 110], [0.003, 0.002]) == (0.003, 0.0)  # noise that makes the slope negative: flat
    got = aggregator_cpu(2, reps=3, timeout=120)
    # 2 trainers through the aggregator over loopback: some tens of microseconds to some tens of ms per
    # bucket (the slope between the sizes is only sure on a quiet machine: not asserted here)
    assert got["trainers"] == 2 and got["sizes"] == [65_536, 524_288] and len(got["cpu_s"]) == 2, got
    assert all(0 < c < 0.5 for c in got["cpu_s"]) and got["per_bucket_s"] >= 0 and 0 <= got["per_value_s"] < 1e-6, got
    # each trainer's own CPU per exchange: quantizing, a send and a receive per chunk, decoding
    assert len(got["trainer_cpu_s"]) == 2 and all(0 < c < 0.5 for c in got["trainer_cpu_s"]), got
    assert got["trainer_per_bucket_s"] >= 0 and 0 <= got["trainer_per_value_s"] < 1e-6, got
    prof = profile_workload(workload="digits", model={"channels": 4, "hidden": 64}, batch_sizes=[4],
                            codecs=["none"], reps=2, warmup=1, corun=False)
    rec = AggregatorRecord(trainers=2, per_bucket_s=got["per_bucket_s"], per_value_s=got["per_value_s"],
                           trainer_per_bucket_s=got["trainer_per_bucket_s"], trainer_per_value_s=got["trainer_per_value_s"])
    back = load_profile(save_profile(dataclasses.replace(prof, aggregator=rec), tmp_path / "p.yaml"))
    assert back.aggregator == rec and back.aggregator.trainer_cpu == (got["trainer_per_bucket_s"], got["trainer_per_value_s"])
    old = AggregatorRecord(trainers=2, per_bucket_s=0.001, per_value_s=1e-8)  # a profile from before: not measured
    assert old.trainer_cpu is None
    from thinwire.errors import ConfigError
    with pytest.raises(ConfigError, match="aggregator.per_value_s"):
        AggregatorRecord(trainers=2, per_bucket_s=0.0, per_value_s=-1.0)


def test_a_measured_aggregator_is_priced_per_trainer_at_its_cores():
    from thinwire.measure.file import AggregatorRecord
    from thinwire.perf.model import aggregator_s
    from thinwire.sim.inputs import _per_trainer, codec_model

    rec = AggregatorRecord(trainers=4, per_bucket_s=0.004, per_value_s=8e-9)
    net = Network(alpha_s=0.0, beta_s_per_byte=BETA_100M, switch_speed=0.25, switch_cpu=_per_trainer(rec))
    cm = codec_model("int8", None, switch=True)
    n = 445_952
    assert aggregator_s(cm, n, n, 4, net) == pytest.approx((0.004 + 8e-9 * n) / 0.25)
    assert aggregator_s(cm, n, n, 8, net) == pytest.approx(2 * (0.004 + 8e-9 * n) / 0.25)  # twice the trainers
    assert aggregator_s(cm, n, n, 4, dataclasses.replace(net, switch_speed=None)) == 0.0  # uncapped: keeps up


def test_a_trainers_measured_cpu_through_the_switch_is_its_buckets_host_cpu():
    """Measured whole (profile's ``aggregator.trainer_*``), less the codec kernels the model prices apart, at
    the trainer's codec speed; without the measurement, the bytes at the collectives' CPU per byte. The ring
    is not touched."""
    from thinwire.sim.inputs import codec_model

    n, line = 445_952, (0.001, 1.5e-8)
    net = Network(alpha_s=1e-4, beta_s_per_byte=BETA_100M, cpu_s_per_byte=1e-9)
    timed = dataclasses.replace(net, switch_trainer_cpu=line)
    switch = codec_model("int8", None, switch=True)  # no kernel costs: the line is all transport
    plain = bucket_cost(switch, 0, n, 4, net, codec_speed=0.5)
    assert plain.comm_cpu_s == pytest.approx(plain.bytes_sent * 1e-9 / 0.5)
    assert bucket_cost(switch, 0, n, 4, timed, codec_speed=0.5).comm_cpu_s == pytest.approx((0.001 + 1.5e-8 * n) / 0.5)
    costed = dataclasses.replace(switch, encode=LinearCost(per_byte_s=1e-9))  # the kernels priced apart come off
    c = bucket_cost(costed, 0, n, 4, timed)
    assert c.comm_cpu_s == pytest.approx(0.001 + 1.5e-8 * n - c.encode_s - c.decode_s)
    ring = codec_model("int8", None)
    assert bucket_cost(ring, 0, n, 4, timed) == bucket_cost(ring, 0, n, 4, net)


def test_scheme_dispatch_and_bytes():
    net = Network(alpha_s=0.0, beta_s_per_byte=BETA_100M)
    n = 1_000_000
    bf16 = _fake("bf16", lambda k: 2 * k)
    assert bucket_cost(bf16, 0, n, 4, net).bytes_sent == (2 * 3 * (2 * n)) // 4  # the flag travels in band
    topk = _fake("topk", lambda k: 8 * math.ceil(0.01 * k))
    assert bucket_cost(topk, 0, n, 4, net).collectives == (("all-gather", 80_004),)
    assert bucket_cost(topk, 0, n, 400, net).scheme == "sparse-dense"  # p * density too large
    int8 = _fake("int8", lambda k: k + 4 * math.ceil(k / 256))
    assert bucket_cost(int8, 0, n, 2, net).collectives == (("all-gather", n + 4 * 3907 + 4),)
    assert [c[0] for c in bucket_cost(int8, 0, n, 3, net).collectives] == ["all-to-all", "all-gather"]
    small = bucket_cost(bf16, 0, 1000, 4, net)  # under min_compress_bytes: fp32
    assert small.scheme == "fp32" and small.bytes_sent == 6000
    with_costs = dataclasses.replace(_fake("fp16", lambda k: 2 * k), encode=LinearCost(per_byte_s=1e-9),
                                     decode=LinearCost(per_byte_s=1e-9))
    c = bucket_cost(with_costs, 0, n, 2, net, codec_speed=0.5)
    assert c.encode_s == pytest.approx(2 * (4e-3 + 4e-3)) and c.decode_s == pytest.approx(2 * 4e-3)


def _bytes_per_step(rank, world, specs):
    """On each rank: for each codec, bytes this rank put on the wire per step, and DDP's bucket layout."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from thinwire.compress import hook

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(40, 300), nn.Linear(300, 30)
            self.c = nn.Parameter(torch.zeros(5000))

        def forward(self, x):
            return self.b(torch.relu(self.a(x))).sum() + (self.c * x.sum()).sum()

    seen, original = [], hook.CommState.hook

    def spy(state, bucket):
        seen.append((bucket.buffer().numel(), [list(p.shape) for p in bucket.parameters()]))
        return original(state, bucket)

    hook.CommState.hook = spy
    out = {}
    for spec in specs:
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.03)
        state = thinwire.attach(model, spec)
        per_step = []
        for step in range(2):  # step 1 runs on DDP's rebuilt buckets
            seen.clear()
            before = state.wire.bytes_sent
            model(torch.randn(8, 40, generator=torch.Generator().manual_seed(rank + 10 * step))).backward()
            per_step.append(state.wire.bytes_sent - before)
            model.zero_grad()
        state.close()
        out[spec] = (per_step[-1], list(seen))
    return out


# every scheme and branch: fp32, summable (bf16, randomk), sparse (top-k gathered, top-k dense fallback),
# quantized (all-gather at p = 2, compressed reduce-scatter at p > 2), low-rank
CODECS = {2: ["none", "bf16", "int8", "sign", "topk", "topk:ratio=0.6", "randomk", "powersgd"],
          3: ["bf16", "int8", "topk", "topk:ratio=0.6", "powersgd"]}


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_priced_exactly_as_the_hook_sends_them(world):
    from tests.distributed import run_ranks
    from thinwire.sim.inputs import codec_model

    results = run_ranks(_bytes_per_step, world, CODECS[world])[0]
    net = Network(alpha_s=0.0, beta_s_per_byte=1e-9)
    for spec, (sent, layout) in results.items():
        assert len(layout) > 1, "the test needs several buckets"
        model = codec_model(spec, None, shapes=[shapes for _, shapes in layout])
        predicted = sum(bucket_cost(model, i, numel, world, net).bytes_sent for i, (numel, _) in enumerate(layout))
        assert predicted == sent, f"{spec} on {world} ranks: predicted {predicted} bytes, the hook sent {sent}"


# ---- profile and simulate -------------------------------------------------------------------------------

def test_profile_measures_ddp_layout_and_costs(tmp_path):
    from thinwire.measure.file import load_profile, save_profile
    from thinwire.measure.run import profile_workload

    prof = profile_workload(workload="digits", model={"channels": 4, "hidden": 64}, batch_sizes=[8, 4],
                            bucket_mb=0.01, codecs=["none", "bf16"], reps=2, warmup=2, corun=False)
    assert len(prof.buckets) > 1 and [c.batch for c in prof.compute] == [8, 4]
    assert sum(b.numel for b in prof.buckets) == prof.parameters
    assert all(0.0 <= b.ready_frac <= 1.0 for b in prof.buckets)
    assert prof.flops_per_sample > 0 and prof.activation_bytes_per_sample > 0
    from thinwire.workloads.registry import build_workload
    assert prof.val_items == len(build_workload("digits", {"channels": 4, "hidden": 64}, None).val) > 0
    # DDP's rebuilt layout is the size-capped assignment in gradient-ready order (first cap = cap here)
    order = [i for b in prof.buckets for i in b.params]
    sizes = {i: 4 * math.prod(s) for b in prof.buckets for i, s in zip(b.params, b.shapes)}
    cap = int(0.01 * 2**20)
    expect = ddp_bucket_assignment([sizes[i] for i in order], cap=cap, first_cap=cap)
    assert [[order[j] for j in bk] for bk in expect] == [b.params for b in prof.buckets]
    back = load_profile(save_profile(prof, tmp_path / "p.yaml"))
    assert back.codecs["bf16"].encode.per_byte_s == prof.codecs["bf16"].encode.per_byte_s


def test_measure_compute_is_the_profiles_step_at_one_batch():
    from thinwire.measure.run import measure_compute

    point = measure_compute(workload="digits", model={"channels": 4, "hidden": 64}, batch=4, bucket_mb=0.01,
                            reps=2, warmup=1)
    assert point.batch == 4 and point.pre_s > 0 and point.backward_s > 0 and point.post_s > 0


def test_profile_corun_is_relative_to_the_fair_share(monkeypatch):
    """n copies on c cores: the profile keeps each copy's speed over its fair share min(1, c/n), for
    n from c (every core busy) to 2c (time-sharing), so the model multiplies it onto the share."""
    import thinwire.measure.corun as corun
    from thinwire.measure.run import profile_workload

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr(corun, "corun_speed", lambda *, n, **_: {2: 0.9, 3: 0.5, 4: 0.4}[n])
    prof = profile_workload(workload="digits", model={"channels": 4, "hidden": 64}, batch_sizes=[4],
                            codecs=[], reps=2, warmup=1)
    assert prof.corun_speed == pytest.approx({"2": 0.9, "3": 0.75, "4": 0.8})


def _profile_file(tmp_path, **over) -> Path:
    data = {
        "version": 1, "workload": "charlm", "model": {}, "threads": 1, "bucket_mb": 25.0, "parameters": 445952,
        "compute": [{"batch": 32, "pre_s": 0.05, "backward_s": 0.1, "post_s": 0.003, "std_s": 0.002},
                    {"batch": 16, "pre_s": 0.03, "backward_s": 0.05, "post_s": 0.003, "std_s": 0.002}],
        "activation_bytes_per_sample": 2e6,
        "buckets": [{"numel": 445952, "ready_frac": 1.0, "params": [0], "shapes": [[445952]]}],
        "kernels": {"add": {"fixed_s": 0, "per_byte_s": 1e-10}, "feedback": {"fixed_s": 0, "per_byte_s": 2e-10}},
        "codecs": {"bf16": {"encode": {"fixed_s": 1e-5, "per_byte_s": 1e-10}, "decode": {"fixed_s": 0, "per_byte_s": 1e-11}}},
    }
    data.update(over)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args):
    from thinwire.cli.main import main

    return main([str(a) for a in args])


def test_simulate_cli_smoke(tmp_path, capsys):
    prof = _profile_file(tmp_path)
    rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/two-sites.yaml", "--profile", prof,
              "--compression", "bf16", "--hosts", "2,4,...,1024", "--out", tmp_path / "sim", "--json")
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    pts = out["points"]
    assert [p["hosts"] for p in pts] == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert out["simulate_seconds"] < 1.0  # measured, not a timing assertion: a 10-point sweep is milliseconds
    assert all(a["bytes_per_rank"] <= b["bytes_per_rank"] for a, b in zip(pts, pts[1:]))
    assert all(0 < p["efficiency"] <= 1 for p in pts)
    assert "hierarchical" in pts[0]["dense_fp32_allreduce_s"]
    for name in ("simulate.json", "scaling.png", "timeline.png"):
        assert (tmp_path / "sim" / name).stat().st_size > 0


@pytest.mark.parametrize("scaling, batch, hosts, says", [
    ("strong", 32, "2,3,4", "32 samples over 3 hosts is 10.7 each (priced as such)"),
    ("strong", 36, "2,3,4", "36 samples over 4 hosts is 9 each"),
    ("weak", 30, "2,4", "--batch-size 30 over the spec's 3 hosts is 10 each"),  # two-sites: 3 hosts
    ("weak", 32, "2,4", "--batch-size 32 over the spec's 3 hosts is 10.7 each (priced as such)"),
    ("strong", 48, "2,3,4", None)])
def test_simulate_says_where_train_would_refuse_the_batch(tmp_path, capsys, scaling, batch, hosts, says):
    """A fractional batch per host is priced as such, but no run can have it: the output says so and how to fix it."""
    rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/two-sites.yaml", "--profile", _profile_file(tmp_path),
              "--hosts", hosts, "--batch-size", batch, "--scaling", scaling, "--out", tmp_path / "sim")
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    if says is None or "10 each" in says or "9 each" in says:  # every host count shares the batch equally
        assert "refuses a batch" not in out
    else:
        fix = "that every host count divides, e.g. 36" if scaling == "strong" else "that 3 divides, e.g. 33"
        assert says in out and f"Give a --batch-size {fix}." in out


def test_simulate_says_where_a_one_point_profile_prices_other_batches_in_proportion(tmp_path, capsys):
    from thinwire.measure.file import load_profile
    from thinwire.sim.inputs import one_point_note

    one = [{"batch": 32, "pre_s": 0.05, "backward_s": 0.1, "post_s": 0.003, "std_s": 0.002}]
    args = ["--cluster", ROOT / "examples/clusters/two-sites.yaml", "--hosts", "2,4", "--batch-size", 64,
            "--scaling", "strong"]
    assert _cli("simulate", "--profile", _profile_file(tmp_path, compute=one), *args, "--out", tmp_path / "a") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "one batch size (32 per host); 16 per host are priced in proportion to it" in out
    assert "--batch-sizes 16,32" in out
    assert _cli("simulate", "--profile", _profile_file(tmp_path), *args, "--out", tmp_path / "b") == 0
    assert "one batch size" not in capsys.readouterr().out   # two points: a line
    prof = load_profile(_profile_file(tmp_path, compute=one))
    assert one_point_note(prof, [32, 32]) is None and "8, 16 per host" in one_point_note(prof, [8, 16, 32])


@pytest.mark.parametrize("args, message", [
    (["--hosts", "0,2"], r"--hosts: must be comma-separated host counts >= 1.*got '0,2'"),
    (["--hosts", "two"], r"--hosts: must be comma-separated host counts.*got 'two'"),
    (["--hosts", "8,4,...,2"], r"--hosts: .*The terms must grow"),
    (["--hosts", "4,2"], r"--hosts: must be host counts in increasing order, each once, got '4,2'"),
    (["--hosts", "2,2"], r"--hosts: must be host counts in increasing order, each once"),
    (["--hosts", "8,2,4,...,16"], r"--hosts: must be host counts in increasing order, each once, got '8,2,4,...,16'"),
    (["--hosts", "4,2,3,...,9"], r"--hosts: must be host counts in increasing order, each once"),
    # refused at once, not after simulating each count (a range this long ran out of memory)
    (["--hosts", "2,3,...,100000000000"], r"--hosts: must be host counts in \[1, 65536\]"),
    (["--hosts", "2,3,...,60000"], r"--hosts: must be a sweep of at most 256 host counts"),
    (["--compression", "topk"], r"profile: has no measured cost for codec 'topk'.*--codecs topk"),
    (["--device", "pi9"], r"--device: must be one of .*raspberry-pi-4"),
    (["--scaling", "strong", "--batch-size", "4", "--hosts", "8"], r"--batch-size: must be at least one sample per host \(8 hosts with --scaling strong\), got 4\. 4 over 8 hosts is 0\.5 each"),
    (["--set", "model.width=64"], r"profile: measured workload 'charlm' with model options \{\}"),
    (["--recompute"], r"--recompute: must be used with --validate.*Add --validate"),
])
def test_simulate_bad_input_says_what_and_how(tmp_path, capsys, args, message):
    import re

    prof = _profile_file(tmp_path)
    rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile", prof,
              "--out", tmp_path / "sim", *args)
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err), err


def test_a_simulate_that_fails_leaves_no_default_folder_behind(tmp_path, capsys, monkeypatch):
    """The default folder (``runs/simulate-...``) is made before the predictions; a run that stops before writing
    takes it away again, and ``runs/`` where it made that too, but never a ``runs/`` of the user's own."""
    prof = _profile_file(tmp_path)
    work = tmp_path / "w"
    work.mkdir()
    monkeypatch.chdir(work)
    args = ["simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile", prof]
    bad = [*args, "--scaling", "strong", "--batch-size", "1", "--hosts", "2"]
    assert _cli(*bad) == 2 and "--batch-size: must be at least one sample per host" in capsys.readouterr().err
    assert not list(work.iterdir())
    (work / "runs").mkdir()  # the user's own, empty
    assert _cli(*bad) == 2
    assert [p.name for p in work.iterdir()] == ["runs"] and not list((work / "runs").iterdir())
    assert _cli(*args, "--json") == 0
    assert [p.name for p in (work / "runs").iterdir()][0].startswith("simulate-pair-100mbit-")


def test_missing_or_foreign_profile(tmp_path, capsys):
    rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile", tmp_path / "nope.yaml")
    assert rc == 2
    assert re_search(r"profile: file '.*nope.yaml' does not exist. Make one with `thinwire profile", capsys.readouterr().err)
    bad = _profile_file(tmp_path, version=7)
    assert _cli("simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile", bad) == 2
    assert re_search(r"version: must be 1, got 7. The profile was written by another", capsys.readouterr().err)


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


# ---- auto: the per-bucket plan -----------------------------------------------------------------------

# encode / decode seconds per byte on one core of the development machine (thinwire profile, charlm buckets)
CODEC_COST = {"bf16": (8e-11, 2e-11), "topk:ratio=0.01": (3e-9, 2e-11), "powersgd:rank=4": (8e-10, 9e-11)}


def _candidates():
    import dataclasses

    from thinwire.sim.inputs import codec_model

    out = {}
    for spec in ("none", "bf16", "topk:ratio=0.01", "powersgd:rank=4"):
        model = codec_model(spec, None)
        if spec in CODEC_COST:
            enc, dec = CODEC_COST[spec]
            model = dataclasses.replace(model, encode=LinearCost(per_byte_s=enc), decode=LinearCost(per_byte_s=dec))
        out[spec] = model
    return out


def _choose(rate_bps, banned=None):
    from thinwire.plan.choose import choose

    buckets = [Bucket(numel=400_000, ready_frac=0.5), Bucket(numel=400_000, ready_frac=1.0)]
    return choose(buckets=buckets, compute=Compute(pre_s=0.02, backward_s=0.04, post_s=0.003), speeds=[1.0] * 4,
                  network=Network(alpha_s=1e-4, beta_s_per_byte=8 / rate_bps), candidates=_candidates(),
                  banned=banned)


def test_auto_chooses_light_on_fast_links_and_strong_on_slow_links():
    fast = _choose(10e9)
    assert set(fast.choices) <= {"none", "bf16"} and fast.step_s <= fast.baseline_s
    slow = _choose(10e6)
    assert set(slow.choices) <= {"topk:ratio=0.01", "powersgd:rank=4"}
    assert slow.step_s < 0.2 * slow.baseline_s
    guarded = _choose(10e6, banned={0: {"topk:ratio=0.01", "powersgd:rank=4"}, 1: {"topk:ratio=0.01"}})
    assert guarded.choices == ["bf16", "powersgd:rank=4"]


def _auto_run(rank, world, slow_link_bps):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from thinwire.auto import AutoConfig, AutoPolicy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.25)
    policy = AutoPolicy(AutoConfig(warmup_steps=2, baseline_steps=1, check_every=3, max_error=10.0,
                                   candidates=("none", "bf16", "topk:ratio=0.01", "powersgd:rank=4")))
    state = thinwire.attach(model, policy)
    policy.bind(state, net)  # what attach will do for a policy with bind()
    if slow_link_bps:  # every rank "measures" the same slow link
        policy.link.estimate = lambda p: (1e-4, 8 / slow_link_bps)
    g = torch.Generator().manual_seed(rank)
    for _ in range(8):
        nn.functional.cross_entropy(model(torch.randn(16, 64, generator=g)), torch.randint(0, 10, (16,), generator=g)).backward()
        model.zero_grad()
    state.close()
    return policy.decisions, policy.describe()


def test_auto_decides_identically_on_every_rank_and_logs_why():
    from tests.distributed import run_ranks

    results = run_ranks(_auto_run, 2, 1e6)
    (decisions, described), (other, described_other) = results
    assert decisions == other and described == described_other
    # warm-up 2 + baseline 1: checked at step 3, its agreement concluded (and acted on) at step 4
    assert decisions[0]["step"] == 4 and decisions[0]["reason"] == "warm-up done"
    assert set(decisions[0]["choices"].values()) & {"topk:ratio=0.01", "powersgd:rank=4"} and decisions[0]["trial"]
    # the next check (6) is the trial's verdict: the clock, not the (faked) link, decides whether it stays
    assert decisions[1]["step"] == 7 and decisions[1]["reason"].split(":")[0] in ("kept", "reverted")
    assert described.startswith("auto[")


def test_validation_keeps_the_least_disturbed_attempt(tmp_path, monkeypatch):
    import thinwire.validation as v
    from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec
    from thinwire.measure.file import load_profile
    from thinwire.sim.sweep import SimOptions

    foreign = iter([0.9, 0.4, 0.6])
    monkeypatch.setattr(v, "run_real", lambda real, where, **kw: (0.2, 1000.0, next(foreign)))
    monkeypatch.setattr(v, "wait_quiet", lambda *a, **k: 0.0)
    spec = ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="200mbit", cpu=1.0), hosts=[HostSpec(name="a"), HostSpec(name="b")])
    prof = load_profile(_profile_file(tmp_path))
    (row,) = v.validate(spec, prof, SimOptions(codec="bf16"), workload="charlm", model={}, batch=32, steps=30,
                        out=tmp_path, max_foreign=0.3, retries=2)
    assert row.attempts == 3 and row.foreign_cores == 0.4 and row.out.endswith("hosts2-bf16-retry1")
    assert row.predicted_loaded_s > row.predicted_s  # fewer cores left: slower


def test_validation_predicts_with_the_step_measured_again_before_each_run(tmp_path, monkeypatch):
    """A machine that got slower since it was profiled: with ``recompute`` the prediction uses the
    step measured just before the run (here twice the profile's) and records the drift."""
    import dataclasses

    import thinwire.validation as v
    from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec
    from thinwire.measure.file import load_profile
    from thinwire.sim.sweep import SimOptions

    monkeypatch.setattr(v, "run_real", lambda real, where, **kw: (0.2, 1000.0, 0.0))
    spec = ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="10gbit", cpu=1.0), hosts=[HostSpec(name="a"), HostSpec(name="b")])
    prof = load_profile(_profile_file(tmp_path))
    asked = []

    def slower(batch):
        asked.append(batch)
        c = next(c for c in prof.compute if c.batch == batch)
        return dataclasses.replace(c, pre_s=2 * c.pre_s, forward_s=2 * c.forward_s, backward_s=2 * c.backward_s,
                                   post_s=2 * c.post_s)

    kw = dict(workload="charlm", model={}, batch=32, steps=30, out=tmp_path)
    (plain,) = v.validate(spec, prof, SimOptions(codec="none"), **kw)
    (fresh,) = v.validate(spec, prof, SimOptions(codec="none"), **kw, recompute=slower)
    assert asked == [16] and plain.compute_drift is None and fresh.compute_drift == pytest.approx(2.0)
    assert fresh.predicted_s > 1.5 * plain.predicted_s  # compute-bound on a fast link
    assert [c.batch for c in prof.compute] == [c.batch for c in v.with_fresh_compute(prof, slower, 16)[0].compute]


def test_validation_compute_diagnostic_reads_the_run_and_skips_mixed_cpus(tmp_path):
    import thinwire.validation as v
    from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": k, "data_s": 0.01, "compute_s": 0.05 + (0.5 if k <= 2 else 0.001 * k), "step_time_s": 0.1}
               for k in range(1, 8)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    same = ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="1gbit", cpu=1.0), hosts=[HostSpec(name="a"), HostSpec(name="b")])
    got = v.compute_diagnostic(same, 0.07, run, skip=2)  # steps 3..7: 0.063 .. 0.067, median 0.065
    assert got["predicted_compute_s"] == 0.07 and got["measured_compute_s"] == pytest.approx(0.065)
    mixed = ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="1gbit", cpu=1.0),
                        hosts=[HostSpec(name="a"), HostSpec(name="b", cpu=0.25)])
    assert v.compute_diagnostic(mixed, 0.07, run, skip=2) == {}  # rank 0's compute is not the slowest host's


def test_colocation_calibration_keeps_the_median_of_its_repeats(tmp_path, monkeypatch):
    import thinwire.validation as v
    from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec
    from thinwire.measure.file import load_profile
    from thinwire.sim.sweep import SimOptions

    steps = {"hosts2-bf16-cal-10gbit": 0.30, "hosts2-bf16-cal-10gbit-1": 0.90, "hosts2-bf16-cal-10gbit-2": 0.40,
             "hosts2-bf16": 0.5}  # one calibration run far off: the median ignores it
    monkeypatch.setattr(v, "run_real", lambda real, where, **kw: (steps[where.name], 1000.0, 0.0))
    spec = ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="200mbit", cpu=1.0), hosts=[HostSpec(name="a"), HostSpec(name="b")])
    prof = load_profile(_profile_file(tmp_path))
    opts = SimOptions(codec="bf16")
    (row,) = v.validate(spec, prof, opts, workload="charlm", model={}, batch=32, steps=30, out=tmp_path,
                        calibrate_bandwidth="10gbit", calibrate_reps=3)
    sim = dataclasses.replace(opts, hosts=[2], batch_size=32, scaling="strong",
                              colocated_cores=float(os.cpu_count() or 1), threads=prof.threads)
    fast = v.simulate(v.at_bandwidth(v.scaled_spec(spec, 2), "10gbit"), prof, sim, default_batch=32)[0].prediction
    here = v.simulate(v.scaled_spec(spec, 2), prof, sim, default_batch=32)[0].prediction
    assert row.colocation_measured_s == pytest.approx(0.40 - fast.step_s)
    # at 200mbit the link adds time the co-located CPU work hides in: only the rest is added
    added = here.comm_s - fast.comm_s
    assert added > 0 and row.colocation_s == pytest.approx(max(0.0, 0.40 - fast.step_s - added))
    assert row.predicted_s == pytest.approx(row.model_s + row.colocation_s)


def test_link_meter_ignores_waits_that_a_regression_would_turn_into_any_slope():
    from thinwire.auto.meters import DEFAULT_ALPHA_S, LinkMeter

    meter = LinkMeter()
    beta = 8 / 1e9  # 1 Gbit/s
    fixed = 2 * DEFAULT_ALPHA_S
    for i in range(20):  # 2 MB transfers, two of them behind a 50 ms wait for a late peer
        meter.samples.append((2_000_000, fixed + 2_000_000 * beta + (0.05 if i in (3, 11) else 0.0)))
    meter.samples.append((4, 0.05))  # a flag collective that waited too
    alpha, est = meter.estimate(2)
    assert alpha == DEFAULT_ALPHA_S and est == pytest.approx(beta, rel=1e-6)


def test_link_meter_times_a_queued_collective_from_when_the_one_before_it_completed():
    """An async all-reduce issued while the previous bucket's was still on the wire waited for it:
    its transfer counts from that completion, not from its issue (else a fast link reads slow)."""
    import time

    from thinwire.auto.meters import LinkMeter

    meter = LinkMeter()
    now = time.perf_counter()
    meter._last_done = now - 0.010           # the earlier collective completed 10 ms ago
    meter._record(1000, issued=now - 0.500)  # this one was issued 500 ms ago, behind it
    meter._last_done = time.perf_counter() - 0.500           # idle link: the last one completed long ago
    meter._record(1000, issued=time.perf_counter() - 0.020)  # so this one's own time counts
    (_, queued), (_, alone) = meter.samples
    assert 0.010 <= queued < 0.100
    assert 0.020 <= alone < 0.100


def test_significance_test_agrees_with_scipys_mann_whitney_u():
    import random

    from scipy.stats import mannwhitneyu

    from thinwire.auto.trial import p_faster as _p_faster

    rng = random.Random(0)
    cases = [([0.070 + 0.01 * rng.random() for _ in range(10)], [0.074 + 0.01 * rng.random() for _ in range(10)])
             for _ in range(20)]
    cases += [([1, 2, 2, 3, 5], [2, 3, 3, 4, 6, 6]), ([3, 3, 3], [3, 3, 3, 3]), ([0.137] * 10, [0.3] * 10)]
    for now, before in cases:
        want = mannwhitneyu(now, before, alternative="less", method="asymptotic").pvalue
        got = _p_faster(now, before)
        assert got == pytest.approx(float(want), rel=1e-9, abs=1e-12) or (want != want and got == 1.0), (now, before)
    assert _p_faster([1, 2], [3, 4, 5]) == 0.0


def test_auto_keeps_its_heavy_steps_on_the_communication_thread():
    from thinwire.auto import AutoConfig, AutoPolicy

    policy = AutoPolicy(AutoConfig(warmup_steps=2, check_every=3))
    assert policy.busy(0, 0) and policy.busy(1, 1)           # warm-up: shadow runs
    policy._last_step = 1
    assert policy.busy(0, 2)                                 # the first check times the codecs
    policy._last_step = 2
    assert not policy.busy(1, 2) and not policy.busy(0, 3)   # in between: nothing heavy
    policy.costs, policy._last_step = {}, 6
    assert not policy.busy(0, 7)                             # a later check only issues its agreement
    policy._pending, policy._last_step = (lambda: None), 7
    assert policy.busy(0, 8)                                 # the step after it: the first decision
    policy.decided_bps = 1e9
    assert not policy.busy(0, 8)                             # a check that finds nothing moved: light
    policy.trial = object()
    assert policy.busy(0, 8)                                 # a trial's verdict may re-plan
    policy._pending, policy.trial = None, None
    policy.choices, policy.shadows.since = {1: "powersgd:rank=8"}, {1: ("powersgd:rank=8", 2)}
    assert policy.busy(1, 3) and not policy.busy(1, 6)       # PowerSGD's first window keeps its shadow


def test_shadow_guard_keeps_out_codecs_that_leave_most_of_the_gradient_behind():
    import torch

    from thinwire.auto import AutoConfig, AutoPolicy

    policy = AutoPolicy(AutoConfig(warmup_steps=4, candidates=("none", "bf16", "int8", "topk:ratio=0.01")))
    g = torch.Generator().manual_seed(0)
    for step in range(4):  # heavy-tailed gradients whose direction changes every step
        policy.observe(0, torch.randn(100_000, generator=g) * torch.rand(100_000, generator=g) ** 4, step)
    errs = policy.shadows.errors[0]
    assert errs["bf16"] < 0.01 and errs["int8"] < 0.05 and errs["topk:ratio=0.01"] > 0.8
    policy.observe(0, torch.randn(100_000, generator=g), 4)  # after the warm-up: no more shadow work
    policy.shadows.keep_needed(policy.choices, 4)  # a decision (here: none everywhere) drops what no bucket uses
    assert policy.shadows.residuals == {} and policy.shadows.errors[0] == errs


def test_a_non_finite_gradient_leaves_the_shadows_as_they_were():
    """A skipped step (fp16's loss scale) folded into the shadows' residuals and PowerSGD's warm-start Q made
    every later error NaN."""
    import torch

    from thinwire.auto.shadow import ShadowRuns
    from thinwire.compress.spec import parse_codec_spec

    specs = ("int8", "powersgd:rank=2")
    shadows = ShadowRuns({s: parse_codec_spec(s) for s in specs}, window=4)
    shadows.shapes[0] = [(20, 50)]
    g = torch.Generator().manual_seed(0)
    shadows.run(0, torch.randn(1000, generator=g), warm=True, current="none")
    bad = torch.randn(1000, generator=g)
    bad[3] = float("inf")
    shadows.run(0, bad, warm=True, current="none")
    shadows.run(0, torch.randn(1000, generator=g), warm=True, current="none")
    assert all(0 < e < 1 for e in shadows.errors[0].values()), shadows.errors
    assert all(torch.isfinite(r).all() for r in shadows.residuals.values())


def test_auto_times_codecs_in_the_warm_up_shadows_and_measures_only_the_rest(monkeypatch):
    """The warm-up's shadows encode and decode every lossy candidate on the real buckets: their times
    are the codec costs the model prices with; only what did not run in shadow as itself (a low-rank
    codec, run as a per-matrix approximation) is timed at the first check."""
    import torch

    from thinwire.auto import AutoConfig, AutoPolicy
    from thinwire.auto import decide

    policy = AutoPolicy(AutoConfig(warmup_steps=2, candidates=("none", "bf16", "int8", "powersgd:rank=4")))
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        policy.observe(0, torch.randn(100_000, generator=g), step, [(100, 1000)])
        policy.observe(1, torch.randn(20_000, generator=g), step, [(20_000,)])
    costs = policy.shadows.costs()
    assert set(costs) == {"bf16", "int8"} and all(e > 0 and d > 0 for e, d in costs.values())
    asked = []
    monkeypatch.setattr(decide, "codec_costs", lambda specs, numel: asked.append((specs, numel)) or {
        s: (1e-9, 1e-9) for s in specs if s != "none"})
    policy.numels = {0: 100_000, 1: 20_000}
    policy._check(2)  # the warm-up's end: the baseline window starts, the codecs are priced
    assert asked == [(("none", "powersgd:rank=4"), 100_000)]
    assert policy.costs == {**costs, "powersgd:rank=4": (1e-9, 1e-9)}


def test_auto_agrees_on_the_device_its_group_reduces_on(monkeypatch):
    """NCCL reduces CUDA tensors only: the agreement's tensor goes where the group's collectives go."""
    import torch
    import torch.distributed as dist

    from thinwire.auto.agree import _device

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert _device(None) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _device(None) == torch.device("cuda", 3)


def test_compute_meter_keeps_two_hooks_after_the_first_backward():
    """The first backward notes the order gradients arrive in; then only its first and last
    parameter are hooked, and the phases are still timed from forward start to the last gradient."""
    import torch
    from torch import nn

    from thinwire.auto.meters import ComputeMeter

    class Counting(ComputeMeter):
        calls = 0

        def _on_grad(self, param):
            Counting.calls += 1
            super()._on_grad(param)

    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    meter = Counting()
    meter.attach(net)
    per_step = []
    for _ in range(4):
        before = Counting.calls
        net(torch.randn(4, 8)).sum().backward()
        per_step.append(Counting.calls - before)
    assert per_step == [6, 2, 2, 2]  # 6 parameters hooked in the first backward, then the two ends
    net(torch.randn(4, 8))  # the next forward closes the last step
    pre, backward = meter.estimate()
    assert len(meter.backward) == 4 and pre > 0 and backward > 0


def test_error_meter_reports_the_share_left_behind_with_error_feedback():
    import torch

    from thinwire.compress.feedback import ErrorFeedback
    from thinwire.auto.meters import ErrorMeter

    fb = ErrorFeedback()
    meter = ErrorMeter()
    meter.wrap(fb)
    x = torch.ones(1000)
    fb.update("0", x, x * 0.75)  # a quarter stays behind
    fb.update("0", x, x * 0.75)
    assert meter.window_errors(["0", "1"]) == [pytest.approx(0.25), 0.0]
    assert meter.window_errors(["0"]) == [0.0]  # reset


@pytest.mark.parametrize("spec, message", [
    ("auto:keep_gain=abc", r"auto\.keep_gain: must be a number, got 'abc'\. E\.g\. auto:keep_gain=0\.05"),
    ("auto:check_every=1.5", r"auto\.check_every: must be an integer, got '1\.5'"),
    ("auto:keep_gain=2", r"auto\.keep_gain: must be a fraction in \(-1, 1\), got 2\.0"),
    ("auto:keep_p=0", r"auto\.keep_p: must be a probability in \(0, 1\], got 0\.0\. 1 keeps any trial"),
    ("auto:nope=1", r"auto parameter: must be key=value with key one of"),
    ("auto:trial_windows=0", r"auto\.trial_windows: must be an integer >= 1, got 0\. 1 judges a trial on its first window alone"),
    ("auto:start=int4", r"auto\.start: must be one of the candidates \(none\|bf16\|int8.*\), got 'int4'"),
    ("auto:baseline_steps=-1", r"auto\.baseline_steps: must be an integer >= 0, got -1\. 0 decides at the warm-up's end"),
    ("auto:candidates=none|int8@switch", r"auto\.candidates: must be codec specs \(int8, not int8@switch\), got "
                                         r"'int8@switch'\. Where the job has an aggregator on the switch"),
    ("auto:candidates=int8|foo", r"compression: must be one of none, .*got 'foo'"),  # not only "'none' is missing"
    ("auto:candidates=", r"auto\.candidates: must be codec specs separated by \|, none empty, got ''\. E\.g\. auto:"),
    ("auto:candidates=none||int8", r"auto\.candidates: must be codec specs separated by \|, none empty, got 'none\|\|int8'"),
])
def test_bad_auto_spec_names_the_field_the_value_and_the_fix(spec, message):
    from thinwire.errors import ConfigError
    from thinwire.auto import parse_auto_spec

    with pytest.raises(ConfigError, match=message):
        parse_auto_spec(spec)


def _guard_profile(tmp_path, verdicts: dict[str, bool], guard: bool = True):
    """A profile whose convergence guard says ``verdicts`` (codec -> reaches fp32's loss)."""
    from tests.test_plan import profile
    from thinwire.measure.file import CodecCost, ConvergenceRecord, Cost, save_profile

    prof = profile()
    for name, reaches in verdicts.items():
        prof.codecs[name] = CodecCost(encode=Cost(per_byte_s=1e-9), decode=Cost(per_byte_s=1e-9))
        if guard:
            prof.codecs[name].convergence = ConvergenceRecord(factor=1.0 if reaches else 2.0,
                                                              loss=2.0 if reaches else 2.5, reference_loss=2.0,
                                                              steps=60, world=4)
    return save_profile(prof, tmp_path / "p.yaml")


def test_auto_with_a_guard_never_tries_what_does_not_reach_and_trusts_what_does(tmp_path):
    from thinwire.auto import AutoPolicy, parse_auto_spec
    from thinwire.auto.decide import Guards, _left_out

    path = _guard_profile(tmp_path, {"bf16": True, "int8": True, "topk:ratio=0.01": False})
    cfg = parse_auto_spec(f"auto:guard={path},candidates=none|bf16|int8|topk:ratio=0.01|powersgd:rank=8")
    assert cfg.verdicts == {"bf16": True, "int8": True, "topk:ratio=0.01": False, "powersgd:rank=8": None}
    policy = AutoPolicy(cfg)
    assert policy.config.candidates == ("none", "bf16", "int8", "powersgd:rank=8") and policy.excluded == {"topk:ratio=0.01"}
    assert "topk:ratio=0.01" not in policy.codecs and policy.config.start == "bf16"
    # the error cap: waived for what the guard says reaches, kept for what it has no record of
    guards = Guards(banned={}, tried={}, max_error=0.1, trusted=frozenset(policy.trusted))
    assert _left_out([0], guards, {0: {"int8": 0.3, "powersgd:rank=8": 0.3}}) == {0: {"powersgd:rank=8"}}
    # bf16 left out by the guard: auto starts uncompressed
    path = _guard_profile(tmp_path, {"bf16": False})
    assert AutoPolicy(parse_auto_spec(f"auto:guard={path}")).config.start == "none"


def test_auto_guard_must_be_a_profile_with_the_guard(tmp_path):
    from thinwire.auto import parse_auto_spec
    from thinwire.errors import ConfigError

    with pytest.raises(ConfigError, match=r"auto\.guard: must be the path of an existing profile, got '.*nope\.yaml'\. No such file"):
        parse_auto_spec(f"auto:guard={tmp_path / 'nope.yaml'}")
    (tmp_path / "x.yaml").write_text("just text")
    with pytest.raises(ConfigError, match=r"auto\.guard: must be a profile written by `thinwire profile`"):
        parse_auto_spec(f"auto:guard={tmp_path / 'x.yaml'}")
    path = _guard_profile(tmp_path, {"bf16": True}, guard=False)
    with pytest.raises(ConfigError, match=r"auto\.guard: must be a profile with the convergence guard's records, .*--guard-steps 0"):
        parse_auto_spec(f"auto:guard={path}")


def test_auto_keeps_a_switch_only_if_the_measured_step_got_faster():
    from types import SimpleNamespace

    from thinwire.auto import AutoConfig, AutoPolicy
    from thinwire.auto.agree import Measurements

    def window(step_s, rate_bps=10e6, steps=()):  # what _agree returns: every rank's measurements merged
        return Measurements(**{"alpha": 1e-4, "beta": 8 / rate_bps, "pre_s": 0.02, "backward_s": 0.04, "step_s": step_s,
                "errors": {0: 0.0}, "shadow": {0: {"bf16": 0.002, "topk:ratio=0.01": 0.3}}, "window": list(steps)})

    def policy_seeing(windows):
        policy = AutoPolicy(AutoConfig(warmup_steps=1, baseline_steps=0, check_every=1, max_error=0.5,
                                       candidates=("none", "bf16", "topk:ratio=0.01")))
        policy.numels, policy.costs = {0: 400_000}, {"bf16": (1e-10, 1e-11), "topk:ratio=0.01": (1e-9, 1e-11)}
        policy._state = SimpleNamespace(wire=SimpleNamespace(world=4))
        seen = iter(windows)
        policy._measured = lambda: None  # _agree below stands in for every rank's merged record
        policy._agree = lambda measured: lambda: next(seen)
        for step in range(1, 1 + len(windows)):
            policy._check(step)
            policy.sent(0, step)  # the agreement goes out behind the step's first bucket
            policy._conclude(step + 1)
        return policy

    # a slow link: the model switches to top-k; the clock says the step went from 400 to 100 ms: kept
    kept = policy_seeing([window(0.4), window(0.1), window(0.1)])
    assert [d["reason"].split(":")[0] for d in kept.decisions] == ["warm-up done", "kept"]
    assert kept.choices == {0: "topk:ratio=0.01"} and kept.decided_bps == 10e6
    # the same prediction, but the step did not get 5% faster: reverted, and top-k is not tried again
    # at this link rate; a link that moves by more than 30% clears that, and the model decides again
    back = policy_seeing([window(0.4), window(0.39), window(0.4), window(0.4, rate_bps=5e6), window(0.4, 5e6),
                          window(0.1, 5e6)])
    reasons = [d["reason"].split(":")[0] for d in back.decisions]
    assert reasons == ["warm-up done", "reverted", "link moved 50%", "kept"], reasons
    assert back.decisions[1]["choices"] == {0: "bf16"} and back.choices == {0: "topk:ratio=0.01"}  # bf16: the start
    # a link that gets faster makes the rejected top-k pay less still: re-decided, but not tried again
    faster = policy_seeing([window(0.4), window(0.39), window(0.4), window(0.4, rate_bps=20e6), window(0.4, 20e6)])
    assert [d["reason"].split(":")[0] for d in faster.decisions] == ["warm-up done", "reverted", "link moved 100%"]
    assert faster.choices == {0: "bf16"} and faster.trial is None and faster.tried == {0: {"topk:ratio=0.01": 10e6}}
    # one window's reading moved (a busy host), the next did not, or moved the other way: no re-decision
    for blip in ([window(0.4, 20e6), window(0.4)], [window(0.4, 20e6), window(0.4, 5e6)]):
        steady = policy_seeing([window(0.4), window(0.39), window(0.4), *blip])
        assert [d["reason"].split(":")[0] for d in steady.decisions] == ["warm-up done", "reverted"]
    # a noisy host: the trial's median is 7% lower, but half its steps are slower than most before it
    # (p ~ 0.24): not sure yet, so the old plan is timed again for a window, then the new one; after
    # trial_windows (3) windows the medians of all the steps decide
    before = [0.40, 0.43, 0.38, 0.45, 0.41, 0.39, 0.44, 0.40, 0.42, 0.37]
    noisy = [0.31, 0.46, 0.33, 0.37, 0.45, 0.30, 0.38, 0.47, 0.32, 0.44]
    assert statistics.median(noisy) <= 0.95 * statistics.median(before)
    w = lambda steps: window(statistics.median(steps), steps=steps)  # noqa: E731
    doubt = policy_seeing([w(before), w(noisy), w(before), w(noisy)])
    assert [d["reason"].split(":")[0] for d in doubt.decisions] == ["warm-up done", "trial", "trial", "kept"]
    assert "not surely faster yet" in doubt.decisions[1]["reason"] and doubt.decisions[1]["choices"] == {0: "bf16"}
    assert doubt.decisions[2]["choices"] == {0: "topk:ratio=0.01"}
    assert "3 alternating windows" in doubt.decisions[3]["reason"] and doubt.choices == {0: "topk:ratio=0.01"}
    # the old plan, timed again, turns out as fast as the trial: reverted, top-k left out
    lucky = policy_seeing([w(before), w(noisy), w([t * 0.85 for t in before])])
    assert [d["reason"].split(":")[0] for d in lucky.decisions] == ["warm-up done", "trial", "reverted"]
    assert lucky.choices == {0: "bf16"} and lucky.tried == {0: {"topk:ratio=0.01": 10e6}} and lucky.trial is None
    # every step of the trial below every step before it: kept at once
    clear = [t / 3 for t in before]
    sure = policy_seeing([w(before), w(clear)])
    assert [d["reason"].split(":")[0] for d in sure.decisions] == ["warm-up done", "kept"]


def test_auto_reverts_a_trial_early_when_its_first_steps_are_surely_slower():
    """A trial gets a look after its first EARLY_STEPS steps: every one slower than the steps before
    it reverts at once; mixed steps leave the trial to its regular window."""
    from types import SimpleNamespace

    from thinwire.auto import AutoConfig, AutoPolicy
    from thinwire.auto.agree import Measurements
    from thinwire.auto.policy import EARLY_STEPS

    before = [0.40, 0.42, 0.39, 0.41, 0.40, 0.43, 0.38, 0.41, 0.40, 0.42]

    def run(trial_steps):
        policy = AutoPolicy(AutoConfig(warmup_steps=1, baseline_steps=0, check_every=10, max_error=0.5,
                                       candidates=("none", "bf16", "topk:ratio=0.01")))
        policy.numels, policy.costs = {0: 400_000}, {"bf16": (1e-10, 1e-11), "topk:ratio=0.01": (1e-9, 1e-11)}
        policy._state = SimpleNamespace(wire=SimpleNamespace(world=4))
        windows, checks = itertools.chain([before, *trial_steps], itertools.repeat(before)), []

        def agree(measured):
            steps = next(windows)
            m = Measurements(alpha=1e-4, beta=8 / 10e6, pre_s=0.02, backward_s=0.04, step_s=statistics.median(steps),
                             errors={0: 0.0}, shadow={0: {"bf16": 0.002, "topk:ratio=0.01": 0.3}}, window=list(steps))
            return lambda: m
        policy._measured = lambda: None  # _agree below stands in for every rank's merged record
        policy._agree = agree
        for step in range(1, 22):
            if policy._pending is not None:
                policy._conclude(step)
            if policy._due(step):
                checks.append(step)
                policy._check(step)
                policy.sent(0, step)
        return policy, checks

    slow, checks = run([[0.55, 0.60, 0.52, 0.58]])  # then steps as before: no other change
    assert checks[:2] == [1, 2 + EARLY_STEPS]  # decided at step 2 (the step after the check), looked at 4 steps later
    reasons = [d["reason"].split(":")[0] for d in slow.decisions]
    assert reasons == ["warm-up done", "reverted early"] and slow.decisions[1]["step"] == 3 + EARLY_STEPS
    assert slow.choices == {0: "bf16"} and slow.trial is None and slow.tried == {0: {"topk:ratio=0.01": 10e6}}
    assert checks[2] == 11  # the regular checks go on
    # mixed first steps: no verdict yet; the regular check judges all of the trial's steps
    mixed, checks = run([[0.30, 0.45, 0.31, 0.44], [0.30, 0.29, 0.31, 0.30, 0.32]])
    assert checks[:3] == [1, 2 + EARLY_STEPS, 11]
    assert [d["reason"].split(":")[0] for d in mixed.decisions] == ["warm-up done", "kept"]
    assert mixed.choices == {0: "topk:ratio=0.01"} and "over" not in mixed.decisions[1]["reason"]  # at once, p <= 0.05


def test_auto_times_its_first_trial_against_a_baseline_window_not_the_warm_up():
    """The warm-up's steps (start-up, shadow runs) are dropped at its end; the first decision comes
    ``baseline_steps`` later, and its trial is judged against those steps alone."""
    from types import SimpleNamespace

    from thinwire.auto import AutoConfig, AutoPolicy

    config = AutoConfig(warmup_steps=3, baseline_steps=2, check_every=4)
    policy = AutoPolicy(config)
    assert [s for s in range(20) if policy._due(s)] == [3, 5, 9, 13, 17]
    policy.costs = {}
    policy._state = SimpleNamespace(wire=SimpleNamespace(world=2))
    policy.step_times = [0.9, 0.5, 0.4]  # the warm-up's
    policy._check(3)
    assert policy.step_times == [] and policy.decisions == [] and policy.choices == {}
    assert AutoPolicy(AutoConfig(warmup_steps=3, baseline_steps=0, check_every=4))._due(3)


def test_auto_starts_in_bf16_and_a_change_of_plan_must_pay_over_the_plan_in_use():
    """Before its first decision auto sends bf16 (none when bf16 is not a candidate, or with
    ``start=none``); the decision starts from the plan in use, so on a fast link, where neither is
    predicted 10% faster than the other, it keeps whichever it started with, and on a slow link the
    trial of a strong codec is timed against bf16's steps."""
    from types import SimpleNamespace

    from thinwire.auto import AutoConfig, AutoPolicy
    from thinwire.auto.agree import Measurements

    def after_first_check(rate_bps, **kw):
        policy = AutoPolicy(AutoConfig(warmup_steps=1, baseline_steps=0, check_every=1,
                                       candidates=("none", "bf16", "int8"), **kw))
        assert policy.codec_for(0, 400_000, 0).name == ("bf16" if policy.config.start == "bf16" else "none")
        policy.numels, policy.costs = {0: 400_000}, {"bf16": (1e-10, 1e-11), "int8": (1e-9, 1e-10)}
        policy._state = SimpleNamespace(wire=SimpleNamespace(world=4))
        policy._measured = lambda: None  # _agree below stands in for every rank's merged record
        policy._agree = lambda measured: lambda: Measurements(**{"alpha": 1e-4, "beta": 8 / rate_bps, "pre_s": 0.02, "backward_s": 0.04,
                                 "step_s": 0.1, "errors": {0: 0.0}, "shadow": {0: {"bf16": 0.002, "int8": 0.008}},
                                 "window": [0.1] * 5})
        policy._check(1)
        policy.sent(0, 1)
        policy._conclude(2)
        return policy

    assert AutoConfig().start == "bf16" and AutoConfig(candidates=("none", "int8")).start == "none"
    fast = after_first_check(10e9)
    assert fast.choices == {0: "bf16"} and fast.trial is None  # no change: nothing to time
    assert after_first_check(10e9, start="none").choices == {0: "none"}
    slow = after_first_check(20e6)
    assert slow.choices == {0: "int8"} and slow.trial.old == {0: "bf16"}


def test_auto_tries_a_rejected_codec_again_only_when_the_link_moves_its_way():
    from thinwire.auto import AutoConfig, AutoPolicy

    policy = AutoPolicy(AutoConfig(candidates=("none", "bf16", "topk:ratio=0.01")))
    policy.numels, policy.choices = {0: 400_000}, {0: "bf16"}
    policy.tried = {0: {"none": 10e6, "topk:ratio=0.01": 10e6}}
    policy._forget_rejections(20e6)  # faster: fp32 may pay now, top-k pays less still
    assert policy.tried == {0: {"topk:ratio=0.01": 10e6}}
    policy._forget_rejections(8e6)   # 20% slower than when top-k was rejected: not enough
    assert policy.tried == {0: {"topk:ratio=0.01": 10e6}}
    policy._forget_rejections(5e6)
    assert policy.tried == {0: {}}


def test_choose_starts_from_the_plan_in_use():
    from thinwire.plan.choose import choose

    buckets = [Bucket(numel=400_000, ready_frac=0.5), Bucket(numel=400_000, ready_frac=1.0)]
    kw = dict(buckets=buckets, compute=Compute(pre_s=0.02, backward_s=0.04, post_s=0.003), speeds=[1.0] * 4,
              network=Network(alpha_s=1e-4, beta_s_per_byte=8 / 10e9), candidates=_candidates(), min_gain=0.1)
    assert choose(**kw).choices == ["none", "none"]
    kept = choose(**kw, initial=["bf16", "none"])
    assert kept.choices == ["bf16", "none"] and kept.baseline_s == choose(**kw).baseline_s
    assert kept.initial_s == kept.step_s  # kept: nothing is predicted 10% faster than it
    moved = choose(**{**kw, "min_gain": 0.0}, initial=["topk:ratio=0.01"] * 2)  # top-k: 4% slower here
    unsearched = choose(**{**kw, "min_gain": 0.0}, initial=["topk:ratio=0.01"] * 2, passes=0)
    assert moved.initial_s == unsearched.step_s > moved.step_s != moved.baseline_s
    with pytest.raises(ValueError, match="one candidate per bucket"):
        choose(**kw, initial=["bf16"])


def test_default_cap_keeps_out_a_codec_that_leaves_a_third_of_the_gradient_behind():
    """The default cap (0.1): a codec whose shadow error is 0.3 (PowerSGD rank 8's level on charlm,
    which ends 3-4% above fp32's loss at equal samples) is not chosen on a slow link, where the model
    predicts it far faster; bf16 (0.002) is. ``max_error=0.5`` admits it."""
    from types import SimpleNamespace

    from thinwire.auto import AutoConfig, AutoPolicy
    from thinwire.auto.agree import Measurements

    def first_choice(config):
        policy = AutoPolicy(config)
        policy.numels, policy.costs = {0: 400_000}, {"bf16": (1e-10, 1e-11), "topk:ratio=0.01": (1e-9, 1e-11)}
        policy._state = SimpleNamespace(wire=SimpleNamespace(world=4))
        policy._measured = lambda: None  # _agree below stands in for every rank's merged record
        policy._agree = lambda measured: lambda: Measurements(**{"alpha": 1e-4, "beta": 8 / 10e6, "pre_s": 0.02, "backward_s": 0.04,
                                 "step_s": 0.4, "errors": {0: 0.0}, "shadow": {0: {"bf16": 0.002, "topk:ratio=0.01": 0.3}},
                                 "window": []})
        policy._check(1)
        policy.sent(0, 1)
        policy._conclude(2)
        return policy.choices

    candidates = ("none", "bf16", "topk:ratio=0.01")
    assert first_choice(AutoConfig(warmup_steps=1, baseline_steps=0, check_every=1, candidates=candidates)) == {
        0: "bf16"}
    assert first_choice(AutoConfig(warmup_steps=1, baseline_steps=0, check_every=1, candidates=candidates,
                                   max_error=0.5)) == {
        0: "topk:ratio=0.01"}


def test_powersgd_shadow_prices_the_per_matrix_scheme_and_runs_one_window_in_use():
    import torch

    from thinwire.compress.codecs.powersgd import PowerSGDConfig, local_approx
    from thinwire.auto import AutoConfig, AutoPolicy

    g = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (96,), (96, 64)]
    low = [torch.randn(64, 2, generator=g) @ torch.randn(2, 96, generator=g), torch.randn(96, generator=g),
           torch.randn(96, 2, generator=g) @ torch.randn(2, 64, generator=g)]
    x = torch.cat([t.reshape(-1) for t in low])
    qs: dict = {}
    out = local_approx(x, shapes, PowerSGDConfig(rank=2), qs)
    assert torch.allclose(out, x, atol=1e-4)           # rank 2 matrices are exact, the vector passes
    assert {i: q.shape for i, q in qs.items()} == {0: (96, 2), 2: (64, 2)}

    policy = AutoPolicy(AutoConfig(warmup_steps=3, check_every=2, candidates=("none", "powersgd:rank=2")))
    noise = lambda: torch.randn(x.numel(), generator=g)  # noqa: E731
    for step in range(3):  # warm-up: low-rank gradients, the flat near-square view would not see it
        policy.observe(0, x * (1 + step), step, shapes)
    assert policy.shadows.errors[0]["powersgd:rank=2"] < 1e-3
    policy.choices = {0: "powersgd:rank=2"}
    policy.shadows.keep_needed(policy.choices, 3)
    for step in range(3, 7):  # in use: full-rank gradients, measured for one window (2 steps), then not
        policy.observe(0, noise(), step, shapes)
    assert len(policy.shadows.lowrank_errors[0]) == 2 and min(policy.shadows.lowrank_errors[0]) > 0.5
    assert (0, "powersgd:rank=2") not in policy.shadows.residuals
    # sent uncompressed for a while, then PowerSGD again: a new first window is measured
    policy.choices = {0: "none"}
    policy.shadows.keep_needed(policy.choices, 7)
    policy.shadows.lowrank_errors.clear()
    policy.choices = {0: "powersgd:rank=2"}
    policy.shadows.keep_needed(policy.choices, 9)
    policy.observe(0, noise(), 9, shapes)
    assert len(policy.shadows.lowrank_errors[0]) == 1


def test_corun_timeout_kills_and_reaps_its_copies():
    """Copies still importing torch when the timeout passes are killed and reaped, not left running."""
    import subprocess

    from thinwire.measure import corun

    def children() -> list[int]:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                if int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        return found

    with pytest.raises(subprocess.TimeoutExpired):
        corun._run(2, ["--workload", "digits", "--batch", "8"], timeout=0.3)
    assert children() == []


def test_an_offload_engine_runs_the_codec_off_compute_at_its_own_speed(tmp_path):
    """Hosts with ``nic:`` price codec work and the collectives' CPU on the engine's cores and take none of
    it from backward; the same hosts without an engine take it from compute (one core, no spare)."""
    from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec, NicSpec
    from thinwire.measure.file import load_profile
    from thinwire.sim.sweep import SimOptions, simulate

    half = 445952 // 2
    prof = load_profile(_profile_file(tmp_path, buckets=[
        {"numel": half, "ready_frac": 0.5, "params": [0], "shapes": [[half]]},
        {"numel": half, "ready_frac": 1.0, "params": [1], "shapes": [[half]]}]))
    opts = SimOptions(codec="bf16", hosts=[4], batch_size=64, scaling="strong", threads=1)

    def predict(nic):
        spec = ClusterSpec(name="t", defaults=DefaultsSpec(bandwidth="10gbit", cpu=1.0, nic=nic),
                           hosts=[HostSpec(name=f"h{i}") for i in range(4)])
        return simulate(spec, prof, opts, default_batch=64)[0].prediction

    inline, engine, slow_engine = predict(None), predict(NicSpec(cpu=1.0)), predict(NicSpec(cpu=0.1))
    assert inline.timeline.backward_s > engine.timeline.backward_s  # inline codec work delays backward
    assert engine.timeline.backward_s == slow_engine.timeline.backward_s  # engines take nothing from it
    assert slow_engine.codec_s == pytest.approx(engine.codec_s * 10)  # codec at 0.1 core instead of 1
    assert engine.step_s < inline.step_s


def test_network_probe_keeps_the_median_small_all_reduce_and_the_fastest_large_one(monkeypatch):
    """Latency is what every collective of a step pays (the median of many small all-reduces: on hosts sharing
    cores the fastest rep misses the hand-offs' waits); bandwidth is the token bucket's (the fastest large rep)."""
    from thinwire.cluster.spec import ClusterSpec, DefaultsSpec, HostSpec
    from thinwire.measure import network

    small = [0.0015] * 5 + [0.009] * 20 + [0.02] * 16       # fastest 1.5 ms, median 9 ms
    large = [0.62, 0.5, 0.55]
    calls = []

    size, gap = network.credit_message(100e6)

    def fake_run(cluster, hosts, sizes, reps, timeout, p2p=False, gap=None):
        if p2p and gap is not None:  # the credit probe: round trips after idle gaps, a 25 kB bucket at 1/beta
            assert len(hosts) == 2 and sizes == [4, size, 2 * size] and gap >= 25_000 / (100e6 / 8)
            r = 100e6 / 8 * 0.9
            return {str(x): [5e-4 + max(0, x - 25_000) / r + e for e in (0, 1e-4, -1e-4)] for x in sizes}
        if p2p:  # the point-to-point probe: two hosts, one-way times
            assert len(hosts) == 2
            return {"one_way": [0.0004, 0.0002, 0.0003]}
        calls.append((tuple(sizes), reps))
        return [small[:reps]] if sizes == [network.SMALL_BYTES] else [large[:reps]]

    class Up:
        def __init__(self, spec):
            self.spec = spec

        def require_up(self):
            pass

    monkeypatch.setattr(network, "_run_workers", fake_run)
    monkeypatch.setattr(network, "EmulatedCluster", Up)
    spec = ClusterSpec(name="probe", defaults=DefaultsSpec(bandwidth="100mbit"),
                       hosts=[HostSpec(name=f"h{i}") for i in range(4)])
    rec = network.probe_network(spec, reps=3)
    assert calls[0] == ((network.SMALL_BYTES,), network.SMALL_REPS) and calls[1][1] == 3
    alpha, beta = network.alpha_beta(rec.sizes, [0.009, 0.5], 4)
    assert rec.times_s == [0.009, 0.5]
    assert rec.alpha_s == pytest.approx(alpha) and rec.alpha_s > 1e-3  # the fastest rep would give ~0.2 ms
    assert rec.measured_bps == pytest.approx(8 / beta)
    assert rec.p2p_latency_s == pytest.approx(0.0003)  # the median one-way time, a pipeline hand-off's latency
    assert rec.burst_bytes == pytest.approx(25_000 * 8 / beta / (100e6 * 0.9))  # the bucket at the measured rate
    # hosts that carry under half the link's rate (emulated hosts at 100 Gbit/s) are not paced by its bucket
    large[:] = [2.0, 2.1, 2.2]  # a quarter of the rate
    slow = network.probe_network(spec, reps=3)
    assert slow.efficiency < network.FILLED and slow.burst_bytes is None


@pytest.mark.parametrize("bucket", [0, 1000, 30_000, 99_000])
def test_credit_probe_reads_a_token_buckets_size_whatever_the_rate_and_latency(bucket):
    """Round trips ``t(x) = t0 + max(0, x - B) / r`` of 4 bytes, s and 2s give B (< s) back for any latency and
    rate; no bucket reads 0."""
    from thinwire.measure import network

    for rate_Bps, t0 in ((12.5e6, 3e-4), (1.2e8, 2e-3)):
        size = 100_000
        t = {x: [t0 + max(0, x - bucket) / rate_Bps] for x in (4, size, 2 * size)}
        got = network.credit_bytes(t[4], t[size], t[2 * size], rate_Bps=rate_Bps, size=size)
        assert got == pytest.approx(bucket, abs=1e-6 * rate_Bps)
    size, gap = network.credit_message(100e6)
    assert size > 32 * 1024 and gap >= 1.5 * size * 8 / 100e6  # the emulator's bucket is smaller, and refills
    assert network.credit_message(10e9)[0] == 10e9 / 8 * 0.008  # 8 ms at the rate: above its 2 ms bucket


def test_auto_state_round_trips_through_a_checkpoint_and_a_run_without_it_warms_up_again(tmp_path, caplog):
    import torch

    from thinwire.auto import AutoConfig, AutoPolicy
    from thinwire.auto.trial import Trial

    config = AutoConfig(warmup_steps=3, baseline_steps=5, check_every=10)
    decided = AutoPolicy(config)
    assert decided.state_dict() == {}  # before the first decision there is nothing to keep
    decided.origin, decided.numels, decided.choices = 0, {0: 100_000}, {0: "int8"}
    decided.decided_bps, decided.costs = 1e8, {"bf16": (1e-5, 1e-9), "int8": (2e-5, 2e-9)}
    decided.banned, decided.tried = {0: {"topk:ratio=0.01"}}, {0: {"powersgd:rank=8": 5e7}}
    decided.shadows.errors = {0: {"bf16": 0.002, "int8": 0.008, "topk:ratio=0.01": 0.78}}
    decided.decisions = [{"step": 9, "reason": "warm-up done", "choices": {"0": "int8"}}]
    path = tmp_path / "sd.pt"
    torch.save(decided.state_dict(), path)  # as the checkpoint holds it: plain values
    sd = torch.load(path, weights_only=True)

    resumed = AutoPolicy(config)
    resumed.load_state_dict(sd)
    assert resumed.choices == {0: "int8"} and resumed.banned == {0: {"topk:ratio=0.01"}}
    assert resumed.shadows.errors == decided.shadows.errors and resumed.decisions == decided.decisions
    assert resumed.codec_for(0, 100_000, 205).name == "int8"
    assert not resumed.busy(0, 206)               # no warm-up: it goes on with the plan
    assert not resumed._due(208)                  # its schedule (checks at 8 + 10k), once this run has a window
    assert resumed._due(218) and not resumed._due(219)

    fresh = AutoPolicy(config)                    # resumed without auto's state (an older checkpoint)
    assert fresh.busy(0, 200) and fresh.busy(0, 202) and not fresh.busy(0, 204)  # a warm-up of its own
    fresh.observe(0, torch.randn(100_000), 200)
    assert fresh.shadows.errors[0]["topk:ratio=0.01"] > 0.5  # the shadows run: the guard sees topk's error
    assert fresh._due(203) and fresh._due(208) and not fresh._due(211)  # baseline window, then every 10

    mid = AutoPolicy(config)                      # a checkpoint during a trial: the plan before it, decided again
    mid.origin, mid.numels, mid.decided_bps, mid.choices = 0, {0: 100_000}, 1e8, {0: "int8"}
    mid.trial = Trial(old={0: "bf16"}, new={0: "int8"}, steps={"old": [0.1], "new": []})
    again = AutoPolicy(config)
    again.load_state_dict(mid.state_dict())
    assert again.choices == {0: "bf16"} and again.decided_bps is None
    assert again._reason(1e8, None) == "resumed from a checkpoint taken during a trial"

    switched = AutoPolicy(config)                 # restarted on the ring: no switch to send through
    switched.origin, switched.numels, switched.decided_bps, switched.choices = 0, {0: 100_000}, 1e8, {0: "int8@switch"}
    ring = AutoPolicy(config)
    ring.load_state_dict(switched.state_dict())
    assert ring.choices == {0: "int8"} and ring.decided_bps is None

    other = AutoPolicy(AutoConfig(candidates=("none", "bf16")))
    with caplog.at_level("WARNING", logger="thinwire.plan"):
        other.load_state_dict(sd)
    assert other.choices == {} and "measuring and deciding again" in caplog.text


def test_auto_holds_a_new_codec_to_its_own_error_not_the_old_codecs():
    """A change of plan applies from the step after the check, so the check's own step ran the old codec and
    its error is already in the next window. Counted there, PowerSGD's (its distributed residual reads ~0.9 a
    step) is held against int8 (~0.01): over a trial's 4-step early look that alone is ~0.19, past the cap (0.1),
    and the guard bans int8 from the bucket for good."""
    from types import SimpleNamespace

    from thinwire.auto import AutoConfig, AutoPolicy

    policy = AutoPolicy(AutoConfig(warmup_steps=1, baseline_steps=0, check_every=10,
                                   candidates=("none", "bf16", "int8", "powersgd:rank=8")))
    policy.numels, policy.choices = {0: 400_000, 1: 400_000}, {0: "powersgd:rank=8", 1: "int8"}
    policy.errors.errors = {"0": [0.9], "1": [0.01]}  # the check's step, sent with the plan in use

    def act(step, shared):
        policy.choices = {0: "int8", 1: "int8"}
    policy._act, policy._pending = act, (lambda: SimpleNamespace(costs={}))
    policy._conclude(12)
    assert policy.errors.window_errors(["0", "1"]) == [0.0, 0.01]  # bucket 1 kept its codec and its error


USER_WORKLOAD = '''
import torch
from torch import nn
import thinwire

def build():
    g = torch.Generator().manual_seed(0)
    data = [(x, int(x.sum() > 0)) for x in torch.randn(64, 8, generator=g)]
    return thinwire.Workload(model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), train=data, val=data,
                             loss=nn.functional.cross_entropy, task="classification", batch_size=8)
'''


def test_probes_of_a_users_workload_find_it_on_the_callers_pythonpath(tmp_path, monkeypatch):
    """The co-run copies (and every child thinwire starts) keep the caller's PYTHONPATH: they replaced it with
    thinwire's own, so `thinwire profile --workload mine:build` died in an IndexError on the copies' empty output."""
    import thinwire.child as child
    from thinwire.errors import ThinwireError
    from thinwire.measure.corun import corun_speed

    (tmp_path / "mine.py").write_text(USER_WORKLOAD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), child.ROOT, ""]))
    assert child.pythonpath().split(os.pathsep) == [child.ROOT, str(tmp_path)]
    assert corun_speed(workload="mine:build", model={}, data=None, batch=8, steps=2, tries=1) > 0
    monkeypatch.setenv("PYTHONPATH", child.ROOT)  # the module nowhere on the path: a clear error, not an IndexError
    with pytest.raises(ThinwireError, match="a copy of the workload's step .* failed .*--no-corun"):
        corun_speed(workload="mine:build", model={}, data=None, batch=8, steps=2, tries=1)


def test_simulate_and_plan_take_the_workload_from_the_profile_when_none_is_named(tmp_path, capsys):
    """`thinwire simulate --profile P` of a user's workload, without --workload: the profile's workload and model
    options (it refused, asking for charlm). Naming another workload is still refused."""
    prof = _profile_file(tmp_path, workload="tests.test_pipeline:wrong_order")
    cluster = ROOT / "examples/clusters/pair-100mbit.yaml"
    assert _cli("simulate", "--cluster", cluster, "--profile", prof, "--out", tmp_path / "sim", "--json") == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["workload"] == "tests.test_pipeline:wrong_order"
    # this profile's model is not the one the workload builds (its size says so): each command warns
    assert "warning: the profile measured 'tests.test_pipeline:wrong_order' with " in out.err
    assert _cli("plan", "--cluster", cluster, "--profile", prof, "--out", tmp_path / "plan.yaml") == 0
    assert "but it builds" in capsys.readouterr().err
    assert "tests.test_pipeline:wrong_order" in (tmp_path / "plan.yaml").read_text()
    assert _cli("simulate", "--cluster", cluster, "--profile", prof, "--workload", "charlm") == 2
    assert "measured workload 'tests.test_pipeline:wrong_order'" in capsys.readouterr().err


def test_simulate_on_a_device_keeps_each_hosts_cpu_share(tmp_path, capsys):
    """`--device D --mfu U` makes every host a D, at its own share of it (cpu:), as plan prices it: plan-a's host
    `slow` (cpu 0.125, a quarter of the others') computed as fast as the others."""
    from tests.test_cli import ROOT

    prof = _profile_file(tmp_path, flops_per_sample=5e8)
    even = tmp_path / "even.yaml"
    even.write_text((ROOT / "examples/clusters/plan-a-slow-cpu.yaml").read_text().replace("cpu: 0.125", "cpu: 0.5"))
    compute = {}
    for spec in (ROOT / "examples/clusters/plan-a-slow-cpu.yaml", even):
        rc = _cli("simulate", "--cluster", spec, "--profile", prof, "--device", "raspberry-pi-5", "--mfu", "0.4",
                  "--out", tmp_path / "sim", "--json")
        assert rc == 0
        compute[spec.name] = json.loads(capsys.readouterr().out)["points"][0]["compute_s"]
    assert compute["plan-a-slow-cpu.yaml"] == pytest.approx(4 * compute["even.yaml"], rel=0.05), compute


def test_a_co_run_speed_above_the_fair_share_is_recorded_as_the_share_with_a_note(capsys):
    """2 copies on 2 cores measured at 1.30 of one alone (the solo timing ran on a busy machine): kept, the
    simulator would price co-located hosts faster than a host alone."""
    from thinwire.measure.run import corun_over_fair

    assert corun_over_fair(1.30, cores=2, n=2) == 1.0
    assert "ran at 1.30 of their fair share" in capsys.readouterr().err
    assert corun_over_fair(0.4, cores=2, n=4) == 0.8 and corun_over_fair(1.02, cores=2, n=2) == 1.0
    assert capsys.readouterr().err == ""


def test_credit_probe_keeps_the_fastest_rep_so_trips_held_up_by_a_busy_machine_do_not_move_it():
    """Three of five 4-byte trips held up 4 ms by other processes (as in a CI run beside other work): the
    medians read 32 KiB as 46 KiB; the bucket after an idle gap is deterministic, so the fastest rep is its time."""
    from thinwire.measure import network

    rate_Bps, size, bucket, t0 = 6.25e6, 131_072, 32 * 1024, 8e-4
    t = {x: [t0 + max(0, x - bucket) / rate_Bps] * 5 for x in (4, size, 2 * size)}
    t[4] = t[4][:2] + [t0 + 4e-3] * 3
    assert network.credit_bytes(t[4], t[size], t[2 * size], rate_Bps=rate_Bps, size=size) == pytest.approx(bucket)


def test_simulate_counts_the_worker_process_and_says_which_hosts_cannot_hold_a_rank(tmp_path, capsys):
    """It showed 11.9 MB per rank and no word on hosts of 100 MiB, where plan said the process alone needs
    249 MiB and the model fits nowhere."""
    spec = tmp_path / "small.yaml"
    spec.write_text("name: small\ndefaults: {bandwidth: 1gbit, cpu: 1.0}\nhosts: [{name: a, memory: 100MiB}, "
                    "{name: b}]\n")
    prof = _profile_file(tmp_path, runtime_bytes=250 * 2**20)
    rc = _cli("simulate", "--cluster", spec, "--profile", prof, "--out", tmp_path / "sim")
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "a (100 MiB): below the" in out and "b (" not in out.split("a (100 MiB)")[0], out[-2000:]
    point = json.loads((tmp_path / "sim" / "simulate.json").read_text())["points"][-1]
    assert point["memory"]["runtime"] == 250 * 2**20 and point["memory_per_rank_bytes"] > 250 * 2**20


def test_strong_scalings_speedup_is_against_one_host_on_the_whole_batch(tmp_path):
    """Each row's speedup was against one host on that row's per-host batch: it rose from 2 to 8 hosts while the same
    global batch got slower. Now one host's step on the whole batch over this one: inverse to the step column."""
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.measure.file import load_profile
    from thinwire.sim.sweep import SimOptions, simulate

    spec = load_cluster_spec(ROOT / "examples/clusters/two-sites.yaml")
    points = simulate(spec, load_profile(_profile_file(tmp_path)),
                      SimOptions(hosts=[1, 2, 4, 8], batch_size=64, scaling="strong"), default_batch=64)
    one = points[0]
    for pt in points[1:]:
        assert pt.speedup / one.speedup == pytest.approx(one.prediction.step_s / pt.prediction.step_s, rel=1e-6)
