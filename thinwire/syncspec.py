"""The sync mode: *when* gradients or parameters are averaged, parsed once from ``--sync`` (or ``sync:``
in a config, or the string given to :func:`thinwire.sync`) into one typed :class:`SyncSpec`.

=============================================  =====================================================
form                                           what runs (:mod:`thinwire.compress.sync`)
=============================================  =====================================================
``allreduce``                                  today's DDP hook: gradients averaged in backward
``delayed[:predict=own|last|off]``             step t's gradient averaged while step t+1 computes and
                                               applied at step t+1 (staleness 1; Pipe-SGD, Li et al.
                                               2018); the first step applies nothing; each step
                                               computes its gradient at the weights it will be
                                               applied to, predicted by the optimizer's step with
                                               this rank's own last gradient (``own``, default) or by
                                               repeating the last update (``last``); ``off``: plain
                                               staleness
``local:period=H[,warmup=W]``                  post-local SGD (Lin et al. 2020; PyTorch's
                                               ``PostLocalSGDState`` + ``PeriodicModelAverager``):
                                               W synchronous steps, then local steps and parameters
                                               averaged every H steps
``local:period=H,fragments=F[,delay=,alpha=]``   the same average streamed: F fragments, one every H/F
                                               steps, in flight during ``delay`` inner steps, then
                                               mixed as Streaming DiLoCo's (its outer step of lr 1
                                               without momentum: the average itself)
``local:period=H,merge=keep[,delay=T]``        local SGD overlapped (CoCoD-SGD, Shen et al. 2019): the
                                               average travels during T inner steps (1 by default),
                                               then each rank takes the new global parameters plus its
                                               own progress since it sent (``merge=keep``; also with
                                               ``fragments`` and for ``diloco``)
``diloco:period=H[,outer_lr=,outer_momentum=   DiLoCo (Douillard et al. 2023): the training optimizer
,warmup=]``                                    inside, every H steps the averaged pseudo-gradient
                                               (anchor - params) takes an outer Nesterov SGD step
``diloco:period=H,fragments=F[,delay=,alpha=]``  Streaming DiLoCo (Douillard et al. 2025): F fragments
                                               of the parameters, one synced every H/F steps (each
                                               every H), its average in flight for ``delay`` inner
                                               steps, then mixed: ``lerp(global, local, alpha)``
``dynamic[:threshold=D,check_every=B,...]``    dynamic averaging (Kamp et al. 2018): local steps; every
                                               B steps a one-byte vote, and an average only when
                                               some rank drifted ``||x - a|| / ||a|| > D`` (0.05);
                                               ``rule=spread``: when the ranks' spread around their
                                               mean ``sqrt(mean ||x_i - mean x||^2) / ||a|| > D``,
                                               from a 256-float sketch per rank instead of the vote;
                                               ``by_lr=1``: D times the learning rate over its peak
``auto[:trial=N,warmup=W,guard=P]``             ``allreduce`` or ``delayed``, whichever steps faster on
                                               this run: W (10) steps, then each timed for N (20)
                                               steps; delayed only if >= 2% faster; with the profile
                                               ``P``, never delayed where its convergence guard says
                                               delayed does not reach fp32's loss
``gossip[:topology=exp2|ring|torus|random]``   decentralized SGD (D-PSGD, Lian et al. 2017): after each
                                               step, parameters averaged with the neighbours only;
                                               ``exp2`` is SGP's one-peer exponential graph (default);
                                               with a lossy codec CHOCO-SGD (ring, torus, exp2;
                                               ``gamma``: its consensus step, auto 1 for fp16,
                                               bf16, int8 and bfp); ``overlap=1``: each round
                                               travels during the next step and is mixed in after
                                               it (SGP's overlap, one step stale)
=============================================  =====================================================

Defaults and their sources: ``local`` warm-up 100 steps and no default period (PyTorch's
post-local-SGD example uses ``start_localSGD_iter=100``, ``warmup_steps=100``, ``period=4``; its
``PeriodicModelAverager`` has no default period either). ``diloco`` ``outer_lr=0.7``,
``outer_momentum=0.9`` (Nesterov) as in the paper; its period defaults to 100, not the paper's 500:
the paper chose H=500 for runs of ~88k inner steps starting from a pre-trained model, and its own
sweep of H (50 ... 2000) shows quality improving as H falls; a default must still average dozens of
times in a run of a few thousand steps from scratch. Every average goes through the codec of
``--compression`` with error feedback. The streaming variant's keys are torchft's
(``fragment_sync_delay``, ``fragment_update_alpha``), and ``local`` takes them too; with ``fragments`` > 1 ``delay`` defaults to 1
(the paper's overlap of one inner step) and ``alpha`` to 0.5 (its mixing of local and global
parameters when the sync overlaps inner steps); with one fragment both are 0: classic DiLoCo.

    >>> parse_sync_spec("diloco:period=50").outer_lr, parse_sync_spec("local:period=8").text
    (0.7, 'local:period=8,warmup=100')
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Literal

from thinwire.errors import ConfigError

MODES = ("allreduce", "delayed", "local", "diloco", "gossip", "dynamic", "auto")
TOPOLOGIES = ("exp2", "ring", "torus", "random")
DYNAMIC_RULES = ("drift", "spread")
MERGES = ("lerp", "keep")  # local and diloco: how a landed average meets the local parameters (streaming module)
PREDICTORS = ("own", "last", "off")  # delayed's weight prediction (thinwire.compress.sync.delayed)
#: The modes ``thinwire plan`` and ``thinwire simulate --sync all`` price side by side: one of each kind,
#: at periods from the literature's range (post-local SGD's example uses 4-16; DiLoCo's default 100, streamed).
#: Not gossip: these are priced with the plan's codec; gossip's topology and codec are the user's (``simulate --sync gossip``).
SHOWN = ("delayed", "local:period=4", "local:period=16", "diloco:period=100", "diloco:period=100,fragments=4")
MAX_PERIOD = 10**9
_INT = re.compile(r"[0-9]{1,10}", re.ASCII)
# per mode: key -> (kind, default); None: required
_KEYS: dict[str, dict[str, tuple[type, object]]] = {
    "allreduce": {}, "delayed": {"predict": (str, "own")},
    "local": {"period": (int, None), "warmup": (int, 100), "fragments": (int, 1), "delay": (int, "auto"),
              "alpha": (float, "auto"), "merge": (str, "lerp")},
    "diloco": {"period": (int, 100), "outer_lr": (float, 0.7), "outer_momentum": (float, 0.9), "warmup": (int, 0),
               "fragments": (int, 1), "delay": (int, "auto"), "alpha": (float, "auto"), "merge": (str, "lerp")},
    "gossip": {"topology": (str, "exp2"), "gamma": (float, "auto"), "overlap": (int, 0)},
    "dynamic": {"threshold": (float, 0.05), "check_every": (int, 4), "warmup": (int, 0), "rule": (str, "drift"),
                "by_lr": (int, 0)},
    "auto": {"trial": (int, 20), "warmup": (int, 10), "guard": (Path, "")},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncSpec:
    """A parsed sync mode; ``local`` is DiLoCo's outer step with lr 1 and no momentum (plain averaging)."""

    mode: Literal["allreduce", "delayed", "local", "diloco", "gossip", "dynamic", "auto"] = "allreduce"
    period: int = 1
    warmup: int = 0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    merge: str = "lerp"         # local, diloco with a delay: lerp(global, local, alpha), or keep (global + own)
    topology: str = ""
    gamma: float = 0.0          # gossip with a lossy codec (CHOCO-SGD): the consensus step; 0: auto
    overlap: int = 0            # gossip: 1 sends each round during the next step's compute (SGP's overlap)
    threshold: float = 0.05
    rule: str = ""              # dynamic: "drift" (each rank's from the last average) or "spread" (the ranks')
    by_lr: int = 0              # dynamic: 1 scales the threshold by the learning rate over its peak so far
    check_every: int = 1
    trial: int = 20             # auto: timed steps of each of allreduce and delayed
    guard: str = ""             # auto: a profile whose convergence guard says whether delayed reaches fp32's loss
    try_delayed: bool = True    # auto: False when the guard says delayed does not (resolved by commspec)
    predict: str = "own"        # delayed (and auto's delayed): where each gradient is computed (PREDICTORS)

    def __post_init__(self) -> None:
        _check(self.mode in MODES, "mode", self.mode, "one of " + ", ".join(MODES))
        _check(math.isfinite(self.threshold) and 0 < self.threshold < 10, "threshold", self.threshold,
               "a relative drift in (0, 10)", "0.05 (the default) averages once parameters moved 5% of their norm.")
        _check(5 <= self.trial <= 10**6, "trial", self.trial, "an integer in [5, 1000000]",
               "Steps each of allreduce and delayed is timed before auto chooses; 20 by default.")
        _check(self.predict in PREDICTORS, "predict", self.predict, "one of " + ", ".join(PREDICTORS),
               "own (default) computes each gradient where the optimizer's step with this rank's own last gradient "
               "puts the weights; last: where repeating the last update does; off: plain staleness.")
        _check((self.mode == "dynamic") == (self.rule in DYNAMIC_RULES), "rule", self.rule,
               "one of " + ", ".join(DYNAMIC_RULES) + " (dynamic only)",
               "drift tests each rank's distance from the last average; spread the ranks' distance from their mean.")
        _check(self.by_lr in (0, 1) and (self.by_lr == 0 or self.mode == "dynamic"), "by_lr", self.by_lr,
               "0 or 1 (dynamic only)", "1 scales the threshold by the learning rate over its peak so far.")
        _check(1 <= self.check_every <= MAX_PERIOD, "check_every", self.check_every, f"an integer in [1, {MAX_PERIOD}]")
        _check((self.mode == "gossip") == (self.topology in TOPOLOGIES), "topology", self.topology,
               "one of " + ", ".join(TOPOLOGIES) + " (gossip only)", "exp2, the one-peer exponential graph, scales best.")
        _check(math.isfinite(self.gamma) and 0 <= self.gamma <= 1 and (self.gamma == 0 or self.mode == "gossip"),
               "gamma", self.gamma, "a number in (0, 1] (gossip only)",
               "The consensus step of compressed gossip; auto is 1 for the dense quantizers fp16, bf16, int8, bfp.")
        _check(self.overlap in (0, 1) and (self.overlap == 0 or self.mode == "gossip"), "overlap", self.overlap,
               "0 or 1 (gossip only)", "1 mixes each round in one step later, its transfer hidden behind that step.")
        _check(1 <= self.period <= MAX_PERIOD, "period", self.period, f"an integer in [1, {MAX_PERIOD}]",
               "period=1 averages after every step; larger periods send less.")
        _check(0 <= self.warmup <= MAX_PERIOD, "warmup", self.warmup, f"an integer in [0, {MAX_PERIOD}]")
        _check(math.isfinite(self.outer_lr) and 0 < self.outer_lr <= 10, "outer_lr", self.outer_lr,
               "a number in (0, 10]", "DiLoCo uses 0.7.")
        _check(math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1, "outer_momentum",
               self.outer_momentum, "a number in [0, 1)", "DiLoCo uses 0.9; 0 turns momentum off.")
        _check(1 <= self.fragments <= self.period and self.period % self.fragments == 0, "fragments", self.fragments,
               f"a whole number that divides the period ({self.period})",
               "One fragment is synced every period/fragments steps.")
        every = self.period // self.fragments if self.period % self.fragments == 0 else 1
        _check(0 <= self.delay < every, "delay", self.delay, f"a whole number in [0, {every - 1}] "
               f"(fewer than period/fragments = {every} steps)", "A fragment's sync must land before the next one starts.")
        _check(math.isfinite(self.alpha) and 0 <= self.alpha <= 1, "alpha", self.alpha, "a number in [0, 1]",
               "0 keeps the global parameters, 1 the local ones; Streaming DiLoCo mixes 0.5.")
        _check(self.merge in MERGES and (self.merge == "lerp" or self.periodic), "merge", self.merge,
               "one of " + ", ".join(MERGES) + " (local and diloco only)",
               "keep: the new global parameters plus this rank's progress while the average travelled (CoCoD-SGD); "
               "lerp: lerp(global, local, alpha) (Streaming DiLoCo).")

    @property
    def sync_every(self) -> int:
        """Local steps between a periodic mode's syncs: its period, or a fragment's turn (period / fragments)."""
        return self.period // self.fragments

    @property
    def streaming(self) -> bool:
        """Fragments synced on a staggered schedule, or the outer step overlapped with inner steps."""
        return self.fragments > 1 or self.delay > 0

    @property
    def periodic(self) -> bool:
        """Whether ranks step locally and average parameters every ``period`` steps."""
        return self.mode in ("local", "diloco")

    @property
    def text(self) -> str:
        keys = [k for k in _KEYS[self.mode] if (k not in _STREAMING or self.streaming) and (k != "gamma" or self.gamma)
                and (k != "guard" or self.guard) and (k != "predict" or self.predict != "own") and (k != "overlap" or self.overlap)
                and (k != "rule" or self.rule != "drift") and (k != "by_lr" or self.by_lr)
                and (k != "merge" or self.merge != "lerp") and (k != "alpha" or self.merge != "keep")]
        return self.mode + (":" + ",".join(f"{k}={getattr(self, k)}" for k in keys) if keys else "")


