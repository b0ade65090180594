"""``auto``'s settings (:class:`AutoConfig`) and their spec string, ``auto:key=value,...``.

    >>> parse_auto_spec("auto:max_error=0.3,candidates=none|bf16|topk:ratio=0.01").candidates
    ('none', 'bf16', 'topk:ratio=0.01')
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from thinwire.compress.spec import default_candidates, parse_codec_spec
from thinwire.config import check
from thinwire.errors import ConfigError, ThinwireError
from thinwire.plan.choose import MAX_EF_ERROR


@dataclasses.dataclass(kw_only=True, frozen=True)
class AutoConfig:
    """What ``auto`` tries and when (the steps are described in :mod:`thinwire.auto`).

    ``candidates``: codec specs, light to strong, ``none`` included (default: the planner's,
    :func:`~thinwire.compress.spec.default_candidates`). ``warmup_steps``: steps of shadow runs
    before the ``baseline_steps`` that time the plan in use; then a check every ``check_every``
    steps. ``rebalance_change``: the relative move of the measured link rate that re-decides
    (seen at two checks in a row).
    ``max_error``: the accuracy cap (:data:`~thinwire.plan.choose.MAX_EF_ERROR`). ``min_gain``: how
    much faster the model must predict a new plan. ``keep_gain``, ``keep_p``, ``trial_windows``: a
    trial keeps a new plan if its steps are ``keep_gain`` faster at significance ``keep_p``, or by
    the medians after ``trial_windows`` windows. ``start``: the plan before the first decision
    (``""``: bf16 where it is a candidate, else none). ``guard``: a profile made by ``thinwire profile``
    of the same workload, whose convergence guard decides instead of ``max_error``: a lossy candidate
    it says does not reach fp32's loss (within 1% at equal samples) is never tried, one it says reaches is
    not held to the error cap; a candidate the profile has no guard record for keeps the cap
    (:attr:`verdicts`, read once here).
    """

    candidates: tuple[str, ...] = dataclasses.field(default_factory=default_candidates)
    warmup_steps: int = 3
    baseline_steps: int = 5
    check_every: int = 10
    rebalance_change: float = 0.3
    max_error: float = MAX_EF_ERROR
    min_gain: float = 0.10
    keep_gain: float = 0.05
    keep_p: float = 0.05
    trial_windows: int = 3
    start: str = ""
    guard: str = ""
    verdicts: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for c in self.candidates:  # an unknown codec first: it is why 'none' may seem missing (int8|foo)
            check(not c.endswith("@switch"), "auto.candidates", c, "codec specs (int8, not int8@switch)",
                  "Where the job has an aggregator on the switch (--aggregation switch), auto tries every int8 "
                  "candidate both around the ring and through the switch by itself.")
            check(bool(c), "auto.candidates", "|".join(self.candidates), "codec specs separated by |, none empty",
                  "E.g. auto:candidates=none|bf16|int8")
            parse_codec_spec(c)
        check("none" in self.candidates, "auto.candidates", "|".join(self.candidates),
              "a list that includes 'none', its codecs separated by | (auto:candidates=none|bf16|int8)",
              "auto falls back to none where no compressed candidate pays off.")
        if not self.start:
            object.__setattr__(self, "start", "bf16" if "bf16" in self.candidates else "none")
        check(self.start in self.candidates, "auto.start", self.start, f"one of the candidates ({'|'.join(self.candidates)})",
              "The codec sent before the first decision; bf16 or none.")
        self._check_steps()
        self._check_fractions()
        if self.guard:
            object.__setattr__(self, "verdicts", guard_verdicts(self.guard, self.candidates))

    def excluded(self) -> set[str]:
        """Lossy candidates the guard says do not reach fp32's loss: never tried."""
        return {c for c, reaches in self.verdicts.items() if reaches is False}

    def trusted(self) -> set[str]:
        """Lossy candidates the guard says reach fp32's loss: not held to ``max_error``."""
        return {c for c, reaches in self.verdicts.items() if reaches is True}

    def _check_steps(self) -> None:
        check(self.warmup_steps >= 1, "auto.warmup_steps", self.warmup_steps, "an integer >= 1")
        check(self.baseline_steps >= 0, "auto.baseline_steps", self.baseline_steps, "an integer >= 0",
              "0 decides at the warm-up's end, timing the first trial against the warm-up's steps.")
        check(self.check_every >= 1, "auto.check_every", self.check_every, "an integer >= 1")
        check(self.trial_windows >= 1, "auto.trial_windows", self.trial_windows, "an integer >= 1",
              "1 judges a trial on its first window alone.")

    def _check_fractions(self) -> None:
        check(0 < self.rebalance_change < 10, "auto.rebalance_change", self.rebalance_change, "a fraction > 0")
        check(self.max_error > 0, "auto.max_error", self.max_error, "a relative error > 0")
        check(0 <= self.min_gain < 1, "auto.min_gain", self.min_gain, "a fraction in [0, 1)")
        check(-1 < self.keep_gain < 1, "auto.keep_gain", self.keep_gain, "a fraction in (-1, 1)")
        check(0 < self.keep_p <= 1, "auto.keep_p", self.keep_p, "a probability in (0, 1]",
              "1 keeps any trial whose median step is keep_gain faster, however noisy.")


