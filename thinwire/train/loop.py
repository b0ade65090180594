"""The training loop: the same code for one process, N local processes and many nodes.

Reading order: :func:`train` sets up the process group, :class:`Trainer` builds the workload, wraps
the model in DDP, attaches thinwire's communication hook, resumes from a checkpoint if there is one,
and then each step is: take this rank's slice of the global batch, forward, backward (DDP averages
gradients through the hook while backward runs), clip, optimizer step, log, and now and then
validate and checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire import batch as B
from thinwire.api import attach_policy as attach
from thinwire.cluster.emulator import NIC_ENV
from thinwire.config import to_dict
from thinwire.errors import ThinwireError
from thinwire.precision import prepare_precision, sample_from
from thinwire.syncspec import parse_sync_spec
from thinwire.train import checkpoint as ckpt
from thinwire.train.config import TrainConfig
from thinwire.train.distenv import RESTARTS_BEFORE_ENV, DistEnv, device_for, init, read_env, set_threads
from thinwire.train.metrics import MetricsWriter, write_summary
from thinwire.commspec import TorchSpec
from thinwire.compress.engine import check_core, pin_to_core, threads_on_core, threads_on_engine
from thinwire.compress.sync import SyncMode, create as create_sync
from thinwire.train.peers import PeerComm, PeerLocalSGD
from thinwire.train.planned import PlannedRun
from thinwire.train.progress import ProgressBar, console, summary_table
from thinwire.train.timing import GradReadyClock
from thinwire.workloads.base import GlobalSampler, collate, correct, eval_part, eval_subset, even_shares
from thinwire.workloads.partition import ShardSampler, shards
from thinwire.workloads.registry import build_workload, model_defaults


VALIDATION_NOTE_S = 5.0  # a validation running longer than this logs its progress
# skipped optimizer steps in a row (a non-finite average gradient) that end a run as diverged: more than a
# GradScaler's start takes to find its scale (it halves from 2^16 at each overflow)
MAX_SKIPPED_IN_A_ROW = 50


def train(cfg: TrainConfig, out: Path) -> dict:
    env = read_env()
    device = device_for(env)
    set_threads(env, cfg.threads)
    init(env, device, cfg.timeout_s)
    try:
        summary = trainer_class(cfg)(cfg, out, env, device).fit()
        dist.barrier()  # leave together: a rank tearing down gloo while a peer still talks aborts
        return summary
    finally:
        dist.destroy_process_group()


def trainer_class(cfg: TrainConfig) -> type:
    """The data-parallel :class:`Trainer`, or the pipelined one (``--pipeline``)."""
    if cfg.pipeline_spec.enabled:
        from thinwire.train.pipelined import PipelineTrainer

        return PipelineTrainer
    return Trainer


def resolve(cfg: TrainConfig, wl) -> tuple[int, int, float]:
    return cfg.steps or wl.steps, cfg.batch_size or wl.batch_size, cfg.lr or wl.lr


def _bucket_mb(cfg: TrainConfig) -> float:
    return cfg.comm.bucket_mb(cfg.bucket_mb) if isinstance(cfg.comm, TorchSpec) else cfg.bucket_mb


def average_states(states: list[dict]) -> dict:
    """The ranks' average of each floating-point entry (in float64, stored in its own dtype; an entry equal
    on every rank, as parameters at an average, kept as it is); other entries (counters) rank 0's."""
    out = {}
    for k, first in states[0].items():
        values = [s[k].detach().cpu() for s in states]  # each rank's on its own device
        if not first.is_floating_point() or all(torch.equal(values[0], v) for v in values[1:]):
            out[k] = first
        else:
            out[k] = torch.stack([v.double() for v in values]).mean(0).to(dtype=first.dtype, device=first.device)
    return out


def scalar_loss(value, workload: str):
    """``value``, a workload's loss of one batch, where it is one number to train on; otherwise what it is and
    what it should be (a per-item loss failed in backward as torch's 'grad can be implicitly created only for
    scalar outputs', every rank's traceback)."""
    if torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point():
        return value
    got = (f"a tensor of shape {tuple(value.shape)} ({str(value.dtype).replace('torch.', '')})" if torch.is_tensor(value)
           else f"a {type(value).__name__}")
    raise ThinwireError(f"workload: {workload}'s loss returned {got}; it must return one floating-point tensor for "
                        "the batch, the mean over its items (e.g. nn.CrossEntropyLoss() with its default "
                        "reduction='mean', or loss(out, y).mean()), with the graph back to the model's output.")


