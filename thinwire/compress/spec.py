"""Codec spec strings: ``"name"`` or ``"name:key=value,key=value"`` to a configured codec, and back.

Grammar: ``name[:key=value[,key=value]...]``; spaces around tokens are ignored. Values are read
with the type of the codec config's field: ``int`` (``64``, ``1_000_000``, ``1e6``), ``float``,
``bool`` (``true``/``false``/``1``/``0``), ``X | None`` (``none``/``null``). Every mistake raises
:class:`~thinwire.errors.ConfigError` naming what is allowed::

    >>> parse_codec_spec("topk:ratio=0.01,approx=true")
    TopKCodec(TopKConfig(ratio=0.01, approx=True, approx_threshold=1000000, sample_size=10000))
    >>> spec_string(parse_codec_spec("int8:block=64"))
    'int8:block=64'
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from enum import Enum
from collections.abc import Mapping
from typing import Any, get_args, get_origin, get_type_hints

from thinwire.compress.codecs import (
    BfpCodec, Bf16Codec, Codec, Fp16Codec, Int8Codec, NoneCodec, PowerSGDCodec, QsgdCodec,
    RandomKCodec, SignCodec, TopKCodec,
)
from thinwire.config import from_dict
from thinwire.errors import ConfigError


class CodecName(str, Enum):
    """The built-in codecs' user-facing names (more can be added with :func:`register_codec`)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    BFP = "bfp"
    QSGD = "qsgd"
    TOPK = "topk"
    RANDOMK = "randomk"
    SIGN = "sign"
    POWERSGD = "powersgd"


class CodecRegistry(Mapping):
    """Name -> codec class: the built-ins (keyed by :class:`CodecName`) then the registered ones.

    The one place a codec's name is looked up; everything else (the hook, the performance model,
    the planner, ``auto``, ``thinwire codecs``) asks it or the codec's traits.
    """

    def __init__(self, builtins: Mapping[CodecName, type[Codec]]) -> None:
        self._classes: dict[str, type[Codec]] = {n.value: c for n, c in builtins.items()}
        self._keys: dict[str, str | CodecName] = {n.value: n for n in builtins}

    def __getitem__(self, name: str) -> type[Codec]:
        return self._classes[str(getattr(name, "value", name))]

    def __iter__(self):
        return iter(self._keys.values())

    def __len__(self) -> int:
        return len(self._classes)

    def names(self) -> list[str]:
        return list(self._classes)

    def register(self, cls: type[Codec]) -> type[Codec]:
        """Add ``cls`` under ``cls.name`` (usable as a class decorator); the name must be new."""
        name = getattr(cls, "name", None)
        if not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise ValueError(f"a codec's name must match {_NAME.pattern}, got {name!r}")
        if name in self._classes or name in _RESERVED:
            raise ValueError(f"codec name {name!r} is taken; pick another name")
        if not (isinstance(cls, type) and issubclass(cls, Codec)):
            raise ValueError(f"register a Codec subclass, got {cls!r}")
        self._classes[name], self._keys[name] = cls, name
        return cls

    def unregister(self, name: str) -> None:
        """Remove a registered codec (built-ins stay)."""
        if name in CodecName._value2member_map_ or name not in self._classes:
            raise ValueError(f"{name!r} is not a registered (non-built-in) codec")
        del self._classes[name], self._keys[name]


REGISTRY = CodecRegistry({
    CodecName.NONE: NoneCodec,
    CodecName.FP16: Fp16Codec,
    CodecName.BF16: Bf16Codec,
    CodecName.INT8: Int8Codec,
    CodecName.BFP: BfpCodec,
    CodecName.QSGD: QsgdCodec,
    CodecName.TOPK: TopKCodec,
    CodecName.RANDOMK: RandomKCodec,
    CodecName.SIGN: SignCodec,
    CodecName.POWERSGD: PowerSGDCodec,
})
register_codec = REGISTRY.register

_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_RESERVED = ("auto", "torch")  # the other forms of a communication spec
_FORMAT = "name or name:key=value,key=value (e.g. 'int8:block=64')"
_TRUE, _FALSE, _NULL = ("true", "1"), ("false", "0"), ("none", "null")


def codec_class(name: str) -> type[Codec]:
    """The codec class registered under ``name``; an unknown name lists the codecs (the other forms of
    ``--compression`` are :mod:`thinwire.commspec`'s, which lists them all)."""
    try:
        return REGISTRY[name]
    except KeyError:
        valid = ", ".join(REGISTRY.names())
        fix = "`thinwire codecs` lists every codec's parameters and the other forms (auto, torch:*)."
        raise ConfigError("compression", name, f"one of {valid}", fix) from None


def default_candidates() -> tuple[str, ...]:
    """The specs the planner and ``auto`` try by default: every registered codec's ``candidate``,
    lossless first, then from the most bytes per value to the fewest (light to strong)."""
    specs = [c.candidate for c in REGISTRY.values() if c.candidate]

    def lightness(spec: str) -> tuple[bool, int]:
        codec = parse_codec_spec(spec)
        return not codec.lossless, -codec.payload_bytes(1 << 20)

    return tuple(sorted(specs, key=lightness))


def build_codec(name: str, params: Mapping[str, Any] | None = None) -> Codec:
    """A codec from its name and already-typed parameters (e.g. from a YAML mapping)."""
    cls = codec_class(name)
    params = dict(params or {})
    for key in params:
        _check_known(cls, key)
    return cls(from_dict(cls.config_cls, params, where=cls.name))


