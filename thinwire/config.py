"""Typed configs: dataclasses validated field by field, loaded from YAML or dicts, with overrides.

Each component owns its config dataclass (``TrainConfig`` in train/, ``ClusterSpec`` in cluster/,
...). This module only knows how to turn plain data into such a dataclass and back:

* unknown keys are rejected, listing the known ones;
* each value is checked against the field's annotation (``int``, ``float``, ``str``, ``bool``,
  ``X | None``, ``Literal[...]``, nested dataclasses, ``list[...]``);
* range checks live in the dataclass's own ``__post_init__`` and raise :class:`ConfigError`.

Example::

    >>> from dataclasses import dataclass
    >>> @dataclass(kw_only=True)
    ... class Opt:
    ...     lr: float = 1e-3
    >>> from_dict(Opt, {"lr": 0.1}, where="optim")
    Opt(lr=0.1)
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

from thinwire.errors import MISSING, ConfigError, ThinwireError, cannot_write, short

T = TypeVar("T")


def from_dict(cls: type[T], data: Any, *, where: str) -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types; ``where`` prefixes field names,
    also those of the errors ``cls.__post_init__`` raises (``hosts`` -> ``plan.chosen.hosts``)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where or "config", data, "a mapping of field: value")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            _join(where, unknown[0]), data[unknown[0]],
            f"one of the known fields ({', '.join(sorted(fields))})", "Remove or rename the key.",
        )
    for name in _required(fields):
        if name not in data:
            raise ConfigError(_join(where, name), MISSING, f"set ({_name(hints[name])})", "Add the field.")
    kwargs = {k: _coerce(hints[k], v, _join(where, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.within(where) from None


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _required(fields: dict[str, dataclasses.Field]) -> list[str]:
    return [n for n, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _coerce(tp: Any, value: Any, field: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and not _is_scalar(inner[0]):  # X | None: X's own error names the inner field
            return _coerce(inner[0], value, field)
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# annotation -> (accepts the value, what is allowed, the value as the field holds it)
_SCALARS: dict[Any, tuple[Any, str, Any]] = {
    Any: (lambda v: True, "", lambda v: v),
    dict: (lambda v: isinstance(v, dict), "a mapping", lambda v: v),
    bool: (lambda v: isinstance(v, bool), "true or false", lambda v: v),
    int: (lambda v: _is_int(v) and abs(v) < 2**63, "an integer", lambda v: v),
    float: (lambda v: (_is_int(v) or isinstance(v, float)) and _finite(v), "a finite number", float),
    str: (lambda v: isinstance(v, str), "a string", lambda v: v),
    Path: (lambda v: isinstance(v, (str, Path)), "a path", Path),
}


def _scalar(tp: Any, value: Any, field: str) -> Any:
    if tp not in _SCALARS:
        raise TypeError(f"config field {field}: unsupported annotation {tp!r}")  # a bug, not user input
    accepts, allowed, convert = _SCALARS[tp]
    if accepts(value):
        return convert(value)
    fix = ""
    if tp is str and isinstance(value, dict) and field in SPEC_EXAMPLES:  # a spec's keys written as a mapping
        ex = SPEC_EXAMPLES[field]
        fix = (f"A {field} spec is one string, its keys after a colon: {field}: '{ex}' in a config file, "
               f"--{field} {ex} or --set {field}={ex} on the command line.")
    raise ConfigError(field, value, "an integer of 64 bits" if tp is int and _is_int(value) else allowed, fix)


# fields that hold a spec string (``NAME:key=value,...``), with an example each
SPEC_EXAMPLES = {"pipeline": "1f1b:stages=2,microbatches=8", "sync": "local:period=8",
                 "compression": "int8:block=256", "partition": "label_skew:alpha=0.5"}


def _is_scalar(tp: Any) -> bool:
    return tp in _SCALARS and tp is not dict


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


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


def check_range(field: str, value: Any, lo: float, hi: float, *, kind: str = "a number",
                open_lo: bool = False, fix: str = "") -> None:
    """Raise :class:`ConfigError` unless ``value`` is a finite number in ``[lo, hi]`` (``(lo, hi]`` with
    ``open_lo``); ``None`` passes (optional fields). The message states the range::

        >>> check_range("lr", float("inf"), 0, 10, open_lo=True)
        Traceback (most recent call last):
        thinwire.errors.ConfigError: lr: must be a finite number in (0, 10], got inf
    """
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    ok = ok and (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        kind = kind if kind != "a number" else "a finite number"
        raise ConfigError(field, value, f"{kind} in {'(' if open_lo else '['}{_fmt(lo)}, {_fmt(hi)}]", fix)


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def check(cond: bool, field: str, value: object, allowed: str, fix: str = "") -> None:
    """Raise :class:`ConfigError` unless ``cond``; the one-liner used by ``__post_init__`` checks."""
    if not cond:
        raise ConfigError(field, value, allowed, fix)


# -- the one YAML reader ----------------------------------------------------------------------------
MAX_DEPTH = 64                 # nested mappings/lists; PyYAML's composer recurses and fails near 1,000
MAX_FILE_BYTES = 8 * 2**20     # the largest plan or profile thinwire writes is well under 1 MiB
MAX_INT_DIGITS = 100           # an integer longer than this is a mistake (int64 has 19 digits)
_NULL = re.compile(r"(?:~|null|Null|NULL|)\Z", re.ASCII)
_BOOL = re.compile(r"(?:true|True|TRUE|false|False|FALSE)\Z", re.ASCII)
_INT = re.compile(r"(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)\Z", re.ASCII)
_FLOAT = re.compile(r"(?:[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN))\Z",
                    re.ASCII)
_CORE_SCHEMA = [  # YAML 1.2 core schema: https://yaml.org/spec/1.2.2/#1032-tag-resolution
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", _BOOL, list("tTfF")),
    ("tag:yaml.org,2002:int", _INT, list("-+0123456789")),
    ("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789")),
]


_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "str", "seq", "map")}


class _YamlRefused(Exception):
    """Raised inside the loader; :func:`parse_yaml` turns it into a :class:`ConfigError`."""

    def __init__(self, value: object, allowed: str, fix: str = "") -> None:
        super().__init__(allowed)
        self.value, self.allowed, self.fix = value, allowed, fix


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader read as YAML 1.2 (``1e-3`` a number, ``off`` and ``1:30`` strings), with
    no aliases, bounded nesting, string keys only and integers of at most ``MAX_INT_DIGITS`` digits."""

    yaml_implicit_resolvers: dict = {}
    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _YamlRefused(self.peek_event().anchor, "written without aliases (*name)",
                               "Write the value out instead of referring to an anchor.")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _YamlRefused(f"{self.depth} levels", f"at most {MAX_DEPTH} levels of nesting")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag != "tag:yaml.org,2002:str":
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else key_node.tag
                raise _YamlRefused(shown, "a mapping with string keys",
                                   "Quote the key, e.g. '1': value.")
            if key_node.value in seen:  # YAML says keys are unique; PyYAML would keep the last one silently
                raise _YamlRefused(key_node.value, "a mapping whose keys are unique",
                                   f"The key appears twice (the second at line {key_node.start_mark.line + 1}); "
                                   "keep one.")
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node, deep=False):
        if node.tag not in _PLAIN_TAGS:
            raise _YamlRefused(node.tag, "plain values, lists and mappings", "Remove the explicit !!tag.")
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. !!int "x"
            raise _YamlRefused(getattr(node, "value", node.tag), f"a value of type {node.tag}") from e