def check_batch(batch: int, world: int) -> None:
    if batch % world:
        lo, hi = (batch // world) * world, (batch // world + 1) * world
        raise ThinwireError(
            f"batch_size: must be divisible by the number of workers ({world}) so every worker gets an equal "
            f"share, got {batch}. Use {hi}" + (f" or {lo}" if lo else "") + " instead."
        )


class Trainer:
    def __init__(self, cfg: TrainConfig, out: Path, env: DistEnv, device: torch.device) -> None:
        self.cfg, self.out, self.env, self.device = cfg, out, env, device
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.wl = build_workload(cfg.workload, cfg.model, cfg.data)
        self.steps, self.batch, lr = resolve(cfg, self.wl)
        self._check_batch_against_data()
        self.lr = lr  # the schedule's peak
        self.planned = self._planned_run()
        self.shares = self._batch_shares()
        self.loss_weight = self.planned.loss_weight(env.rank) if self.planned else 1.0
        self._setup_model(lr)  # precision, DDP, the hook or sync mode, the optimizer
        self.offload = self._offload()
        self.repin_pending = bool(self.offload and "core" in self.offload)
        self.horizon = self.steps  # the LR schedule's length; a resume keeps the first start's (see _load)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.sampler = GlobalSampler(len(self.wl.train), self.batch, cfg.seed)
        self.shard = None  # --partition: this rank draws from its own shard only
        if cfg.partition_spec.kind != "iid":
            own = shards(cfg.partition_spec, self.wl.train, env.world, cfg.seed, self.wl.task)[env.rank]
            self.shard = ShardSampler(own, cfg.seed, env.rank)
        self.metrics = MetricsWriter(out, env.is_main, tensorboard=cfg.tensorboard)
        self.step, self.wall_before = 0, 0.0
        self.world_sizes = [[0, env.world]]  # [step, world size] where the run started or changed size
        self.restarts = env.restart_count + int(os.environ.get(RESTARTS_BEFORE_ENV, 0))  # a switch fallback's too
        self.samples_before = (0, 0)  # (step, samples) where this process started: a resume may change the batch
        self.eval_s = 0.0  # seconds spent validating, this run (the checkpoint carries it)
        self.skipped_in_a_row = 0  # optimizer steps skipped for a non-finite gradient, in a row
        self.eval_due = False  # a validation mark passed, waiting for the ranks to agree (:meth:`_validates_now`)
        self.told_wait = False  # that wait was said (once per process)
        self.counts_before: dict[str, int] = {}  # codec use counts of the run before this process's start
        torch.manual_seed(cfg.seed * 1000 + env.rank + 1)  # per-rank randomness (dropout)
        self.step_times: list[float] = []
        self.waits: list[float] = []
        self.last_val: dict = {}
        self.bar_rec: dict | None = None  # the last step's record, for the progress bar

    def _offload(self) -> dict | None:
        """Where the communication work runs (``offload``): on a host with an offload engine (``nic:``; the
        emulator moves the communication threads onto its CPU), or on core N (``core:N``: those threads
        pinned there, the rest off it), every bucket's job runs on the engine thread, none inline on DDP's."""
        cfg = self.cfg
        cores = os.environ.get(NIC_ENV)
        if cfg.offload == "off" or (cfg.offload_core is None and not cores):
            return None
        comm = getattr(self, "comm", None)
        if comm is not None and hasattr(comm, "offload"):
            comm.offload = True
        if cfg.offload_core is None:
            return {"engine_cpu": float(cores)}
        check_core(cfg.offload_core)
        pin_to_core(cfg.offload_core)
        return {"core": cfg.offload_core}

    def _repin(self) -> None:
        """After this process's first step, threads a process group started on first use are pinned like the
        others (``offload=core:N``)."""
        if self.repin_pending:
            pin_to_core(self.offload["core"])
            self.repin_pending = False

    def _planned_run(self) -> PlannedRun | None:
        cfg = self.cfg
        return PlannedRun(cfg.plan, cfg.cluster, cfg.workload, cfg.model, cfg.batch_size) if cfg.plan else None

    def _batch_shares(self) -> list[int]:
        """Each rank's items of the global batch (a plan's uneven shares, else equal ones)."""
        if self.planned:
            self.batch = self.planned.global_batch
            return self.planned.shares
        check_batch(self.batch, self.env.world)
        return even_shares(self.batch, self.env.world)

    def _setup_model(self, lr: float) -> None:
        cfg, env, device = self.cfg, self.env, self.device
        model = self.wl.model.to(device)
        self.prec = prepare_precision(  # int8 layers, auto choice, micro-batches under memory_budget
            model, self._precision_mode(), device=device, batch=self.shares[env.rank], loss_fn=self.wl.loss,
            sample=sample_from(self.wl.train, collate, device, cfg.seed), memory_budget=cfg.memory_budget,
            optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=cfg.weight_decay), clip=cfg.grad_clip)
        self.prec.runner.announce_skips = False  # _log says it, once
        if self.planned:
            self.prec.micro_sizes = self.planned.micro_sizes(env.rank)
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=_bucket_mb(cfg),
                                           device_ids=[device.index] if device.type == "cuda" else None)
        self.comm = self._attach_comm()
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
        self.sync.optimizer, self.sync.clip = self.opt, cfg.grad_clip  # what the mode may read (delayed's prediction)
        self.clock = GradReadyClock(model)
        self.signature = ckpt.model_signature(model)  # after precision's module swaps, as the state dict is

    def _attach_comm(self):
        comm = self._attach_hook() if self.cfg.sync_spec.mode == "allreduce" else None
        if isinstance(self.cfg.comm, TorchSpec) and self.cfg.comm.hook == "localsgd":
            self.sync = PeerLocalSGD(self.ddp, comm, self.cfg.comm)
            return comm
        self.sync = SyncMode(self.ddp, comm) if comm is not None else create_sync(
            self.ddp, self.cfg.sync_spec, self.cfg.comm.policy(), error_feedback=self.cfg.error_feedback,
            warmup_steps=self.cfg.compression_warmup, process_group=dist.group.WORLD, bucket_mb=self.cfg.bucket_mb)
        return self.sync.comm

    def _attach_hook(self):
        if isinstance(self.cfg.comm, TorchSpec):  # PyTorch's own hooks, for head-to-head benchmarks
            return PeerComm(self.ddp, self.cfg.comm)
        # The world group, not a new one: after an elastic restart a new group's store keys can still
        # hold the dead workers' addresses. Safe here because the loop issues its own collectives only
        # between steps, when DDP has waited for every bucket.
        kwargs = dict(error_feedback=self.cfg.error_feedback, warmup_steps=self.cfg.compression_warmup,
                      process_group=dist.group.WORLD)
        state = self.planned.attach(self.ddp, **kwargs) if self.planned else attach(self.ddp, self.cfg.comm, **kwargs)
        if self.cfg.aggregation == "switch":  # int8 buckets through the aggregator on the switch
            from thinwire.compress.switch import BLOCK, connect

            # the port's default block (each bucket's header names its own): the flag's codec, else int8's
            codec = getattr(self.cfg.comm, "codec", None)  # none for a plan or auto
            block = codec.config.block if codec is not None and not self.planned else BLOCK
            state.switch = connect(self.env.rank, self.env.world, self.env.restart_count, self.cfg.timeout_s, block=block)
        return state

    def _lr_factor(self, step: int) -> float:
        warm = self.cfg.warmup_steps
        if step < warm:
            return (step + 1) / warm
        if self.cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, self.horizon - warm))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    # -- the run -------------------------------------------------------------------------------------
    def fit(self) -> dict:
        self._maybe_resume()
        self.first_step = self.step  # where this process began (a resume's step)
        self.t_start = time.perf_counter()
        bar = ProgressBar(self.steps, self.step, self.env.is_main, f"{self.cfg.workload} x{self.env.world}")
        try:
            while self.step < self.steps:
                try:
                    rec = self._train_step()
                except RuntimeError as e:
                    raise self._unused_parameters(e) or e
                self.step += 1
                self._repin()
                self._log(rec, bar)
                self.eval_due |= self.step % self.cfg.eval_every == 0 or self.step == self.steps
                if self.eval_due and self._validates_now(bar):
                    self._validate(bar)
                    self.eval_due = False
                if self._checkpoints_now():
                    self._checkpoint()
        except ThinwireError as e:
            if str(e).startswith("cannot write"):  # a full disk: the run's last checkpoint is whole
                last = ckpt.latest(self.out)
                raise ThinwireError(f"{e} The run stopped at step {self.step}; " + (
                    f"go on from its last checkpoint (step {ckpt.step_of(last)}) with `thinwire train --resume "
                    f"{self.out}`." if last else "it had written no checkpoint yet.")) from None
            raise
        finally:
            bar.close()
            self.sync.flush()
            if self.offload:  # counted while the engine thread still runs: close() ends it
                self.offload["threads_on_engine"] = (threads_on_core(self.offload["core"]) if "core" in self.offload
                                                     else threads_on_engine())
            self.comm.close()
        return self._finish()

    def _train_step(self) -> dict:
        t0 = time.perf_counter()
        if self.shard is not None:
            indices = self.shard.indices(self.step, self.shares[self.env.rank])
        else:
            indices = self.sampler.rank_indices(self.step, self.env.rank, self.shares)
        x, y = self._collate(self._sets(self.step)[0], indices, "training")
        x, y = B.to(x, self.device, non_blocking=True), B.to(y, self.device, non_blocking=True)
        t1 = time.perf_counter()
        bytes_before = self.comm.wire.bytes_sent
        with self.prec.measure(self.opt, *B.tensors(x), *B.tensors(y)):  # peak memory of the first steps
            loss, n, total = torch.zeros((), device=self.device), len(self.prec.micro_sizes), B.batch_len(y)
            for i, (xm, ym) in enumerate(zip(B.split(x, self.prec.micro_sizes), B.split(y, self.prec.micro_sizes))):
                with self.ddp.no_sync() if i < n - 1 else self.sync.no_sync():  # all-reduce once, at the end
                    with self._autocast():
                        part = self._forward_loss(xm, ym) * (B.batch_len(ym) / total * self.loss_weight)
                    t2 = time.perf_counter()
                    self.prec.runner.backward(part)
                loss += part.detach()
            if isinstance(self.comm, PeerComm):
                self.comm.count_step_without_hook()
            if self.sync.name != "allreduce":
                self._check_gradients()
            self.sync.before_step()  # delayed: the last step's average becomes the gradient
            wait = self.clock.exposed_wait(time.perf_counter(), t2)
            skipped = self.prec.runner.step(self.opt, self.ddp.parameters(), self.cfg.grad_clip)
            t3 = time.perf_counter()
            self.sync.optimizer = self.opt   # what the mode may read (dynamic:by_lr's learning rate)
            self.sync.after_step()  # local, diloco: parameters averaged every H steps (blocking: a wait)
            wait += time.perf_counter() - t3
            self.opt.zero_grad(set_to_none=True)
        lr = self.sched.get_last_lr()[0]  # the rate this step trained at (the next step's from here)
        self.sched.step()
        t4 = time.perf_counter()
        self.step_times.append(t4 - t0)
        self.waits.append(wait)
        return {"loss": loss.item() / self.loss_weight, "step_time_s": t4 - t0, "compute_s": (t4 - t1) - wait, "comm_wait_s": wait,
                "data_s": t1 - t0, "bytes_sent": self.comm.wire.bytes_sent - bytes_before,
                "lr": lr, "skipped": skipped}

    def _autocast(self):
        return self.prec.runner.context()

    def _log(self, rec: dict, bar: ProgressBar) -> None:
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if rec["skipped"] else 0
        if rec["skipped"]:
            runner = self.prec.runner
            scale = f"; loss scale now {runner.scaler.get_scale():g}" if runner.scaler is not None else ""
            bar.log(f"step {self.step}: non-finite gradient ({runner.last_grad_norm}), optimizer step skipped{scale}")
        # the same on every rank (the average is non-finite): many in a row, or every step this process trained
        # (not where fp16's loss scaler is still finding its scale: a finite loss, its gradients overflowed)
        every = self.step == self.steps and self.skipped_in_a_row >= self.step - self.first_step
        if every and self.prec.runner.scaler is not None:  # searching: every rank's loss finite (each has its own)
            every = not self._all_ranks(math.isfinite(rec["loss"]))
        if self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW or every:
            self.metrics.write({"step": self.step, "samples": self._samples(), "wall_s": self._wall(), **rec})
            last = ckpt.latest(self.out)
            raise ThinwireError(
                f"training diverged: the last {self.skipped_in_a_row} step(s) all had a non-finite gradient (loss "
                f"{rec['loss']}), so none of them changed the model; the run stopped at step {self.step}. Lower --lr, "
                "train in --precision fp32, or check the workload's loss for NaN"
                + (f"; --resume {self.out} goes on from step {ckpt.step_of(last)}." if last else "."))
        if self.step % self.cfg.log_every == 0 or rec["skipped"]:
            rec = {"step": self.step, "samples": self._samples(), "wall_s": self._wall(), **rec}
            if not rec["skipped"]:
                rec.pop("skipped")
            self.metrics.write(rec)
        self.bar_rec = rec
        bar.update(self.step, self._bar_info())

    def _bar_info(self) -> str:
        """The progress bar's text: the last step's loss and time and the last validation's loss."""
        rec = self.bar_rec
        val = f" val {self.last_val['val_loss']:.3f}" if self.last_val else ""
        return f"loss {rec['loss']:.3f}{val} {rec['step_time_s'] * 1e3:.0f} ms/step"

    def _sets(self, step: int) -> tuple:
        """(train, val) at ``step``: a drifting workload's (:attr:`Workload.data_at`), else its own."""
        return self.wl.data_at(step) if self.wl.data_at is not None else (self.wl.train, self.wl.val)

    def _all_ranks(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (where the ranks step together: a diverging mode's ranks skip
        steps each on its own gradient, so each decides alone)."""
        if self.sync.diverges or not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item() > 0)

    def _wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    # -- validation ----------------------------------------------------------------------------------
    def _validates_now(self, bar: ProgressBar) -> bool:
        """A validation that is due runs now, unless the ranks diverge and average again within the run:
        then at that average (at most a period late), where the ranks hold one model and the consensus
        sends no parameters, as federated averaging evaluates its global model at the end of a round.
        The first such wait is said once."""
        wait = self.sync.steps_to_agreement()
        if wait is None or wait == 0 or self.step + wait > self.steps:
            return True
        if not self.told_wait:
            self.told_wait = True
            bar.log(f"step {self.step}: validation moves to step {self.step + wait}, the ranks' next average "
                    f"(--sync {self.sync.name}: their one model there, no parameters sent); so does every mark "
                    "between averages")
        return False

    @torch.no_grad()
    def _validate(self, bar: ProgressBar) -> None:
        t0 = time.perf_counter()
        with self.sync.consensus():  # modes whose ranks diverge: their average is the run's model
            self._validate_model(bar, t0)
        self.eval_s += time.perf_counter() - t0

    def _validate_model(self, bar: ProgressBar, t0: float) -> None:
        """Validate this rank's model as it is (the ranks' average, inside :meth:`_validate`); the record's
        ``eval_s`` is the run's validation time so far, this one included (``wall_s`` minus it: training's)."""
        model, val = self._module(), self._sets(self.step)[1]
        model.eval()
        slot, shares = self._eval_slot()
        subset, per = eval_subset(len(val), self.cfg.eval_batches, self.batch), shares[slot]
        mine = [subset[i] for i in eval_part(len(subset), shares, slot)]
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # NCCL reduces CUDA tensors only
        said = time.perf_counter()
        for i in range(0, len(mine), per):
            if time.perf_counter() - said > VALIDATION_NOTE_S:  # a long validation says how far it is
                bar.log(f"step {self.step}: validating, {i} of {len(mine)} items on this rank")
                said = time.perf_counter()
            x, y = self._collate(val, mine[i : i + per], "validation")
            x, y = B.to(x, self.device), B.to(y, self.device)
            out = self._eval_forward(x, y)
            if out is None:  # a pipeline stage before the last
                continue
            n = B.batch_len(y)
            totals += torch.tensor([float(self.wl.loss(out, y)) * n, self._correct(out, y), n], dtype=torch.float64,
                                   device=totals.device)
        model.train()
        dist.all_reduce(totals)
        self.last_val = self._val_record(*totals.tolist())
        self.metrics.write({"step": self.step, "samples": self._samples(), "wall_s": self._wall(),
                            "eval_s": self.eval_s + time.perf_counter() - t0, **self.last_val})
        bar.log(f"step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in self.last_val.items()))
        if self.bar_rec is not None:  # the bar's last frame shows this validation, not the one before
            bar.update(self.step, self._bar_info())

    def _module(self) -> torch.nn.Module:
        """This rank's model (a pipeline rank's: its stage)."""
        return self.ddp.module

    def _eval_slot(self) -> tuple[int, list[int]]:
        """(this rank's slot, every slot's items per forward: its training share); which items each validates:
        :func:`~thinwire.workloads.base.eval_part`."""
        return self.env.rank, [max(1, s) for s in self.shares]

    def _eval_forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        with self._autocast():
            return self.ddp.module(x)

    def _correct(self, out: torch.Tensor, y: torch.Tensor) -> float:
        return correct(out, y) if self.wl.task == "classification" else 0.0

    def _val_record(self, loss_sum: float, correct: float, count: float) -> dict:
        rec = {"val_loss": loss_sum / count}
        if self.wl.task == "lm":
            rec["val_bpb"] = rec["val_loss"] / math.log(2)
        if self.wl.task == "classification":
            rec["val_accuracy"] = correct / count
        return rec

    # -- checkpoints ---------------------------------------------------------------------------------
    def _rank_state(self) -> dict:
        sync = self.sync.state_dict()  # first: it waits for averages in flight, whose residuals the comm state holds
        s = {"rng": torch.get_rng_state(), "comm": self.comm.state_dict(), "precision": self.prec.runner.state_dict(),
             "sync": sync}
        if (int8 := self.prec.int8_state()) is not None:
            s["int8"] = int8
        s["consensus_bytes"] = self.sync.consensus_bytes  # validation's averages, counted over the whole run
        if self.sync.diverges:  # ranks' parameters and optimizer states differ between averages
            s["model"], s["optimizer"] = self._module().state_dict(), self.opt.state_dict()
        else:  # buffers (BatchNorm's statistics) differ where forward runs outside DDP's sync (delayed)
            params = {name for name, _ in self._module().named_parameters()}
            s["buffers"] = {k: v for k, v in self._module().state_dict().items() if k not in params}
        if self.device.type == "cuda":
            s["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return s

    def _checkpoint(self) -> None:
        ranks = [None] * self.env.world if self.env.is_main else None
        dist.gather_object(self._rank_state(), ranks, dst=0)
        if not self.env.is_main:
            return
        state = {"step": self.step, "samples": self._samples(), "wall_s": self._wall(), "eval_s": self.eval_s,
                 "eval_due": self.eval_due, "last_val": self.last_val,  # the summary's result, where only it is left
                 "model": self._model_state(ranks), "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "lr_horizon": self.horizon,
                 "compression_counts": self._compression_counts(), "signature": self.signature,
                 "config": to_dict(self.cfg), "world_size": self.env.world, "world_sizes": self.world_sizes,
                 "ranks": ranks, "precision_mode": self.prec.mode,
                 **self._checkpoint_extra()}
        ckpt.save(self.out, state, self.cfg.keep_checkpoints)

    def _checkpoints_now(self) -> bool:
        return self.step % self.cfg.checkpoint_every == 0 or self.step == self.steps

    def _checkpoint_extra(self) -> dict:
        return {}

    def _model_state(self, ranks: list[dict]) -> dict:
        """The whole model's state dict for the checkpoint (rank 0 holds it; a pipeline merges its stages').
        Where ranks diverge, their average (what :meth:`SyncMode.consensus` evaluates): what ``thinwire``
        exports and a job of another size resumes from, made on rank 0 from the ranks' own states that the
        checkpoint gathers anyway (each stays in its ``ranks`` entry for an exact resume)."""
        if not self.sync.diverges:
            state = self.ddp.module.state_dict()
            if self.sync.buffers_diverge and all(r.get("buffers") for r in ranks):  # delayed: their BatchNorm statistics
                state.update(average_states([r["buffers"] for r in ranks]))
            return state
        return average_states([r["model"] for r in ranks])

    def _maybe_resume(self) -> None:
        source = self._resume_source()
        box = [None, None]
        if self.env.is_main and source is not None:
            box[0] = ckpt.load(source)
            ckpt.check_signature(source, box[0]["signature"], self.signature)
            box[1] = str(source)
        dist.broadcast_object_list(box, src=0)
        self.resumed_from = Path(box[1]) if box[1] else None
        if box[0] is None:
            if self.cfg.resume or self.env.restart_count:  # stopped before its first checkpoint: from step 0 again
                self.metrics.resumed_at(0)
            self.metrics.write({"event": "start", "step": 0, "restart_count": self.restarts, "world_size": self.env.world})
            return
        self._load(box[0])
        self.metrics.resumed_at(self.step)
        event = "restart" if self.env.restart_count else "resume"
        if self.step < self.steps or self.env.restart_count:  # with nothing to train the folder stays as it was,
            self.metrics.write({"event": event, "step": self.step, "restart_count": self.restarts,  # but a restart's
                                "from": str(source), "world_size": self.env.world,               # record is kept
                                "checkpoint_world_size": len(box[0]["ranks"])})
        if self.env.is_main:
            console.print(f"[bold]{event}[/bold] from {source} at step {self.step}")
            if self.step >= self.steps and self.env.restart_count:  # a worker failed after the last checkpoint
                console.print(f"the run had reached step {self.step} of {self.steps} before the failure: only its "
                              "summary is left to write")
            elif self.step >= self.steps:
                console.print(f"[yellow]the run is already at step {self.step} and --steps is {self.steps}: nothing "
                              f"to train. Pass a larger --steps to go on.[/yellow]")

    def _note_changes(self, saved: dict) -> None:
        """Say where this job's seed, partition, codec, data or model options (those that leave the parameters'
        shapes as they are: dropout, say) differ from the checkpoint's: the run goes on, but from here it is
        another run's."""
        what = {"seed": "the data order and per-rank randomness", "partition": "each rank's shard of the data",
                "compression": "what crosses the wire, and its error-feedback residuals",
                "precision": "the arithmetic of forward and backward"}
        changed = [f"--{k} {saved[k]} -> {getattr(self.cfg, k)} ({v})" for k, v in what.items()
                   if k in saved and saved[k] != getattr(self.cfg, k)]
        if "data" in saved and saved["data"] != self.cfg.data:
            changed.append(f"--data {saved['data']} -> {self.cfg.data} (the samples it trains and validates on)")
        defaults = model_defaults(self.cfg.workload)  # the options a config leaves out
        old, new = {**defaults, **(saved.get("model") or {})}, {**defaults, **(self.cfg.model or {})}
        model = [f"model.{k} {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new), key=str)
                 if k in old and k in new and old[k] != new[k]]
        if model:
            changed.append(f"{', '.join(model)} (the model's options)")
        if changed and self.env.is_main:
            console.print(f"[yellow]resumed with other settings than the checkpoint's: {'; '.join(changed)}; the run "
                          "goes on from its checkpoint, no longer bit-identical to one that kept them[/yellow]")

    def _precision_mode(self) -> str:
        """``--precision``, but ``auto`` resumed (or restarted) takes the mode its run chose and checkpointed:
        choosing again could change the arithmetic in the middle of a run (the trials' timings vary)."""
        if self.cfg.precision != "auto":
            return self.cfg.precision
        box = [None]
        if self.env.is_main and (source := self._resume_source()) is not None:
            box[0] = ckpt.load(source).get("precision_mode")
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return "auto"
        if self.env.is_main:
            console.print(f"precision auto: {box[0]}, as the run chose at its start (its checkpoint)")
        return box[0]

    def _resume_source(self) -> Path | None:
        if not self.env.is_main:
            return None
        # The run folder was checked before anything was written (thinwire.train.runfolder): it is new,
        # this run's own (restarted), or the folder being resumed in place; a checkpoint there is ours.
        if ckpt.latest(self.out):
            return ckpt.latest(self.out)
        if self.cfg.resume:
            found, _ = ckpt.resume_point(Path(self.cfg.resume))
            if found is None and not ckpt.stopped_before_first(Path(self.cfg.resume)):
                raise ThinwireError(f"resume: folder {self.cfg.resume!r} holds no checkpoint (checkpoints/step_*.pt). "
                                    "Pass the --out folder of an earlier run.")
            return found
        return None

    def _load(self, state: dict) -> None:
        self._load_model(state)
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.wall_before = int(state["step"]), float(state["wall_s"])
        history = [list(map(int, w))
                   for w in state.get("world_sizes") or [[0, state.get("world_size", self.env.world)]]]
        self.world_sizes = history + ([[self.step, self.env.world]] if history[-1][1] != self.env.world else [])
        self.samples_before = (self.step, int(state.get("samples", self.step * self.batch)))
        # the global batch it was trained with (a config's None: the workload's default)
        self._load_batch = int(state.get("config", {}).get("batch_size") or self.wl.batch_size)
        self.eval_s = float(state.get("eval_s", 0.0))
        self.eval_due = bool(state.get("eval_due", False))  # a validation waiting for the ranks' next average
        self.last_val = {str(k): float(v) for k, v in (state.get("last_val") or {}).items()}
        self._load_horizon(state)
        self._note_changes(state.get("config", {}))
        self.counts_before = {str(k): int(v) for k, v in state.get("compression_counts", {}).items()}
        ranks = state["ranks"]
        if self._same_ranks(state):
            self._load_rank(ranks[self.env.rank])
            if "counts" in ranks[self.env.rank]["comm"].get("counters", {}):  # the hook's own counts go on
                self.counts_before = {}
        elif self.env.is_main and not self._same_sync(state):
            saved = state["config"]["sync"]
            console.print(f"[yellow]checkpoint trained with --sync {saved}, this job with {self.cfg.sync}: every rank "
                          f"starts from the ranks' average, and error-feedback residuals, RNG streams and "
                          f"{self.cfg.sync_spec.mode}'s own state start fresh[/yellow]")
        elif self.env.is_main:
            kind = "pipelined ranks" if state.get("shards") else "ranks"
            other = " in another layout" if len(ranks) == self.env.world else ""
            mode = (f"; every rank starts from the ranks' average, and {self.cfg.sync_spec.mode}'s own state afresh"
                    if self.sync.diverges and "model" in (ranks[0] or {}) else "")
            console.print(f"[yellow]checkpoint has {len(ranks)} {kind}, this job {self.env.world}{other}: "
                          f"error-feedback residuals and RNG streams start fresh{mode}[/yellow]")
        self._retune()

    def _check_batch_against_data(self) -> None:
        """A global batch larger than the training set repeats its items within a step: said; far larger (a typo's
        extra zeros) refused, where each step would gather that many items (10**9 ran out of memory in the sampler)."""
        n, what = len(self.wl.train), f"the training set ({len(self.wl.train)} items)"
        if self.batch > 16 * n:
            raise ThinwireError(f"batch_size: {self.batch} is {self.batch / n:.0f}x {what}: every step would gather "
                                f"each item {self.batch // n} times. Use a --batch-size of at most {n}, or more data.")
        if self.batch > n and self.env.is_main:
            console.print(f"[yellow]batch_size {self.batch} is larger than {what}: each step sees items more than "
                          "once (a smaller --batch-size, or more data, does not)[/yellow]")

    def _forward_loss(self, x, y):
        """The workload's loss of its model's output. On this process's first step an error there is the
        workload's (its model does not take the data's inputs, its loss not the outputs): said in one paragraph,
        where in the user's code, not as every rank's traceback."""
        what = "model's forward"
        try:
            out = self.ddp(x)
            what = "loss"
            loss = scalar_loss(self.wl.loss(out, y), self.cfg.workload)
            if self.step == self.first_step and self.wl.task == "classification":
                correct(out.detach(), y)  # targets accuracy cannot be read from: said now, not at the first validation
            if self.step == self.first_step:
                # outside the step's memory meter: a validation item viewed from a tensor dataset counted the whole
                # validation set's storage in the step's peak (90x the budget on a small one); this is no training
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes():
                    self._check_validation_item()
            return loss
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            if self.step != self.first_step or isinstance(e, (dist.DistError, torch.cuda.OutOfMemoryError)):
                raise
            import traceback

            shape = lambda b: str(B.tree_map(lambda t: tuple(t.shape), b))[:200]  # noqa: E731
            given = (f"inputs of shape {shape(x)}" if what != "loss" else
                     f"the model's output of shape {shape(out)}") + f", targets {shape(y)}"
            own = [f for f in traceback.extract_tb(e.__traceback__)
                   if not any(part in f.filename for part in ("/torch/", "/thinwire/"))]
            where = f" (at {own[-1].filename}:{own[-1].lineno}, in {own[-1].name})" if own else ""
            raise ThinwireError(f"workload: {self.cfg.workload}'s {what} failed on the first batch ({given}): "
                                f"{type(e).__name__}: {str(e)[:300]}{where}. The model takes the data's inputs, the "
                                "loss the model's output and the targets: check the workload's shapes and types (call "
                                "them in Python on one batch to see the whole traceback).") from None

    def _collate(self, dataset, indices: list[int], which: str):
        """The items' batch; a dataset that fails to give one (a corrupt record, a missing file) says so in one
        paragraph, where in the user's code and what is kept, not as every rank's traceback."""
        try:
            return collate(dataset, indices)
        except Exception as e:  # the user's dataset: any error is its own
            if isinstance(e, (dist.DistError, torch.cuda.OutOfMemoryError, ThinwireError)):
                raise
            import traceback

            own = [f for f in traceback.extract_tb(e.__traceback__)
                   if not any(part in f.filename for part in ("/torch/", "/thinwire/"))]
            where = f" (at {own[-1].filename}:{own[-1].lineno}, in {own[-1].name})" if own else ""
            items = f"one of items {', '.join(map(str, indices[:8]))}" + (", ..." if len(indices) > 8 else "")
            if not hasattr(dataset, "batch"):  # which one: each alone
                for i in indices:
                    try:
                        dataset[i]
                    except Exception:  # noqa: BLE001 - the same error, found at its item
                        items = f"item {i}"
                        break
            raise ThinwireError(f"workload: {self.cfg.workload}'s {which} set failed to give {items} at step "
                                f"{self.step}: {type(e).__name__}: {str(e)[:300]}{where}. The run's checkpoints are "
                                f"kept: mend the data and go on with --resume {self.out}.") from None

    def _check_validation_item(self) -> None:
        """The model and loss on the validation set's first item, before any work: a validation set that does not
        fit the model (or its loss) failed at the first validation, every step before it lost with a traceback.
        Its RNG state is put back (a model drawing in eval mode would otherwise draw differently on a resume)."""
        val = self._sets(self.step)[1]
        if not len(val):
            return
        x, y = self._collate(val, [0], "validation")
        x, y = B.to(x, self.device), B.to(y, self.device)
        model = self._module()
        devices = [self.device] if self.device.type == "cuda" else []
        from thinwire.precision.quant import COUNTERS, Int8Stats

        stats = [COUNTERS] + [m.stats for m in model.modules() if isinstance(getattr(m, "stats", None), Int8Stats)]
        counts = [(s.int8, s.float) for s in stats]  # int8's matmul counts: a check is no training step
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), self._autocast():
                model.eval()
                out = model(x)
                scalar_loss(self.wl.loss(out, y), self.cfg.workload)
                if self.wl.task == "classification":
                    correct(out, y)
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            if isinstance(e, (dist.DistError, torch.cuda.OutOfMemoryError)):
                raise
            raise ThinwireError(f"workload: {self.cfg.workload}'s validation set does not fit its model or loss "
                                f"(its first item: {type(e).__name__}: {str(e)[:300]}), though the training batch "
                                "did: the validation items are the training items' kind (same shapes and types) "
                                "and the loss takes the model's output on them. "
                                + ("Nothing was trained." if self.step == 0 else
                                   f"This launch trained nothing; the run's checkpoints (step {self.step}) are kept.")
                                ) from None
        finally:
            model.train()
            for s, (i, f) in zip(stats, counts):
                s.int8, s.float = i, f

    def _unused_parameters(self, e: RuntimeError) -> ThinwireError | None:
        """DDP's error for parameters that got no gradient (its advice, ``find_unused_parameters``, is no option
        of thinwire's), as one paragraph naming them; None for any other error."""
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(e))
        if "Expected to have finished reduction" not in str(e) or found is None:
            return None
        trainable = [name for name, p in self._module().named_parameters() if p.requires_grad]
        names = [trainable[int(i)] if int(i) < len(trainable) else f"#{i}" for i in found.group(1).split()]
        return self._no_gradient(names, self.step)  # DDP says so in the next step's forward

    def _check_gradients(self) -> None:
        """A mode that averages outside DDP's backward (DDP's ``no_sync``: its own check for parameters without a
        gradient is off there): refuse a trainable parameter that got none, as DDP does in ``allreduce`` (the mode
        would average zeros for it, and weight decay and momentum would move what the loss does not use)."""
        missing = [name for name, p in self._module().named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise self._no_gradient(missing, self.step + 1)

    @staticmethod
    def _no_gradient(names: list[str], step: int) -> ThinwireError:
        return ThinwireError(f"model: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} got no gradient in step "
                             f"{step}: the loss does not depend on {'it' if len(names) == 1 else 'them'}. thinwire train "
                             "averages every trainable parameter, so each must get a gradient every step: freeze what the "
                             "forward does not use (p.requires_grad_(False) in your workload) or remove it from the model.")

    def _samples(self) -> int:
        """Samples trained so far: the checkpoint's, and this process's steps at its batch (a resume may change it)."""
        step, samples = self.samples_before
        return samples + (self.step - step) * self.batch

    def _retune(self) -> None:
        """A resume with another ``--lr``, ``weight_decay`` or batch: the optimizer's and scheduler's state dicts brought
        back the checkpoint's; this run's are applied from the next step on (the schedule goes on at the new peak),
        and said."""
        changes = []
        if self.sched.base_lrs and self.sched.base_lrs[0] != self.lr:
            changes.append(f"lr {self.sched.base_lrs[0]:g} -> {self.lr:g}")
            self.sched.base_lrs = [self.lr] * len(self.opt.param_groups)
            for group in self.opt.param_groups:
                group["initial_lr"], group["lr"] = self.lr, self.lr * self._lr_factor(self.step)
            self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]
        wd = {g.get("weight_decay") for g in self.opt.param_groups}
        if wd != {self.cfg.weight_decay} and all(w is not None for w in wd):
            changes.append(f"weight_decay {', '.join(f'{w:g}' for w in sorted(wd))} -> {self.cfg.weight_decay:g}")
            for group in self.opt.param_groups:
                group["weight_decay"] = self.cfg.weight_decay
        if (before := self._load_batch) != self.batch:
            changes.append(f"batch {before} -> {self.batch}")
        if changes and self.env.is_main:
            console.print(f"[yellow]resumed with {', '.join(changes)}: the optimizer goes on with this run's from step "
                          f"{self.step + 1}[/yellow]")

    def _load_model(self, state: dict) -> None:
        self.ddp.module.load_state_dict(ckpt.model_state(self.resumed_from, state))  # a pipeline's: its stages merged
        if state.get("shards"):  # a pipelined run's: each stage had its own optimizer
            if self.env.is_main:
                console.print("[yellow]checkpoint of a pipelined run: the model is loaded, the optimizer's moments "
                              "start fresh[/yellow]")
            return
        self.opt.load_state_dict(state["optimizer"])

    def _same_ranks(self, state: dict) -> bool:
        """Whether the checkpoint's per-rank states are this job's ranks' (else they start fresh)."""
        return len(state["ranks"]) == self.env.world and not state.get("shards") and self._same_sync(state)

    def _same_sync(self, state: dict) -> bool:
        """Whether the checkpoint was trained with this job's sync mode. A rank's state is its mode's (an anchor,
        its own parameters mid-period, a pending gradient): under another mode it starts from the ranks' average."""
        saved = (state.get("config") or {}).get("sync")
        if saved is None:
            return True
        try:
            return parse_sync_spec(str(saved)).text == parse_sync_spec(self.cfg.sync).text
        except ThinwireError:
            return False

    def _load_rank(self, mine: dict) -> None:
        torch.set_rng_state(mine["rng"])
        if "cuda_rng" in mine and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda_rng"], self.device)
        self.comm.load_state_dict(mine["comm"])
        self.sync.load_state_dict(mine.get("sync", {}))
        if "model" in mine:  # a mode whose ranks differ mid-period: this rank's own
            self._module().load_state_dict(mine["model"])
            self.opt.load_state_dict(mine["optimizer"])
        elif mine.get("buffers"):
            self._module().load_state_dict(mine["buffers"], strict=False)
        # (the mode's load_state_dict keeps each rank's own buffers where forward runs outside DDP's sync)
        if mine.get("precision"):
            self.prec.runner.load_state_dict(mine["precision"])  # fp16 loss scale
        self.prec.load_int8_state(mine.get("int8"))  # int8 compute's rounding noise
        self.sync.consensus_bytes = int(mine.get("consensus_bytes", 0))

    def _load_horizon(self, state: dict) -> None:
        """Keep the schedule's horizon from the first start, or fit it to this launch's steps (reschedule).

        Checkpoints from before ``lr_horizon`` existed: the steps their run was configured with."""
        saved = int(state.get("lr_horizon") or state["config"].get("steps") or self.wl.steps)
        self.horizon = self.steps if self.cfg.reschedule else saved
        if self.horizon != saved:  # the next step's LR as a straight run of the new length has it
            for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
                group["lr"] = base * self._lr_factor(self.step)
            self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]
        if self.env.is_main and self.horizon != self.steps and self.cfg.schedule == "cosine":
            console.print(f"LR schedule: horizon kept at {self.horizon} steps (this run has {self.steps}); "
                          "--reschedule fits it to the new total")

    def _compression_counts(self) -> dict[str, int]:
        """How often each codec ran, over the whole run: the hook counts only since this process started."""
        counts = dict(self.counts_before)
        for name, n in self.comm.stats().get("counts", {}).items():
            counts[name] = counts.get(name, 0) + int(n)
        return counts

    def _compression_stats(self) -> dict:
        stats = self.comm.stats()
        if "counts" in stats:
            stats["counts"] = self._compression_counts()
        return stats

    # -- the end -------------------------------------------------------------------------------------
    def _bytes_sent(self) -> int:
        """What this rank sent over the whole run (since this process started)."""
        return self.comm.wire.bytes_sent

    def _summary_extra(self) -> dict:
        """More of ``summary.json`` (a pipelined run's layout); called on every rank."""
        return {}

    def _finish(self) -> dict:
        totals = torch.tensor([float(self._bytes_sent()), float(self.sync.consensus_bytes)], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(totals)
        summary = {
            "out": str(self.out), "workload": self.cfg.workload, "steps": self.step, "world_size": self.env.world,
            "world_sizes": self.world_sizes, "samples": self._samples(), "wall_s": self._wall(), **self.last_val,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "backend": dist.get_backend(),
            "median_step_time_s": statistics.median(self.step_times) if self.step_times else None,
            "median_comm_wait_s": statistics.median(self.waits) if self.waits else None,
            "bytes_sent_total": self._bytes_sent(), "bytes_sent_total_all_ranks": int(totals[0]),
            **({"bytes_sent_consensus_all_ranks": int(totals[1])} if self.sync.diverges else {}),  # validation's
            "compression": self.comm.policy.describe(), "compression_stats": self._compression_stats(),
            "sync": {"mode": self.cfg.sync_spec.text, **self.sync.stats()},
            **({"auto_decisions": self.comm.policy.decisions} if hasattr(self.comm.policy, "decisions") else {}),
            "precision": self.prec.runner.mode.value,  # auto's choice, not "auto"
            **({"precision_asked": self.cfg.precision} if self.cfg.precision != self.prec.runner.mode.value else {}),
            "restarts": self.restarts, "lr_horizon": self.horizon,
            "peak_memory_bytes": self.prec.peak_memory_bytes(), "precision_report": self.prec.report(),
            "unigram_entropy_bits": self.wl.info.get("unigram_entropy_bits"),
            "workload_info": self.wl.info,
            "config": {**to_dict(self.cfg), "steps": self.steps, "batch_size": self.batch, "lr": self.lr},
            **({"offload": self.offload} if self.offload else {}),
            **self._summary_extra(),
        }
        kept = self.out / "summary.json"
        # a resume with nothing to train: the folder stays as it was (its summary; none where it was stopped before
        # this --steps: one would be of a job that never ran), but a run stopped between its last checkpoint and
        # its summary gets the summary now
        if not self.step_times and (kept.is_file() or self.step > self.steps):
            try:
                summary = json.loads(kept.read_text()) if kept.is_file() else summary
            except (OSError, ValueError):
                pass
            if self.env.is_main:
                self.metrics.close()
                console.print(summary_table(summary))
            return summary
        if self.env.is_main:
            write_summary(self.out, summary)
            for d in summary.get("auto_decisions", []):  # auto's decisions, for TensorBoard's text tab
                self.metrics.board_text("auto", d, int(d.get("step", 0)))
            self.metrics.close()
            console.print(summary_table(summary))
        return summary
