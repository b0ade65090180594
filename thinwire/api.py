"""The public ``thinwire.attach``: codec specs, codec objects, policies, and ``"auto"``.

``"auto"`` is an online plan (:mod:`thinwire.auto`) built above the compression layer and
handed to :func:`thinwire.compress.hook.attach` as a policy, so compress/ never imports the
performance model or the planner.
"""

from __future__ import annotations

from thinwire.compress.hook import CommState
from thinwire.compress.hook import attach as _attach


def is_auto(codec) -> bool:
    return isinstance(codec, str) and codec.split(":", 1)[0].strip().lower() == "auto"


def resolve_codec(codec):
    """``"auto"`` / ``"auto:k=v"`` -> an AutoPolicy; anything else unchanged (parsed by ``attach``)."""
    if is_auto(codec):
        from thinwire.auto import AutoPolicy

        return AutoPolicy.from_spec(codec)
    return codec


def attach(model, codec="none", **kwargs) -> CommState:
    """Attach thinwire's compressed all-reduce to a DDP model; see :func:`thinwire.compress.hook.attach`.

    ``codec="auto"`` measures the link and the compute after the warm-up and picks, per bucket, the
    codec the performance model predicts fastest under an accuracy guard, re-deciding when the
    measured bandwidth moves by more than 30%; every decision is logged with its reason.
    """
    return _attach(model, resolve_codec(codec), **kwargs)
