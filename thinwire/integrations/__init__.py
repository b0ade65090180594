"""thinwire inside the training frameworks people already use: each an optional extra.

- :mod:`thinwire.integrations.lightning`: ``Trainer(strategy=ThinwireStrategy("int8"))``
  (``pip install 'thinwire[lightning]'``).
- :mod:`thinwire.integrations.accelerate`: ``attach(accelerator, model, "int8")`` on a prepared model
  (``pip install 'thinwire[accelerate]'``).
- :mod:`thinwire.integrations.transformers`: ``attach(trainer, "int8")`` on a Hugging Face ``Trainer``
  (``pip install 'thinwire[transformers]'``).

Each keeps the hook's per-rank state (error-feedback residuals, counters) in the framework's own
checkpoint, so a resumed run continues with the residuals it stopped with. Residuals differ per rank,
so what is saved is every rank's state; a resumed run at another world size starts with empty
residuals and says so.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from thinwire.batch import tree_map

log = logging.getLogger("thinwire.integrations")


def need(module: str, extra: str):
    """Import an optional framework, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"thinwire's {extra} integration needs {module!r}: pip install 'thinwire[{extra}]'") from None


def hook_codec(codec, who: str):
    """``codec`` parsed and checked where the integration is built, before any process starts: a thinwire
    codec spec, ``auto``, a parsed spec, a Codec or a Policy (not PyTorch's hooks, which the frameworks
    register themselves)."""
    from thinwire.commspec import AutoSpec, CodecSpec, TorchSpec, as_policy, parse_comm_spec
    from thinwire.compress.codecs.base import Codec
    from thinwire.compress.hook import Policy

    if isinstance(codec, (str, TorchSpec)):
        spec = parse_comm_spec(codec) if isinstance(codec, str) else codec
        if isinstance(spec, TorchSpec):
            as_policy(spec)  # raises, saying where PyTorch's hooks go
        return spec
    if not isinstance(codec, (CodecSpec, AutoSpec, Codec, Policy)):
        raise TypeError(f"{who}: codec must be a spec string such as 'int8', 'powersgd:rank=4' or 'auto' (see "
                        f"`thinwire codecs`), got {codec!r}")
    return codec


def check_hook_kwargs(kwargs: dict, who: str) -> None:
    """The keywords of :func:`thinwire.attach`, named and typed where the integration is built (a mistake
    would otherwise surface once every process has started training)."""
    import inspect

    from thinwire.compress.hook import attach, check_options

    known = [n for n in inspect.signature(attach).parameters if n not in ("model", "codec", "process_group")]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"{who}: unknown keyword {unknown[0]!r}; it takes {', '.join(known)} (as thinwire.attach)"
                        + ("; sync modes are offered in Lightning and accelerate, not here" if "sync" in unknown else ""))
    check_options(**kwargs)


def to_cpu(obj):
    """``obj`` with every tensor moved to the CPU (a checkpoint readable on any device)."""
    return tree_map(lambda t: t.detach().cpu(), obj)


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def gather_states(mine: dict) -> dict:
    """Every rank's ``mine`` (its hook or sync state), gathered: a collective, call it on every rank.
    What a checkpoint written by one rank must hold, since residuals differ per rank."""
    rank, size = world()
    mine = to_cpu(mine)
    if size == 1:
        return {"world_size": 1, "ranks": [mine]}
    states: list = [None] * size
    dist.all_gather_object(states, mine)
    return {"world_size": size, "ranks": states}


def rank_state(saved: dict | None, where: str, *, warn: bool = True) -> dict | None:
    """This rank's part of :func:`gather_states`' output; None (and a warning) when the saved run had
    another world size: residuals then start empty, which costs accuracy for a few steps, not
    correctness."""
    if not saved:
        return None
    rank, size = world()
    if saved.get("world_size") != size:
        if warn:  # once per checkpoint: a second reader of the same one passes warn=False
            log.warning("thinwire: %s holds state for %s ranks, this run has %s; error-feedback residuals "
                        "start empty", where, saved.get("world_size"), size)
        return None
    return saved["ranks"][rank]


def mode_record(mode) -> dict:
    """What a checkpoint keeps of a sync mode for this rank: its state, and its name (what tells a resume under
    another mode apart, where two modes' states have the same keys)."""
    return {"sync": mode.state_dict(), "sync_name": mode.name}  # the state first: it waits for averages in flight


def same_mode(mode, mine: dict) -> bool:
    """Whether ``mine`` (a rank's part of a checkpoint) was saved by this run's sync ``mode``: by the name saved with
    it, and by its state's keys where an older checkpoint has no name."""
    if mode is None or not isinstance(mine.get("sync"), dict) or mine.get("sync_name", mode.name) != mode.name:
        return False
    try:
        mode.check_state(mine["sync"])
    except ValueError:
        return False
    return True


def load_mode_state(mode, mine: dict, where: str) -> None:
    """``mode``'s state from a rank's part of a checkpoint; where it is another mode's (the run changed ``sync``),
    that mode's state is left out, said, and this one's starts fresh, as ``thinwire train`` does."""
    if same_mode(mode, mine):
        mode.load_state_dict(mine["sync"])
        return
    if "sync" in mine:
        log.warning("thinwire: %s holds another sync mode's state (%s); %s's own starts fresh", where,
                    _saved_mode(mode, mine), mode.name)
    mode.load_state_dict({})


def _saved_mode(mode, mine: dict) -> str:
    """The mode a checkpoint's rank part was saved by, as a warning names it: its name, and where that is this
    mode's (classic and streaming DiLoCo are both ``diloco``) that its settings differ."""
    name = mine.get("sync_name")
    if name is None:
        return "its state's keys are not this mode's"
    return f"{name} with other settings: its state's keys are not this run's" if name == mode.name else name


def load_own_model(mode, module, saved: dict, mine: dict, where: str) -> None:
    """A rank's own model from a checkpoint of a mode whose ranks' models differ (``saved``: every rank's part,
    :func:`gather_states`; ``mine``: this rank's), loaded where this run's ``mode`` is the same mode. Another mode
    whose ranks differ (DiLoCo resumed as local SGD) starts every rank from the ranks' average, as ``thinwire
    train`` does: a fresh mode's anchor would be each rank's own parameters, and they would never meet again. A
    mode that keeps their parameters equal (``allreduce``; ``delayed``, whose BatchNorm statistics alone are each
    rank's) goes on from the checkpoint's model (``where``) on every rank."""
    if mode is not None and mode.diverges:
        if same_mode(mode, mine):
            module.load_state_dict(mine["model"])
            return
        from thinwire.train.loop import average_states

        module.load_state_dict(average_states([r["model"] for r in saved["ranks"]]))
        log.warning("thinwire: the checkpoint's ranks trained under another sync mode (%s); every rank starts "
                    "from their average", _saved_mode(mode, mine))
        return
    own = mine["model"]
    if mode is not None and mode.buffers_diverge:
        params = {n for n, _ in module.named_parameters()}
        module.load_state_dict({k: v for k, v in own.items() if k not in params}, strict=False)
        return
    log.warning("thinwire: the checkpoint holds each rank's own model (saved by a sync mode whose ranks' models "
                "differ); this run keeps the ranks equal, so every rank goes on from %s", where)
