"""``dynamic:threshold=D,check_every=B``: dynamic averaging, parameters averaged only when they drift.

Kamp et al., "Efficient Decentralized Deep Learning by Dynamic Model Averaging" (ECML PKDD 2018,
https://arxiv.org/abs/1807.03210): every rank steps locally; every B steps each rank tests its own
condition, the drift of its parameters from the reference model ``a`` (the last average),
``||x_i - a|| / ||a|| > D``; a one-byte vote (a MAX all-reduce of one ``uint8``) tells every rank
whether any rank has drifted, and only then the ranks average, as local SGD does (the change since
the last average through the codec with error feedback, :class:`~.local.LocalSGD`). While the models
agree (a converged model, a stable data distribution) little is sent; when they drift apart (fast
learning, concept drift at some hosts) averaging comes back by itself. The paper reports about an
order of magnitude less communication than periodic averaging at almost the same quality.

The threshold is relative to the reference's norm, so one value means the same for a small and a
large model: D averages once the parameters have moved D of their norm away from the last average.
The drift of a step falls as the learning rate decays and as the model settles, so one D averages
often early and rarely late (charlm, 200 steps: averages at steps 12, 20, 28, ... 112, 152 with D =
0.1). The default, D = 0.05, was chosen on two workloads with skewed data against averaging at every
check (D -> 0, which is periodic averaging every B steps): charlm on 4 workers with a file each,
2.3x fewer bytes for +1.3% validation loss (one seed); digits on 8 workers with label-skewed shards,
2.2x fewer bytes for +3% (the median of 3 seeds' gaps, -9% to +8%). D = 0.01 averaged at 90% of the
checks on both, which saves almost nothing; larger D saves more and costs more (D = 0.1: 5x and +4%
on charlm: ``benchmarks/results/dynamic_threshold.md``; the digits sweep is in ``decentral.md``).
The rule is not always the better schedule at equal bytes: on label-skewed digits D = 0.3 averaged
5-6 times, early (seed 0 at steps 20, 32, 44, 64, 100, 184 of 300; seed 1 last at 128), and ended
22% above averaging every 4 steps, while averaging every 40 steps (as many bytes) ended 2% below it;
on charlm D = 0.1 ended 1.5% below averaging every 20 steps (as many bytes). To pick D: a smaller D
averages more; divide one step's relative change (early in training often 1e-3 to 1e-2, later far
less) into D for the period the rule gives at that stage; ``syncs`` and ``checks`` (in the mode's
state and the run's summary) show the rate a run got. Validation and the checkpoint's model are the
ranks' average (:meth:`~.base.SyncMode.consensus`), as for every mode whose ranks diverge.

``rule=spread`` tests what averaging removes instead: the ranks' spread around their mean,
``sqrt(mean_i ||x_i - xbar||^2) / ||a|| > D`` (the paper's divergence, which its local conditions
bound without communication). The drift rule also counts the ranks' common motion, which averaging
leaves as it is: ranks that learn the same thing from similar data drift far from the last average
and agree. Every rank sends a count sketch of ``x_i - a`` (256 values, the parameters hashed into
buckets with random signs; linear, so the spread of the sketches is the sketch of the spread, within
about 9%), its squared norm and ``||a||^2`` in one fp64 all-reduce (2 KiB) in place of the one-byte
vote; every rank computes the same value from the same sum, so they decide alike. The sketch's hashes
cost 2 bytes per parameter. Its thresholds mean less drift than the drift rule's (the spread excludes
the common motion).

``by_lr=1`` scales the threshold by the learning rate over its peak so far (read from the step's
optimizer, the same on every rank). A step's drift is about the learning rate times the update's size,
so under a decaying schedule a fixed threshold is crossed more and more rarely and the late, low-rate
part of a run goes without averages, while the ranks' models still move apart; with ``by_lr`` a
threshold means a number of peak-rate steps' worth of drift throughout (with Adam's near-constant
update size, close to a fixed period that shortens where ranks disagree faster).
``benchmarks/results/dynamic_rules.md`` compares the rules on the same two workloads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.compress.sync.base import StepParts
from thinwire.compress.sync.local import LocalSGD
from thinwire.compress.wire import ring_allreduce_bytes
from thinwire.errors import ThinwireError
from thinwire.perf.sync import dynamic_step_s

SKETCH = 256        # rule=spread: values per rank's sketch (2 KiB in fp64)
CHUNK = 1 << 20     # coordinates sketched at a time


class Dynamic(LocalSGD):
    name = "dynamic"
    state_keys = ("steps", "anchor", "checks", "syncs", "lr_peak")

    def __init__(self, model, comm, spec, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec, bucket_mb=bucket_mb)
        self.threshold, self.check_every = spec.threshold, spec.check_every
        self.rule = spec.rule or "drift"
        self.by_lr, self.lr_peak = bool(spec.by_lr), 0.0
        self.hashes: list[Tensor] | None = None  # rule=spread: the count sketch's buckets and signs
        self.checks = 0
        self.syncs = 0
        self.synced_at = -1  # the step of the last average (this process's)

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        """At most: an average at every check (the rate is the data's; see :func:`dynamic_step_s`)."""
        return dynamic_step_s(compute_s=parts.compute_s, average_s=parts.comm_s + parts.codec_s,
                              check_every=spec.check_every, sync_rate=1.0)

    @classmethod
    def bytes_per_step(cls, spec, bytes_per_average: int, hosts: int = 2) -> float:
        """At most: an average at every check, plus the check's own all-reduce (a ring's 2 (p-1)/p of
        its payload: the one-byte vote, or ``rule=spread``'s fp64 sketch and two norms, 2 KiB)."""
        check = ((SKETCH + 2) * 8 if (spec.rule or "drift") == "spread" else 1) * 2 * (hosts - 1) / max(hosts, 1)
        return (bytes_per_average + check) / spec.check_every

    def after_step(self) -> None:
        self.steps += 1
        local = self.steps - self.warmup
        if local <= 0 or local % self.check_every or self.comm.wire.world == 1:  # one rank: nobody to average with
            return
        self.checks += 1
        threshold = self.threshold * self.lr_ratio()
        apart = self.spread() > threshold if self.rule == "spread" else self.vote(self.drift() > threshold)
        if apart:
            self.syncs += 1
            self.synced_at = self.steps
            self.average()

    def steps_to_agreement(self) -> int | None:
        """0 through the warm-up and at the step of an average; else None: the next is the data's call."""
        return 0 if self.steps <= self.warmup or self.synced_at == self.steps else None

    def lr_ratio(self) -> float:
        """``by_lr=1``: the learning rate now over its peak so far (the same on every rank); else 1."""
        if not self.by_lr:
            return 1.0
        if self.optimizer is None:
            raise ThinwireError("sync dynamic:by_lr=1 follows the learning rate: step with mode.step(optimizer) "
                                "(or set mode.optimizer) so it can read it.")
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.lr_peak = max(self.lr_peak, lr)
        return lr / self.lr_peak if self.lr_peak > 0 else 1.0

    def spread(self) -> float:
        """The ranks' spread around their mean relative to the last average, ``sqrt(mean_i ||x_i - xbar||^2)
        / ||a||``, the same value on every rank: one all-reduce (a sum) of each rank's sketch of ``x_i - a``
        (:meth:`sketch`, linear, so the sketches' spread is the sketched spread), its squared norm and
        ``||a||^2``."""
        wire = self.comm.wire
        deltas = [x - a for a, x in zip(self.anchor, self._flat_params())]
        s = self.sketch(deltas)
        norm2 = sum(a.double().pow(2).sum() for a in self.anchor)
        v = torch.cat([s, s.pow(2).sum().view(1), norm2.view(1).to(s.device)])
        wire.bytes_sent += ring_allreduce_bytes(v.numel() * v.element_size(), wire.world)
        wire.calls += 1
        if wire.world > 1:
            dist.all_reduce(v, group=wire.group)
        m = wire.world
        mean = v[:SKETCH] / m
        spread2 = max(float(v[SKETCH] - m * mean.pow(2).sum()) / m, 0.0)
        norm2 = float(v[SKETCH + 1]) / m
        return (spread2 / norm2) ** 0.5 if norm2 > 0 else float("inf")

    def sketch(self, flats: list[Tensor]) -> Tensor:
        """A count sketch of the flat buckets into ``SKETCH`` values: coordinate j adds ``sign_j x_j`` to
        bucket ``h_j`` (both from a fixed seed, the same on every rank; kept as one int16 per parameter).
        Linear, and ``E ||sketch(v)||^2 = ||v||^2`` (relative spread about ``sqrt(2 / SKETCH)``, 9%)."""
        if self.hashes is None:
            g = torch.Generator().manual_seed(20180703)   # Kamp et al.'s arXiv date: any fixed seed
            self.hashes = [torch.randint(0, 2 * SKETCH, (f.numel(),), generator=g, dtype=torch.int16) for f in flats]
        out = torch.zeros(SKETCH, dtype=torch.float64, device=flats[0].device)
        for f, h in zip(flats, self.hashes):
            for lo in range(0, f.numel(), CHUNK):
                r = h[lo:lo + CHUNK].to(device=f.device, dtype=torch.int64)
                out.index_add_(0, r >> 1, f[lo:lo + CHUNK].double() * (1 - 2 * (r & 1)))
        return out

    def drift(self) -> float:
        """``||x - a|| / ||a||`` over all parameters."""
        num = den = 0.0
        for a, x in zip(self.anchor, self._flat_params()):
            num += float((x - a).pow(2).sum())
            den += float(a.pow(2).sum())
        return (num / den) ** 0.5 if den > 0 else float("inf")

    def vote(self, mine: bool) -> bool:
        """Whether any rank has drifted: one byte each, a MAX all-reduce."""
        wire = self.comm.wire
        flag = torch.tensor([1 if mine else 0], dtype=torch.uint8, device=self.anchor[0].device)
        wire.bytes_sent += ring_allreduce_bytes(1, wire.world)
        wire.calls += 1
        if wire.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=wire.group)
        return bool(flag.item())

    def stats(self) -> dict:
        return {"checks": self.checks, "syncs": self.syncs, "sync_rate": self.syncs / self.checks if self.checks else None}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "checks": self.checks, "syncs": self.syncs, "lr_peak": self.lr_peak}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.checks, self.syncs = int(sd.get("checks", 0)), int(sd.get("syncs", 0))
        self.lr_peak = float(sd.get("lr_peak", 0.0))
