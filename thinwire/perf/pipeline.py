"""A pipeline step's time, and the split of a layer list over hosts of different speeds.

**The step** (GPipe and 1F1B have the same bubble). S stages on S hosts, M micro-batches. Stage s
computes ``c_s`` per micro-batch (forward + backward of its layers at its host's speed) and sends, per
micro-batch, its output forward (``a_s`` bytes, unless last) and its input's gradient back (``g_s``
bytes, unless first), both over its own egress at ``B_s`` bytes/s with latency ``alpha`` per message.
Sends are asynchronous (the schedule's ``isend``), so a host's egress overlaps its compute, and the
steady state runs at the pace of the busiest host::

    P = max_s max(c_s, (a_s + g_s) / B_s + 2 alpha)             (one micro-batch per period)

One micro-batch also has to get through: forward over every stage and link, then back::

    L = sum_s c_s + sum_{s < S-1} ((a_s + g_{s+1}) / B_link + 2 alpha)

    step = L + (M - 1) P + after

(the pipeline latency model of DAPPLE, Fan et al. PPoPP 2021, ``T = sum of stages + (M-1) x the
slowest``, with links as stages of their own as PipeDream's planner treats them, Narayanan et al. SOSP
2019). ``after``: what follows the schedule, the replicas' average of the stages' gradients (in parallel
over stages: the slowest) and the optimizer step.

**The split.** :func:`split_for_speeds` cuts the layer list into contiguous stages, stage s on host s,
minimizing the largest ``max(layers' seconds / speed_s, link seconds)``: a slow host gets fewer layers.
Dynamic programming over (stage, last layer), O(S n^2).

    >>> round(pipeline_step_s(stage_s=[1.0, 1.0], egress_s=[0.5, 0.5], link_s=[0.5], microbatches=4), 3)
    5.5
    >>> split_for_speeds([1, 1, 1, 1, 1, 1], [1.0, 0.5])
    [[0, 1, 2, 3], [4, 5]]
"""

from __future__ import annotations


def pipeline_step_s(*, stage_s: list[float], egress_s: list[float], link_s: list[float], microbatches: int,
                    after_s: float = 0.0) -> float:
    """One step: ``stage_s[s]`` compute per micro-batch, ``egress_s[s]`` seconds host s sends per micro-batch
    (forward and back), ``link_s[l]`` one micro-batch's activation and gradient across link l (module docstring)."""
    assert microbatches >= 1 and len(stage_s) == len(egress_s) == len(link_s) + 1
    period = max(max(c, e) for c, e in zip(stage_s, egress_s))
    return sum(stage_s) + sum(link_s) + (microbatches - 1) * period + after_s


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of an even pipeline's step, ``(S-1)/(M+S-1)`` (GPipe, Huang et al. 2019)."""
    return (stages - 1) / (microbatches + stages - 1)


def split_for_speeds(layer_s: list[float], speeds: list[float], *, link_s: list[float] | None = None,
                     fits=None) -> list[list[int]] | None:
    """Contiguous runs of layer indices, run s on a host of relative speed ``speeds[s]``, minimizing the
    slowest stage's seconds; ``link_s[k]``: seconds after layer k when a cut falls there (its output
    and gradient on the link), ``fits(s, first, last)``: whether the run fits host s's memory. None: no
    split fits."""
    n, S = len(layer_s), len(speeds)
    assert 1 <= S <= n
    link_s = link_s or [0.0] * n
    prefix = [0.0]
    for c in layer_s:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    cut = [[0] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for end in range(s, n - (S - s) + 1):
            for start in range(s - 1, end):
                if best[s - 1][start] == inf or (fits is not None and not fits(s - 1, start, end - 1)):
                    continue
                stage = (prefix[end] - prefix[start]) / speeds[s - 1]
                link = link_s[end - 1] if end < n else 0.0
                value = max(best[s - 1][start], stage, link)
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, start
    if best[S][n] == inf:
        return None
    runs, end = [], n
    for s in range(S, 0, -1):
        runs.append(list(range(cut[s][end], end)))
        end = cut[s][end]
    return runs[::-1]
