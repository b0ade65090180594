"""One rank's part of a pipeline: its stage, run by a ``torch.distributed.pipelining`` schedule.

Ranks form a 2-D mesh ``(replicas, stages)`` (``init_device_mesh``; rank = replica x stages + stage):
along ``pp`` the ranks of one replica pass activations forward and their gradients back (the
schedule's point-to-point sends), along ``dp`` the ranks holding the same stage in different replicas
average that stage's gradients (DDP over the ``dp`` group, with thinwire's hook; the schedule runs the
micro-batches under ``no_sync`` and lets the last backward reduce, see ``PipelineStage``). A step:

1. the schedule splits the replica's batch into M micro-batches, runs them through the stages (GPipe or
   1F1B) and, on the last stage, the loss of each; gradients are divided by M (the loss is a mean);
2. parameters shared by stages (a tied embedding) get their gradients summed over the stages holding
   them (:mod:`thinwire.pipeline.stages`);
3. the gradient norm is summed over the stages (each shared parameter counted once), so clipping is
   the single-process model's.

Communication per step and replica: each of the S-1 links carries M activations forward and M
activation gradients back; the bubble is ``(S-1)/(M+S-1)`` of the ideal step for both schedules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from thinwire import batch as B
from thinwire.errors import ThinwireError
from thinwire.pipeline.stages import Layer, StageModule, full_names, shared_parameters
from thinwire.pipeline.wire import Decode, Encode

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@contextlib.contextmanager
def _our_errors():
    """A thinwire error raised inside a stage (the schedule wraps it in a RuntimeError) comes out as itself."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e.__cause__, ThinwireError):
            raise e.__cause__ from None
        raise


@dataclasses.dataclass
class Cut:
    """A model cut into stage modules (sharing the model's tensors), with the stages' shared parameters."""

    stages: list[StageModule]
    names: dict[int, list[str]]        # id(tensor) -> its names in the whole model's state dict
    shared: dict[int, list[int]]       # id(param) -> stage indices holding it
    runs: list[list[int]]              # layer indices per stage
    layer_names: list[str]

    def shared_order(self) -> list[int]:
        """Shared parameters in a fixed order (by name), the same on every rank."""
        return sorted(self.shared, key=lambda pid: self.names[pid][0])


def cut(model: nn.Module, layers: list[Layer], runs: list[list[int]], links: list[str] | None = None) -> Cut:
    """Stage modules over ``runs``; link s (stage s to s+1) carries activations in ``links[s]``
    (:mod:`thinwire.pipeline.wire`; default fp32)."""
    links = links or ["fp32"] * (len(runs) - 1)
    stages = []
    for s, run in enumerate(runs):
        before = links[s - 1] if s > 0 else "fp32"
        after = links[s] if s < len(runs) - 1 else "fp32"
        stages.append(StageModule([layers[i] for i in run], decode=Decode(before) if before != "fp32" else None,
                                  encode=Encode(after) if after != "fp32" else None))
    return Cut(stages=stages, names=full_names(model), shared=shared_parameters(stages), runs=runs,
               layer_names=[layer.name for layer in layers])


@dataclasses.dataclass
class Tie:
    """A parameter this stage shares with others: summed over ``group``; ``counted`` in the norm here."""

    param: nn.Parameter
    group: dist.ProcessGroup
    counted: bool


def make_ties(c: Cut, stage: int, grid: list[list[int]]) -> list[Tie]:
    """Process groups for the shared parameters, created on every rank in the same order (``new_group``
    is collective); ``grid[replica][stage]`` is a global rank; this rank keeps its own stage's ties."""
    by_id = {id(p): p for s in c.stages for p in s.parameters()}
    rank, mine = dist.get_rank(), []
    for pid in c.shared_order():
        holders = c.shared[pid]
        for row in grid:
            ranks = [row[s] for s in holders]
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                mine.append(Tie(by_id[pid], group, counted=stage == holders[0]))
    return mine