def load_guard_profile(path: str, field: str, make: str):
    """The profile at ``path`` for a convergence guard's verdicts; a missing or unreadable file is refused
    naming ``field``, with ``make`` saying how to make one."""
    from thinwire.measure.file import load_profile

    if not Path(path).is_file():
        raise ConfigError(field, path, "the path of an existing profile", f"No such file. {make}")
    try:
        return load_profile(path, flag=None)
    except ThinwireError as e:
        raise ConfigError(field, path, "a profile written by `thinwire profile`", f"{str(e).rstrip('.')}. {make}") from None


def guard_verdicts(path: str, candidates: tuple[str, ...]) -> dict[str, bool | None]:
    """Each lossy candidate's verdict in the profile at ``path`` (True: reaches fp32's loss; False: does
    not; None: the profile has no guard record for it). A profile with no guard at all is refused."""
    from thinwire.compress.spec import spec_string

    make = "Make one with `thinwire profile --workload W --out P` (the convergence guard is on by default)."
    profile = load_guard_profile(path, "auto.guard", make)
    records = {spec_string(parse_codec_spec(name)): c.convergence for name, c in profile.codecs.items()}
    if not any(r is not None for r in records.values()):
        raise ConfigError("auto.guard", path, "a profile with the convergence guard's records",
                          f"This one was made with --guard-steps 0. {make}")
    out: dict[str, bool | None] = {}
    for c in candidates:
        if c != "none" and not parse_codec_spec(c).lossless:
            r = records.get(spec_string(parse_codec_spec(c)))
            out[c] = None if r is None else r.reaches
    return out


def parse_auto_spec(spec: str) -> AutoConfig:
    """``"auto"`` or ``"auto:max_error=0.3,check_every=20,candidates=none|bf16|topk:ratio=0.01"``.

    ``candidates`` are separated by ``|`` (a candidate's own parameters keep their ``:``/``=``;
    only one parameter per candidate fits this syntax).
    """
    name, _, rest = spec.partition(":")
    if name.strip().lower() != "auto":
        raise ConfigError("compression", spec, "auto or auto:key=value,...")
    fields = {f.name: f.type for f in dataclasses.fields(AutoConfig) if f.init}
    kwargs: dict[str, Any] = {}
    for item in _split_top(rest):
        key, eq, value = (t.strip() for t in item.partition("="))
        if not eq or key not in fields:
            raise ConfigError("auto parameter", item, f"key=value with key one of {', '.join(fields)}")
        kwargs[key] = _value(key, value, fields[key])
    return AutoConfig(**kwargs)


def _value(key: str, value: str, kind) -> Any:
    """One ``key=value`` of the spec, typed as :class:`AutoConfig`'s field ``key``."""
    if key == "candidates":
        return tuple(v.strip() for v in value.split("|"))
    if key in ("start", "guard"):
        return value
    number = int if kind in (int, "int") else float
    try:
        return number(value)
    except ValueError:
        raise ConfigError(f"auto.{key}", value, "an integer" if number is int else "a number",
                          f"E.g. auto:{key}={getattr(AutoConfig(), key)}.") from None


def _split_top(rest: str) -> list[str]:
    """Split ``a=1,candidates=none|topk:ratio=0.01,b=2`` on the commas between auto's own keys."""
    names = {f.name for f in dataclasses.fields(AutoConfig) if f.init}
    items: list[str] = []
    for piece in (p for p in rest.split(",") if p.strip()):
        if items and piece.partition("=")[0].strip() not in names:
            items[-1] += "," + piece
        else:
            items.append(piece)
    return items