def parse_codec_spec(spec: str) -> Codec:
    """``"int8:block=64"`` to ``Int8Codec(Int8Config(block=64, ...))`` (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("compression", spec, _FORMAT)
    name, colon, rest = (part.strip() for part in spec.partition(":"))
    name = name.lower()  # "INT8" is fine; parameter names stay exact
    cls = codec_class(name)
    hints = get_type_hints(cls.config_cls)
    params: dict[str, Any] = {}
    for item in rest.split(",") if colon else []:
        key, value = _split_item(spec, item)
        _check_known(cls, key)
        if key in params:
            raise ConfigError(f"{name}.{key}", spec, "given once", "Remove the duplicate.")
        allowed = next(f.metadata.get("allowed", "") for f in dataclasses.fields(cls.config_cls) if f.name == key)
        params[key] = _from_text(hints[key], value, f"{name}.{key}", allowed,
                                 f"E.g. {name}:{key}={_text(_defaults(cls)[key])}.")
    return build_codec(name, params)


def _split_item(spec: str, item: str) -> tuple[str, str]:
    key, eq, value = (part.strip() for part in item.partition("="))
    if not eq or not key or not value:
        fix = f"Write each parameter as key=value, not {item.strip()!r}."
        raise ConfigError("compression", spec, _FORMAT, fix)
    return key, value


def _check_known(cls: type[Codec], key: str) -> None:
    known = _defaults(cls)
    if key in known:
        return
    field = f"{cls.name} parameter"
    if not known:
        raise ConfigError(field, key, "absent", f"{cls.name} takes no parameters: write just {cls.name!r}.")
    listing = ", ".join(f"{k}={_text(v)}" for k, v in known.items())
    first = next(iter(known))
    raise ConfigError(field, key, f"one of {listing}", f"E.g. {cls.name}:{first}={_text(known[first])}.")


def _from_text(tp: Any, text: str, field: str, allowed: str = "", example: str = "") -> Any:
    """The value of ``text`` for a field annotated ``tp`` (``from_dict`` then checks ranges); ``allowed``, the
    field's range as ``thinwire codecs`` lists it, goes in the error."""
    optional = get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)
    if optional:
        if text.lower() in _NULL:
            return None
        (tp,) = [a for a in get_args(tp) if a is not type(None)]
    read, kind = _READERS[tp]
    try:
        return read(text)
    except ValueError:
        if allowed and tp is not bool:  # true or false says it all
            kind += f" ({allowed})"
        raise ConfigError(field, text, kind + (" or none" if optional else ""), example) from None


def _bool(text: str) -> bool:
    if text.lower() in _TRUE + _FALSE:
        return text.lower() in _TRUE
    raise ValueError(text)


_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*", re.ASCII)  # ASCII only: int() also reads '٣'
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:_[0-9]+)*\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def _int(text: str) -> int:
    if len(text) > 40:  # longer than any integer a codec takes; int() of 4,300+ digits raises
        raise ValueError(text)
    if _INT_TEXT.fullmatch(text):
        return int(text)
    value = _float(text)  # "1e6"
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


def _float(text: str) -> float:
    if len(text) > 40 or not _FLOAT_TEXT.fullmatch(text):  # no 'nan', 'inf', '١.٥'
        raise ValueError(text)
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_READERS = {bool: (_bool, "true or false"), int: (_int, "an integer"), float: (_float, "a number")}


def _defaults(cls: type[Codec]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls.config_cls)}


def _text(value: Any) -> str:
    """A value as a spec string writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return repr(value) if isinstance(value, float) else str(value)  # repr: shortest exact float


def spec_string(codec: Codec) -> str:
    """The canonical spec of ``codec``: its name and the parameters that differ from the defaults,
    in field order, so that ``parse_codec_spec(spec_string(c))`` rebuilds an equal config."""
    changed = [
        f"{f.name}={_text(getattr(codec.config, f.name))}"
        for f in dataclasses.fields(codec.config)
        if getattr(codec.config, f.name) != f.default
    ]
    return codec.name + (":" + ",".join(changed) if changed else "")


def codec_help() -> str:
    """A table of codecs, their parameters with defaults and allowed values, for ``--help``.

    ``bytes/value`` is ``payload_bytes`` of a 2**20-element fp32 tensor over 2**20, at defaults.
    """
    lines = [f"{'codec':<10}{'bytes/value':<13}{'summable':<10}" + _row("parameter=default", "allowed", "meaning")]
    for name, cls in REGISTRY.items():
        per_value = f"{cls(cls.config_cls()).payload_bytes(1 << 20) / (1 << 20):.3g}"
        params = [_param_help(f) for f in dataclasses.fields(cls.config_cls)] or ["-"]
        lines.append(f"{cls.name:<10}{per_value:<13}{'yes' if cls.summable else 'no':<10}{params[0]}")
        lines += [" " * 33 + p for p in params[1:]]
    return "\n".join(lines) + f"\n\nSpec: {_FORMAT}."


def _param_help(f: dataclasses.Field) -> str:
    return _row(f"{f.name}={_text(f.default)}", f.metadata["allowed"], f.metadata["doc"])


def _row(param: str, allowed: str, doc: str) -> str:
    return f"{param:<26} {allowed:<24} {doc}"
