"""Sync modes: *when* averaging happens (see :mod:`thinwire.syncspec` for the forms and their sources).

==============  ========================================  ===========================================
mode            module                                    averages
==============  ========================================  ===========================================
``allreduce``   :mod:`.base` (the DDP hook)               gradients, in backward
``delayed``     :mod:`.delayed`                           gradients, overlapped with the next step
``local``       :mod:`.local`                             parameter changes, every H steps
``diloco``      :mod:`.diloco`                            pseudo-gradients, every H steps (outer Nesterov)
  (streaming)   :mod:`.streaming`                         one of F fragments every H/F steps, in flight
``gossip``      :mod:`.gossip`                            parameters, with neighbours only, every step
``dynamic``     :mod:`.dynamic`                           parameter changes, when some rank has drifted
``auto``        :mod:`.choose`                            ``allreduce`` or ``delayed``, by this run's clock
==============  ========================================  ===========================================

Every mode averages through a :class:`~thinwire.compress.hook.CommState` (codec, error feedback,
bytes counted on the wire). :func:`create` builds one; ``thinwire.sync`` is the public entry.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from thinwire.compress.hook import MIN_COMPRESS_BYTES, CommState, Policy, attach, group_like, refuse_sparse
from thinwire.compress.sync.base import Averaged, StepParts, SyncMode, Unwrapped
from thinwire.compress.sync.choose import ChooseSync
from thinwire.compress.sync.delayed import Delayed
from thinwire.compress.sync.diloco import DiLoCo
from thinwire.compress.sync.dynamic import Dynamic
from thinwire.compress.sync.gossip import Gossip
from thinwire.compress.sync.local import LocalSGD
from thinwire.compress.sync.streaming import StreamingDiLoCo, StreamingLocal

MODES: dict[str, type[SyncMode]] = {"allreduce": SyncMode, "delayed": Delayed, "local": LocalSGD, "diloco": DiLoCo,
                                    "gossip": Gossip, "dynamic": Dynamic, "auto": ChooseSync}


def create(model, spec, policy: Policy, *, error_feedback: bool = True, warmup_steps: int = 0,
           min_compress_bytes: int = MIN_COMPRESS_BYTES, nonfinite: str = "skip", timeout_s: float | None = None,
           process_group=None, bucket_mb: float = 25.0) -> SyncMode:
    """The sync mode ``spec.mode`` (a parsed spec: mode, period, warmup, outer_lr, outer_momentum) on a
    DDP ``model``, averaging with ``policy``'s codec. ``allreduce`` attaches the DDP hook (on a module
    without DDP, :class:`~.base.Unwrapped`, it averages after backward: :class:`~.base.Averaged`); the others
    average outside backward. ``delayed`` always gets a new process group: its averaging stays in
    flight while the loop issues its own collectives, and so does streaming DiLoCo with a delay.
    ``min_compress_bytes``, ``nonfinite`` and ``timeout_s`` (of the groups made here) as in
    :func:`~thinwire.compress.hook.attach`."""
    import datetime

    from thinwire.compress.hook import check_options

    refuse_sparse(model.module, f"sync {spec.mode}")
    check_options(error_feedback=error_feedback, warmup_steps=warmup_steps, min_compress_bytes=min_compress_bytes,
                  nonfinite=nonfinite, timeout_s=timeout_s)
    options = dict(error_feedback=error_feedback, warmup_steps=warmup_steps, min_compress_bytes=min_compress_bytes,
                   nonfinite=nonfinite)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    if spec.mode == "allreduce" and not isinstance(model, Unwrapped):
        return SyncMode(model, attach(model, policy, **options, timeout_s=timeout_s, process_group=process_group), spec)
    if spec.mode == "auto":  # the DDP hook and delayed's averages share one CommState, in a group of their own
        if isinstance(model, Unwrapped):
            from thinwire.errors import ConfigError

            raise ConfigError("sync", "auto", "a mode without DDP's hook here (allreduce or delayed)",
                              "--sync auto chooses between DDP's all-reduce and delayed; a pipeline stage has no DDP.")
        comm = attach(model, policy, **options, process_group=group_like(model, timeout))
        return ChooseSync(model, comm, spec, bucket_mb=bucket_mb)
    if spec.mode == "delayed" or spec.delay > 0 or process_group is None:
        process_group = (group_like(model, timeout) if isinstance(model, DistributedDataParallel) else
                         dist.new_group(backend=dist.get_backend(), timeout=timeout))
    ddp = isinstance(model, DistributedDataParallel)
    if ddp:
        _refuse_attached(model, spec)
    comm = CommState(policy, **options, group=process_group)
    policy.bind(comm, model.module)
    try:  # a mode that refuses its model (fragments=, topology=) leaves the DDP model as it was: a retry, or plain DDP
        built = (Averaged if spec.mode == "allreduce" else kind(spec))(model, comm, spec, bucket_mb=bucket_mb)
    except BaseException:
        comm.close()
        raise
    if ddp:
        try:
            _keep_own_gradients(model, spec)
        except BaseException:
            built.close()
            raise
        model._thinwire_state = comm  # a second attach or sync on this model is refused, saying why
    return built


def _refuse_attached(model: DistributedDataParallel, spec) -> None:
    from thinwire.errors import ConfigError

    if getattr(model, "_thinwire_state", None) is not None:
        raise ConfigError("sync", spec.mode, "a DDP model thinwire is not attached to yet",
                          "thinwire.attach (or an earlier thinwire.sync) already averages this model; give the codec "
                          "to thinwire.sync(model, mode, codec=...) instead, once per DDP model.")


def _keep_own_gradients(model: DistributedDataParallel, spec) -> None:
    """A mode that averages itself runs forward and backward in ``mode.no_sync()``. A loop that puts only
    backward in it (DDP decides at the forward whether its backward all-reduces) would all-reduce every
    gradient in fp32 besides the mode's own averaging: accelerate's loops do, written the usual way. DDP's
    backward gets torch's no-op hook (each rank keeps its own gradient), so such a backward costs no traffic."""
    from thinwire.errors import ConfigError

    try:
        model.register_comm_hook(None, noop_hook)
    except RuntimeError:
        raise ConfigError("sync", spec.mode, "a model without a DDP communication hook of its own",
                          f"sync {spec.mode} averages by itself, so DDP's backward must not: build the DDP model anew "
                          "without register_comm_hook.") from None


def kind(spec) -> type[SyncMode]:
    """The class that runs (and prices) a parsed sync spec."""
    if spec.periodic and spec.streaming:
        return StreamingLocal if spec.mode == "local" else StreamingDiLoCo
    return MODES[spec.mode]


__all__ = ["MODES", "StepParts", "SyncMode", "Averaged", "Unwrapped", "kind", "ChooseSync", "Delayed", "LocalSGD", "DiLoCo", "StreamingDiLoCo", "StreamingLocal", "Gossip",
           "Dynamic", "create"]
