"""The communication spec: how gradients travel, parsed once from ``--compression`` (or ``compression:``
in a config, or the string given to :func:`thinwire.attach`) into one typed object.

==========================  =============  ======================================================
form                        object         what runs
==========================  =============  ======================================================
``int8``, ``topk:ratio=…``  :class:`CodecSpec`   thinwire's hook with that codec on every bucket
``auto``, ``auto:k=v,…``    :class:`AutoSpec`    thinwire's hook, the codec chosen per bucket online
``torch:none|fp16|bf16``,   :class:`TorchSpec`   PyTorch's own DDP communication (the peers thinwire
``torch:powersgd:rank=R``,                       is measured against); ``localsgd`` is its post-local
``torch:localsgd:period=H``                      SGD (hook + ``PeriodicModelAverager``)
==========================  =============  ======================================================

Below this module nobody reads the string again: the trainer, ``attach`` and the CLI receive the
object. A sync mode (local SGD, DiLoCo, gossip) is a new form with its own object here.

    >>> parse_comm_spec("int8:block=64").text, parse_comm_spec("torch:powersgd:rank=4").rank
    ('int8:block=64', 4)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Literal, Union

from thinwire.auto import AutoConfig, AutoPolicy, parse_auto_spec
from thinwire.compress.codecs.base import Codec
from thinwire.compress.hook import Policy, StaticPolicy
from thinwire.compress.spec import REGISTRY, codec_help, parse_codec_spec, spec_string
from thinwire.errors import ConfigError
from thinwire.syncspec import MAX_PERIOD, SyncSpec, parse_sync_spec

TORCH_HOOKS = ("none", "fp16", "bf16", "powersgd", "localsgd")
MAX_RANK = 4096
_RANK = re.compile(r"[0-9]{1,6}", re.ASCII)  # ASCII digits only: str.isdigit() also accepts '²'


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """One codec for every bucket, through thinwire's hook."""

    codec: Codec

    @property
    def text(self) -> str:
        return spec_string(self.codec)

    def policy(self) -> Policy:
        return StaticPolicy(self.codec)


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """``auto``: the codec of each bucket chosen online (:mod:`thinwire.auto`)."""

    config: AutoConfig
    text: str

    def policy(self) -> Policy:
        return AutoPolicy(self.config)


@dataclasses.dataclass(frozen=True)
class TorchSpec:
    """PyTorch's own DDP communication: no hook, one of its ``default_hooks`` / ``powerSGD_hook``, or
    post-local SGD (``post_localSGD_hook`` with ``PeriodicModelAverager``: ``period``, ``warmup``, the
    defaults of thinwire's ``--sync local`` so the two run the same schedule)."""

    hook: Literal["none", "fp16", "bf16", "powersgd", "localsgd"]
    rank: int = 1
    period: int = 1
    warmup: int = 100

    @property
    def text(self) -> str:
        if self.hook == "localsgd":
            return f"torch:localsgd:period={self.period},warmup={self.warmup}"
        return f"torch:{self.hook}" + (f":rank={self.rank}" if self.hook == "powersgd" else "")

    def bucket_mb(self, default: float) -> float:
        """PyTorch's PowerSGD hook aborts on gloo with more than one DDP bucket: it gets one."""
        return 1e5 if self.hook == "powersgd" else default


CommSpec = Union[CodecSpec, AutoSpec, TorchSpec]


