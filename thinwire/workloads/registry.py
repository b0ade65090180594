"""Workload names to builders, and loading a user's ``package.module:function``.

Built-in workloads own a config dataclass (the ``model:`` section of a run's config). A user's
workload is any importable function; the ``model:`` mapping is passed to it as keyword arguments,
and it returns a :class:`~thinwire.workloads.base.Workload`.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import math
import os
import random
import re
import sys
import traceback
from typing import Callable

import numpy as np
import torch

from thinwire.config import from_dict
from thinwire.errors import ConfigError, ThinwireError, short
from thinwire.workloads import charlm, digits
from thinwire.workloads.base import Workload


class WorkloadName(str, enum.Enum):
    CHARLM = "charlm"
    DIGITS = "digits"


BUILTIN: dict[WorkloadName, tuple[type, Callable]] = {
    WorkloadName.CHARLM: (charlm.CharLMConfig, charlm.build),
    WorkloadName.DIGITS: (digits.DigitsConfig, digits.build),
}


_USER = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)


def check_workload_name(name: str) -> None:
    """Fail at config time for a name that is neither built in nor ``package.module:function``
    (absolute, ASCII identifiers: ``':'`` and ``'.x:y'`` are refused here, not by importlib)."""
    if name in {w.value for w in WorkloadName} or _USER.fullmatch(name):
        return
    raise ConfigError(
        "workload", name, f"one of {', '.join(w.value for w in WorkloadName)} or package.module:function",
        "For your own model, pass e.g. --workload mypkg.train:make_workload.",
    )


def build_workload(name: str, options: dict, data: str | None) -> Workload:
    check_workload_name(name)
    if name in {w.value for w in WorkloadName}:
        cfg_cls, builder = BUILTIN[WorkloadName(name)]
        return builder(from_dict(cfg_cls, options, where="model"), data=data)
    return _build_user(name, options, data)


def _build_user(name: str, options: dict, data: str | None) -> Workload:
    module_name, _, func_name = name.partition(":")
    here = os.getcwd()
    if here not in sys.path:  # `--workload mywl:build` run from the folder that holds mywl.py, as `python -m` finds it
        sys.path.append(here)  # last: never in place of an installed module of the same name
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:  # argparse at import time reads thinwire's own arguments, and exits
        raise ThinwireError(f"workload: module {short(module_name)} exited as it was imported (SystemExit "
                            f"{short(e.code)}): a training script that parses its command line at import time reads "
                            "thinwire's arguments. Put that under `if __name__ == \"__main__\":`.") from None
    except ImportError as e:
        raise ThinwireError(f"workload: cannot import module {short(module_name)} ({short(str(e), 300)}). "
                            f"Check that it is on PYTHONPATH or in the current folder ({short(here, 200)}).") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed as it loaded: where, in one paragraph
        where = (f"{e.filename}:{e.lineno}" if isinstance(e, SyntaxError) else
                 "{0.filename}:{0.lineno}, in {0.name}".format(traceback.extract_tb(e.__traceback__)[-1]))
        raise ThinwireError(f"workload: module {short(module_name)} raised {type(e).__name__} as it was imported: "
                            f"{short(str(e), 300)} (at {where}). Import it in Python to see the whole traceback.") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        what = (f"has no function {short(func_name)}" if fn is None else
                f"has {short(func_name)} of type {type(fn).__name__}, not a function")
        raise ThinwireError(f"workload: module {short(module_name)} {what}; a workload is a function that returns a "
                            "thinwire.Workload.")
    kwargs = dict(options)
    if data is not None:
        params = inspect.signature(fn).parameters
        if "data" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ThinwireError(f"data: {name} takes no data argument, so --data {short(data)} would go unused. "
                                f"Give {func_name} a data=... parameter to read it, or leave --data out.")
        kwargs["data"] = data
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        takes = [n for n, p in inspect.signature(fn).parameters.items() if n != "data"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise ThinwireError(f"model: options {sorted(kwargs)} do not fit {name}: {e}; it takes "
                            f"{', '.join(takes) or 'no options'}.") from None
    # a workload that splits or shuffles its data with Python's or NumPy's global generator (scikit-learn's
    # train_test_split does) gets the same split in every process: seeded from torch's, which the caller seeded
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    try:
        wl = fn(**kwargs)
    except SystemExit as e:
        raise ThinwireError(f"workload: {name} exited (SystemExit {short(e.code)}) instead of returning a "
                            "thinwire.Workload.") from None
    except Exception as e:  # noqa: BLE001 - the user's own code: where it failed, in one paragraph
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ThinwireError(f"workload: {name}({', '.join(f'{k}={short(v)}' for k, v in kwargs.items())}) raised "
                            f"{type(e).__name__}: {str(e)[:300]} (at {where.filename}:{where.lineno}, in "
                            f"{where.name}). Call it in Python to see the whole traceback.") from None
    if not isinstance(wl, Workload):
        raise ThinwireError(f"workload: {name} must return a thinwire.Workload, got {type(wl).__name__}.")
    if wl.task not in ("lm", "classification", "regression"):
        raise ThinwireError(f"workload: {name}'s Workload has task={short(wl.task)}; it must be lm, classification or "
                            "regression (which validation metrics it reports).")
    _check_defaults(name, wl)
    if not any(p.requires_grad for p in wl.model.parameters()):
        raise ThinwireError(f"workload: {name}'s model has no trainable parameters (none, or every one with "
                            "requires_grad=False), so training would change nothing; give it a layer with weights, "
                            "or unfreeze some.")
    for field in ("train", "val"):
        data = getattr(wl, field)
        try:
            n = len(data)
        except TypeError:
            raise ThinwireError(f"workload: {name}'s {field} set has no len(); thinwire samples map-style datasets "
                                "(len and [i] -> (input, target)), e.g. a torch.utils.data.TensorDataset.") from None
        if n == 0:
            raise ThinwireError(f"workload: {name}'s {field} set is empty; give it at least one item "
                                f"({'training needs samples' if field == 'train' else 'validation reports its loss'}).")
        _check_pairs(name, field, data)
    return wl


def _check_defaults(name: str, wl: Workload) -> None:
    """The Workload's suggested steps, batch size and learning rate: the run's unless a flag says otherwise."""
    for field, ok, allowed, flag in (
            ("steps", isinstance(wl.steps, int) and not isinstance(wl.steps, bool) and wl.steps >= 1,
             "an integer >= 1", "--steps"),
            ("batch_size", isinstance(wl.batch_size, int) and not isinstance(wl.batch_size, bool) and wl.batch_size >= 1,
             "an integer >= 1", "--batch-size"),
            ("lr", isinstance(wl.lr, (int, float)) and not isinstance(wl.lr, bool) and math.isfinite(wl.lr) and wl.lr > 0,
             "a finite number > 0", "--lr")):
        if not ok:
            raise ThinwireError(f"workload: {name}'s Workload has {field}={short(getattr(wl, field))}; it must be "
                                f"{allowed} (the run's default, which {flag} overrides).")


def _check_pairs(name: str, field: str, data) -> None:
    """The trainer unpacks every batch as ``inputs, targets``: a set whose items are not pairs fails here, not
    as an unpacking error in every worker once training has started."""
    where = f"{field}.batch([0])" if hasattr(data, "batch") else f"{field}[0]"
    try:
        item = data.batch([0]) if hasattr(data, "batch") else data[0]
    except Exception as e:  # noqa: BLE001 - the user's dataset: any error, named
        raise ThinwireError(f"workload: {name}'s {where} raised {type(e).__name__}: {str(e)[:300]}; thinwire reads "
                            f"items by index 0..len-1.") from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        got = f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
        raise ThinwireError(f"workload: {name}'s {field} set gives {got} at {where}, where thinwire needs an "
                            "(input, target) pair; return (x, y) from __getitem__ (the input may itself be a tuple or "
                            "a dict of tensors).")


def model_defaults(name: str) -> dict:
    """The resolved ``model:`` options of a workload (for the run's saved config, and so that an option given at
    its default is the same model as one left out): a built-in's config, a user's ``module:function``'s keyword
    defaults of plain values (``data`` apart); ``{}`` where the module cannot be imported (its own error comes
    where it is built)."""
    from thinwire.config import to_dict

    if name in {w.value for w in WorkloadName}:
        return to_dict(BUILTIN[WorkloadName(name)][0]())
    module_name, _, func_name = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), func_name, None)
        params = inspect.signature(fn).parameters.items() if callable(fn) else ()
    except Exception:  # noqa: BLE001 - the user's module: building it says what is wrong
        return {}
    return {k: p.default for k, p in params if k != "data" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and isinstance(p.default, (bool, int, float, str))}
