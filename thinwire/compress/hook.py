"""The DDP communication hook: compressed, error-fed gradient averaging that any script can attach.

    state = thinwire.attach(ddp_model, "topk:ratio=0.01", error_feedback=True)
    ...train as usual...
    state.stats()                          # bytes_raw, bytes_sent, compress_s, per-codec counts
    torch.save(state.state_dict(), f)      # residuals travel with the checkpoint

How a bucket travels (every rank decides identically, from sizes and the step number alone):

1. The bucket is divided by the world size first (so fp16 sums cannot overflow).
2. During ``warmup_steps``, or when the bucket is smaller than ``min_compress_bytes``, it is
   all-reduced in fp32.
3. Otherwise error feedback adds the bucket's residual (every codec but ``bf16``, whose unbiased
   rounding needs none; see ``Codec.needs_feedback``), the codec encodes it, and the scheme in
   :mod:`thinwire.compress.schemes` moves the payload: all-reduce for summable payloads, all-gather
   (or a compressed reduce-scatter + all-gather) with local decoding for quantized ones, PowerSGD's
   two factor all-reduces for ``powersgd``.
4. A non-finite gradient on any rank is never folded into a residual. ``nonfinite="skip"`` (the
   default) makes the bucket's result NaN on every rank, as uncompressed DDP would, and logs a warning
   (a GradScaler, or ``thinwire train``, then skips the optimizer step; a loop of one's own checks the
   gradients before stepping); ``"raise"`` fails the backward: the hook raises ``FloatingPointError``,
   which DDP's reducer re-raises as a ``RuntimeError`` naming the bucket and the step.

Bucket jobs run in order on one communication thread (:mod:`thinwire.compress.engine`), so any
DDP bucket layout works on gloo and NCCL alike. A bucket that needs only all-reduces (fp32, and the
summable codecs but PowerSGD) is issued asynchronously from DDP's own thread when the communication
thread has nothing left to issue, as PyTorch's hooks do; the order of collectives is the same.
"""

from __future__ import annotations

import datetime
import math
import logging
import time
from collections import Counter
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from thinwire.compress.codecs.base import Codec
from thinwire.compress.codecs.common import all_finite
from thinwire.compress.wire import Wire
from thinwire.compress.engine import CommThread, for_ddp
from thinwire.compress.feedback import ErrorFeedback
from thinwire.compress import schemes

log = logging.getLogger("thinwire.compress")
MIN_COMPRESS_BYTES = 4096  # a bucket smaller than this goes uncompressed (fp32): too small for a codec to pay


