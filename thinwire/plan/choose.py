"""The per-bucket codec search the planner and ``auto`` share, and the accuracy cap both apply.

Pure decision logic over :mod:`thinwire.perf.model` (no measurement, no communication), so it can
be tested by hand and gives the same answer on every rank for the same inputs.

:func:`descend`, coordinate descent over buckets (the planner's :func:`thinwire.plan.search.best_codecs`
and :func:`choose`, ``auto``'s decision, both run it):

1. start from a plan (``auto``: the plan in use, so a change of plan must pay for itself; the
   planner: the best single codec);
2. for each bucket, last to first (the last buckets are the least hidden behind backward), try
   every allowed candidate with the other buckets fixed, keep the one with the smallest predicted
   step; a candidate must beat the current choice by ``min_gain`` (relative) to replace it, so ties
   go to the lighter codec (candidates are listed light to strong);
3. repeat the pass until nothing changes (at most ``passes`` times).

Each pass prices ``buckets x candidates`` plans with the model (microseconds each).

A candidate is allowed for a bucket unless the accuracy guard banned it there: its relative error
with error feedback exceeded :data:`MAX_EF_ERROR`.

    >>> from thinwire.perf.model import Bucket, Compute, Network
    >>> from thinwire.sim.inputs import codec_model
    >>> cands = {s: codec_model(s, None) for s in ("none", "bf16")}
    >>> slow = Network(alpha_s=1e-4, beta_s_per_byte=8 / 10e6)
    >>> choose(buckets=[Bucket(numel=1_000_000, ready_frac=1.0)], compute=Compute(pre_s=0.01, backward_s=0.02, post_s=0.0),
    ...        speeds=[1.0, 1.0], network=slow, candidates=cands).choices
    ['bf16']
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence, TypeVar

from thinwire.perf.model import Bucket, CodecModel, Compute, Network, StepPrediction, predict_step

#: The accuracy cap of the planner and ``auto``: the largest relative compression error with error
#: feedback, ``||r|| / ||g + r_prev||`` (the share of what was due that a step left behind), a codec
#: may have and still be used. ``auto`` measures it per bucket, in shadow on the warm-up's
#: gradients and then in use; the planner reads it from the profile (``thinwire profile`` runs the
#: same shadow error feedback on the workload's gradients, over all buckets together). 0.1 admits
#: bf16 (0.002 on charlm) and int8 (0.008), whose loss ends within 0.5% of DDP fp32's at equal
#: samples, and keeps out QSGD (~0.2) and PowerSGD rank 8 (~0.3), 1.7-4.0% above it
#: (``benchmarks/results/compare_long.md``; the history is in ``docs/auto.md``). A user who will
#: trade loss for speed raises it (``auto:max_error=0.5``, ``thinwire plan --max-error 0.5``).
MAX_EF_ERROR = 0.1

Priced = TypeVar("Priced")


@dataclasses.dataclass(frozen=True)
class BucketCodecs:
    choices: list[str]            # codec spec per bucket
    step_s: float                 # predicted step with these choices
    baseline_s: float             # predicted step with every bucket uncompressed
    initial_s: float              # predicted step with the plan the search started from (``initial``)
    prediction: StepPrediction


def choose(*, buckets: Sequence[Bucket], compute: Compute, speeds: Sequence[float], network: Network,
           candidates: Mapping[str, CodecModel], banned: Mapping[int, set[str]] | None = None,
           min_gain: float = 0.02, passes: int = 3, codec_steals_compute: bool = False,
           initial: Sequence[str] | None = None) -> BucketCodecs:
    """Per-bucket codec choice (see the module docstring). ``candidates``: spec -> model, light first;
    it must contain ``"none"``."""
    if "none" not in candidates:
        raise ValueError(f"candidates must include 'none', got {list(candidates)}")
    kw = dict(buckets=list(buckets), compute=compute, speeds=list(speeds), network=network,
              codec_steals_compute=codec_steals_compute)
    choice = list(initial) if initial is not None else ["none"] * len(buckets)
    if len(choice) != len(buckets) or any(c not in candidates for c in choice):
        raise ValueError(f"initial must name one candidate per bucket, got {choice}")

    def step(ch: Sequence[str]) -> float:
        return predict_step(codec=[candidates[c] for c in ch], **kw).step_s

    baseline, initial_s = step(["none"] * len(buckets)), step(choice)
    choice, best = descend(choice, initial_s, list(candidates), step, banned=banned, min_gain=min_gain, passes=passes)
    return BucketCodecs(choices=list(choice), step_s=best, baseline_s=baseline, initial_s=initial_s,
                    prediction=predict_step(codec=[candidates[c] for c in choice], **kw))


def descend(start: Sequence[str], priced: Priced, candidates: Sequence[str], price: Callable[[tuple[str, ...]], Priced],
            *, seconds: Callable[[Priced], float] = lambda p: p, banned: Mapping[int, set[str]] | None = None,
            min_gain: float, passes: int) -> tuple[tuple[str, ...], Priced]:
    """Coordinate descent over buckets from ``start`` (one candidate per bucket), whose price is
    ``priced`` (see the module docstring). ``price`` prices a plan, ``seconds`` reads its step time;
    returns the best plan found and its price."""
    banned = banned or {}
    choice, best = tuple(start), priced
    for _ in range(passes):
        changed = False
        for i in reversed(range(len(choice))):
            for spec in candidates:
                if spec == choice[i] or spec in banned.get(i, set()):
                    continue
                trial = choice[:i] + (spec,) + choice[i + 1:]
                p = price(trial)
                if seconds(p) < seconds(best) * (1 - min_gain):
                    choice, best, changed = trial, p, True
        if not changed:
            break
    return choice, best
