"""The planner's search: enumerate host subsets and groupings, balance batch shares, pick codecs, score.

Every candidate is priced with the performance model (:mod:`thinwire.perf`), no measurement:

1. **Hosts** (:func:`subsets`): all hosts that fit the model, and the subsets left after dropping
   the slowest hosts by compute speed, by access bandwidth, or a whole group (each threshold is one
   of the hosts' own distinct values, at most :data:`MAX_THRESHOLDS` of them), and the 1, 2, 4, ... fastest
   of each such subset (fewer of the same hosts win where communication costs more than their compute saves).
2. **Shares** (:func:`allocate`): batch units are handed out one at a time to the host that would
   finish its compute soonest with one more (greedy, which is optimal for minimising the largest of
   non-decreasing per-host times); every host gets at least one sample. Each host's time counts its
   gradient accumulation: ``k = ceil(share / micro)`` micro-batches, with ``micro`` capped by memory.
3. **Grouping** (:func:`groupings`): a flat ring over the subset; hierarchical over the spec's groups;
   hierarchical over bandwidth tiers inside groups (a host behind a slow access link becomes its own
   group). Hierarchical: dense fp32 all-reduce inside each group, the codec between group leaders,
   broadcast back inside each group.
4. **Codecs** (:func:`best_codecs`): each candidate codec on every bucket, then the per-bucket
   coordinate descent ``auto`` runs too (:func:`thinwire.plan.choose.descend`) from the best single
   one (last bucket first: the least hidden behind backward); a codec must beat the current one by
   ``min_gain`` to replace it, so ties go to the lighter codec.
5. **Prune**: a subset's balanced compute time is a lower bound of its step (and of its time to
   target: sample factors are at least 1); subsets are tried in order of that bound and skipped once
   it cannot reach the ``keep``-th best found.

**The objective** is the predicted time to DDP fp32's loss, :attr:`Scored.time_s`: the step, plus the
run's validation spread over the steps between validations (:func:`validation_s`), times the sample
factor of the codecs the candidate sends with (``Problem.factors``, from the convergence guard; the
largest over its buckets' codecs). With no factors (``--rank step``, or a profile without the guard)
every factor is 1. Validation counts because the trainer splits it over the plan's hosts (by their shares of
the batch where those differ): a plan on fewer hosts validates more items on each (denoise on two groups of
two half-core hosts, 50 global batches: 0.71 s per validation on 2 hosts, 0.34 s on 4;
benchmarks/results/validation_cost.md).

Scoring (:func:`score`) follows :func:`thinwire.perf.model.predict_step` but with per-host compute: bucket
``i`` is ready when its gradient is ready on the *last* host, ``max_h(pre_h + f_i * backward_h)``;
the overlap timeline (:func:`thinwire.perf.timeline.overlap_timeline`) then serialises the buckets'
communication as DDP and thinwire's communication thread do.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable, Sequence

from thinwire.perf import collectives as coll
from thinwire.perf.model import Bucket, CodecModel, Compute, Network, bucket_cost
from thinwire.perf.straggler import blom_z
from thinwire.perf.timeline import Timeline, overlap_timeline
from thinwire.plan.choose import descend

MAX_THRESHOLDS = 8
TIER_RATIO = 2.0  # hosts whose access links differ by more than this are in different bandwidth tiers


@dataclasses.dataclass(frozen=True)
class HostModel:
    """A host as the planner sees it. ``cap_dense``/``cap_comp``: largest micro-batch that fits its
    memory without / with error-feedback residuals (None: no limit; 0: does not fit)."""

    name: str
    group: str
    speed: float
    cores: float
    bandwidth: float
    cap_dense: int | None = None
    cap_comp: int | None = None
    nic_cpu: float | None = None   # an offload engine's cores (``nic:`` in the spec): codec work runs there


@dataclasses.dataclass
class Problem:
    """Everything a candidate is scored against (built by :mod:`thinwire.plan.planner`)."""

    hosts: list[HostModel]               # usable hosts, in ring order (group by group)
    buckets: list[Bucket]
    compute: Callable[[int], Compute]    # per-rank batch -> seconds at speed 1
    codecs: dict[str, CodecModel]        # candidates, lightest first, "none" included
    links: dict[frozenset, float]        # group pair -> bit/s
    alpha_s: float                       # a hop's latency inside a group
    efficiency: float
    batch: int
    cpu_s_per_byte: float = 0.0          # a collective's host CPU per byte sent, at speed 1
    busy_hop_s: float = 0.0              # a ring hop's wait for a CPU quota while hosts compute (perf.timeline)
    threads: int = 1
    min_gain: float = 0.02
    factors: dict[str, float] = dataclasses.field(default_factory=dict)  # codec -> sample factor (absent: 1)
    # the cluster's aggregator on the switch (spec ``switch:``): int8 codecs' models through it, its speed
    # (cores, one thread) and its measured CPU per bucket and trainer; empty: no switch to aggregate in
    switch_codecs: dict[str, CodecModel] = dataclasses.field(default_factory=dict)
    switch_speed: float | None = None
    switch_cpu: tuple[float, float] | None = None
    switch_trainer_cpu: tuple[float, float] | None = None  # a trainer's own CPU per exchange, measured
    val_items: int = 0                   # validation items per evaluation (0: validation not priced)
    latencies: dict[frozenset, float] = dataclasses.field(default_factory=dict)  # group pair -> a link's own latency
    eval_every: int = 1                  # steps between evaluations
    scored: int = 0                      # candidates priced so far
    _memo: dict = dataclasses.field(default_factory=dict)

    def host_compute(self, batch: int, micro: int) -> Compute:
        """Phases of one step of ``batch`` samples in micro-batches of at most ``micro`` (speed 1): the
        earlier micro-batches' forward + backward run before the last one's, whose backward overlaps
        communication (DDP's ``no_sync`` until the last)."""
        key = (batch, micro)
        if key not in self._memo:
            k = math.ceil(batch / micro)
            sizes = [batch // k + (1 if i < batch % k else 0) for i in range(k)]
            parts = [self.compute(s) for s in sizes]
            head = sum(p.pre_s + p.backward_s for p in parts[:-1])
            last = parts[-1]
            self._memo[key] = Compute(pre_s=head + last.pre_s, backward_s=last.backward_s, post_s=last.post_s,
                                      std_s=max(p.std_s for p in parts))
        return self._memo[key]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A candidate: host indices (into ``Problem.hosts``), their shares and micro-batches, groups
    (tuples of host indices, leader first; ``None`` for a flat ring) and a codec per bucket."""

    hosts: tuple[int, ...]
    shares: tuple[int, ...]
    micro: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...] | None
    codecs: tuple[str, ...]
    uniform: bool = False
    switch: bool = False  # int8 buckets through the aggregator on the switch (flat layouts only)


@dataclasses.dataclass(frozen=True)
class Scored:
    layout: Layout
    step_s: float
    compute_s: float
    timeline: Timeline
    bytes_per_step: int      # the busiest rank's, every collective
    codec_bytes: int         # of which through the codec (the ring, or between group leaders)
    factor: float = 1.0      # samples relative to DDP fp32 to reach its loss (the guard's, largest over the codecs)
    steals: bool = False     # no spare core for the communication thread: codec work is taken from compute
    val_s: float = 0.0       # one validation's predicted seconds (0: not priced)
    val_per_step_s: float = 0.0  # val_s over the steps between validations
    noise_s: float = 0.0     # the slowest host's expected noise, in step_s, not in compute_s (as predict_step's)

    @property
    def time_s(self) -> float:
        """The objective: predicted seconds per fp32-equivalent step ((step + its share of validation) x
        sample factor)."""
        return (self.step_s + self.val_per_step_s) * self.factor


# -- pricing -----------------------------------------------------------------------------------------
def ring_network(pb: Problem, idx: Sequence[int]) -> Network:
    hs = [pb.hosts[i] for i in idx]
    rates = coll.ring_edge_rates([h.bandwidth for h in hs], [h.group for h in hs], pb.links)
    groups = {h.group for h in hs}  # a link's latency slows only the rings that cross it
    latency = max((s for pair, s in pb.latencies.items() if pair <= groups), default=0.0)
    return Network(alpha_s=pb.alpha_s + latency, beta_s_per_byte=coll.ring_beta(rates, pb.efficiency),
                   cpu_s_per_byte=pb.cpu_s_per_byte, switch_speed=pb.switch_speed, switch_cpu=pb.switch_cpu,
                   switch_trainer_cpu=pb.switch_trainer_cpu)


def _bucket(pb: Problem, lay: Layout, i: int, codec_speed: float) -> tuple[float, float, float, int, int, float, int]:
    """(encode, wire, decode seconds, bytes the busiest rank sends, of which through the codec, the
    collectives' host CPU seconds, ring hops on the critical path) of bucket ``i``."""
    n, codec = pb.buckets[i].numel, pb.codecs[lay.codecs[i]]
    if lay.switch:
        codec = pb.switch_codecs.get(lay.codecs[i], codec)  # other codecs still go around the ring
    if lay.groups is None:
        c = bucket_cost(codec, i, n, len(lay.hosts), ring_network(pb, lay.hosts), codec_speed)
        return c.encode_s, c.comm_s, c.decode_s, c.bytes_sent, c.bytes_sent, c.comm_cpu_s, c.hops
    intra = bcast = 0.0
    intra_bytes = intra_hops = 0
    for g in lay.groups:
        if len(g) > 1:
            net = ring_network(pb, g)
            intra = max(intra, coll.ring_allreduce_s(4 * n, len(g), alpha=net.alpha_s, beta=net.beta_s_per_byte))
            bcast = max(bcast, (len(g) - 1) * (net.alpha_s + 4 * n * net.beta_s_per_byte))  # gloo: root to each
            intra_bytes = max(intra_bytes, 2 * (len(g) - 1) * 4 * n // len(g) + (len(g) - 1) * 4 * n)
            intra_hops = max(intra_hops, 3 * (len(g) - 1))  # the all-reduce's 2(g-1), the broadcast's g-1
    leaders = [g[0] for g in lay.groups]
    c = bucket_cost(codec, i, n, len(leaders), ring_network(pb, leaders), codec_speed)
    cpu = intra_bytes * pb.cpu_s_per_byte / codec_speed + c.comm_cpu_s
    return (c.encode_s, intra + c.comm_s + bcast, c.decode_s, intra_bytes + c.bytes_sent, c.bytes_sent, cpu,
            intra_hops + c.hops)


def score(pb: Problem, lay: Layout) -> Scored:
    """Predicted step of a candidate (see the module docstring)."""
    pb.scored += 1
    pre, bwd, post, std = [], [], [], []
    for h, b, m in zip(lay.hosts, lay.shares, lay.micro):
        c, s = pb.host_compute(b, m), pb.hosts[h].speed
        pre.append(c.pre_s / s), bwd.append(c.backward_s / s), post.append(c.post_s / s), std.append(c.std_s / s)
    ready = [max(p + min(1.0, max(0.0, bk.ready_frac)) * b for p, b in zip(pre, bwd)) for bk in pb.buckets]
    end = max(p + b for p, b in zip(pre, bwd))
    coders = lay.hosts if lay.groups is None else [g[0] for g in lay.groups]
    codec_speed, steals = _coder(pb, coders)
    costs = [_bucket(pb, lay, i, codec_speed) for i in range(len(pb.buckets))] if len(lay.hosts) > 1 else \
        [(0.0, 0.0, 0.0, 0, 0, 0.0, 0)] * len(pb.buckets)
    noise = max(std) * blom_z(len(lay.hosts))
    tl = overlap_timeline(ready_s=ready, comm_s=[c[1] for c in costs], encode_s=[c[0] for c in costs],
                          decode_s=[c[2] for c in costs], comm_cpu_s=[c[5] for c in costs], backward_s=end, pre_s=noise,
                          post_s=max(post), codec_steals_compute=steals, busy_wait_s=[c[6] * pb.busy_hop_s for c in costs])
    compute = max(p + b + q for p, b, q in zip(pre, bwd, post))
    factor = max((pb.factors.get(c, 1.0) for c in set(lay.codecs)), default=1.0) if len(lay.hosts) > 1 else 1.0
    val = validation_s(pb, lay)
    return Scored(lay, tl.step_s, compute, tl, sum(c[3] for c in costs), sum(c[4] for c in costs), factor, steals,
                  val, val / max(1, pb.eval_every), noise)


def validation_s(pb: Problem, lay: Layout) -> float:
    """One validation's predicted seconds: as the trainer runs it (``train.loop._validate``), each rank takes
    its part of ``pb.val_items`` items (:func:`~thinwire.workloads.base.eval_part`: equal parts for equal
    shares, else parts proportional to the shares) and forwards them its share at a time; the slowest rank
    decides (the result is all-reduced). A forward is priced at the profile's data + forward phase (``pre_s``,
    measured with autograd on: a slight over-estimate of a no-grad forward)."""
    if pb.val_items <= 0:
        return 0.0
    from thinwire.workloads.base import eval_part  # torch: only where validation is priced

    worst, shares = 0.0, [max(1, s) for s in lay.shares]
    for r, (h, share) in enumerate(zip(lay.hosts, shares)):
        items = len(eval_part(pb.val_items, shares, r))
        if items == 0:
            continue
        full, last = divmod(items, share)
        t = full * pb.compute(share).pre_s + (pb.compute(last).pre_s if last else 0.0)
        worst = max(worst, t / pb.hosts[h].speed)
    return worst


def _coder(pb: Problem, coders: Sequence[int]) -> tuple[float, bool]:
    """(codec speed, whether codec work takes from compute) from the slowest coding host, as
    :func:`thinwire.sim.inputs.engine_codec` prices it for ``simulate``: on an offload engine (``nic:``)
    at the engine's cores (one thread: at most speed 1), taking nothing from compute; else at the host's
    speed, from backward when the host has no core to spare beside its compute threads."""
    slow = min(coders, key=lambda h: pb.hosts[h].speed)
    nic = pb.hosts[slow].nic_cpu
    if nic is not None:
        return min(1.0, nic), False
    return min(1.0, pb.hosts[slow].speed), min(pb.hosts[h].cores for h in coders) < pb.threads + 1


# -- shares ------------------------------------------------------------------------------------------
def micro_for(cap: int | None, share: int) -> int:
    return share if cap is None else max(1, min(cap, share))


def allocate(pb: Problem, idx: Sequence[int], caps: Sequence[int | None]) -> tuple[tuple[int, ...], float] | None:
    """Greedy min-max shares for hosts ``idx`` (see the module docstring); None if the batch is too small."""
    if pb.batch < len(idx):
        return None

    def t(j: int, b: int) -> float:
        return pb.host_compute(b, micro_for(caps[j], b)).total_s / pb.hosts[idx[j]].speed

    shares = [1] * len(idx)
    heap = [(t(j, 2), j) for j in range(len(idx))]
    heapq.heapify(heap)
    for _ in range(pb.batch - len(idx)):
        _, j = heapq.heappop(heap)
        shares[j] += 1
        heapq.heappush(heap, (t(j, shares[j] + 1), j))
    return tuple(shares), max(t(j, b) for j, b in enumerate(shares))


def even(batch: int, p: int) -> tuple[int, ...]:
    return tuple(batch // p + (1 if i < batch % p else 0) for i in range(p))


# -- the candidates ----------------------------------------------------------------------------------
def _thresholds(values: list[float]) -> list[float]:
    distinct = sorted(set(values), reverse=True)
    if len(distinct) > MAX_THRESHOLDS:  # quantiles of the distinct values
        distinct = [distinct[round(i * (len(distinct) - 1) / (MAX_THRESHOLDS - 1))] for i in range(MAX_THRESHOLDS)]
    return distinct


def subsets(pb: Problem) -> list[tuple[int, ...]]:
    """Host subsets worth pricing: all, minus slow-compute, slow-link or whole groups (see the module
    docstring); with fewer samples than hosts, also the ``batch`` fastest hosts."""
    hs, everyone = pb.hosts, tuple(range(len(pb.hosts)))
    groups = sorted({h.group for h in hs})
    groupsets = [set(groups)]
    if 1 < len(groups) <= MAX_THRESHOLDS:
        groupsets += [{g} for g in groups]  # one group alone
        if len(groups) > 2:
            groupsets += [set(groups) - {g} for g in groups]  # all but one group
    out: dict[tuple[int, ...], None] = {}
    for gs in groupsets:
        for ts in _thresholds([h.speed for h in hs]):
            for tb in _thresholds([h.bandwidth for h in hs]):
                sub = tuple(i for i in everyone if hs[i].group in gs and hs[i].speed >= ts and hs[i].bandwidth >= tb)
                if sub and len(sub) <= pb.batch:
                    out.setdefault(sub, None)
    def fastest(sub, k):
        return tuple(sorted(sorted(sub, key=lambda i: (-hs[i].speed, -hs[i].bandwidth, i))[:k]))

    if pb.batch < len(hs):  # fewer samples than hosts: the fastest ones, one sample each at least
        out.setdefault(fastest(everyone, pb.batch), None)
    # the k fastest of each (k = 1, 2, 4, ...): where communication costs more than another host's compute saves,
    # fewer of the same hosts are faster, and a threshold keeps every host of a class (given 64 more hosts like
    # its two best, a plan took four of them, 11% slower)
    for sub in list(out):
        k = 1
        while k < len(sub):
            out.setdefault(fastest(sub, k), None)
            k *= 2
    return list(out)


def groupings(pb: Problem, idx: Sequence[int]) -> list[tuple[tuple[int, ...], ...] | None]:
    """A flat ring, and the hierarchical groupings of ``idx`` that differ from it (leader = fastest)."""
    out: list = [None]
    for key in (lambda i: pb.hosts[i].group, lambda i: (pb.hosts[i].group, _tier(pb, i))):
        parts: dict = {}
        for i in idx:
            parts.setdefault(key(i), []).append(i)
        if 1 < len(parts) < len(idx):
            g = tuple(tuple(sorted(p, key=lambda i: (-pb.hosts[i].speed, -pb.hosts[i].bandwidth, i)))
                      for p in parts.values())
            if g not in out:
                out.append(g)
    return out


def _tier(pb: Problem, i: int) -> int:
    top = max(h.bandwidth for h in pb.hosts)
    return int(math.floor(math.log(top / pb.hosts[i].bandwidth, TIER_RATIO) + 1e-9))


def caps_for(pb: Problem, idx: Sequence[int], groups) -> tuple[list[int | None], bool]:
    """Micro-batch caps of ``idx`` and whether codecs may run: hosts that compress (all on a ring,
    leaders when hierarchical) need room for residuals; if one lacks it, the candidate stays dense."""
    coders = set(idx) if groups is None else {g[0] for g in groups}
    if all(pb.hosts[i].cap_comp is None or pb.hosts[i].cap_comp >= 1 for i in coders):
        return [pb.hosts[i].cap_comp if i in coders else pb.hosts[i].cap_dense for i in idx], True
    return [pb.hosts[i].cap_dense for i in idx], False


def best_codecs(pb: Problem, lay: Layout, allowed: Sequence[str], passes: int = 2) -> Scored:
    """Best single codec, then per-bucket coordinate descent from it (see the module docstring)."""
    singles = [score(pb, dataclasses.replace(lay, codecs=(c,) * len(pb.buckets))) for c in allowed]
    best = singles[0]
    for s in singles[1:]:  # lightest first: a heavier codec must gain min_gain to win
        if s.time_s < best.time_s * (1 - pb.min_gain):
            best = s
    passes = passes if len(pb.buckets) > 1 and len(allowed) > 1 else 0
    start = best.layout

    def price(codecs: tuple[str, ...]) -> Scored:
        return score(pb, dataclasses.replace(start, codecs=codecs))

    return descend(start.codecs, best, allowed, price, seconds=lambda s: s.time_s, min_gain=pb.min_gain,
                   passes=passes)[1]


def uniform(pb: Problem, codec: str, idx: Sequence[int] | None = None) -> Scored | None:
    """Uniform DDP: even shares over ``idx`` (default all usable hosts), a flat ring, one codec."""
    idx = tuple(range(len(pb.hosts))) if idx is None else tuple(idx)
    if pb.batch < len(idx):
        return None
    shares = even(pb.batch, len(idx))
    caps, ok = caps_for(pb, idx, None)
    if codec != "none" and not ok:
        return None
    micro = tuple(micro_for(c, s) for c, s in zip(caps, shares))
    return score(pb, Layout(idx, shares, micro, None, (codec,) * len(pb.buckets), uniform=True))


def search(pb: Problem, keep: int = 8) -> list[Scored]:
    """The ``keep`` best candidates by time to target, best first (uniform DDP with every single codec
    is always priced, so the first is never predicted slower than any of them); ``pb.scored`` counts
    what was priced."""
    found: dict[Layout, Scored] = {}
    for c in pb.codecs:
        s = uniform(pb, c)
        if s is not None:
            found[s.layout] = s
    work = []
    for idx in subsets(pb):
        for groups in groupings(pb, idx):
            caps, can_compress = caps_for(pb, idx, groups)
            shares = allocate(pb, idx, caps)
            if shares is not None:
                work.append((shares[1], idx, groups, caps, shares[0], can_compress))
    work.sort(key=lambda w: w[0])
    for bound, idx, groups, caps, shares, can_compress in work:
        ranked = sorted(s.time_s for s in found.values())
        if len(ranked) >= keep and bound >= ranked[keep - 1]:
            continue
        micro = tuple(micro_for(c, s) for c, s in zip(caps, shares))
        lay = Layout(tuple(idx), shares, micro, groups, ("none",) * len(pb.buckets))
        allowed = list(pb.codecs) if can_compress else ["none"]
        best = best_codecs(pb, lay, allowed)
        found.setdefault(best.layout, best)
    for s in list(found.values()):  # each flat layout with int8 buckets again, through the switch
        if s.layout.groups is None and len(s.layout.hosts) > 1 and set(s.layout.codecs) & set(pb.switch_codecs):
            sw = score(pb, dataclasses.replace(s.layout, switch=True))
            found[sw.layout] = sw
    unique: dict[tuple, Scored] = {}
    for s in found.values():  # the same decision found by the search and as uniform DDP: keep the uniform label
        key = dataclasses.replace(s.layout, uniform=False)
        if key not in unique or s.layout.uniform:
            unique[key] = s
    ranked = sorted(unique.values(), key=lambda s: (s.time_s, s.step_s, -len(s.layout.hosts), not s.layout.uniform,
                                                    s.layout.switch, s.layout.codecs))
    # a heavier codec must gain min_gain to come first, as inside best_codecs: uniform DDP with each codec is
    # ranked by its time alone, and put int8 ahead of none for a 0.2% gain (bf16 ahead on one host, saving 0 ms)
    light = {c: i for i, c in enumerate(pb.codecs)}  # lightest first, none first
    near = [s for s in ranked if ranked and s.time_s <= ranked[0].time_s * (1 + pb.min_gain)]
    if near:
        first = min(near, key=lambda s: (max(light.get(c, len(light)) for c in s.layout.codecs), ranked.index(s)))
        ranked.remove(first)
        ranked.insert(0, first)
    return ranked[:keep]
