"""One decision of ``auto``: the agreed measurements priced by the performance model, per bucket.

Steps of :func:`decide`:

1. **Buckets** in index order, each ready when its share of the gradient is (``ready_frac``: the
   cumulative share of values, as DDP fills buckets in the order backward produces them).
2. **Candidates** as the model sees them (:func:`thinwire.sim.inputs.codec_model`, with the
   parameters' shapes for PowerSGD), their encode and decode priced by the costs every rank agreed
   on (:func:`codec_costs`, measured once at the largest bucket). Where the job has an aggregator on
   the switch, each codec it can sum is a candidate twice (:func:`routes`): around the ring (``int8``)
   and through the switch (``int8@switch``), priced at the switch's pace as timed once it has carried
   a bucket, before that from the link's with the aggregator taken to keep up (the trial then judges).
3. **Left out per bucket**: codecs the accuracy guard banned, codecs a trial rejected
   (:mod:`thinwire.auto.trial`; by route), and lossy candidates whose shadow error is over the cap (unless the
   convergence guard of ``auto:guard=PROFILE`` says they reach fp32's loss); a codec left out for its
   error is left out by either route.
4. **Search** (:func:`thinwire.plan.choose.choose`, the planner's per-bucket coordinate descent)
   from the plan in use, each move at least :data:`SEARCH_GAIN` faster; the plan found replaces the plan
   in use only if predicted ``min_gain`` faster than it. (With ``min_gain`` on every move, a first move
   to ``int8`` could block a second to ``int8@switch`` that was not 10% faster again, though the two
   together were.)

Pure but for :func:`codec_costs` (which times the codecs); the same inputs give the same plan on
every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from thinwire.auto.agree import Measurements
from thinwire.compress.schemes.switched import base_spec, switchable, via_switch
from thinwire.perf.model import Bucket, CodecModel, Compute, LinearCost, Network
from thinwire.plan.choose import BucketCodecs, choose

log = logging.getLogger("thinwire.plan")
SEARCH_GAIN = 0.01  # each move of the search: at least this much faster (the model's own noise is smaller)


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
           min_gain: float, switch: bool = False) -> tuple[dict[int, str], BucketCodecs]:
    """The new choice per bucket index and the search's decision (see the module docstring).
    ``plan``: the spec each bucket is sent with now; ``costs``: the agreed codec costs; ``switch``: the
    job has an aggregator on the switch."""
    order = sorted(numels)
    sizes = [numels[i] for i in order]
    layout = [shapes[i] for i in order] if all(i in shapes for i in order) else None
    candidates = routes(candidates, switch)
    models = candidate_models(candidates, sizes, layout, costs)
    left_out = _left_out(order, guards, shared.shadow, candidates)
    current = [plan[i] if plan[i] not in left_out.get(k, ()) else "none" for k, i in enumerate(order)]
    kw = dict(buckets=buckets(sizes), compute=Compute(pre_s=shared.pre_s, backward_s=shared.backward_s, post_s=0.0),
              speeds=[1.0] * world, network=Network(alpha_s=shared.alpha, beta_s_per_byte=shared.beta,
                                                    switch_beta_s_per_byte=shared.switch_beta),
              candidates=models, banned=left_out, codec_steals_compute=_no_spare_core())
    decision = choose(initial=current, min_gain=SEARCH_GAIN, **kw)
    if decision.step_s > decision.initial_s * (1 - min_gain):  # not worth a change: the plan in use stays
        decision = choose(initial=current, min_gain=min_gain, passes=0, **kw)
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


def routes(candidates: tuple[str, ...], switch: bool) -> tuple[str, ...]:
    """The candidates by route: with a ``switch``, each one its aggregator can sum also through it, next
    to its ring route (``int8``, ``int8@switch``)."""
    out: list[str] = []
    for c in candidates:
        out += [c, via_switch(c)] if switch and switchable(c) else [c]
    return tuple(out)


def candidate_models(candidates: tuple[str, ...], numels: list[int], shapes: list | None,
                     costs: dict[str, tuple[float, float]]) -> dict[str, CodecModel]:
    """Each candidate's model (light first, as the search wants them), priced with ``costs``; one named
    ``CODEC@switch`` (:func:`routes`) travels through the switch."""
    from thinwire.sim.inputs import codec_model

    out = {}
    for c in candidates:
        model = codec_model(base_spec(c), None, shapes=shapes, switch=base_spec(c) != c)
        out[c] = dataclasses.replace(model, name=c, **costs_for(c, costs))
    return out


def costs_for(spec: str, costs: dict[str, tuple[float, float]]) -> dict:
    """``spec``'s measured encode/decode seconds per byte as model fields (none: free)."""
    spec = base_spec(spec)
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


def _left_out(order: list[int], guards: Guards, shadow: dict[int, dict[str, float]],
              candidates: tuple[str, ...] = ()) -> dict[int, set[str]]:
    """Position in ``order`` -> the specs not to try there (see :class:`Guards`): a codec banned or over
    the error cap by either route (``candidates``), a route the clock rejected."""
    out: dict[int, set[str]] = {}
    for i, banned in guards.banned.items():
        if i in order:
            bases = {base_spec(b) for b in banned}
            out.setdefault(order.index(i), set()).update(c for c in candidates or banned if base_spec(c) in bases)
    for i, errs in shadow.items():
        if i in order:
            over = {c for c, e in errs.items() if e > guards.max_error and c not in guards.trusted}
            out.setdefault(order.index(i), set()).update(c for c in candidates or over if base_spec(c) in over)
    for i, rejected in guards.tried.items():
        if i in order:
            out.setdefault(order.index(i), set()).update(rejected)
    return out


def _no_spare_core() -> bool:
    """The training threads use every core: codec work on the communication thread slows backward."""
    return torch.get_num_threads() >= (os.cpu_count() or 1)
