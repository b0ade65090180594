"""The public ``thinwire.attach``: a communication spec (string or parsed), a codec, or a policy.

A string is parsed by :func:`thinwire.commspec.parse_comm_spec`, so ``"auto"`` (an online plan built
above the compression layer, :mod:`thinwire.auto`) arrives at :func:`thinwire.compress.hook.attach`
as a policy, and compress/ never imports the performance model or the planner.
"""

from __future__ import annotations

from thinwire.commspec import AutoSpec, CodecSpec, TorchSpec, as_policy
from thinwire.compress.hook import CommState
from thinwire.compress.hook import attach as _attach


def attach(model, codec="none", **kwargs) -> CommState:
    """Attach thinwire's compressed all-reduce to a DDP model; see :func:`thinwire.compress.hook.attach`.

    ``codec``: a spec string (``"int8"``, ``"topk:ratio=0.01"``, ``"auto"``; see ``thinwire codecs``), a
    parsed spec, a :class:`~thinwire.compress.codecs.base.Codec` or a
    :class:`~thinwire.compress.hook.Policy`. ``"auto"`` measures the link and the compute after the
    warm-up and picks, per bucket, the codec the performance model predicts fastest under an accuracy
    guard, re-deciding when the measured bandwidth moves by more than 30%; every decision is logged
    with its reason.
    """
    if isinstance(codec, (str, CodecSpec, AutoSpec, TorchSpec)):
        codec = as_policy(codec)
    return _attach(model, codec, **kwargs)
