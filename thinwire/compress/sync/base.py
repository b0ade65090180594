"""What every sync mode shares: the small :class:`SyncMode` interface the trainer (and a user's loop)
calls around the optimizer step, the ``allreduce`` mode (today's DDP hook), and :class:`Buckets`, the
fixed grouping of parameters into flat fp32 buckets in which the other modes average.

A training loop with any mode::

    mode = thinwire.sync(ddp_model, "local:period=8", codec="int8")
    with mode.no_sync():          # modes that average outside backward keep DDP from all-reducing
        loss_fn(ddp_model(x), y).backward()
    mode.step(optimizer)          # before_step, optimizer.step, after_step
    with mode.consensus():        # modes whose ranks diverge: the ranks' average model, to evaluate or save
        evaluate(ddp_model.module)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim.optimizer import register_optimizer_step_post_hook

from thinwire.compress.hook import CommState
from thinwire.compress.wire import ring_allreduce_bytes

_PREVIEW = threading.local()  # ``active`` while delayed's weight prediction steps a copy (not one of the run's steps)
log = logging.getLogger("thinwire.compress")


class Buckets:
    """Parameters in model order, grouped into flat buckets of at most ``cap_bytes`` fp32 bytes.

    Fixed for the run (unlike DDP's, which are rebuilt after the first step), so the error-feedback
    residual of each bucket keeps its key and layout across steps and resumes."""

    def __init__(self, params: list[torch.nn.Parameter], cap_bytes: int, indices: list[int] | None = None) -> None:
        self.params = params
        self.indices = indices or list(range(len(params)))  # each parameter's index in the model (residual layout)
        self.groups: list[list[int]] = []
        size = cap_bytes
        for i, p in enumerate(params):
            if not self.groups or (size + p.numel() * 4 > cap_bytes and self.groups[-1]):
                self.groups.append([])
                size = 0
            self.groups[-1].append(i)
            size += p.numel() * 4

    @classmethod
    def trainable(cls, model, cap_bytes: int) -> "Buckets":
        """Buckets of ``model``'s trainable parameters, each indexed by its place in ``model.parameters()``,
        frozen ones counted, as the DDP hook indexes its layouts: a residual the hook held for a parameter is
        found again by a mode's bucket (``--sync auto`` shares one error feedback between them). Indexed among
        the trainable ones only, a model with a frozen layer paired residuals with the wrong parameters."""
        module = getattr(model, "module", model)
        pairs = [(i, p) for i, p in enumerate(module.parameters()) if p.requires_grad]
        return cls([p for _, p in pairs], cap_bytes, [i for i, _ in pairs])

    def layout(self, b: int) -> tuple:
        return tuple((self.indices[i], self.params[i].numel()) for i in self.groups[b])

    def shapes(self, b: int) -> list[tuple]:
        return [tuple(self.params[i].shape) for i in self.groups[b]]

    def flatten(self, tensors: list[Tensor | None]) -> list[Tensor]:
        """One new flat tensor per bucket from per-parameter tensors (None: zeros): fp32, or fp64 for a bucket
        with a float64 parameter (fp32 rounded a float64 model's parameters at every average)."""
        out = []
        for group in self.groups:
            dtype = torch.float64 if any(self.params[i].dtype == torch.float64 for i in group) else torch.float32
            parts = [tensors[i].detach().reshape(-1).to(dtype) if tensors[i] is not None
                     else torch.zeros(self.params[i].numel(), dtype=dtype, device=self.params[i].device) for i in group]
            out.append(torch.cat(parts))
        return out

    def unflatten(self, flats: list[Tensor]) -> list[Tensor]:
        """Per-parameter views (parameter shapes and dtypes) of flat buckets."""
        out: list[Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for group, flat in zip(self.groups, flats):
            offset = 0
            for i in group:
                p = self.params[i]
                out[i] = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
        return out

    def average(self, comm: CommState, flats: list[Tensor], first: int = 0) -> list[torch.futures.Future]:
        """Start averaging each flat bucket through ``comm`` (its codec, error feedback, wire count);
        bucket ``b`` keeps its residual under key ``first + b``."""
        step = comm.step
        comm.step += 1
        return [comm.send(flat, first + b, step, self.shapes(b), self.layout(b)) for b, flat in enumerate(flats)]


@dataclasses.dataclass(frozen=True)
class StepParts:
    """A predicted ``allreduce`` step and its parts (seconds, :func:`thinwire.perf.model.predict_step`),
    from which each mode prices its own step; ``codec_steals_compute``: no spare core for the
    communication thread, so codec work is CPU taken from compute."""

    allreduce_step_s: float
    compute_s: float
    comm_s: float
    codec_s: float
    codec_steals_compute: bool = False
    hosts: int = 2                       # the ranks the all-reduce spans (gossip prices its neighbours from it)


class SyncMode:
    """When averaging happens. Subclasses override the hooks; this base is ``allreduce``: DDP's
    backward averages gradients through thinwire's hook, nothing else to do.

    Each mode also prices itself (:meth:`step_s`, :meth:`bytes_per_step`, from :mod:`thinwire.perf.sync`'s
    formulas), so what ``simulate`` and the planner predict is what this class runs.

    ``comm``: the :class:`CommState` that counts bytes and holds error-feedback residuals;
    ``diverges``: ranks hold different parameters between averages (the trainer then checkpoints
    every rank's parameters and optimizer state); ``buffers_diverge``: ranks' floating-point buffers
    (BatchNorm's running statistics) differ, as they do wherever forward runs outside DDP's sync, which
    would send rank 0's to all at each forward."""

    name = "allreduce"
    diverges = False
    state_keys: tuple[str, ...] = ()  # what :meth:`state_dict` holds (:meth:`check_state` refuses other keys)

    @property
    def buffers_diverge(self) -> bool:
        return self.diverges

    def __init__(self, model, comm: CommState, spec=None) -> None:
        self.model, self.comm, self.spec = model, comm, spec
        self.consensus_bytes = 0  # what :meth:`consensus` sent (this rank): measurement's, not training's
        self.optimizer = None     # the step's optimizer (set by :meth:`step`, or by a trainer that steps itself)
        self.accumulating = None  # a callable: True on a micro-batch whose optimizer step is skipped (accelerate's)
        self.own_inside: dict = {}  # inside :meth:`consensus`: this rank's own tensors it replaced (for a checkpoint)
        self.clip: float | None = None  # the gradient norm the trainer clips to (delayed's prediction clips alike)
        # DDP's find_unused_parameters: a parameter no rank gave a gradient keeps none, so the optimizer skips it
        # (weight decay and momentum do not move a layer or branch that no rank ran), as under DDP
        self.find_unused = bool(getattr(model, "find_unused_parameters", False))
        self._told_unused = False  # a parameter without a gradient, and no find_unused_parameters: warned once

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        """The predicted step of this mode: ``allreduce`` overlaps communication with backward only."""
        return parts.allreduce_step_s

    @classmethod
    def bytes_per_step(cls, spec, bytes_per_average: int, hosts: int = 2) -> float:
        """Bytes one rank sends per step, given those of one average of every gradient (or parameter)."""
        return float(bytes_per_average)

    def no_sync(self):
        """The context backward runs in: DDP all-reduces (through the hook) unless a mode averages itself."""
        return contextlib.nullcontext()

    def before_step(self) -> None:
        """After backward, before the optimizer: the gradients the optimizer applies are set here."""

    def after_step(self) -> None:
        """After the optimizer step: parameter averaging happens here."""

    def start_used(self, params: list[torch.nn.Parameter]) -> torch.futures.Future | None:
        """Where the model was wrapped with ``find_unused_parameters`` (DDP's flag for a forward that may leave
        parameters out): start the exact sum over the ranks of which of ``params`` got a gradient on each (one
        fp32 flag per parameter, as DDP exchanges its bitmap), for :func:`drop_unused`; None otherwise (DDP refuses
        a parameter without a gradient there, and its ``no_sync`` leaves that to the mode)."""
        if not self.find_unused or not params:
            if not self._told_unused and any(p.grad is None for p in params):
                self._told_unused = True
                module = getattr(self.model, "module", self.model)
                names = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
                log.warning("sync %s: %s got no gradient on this rank and are averaged as zeros, so weight decay and "
                            "momentum move them where no rank used them; wrap the model with "
                            "DistributedDataParallel(..., find_unused_parameters=True) to leave those no rank used "
                            "without a gradient (as DDP does), or freeze what the forward never uses",
                            self.name, ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""))
            return None
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        return self.comm.sum_exact(flags)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``before_step``, ``optimizer.step()``, ``after_step``: one line in a user's loop. Under gradient
        accumulation that skips the optimizer's step on all but the last micro-batch (``accumulating``, which
        accelerate's integration sets), only ``optimizer.step()`` is called there: the mode counts, averages
        and applies at optimizer steps only."""
        self.comm.check_open()
        if self.accumulating is not None and self.accumulating():
            optimizer.step()  # the wrapper's own no-op (accelerate's AcceleratedOptimizer), whatever it does there
            return
        self.optimizer = optimizer
        self.before_step()
        optimizer.step()
        self.after_step()

    def flush(self) -> None:
        """Wait for averaging in flight (before the loop's own collectives or a checkpoint)."""

    def steps_to_agreement(self) -> int | None:
        """Optimizer steps from now until every rank holds the same parameters: 0 where they do now (a mode
        whose ranks never diverge, or the step of a periodic average), None where no step is known ahead
        (gossip, dynamic averaging). The same on every rank. The trainer validates at that step
        (:meth:`consensus` then sends no parameters)."""
        return None if self.diverges else 0

    @contextlib.contextmanager
    def consensus(self):
        """Inside: the model holds the ranks' average of its parameters and floating-point buffers; after,
        this rank's own again, untouched, so training goes on (and resumes) exactly as without it. A
        collective: every rank enters it (rank 0 alone would wait for the others without end).

        Where ranks diverge (local SGD, DiLoCo, gossip, dynamic averaging) each rank's model is trained on
        its own data since the last average; the model the run stands for is their average (as federated
        averaging evaluates its global model), and under skewed data a rank's own can score far worse.
        The trainer validates it (and checkpoints it, averaged on rank 0 from the ranks' states the
        checkpoint gathers anyway): one exact fp32 all-reduce over the mode's group, its bytes counted in
        ``consensus_bytes``, apart from the training's. No parameter is sent where the ranks hold the
        same ones (``diverges`` False, or :meth:`steps_to_agreement` 0: the step of an average), nothing
        at all where there is one rank; floating-point buffers (BatchNorm's running statistics), which
        no mode averages between steps, are averaged whenever they diverge (``buffers_diverge``: ``delayed``'s
        forward runs outside DDP's sync, so its ranks' buffers differ though their parameters do not).

        Yields ``{id(tensor): this rank's own value}`` for the tensors it replaced (empty where it replaced
        none): what a checkpoint written inside saves as the rank's own state."""
        wire = self.comm.wire
        if not self.buffers_diverge or wire.world == 1:
            yield {}
            return
        self.flush()  # averages in flight (streaming DiLoCo's) land first: one collective at a time on the group
        module = getattr(self.model, "module", self.model)
        params = [] if not self.diverges or self.steps_to_agreement() == 0 else [*module.parameters()]
        tensors = [t for t in [*params, *module.buffers()] if t.is_floating_point()]
        if not tensors:
            yield {}
            return
        own = [t.detach().clone() for t in tensors]
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        flat = _flatten_dense_tensors([t.detach().to(dtype) for t in tensors])
        self.consensus_bytes += ring_allreduce_bytes(flat.numel() * flat.element_size(), wire.world)
        dist.all_reduce(flat, group=getattr(wire, "group", None))
        flat.div_(wire.world)
        try:
            with torch.no_grad():
                for t, avg in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    t.copy_(avg)
            self.own_inside = {id(t): mine for t, mine in zip(tensors, own)}
            yield self.own_inside
        finally:
            self.own_inside = {}
            with torch.no_grad():
                for t, mine in zip(tensors, own):
                    t.copy_(mine)

    def stats(self) -> dict:
        """What the run's summary reports of this mode (e.g. dynamic averaging's sync rate)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        self.check_state(sd)
        self._own_buffers_on_resume()

    def check_state(self, sd) -> None:
        """Refuse what no :meth:`state_dict` of this mode returned (each mode's ``load_state_dict`` starts here): a
        mixed-up file would otherwise resume without a word and not exactly. An empty dict is a fresh state."""
        if not isinstance(sd, dict):
            raise TypeError(f"{type(self).__name__}.load_state_dict needs the dict its state_dict() returned, got "
                            f"{type(sd).__name__}")
        saved = sd.get("mode")  # the class that saved it (local SGD's keys are DiLoCo's but its momentum; the two
        # streaming modes' are the same): older states have none, and are told apart by their keys only
        if saved is not None and saved != type(self).__name__:
            raise ValueError(f"{type(self).__name__}.load_state_dict: this is a {saved} mode's state, not a "
                             f"{type(self).__name__}'s ({self.name}); a mode resumes from its own state (start this "
                             "one fresh with load_state_dict({}), or resume with the mode that saved it)")
        saved_rank, world = sd.get("rank"), sd.get("world")
        if saved_rank is not None and world == self.comm.wire.world and saved_rank != self.comm.wire.rank:
            raise ValueError(f"{type(self).__name__}.load_state_dict: this state was saved by rank {saved_rank}, and "
                             f"this is rank {self.comm.wire.rank} of {world}: each rank's state is its own (what it "
                             "sent, its own gradient); load the state this rank saved")
        unknown = sorted(str(k) for k in set(sd) - set(self.state_keys) - {"mode", "rank", "world"})
        if unknown:
            raise ValueError(f"{type(self).__name__}.load_state_dict: keys {unknown[:6]} are not a {self.name} mode's "
                             f"state (it holds {', '.join(self.state_keys) or 'nothing'}): the state of another mode, or "
                             "another object's (the CommState's?); pass what this mode's state_dict() returned")

    def saved_by(self) -> dict:
        """What each mode's :meth:`state_dict` starts with: the class that saved it and the rank (of how many), so a
        state loaded into another mode or by another rank is refused (:meth:`check_state`)."""
        return {"mode": type(self).__name__, "rank": self.comm.wire.rank, "world": self.comm.wire.world}

    def _own_buffers_on_resume(self) -> None:
        """As if the run never stopped (each mode's ``load_state_dict`` ends here): a new DDP wrapper's first
        forward sends rank 0's buffers (BatchNorm's running statistics) to every rank, which a run that goes on
        does not where this mode's forward runs outside DDP's sync; each rank keeps its own, as it restored them."""
        ddp = self.model
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            with self.no_sync():
                outside = not ddp.require_backward_grad_sync
            ddp.require_forward_param_sync = not outside  # a new wrapper's value where forward runs inside

    def guard_steps(self) -> None:
        """Refuse an optimizer step on this model's parameters that no :meth:`before_step` prepared: a user's loop
        that calls ``optimizer.step()`` where it should call ``mode.step(optimizer)`` averages nothing, and its
        ranks drift apart without a word. For users' own loops (:func:`thinwire.sync`); removed by :meth:`close`."""
        ids = {id(p) for p in self.model.parameters()}
        ref = weakref.ref(self)
        mine: dict[int, bool] = {}  # id(optimizer) -> whether it steps this model's parameters
        stepped: set[int] = set()    # the optimizers that stepped since the last before_step (two may: one a layer)
        inner = self.before_step
        forwards = [0, -1]           # the model's forwards so far, and that count at the last before_step

        def count_forward(module, args) -> None:
            forwards[0] += 1

        def before_step() -> None:
            if forwards[0] == forwards[1] and not self._told_twice:  # no forward since the last step
                self._told_twice = True
                log.warning("sync %s: a second step with no forward of the model since the last (mode.step called once "
                            "per optimizer?): the mode counts, averages and applies at each, so a period shrinks; with "
                            "several optimizers call mode.before_step(), each optimizer.step(), then mode.after_step()",
                            self.name)
            forwards[1] = forwards[0]
            inner()
            stepped.clear()
            self._prepared = True

        def refuse_unprepared(optimizer, args, kwargs) -> None:  # after the step: a closure runs before_step inside it
            mode = ref()
            if mode is None or getattr(_PREVIEW, "active", False):
                return
            if id(optimizer) not in mine:
                mine[id(optimizer)] = any(id(p) in ids for g in optimizer.param_groups for p in g["params"])
            if not mine[id(optimizer)]:
                return
            if not mode._prepared or id(optimizer) in stepped:
                raise RuntimeError(f"thinwire.sync {mode.name}: optimizer.step() was called without "
                                   "mode.before_step(), so this step's gradients were not averaged and the ranks drift "
                                   "apart; call "
                                   "mode.step(optimizer) instead of optimizer.step() (or mode.before_step(), "
                                   "optimizer.step(), mode.after_step(); with two optimizers, both steps between them)")
            stepped.add(id(optimizer))

        self._prepared = False
        self._told_twice = False
        self.before_step = before_step
        self._guard = register_optimizer_step_post_hook(refuse_unprepared)
        self._counter = self.model.register_forward_pre_hook(count_forward)

    def close(self) -> None:
        guard = getattr(self, "_guard", None)
        if guard is not None:
            guard.remove()
            self._guard = None
            self._counter.remove()
        self.flush()
        self.comm.close()


def drop_unused(params: list[torch.nn.Parameter], used: Tensor | torch.futures.Future | None) -> None:
    """Clear the gradient of each parameter that no rank used (``used``: :meth:`SyncMode.start_used`'s sum, or its
    future), which averaging filled with zeros: the optimizer then skips it, as it does under DDP."""
    if used is None:
        return
    flags = used.wait() if isinstance(used, torch.futures.Future) else used
    for p, n in zip(params, flags.tolist()):
        if n == 0:
            p.grad = None


def average_gradients(mode: SyncMode, buckets: Buckets, first: int = 0) -> None:
    """Set each of ``buckets``' parameters' gradient to the ranks' average, through ``mode``'s codec with error
    feedback (residuals under keys ``first`` on), blocking; a parameter no rank used keeps none (:func:`drop_unused`)."""
    params = buckets.params
    futures = buckets.average(mode.comm, buckets.flatten([p.grad for p in params]), first=first)
    used = mode.start_used(params)
    for p, g in zip(params, buckets.unflatten([f.wait() for f in futures])):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    drop_unused(params, used)


class Averaged(SyncMode):
    """``allreduce`` for a module that DDP does not wrap (a pipeline stage, :mod:`thinwire.pipeline`):
    after backward, the gradients are averaged in flat buckets through the codec with error feedback,
    blocking, before the optimizer applies them. The same bytes as DDP's hook, none of its overlap with
    backward (a stage's backward is spread over the schedule's micro-batches)."""

    def __init__(self, model, comm: CommState, spec=None, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec)
        self.buckets = Buckets.trainable(model, int(bucket_mb * 2**20))

    def before_step(self) -> None:
        average_gradients(self, self.buckets)


class Unwrapped:
    """A module for the sync modes where no DDP wraps it: ``.module`` and a ``no_sync`` that does nothing."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def no_sync(self):
        return contextlib.nullcontext()

    def parameters(self):
        return self.module.parameters()


def cpu_list(tensors: list[Tensor] | None) -> list[Tensor] | None:
    return None if tensors is None else [t.detach().cpu().clone() for t in tensors]


def on_device(tensors: list[Tensor] | None, like: list[Tensor]) -> list[Tensor] | None:
    """``tensors`` of a loaded state, copied to the device of ``like`` (this mode's own, of the same sizes): a state of
    another model (other buckets, another size) is refused, where it would be sliced or fail at the next average."""
    if tensors is None:
        return None
    sizes, want = [t.numel() for t in tensors], [x.numel() for x in like]
    if sizes != want:
        raise ValueError(f"a sync mode's state holds tensors of {sizes[:6]} values, where this model's buckets hold "
                         f"{want[:6]}: the state of another model (or of other bucket sizes); load the state this "
                         "model's mode saved, or start the mode fresh")
    return [t.to(x.device).clone() for t, x in zip(tensors, like)]
