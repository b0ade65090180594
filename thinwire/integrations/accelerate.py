"""thinwire in Hugging Face accelerate: attach the hook to the model ``accelerator.prepare`` returned.

    accelerator = Accelerator(cpu=True)            # or on GPUs: Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    comm = thinwire.integrations.accelerate.attach(accelerator, model, "int8")
    ...the usual accelerate loop (accelerator.backward(loss); optimizer.step())...
    accelerator.save_state("ckpt")                  # every rank's residuals saved with it
    accelerator.wait_for_everyone()                 # then end_training(): ranks leave together

Launch as usual (``accelerate launch --multi_gpu ...`` or ``torchrun ...``). The hook's state is
registered with ``accelerator.register_for_checkpointing``, so ``save_state`` / ``load_state`` carry
every rank's error-feedback residuals. A sync mode: :func:`sync` (``sync(accelerator, model,
"local:period=8", "int8", optimizer=opt)``), whose state, with every rank's own parameters and optimizer
state, ``save_state`` keeps the same way (see ``examples/accelerate_train.py``).
End with ``accelerator.wait_for_everyone()`` before ``end_training()``: the hook has its own gloo group,
and a rank that tears gloo down while a peer is still writing its checkpoint can abort
("terminate called without an active exception"; about 1 run in 10 on 2 CPU processes without it).
Install with ``pip install 'thinwire[accelerate]'``.
"""

from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel

from thinwire.api import attach as _attach
from thinwire.integrations import (
    check_hook_kwargs, gather_states, hook_codec, load_mode_state, load_own_model, log, mode_record, need, rank_state,
)

need("accelerate", "accelerate")


