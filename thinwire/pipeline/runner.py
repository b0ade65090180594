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

**Interleaved** (``ScheduleInterleaved1F1B``, Narayanan et al. SC 2021): the layer list is cut into S x V
stages and the replica's rank r holds stages r, r + S, ..., r + (V-1) S (a :class:`RankStages` of them,
one ``PipelineStage`` each), so a micro-batch goes round the ranks V times: V times the messages, each
link's S x V - 1 hand-overs including rank S-1 back to rank 0, for a bubble about V times smaller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from thinwire import batch as B
from thinwire.errors import ThinwireError
from thinwire.pipeline.stages import Layer, StageModule, full_names, shared_parameters
from thinwire.pipeline.wire import Decode, Encode

# On any exception in a step, torch's interleaved runtime logs its whole schedule (~90 lines per rank) before
# re-raising; the exception itself still reaches the worker, which reports it (a lost peer in one line).
logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.CRITICAL)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


@contextlib.contextmanager
def _our_errors():
    """A thinwire error raised inside a stage (the schedule wraps it in a RuntimeError) comes out as itself; a
    BatchNorm given one sample per micro-batch says what to change."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e.__cause__, ThinwireError):
            raise e.__cause__ from None
        raise
    except ValueError as e:
        if "Expected more than 1 value per channel when training" in str(e):
            raise ThinwireError("pipeline: a BatchNorm got a micro-batch of one sample, from which it cannot take "
                                "statistics in training. Use fewer micro-batches (pipeline microbatches=M) or a larger "
                                "--batch-size.") from None
        raise


class Stage(PipelineStage):
    """torch's :class:`PipelineStage`, whose shape inference leaves no trace. Without example tensors the runtime
    infers each stage's output shapes by running the stage (at its first step, and again at each switch between
    training and evaluation) on tensors made from the previous stage's metadata with ``torch.empty``, in the
    stage's training mode: a BatchNorm's running statistics then took in whatever that memory held (seen: 3e37,
    and infinite running variances), and an integer input indexed out of range. Here those tensors are zeros, and
    the stage's buffers are put back once the probe is over (its backward too, which reads them); the runtime
    already keeps the random state apart."""

    _probed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _to_tensor(self, arg):
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):  # made from metadata: torch.empty
            with torch.no_grad():
                t.zero_()
        return t

    def _forward_metadata_inference(self, *args, **kwargs):
        if self._probed is None:
            self._probed = [(b, b.detach().clone()) for b in self.submod.buffers()]
        return super()._forward_metadata_inference(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        if self._probed is not None:
            with torch.no_grad():
                for b, value in self._probed:
                    b.copy_(value)
            self._probed = None


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
    is collective); ``grid[replica][s]`` is a global rank, stage k on column ``k % S``; this rank keeps its
    own ties. Stages on the same rank share the one tensor, whose gradient sums them already."""
    by_id = {id(p): p for s in c.stages for p in s.parameters()}
    rank, mine = dist.get_rank(), []
    for pid in c.shared_order():
        columns = sorted({k % len(grid[0]) for k in c.shared[pid]})
        if len(columns) < 2:
            continue
        for row in grid:
            ranks = [row[s] for s in columns]
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                mine.append(Tie(by_id[pid], group, counted=stage == columns[0]))
    return mine


