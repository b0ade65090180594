"""Executing a plan from ``thinwire plan``: which host is which rank, its batch share, its codecs.

torchrun's c10d rendezvous numbers workers in the order they join, so ranks are matched to the
plan's hosts by name (``THINWIRE_HOST``, set by the emulator; the machine's hostname otherwise),
gathered once from every rank. Uneven shares are made exact by weighting each rank's mean loss
(:func:`thinwire.plan.planfile.loss_weight`), so DDP's equal average is the global-batch gradient.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from thinwire.cluster.spec import load_cluster_spec
from thinwire.errors import ThinwireError
from thinwire.plan.planfile import Plan, load_plan, loss_weight


class PlannedRun:
    def __init__(self, path: str, cluster: str | None, workload: str, model: dict, batch_size: int | None) -> None:
        if not cluster:
            raise ThinwireError("plan: --plan needs --cluster SPEC, the cluster the plan was made for.")
        self.plan: Plan = load_plan(path, load_cluster_spec(cluster), workload, model, batch_size=batch_size)
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, os.environ.get("THINWIRE_HOST") or socket.gethostname())
        missing = [n for n in names if n not in self.plan.hosts]
        if missing or len(set(names)) != len(names):
            raise ThinwireError(f"plan: workers run on {names}, the plan trains on {self.plan.hosts}. "
                                "Launch exactly the plan's hosts, one worker each.")
        self.index = [self.plan.hosts.index(n) for n in names]  # rank -> position in the plan
        planned = self.plan.shares(len(names))
        self.shares = [planned[i] for i in self.index]

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def micro_sizes(self, rank: int) -> list[int]:
        return self.plan.micro_sizes(self.index[rank])

    def loss_weight(self, rank: int) -> float:
        return loss_weight(rank, self.shares)

    def attach(self, model, **kwargs):
        """The plan's codecs per bucket, over a ring or the hierarchical collective."""
        from thinwire.compress.hook import attach

        if self.plan.decision.collective != "hierarchical":
            return attach(model, self.plan.policy(), **kwargs)
        from thinwire.compress.hierarchical import attach_hierarchical

        groups = [[self.index.index(i) for i in g] for g in self.plan.rank_groups()]
        kwargs.pop("process_group", None)
        return attach_hierarchical(model, self.plan.policy(), groups=groups, **kwargs)
