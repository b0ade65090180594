"""Choose a codec per bucket that minimizes the predicted step time, under an accuracy guard.

Pure decision logic over :mod:`thinwire.perf.model` (no measurement, no communication), so it can
be tested by hand and gives the same answer on every rank for the same inputs.

Algorithm (coordinate descent over buckets):

1. start from the plan in use (``initial``; by default every bucket uncompressed, ``none``), so a
   change of plan must pay for itself;
2. for each bucket, last to first (the last buckets are the least hidden behind backward), try
   every allowed candidate with the other buckets fixed, keep the one with the smallest predicted
   step; a candidate must beat the current choice by ``min_gain`` (relative) to replace it, so ties
   go to the lighter codec (candidates are listed light to strong);
3. repeat the pass until nothing changes (at most ``passes`` times).

A candidate is allowed for a bucket unless the accuracy guard banned it there (its measured
relative error with error feedback exceeded the cap).

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
from typing import Mapping, Sequence

from thinwire.perf.model import Bucket, CodecModel, Compute, Network, StepPrediction, predict_step


@dataclasses.dataclass(frozen=True)
class Decision:
    choices: list[str]            # codec spec per bucket
    step_s: float                 # predicted step with these choices
    baseline_s: float             # predicted step with every bucket uncompressed
    initial_s: float              # predicted step with the plan the search started from (``initial``)
    prediction: StepPrediction


def choose(*, buckets: Sequence[Bucket], compute: Compute, speeds: Sequence[float], network: Network,
           candidates: Mapping[str, CodecModel], banned: Mapping[int, set[str]] | None = None,
           min_gain: float = 0.02, passes: int = 3, codec_steals_compute: bool = False,
           initial: Sequence[str] | None = None) -> Decision:
    """Per-bucket codec choice (see the module docstring). ``candidates``: spec -> model, light first;
    it must contain ``"none"``."""
    if "none" not in candidates:
        raise ValueError(f"candidates must include 'none', got {list(candidates)}")
    banned = banned or {}
    kw = dict(buckets=list(buckets), compute=compute, speeds=list(speeds), network=network,
              codec_steals_compute=codec_steals_compute)
    choice = list(initial) if initial is not None else ["none"] * len(buckets)
    if len(choice) != len(buckets) or any(c not in candidates for c in choice):
        raise ValueError(f"initial must name one candidate per bucket, got {choice}")

    def step(ch: list[str]) -> float:
        return predict_step(codec=[candidates[c] for c in ch], **kw).step_s

    baseline, best = step(["none"] * len(buckets)), step(choice)
    initial_s = best
    for _ in range(passes):
        changed = False
        for i in reversed(range(len(buckets))):
            for spec in candidates:
                if spec == choice[i] or spec in banned.get(i, set()):
                    continue
                trial = choice[:i] + [spec] + choice[i + 1:]
                t = step(trial)
                if t < best * (1 - min_gain):
                    choice, best, changed = trial, t, True
        if not changed:
            break
    return Decision(choices=choice, step_s=best, baseline_s=baseline, initial_s=initial_s,
                    prediction=predict_step(codec=[candidates[c] for c in choice], **kw))