class RankStages(nn.Module):
    """The stages one rank holds in an interleaved pipeline, as one module (its parameters, optimizer, checkpoint
    shard and the replicas' averaging); the schedule runs each stage itself."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)


class PipelineRank:
    """This rank's stage in its replica's pipeline: train and evaluate steps of whole replica batches."""

    def __init__(self, submod: nn.Module, *, stage: int, stages: int, group: dist.ProcessGroup | None,
                 device: torch.device, loss_fn, microbatches: int, schedule: str, ties: list[Tie],
                 virtual: int = 1) -> None:
        """``submod``: this rank's stage, or with ``virtual`` > 1 its :class:`RankStages` (stages ``stage``,
        ``stage + stages``, ...)."""
        self.stage_index, self.stages, self.ties = stage, stages, ties
        if virtual > 1:
            self.pipeline_stages = [Stage(m, stage + v * stages, stages * virtual, device, group=group)
                                    for v, m in enumerate(submod.stages)]
        else:
            self.pipeline_stages = [Stage(submod, stage, stages, device, group=group)]
        # gradients divided by M here, once per tensor: torch's multi-stage runtime divides each stage's at its
        # last backward, so a tensor two of this rank's stages share (a tied weight) was divided twice, and
        # what the second stage added after the first one's division not as often
        self.schedule = SCHEDULES[schedule](self.pipeline_stages if virtual > 1 else self.pipeline_stages[0],
                                            n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
        self.microbatches = microbatches
        self.stage = self.pipeline_stages[0]
        self.clock = StageClock(self.pipeline_stages)
        self.modules = list(submod.stages) if virtual > 1 else [submod]
        self.params = list({id(p): p for m in self.modules for p in m.parameters()}.values())
        self.group = group
        self.first, self.last = stage == 0, stage == stages - 1

    def train_step(self, x, y: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one replica batch; the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        self.clock.counting = True
        try:
            with _our_errors():
                self.schedule.step(*self._inputs(x), target=y if self.last else None,
                                   losses=losses if self.last else None, return_outputs=False)
        finally:
            self.clock.counting = False
        for p in self.params:  # the losses are means over their micro-batches: the step's gradient is their mean
            if p.grad is not None:
                p.grad.div_(self.microbatches)
        for tie in self.ties:
            if tie.param.grad is None:  # a stage holds the shared tensor, but nothing it computed used it
                tie.param.grad = torch.zeros_like(tie.param)
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
        self.modules[0].structure = x  # the template StageModule.forward rebuilds each micro-batch's from
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


class StageClock:
    """Wall seconds this rank spends computing its stages' micro-batches: torch's ``forward_one_chunk`` and
    ``backward_one_chunk`` of each ``PipelineStage``, which the schedule calls once a chunk's input has
    arrived; the rest of a step is waiting on the neighbours (or the bubble) and the hand-overs. Counts only
    while :attr:`counting` (training steps, not validation)."""

    def __init__(self, stages: list[PipelineStage]) -> None:
        self.forward_s = self.backward_s = 0.0
        self.counting = False
        self.in_chunk = False  # inside a micro-batch's forward or backward (not torch's shape inference)
        for st in stages:  # the schedule looks the methods up on the instance
            st.forward_one_chunk = self._timed(st.forward_one_chunk, "forward_s")
            st.backward_one_chunk = self._timed(st.backward_one_chunk, "backward_s")

    def _timed(self, fn, field: str):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t, self.in_chunk = time.perf_counter(), True
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_chunk = False
                if self.counting:
                    setattr(self, field, getattr(self, field) + time.perf_counter() - t)
        return run


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
    """This rank's :class:`PipelineRank`, its module (its stage, or its :class:`RankStages` where ``runs`` holds
    more stages than ``place.stages``: interleaved) and the :class:`Cut`; the mesh (``dp`` x ``pp``, ranks laid
    out as ``place.order`` says) and the shared parameters' groups are created here, collectively."""
    from torch.distributed.device_mesh import DeviceMesh

    c = cut(model, layers, runs, links)
    virtual = len(runs) // place.stages
    assert virtual * place.stages == len(runs) and (virtual == 1) == (schedule != "interleaved"), (schedule, len(runs))
    grid = torch.tensor(place.ranks()).view(place.replicas, place.stages)
    mesh = DeviceMesh(device.type, grid, mesh_dim_names=("dp", "pp"))
    mine = [c.stages[k] for k in range(place.stage, len(runs), place.stages)]
    module = (mine[0] if virtual == 1 else RankStages(mine)).to(device)
    ties = make_ties(c, place.stage, grid.tolist())
    pp = mesh.get_group("pp")
    pr = PipelineRank(module, stage=place.stage, stages=place.stages, group=pp, device=device,
                      loss_fn=loss_fn, microbatches=microbatches, schedule=schedule, ties=ties, virtual=virtual)
    row = grid[place.replica].tolist()  # the group's ranks are numbered in global-rank order: map stages to them
    to_group = {k: dist.get_group_rank(pp, row[k % place.stages]) for k in range(len(runs))}
    for st in pr.pipeline_stages:
        st.stage_index_to_group_rank = to_group
    if virtual > 1:  # the schedule's program is by position (position r holds stages r, r + S, ...)
        pr.schedule.stage_index_to_group_rank, pr.schedule.rank = to_group, place.stage
    pr.dp_group = mesh.get_group("dp")
    return pr, module, c
