"""Measure the network's alpha (latency per message) and beta (seconds per byte) on an emulated cluster.

Two all-reduce probes with :mod:`thinwire.cluster.bench`'s workers (gloo, one process per host,
each rep after a barrier, the slowest rank's time): a small one (4 KiB), whose time is mostly latency,
and a large one lasting about half a second at the configured rate. For the large one the fastest of
``reps`` is kept: the link is deterministic (a token bucket), so slower reps measure other processes
on the machine, not the network. For the small one the median of ``SMALL_REPS`` is kept: its time is
the hosts' own hand-offs between threads and processes (a gloo all-reduce passes ~30 messages and
wake-ups per rank), which is what every collective of a step pays. Emulated hosts sharing a few cores
wait for one at each hand-off: on this 2-core machine a 4 KiB all-reduce across 4 idle hosts takes
7-10 ms at the median and under 2 ms at its fastest (``benchmarks/results/validation_probe.md``), and the
model priced from the fastest under-predicted codecs with several collectives per bucket by up to
27%. (A 4-byte all-reduce, which gloo sends another way, takes 0.7 ms and is no measure of it.)
With the ring all-reduce model ``t = 2 (p-1) alpha + 2 (p-1)/p n beta``
the two points give::

    beta  = (t_large - t_small) / (2 (p-1)/p (n_large - n_small))
    alpha = (t_small - 2 (p-1)/p n_small beta) / (2 (p-1))

``efficiency = 8 / beta / configured rate`` is the share of the link's rate that carries payload
(~0.93 here: headers and TCP's slack); the simulator applies it to every link of a spec.

A pipeline's stages hand over activations point to point, one message at a time, without the
all-reduce's algorithm: a fourth probe passes 4 bytes back and forth between two hosts (``send``/``recv``)
and keeps the median one-way time (``p2p_latency_s``; 0.1-0.3 ms between idle emulated hosts here, a
tenth of the all-reduce's ``alpha``), the latency :mod:`thinwire.sim.pipeline` charges per hand-off.

A link shaped by a token bucket (tc's tbf, as the emulator shapes every host's link; a cloud VM's egress
limit) lets what its bucket holds leave at once after an idle gap, at the speed of the wire beneath it,
not at its rate: on the emulator at 100 Mbit/s a 32 KiB message after a pause arrives in 0.1-0.5 ms
instead of 2.6 (``benchmarks/results/link_burst.md``). A fifth probe times, between two hosts, one
message's round trip (a 4-byte reply) after an idle gap that refills such a bucket: of 4 bytes (``t_0``),
of ``s`` bytes, larger than the bucket (8 ms at the rate, at least 64 KiB; ``t_1``), and of ``2s``
(``t_2``). With ``t(x) = t_0 + max(0, x - B) / r``, the bucket's ``B / r = t_2 - 2 t_1 + t_0``, whatever the
rate; times the measured rate it is ``burst_bytes`` (the fastest of the reps; about 0 on a link that is not
shaped so). Where the hosts cannot fill the link (the all-reduce probe carried under half its rate, as
emulated hosts at 100 Gbit/s, whose CPU paces every byte), no bucket paces them and the probe is skipped.
The pipeline model charges a hand-over only for the bytes beyond the credit its link has gathered while
idle.

Where hosts have a CPU quota, a third probe (:func:`thinwire.cluster.bench.busy_latency`) measures what
a collective issued while they compute waits per ring hop (``busy_hop_s``; the model adds it to the
buckets that go out during backward).
"""

from __future__ import annotations

import statistics

from thinwire.cluster.bench import _run_workers, bus_factor, busy_latency, default_sizes
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import ClusterSpec
from thinwire.measure.file import NetworkRecord

SMALL_BYTES = 4096
SMALL_REPS = 41   # the small probe's median is kept (module docstring); ~0.5 s at 10 ms each
CREDIT_REPS = 7   # the credit probe's reps per size (module docstring)
FILLED = 0.5      # the credit probe runs where the all-reduce probe carried at least this share of the link's rate