class Policy:
    """Chooses the codec of each bucket; must answer identically on every rank.

    A subclass answers :meth:`codec_for` and :meth:`describe`; the other hooks do nothing here and
    are there for an online policy (``auto``) to override: :meth:`bind` is called once by
    :func:`attach`, :meth:`observe` sees each bucket's gradient before it travels, and :meth:`busy`
    moves a bucket whose ``observe`` or ``codec_for`` does heavy work onto the communication thread.

    Example::

        class Int8AfterWarmup(Policy):
            def codec_for(self, bucket, numel, step):
                return parse_codec_spec("int8" if step >= 10 else "bf16")

            def describe(self):
                return "bf16, then int8"
    """

    def codec_for(self, bucket: int, numel: int, step: int) -> Codec:
        raise NotImplementedError(f"{type(self).__name__} must define codec_for(bucket, numel, step)")

    def describe(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define describe()")

    def bind(self, state: "CommState", model: torch.nn.Module | None = None) -> None:
        """Called once by :func:`attach` with the hook's state and the wrapped module."""

    def observe(self, bucket: int, buf: Tensor, step: int, shapes: list[tuple] | None = None) -> None:
        """Sees bucket ``bucket``'s averaged gradient (and its parameters' shapes) before it travels."""

    def busy(self, bucket: int, step: int) -> bool:
        """Whether ``observe`` or ``codec_for`` does heavy work for this bucket at this step."""
        return False

    def via_switch(self, bucket: int) -> bool:
        """Where the job has an aggregator on the switch: whether this bucket's int8 goes through it (else
        around the ring). Asked right after :meth:`codec_for`; every int8 bucket goes through it here."""
        return True

    def sent(self, bucket: int, step: int) -> None:
        """Called once bucket ``bucket``'s collectives at ``step`` are issued, on the thread that issued
        them (the same place in the collective sequence on every rank): a policy may issue a collective
        of its own here, behind the gradient's rather than ahead of it."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy (plain values, the same on every rank; nothing here)."""
        return {}

    def load_state_dict(self, sd: dict) -> None:
        """Go on from :meth:`state_dict`'s output, from a checkpoint (called before the first step)."""


class StaticPolicy(Policy):
    """The same codec for every bucket."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def codec_for(self, bucket: int, numel: int, step: int) -> Codec:
        return self.codec

    def describe(self) -> str:
        from thinwire.compress.spec import spec_string

        return spec_string(self.codec)


class CommState:
    """State of an attached hook: policy, error feedback, counters. Checkpoint it with ``state_dict``."""

    issues_inline = True  # buckets of one all-reduce may go out from DDP's thread (not where _reduce is overridden)

    def __init__(self, policy: Policy, *, error_feedback: bool, warmup_steps: int, min_compress_bytes: int,
                 nonfinite: Literal["skip", "raise"], group=None) -> None:
        check_options(error_feedback=error_feedback, warmup_steps=warmup_steps, min_compress_bytes=min_compress_bytes,
                      nonfinite=nonfinite)
        self.policy, self.warmup_steps, self.min_compress_bytes = policy, warmup_steps, min_compress_bytes
        self.nonfinite = nonfinite
        self.feedback = ErrorFeedback() if error_feedback else None
        self.wire = Wire(group)
        self.step = 0
        self.bytes_raw = 0
        self.compress_s = 0.0
        self.counts: Counter = Counter()
        self.skipped_nonfinite = 0
        self.extra: dict = {}           # per-scheme state, e.g. PowerSGD's Q matrices
        self.last_bucket_ready = 0.0    # perf_counter() when the last bucket was handed over
        self.param_index: dict[int, int] = {}  # id(parameter) -> its index in model.parameters()
        self.param_numels: dict[int, int] = {}  # that index -> the parameter's size (a state of another model: refused)
        self.layouts: dict[int, tuple] = {}    # bucket index -> its layout at its last step (kept in checkpoints)
        self.resumed: dict[int, tuple] | None = None  # the layouts a loaded checkpoint's buckets had (see hook)
        self._layouts_step = -1
        self._thread = CommThread()
        # a bucket's collectives issued on the caller's thread (_send), whose decode and error-feedback write run in
        # their completion callback: the next send of that bucket waits for it (a sync mode may send step t before
        # it collects step t - 1; the residual it reads must be t - 1's)
        self._inflight: dict[int, torch.futures.Future] = {}
        # every bucket's whole job on the engine thread, none on DDP's (a host with an offload engine:
        # the thread runs on the engine's CPU, see thinwire.compress.engine)
        self.offload = False
        # a port to the aggregator on the switch (thinwire.compress.switch): int8 buckets go through it
        self.switch = None

    # -- the hook ------------------------------------------------------------------------------
    def hook(self, bucket):  # no annotations: DDP rejects the string ones `from __future__` makes
        self._thread.check_open()
        step, index = self.step, bucket.index()
        if bucket.is_last():
            self.step += 1
            self.last_bucket_ready = time.perf_counter()
        params = bucket.parameters()
        shapes = [tuple(p.shape) for p in params]
        layout = tuple((self.param_index.get(id(p), -1), p.numel()) for p in params)
        if self.resumed is not None:
            parts = self._resumed_parts(index, layout)
            if parts:
                by_index = dict(zip((i for i, _ in layout), shapes))
                return for_ddp(self._thread.submit(self._regrouped, bucket.buffer(), step, layout, parts,
                                                    by_index))
        if step != self._layouts_step:  # DDP may have rebuilt its buckets: this step's layouts only
            self.layouts, self._layouts_step = {}, step
        self.layouts[index] = layout
        return for_ddp(self._send(bucket.buffer(), index, step, shapes, layout))

    def _resumed_parts(self, index: int, layout: tuple) -> list[tuple[int, tuple]] | None:
        """The first step after a checkpoint was loaded: the buckets it was saved with, where DDP hands over
        another layout that holds all of them (its first iteration's single bucket), else None.

        DDP builds its buckets again after its first iteration, in the order gradients became ready, and a
        resumed process starts from its initial layout: one bucket of every parameter in reverse order. The
        codecs that quantize or select over a bucket (int8's blocks, bfp, top-k, sign) would send that step's
        gradient otherwise than the run that was never stopped, so its first step is averaged bucket by bucket
        as saved, and a resume is bit-identical. Where DDP's layout already is the saved one (it does not
        rebuild with ``find_unused_parameters``) or does not hold all of it, the step runs as DDP hands it. The
        saved layouts are kept while DDP hands over its initial one: with ``static_graph`` it rebuilds after its
        second iteration, not its first."""
        saved = self.resumed
        if saved.get(index) == layout or not saved:
            self.resumed = None
            return None
        mine = sorted(layout)
        if sorted(pair for part in saved.values() for pair in part) != mine:
            self.resumed = None
            log.info("resume: DDP's first buckets after the checkpoint are not the saved ones; the first step "
                     "averages its gradient in DDP's layout")
            return None
        return sorted(saved.items())

    def _regrouped(self, buf: Tensor, step: int, layout: tuple, parts: list[tuple[int, tuple]],
                   shapes: dict[int, tuple]) -> Tensor:
        """Average ``buf`` (one bucket in ``layout``) as the saved buckets ``parts``, in their order."""
        self.layouts, self._layouts_step = {}, step
        offsets, at = {}, 0
        for i, n in layout:
            offsets[i] = (at, n)
            at += n
        for index, part in parts:
            sub = torch.cat([buf[offsets[i][0]: offsets[i][0] + n] for i, n in part])
            out = self._reduce(sub, index, step, [shapes[i] for i, _ in part], part)
            at = 0
            for i, n in part:
                start = offsets[i][0]
                buf[start: start + n].copy_(out[at: at + n])
                at += n
            self.layouts[index] = part
        return buf

    def send(self, buf: Tensor, index: int, step: int, shapes: list[tuple], layout: tuple) -> torch.futures.Future:
        """Average ``buf`` (one flat fp32 bucket) across ranks as the hook averages a DDP bucket: a
        future of the result. For the sync modes (:mod:`thinwire.compress.sync`), which average
        outside DDP's backward; ``layout``: (parameter index, numel) in bucket order."""
        return self._send(buf, index, step, shapes, layout)

    def sum_exact(self, t: Tensor) -> torch.futures.Future:
        """Sum ``t`` in place across ranks, as it is (no codec, no average), after every bucket handed over before
        it, so every rank issues its collectives in one order: a future of ``t``. For small exact exchanges beside
        the buckets (which parameters got a gradient, :meth:`SyncMode.start_used`)."""
        return self._thread.submit(self.wire.all_reduce, t)

    def _send(self, buf: Tensor, index: int, step: int, shapes: list[tuple], layout: tuple) -> torch.futures.Future:
        """Hand the bucket to the communication thread, or, when that thread has nothing left to
        issue and the bucket needs only all-reduces (fp32, bf16, fp16, random-k), issue them here,
        asynchronously, as PyTorch's own hooks do: no thread hand-over on the step's critical path
        (which costs a scheduler slice on a host with more busy threads than cores). The order of
        collectives is the same either way: every earlier bucket's were issued before this one's."""
        args = (buf, index, step, shapes, layout)
        # a policy with heavy work at this bucket keeps it off the caller
        if self.offload or not (self.issues_inline and self._thread.idle()) or self.policy.busy(index, step):
            return self._thread.submit(self._reduce, *args)
        job = self._prepare(*args)
        if job is None:
            fut = self.wire.all_reduce_async(buf)
            self.policy.sent(index, step)
            return fut.then(lambda fut: fut.value()[0])
        pending = schemes.start(job)
        if pending is None:  # later collectives depend on earlier results: the thread runs the job
            return self._thread.submit(self._run_and_tell, job)
        futures = [self.wire.all_reduce_async(t) for t in pending.tensors]
        self.policy.sent(index, step)
        done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
        # The callback runs on the process group's worker thread, and the group may free it there
        # later: had it kept this state (so the group) alive, the group's destructor would run on
        # its own worker and join itself (seen: "terminate ... Resource deadlock avoided" at exit).
        # So the callback holds it only until it has run.
        box = [self, job, pending]

        def finish(_):
            state, job, pending = box
            box.clear()
            for f in futures:  # a failed collective (a lost peer, a timeout) fails the step: value() raises its
                f.value()      # error; the payload it left behind is no average
            return state._finish(job, *pending.finish())

        result = done.then(finish)
        self._inflight[index] = result
        return result

    def _settle(self, index: int | None = None) -> None:
        """Wait until bucket ``index``'s (None: every bucket's) collectives issued on the caller's thread have
        run their callbacks: its error-feedback residual is written. An error is left to whoever awaits the
        future (the step that collects it)."""
        for i in [index] if index is not None else list(self._inflight):
            fut = self._inflight.pop(i, None)
            if fut is not None and not fut.done():
                try:
                    fut.wait()
                except Exception:  # noqa: BLE001 - raised where the average is collected
                    pass

    def _prepare(self, buf: Tensor, index: int, step: int, shapes: list[tuple], layout: tuple) -> schemes.BucketJob | None:
        """Average-scale the bucket, show it to the policy, pick its codec: the job, or None when it
        goes uncompressed (warm-up, small bucket) as a plain fp32 all-reduce."""
        self._settle(index)
        self.bytes_raw += buf.numel() * buf.element_size()
        buf.div_(self.wire.world)
        self.policy.observe(index, buf, step, shapes)  # online policies (auto) look before it travels
        if step < self.warmup_steps or buf.numel() * 4 < self.min_compress_bytes:
            self.counts["fp32"] += 1
            return None
        codec = self.policy.codec_for(index, buf.numel(), step)
        self.counts[codec.name] += 1
        return schemes.BucketJob(key=str(index), buf=buf, step=step, shapes=shapes, layout=layout, codec=codec, state=self,
                                 via_switch=self.switch is not None and self.policy.via_switch(index))

    def _reduce(self, buf: Tensor, index: int, step: int, shapes: list[tuple], layout: tuple) -> Tensor:
        job = self._prepare(buf, index, step, shapes, layout)
        if job is None:
            out = self.wire.all_reduce(buf)
            self.policy.sent(index, step)
            return out
        return self._run_and_tell(job)

    def _run(self, job: schemes.BucketJob) -> Tensor:
        return self._finish(job, *schemes.run(job))

    def _run_and_tell(self, job: schemes.BucketJob) -> Tensor:
        out = self._run(job)
        self.policy.sent(int(job.key), job.step)
        return out

    def _finish(self, job: schemes.BucketJob, out: Tensor, finite: bool) -> Tensor:
        if finite and not all_finite(out):  # every rank's gradient finite, their average decoded not: the codec's
            raise FloatingPointError(f"codec {job.codec.name} decoded bucket {job.key} at step {job.step} to non-finite "
                                     "values though every rank's gradient was finite: its compress or decompress is "
                                     "wrong (a codec of your own: check it on this bucket's values)")
        return out if finite else self._on_nonfinite(job.buf, int(job.key), job.step)

    def _on_nonfinite(self, buf: Tensor, index: int, step: int) -> Tensor:
        self.skipped_nonfinite += 1
        msg = f"non-finite gradient in bucket {index} at step {step} on some rank; residuals left unchanged"
        if self.nonfinite == "raise":
            raise FloatingPointError(msg)
        log.warning("%s; the bucket is averaged as NaN on every rank (a GradScaler or thinwire train skips the "
                    "optimizer step; a loop of your own should check the gradients before stepping)", msg)
        return buf.fill_(float("nan"))

    # -- introspection and checkpoints -----------------------------------------------------------
    def stats(self) -> dict:
        return {
            "bytes_raw": self.bytes_raw,
            "bytes_sent": self.wire.bytes_sent,
            "compression_ratio": self.bytes_raw / self.wire.bytes_sent if self.wire.bytes_sent else None,
            "compress_s": self.compress_s,
            "collectives": self.wire.calls,
            "counts": dict(self.counts),
            "skipped_nonfinite": self.skipped_nonfinite,
            "residual_bytes": self.feedback.nbytes() if self.feedback else 0,
            "policy": self.policy.describe(),
        }

    def state_dict(self) -> dict:
        """The residuals, the policy's state and the counters, once every average handed over has run (a sync mode's
        last one may still be on the wire: its residuals are written when it arrives)."""
        if not self._thread.closed:
            self._thread.submit(lambda: None).wait()  # after every job handed to the thread before it
        self._settle()
        return {
            "step": self.step,
            "residuals": self.feedback.state_dict() if self.feedback else {},
            "extra": {k: v.detach().cpu().clone() for k, v in self.extra.items()},
            "policy": self.policy.describe(),
            "policy_state": self.policy.state_dict(),
            "layouts": {str(i): [list(pair) for pair in layout] for i, layout in self.layouts.items()},
            "counters": {"bytes_raw": self.bytes_raw, "bytes_sent": self.wire.bytes_sent, "calls": self.wire.calls,
                         "counts": dict(self.counts)},
            "world": self.wire.world,
            "rank": self.wire.rank,
        }

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or "step" not in sd:
            what = f"a dict with keys {sorted(map(str, sd))[:6]}" if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"CommState.load_state_dict takes what CommState.state_dict() returned (a dict with "
                             f"step, residuals, counters, ...), got {what}; save state.state_dict() with the model's")
        self._check_model(sd.get("residuals") or {})
        world = sd.get("world", self.wire.world)  # states from before it was kept: as this job's
        rank = sd.get("rank", self.wire.rank)
        if world == self.wire.world and rank != self.wire.rank:  # one file for every rank: residuals swapped
            raise ValueError(f"this CommState is rank {self.wire.rank}'s, and the state loaded was saved by rank "
                             f"{rank}: error-feedback residuals are each rank's own. Save one file per rank, e.g. "
                             f"torch.save(state.state_dict(), f\"comm{{dist.get_rank()}}.pt\"), and load each rank's own")
        self.step = int(sd["step"])
        if world != self.wire.world:
            log.warning("this state was saved by a job of %d ranks, this one has %d: error-feedback residuals start "
                        "empty (each is what one rank's own sends left behind)", world, self.wire.world)
        # one codec for every bucket, saved with another: its residuals are another codec's errors (auto's and a
        # plan's descriptions name their current choices, which their own state brings back)
        policy = sd.get("policy", self.policy.describe()) if isinstance(self.policy, StaticPolicy) else \
            self.policy.describe()
        if policy != self.policy.describe() and sd.get("residuals"):
            log.warning("this state was saved with compression %s, this one sends with %s: error-feedback residuals "
                        "start empty (another codec's residuals are its own errors)", policy, self.policy.describe())
        if self.feedback is not None:
            same = world == self.wire.world and policy == self.policy.describe()
            self.feedback.load_state_dict(sd.get("residuals", {}) if same else {})
        self.extra = {k: v.clone() for k, v in sd.get("extra", {}).items()}
        self.policy.load_state_dict(sd.get("policy_state") or {})  # older checkpoints have none
        self.resumed = {int(i): tuple((int(a), int(b)) for a, b in layout) for i, layout in sd.get("layouts", {}).items()}
        counters = sd.get("counters", {})  # totals continue across a resume
        self.bytes_raw = int(counters.get("bytes_raw", 0))
        self.wire.bytes_sent = int(counters.get("bytes_sent", 0))
        self.wire.calls = int(counters.get("calls", 0))
        self.counts = Counter({str(k): int(v) for k, v in counters.get("counts", {}).items()})

    def _check_model(self, residuals: dict) -> None:
        """Refuse another model's residuals: they were dropped without a word where their sizes did not fit."""
        if not self.param_numels:
            return
        for key, t in (residuals.get("params") or {}).items():
            i, have = int(key), self.param_numels.get(int(key))
            if have != t.numel():
                mine = f"has {have}" if have is not None else f"does not exist (it has {len(self.param_numels)})"
                raise ValueError(f"CommState.load_state_dict: this state is another model's: its residual of parameter "
                                 f"{i} holds {t.numel()} values, and this model's parameter {i} {mine}; load the "
                                 "state saved with this model (without one, its residuals start empty)")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._thread.closed

    def check_open(self) -> None:
        """Raise where :meth:`close` was called: a closed state averages nothing."""
        self._thread.check_open()

    def close(self) -> None:
        self._thread.close()
        if self.switch is not None:  # the aggregator's serve() returns once every trainer has closed
            port, self.switch = self.switch, None
            try:
                port.close()
            except RuntimeError as e:  # the aggregator or a peer is gone (a failing run): its error stands
                log.warning("could not say goodbye to the switch's aggregator: %s", e)


def need_ddp(model, who: str) -> None:
    """Refuse what is not a DDP model, saying how to get one (a ``torch.compile``d DDP: attach before compiling)."""
    if isinstance(model, DistributedDataParallel):
        return
    inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(inner, DistributedDataParallel):
        raise TypeError(f"{who} needs the DistributedDataParallel model itself, got it compiled ({type(model).__name__}); "
                        f"call {who} on the DDP model first, then torch.compile it (or pass model._orig_mod)")
    raise TypeError(f"{who} needs a DistributedDataParallel model, got {type(model).__name__}; "
                    "wrap it first: model = DistributedDataParallel(model)")

def attach(model: DistributedDataParallel, codec: str | Codec | Policy = "none", *, error_feedback: bool = True,
           warmup_steps: int = 0, min_compress_bytes: int = MIN_COMPRESS_BYTES, nonfinite: Literal["skip", "raise"] = "skip",
           process_group=None, timeout_s: float | None = None) -> CommState:
    """Register thinwire's compressed all-reduce as ``model``'s DDP communication hook.

    ``codec`` is a spec string (``"int8:block=64"``, ``"topk:ratio=0.01"``, ``"powersgd:rank=4"``;
    see ``thinwire codecs``), a codec object, or a policy choosing one per bucket.
    Buckets under ``min_compress_bytes`` and the first ``warmup_steps`` steps go uncompressed.
    ``process_group``: the group to average over; by default a new group over the ranks of DDP's own (all
    ranks unless DDP was given a group), so the hook's collectives never interleave with the script's own; ``timeout_s`` bounds how long one of
    its collectives may block (a dead peer or a cut link) before the step fails.

    Example::

        model = DDP(net)
        state = thinwire.attach(model, "int8")
        loss_fn(model(x), y).backward()   # gradients arrive averaged, int8 on the wire
    """
    need_ddp(model, "thinwire.attach")
    if getattr(model, "_thinwire_state", None) is not None:
        raise ValueError("thinwire.attach: a thinwire hook is already attached to this model; attach once per model")
    refuse_sparse(model.module, "thinwire.attach")  # DDP hands a hook a sparse bucket no codec's encoding takes
    try:
        check_options(timeout_s=timeout_s)  # the rest are checked where the state is built
    except ValueError as e:
        raise ValueError(f"thinwire.attach: {e}") from None
    policy = _as_policy(codec)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    group = process_group if process_group is not None else group_like(model, timeout)
    state = CommState(policy, error_feedback=error_feedback, warmup_steps=warmup_steps,
                      min_compress_bytes=min_compress_bytes, nonfinite=nonfinite, group=group)
    try:
        model.register_comm_hook(state, CommState.hook)
    except RuntimeError as e:
        state.close()
        raise ValueError(f"thinwire.attach: DDP refused the hook ({e}); a communication hook can be registered only once") from None
    state.param_index = {id(p): i for i, p in enumerate(model.module.parameters())}
    state.param_numels = {i: p.numel() for i, p in enumerate(model.module.parameters())}
    policy.bind(state, model.module)  # online policies (e.g. "auto") measure through the state
    model._thinwire_state = state
    return state


def group_like(model: DistributedDataParallel, timeout: datetime.timedelta | None = None):
    """A new process group over the ranks DDP averages over (all of them, unless it was given a group of its
    own: replicas of a sharded model, two jobs in one), so thinwire's collectives never interleave with the script's
    own and average over the same ranks as DDP would. A collective over all ranks, as every ``new_group`` is."""
    ranks = dist.get_process_group_ranks(model.process_group)
    world = dist.get_world_size()
    if len(ranks) == world:
        return dist.new_group(backend=dist.get_backend(), timeout=timeout)
    every = [None] * world  # each rank's DDP group: every rank creates every one of them, in one order
    dist.all_gather_object(every, ranks)
    mine = None
    for members in sorted({tuple(r) for r in every}):
        group = dist.new_group(list(members), backend=dist.get_backend(), timeout=timeout)
        if list(members) == list(ranks):
            mine = group
    return mine


def check_options(*, error_feedback: bool = True, warmup_steps: int = 0, min_compress_bytes: int = 0,
                  nonfinite: str = "skip", timeout_s: float | None = None) -> None:
    """The hook's options, each named with what it takes."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not math.isfinite(timeout_s) or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a number of seconds > 0 or None (no bound), got {timeout_s!r}")
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    for name, value in (("warmup_steps", warmup_steps), ("min_compress_bytes", min_compress_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not isinstance(error_feedback, bool):  # "no" would be true
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")


def refuse_sparse(module: torch.nn.Module, who: str) -> None:
    """thinwire averages flat, dense buckets: an embedding with sparse gradients cannot go through them."""
    sparse = [n for n, m in module.named_modules() if getattr(m, "sparse", False) is True
              and isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    if sparse:
        raise ValueError(f"{who}: {', '.join(sparse[:4])} makes sparse gradients (sparse=True), which "
                         "thinwire's codecs cannot encode; build the embedding with sparse=False (a dense gradient, "
                         "which the codecs compress), or leave this model without thinwire")


def _as_policy(codec) -> Policy:
    if isinstance(codec, str):
        from thinwire.compress.spec import parse_codec_spec

        return StaticPolicy(parse_codec_spec(codec))
    if isinstance(codec, Codec):
        return StaticPolicy(codec)
    if isinstance(codec, Policy):
        return codec
    raise TypeError(f"codec must be a spec string, a Codec or a Policy (thinwire.compress.hook.Policy), got "
                    f"{type(codec).__name__}; a policy subclasses Policy and defines codec_for and describe")
