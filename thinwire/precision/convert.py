"""Switch a model's compute precision in place: ``convert(model, "int8" | "bf16" | "fp32")``.

* ``int8``: every ``nn.Linear`` and every ``nn.Conv2d`` that is one matmul (``groups == 1``,
  zero padding) becomes :class:`~thinwire.precision.int8.Int8Linear` /
  :class:`~thinwire.precision.int8.Int8Conv2d` by a class swap of the same object, so its
  Parameters, hooks, weight tying, an optimizer built earlier and the state dict are unchanged.
* ``bf16``: the whole forward runs under ``torch.autocast(bfloat16)`` (a forward pre-hook enters
  it, a forward hook leaves it and casts floating outputs back to fp32), parameters stay fp32.
* ``fp32``: undoes either.

fp16 needs a loss scaler around backward and the optimizer step, which a module cannot hold:
use :class:`~thinwire.precision.runner.PrecisionRunner` ("fp16") instead.

Example::

    model = convert(model, "int8", scaling="rowwise", exclude=["head"])
    conversion_report(model)["swapped"]
    7
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging

import torch
from torch import nn

from thinwire.precision import attention
from thinwire.precision.int8 import Int8ComputeConfig, Int8Conv2d, Int8Linear, int8_conv_supported, to_float_, to_int8_
from thinwire.precision.runner import Precision, parse_precision

log = logging.getLogger("thinwire.precision")
_REPORT = "_thinwire_conversion"


@dataclasses.dataclass
class ConversionReport:
    mode: str
    swapped: list[str] = dataclasses.field(default_factory=list)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> why it stayed float

    def as_dict(self) -> dict:
        return {"mode": self.mode, "swapped": len(self.swapped), "layers": self.swapped, "kept_float": self.kept}


def convert(model: nn.Module, mode: str, *, scaling: str = "pow2", stochastic: bool = True,
            exclude: str | tuple[str, ...] | list[str] = (), quiet: bool = False) -> nn.Module:
    """Switch ``model`` to ``mode`` in place and return it; :func:`conversion_report` says what changed.

    ``exclude``: glob patterns of module names (``"head"``, ``"blocks.*.mlp.0"``; one pattern or a list) to
    leave in fp32 under int8; a pattern that matches no module is refused (a typo would convert everything).
    ``scaling`` and ``stochastic`` configure :class:`Int8ComputeConfig`. ``quiet``: say nothing of the layers
    converted (a trial's copy, which is not the model trained).
    """
    try:
        target = parse_precision(mode)
    except ValueError:
        target = None
    if target not in CONVERTERS:
        why = {"fp16": "fp16 needs a loss scaler: use PrecisionRunner('fp16', device).",
               "auto": "auto is chosen by trial: thinwire train --precision auto, or "
                       "thinwire.precision.choose_precision."}
        raise ValueError(f"convert: mode must be one of {', '.join(p.value for p in CONVERTERS)}, got {mode!r}. "
                         + why.get(getattr(target, "value", None), "E.g. convert(model, 'int8')."))
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)  # "head", not "h", "e", "a", "d"
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [pat for pat in exclude if not any(fnmatch.fnmatchcase(name, pat) for name in names)]
    if unmatched:
        raise ValueError(f"convert: exclude pattern {unmatched[0]!r} matches no module of the model; its modules are "
                         f"named like {', '.join(names[:6])}{', ...' if len(names) > 6 else ''} (glob patterns, "
                         "e.g. 'blocks.*.mlp.0')")
    _to_fp32(model)
    report = CONVERTERS[target](model, Int8ComputeConfig(scaling=scaling, stochastic=stochastic), exclude)
    setattr(model, _REPORT, report)
    if target is not Precision.FP32 and not quiet:
        n = len(report.swapped)
        # layers of kinds no converter takes (an LSTM, an embedding, a norm) compute in fp32: say which
        taken = set(report.swapped) | set(report.kept)
        others = sorted({type(m).__name__ for name, m in model.named_modules()
                         if name not in taken and not isinstance(m, (nn.Linear, nn.Conv2d))
                         and any(True for _ in m.parameters(recurse=False))})
        log.info("precision %s: %d layer%s converted%s%s", report.mode, n, "" if n == 1 else "s",
                 f", {len(report.kept)} kept in fp32" if report.kept else "",
                 f"; {', '.join(others)} compute in fp32" if others else "")
    return model


def conversion_report(model: nn.Module) -> dict:
    report = getattr(model, _REPORT, None)
    return report.as_dict() if report is not None else {"mode": "fp32", "swapped": 0, "layers": [], "kept_float": {}}


def _to_int8(model: nn.Module, cfg: Int8ComputeConfig, exclude: tuple[str, ...]) -> ConversionReport:
    report = ConversionReport("int8")
    for name, m in list(model.named_modules()):
        if not isinstance(m, (nn.Linear, nn.Conv2d)):
            continue
        why = _why_float(name, m, exclude)
        if why:
            report.kept[name] = why
            continue
        to_int8_(m, cfg)
        report.swapped.append(name or type(m).__name__)
    return report


def _why_float(name: str, m: nn.Module, exclude: tuple[str, ...]) -> str | None:
    if any(fnmatch.fnmatchcase(name, pat) for pat in exclude):
        return "excluded"
    if type(m) not in (nn.Linear, nn.Conv2d):
        return f"subclass {type(m).__name__} (its forward may differ)"
    if m.weight.dtype != torch.float32:
        return f"weight dtype {m.weight.dtype}"
    return int8_conv_supported(m) if isinstance(m, nn.Conv2d) else None


class _AutocastHooks:
    """Forward pre-hook enters ``torch.autocast``, forward hook leaves it and returns fp32 outputs."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self._stack = dtype, []

    def enter(self, module, args) -> None:
        device = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
        ctx = attention.autocast(device, self.dtype)
        ctx.__enter__()
        self._stack.append(ctx)

    def leave(self, module, args, output):
        self._stack.pop().__exit__(None, None, None)
        return _to_float32(output)


def _to_float32(out):
    if torch.is_tensor(out):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, (tuple, list)):
        return type(out)(_to_float32(o) for o in out)
    return out


def _to_bf16(model: nn.Module, cfg: Int8ComputeConfig, exclude: tuple[str, ...]) -> ConversionReport:
    hooks = _AutocastHooks(torch.bfloat16)
    model._thinwire_autocast = (model.register_forward_pre_hook(hooks.enter),
                                model.register_forward_hook(hooks.leave, always_call=True))
    layers = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    return ConversionReport("bf16", swapped=layers)  # autocast also runs matmul ops in bf16 (attention: see precision.attention)


def _to_fp32(model: nn.Module) -> None:
    for handle in getattr(model, "_thinwire_autocast", ()):
        handle.remove()
    model.__dict__.pop("_thinwire_autocast", None)
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int8Conv2d)):
            to_float_(m)
    model.__dict__.pop(_REPORT, None)


CONVERTERS = {
    Precision.FP32: lambda model, cfg, exclude: ConversionReport("fp32"),
    Precision.INT8: _to_int8,
    Precision.BF16: _to_bf16,
}