def credit_message(rate_bps: float) -> tuple[int, float]:
    """The credit probe's size ``s`` (bytes: 8 ms at ``rate_bps``, at least 64 KiB, a multiple of 4) and its
    idle gap (seconds: 1.5 times ``s``'s time at the rate, which refills a bucket smaller than ``s``, at
    least 20 ms)."""
    size = int(max(64 * 1024, rate_bps / 8 * 0.008)) // 4 * 4
    return size, max(0.02, 1.5 * size * 8 / rate_bps)


def credit_bytes(t0: list[float], t1: list[float], t2: list[float], *, rate_Bps: float, size: int) -> float:
    """A token bucket's credit (bytes, within ``[0, size]``) from the credit probe's round trips of 4 bytes,
    ``size`` and ``2 size`` bytes after idle gaps, at the measured ``rate_Bps`` (module docstring). The fastest
    rep of each size, as the large all-reduce probe keeps: a token bucket after an idle gap is deterministic,
    so a slower rep measured a busy machine (a few 4-byte trips held up by other processes moved the medians'
    credit by half a bucket)."""
    return min(float(size), max(0.0, (min(t2) - 2 * min(t1) + min(t0)) * rate_Bps))


def alpha_beta(sizes: list[int], times: list[float], p: int) -> tuple[float, float]:
    """(alpha seconds, beta seconds/byte) from a small and a large all-reduce (see module docstring)."""
    (n0, n1), (t0, t1) = sizes, times
    f = bus_factor(p)
    beta = max(1e-15, (t1 - t0) / (f * (n1 - n0)))
    alpha = max(0.0, (t0 - f * n0 * beta) / (2 * (p - 1)))
    return alpha, beta


def probe_network(spec: ClusterSpec, *, reps: int = 7, hosts: list[str] | None = None,
                  timeout: float = 300.0) -> NetworkRecord:
    cluster = EmulatedCluster(spec)
    cluster.require_up()
    hosts = hosts or spec.host_names
    expected = min(spec.bandwidth_bps(a, b) for a in hosts for b in hosts if a != b)
    sizes = [SMALL_BYTES, default_sizes(expected, len(hosts))[1]]
    (small,) = _run_workers(cluster, hosts, sizes[:1], max(reps, SMALL_REPS), timeout)
    (large,) = _run_workers(cluster, hosts, sizes[1:], reps, timeout)
    times = [statistics.median(small), min(large)]
    p = len(hosts)
    alpha, beta = alpha_beta(sizes, times, p)
    capped = any(spec.host(h).cpu is not None for h in hosts)
    busy = busy_latency(cluster, hosts=hosts, reps=max(30, 5 * reps), timeout=timeout).wait_per_hop_s if capped else 0.0
    p2p = burst = None
    if p > 1:
        p2p = statistics.median(_run_workers(cluster, hosts[:2], [4], SMALL_REPS, timeout, p2p=True)["one_way"])
        if 8 / beta >= FILLED * expected:  # hosts that cannot fill the link are not paced by its bucket
            size, gap = credit_message(spec.bandwidth_bps(hosts[0], hosts[1]))
            trips = _run_workers(cluster, hosts[:2], [4, size, 2 * size], CREDIT_REPS, timeout, p2p=True, gap=gap)
            burst = credit_bytes(trips["4"], trips[str(size)], trips[str(2 * size)], rate_Bps=1 / beta, size=size)
    return NetworkRecord(alpha_s=alpha, efficiency=min(1.0, 8 / beta / expected), nominal_bps=expected,
                         measured_bps=8 / beta, hosts=p, cluster=spec.name, sizes=sizes, times_s=times,
                         busy_hop_s=busy, p2p_latency_s=p2p, burst_bytes=burst)