class PipelineRank:
    """This rank's stage in its replica's pipeline: train and evaluate steps of whole replica batches."""

    def __init__(self, submod: nn.Module, *, stage: int, stages: int, group: dist.ProcessGroup | None,
                 device: torch.device, loss_fn, microbatches: int, schedule: str, ties: list[Tie]) -> None:
        self.stage_index, self.stages, self.ties = stage, stages, ties
        self.stage = PipelineStage(submod, stage, stages, device, group=group)
        self.schedule = SCHEDULES[schedule](self.stage, n_microbatches=microbatches, loss_fn=loss_fn)
        self.group = group
        self.first, self.last = stage == 0, stage == stages - 1

    def train_step(self, x, y: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one replica batch; the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        with _our_errors():
            self.schedule.step(*self._inputs(x), target=y if self.last else None,
                               losses=losses if self.last else None, return_outputs=False)
        for tie in self.ties:
            dist.all_reduce(tie.param.grad, group=tie.group)
        return torch.stack(losses).mean().detach() if self.last else None

    @torch.no_grad()
    def evaluate(self, x, y: torch.Tensor) -> torch.Tensor | None:
        """The model's output for a replica batch, on the last stage (else None); forward only."""
        with _our_errors():
            return self.schedule.eval(*self._inputs(x), target=y if self.last else None)

    def _inputs(self, x) -> tuple:
        """The first stage's arguments: ``x``, or the tensors of a structured batch (a dict, a tuple: the
        schedule takes tensors only), which the stage puts back together before its first layer."""
        if not self.first:
            return ()
        if torch.is_tensor(x):
            return (x,)
        self.stage.submod.structure = x  # the template StageModule.forward rebuilds each micro-batch's from
        return tuple(B.tensors(x))

    def grad_norm(self, params: list[nn.Parameter]) -> float:
        """The whole model's gradient 2-norm: squares summed over this replica's stages, shared ones once."""
        shared = {id(t.param) for t in self.ties if not t.counted}
        grads = [p.grad for p in params if p.grad is not None and id(p) not in shared]
        sq = torch.zeros((), dtype=torch.float64)
        for g in grads:
            sq += g.detach().double().pow(2).sum().cpu()
        if self.stages > 1:
            dist.all_reduce(sq, group=self.group)
        return math.sqrt(float(sq))

    def clip(self, params: list[nn.Parameter], max_norm: float | None) -> float:
        """Scale gradients as ``clip_grad_norm_`` would on the whole model; returns the norm before clipping."""
        norm = self.grad_norm(params)
        if max_norm is not None and math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm


@dataclasses.dataclass
class Placement:
    """Where this rank sits among ``replicas`` x ``stages`` positions; ``order[pos]`` is the global rank at
    position ``pos = replica * stages + stage`` (default: rank = position; a plan orders ranks by host)."""

    stages: int
    replicas: int
    rank: int
    order: list[int] | None = None

    @property
    def position(self) -> int:
        return self.order.index(self.rank) if self.order else self.rank

    @property
    def stage(self) -> int:
        return self.position % self.stages

    @property
    def replica(self) -> int:
        return self.position // self.stages

    def ranks(self) -> list[int]:
        return self.order or list(range(self.stages * self.replicas))


def build_rank(model: nn.Module, layers: list[Layer], runs: list[list[int]], *, place: Placement,
               device: torch.device, loss_fn, microbatches: int, schedule: str, links: list[str] | None = None):
    """This rank's :class:`PipelineRank`, its stage module and the :class:`Cut`; the mesh (``dp`` x ``pp``,
    ranks laid out as ``place.order`` says) and the shared parameters' groups are created here, collectively."""
    from torch.distributed.device_mesh import DeviceMesh

    c = cut(model, layers, runs, links)
    grid = torch.tensor(place.ranks()).view(place.replicas, place.stages)
    mesh = DeviceMesh(device.type, grid, mesh_dim_names=("dp", "pp"))
    module = c.stages[place.stage].to(device)
    ties = make_ties(c, place.stage, grid.tolist())
    pp = mesh.get_group("pp")
    pr = PipelineRank(module, stage=place.stage, stages=place.stages, group=pp, device=device,
                      loss_fn=loss_fn, microbatches=microbatches, schedule=schedule, ties=ties)
    row = grid[place.replica].tolist()  # the group's ranks are numbered in global-rank order: map stages to them
    pr.stage.stage_index_to_group_rank = {s: dist.get_group_rank(pp, r) for s, r in enumerate(row)}
    pr.dp_group = mesh.get_group("dp")
    return pr, module, c
