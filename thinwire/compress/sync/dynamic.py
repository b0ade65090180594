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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from thinwire.compress.sync.base import StepParts
from thinwire.compress.sync.local import LocalSGD
from thinwire.compress.wire import ring_allreduce_bytes
from thinwire.perf.sync import dynamic_step_s


class Dynamic(LocalSGD):
    name = "dynamic"

    def __init__(self, model, comm, spec, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec, bucket_mb=bucket_mb)
        self.threshold, self.check_every = spec.threshold, spec.check_every
        self.checks = 0
        self.syncs = 0

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        """At most: an average at every check (the rate is the data's; see :func:`dynamic_step_s`)."""
        return dynamic_step_s(compute_s=parts.compute_s, average_s=parts.comm_s + parts.codec_s,
                              check_every=spec.check_every, sync_rate=1.0)

    @classmethod
    def bytes_per_step(cls, spec, bytes_per_average: int, hosts: int = 2) -> float:
        return bytes_per_average / spec.check_every  # at most: an average at every check

    def after_step(self) -> None:
        self.steps += 1
        local = self.steps - self.warmup
        if local <= 0 or local % self.check_every:
            return
        self.checks += 1
        if self.vote(self.drift() > self.threshold):
            self.syncs += 1
            self.average()

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
        return {**super().state_dict(), "checks": self.checks, "syncs": self.syncs}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.checks, self.syncs = int(sd.get("checks", 0)), int(sd.get("syncs", 0))
