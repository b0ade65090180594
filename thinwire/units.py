"""Numbers with units, as cluster specs, flags and configs write them: rates, sizes, durations, loss.

One parser per quantity, used by every file and flag that takes one (cluster specs, ``--memory-budget``,
``thinwire cluster --sizes``), so ``512MiB`` means the same everywhere. Each refuses a value it
cannot read, a non-finite one and one out of range with a :class:`~thinwire.errors.ConfigError` that
names the field, the value and the units.

    >>> parse_size("512MiB", "memory"), parse_size("800M", "memory"), parse_rate("100mbit", "bandwidth")
    (536870912, 838860800, 100000000.0)
"""

from __future__ import annotations

import math
import re

from thinwire.config import check
from thinwire.errors import ConfigError

_RATE_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}  # a bare letter: binary, as `ls -h` and torch write it
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%/]*)\s*", re.IGNORECASE | re.ASCII)
MAX_RATE_BPS = 1e13        # 10 Tbit/s
MIN_RATE_BPS = 1e3         # 1 kbit/s; tc cannot shape much below it
MAX_BYTES = 2**60          # 1 EiB
MAX_DURATION_S = 3600.0    # a link latency over an hour is a typo


def _split(text: str) -> tuple[float, str] | None:
    m = _NUMBER.fullmatch(text) if len(text) <= 100 else None
    return (float(m.group(1)), m.group(2).lower()) if m else None


def _number(value: float | str, unit: str) -> tuple[float, str] | None:
    """``(number, unit)`` from a plain number (in ``unit``) or a string such as ``"100mbit"``; None
    when neither, or when the number is not finite."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        parts = (float(value), unit) if abs(value) < 1e300 else None
    else:
        parts = _split(value) if isinstance(value, str) else None
    return parts if parts and math.isfinite(parts[0]) else None


_PREFIXES = {"k": "kilo", "m": "mega", "g": "giga", "t": "tera"}


def parse_rate(value: float | str, field_name: str) -> float:
    """``"100mbit"`` -> ``1e8`` bit/s; plain numbers are bit/s. Must be > 0."""
    allowed = "a rate > 0 such as 500kbit, 100mbit, 1gbit or a number of bit/s"
    parts = _number(value, "")
    if parts is None or parts[1] not in _RATE_UNITS:
        negative = isinstance(value, str) and value.strip().startswith("-")
        fix = _rate_hint(value) if parts else ("A link needs a positive rate." if negative else
                                               "Use the units bit, kbit, mbit, gbit.")
        raise ConfigError(field_name, value, allowed, fix)
    rate = parts[0] * _RATE_UNITS[parts[1]]
    check(rate > 0, field_name, value, allowed, "A link needs a positive rate.")
    check(MIN_RATE_BPS <= rate <= MAX_RATE_BPS, field_name, value, "a rate in [1kbit, 10tbit]")
    return rate


def _rate_hint(value: str) -> str:
    """How to write a rate given in another unit, in the value's own number and prefix.

    >>> _rate_hint("100mbps")
    "tc reads 'mbps' as megabytes per second; write 800mbit for 100 MB/s (100mbit for 100 Mbit/s)."
    >>> _rate_hint("100 Mbit/s"), _rate_hint("12.5MB/s"), _rate_hint("1gbits")
    ('Write 100mbit for 100 Mbit/s.', 'Write 100mbit for 12.5 MB/s.', 'Write 1gbit for 1 Gbit/s.')
    """
    m = _NUMBER.fullmatch(value.strip()) if len(value) <= 100 else None
    n, unit = float(m.group(1)), m.group(2)
    for tail in ("bits/s", "bit/s", "bits", "bps", "b/s"):
        p = unit[:-len(tail)].lower()
        if unit.lower().endswith(tail) and p in ("", *_PREFIXES):
            break
    else:
        return "Use the units bit, kbit, mbit, gbit."
    bits = f"{n:g}{p}bit for {n:g} {p.upper()}bit/s"
    if tail == "bps":
        return (f"tc reads '{p}bps' as {_PREFIXES.get(p, '')}bytes per second; write {8 * n:g}{p}bit for {n:g} "
                f"{p.upper()}B/s ({bits}).")
    if tail == "b/s" and unit[-3] == "B":  # MB/s: bytes
        rate = 8 * n * (_RATE_UNITS[p + "bit"] if p else 1)
        q = next(q for q in ("t", "g", "m", "k", "") if rate >= _RATE_UNITS[q + "bit"] or not q)
        return f"Write {rate / _RATE_UNITS[q + 'bit']:g}{q}bit for {n:g} {p.upper()}B/s."
    return f"Write {bits}."


def parse_size(value: int | str, field_name: str = "size") -> int:
    """``"512MiB"`` -> ``536870912`` bytes; plain numbers are bytes; ``K``, ``M``, ``G``, ``T`` alone are
    binary. Must be in (0, 1 EiB]."""
    allowed = "a size > 0 such as 512MiB, 2GiB, 1GB or a number of bytes"
    parts = _number(value, "")
    if parts is None or parts[1] not in _SIZE_UNITS:
        raise ConfigError(field_name, value, allowed, "Use the units KiB, MiB, GiB, TiB (or KB, MB, GB, TB).")
    size = parts[0] * _SIZE_UNITS[parts[1]]
    check(0 < size <= MAX_BYTES, field_name, value, "a size in (0, 1048576TiB] such as 512MiB, 2GiB or 1GB")
    size = int(size)
    check(size > 0, field_name, value, allowed)
    return size


def parse_duration(value: float | str, field_name: str) -> float:
    """``"5ms"`` -> ``0.005`` s; plain numbers are seconds. Must be >= 0."""
    parts = _number(value, "s")
    seconds = parts[0] * _TIME_UNITS[parts[1]] if parts and parts[1] in _TIME_UNITS else -1.0
    check(0 <= seconds <= MAX_DURATION_S, field_name, value,
          "a duration in [0, 1 hour] such as 5ms, 200us or 0.1s")
    return seconds


def parse_loss(value: float | str, field_name: str) -> float:
    """``"0.1%"`` -> ``0.001``; plain numbers are fractions. Must be in [0, 1)."""
    allowed = "a loss rate in [0, 1) or a percentage such as 0.1%"
    parts = _number(value, "")
    if parts is None or parts[1] not in ("", "%"):
        raise ConfigError(field_name, value, allowed)
    loss = parts[0] / 100 if parts[1] == "%" else parts[0]
    check(0 <= loss < 1, field_name, value, allowed)
    return loss
