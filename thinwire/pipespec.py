"""``--pipeline`` parsed once into a typed :class:`PipelineSpec`: the model split into stages on
different ranks, run by a schedule of ``torch.distributed.pipelining``.

==========================  ===================================================================
form                        meaning
==========================  ===================================================================
``none``                    no pipeline: every rank holds the model
``gpipe[:KEYS]``            GPipe (Huang et al. 2019): all forwards, then all backwards
                            (``ScheduleGPipe``)
``1f1b[:KEYS]``             one forward one backward (PipeDream-Flush, Narayanan et al. 2021): the
                            same bubble, at most S micro-batches' activations held per stage
                            (``Schedule1F1B``)
``interleaved[:KEYS]``      interleaved 1F1B (Narayanan et al. SC 2021): each rank holds ``virtual``
                            stages (chunks ``r, r+S, ...`` of the layer list cut in S x V), the
                            bubble about V times smaller for V times the messages
                            (``ScheduleInterleaved1F1B``)
==========================  ===================================================================

KEYS, comma-separated: ``stages=S``, ``microbatches=M``, ``layers=A/B/..``, ``activations=fp32|bf16|int8``
(one format for every link, or one per link: ``activations=fp32/int8/fp32``), ``recompute=on|off``
(activation checkpointing of every layer: its activations recomputed in backward, one more forward of
compute for the memory of its input alone), and for ``interleaved`` ``virtual=V`` (stages per rank, default
2; ``layers`` and per-link ``activations`` then count the S x V stages and their S x V - 1 links).

``stages`` (default: every rank one stage) must divide the world size; the ranks left over form
data-parallel replicas of the pipeline (world = replicas x stages), whose gradients are averaged through
``--compression``. ``microbatches`` defaults to the largest divisor of a replica's batch that is at most
4 x stages: GPipe's paper finds the bubble ``(S-1)/(M+S-1)`` negligible from M >= 4 S. ``layers`` gives each
stage's count of layers of the model's layer list (``2/1/1``); without it the list is cut so that the
largest stage holds the fewest parameters. ``activations`` is the format of the activations and their
gradients on the links between stages (:mod:`thinwire.pipeline.wire`): fp32 (default), bf16, or int8 with a
scale per block of 32 values.

    >>> s = parse_pipeline_spec("1f1b:stages=4,layers=2/1/1/2")
    >>> s.schedule, s.stages, s.layers, s.text
    ('1f1b', 4, (2, 1, 1, 2), '1f1b:stages=4,layers=2/1/1/2')
"""

from __future__ import annotations

import dataclasses
import re

