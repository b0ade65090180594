"""The public ``thinwire.attach``: a communication spec (string or parsed), a codec, or a policy.

A string is parsed by :func:`thinwire.commspec.parse_comm_spec`, so ``"auto"`` (an online plan built
above the compression layer, :mod:`thinwire.auto`) arrives at :func:`thinwire.compress.hook.attach`
as a policy, and compress/ never imports the performance model or the planner.
"""

from __future__ import annotations

import logging

from thinwire.commspec import AutoSpec, CodecSpec, TorchSpec, as_policy
from thinwire.compress.hook import CommState
from thinwire.compress.hook import attach as _attach

log = logging.getLogger("thinwire")


def attach(model, codec="none", **kwargs) -> CommState:
    """Attach thinwire's compressed all-reduce to a DDP model; see :func:`thinwire.compress.hook.attach`.

    ``codec``: a spec string (``"int8"``, ``"topk:ratio=0.01"``, ``"auto"``; see ``thinwire codecs``), a
    parsed spec, a :class:`~thinwire.compress.codecs.base.Codec` or a
    :class:`~thinwire.compress.hook.Policy`. ``"auto"`` measures the link and the compute after the
    warm-up and picks, per bucket, the codec the performance model predicts fastest under an accuracy
    guard, re-deciding when the measured bandwidth moves by more than 30%; every decision is logged
    with its reason.
    """
    state = attach_policy(model, codec, **kwargs)
    close_at_exit(state)
    return state


def attach_policy(model, codec="none", **kwargs) -> CommState:
    """:func:`attach` for a trainer that closes the state itself (``thinwire train``): not closed at exit, where a
    failing worker's exit would otherwise wait for its communication thread."""
    check_options("thinwire.attach", kwargs, ATTACH_OPTIONS)
    if isinstance(codec, (str, CodecSpec, AutoSpec, TorchSpec)):
        codec = as_policy(codec)
    return _attach(model, codec, **kwargs)


SYNC_OPTIONS = ("error_feedback", "warmup_steps", "min_compress_bytes", "nonfinite", "timeout_s")  # as attach()'s
ATTACH_OPTIONS = (*SYNC_OPTIONS, "process_group")


def check_options(who: str, kwargs: dict, allowed: tuple[str, ...]) -> None:
    """A misspelt keyword is named with the nearest one it takes (Python's own TypeError names neither)."""
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], allowed, n=1)
        raise TypeError(f"{who}() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (did you mean {near[0]!r}?)" if near else "") + f"; it takes {', '.join(allowed)}")


def sync(model, mode="allreduce", codec="none", *, optimizer=None, **kwargs):
    """A sync mode on a DDP model: when gradients or parameters are averaged (the ``--sync`` forms:
    ``"allreduce"``, ``"delayed"``, ``"local:period=8"``, ``"diloco:period=100"``; see
    :mod:`thinwire.syncspec`), each average through ``codec`` with error feedback. Returns a
    :class:`~thinwire.compress.sync.SyncMode`; its ``comm`` counts bytes and holds the residuals.

    ``error_feedback``, ``warmup_steps``, ``min_compress_bytes``, ``nonfinite`` and ``timeout_s`` as in
    :func:`thinwire.attach`. ``optimizer``: the one the loop steps; ``delayed`` predicts each step's weights with it (a copy of its
    state), from the first step on, a resumed run's included (``mode.step(optimizer)`` alone tells it only
    after a step).

    Example (three lines in a DDP loop)::

        mode = thinwire.sync(ddp_model, "diloco:period=100", codec="int8", optimizer=optimizer)
        with mode.no_sync():
            loss_fn(ddp_model(x), y).backward()
        mode.step(optimizer)          # instead of optimizer.step()

    A loop that calls ``optimizer.step()`` itself between ``mode.before_step()`` and ``mode.after_step()``
    sets ``mode.optimizer = optimizer`` (and ``mode.clip`` to the gradient norm it clips to), which
    ``delayed``'s weight prediction steps on a copy of its state. Train in fp32 or bf16, not with fp16's
    ``GradScaler``: a mode that averages outside backward applies or predicts with gradients scaled by another
    step's loss scale (``thinwire train`` refuses fp16 with every ``--sync`` mode but ``allreduce``).
    """
    from thinwire.compress.hook import need_ddp
    from thinwire.compress.sync import create

    need_ddp(model, "thinwire.sync")  # every mode averages through DDP's process group
    spec, comm = check_sync(mode, codec, optimizer, kwargs)
    if spec.mode != "allreduce" and getattr(model, "static_graph", False):
        raise ValueError(f"thinwire.sync: {spec.mode!r} runs its steps under model.no_sync(), which a DDP model built "
                         "with static_graph=True does not allow (PyTorch's assertion 'expect_autograd_hooks_'); "
                         "build it without static_graph, or use 'allreduce'")
    m = create(model, spec, as_policy(comm), **kwargs)
    m.optimizer = optimizer
    if spec.mode != "allreduce":
        m.guard_steps()
    close_at_exit(m)
    return m


def close_at_exit(obj) -> None:
    """Close ``obj`` (a CommState or a sync mode) when the interpreter exits, if the script did not: an average
    still on the wire (a sync mode's last) met the process group's teardown at exit, and the process died of
    SIGABRT ("terminate called without an active exception") after training had finished. Held weakly."""
    import atexit
    import weakref

    ref = weakref.ref(obj)

    def close() -> None:
        target = ref()
        if target is None or getattr(target, "comm", target).closed:
            return
        try:
            target.close()
        except Exception as e:  # noqa: BLE001 - at exit: say it, do not raise over the script's own outcome
            log.warning("thinwire: closing at exit: %s", e)

    atexit.register(close)


def check_sync(mode, codec, optimizer, kwargs: dict):
    """:func:`sync`'s arguments checked and parsed, before any model is touched: (the sync spec, the comm spec).
    Integrations call it on one process too, where nothing is averaged, so a mistake shows before a run on many."""
    from thinwire.commspec import check_sync_pairing, parse_comm_spec
    from thinwire.syncspec import SyncSpec, parse_sync_spec
    import torch

    if not isinstance(mode, (str, SyncSpec)):
        raise TypeError(f"thinwire.sync: mode must be a sync spec string such as 'allreduce', 'delayed' or "
                        f"'local:period=8' (see thinwire.syncspec), got {mode!r}")
    if not isinstance(codec, (str, CodecSpec, AutoSpec, TorchSpec)):
        raise TypeError(f"thinwire.sync: codec must be a spec string such as 'none', 'int8' or 'powersgd:rank=4' (see "
                        f"`thinwire codecs`), got {codec!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"thinwire.sync: optimizer must be the torch.optim.Optimizer the loop steps (or None), got "
                        f"{type(optimizer).__name__} {optimizer!r:.60}")
    check_options("thinwire.sync", kwargs, (*SYNC_OPTIONS, "optimizer"))
    spec = parse_sync_spec(mode) if isinstance(mode, str) else mode
    comm = parse_comm_spec(codec, "codec", peers=False) if isinstance(codec, str) else codec
    spec = check_sync_pairing(spec, comm, error_feedback=kwargs.get("error_feedback", True) is not False)
    return spec, comm
