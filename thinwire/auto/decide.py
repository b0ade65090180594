"""One decision of ``auto``: the agreed measurements priced by the performance model, per bucket.

Steps of :func:`decide`:

1. **Buckets** in index order, each ready when its share of the gradient is (``ready_frac``: the
   cumulative share of values, as DDP fills buckets in the order backward produces them).
2. **Candidates** as the model sees them (:func:`thinwire.sim.inputs.codec_model`, with the
   parameters' shapes for PowerSGD), their encode and decode priced by the costs every rank agreed
   on (:func:`codec_costs`, measured once at the largest bucket).
3. **Left out per bucket**: codecs the accuracy guard banned, codecs a trial rejected
   (:mod:`thinwire.auto.trial`), and lossy candidates whose shadow error is over the cap (unless the
   convergence guard of ``auto:guard=PROFILE`` says they reach fp32's loss).
4. **Search** (:func:`thinwire.plan.choose.choose`, the planner's per-bucket coordinate descent)
   from the plan in use, so a change must be predicted ``min_gain`` faster to be made.

Pure but for :func:`codec_costs` (which times the codecs); the same inputs give the same plan on
every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from thinwire.auto.agree import Measurements
from thinwire.perf.model import Bucket, CodecModel, Compute, LinearCost, Network
from thinwire.plan.choose import BucketCodecs, choose

log = logging.getLogger("thinwire.plan")


@dataclasses.dataclass(frozen=True)
class Guards:
    """What may not be sent where: bucket -> specs banned by the accuracy guard, and bucket -> spec ->
    the link rate at which a trial rejected it; lossy candidates whose shadow error is over ``max_error``,
    unless the convergence guard says they reach fp32's loss (``trusted``)."""

    banned: dict[int, set[str]]
    tried: dict[int, dict[str, float]]
    max_error: float
    trusted: frozenset = frozenset()


def decide(*, numels: dict[int, int], shapes: dict[int, list[tuple]], plan: dict[int, str], candidates: tuple[str, ...],
           costs: dict[str, tuple[float, float]], shared: Measurements, guards: Guards, world: int,
           min_gain: float) -> tuple[dict[int, str], BucketCodecs]:
    """The new choice per bucket index and the search's decision (see the module docstring).
    ``plan``: the spec each bucket is sent with now; ``costs``: the agreed codec costs."""
    order = sorted(numels)
    sizes = [numels[i] for i in order]
    layout = [shapes[i] for i in order] if all(i in shapes for i in order) else None
    models = candidate_models(candidates, sizes, layout, costs)
    left_out = _left_out(order, guards, shared.shadow)
    current = [plan[i] if plan[i] not in left_out.get(k, ()) else "none" for k, i in enumerate(order)]
    decision = choose(initial=current, buckets=buckets(sizes),
                      compute=Compute(pre_s=shared.pre_s, backward_s=shared.backward_s, post_s=0.0),
                      speeds=[1.0] * world, network=Network(alpha_s=shared.alpha, beta_s_per_byte=shared.beta),
                      candidates=models, banned=left_out, min_gain=min_gain, codec_steals_compute=_no_spare_core())
    return dict(zip(order, decision.choices)), decision


def record(step: int, reason: str, *, old: dict[int, str], choices: dict[int, str], bps: float, decision: BucketCodecs,
           trial: bool, shadow: dict[int, dict[str, float]]) -> dict:
    """A decision's entry in ``AutoPolicy.decisions``, logged with what changed since ``old``."""
    changed = ", ".join(f"bucket {i} -> {c}" for i, c in sorted(choices.items()) if old.get(i) != c)
    log.info("auto at step %d (%s): %s; predicted step %.1f ms vs %.1f ms with the plan in use, %.1f ms "
             "uncompressed, link %.1f Mbit/s", step, reason, changed or "no change",
             decision.step_s * 1e3, decision.initial_s * 1e3, decision.baseline_s * 1e3, bps / 1e6)
    return {"step": step, "reason": reason, "choices": dict(choices), "link_bps": bps,
            "predicted_step_s": decision.step_s, "plan_in_use_step_s": decision.initial_s,
            "uncompressed_step_s": decision.baseline_s, "trial": trial,
            "shadow_errors": {i: {c: round(e, 4) for c, e in errs.items()} for i, errs in shadow.items()}}


def buckets(numels: list[int]) -> list[Bucket]:
    total = sum(numels) or 1
    return [Bucket(numel=n, ready_frac=sum(numels[: k + 1]) / total) for k, n in enumerate(numels)]


def candidate_models(candidates: tuple[str, ...], numels: list[int], shapes: list | None,
                     costs: dict[str, tuple[float, float]]) -> dict[str, CodecModel]:
    """Each candidate's model (light first, as the search wants them), priced with ``costs``."""
    from thinwire.sim.inputs import codec_model

    out = {}
    for c in candidates:
        model = codec_model(c, None, shapes=shapes)
        out[c] = dataclasses.replace(model, **costs_for(c, costs))
    return out


def costs_for(spec: str, costs: dict[str, tuple[float, float]]) -> dict:
    """``spec``'s measured encode/decode seconds per byte as model fields (none: free)."""
    if spec == "none" or not costs:
        return {}
    enc, dec = costs[spec]
    return {"encode": LinearCost(per_byte_s=enc), "decode": LinearCost(per_byte_s=dec)}


def codec_costs(candidates: tuple[str, ...], numel: int) -> dict[str, tuple[float, float]]:
    """This rank's encode/decode seconds per byte of each compressing candidate at ``numel`` values
    (three repetitions each: a few milliseconds per codec at a bucket of a million values)."""
    from thinwire.measure.codec_costs import measure_codec

    out = {}
    for spec in candidates:
        if spec != "none":
            c = measure_codec(spec, [numel], reps=3)
            out[spec] = (c.encode.per_byte_s, c.decode.per_byte_s)
    return out


def _left_out(order: list[int], guards: Guards, shadow: dict[int, dict[str, float]]) -> dict[int, set[str]]:
    """Position in ``order`` -> the specs not to try there (see :class:`Guards`)."""
    out = {order.index(i): set(b) for i, b in guards.banned.items() if i in order}
    for i, rejected in guards.tried.items():
        if i in order:
            out.setdefault(order.index(i), set()).update(rejected)
    for i, errs in shadow.items():
        if i in order:
            out.setdefault(order.index(i), set()).update(c for c, e in errs.items()
                                                         if e > guards.max_error and c not in guards.trusted)
    return out


def _no_spare_core() -> bool:
    """The training threads use every core: codec work on the communication thread slows backward."""
    return torch.get_num_threads() >= (os.cpu_count() or 1)
