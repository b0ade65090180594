"""A pipeline step's time, and the split of a layer list over hosts of different speeds.

**The step** is the schedule itself, played out action by action (:func:`simulate_schedule`). S stages
on S hosts, M micro-batches; stage s computes ``f_s`` forward and ``b_s`` backward per micro-batch. Each
stage runs its actions in the order ``torch.distributed.pipelining`` gives them (:func:`schedule_actions`:
GPipe, all forwards then all backwards; 1F1B, ``S - s`` forwards of warm-up, then one backward and one
forward in turn, then the backwards left), one at a time, each as soon as the stage is free and its input
has arrived: a forward needs the previous stage's output of that micro-batch, a backward the next stage's
gradient of it (the last stage's, its own forward). A finished action's output (forward) or input
gradient (backward) leaves on its host's egress, one message after another at the egress's rate (``send
seconds``), and arrives a latency ``alpha`` later. The step is when the last action ends, plus ``after``:
what follows the schedule (the stages' optimizer step, the per-step scalar all-reduces, the replicas'
gradient average).

Why not the closed form of DAPPLE (Fan et al. PPoPP 2021), ``sum of stages + (M-1) x the slowest``,
with links as stages as PipeDream's planner treats them (Narayanan et al. SOSP 2019)? It assumes a
stage can run ahead as far as it likes. 1F1B holds at most ``S - s`` micro-batches in flight and waits
for each backward's gradient before its next forward, so a link's transfer time and latency sit in a
cycle between neighbours: on 4 x 100 Mbit/s the closed form was short by 14-27%
(``benchmarks/results/archive/pipeline_v1.md``). The simulation follows the schedule's order exactly and
costs O(S M). With free links and equal stages both give ``(M + S - 1)(f + b)``:

    >>> simulate_schedule(forward_s=[1, 1], backward_s=[2, 2], send_forward_s=[0, 0], send_backward_s=[0, 0],
    ...                   microbatches=4)
    15.0

**The split.** :func:`split_for_speeds` cuts the layer list into contiguous stages, stage s on host s,
minimizing the largest ``max(layers' seconds / speed_s, link seconds)``: a slow host gets fewer layers.
Dynamic programming over (stage, last layer), O(S n^2).

    >>> split_for_speeds([1, 1, 1, 1, 1, 1], [1.0, 0.5])
    [[0, 1, 2, 3], [4, 5]]
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b")


def schedule_actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s actions in order, ``("F"|"B", micro-batch)``, as ``ScheduleGPipe`` and ``Schedule1F1B``
    run them (``torch/distributed/pipelining/schedules.py``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    M = microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warmup = min(M, stages - stage)
    actions, forward = [("F", m) for m in range(warmup)], warmup
    for m in range(M):
        actions.append(("B", m))
        if forward < M:
            actions.append(("F", forward))
            forward += 1
    return actions


def simulate_schedule(*, forward_s: list[float], backward_s: list[float], send_forward_s: list[float],
                      send_backward_s: list[float], microbatches: int, schedule: str = "1f1b",
                      alpha: float = 0.0) -> float:
    """Seconds from the first action to the last (module docstring). Per stage s: ``forward_s[s]``,
    ``backward_s[s]`` per micro-batch; ``send_forward_s[s]``: its output's seconds on its host's egress
    (unused on the last stage), ``send_backward_s[s]``: its input gradient's (unused on the first).
    ``alpha``: each message's latency beyond its time on the egress."""
    S = len(forward_s)
    assert S >= 1 and microbatches >= 1 and len(backward_s) == len(send_forward_s) == len(send_backward_s) == S
    actions = [schedule_actions(schedule, s, S, microbatches) for s in range(S)]
    pos, free, egress = [0] * S, [0.0] * S, [0.0] * S
    arrived: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> its input's arrival

    def send(s: int, at: float, seconds: float) -> float:
        """When a message of ``seconds`` on host s's egress (first come, first served), handed over ``at``,
        has left it."""
        egress[s] = max(egress[s], at) + seconds
        return egress[s]

    moved = True
    while moved:
        moved = False
        for s in range(S):
            while pos[s] < len(actions[s]):
                kind, m = actions[s][pos[s]]
                if kind == "F":
                    ready = arrived.get(("F", s, m)) if s > 0 else 0.0
                else:
                    ready = arrived.get(("B", s, m)) if s < S - 1 else 0.0  # the last stage: its own forward
                if ready is None:
                    break  # waits for a neighbour's message; the other stages go on
                end = max(free[s], ready) + (forward_s[s] if kind == "F" else backward_s[s])
                free[s], pos[s], moved = end, pos[s] + 1, True
                if kind == "F" and s < S - 1:
                    arrived[("F", s + 1, m)] = send(s, end, send_forward_s[s]) + alpha
                elif kind == "B" and s > 0:
                    arrived[("B", s - 1, m)] = send(s, end, send_backward_s[s]) + alpha
    assert all(pos[s] == len(actions[s]) for s in range(S)), "the schedule deadlocked"
    return max(free)


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