def parse_comm_spec(text: str, field: str = "compression", peers: bool = True) -> CommSpec:
    """Any form of the table above to its object; a mistake names every valid form. ``field``: the name the
    caller knows the value by; ``peers`` False: the caller runs no PyTorch hook (``thinwire.attach``'s
    ``codec``), so a mistake is not told of the ``torch:*`` forms."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(field, text, "a codec spec, auto[:...]" + (" or torch:HOOK" if peers else ""), _fix(peers))
    head = text.partition(":")[0].strip().lower()
    parse = _FORMS.get(head)
    if head == "torch" and not peers:
        raise ConfigError(field, text, "a thinwire codec or auto", _HOOKS_ARE_PYTORCHS)
    if parse is not None:
        return parse(text.strip())
    if head not in REGISTRY.names():
        raise ConfigError(field, text, "one of " + ", ".join(forms(peers)), _fix(peers))
    return CodecSpec(parse_codec_spec(text))


def _auto(text: str) -> AutoSpec:
    return AutoSpec(parse_auto_spec(text), text)


def _torch(text: str) -> TorchSpec:
    hook, _, params = text.partition(":")[2].partition(":")
    hook = hook.strip().lower()
    if hook not in TORCH_HOOKS:
        raise ConfigError("compression", text, "torch:" + "|".join(TORCH_HOOKS) +
                          " (powersgd takes :rank=R, localsgd :period=H[,warmup=W])")
    if hook == "localsgd":
        return _torch_localsgd(text, params)
    if not params:
        return TorchSpec(hook)
    key, _, value = (t.strip() for t in params.partition("="))
    if hook != "powersgd" or key != "rank" or not _RANK.fullmatch(value) or not 1 <= int(value) <= MAX_RANK:
        raise ConfigError("compression", text, f"torch:powersgd:rank=R with an integer R in [1, {MAX_RANK}]",
                          f"torch:{hook} takes no parameters." if hook != "powersgd" else "")
    return TorchSpec(hook, int(value))


def _torch_localsgd(text: str, params: str) -> TorchSpec:
    """PyTorch's post-local SGD on the schedule of ``--sync local`` (its parser, its defaults)."""
    try:
        local = parse_sync_spec("local:" + params)
    except ConfigError:
        raise ConfigError("compression", text, f"torch:localsgd:period=H[,warmup=W] with whole numbers H in "
                          f"[1, {MAX_PERIOD}], W in [0, {MAX_PERIOD}]", "E.g. torch:localsgd:period=16") from None
    return TorchSpec("localsgd", period=local.period, warmup=local.warmup)


_FORMS: dict[str, Callable[[str], CommSpec]] = {"auto": _auto, "torch": _torch}


def forms(peers: bool = True) -> list[str]:
    """Every valid head of a communication spec: the registered codecs, ``auto``, ``torch:HOOK`` (``peers``)."""
    return [*REGISTRY.names(), "auto", *(f"torch:{h}" for h in TORCH_HOOKS if peers)]


def _fix(peers: bool = True) -> str:
    return ("E.g. int8, topk:ratio=0.01, auto" + (", torch:bf16" if peers else "")
            + "; `thinwire codecs` lists every codec's parameters.")


def comm_help() -> str:
    """``thinwire codecs``: the codec table, then the other forms."""
    auto = ", ".join(f.name for f in dataclasses.fields(AutoConfig) if f.init)
    return "\n".join([
        codec_help(), "", "Other forms of --compression:",
        f"auto[:key=value,...]    pick the codec per bucket from the measured link and compute; keys: {auto}",
        "torch:none|fp16|bf16    PyTorch's own DDP communication (plain DDP, its fp16/bf16 hooks), as peers",
        "torch:powersgd:rank=R   PyTorch's PowerSGD hook",
        "torch:localsgd:period=H[,warmup=W]  PyTorch's post-local SGD (post_localSGD_hook + PeriodicModelAverager;"
        " warm-up 100 synchronous steps by default)",
    ])


_HOOKS_ARE_PYTORCHS = ("PyTorch's hooks are registered with model.register_comm_hook; "
                       "`thinwire train --compression torch:...` runs them as peers.")


def as_policy(spec: CommSpec | str) -> Policy:
    """What :func:`thinwire.compress.hook.attach` runs for ``spec``; a PyTorch peer has no thinwire policy."""
    spec = parse_comm_spec(spec, "codec", peers=False) if isinstance(spec, str) else spec
    if isinstance(spec, TorchSpec):
        raise ConfigError("codec", spec.text, "a thinwire codec or auto", _HOOKS_ARE_PYTORCHS)
    return spec.policy()