def _construct_int(loader: _Loader, node) -> int:
    text = loader.construct_scalar(node)
    if len(text) > MAX_INT_DIGITS:
        raise _YamlRefused(text, f"an integer of at most {MAX_INT_DIGITS} digits")
    base = 8 if text.startswith("0o") else 16 if text.startswith("0x") else 10
    return int(text[2:] if base != 10 else text, base)


def _construct_float(loader: _Loader, node) -> float:
    text = loader.construct_scalar(node).lower()
    if text.endswith((".inf", ".nan")):
        return float(text.replace(".", ""))
    return float(text)


for _tag, _regex, _first in _CORE_SCHEMA:
    _Loader.add_implicit_resolver(_tag, _regex, _first)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that YAML 1.1 *or* 1.2 would read as something else (``1e-3``, ``0o7``),
    and writes shared objects out in full (the reader refuses aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


for _tag, _regex, _first in _CORE_SCHEMA:
    _Dumper.add_implicit_resolver(_tag, _regex, _first)


def parse_yaml(text: str | bytes, *, what: str) -> Any:
    """Plain data from YAML text, by the rules of :class:`_Loader`; any problem is a
    :class:`ConfigError` naming ``what`` (``config file 'run.yaml'``, ``--set lr``)."""
    if isinstance(text, bytes):
        text = _decode(text, what)
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(what, f"{len(text)} characters", f"at most {MAX_FILE_BYTES} characters")
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except _YamlRefused as e:
        raise ConfigError(what, e.value, e.allowed, e.fix) from None
    except yaml.YAMLError as e:
        raise ConfigError(what, _where(e), "valid YAML", f"{_problem(e)} Fix that line.") from None


def _decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(what, data[e.start:e.start + 8], "UTF-8 text",
                          f"Byte {e.start} is not UTF-8; save the file as UTF-8.") from None


def _where(e: yaml.YAMLError) -> str:
    """Where the parser found the problem (1-based, as editors count), short enough to be shown whole."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "its text"


def _problem(e: yaml.YAMLError) -> str:
    """The parser's own words: what it was parsing and what it found there."""
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    text = "; ".join(p for p in parts if p) or " ".join(str(e).split())[:200]
    return text[0].upper() + text[1:] + "."


def parse_value(text: str, *, what: str) -> Any:
    """One value given on the command line (``--set KEY=VALUE``): YAML 1.2 by :func:`parse_yaml`'s
    rules, empty text as ``None``, and text that is not valid YAML (``a: b``) as itself."""
    if not text.strip():
        return None
    try:
        return parse_yaml(text, what=what)
    except ConfigError as e:
        if e.allowed == "valid YAML":
            return text
        raise


def dump_yaml(data: Any) -> str:
    """YAML text that :func:`parse_yaml` reads back to ``data`` (strings quoted where needed)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120)


def load_yaml(path: str | Path, *, what: str = "config file") -> dict:
    """Read a YAML mapping from a file: a missing file, a file over ``MAX_FILE_BYTES``, bytes that
    are not UTF-8 and anything :func:`parse_yaml` refuses are clear errors."""
    p = Path(path)
    if not p.is_file():
        raise ThinwireError(f"{what} {short(str(p))} does not exist or is not a file. Pass the path of a YAML file.")
    label = f"{what} {short(str(p))}"
    if p.stat().st_size > MAX_FILE_BYTES:
        raise ConfigError(label, f"{p.stat().st_size} bytes", f"at most {MAX_FILE_BYTES} bytes")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ThinwireError(f"{label} could not be read ({e.strerror or e}). Pass a readable YAML file.") from None
    data = parse_yaml(raw, what=label)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(label, type(data).__name__, "a mapping of field: value")
    return data


def save_yaml(obj: Any, path: str | Path) -> Path:
    """Write config dataclass ``obj`` as YAML, atomically: a temporary file in the same folder, then a
    rename, so a crash leaves the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(dump_yaml(to_dict(obj)))
        tmp.replace(path)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise cannot_write(path, e) from None
    return path


def check_writable(path: str | Path, field: str, *, folder: bool, inputs: dict[str, str | None] | None = None,
                   kind: tuple[str, tuple[str, ...]] | None = None) -> None:
    """Refuse an output path that cannot be written before any work is done for it (a profile that took
    minutes, lost to a typo in ``--out``): the nearest folder that exists on the way to it must take a
    new file (tried with a temporary one, which is gone at once), and a file's path must not be a folder,
    nor one of the command's ``inputs`` (flag: path), which writing it would replace. ``kind``: ``(what, keys)``
    of the file the command writes; an existing file is replaced only if it is such a file (a YAML mapping with
    those keys: an earlier plan, say), never another (a run's config.yaml)."""
    import tempfile

    path = Path(path)
    for flag, given in (inputs or {}).items():
        if given and Path(given).exists() and path.exists() and path.resolve() == Path(given).resolve():
            raise ConfigError(field, str(path), f"a file other than the {flag} input",
                              f"writing it would replace {flag} {short(str(given))}; name another file")
    if kind is not None and path.is_file() and not _is_kind(path, kind[1]):
        raise ConfigError(field, str(path), f"a new file, or a {kind[0]} to replace",
                          f"{short(str(path))} exists and is not a {kind[0]} thinwire wrote: writing would destroy it. "
                          "Name another file; nothing was changed.")
    if not folder and path.is_dir():
        raise ConfigError(field, str(path), "a file to write", f"{short(str(path))} is a folder; name a file in it, "
                          f"e.g. {path / 'out.yaml'}")
    base = path if folder else path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    why = "it is not a folder" if not base.is_dir() else None
    if why is None:
        try:
            tempfile.TemporaryFile(dir=base).close()
        except OSError as e:
            why = e.strerror or str(e)
    if why is not None:
        raise ConfigError(field, str(path), f"a {'folder' if folder else 'file'} that can be written",
                          f"{short(str(base))} cannot take new files ({why}); choose another path")


def check_outputs(folder: str | Path, names: tuple[str, ...], command: str, field: str = "--out",
                  *, theirs: tuple[str, ...] = ()) -> None:
    """Refuse a ``folder`` that holds a file named as one ``command`` writes there (``names``) unless thinwire
    wrote it: the folder carries ``command``'s marker (:func:`mark_outputs`, left by an earlier run of it) or
    one of ``theirs`` (a run's ``.thinwire-run``, where ``report`` puts its plots by default)."""
    folder = Path(folder)
    if not folder.is_dir() or any((folder / m).exists() for m in (f".thinwire-{command}", *theirs)):
        return
    clash = [n for n in names if (folder / n).exists()]
    if clash:
        raise ConfigError(field, str(folder), f"a new folder, or one `thinwire {command}` wrote before",
                          f"it holds {', '.join(clash)}, which `thinwire {command}` would replace and cannot tell it "
                          f"wrote (the folder has no .thinwire-{command} marker{', nor is it a run' if theirs else ''}). "
                          f"Name another folder with {field}, or move the file{'s' if len(clash) > 1 else ''} away "
                          "if they are an older thinwire's; nothing was changed.")


def mark_outputs(folder: str | Path, command: str) -> None:
    """Mark ``folder`` as written by ``command`` (a later run of it may replace its files: :func:`check_outputs`)."""
    (Path(folder) / f".thinwire-{command}").touch()


def new_folder(base: str | Path) -> Path:
    """A folder of its own at ``base``, or ``base-2``, ``base-3``, ... where that exists (a default folder named
    by the second: a script's two runs in the same second would share it); created, so no other run takes it."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, 10_000):
        path = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ThinwireError(f"out: {base} and 9,998 numbered folders beside it exist; name one with --out")


def _is_kind(path: Path, keys: tuple[str, ...]) -> bool:
    """Whether ``path`` is a YAML mapping with every one of ``keys`` (a file of the kind thinwire writes)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return False
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and all(k in data for k in keys)


def load_dataclass(cls: type[T], path: str | Path, *, what: str, make: str) -> T:
    """A ``cls`` read and checked from YAML file ``path``; a missing file says how to ``make`` one."""
    if Path(path).is_dir():
        raise ThinwireError(f"{what}: {short(str(path))} is a folder, not a file. Pass the file itself. {make}")
    if not Path(path).is_file():
        raise ThinwireError(f"{what}: file {short(str(path))} does not exist. {make}")
    data = load_yaml(path, what=what)
    check_kind(data, cls, path, what=what, fix=f"Pass the file a {what} was written to.")
    return from_dict(cls, data, where=what)


def check_kind(data: Any, cls: type, path: str | Path, *, what: str, fix: str) -> None:
    """Refuse ``data`` (read from ``path``) that is another kind of file than a ``cls`` (a profile given as a
    cluster spec, a plan as a profile): a required field missing and mostly keys ``cls`` does not have. A file
    of the right kind with a misspelt key goes on to the field-by-field check, which names the key."""
    if not isinstance(data, dict) or not data:
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known, missing = set(data) & set(fields), [k for k in _required(fields) if k not in data]
    if missing and len(known) < len(data) - len(known):
        raise ThinwireError(f"{what}: {short(str(path))} is not a {what}: it lacks {', '.join(missing[:4])} and holds "
                            f"{', '.join(sorted(str(k) for k in data if k not in fields)[:4])}, keys no {what} has. "
                            + fix)
