"""Typed configs: dataclasses validated field by field, loaded from YAML or dicts, with overrides.

Each component owns its config dataclass (``TrainConfig`` in train/, ``ClusterSpec`` in cluster/,
...). This module only knows how to turn plain data into such a dataclass and back:

* unknown keys are rejected, listing the known ones;
* each value is checked against the field's annotation (``int``, ``float``, ``str``, ``bool``,
  ``X | None``, ``Literal[...]``, nested dataclasses, ``list[...]``);
* range checks live in the dataclass's own ``__post_init__`` and raise :class:`ConfigError`.

Example::

    >>> @dataclass(kw_only=True)
    ... class Opt:
    ...     lr: float = 1e-3
    >>> from_dict(Opt, {"lr": 0.1}, where="optim")
    Opt(lr=0.1)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from thinwire.errors import ConfigError, ThinwireError

T = TypeVar("T")


def from_dict(cls: type[T], data: Any, *, where: str) -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types; ``where`` prefixes field names."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where, data, "a mapping of field: value")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}" if where else str(unknown[0]), data[unknown[0]],
            f"one of the known fields ({', '.join(sorted(fields))})", "Remove or rename the key.",
        )
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, field: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(a, value, field)
            except ConfigError as e:
                errors.append(e.allowed)
        raise ConfigError(field, value, " or ".join(errors) + (" or null" if type(None) in args else ""))
    if origin is Literal:
        if value not in args:
            raise ConfigError(field, value, "one of " + ", ".join(repr(a) for a in args))
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(field, value, f"a list of {_name(args[0]) if args else 'values'}")
        items = [_coerce(args[0], v, f"{field}[{i}]") for i, v in enumerate(value)] if args else list(value)
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(field, value, "a mapping")
        return {str(k): _coerce(args[1], v, f"{field}.{k}") if args else v for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else from_dict(tp, value, where=field)
    return _scalar(tp, value, field)


def _scalar(tp: Any, value: Any, field: str) -> Any:
    if tp is Any:
        return value
    if tp is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(field, value, "a mapping")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(field, value, "true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(field, value, "an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(field, value, "a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(field, value, "a string")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(field, value, "a path")
    raise TypeError(f"config field {field}: unsupported annotation {tp!r}")  # a bug, not user input


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def to_dict(obj: Any) -> Any:
    """Plain data (for YAML/JSON) from a config dataclass, recursively; Paths become strings."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def load_yaml(path: str | Path, *, what: str = "config file") -> dict:
    """Read a YAML mapping, turning a missing file or a syntax error into a clear error."""
    p = Path(path)
    if not p.is_file():
        raise ThinwireError(f"{what} {str(p)!r} does not exist or is not a file. Pass the path of a YAML file.")
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ThinwireError(f"{what} {str(p)!r} is not valid YAML: {e}".strip()) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ThinwireError(f"{what} {str(p)!r} must hold a mapping of field: value, got {type(data).__name__}.")
    return data


def check(cond: bool, field: str, value: object, allowed: str, fix: str = "") -> None:
    """Raise :class:`ConfigError` unless ``cond``; the one-liner used by ``__post_init__`` checks."""
    if not cond:
        raise ConfigError(field, value, allowed, fix)