def check_sync_pairing(sync: SyncSpec, comm: CommSpec, *, precision: str = "fp32", plan: str | None = None,
                       error_feedback: bool = True) -> SyncSpec:
    """Refuse a sync mode with what it cannot run: PyTorch's hooks or ``auto`` (a DDP-hook policy),
    fp16's loss scaling (a stale gradient was scaled by an older scale), a plan (it attaches its own hook),
    compressed gossip without error feedback (its public copies are the error feedback).
    Returns the spec resolved: ``auto:guard=P`` with its guard's verdict on ``delayed`` (``try_delayed``)."""
    if sync.mode == "allreduce":
        return sync
    if not isinstance(comm, CodecSpec):
        raise ConfigError("compression", comm.text, f"a thinwire codec (none, bf16, int8, topk:ratio=...) with "
                          f"--sync {sync.mode}", "PyTorch's hooks and auto run only with --sync allreduce.")
    if precision == "fp16":
        raise ConfigError("precision", precision, f"fp32, bf16 or int8 with --sync {sync.mode}",
                          "fp16's loss scale changes between steps; use bf16.")
    if plan:
        raise ConfigError("plan", plan, "no plan with --sync " + sync.mode, "A plan attaches its own per-bucket hook.")
    if sync.mode == "gossip" and not comm.codec.lossless:
        check_compressed_gossip(sync, comm.codec)
        if not error_feedback:  # it would be taken and ignored
            raise ConfigError("error_feedback", False, f"true with compressed gossip (--compression "
                              f"{spec_string(comm.codec)})", "CHOCO-SGD's public copies are its error feedback: what "
                              "the codec drops stays in x - h and is sent later. Drop error_feedback=false, or use a "
                              "lossless codec (none) for plain gossip.")
    elif sync.mode == "gossip" and sync.gamma:  # plain gossip averages exactly: no consensus step to take
        raise ConfigError("sync.gamma", sync.gamma, "left out with a lossless codec (--compression "
                          f"{spec_string(comm.codec)})", "gamma is compressed gossip's (CHOCO-SGD) consensus step; "
                          "with a lossy codec (int8, bfp, topk, ...) it applies.")
    if sync.mode == "auto" and sync.guard:
        return dataclasses.replace(sync, try_delayed=delayed_reaches(sync.guard))
    return sync


def delayed_reaches(path: str) -> bool:
    """The convergence guard's verdict on ``delayed`` in the profile at ``path`` (``thinwire profile`` runs it
    by default): whether one-step-stale averaging reaches fp32's loss within its tolerance at equal samples."""
    from thinwire.auto.spec import load_guard_profile

    make = "Make one with `thinwire profile --workload W --out P` (the guard runs delayed by default)."
    record = load_guard_profile(path, "sync.guard", make).sync.get("delayed")
    if record is None:
        raise ConfigError("sync.guard", path, "a profile with the convergence guard's record of delayed",
                          f"This one has none (made with --guard-steps 0, or by an older thinwire). {make}")
    return record.reaches


#: Codecs that send every coordinate, rounded finely: compressed gossip's consensus step may be 1 with them.
DENSE_QUANTIZERS = ("fp16", "bf16", "int8", "bfp")


def check_compressed_gossip(sync: SyncSpec, codec) -> None:
    """Gossip with a lossy codec is CHOCO-SGD (:mod:`thinwire.compress.sync.gossip`): a fixed graph (each
    rank keeps public copies of its neighbours' parameters: on ring and torus one per neighbour, on exp2
    one per edge of its log2 p peers), a codec that encodes one tensor alone (not PowerSGD's all-reduce
    rounds), and a consensus step that suits the codec."""
    name = spec_string(codec)
    if sync.topology not in ("ring", "torus", "exp2"):
        raise ConfigError("sync.topology", sync.topology, f"ring, torus or exp2 with --compression {name}",
                          "Compressed gossip (CHOCO-SGD) keeps a public copy of each peer's parameters; a random "
                          "pairing may pair any two ranks (p - 1 copies each); or use --compression none.")
    if codec.lowrank:
        raise ConfigError("compression", name, "a codec other than powersgd with --sync gossip",
                          "PowerSGD's factors need all-reduce rounds; int8 or bfp send a quarter of the bytes.")
    if sync.gamma == 0 and codec.name not in DENSE_QUANTIZERS:
        raise ConfigError("sync.gamma", "auto", f"an explicit consensus step in (0, 1] with --compression {name}",
                          f"E.g. gossip:topology={sync.topology},gamma=0.1: CHOCO-SGD's step shrinks with the share "
                          "of the change a codec keeps (tune it; auto is 1 only for fp16, bf16, int8 and bfp).")