_STREAMING = ("fragments", "delay", "alpha", "merge")  # in the text only when set


def _check(cond: bool, key: str, value: object, allowed: str, fix: str = "") -> None:
    if not cond:
        raise ConfigError(f"sync.{key}", value, allowed, fix)


def parse_sync_spec(text: str) -> SyncSpec:
    """``MODE[:key=value,...]`` to its :class:`SyncSpec`; a mistake names the key, the value and what is allowed."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("sync", text, "one of " + ", ".join(MODES), _FIX)
    head, _, params = text.strip().partition(":")
    mode = head.strip().lower()
    if mode not in _KEYS:
        raise ConfigError("sync", text, "one of " + ", ".join(MODES), _FIX)
    keys = _KEYS[mode]
    values = {k: d for k, (_, d) in keys.items()}
    given = set()
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, sep, raw = (t.strip() for t in item.partition("="))
        if key not in keys or not sep:
            allowed = f"keys {', '.join(keys)}" if keys else "no parameters"
            raise ConfigError("sync", text, f"{mode} with {allowed} (key=value, comma-separated)", _FIX)
        if key in given:  # the later one would win, silently
            raise ConfigError(f"sync.{key}", text, "given once", "Remove the duplicate.")
        given.add(key)
        values[key] = _number(mode, key, raw, keys[key][0])
        if key == "gamma":  # 0 stands for auto inside SyncSpec; a given step must be a real one
            _check(math.isfinite(values[key]) and 0 < values[key] <= 1, "gamma", raw, "a number in (0, 1]",
                   "The consensus step of compressed gossip; auto is 1 for the dense quantizers fp16, bf16, int8, bfp.")
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConfigError(f"sync.{missing[0]}", text, f"given: {mode}:{missing[0]}=N", _FIX)
    keep = values.get("merge") == "keep"
    if keep and "alpha" in given:
        raise ConfigError("sync.alpha", values["alpha"], "not given with merge=keep",
                          "merge=keep adds this rank's progress to the global parameters, alpha mixes the two "
                          f"(merge=lerp); give one. E.g. {mode}:period=H,merge=keep")
    if values.get("delay") == "auto":  # streaming or keep: overlap one inner step; one fragment: classic DiLoCo
        every = values["period"] // values["fragments"] if values["fragments"] >= 1 else 0
        values["delay"] = 1 if (values["fragments"] > 1 or keep) and every > 1 else 0
    if mode == "delayed":  # 1 and 0: the values before ``own`` (a run's saved config still says them)
        values["predict"] = {"1": "last", "0": "off"}.get(values["predict"], values["predict"])
    if values.get("gamma") == "auto":  # resolved against the codec (commspec.check_sync_pairing, Gossip)
        values["gamma"] = 0.0
    if values.get("alpha") == "auto":
        values["alpha"] = 0.5 if values["delay"] > 0 and not keep else 0.0
    elif mode in ("local", "diloco") and not (values["fragments"] > 1 or values["delay"] > 0):  # it would be dropped
        raise ConfigError("sync.alpha", values["alpha"], "given only with fragments > 1 or delay > 0",
                          "alpha mixes local and global parameters after an overlapped average (Streaming "
                          f"DiLoCo); a blocking one replaces the local ones. E.g. {mode}:period=H,fragments=F,alpha=0.5")
    return SyncSpec(mode=mode, **values)


def _number(mode: str, key: str, raw: str, kind: type) -> float | int | str:
    if kind is Path:  # a path keeps its case
        if not raw:
            raise ConfigError(f"sync.{key}", raw, "the path of a profile from `thinwire profile`", _FIX)
        return raw
    if kind is str:
        return raw.lower()
    if kind is int:
        if not _INT.fullmatch(raw.removeprefix("-")):  # a negative one gets its range from SyncSpec's check
            raise ConfigError(f"sync.{key}", raw, "a whole number", _FIX)
        return int(raw)
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"sync.{key}", raw, "a number", _FIX) from None


_FIX = "E.g. delayed, local:period=8, diloco:period=100,outer_lr=0.7,outer_momentum=0.9, gossip:topology=ring"