from thinwire.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
DEFAULT_VIRTUAL = 2  # interleaved: stages per rank (Megatron-LM's examples use 2 to 4)
ACTIVATIONS = ("fp32", "bf16", "int8")  # thinwire.pipeline.wire.CODECS
MAX_STAGES = 4096
_INT = re.compile(r"[0-9]{1,9}", re.ASCII)
_FIX = "E.g. --pipeline 1f1b:stages=4, gpipe:stages=2,microbatches=8, 1f1b:stages=3,layers=2/3/1; none to turn it off."


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """A parsed ``--pipeline``; ``schedule`` None is no pipeline. 0 in ``stages``/``microbatches``: the default."""

    schedule: str | None = None
    stages: int = 0
    microbatches: int = 0
    layers: tuple[int, ...] = ()
    activations: tuple[str, ...] = ("fp32",)
    recompute: bool = False
    virtual: int = 1                   # stages per rank: DEFAULT_VIRTUAL for interleaved, else 1

    def __post_init__(self) -> None:
        V = self.virtual
        if self.layers and self.stages:
            _check(len(self.layers) == self.stages * V, "layers", "/".join(map(str, self.layers)),
                   f"one layer count per stage ({self.stages * V}" + (f": {self.stages} ranks x {V} virtual)" if V > 1
                                                                      else ")"))
        if self.layers and V > 1:
            _check(len(self.layers) % V == 0, "layers", "/".join(map(str, self.layers)),
                   f"one layer count per stage: a multiple of virtual={V} (each rank holds {V})")
        known = (self.stages or len(self.layers) // V) * V
        if len(self.activations) > 1 and known:
            _check(len(self.activations) == known - 1, "activations", "/".join(self.activations),
                   f"one format, or one per link between the {known} stages ({known - 1})")

    def link_formats(self, stages: int) -> list[str]:
        """The activation format of each of the ``stages - 1`` links (``stages``: all of them, S x V)."""
        if len(self.activations) == 1:
            return list(self.activations) * (stages - 1)
        _check(len(self.activations) == stages - 1, "activations", "/".join(self.activations),
               f"one format, or one per link between the {stages} stages ({stages - 1})")
        return list(self.activations)

    @property
    def enabled(self) -> bool:
        return self.schedule is not None

    def stage_count(self, world: int) -> int:
        """Stages for a world size: the given count, one per layer count, or every rank one stage."""
        return self.stages or len(self.layers) // self.virtual or world

    @property
    def text(self) -> str:
        if not self.enabled:
            return "none"
        keys = [f"stages={self.stages}"] if self.stages else []
        keys += [f"microbatches={self.microbatches}"] if self.microbatches else []
        keys += ["layers=" + "/".join(map(str, self.layers))] if self.layers else []
        keys += ["activations=" + "/".join(self.activations)] if self.activations != ("fp32",) else []
        keys += ["recompute=on"] if self.recompute else []
        custom = self.schedule == "interleaved" and self.virtual != DEFAULT_VIRTUAL
        keys += [f"virtual={self.virtual}"] if custom else []
        return self.schedule + (":" + ",".join(keys) if keys else "")


def _check(cond: bool, key: str, value: object, allowed: str, fix: str = _FIX) -> None:
    if not cond:
        raise ConfigError(f"pipeline.{key}", value, allowed, fix)


def parse_pipeline_spec(text: str | None) -> PipelineSpec:
    """``SCHEDULE[:key=value,...]`` (or ``none``) to its :class:`PipelineSpec`; a mistake names the key and the fix."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "none"):
        return PipelineSpec()
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("pipeline", text, "none or one of " + ", ".join(SCHEDULES), _FIX)
    head, _, params = text.strip().partition(":")
    schedule = head.strip().lower()
    if schedule == "none":  # keys after none: a pipeline half turned off
        raise ConfigError("pipeline", text, "none alone, or a schedule (" + ", ".join(SCHEDULES) + ") with its keys",
                          "none turns the pipeline off and takes no keys: " + _FIX)
    _check(schedule in SCHEDULES, "schedule", head, "none or one of " + ", ".join(SCHEDULES))
    values: dict = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, sep, raw = (t.strip() for t in item.partition("="))
        _check(bool(sep) and key in ("stages", "microbatches", "layers", "activations", "recompute", "virtual"),
               "key", item, "stages=S, microbatches=M, layers=A/B/..., activations=fp32|bf16|int8, recompute=on|off "
               "or (interleaved) virtual=V (key=value, comma-separated)")
        _check(key not in values, key, text, "given once", f"Keep one {key}= in the spec.")
        if key == "recompute":
            _check(raw.lower() in ("on", "off"), "recompute", raw, "on or off",
                   "on recomputes each layer's activations in backward: less memory, one more forward.")
            values["recompute"] = raw.lower() == "on"
        elif key == "activations":
            parts = tuple(p.strip().lower() for p in raw.split("/"))
            _check(all(p in ACTIVATIONS for p in parts), "activations", raw,
                   "one of " + ", ".join(ACTIVATIONS) + ", or one per link separated by '/'",
                   "int8 sends a byte per value and a scale per row; bf16 two bytes per value.")
            values["activations"] = parts
        elif key == "layers":
            parts = raw.split("/")
            _check(all(_INT.fullmatch(p) and int(p) >= 1 for p in parts), "layers", raw,
                   "positive layer counts separated by '/', one per stage (e.g. 2/1/1)")
            values["layers"] = tuple(int(p) for p in parts)
        else:
            _check(bool(_INT.fullmatch(raw)) and 1 <= int(raw) <= MAX_STAGES * 64, key, raw,
                   f"a whole number from 1 to {MAX_STAGES if key == 'stages' else MAX_STAGES * 64}")
            values[key] = int(raw)
    _check(values.get("stages", 1) <= MAX_STAGES, "stages", values.get("stages"), f"at most {MAX_STAGES}")
    if schedule == "interleaved":
        values.setdefault("virtual", DEFAULT_VIRTUAL)
        _check(2 <= values["virtual"] <= 64, "virtual", values["virtual"], "2 to 64 stages per rank",
               "virtual=1 is 1f1b: use --pipeline 1f1b.")
    else:
        _check("virtual" not in values, "virtual", values.get("virtual"), "only with the interleaved schedule",
               "E.g. --pipeline interleaved:stages=4,virtual=2.")
    return PipelineSpec(schedule=schedule, **values)
