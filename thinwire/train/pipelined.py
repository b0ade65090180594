"""The training loop of a pipelined run (``--pipeline``): the :class:`~thinwire.train.loop.Trainer` with
each rank holding one stage of the model instead of all of it.

What changes from data parallelism (everything else, the sampler, LR schedule, metrics, validation
subset, checkpoint files and resume, is the trainer's own):

* the ranks form ``replicas x stages`` (:mod:`thinwire.pipeline.layout`); all ranks of a replica draw
  the replica's slice of the global batch, the first stage feeds the inputs and the last computes the loss;
* a step is the schedule's (GPipe, 1F1B or interleaved 1F1B over M micro-batches), then the stage's gradients are
  averaged over the replicas through ``--compression`` and the sync mode (no DDP: a stage's backward
  is spread over the schedule; :class:`~thinwire.compress.sync.base.Averaged`), clipped by the whole
  model's norm, and applied by the stage's own AdamW;
* checkpoints hold the whole model's state dict (the stages' merged, so a data-parallel run can resume
  it and the other way round) and each rank's stage and optimizer state;
* validation runs the schedule forward only, on batches of the replica's size (the stages' buffers
  have the training micro-batch's shape), the last one padded and the padding not counted;
* ``bytes_sent`` counts the activations and activation gradients this rank sends to its neighbours
  as well as its share of the replicas' averaging.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from thinwire import batch as B
from thinwire.compress.sync import Unwrapped, create as create_sync
from thinwire.errors import ThinwireError
from thinwire.pipeline.layout import layout_of
from thinwire.pipeline.runner import Placement, build_rank
from thinwire.pipeline.stages import check_chain, layer_list, load_stage_state, stage_state
from thinwire.precision import prepare_precision
from thinwire.precision.memory import apply_checkpointing
from thinwire.train import checkpoint as ckpt
from thinwire.train.loop import Trainer, check_batch, scalar_loss
from thinwire.train.progress import console
from thinwire.workloads.base import collate, even_shares


class ActivationBytes:
    """Bytes this rank's stages send per training step: each stage's outputs forward (unless the pipeline's
    last), the gradients of its floating-point inputs back (unless the first), counted from the tensors its
    forward sees."""

    def __init__(self, modules: list[torch.nn.Module], first: list[bool], last: list[bool], clock=None) -> None:
        self.total, self.counting, self.clock = 0, False, clock
        for module, f, l in zip(modules, first, last, strict=True):
            module.register_forward_hook(lambda m, i, o, f=f, l=l: self._count(i, o, f, l))

    def _count(self, inputs, output, first: bool, last: bool) -> None:
        # only a micro-batch's forward: torch's shape inference (a step's first after a start or a validation)
        # runs the stage once more, and only the shapes travel
        if not self.counting or (self.clock is not None and not self.clock.in_chunk):
            return
        outs = output if isinstance(output, tuple) else (output,)
        if not last:
            self.total += sum(t.numel() * t.element_size() for t in outs if torch.is_tensor(t))
        if not first:
            self.total += sum(t.numel() * t.element_size() for t in inputs if torch.is_tensor(t) and t.is_floating_point())


class PipelineTrainer(Trainer):
    def _planned_run(self) -> None:
        """Which rank holds which stage. On an emulated cluster ranks take stages in the order of their hosts
        (``THINWIRE_HOST``): the spec's order, or a plan's (its layout is already ``--pipeline``, set by
        ``thinwire train``); elsewhere in rank order."""
        self.order, self.predicted_step_s = None, None
        cfg = self.cfg
        if not cfg.cluster:
            return None
        from thinwire.cluster.spec import load_cluster_spec

        spec = load_cluster_spec(cfg.cluster)
        hosts = [h.name for h in spec.hosts]
        if cfg.plan:
            from thinwire.plan.planfile import load_plan

            plan = load_plan(cfg.plan, spec, cfg.workload, cfg.model, batch_size=cfg.batch_size)
            hosts, self.predicted_step_s = plan.hosts, plan.pipeline.predicted_step_s
        names = self._host_names()
        if not set(names) <= set(hosts) or len(set(names)) != len(names):
            raise ThinwireError(f"pipeline: workers run on {names}, the stages belong on {hosts}. Launch the "
                                "cluster's (or the plan's) hosts, one worker each.")
        self.order = [names.index(h) for h in hosts if h in names]
        return None

    def _host_names(self) -> list[str]:
        names = [None] * self.env.world
        dist.all_gather_object(names, os.environ.get("THINWIRE_HOST") or socket.gethostname())
        return names

    def _batch_shares(self) -> list[int]:
        self.layers = layer_list(self.wl.model, self.wl.layers, self.cfg.workload)
        self.layout = layout_of(self.cfg.pipeline_spec, self.layers, self.env.world, self.batch)
        self.place = Placement(self.layout.stages, self.layout.replicas, self.env.rank, self.order)
        check_batch(self.batch, self.layout.replicas)
        if self.env.is_main:
            console.print(f"pipeline: {self.layout.describe()}, schedule {self.cfg.pipeline_spec.schedule}")
        return even_shares(self.batch, self.layout.replicas)  # per replica

    def _setup_model(self, lr: float) -> None:
        cfg, device = self.cfg, self.device
        self.signature = ckpt.model_signature(self.wl.model)
        links = self.layout.links
        x, _ = collate(self.wl.train, [0])
        check_chain(self.layers, B.to(x, device), self.layout.runs, links, model=self.wl.model)
        self.pipe, stage, self.cut = build_rank(
            self.wl.model, self.layers, self.layout.runs, place=self.place, device=device,
            loss_fn=lambda out, y: scalar_loss(self.wl.loss(out, y), cfg.workload),
            microbatches=self.layout.microbatches, schedule=cfg.pipeline_spec.schedule,
            links=links)
        self.cut.stages, self.layers = [], None  # keep only this rank's stage: the others' tensors are freed
        if cfg.pipeline_spec.recompute:  # every layer's activations recomputed in backward
            for m in self.pipe.modules:
                apply_checkpointing(m)
        self.wl.model = stage
        self.stage = stage
        self.prec = prepare_precision(stage, cfg.precision, device=device, batch=self.layout.replica_batch,
                                      loss_fn=self.wl.loss, sample=None, optimizer_fn=None, ddp=False, clip=cfg.grad_clip)
        self.ddp = None
        self.sync = create_sync(Unwrapped(stage), cfg.sync_spec, cfg.comm.policy(), error_feedback=cfg.error_feedback,
                                warmup_steps=cfg.compression_warmup, process_group=self.pipe.dp_group,
                                bucket_mb=cfg.bucket_mb)
        self.comm = self.sync.comm
        # a stage of layers without parameters (an activation, a pooling, a reshape: the planner may give a slow
        # host such a stage) steps an empty placeholder, so that its schedule and checkpoints are the others'
        params = list(stage.parameters()) or [torch.nn.Parameter(torch.zeros(0, device=device))]
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
        # what a mode may read (pipelines run allreduce, local or diloco; delayed's prediction is not offered here)
        self.sync.optimizer, self.sync.clip = self.opt, cfg.grad_clip
        ks = self.layout.rank_stages(self.place.stage)
        self.stage_times: list[tuple] = []  # (forward, backward, schedule, process CPU) seconds per step
        self.acts = ActivationBytes(self.pipe.modules, [k == 0 for k in ks],
                                   [k == len(self.layout.runs) - 1 for k in ks], clock=self.pipe.clock)

    # -- a step --------------------------------------------------------------------------------------
    def _train_step(self) -> dict:
        t0 = time.perf_counter()
        indices = self.sampler.rank_indices(self.step, self.place.replica, self.shares)
        x, y = self._collate(self._sets(self.step)[0], indices, "training")
        x, y = B.to(x, self.device, non_blocking=True), B.to(y, self.device, non_blocking=True)
        t1 = time.perf_counter()
        sent, acts = self.comm.wire.bytes_sent, self.acts.total
        self.acts.counting = True
        clock = self.pipe.clock
        computed, cpu = (clock.forward_s, clock.backward_s), time.process_time()
        with self._autocast():
            loss = self.pipe.train_step(x, y)
        self.acts.counting = False
        t2 = time.perf_counter()
        self.stage_times.append((clock.forward_s - computed[0], clock.backward_s - computed[1], t2 - t1,
                                 time.process_time() - cpu))
        self.sync.before_step()  # the replicas' average of this stage's gradients
        wait = time.perf_counter() - t2
        skipped = self._optimizer_step()
        t3 = time.perf_counter()
        self.sync.after_step()   # local, diloco: parameters averaged every H steps
        wait += time.perf_counter() - t3
        self.opt.zero_grad(set_to_none=True)
        lr = self.sched.get_last_lr()[0]  # the rate this step trained at (the next step's from here)
        self.sched.step()
        loss_value = self._mean_loss(loss)
        t4 = time.perf_counter()
        self.step_times.append(t4 - t0)
        self.waits.append(wait)
        return {"loss": loss_value, "step_time_s": t4 - t0, "compute_s": (t4 - t1) - wait, "comm_wait_s": wait,
                "data_s": t1 - t0, "bytes_sent": self.comm.wire.bytes_sent - sent + self.acts.total - acts,
                "activation_bytes": self.acts.total - acts, "lr": lr, "skipped": skipped}

    def _optimizer_step(self) -> bool:
        """Clip by the whole model's gradient norm and step; True if skipped (a non-finite gradient)."""
        norm = self.pipe.clip(list(self.stage.parameters()), self.cfg.grad_clip)
        runner = self.prec.runner
        runner.steps, runner.last_grad_norm = runner.steps + 1, norm
        if not math.isfinite(norm):
            runner.skipped_steps += 1
            return True
        self.opt.step()
        return False

    def _mean_loss(self, loss: torch.Tensor | None) -> float:
        """The replicas' mean training loss, on every rank (only last stages have a loss)."""
        t = torch.tensor([float(loss) if loss is not None else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t[0]) / self.layout.replicas

    # -- validation ----------------------------------------------------------------------------------
    def _module(self) -> torch.nn.Module:
        return self.stage

    def _eval_slot(self) -> tuple[int, list[int]]:
        return self.place.replica, [self.layout.replica_batch] * self.layout.replicas

    def _check_validation_item(self) -> None:
        """A stage cannot run the model alone: a pipeline's validation set is checked at its first validation."""

    def _eval_forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        k, per = B.batch_len(x), self.layout.replica_batch
        if k < per:  # the schedule's buffers have the training batch's shape: pad, then drop the padding
            x, y = (B.tree_map(lambda t: torch.cat([t, t[-1:].expand(per - k, *t.shape[1:])]), v) for v in (x, y))
        with self._autocast():
            out = self.pipe.evaluate(x, y)
        return B.tree_map(lambda t: t[:k], out) if out is not None else None  # a tuple's every tensor

    # -- checkpoints ---------------------------------------------------------------------------------
    # Each rank writes its stage's parameters and optimizer state to its own shard (checkpoint.save_shard)
    # before rank 0 writes the checkpoint, which holds the rest and the shard count: no rank ever holds
    # another stage's tensors, so a model too large for one host checkpoints and resumes on the hosts
    # that hold it. ``checkpoint.model_state`` merges the stages into the whole model's state dict.
    def _checkpoint(self) -> None:
        self.sync.flush()
        ckpt.save_shard(self.out, self.step, self.env.rank,
                        {"stage": stage_state(self.stage, self.cut.names), "stage_optimizer": self.opt.state_dict(),
                         "pipeline": self._layout_key()})
        dist.barrier()  # every shard is on disk before the checkpoint that names them
        super()._checkpoint()

    def _rank_state(self) -> dict:
        s = super()._rank_state()
        s.pop("model", None)
        s.pop("optimizer", None)
        s.pop("buffers", None)  # the stage's, in its shard
        s["activation_bytes"] = self.acts.total  # the whole run's, as the hook's bytes are
        s["pipeline"] = self._layout_key()
        return s

    def _layout_key(self) -> dict:
        return {"stages": self.layout.stages, "replicas": self.layout.replicas, "runs": self.layout.runs}

    def _model_state(self, ranks: list[dict]) -> dict:
        return {}  # in the shards

    def _checkpoint_extra(self) -> dict:
        return {"shards": self.env.world}

    def _load_model(self, state: dict) -> None:
        if self._same_ranks(state):
            return  # this rank's own shard, in _load_rank
        if self.env.is_main:
            console.print("[yellow]checkpoint from another layout (data-parallel, or other stages): the model is "
                          "loaded, the optimizer's moments start fresh[/yellow]")
        load_stage_state(self.stage, self.cut.names, ckpt.model_state(self.resumed_from, state))

    def _same_ranks(self, state: dict) -> bool:
        ranks = state["ranks"]
        return len(ranks) == self.env.world and all(r.get("pipeline") == self._layout_key() for r in ranks)

    def _load_rank(self, mine: dict) -> None:
        super()._load_rank(mine)
        self.acts.total = int(mine.get("activation_bytes", 0))
        shard = ckpt.load_shard(self.resumed_from, self.env.rank)
        load_stage_state(self.stage, self.cut.names, shard["stage"])  # a replica's own, between averages
        self.opt.load_state_dict(shard["stage_optimizer"])

    def _stage_compute(self) -> list[dict]:
        """Every rank's compute per micro-batch and its share of the schedule's time (the rest: waiting on its
        neighbours, the bubble, the hand-overs) and the cores its process used meanwhile, medians over this
        process's steps after the first
        (:class:`thinwire.pipeline.runner.StageClock`), in rank order."""
        times = self.stage_times[1:] or self.stage_times
        mine = None
        if times:
            m = self.layout.microbatches
            mine = {"rank": self.env.rank, "stages": self.layout.rank_stages(self.place.stage),
                    "replica": self.place.replica, "host": os.environ.get("THINWIRE_HOST") or socket.gethostname(),
                    "forward_s_per_microbatch": statistics.median(t[0] for t in times) / m,
                    "backward_s_per_microbatch": statistics.median(t[1] for t in times) / m,
                    "busy": statistics.median((t[0] + t[1]) / t[2] for t in times if t[2] > 0),
                    # every thread's CPU over the schedule's wall time (the schedule's own work and gloo's
                    # copies included): near the host's quota, the quota paces the stage
                    "cpu": statistics.median(t[3] / t[2] for t in times if t[2] > 0)}
        every = [None] * self.env.world
        dist.all_gather_object(every, mine)
        return [r for r in every if r is not None]

    def _summary_extra(self) -> dict:
        return {"pipeline": {"stage_compute": self._stage_compute(), "spec": self.cfg.pipeline_spec.text,
                             "layout": self.layout.describe(),
                             "stages": self.layout.stages, "replicas": self.layout.replicas,
                             "microbatches": self.layout.microbatches, "runs": self.layout.runs,
                             "links": self.layout.links, "hosts_in_stage_order": self._stage_hosts(),
                             "predicted_step_s": self.predicted_step_s,
                             "activation_bytes_sent": self.acts.total}}

    def _stage_hosts(self) -> list[str]:
        names = self._host_names()
        return [names[r] for r in self.place.ranks()]

    def _bytes_sent(self) -> int:
        return self.comm.wire.bytes_sent + self.acts.total