class RankStates:
    """The hook's state for ``accelerator.register_for_checkpointing``: ``state_dict`` gathers every
    rank's (accelerate calls it on every rank and writes rank 0's), ``load_state_dict`` keeps this
    rank's."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def state_dict(self) -> dict:
        return gather_states({"comm": self.comm.state_dict()})

    def load_state_dict(self, sd: dict) -> None:
        mine = rank_state(sd, "the accelerate checkpoint")
        if mine is not None:
            self.comm.load_state_dict(mine["comm"])


def attach(accelerator, model, codec: str = "int8", **kwargs):
    """thinwire's hook on ``model`` (as returned by ``accelerator.prepare``), its state registered for
    checkpointing; keywords as in :func:`thinwire.attach`. Returns the ``CommState``, or ``None`` when
    the accelerator runs one process (accelerate then does not wrap the model: nothing is averaged)."""
    if not isinstance(model, DistributedDataParallel):
        if accelerator.num_processes == 1:  # checked as on several: a mistake must not wait for the first big run
            hook_codec(codec, "thinwire.integrations.accelerate.attach")
            check_hook_kwargs(kwargs, "thinwire.integrations.accelerate.attach")
            log.info("thinwire: one process, the model is not wrapped in DDP: nothing to attach")
            accelerator.register_for_checkpointing(OneProcessStates(model))
            return None
        raise TypeError(f"thinwire.integrations.accelerate.attach needs the model accelerator.prepare returned "
                        f"(a DistributedDataParallel), got {type(model).__name__}; only DDP is supported "
                        "(not FSDP or DeepSpeed, which average gradients their own way)")
    comm = _attach(model, codec, **kwargs)
    accelerator.register_for_checkpointing(RankStates(comm))
    return comm


class SyncStates:
    """A sync mode's state for ``accelerator.register_for_checkpointing``: every rank's mode state and
    residuals and, for a mode whose ranks diverge between averages (local SGD, DiLoCo, gossip, dynamic),
    every rank's own parameters and optimizer state: accelerate's own checkpoint holds rank 0's only, so
    a run resumed between two averages would go on from rank 0's model on every rank. accelerate loads
    these after its model and optimizer, so each rank ends with its own. accelerate's own model file holds
    rank 0's model, not the ranks' average: for that one (to evaluate, or to load elsewhere) save it inside
    ``with mode.consensus(): ...`` (every rank enters it)."""

    def __init__(self, mode, model, optimizer) -> None:
        self.mode, self.model, self.optimizer = mode, model, optimizer

    def state_dict(self) -> dict:
        mine = mode_record(self.mode)  # first: it waits for averages in flight
        mine["comm"] = self.mode.comm.state_dict()
        if self.mode.buffers_diverge:  # ranks' parameters (or BatchNorm's statistics: delayed) differ
            own = self.mode.own_inside  # saved inside mode.consensus(): this rank's own, not the average it holds
            mine["model"] = {k: own.get(id(v), v).detach().clone()
                             for k, v in self.model.module.state_dict(keep_vars=True).items()}
        if self.mode.diverges and self.optimizer is not None:
            mine["optimizer"] = self.optimizer.state_dict()
        return gather_states(mine)

    def load_state_dict(self, sd: dict) -> None:
        mine = rank_state(sd, "the accelerate checkpoint")
        if mine is None:
            start_from_average(sd, self.model.module)
            return
        if "model" in mine:
            load_own_model(self.mode, self.model.module, sd, mine, "the model accelerate saved (rank 0's)")
        if "optimizer" in mine and self.optimizer is not None and self.mode.diverges:
            self.optimizer.load_state_dict(mine["optimizer"])
        load_mode_state(self.mode, mine, "the accelerate checkpoint")  # a checkpoint of attach() has none: fresh
        self.mode.comm.load_state_dict(mine["comm"])


class OneProcessStates:
    """thinwire's entry in accelerate's checkpoint on one process, so that a checkpoint of one process and one of
    several have as many registered objects (accelerate refuses to load one into the other otherwise): it holds
    nothing; of the state of several ranks loaded here only the ranks' average model is taken, where their models
    differed (residuals start empty, said once)."""

    def __init__(self, model=None) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return gather_states({})

    def load_state_dict(self, sd: dict) -> None:
        if rank_state(sd, "the accelerate checkpoint") is None and self.model is not None:
            start_from_average(sd, getattr(self.model, "module", self.model))


def start_from_average(sd: dict | None, module) -> None:
    """A checkpoint of another world size whose ranks held models of their own (a sync mode saved between averages):
    this run starts from their average, as ``thinwire train`` and Lightning's strategy resume it, not from the model
    accelerate saved (rank 0's own)."""
    models = [r.get("model") for r in (sd or {}).get("ranks", [])]
    if not models or any(m is None for m in models):
        return
    from thinwire.train.loop import average_states

    module.load_state_dict(average_states(models))
    log.warning("thinwire: the checkpoint's %d ranks held models of their own; this run of another size starts from "
                "their average", len(models))


class OneProcess:
    """What :func:`sync` returns on one process: the same loop runs, nothing is averaged (``comm`` is None);
    every method of a sync mode a loop calls is there and does nothing but the optimizer's step."""

    name = "one process"
    comm = None
    diverges = buffers_diverge = False
    optimizer = clip = None

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def steps_to_agreement(self) -> int:
        return 0

    def stats(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def no_sync(self):
        return contextlib.nullcontext()

    def consensus(self):
        return contextlib.nullcontext()

    def step(self, optimizer) -> None:
        optimizer.step()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def sync(accelerator, model, mode: str = "allreduce", codec: str = "none", *, optimizer=None, **kwargs):
    """A thinwire sync mode (:func:`thinwire.sync`) on ``model`` (as returned by ``accelerator.prepare``),
    its state registered for checkpointing (:class:`SyncStates`), so ``save_state`` / ``load_state`` resume
    it exactly, between two averages too. Pass the prepared ``optimizer`` for a mode whose ranks diverge:
    each rank's own optimizer state is then kept as well. On one process (accelerate does not wrap the model)
    it returns :class:`OneProcess`: the same loop runs and nothing is averaged. Use it as in any DDP loop::

        mode = thinwire.integrations.accelerate.sync(accelerator, model, "local:period=8", "int8", optimizer=opt)
        with mode.no_sync():                  # forward and backward: DDP decides at the forward
            accelerator.backward(loss_fn(model(x), y))
        mode.step(opt)
    """
    from thinwire.api import sync as _sync

    if not isinstance(model, DistributedDataParallel):
        if accelerator.num_processes == 1:  # checked as on several: a mistake must not wait for the first big run
            from thinwire.api import check_sync

            spec, _ = check_sync(mode, codec, optimizer, kwargs)
            from thinwire.compress.sync.streaming import check_fragments

            check_fragments(spec, sum(p.requires_grad for p in model.parameters()))  # the model's, as on several
            log.info("thinwire: one process, the model is not wrapped in DDP: nothing to average")
            accelerator.register_for_checkpointing(OneProcessStates(model))
            return OneProcess()
        raise TypeError(f"thinwire.integrations.accelerate.sync needs the model accelerator.prepare returned (a "
                        f"DistributedDataParallel), got {type(model).__name__}; only DDP is supported")
    m = _sync(model, mode, codec=codec, optimizer=optimizer, **kwargs)
    m.accumulating = lambda: not accelerator.sync_gradients  # gradient accumulation: a micro-batch, not a step
    if m.diverges and optimizer is None:
        log.warning("thinwire: %s lets the ranks' optimizer states differ; pass optimizer= so that save_state keeps "
                    "each rank's own (without it every rank resumes with rank 0's)", mode)
    accelerator.register_for_checkpointing(SyncStates(m, model, optimizer))
    return m
