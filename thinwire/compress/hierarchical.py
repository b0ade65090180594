"""Hierarchical gradient averaging: dense fp32 inside fast groups, the bucket's codec between group leaders.

For a cluster of fast groups joined by slow links (sites, racks, or one host behind a slow access
link), a flat ring sends ``2 (p-1)/p * 4n`` bytes per rank at the pace of its slowest edge. Here
each bucket of ``n`` fp32 values (already divided by the world size) takes three steps:

1. **inside each group**, a dense fp32 ring all-reduce: every member holds the group's sum
   (``2 (g-1)/g * 4n`` bytes per member, on the fast links);
2. **between leaders** (the first rank of each group), the bucket's codec through the same schemes
   as the flat hook (:mod:`thinwire.compress.schemes`) on a process group of the ``N`` leaders: only
   this crosses the slow links, and only it is compressed, with error feedback on the leaders;
3. **inside each group**, the leader broadcasts the result, with a non-finite flag appended so every
   member takes the same skip decision (``(g-1) * 4(n+1)`` bytes from the leader; gloo sends from
   the root to each member).

The result equals the flat average up to the codec's error between leaders (exactly, in fp32
rounding, with ``none``). All ranks create every process group in the same order (a
``torch.distributed`` rule). Device and dtype follow the bucket; it runs on gloo and NCCL alike.
(Two-level all-reduce as in Horovod's hierarchical mode and Jia et al., arXiv 1807.11205.)

Example (4 ranks, two sites)::

    state = attach_hierarchical(ddp_model, "int8", groups=[[0, 1], [2, 3]])
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from thinwire.compress import schemes
from thinwire.compress.wire import Wire
from thinwire.compress.hook import MIN_COMPRESS_BYTES, CommState, _as_policy, need_ddp


class _Leg:
    """The leaders' view of a :class:`HierarchicalState` for the schemes: its own wire, the parent's
    error feedback, PowerSGD state and codec-time counter."""

    def __init__(self, parent: CommState, wire: Wire) -> None:
        self.parent, self.wire = parent, wire

    @property
    def feedback(self):
        return self.parent.feedback

    @property
    def extra(self) -> dict:
        return self.parent.extra

    @property
    def compress_s(self) -> float:
        return self.parent.compress_s

    @compress_s.setter
    def compress_s(self, value: float) -> None:
        self.parent.compress_s = value


def check_groups(groups: list[list[int]], world: int) -> None:
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world)) or any(not g for g in groups):
        raise ValueError(f"groups must be non-empty lists of ranks covering 0..{world - 1} once each, got {groups}")


class HierarchicalState(CommState):
    """A :class:`~thinwire.compress.hook.CommState` whose buckets travel in two levels (see the module
    docstring). ``wire`` counts every byte this rank sends, both levels together."""

    issues_inline = False  # every bucket takes two levels of collectives, on the communication thread

    def __init__(self, policy, *, groups: list[list[int]], timeout=None, **kwargs) -> None:
        super().__init__(policy, **kwargs)
        rank, backend = dist.get_rank(), dist.get_backend()
        check_groups(groups, dist.get_world_size())
        self.groups = [list(g) for g in groups]
        intra = None
        for g in self.groups:  # every rank creates every group, in the same order
            pg = dist.new_group(g, backend=backend, timeout=timeout)
            if rank in g:
                intra, self.members = pg, g
        leaders_pg = dist.new_group([g[0] for g in self.groups], backend=backend, timeout=timeout)
        self.leader = self.members[0]
        self.is_leader = rank == self.leader
        self.intra_group = intra
        self.intra = Wire(intra)
        self.inter = Wire(leaders_pg) if self.is_leader else None
        self._leg = _Leg(self, self.inter) if self.inter is not None else None

    def _reduce(self, buf: Tensor, index: int, step: int, shapes: list[tuple], layout: tuple) -> Tensor:
        self.bytes_raw += buf.numel() * buf.element_size()
        buf.div_(self.wire.world)
        self._counted(self.intra, self.intra.all_reduce, buf)
        finite = True
        if self.is_leader:
            finite = self._counted(self.inter, self._across, buf, index, step, shapes, layout)
        finite = self._broadcast(buf, finite)
        if not finite:
            return self._on_nonfinite(buf, index, step)
        return buf

    def _across(self, buf: Tensor, index: int, step: int, shapes: list[tuple], layout: tuple) -> bool:
        """The leaders' collective: fp32 during warm-up and for small buckets, else the bucket's codec."""
        if step < self.warmup_steps or buf.numel() * 4 < self.min_compress_bytes:
            self.counts["fp32"] += 1
            return schemes.all_finite(self.inter.all_reduce(buf))
        codec = self.policy.codec_for(index, buf.numel(), step)
        self.counts[codec.name] += 1
        job = schemes.BucketJob(key=str(index), buf=buf, step=step, shapes=shapes, layout=layout, codec=codec,
                                state=self._leg)
        _, finite = schemes.run(job)
        return finite

    def _broadcast(self, buf: Tensor, finite: bool) -> bool:
        if len(self.members) == 1:
            return finite
        packed = torch.empty(buf.numel() + 1, dtype=buf.dtype, device=buf.device)
        if self.is_leader:
            packed[:-1].copy_(buf)
            packed[-1] = 0.0 if finite else 1.0
            self.wire.bytes_sent += (len(self.members) - 1) * packed.numel() * packed.element_size()
        self.wire.calls += 1
        dist.broadcast(packed, src=self.leader, group=self.intra_group)
        buf.copy_(packed[:-1])
        return float(packed[-1]) == 0.0

    def _counted(self, wire: Wire, fn, *args):
        """Run ``fn`` and add the bytes and calls it put on ``wire`` to this rank's totals."""
        sent, calls = wire.bytes_sent, wire.calls
        out = fn(*args)
        self.wire.bytes_sent += wire.bytes_sent - sent
        self.wire.calls += wire.calls - calls
        return out

    def stats(self) -> dict:
        return {**super().stats(), "groups": self.groups, "leader": self.leader,
                "bytes_sent_inside_group": self.intra.bytes_sent,
                "bytes_sent_between_leaders": self.inter.bytes_sent if self.inter else 0}


def attach_hierarchical(model: DistributedDataParallel, codec="none", *, groups: list[list[int]],
                        error_feedback: bool = True, warmup_steps: int = 0, min_compress_bytes: int = MIN_COMPRESS_BYTES,
                        nonfinite: str = "skip", timeout_s: float | None = None) -> HierarchicalState:
    """Register the hierarchical collective as ``model``'s DDP communication hook.

    ``groups``: lists of global ranks, each group's first rank its leader; ``codec``: a spec string,
    a codec or a policy (used between leaders only). Other arguments as :func:`thinwire.attach`.
    """
    need_ddp(model, "attach_hierarchical")
    if getattr(model, "_thinwire_state", None) is not None:
        raise ValueError("attach_hierarchical: a thinwire hook is already attached to this model; attach once per model")
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    world_group = dist.new_group(backend=dist.get_backend(), timeout=timeout)
    state = HierarchicalState(_as_policy(codec), groups=groups, timeout=timeout, error_feedback=error_feedback,
                              warmup_steps=warmup_steps, min_compress_bytes=min_compress_bytes, nonfinite=nonfinite,
                              group=world_group)
    model.register_comm_hook(state, CommState.hook)
    state.param_index = {id(p): i for i, p in enumerate(model.module.parameters())}
    model._thinwire_state = state
    return state
