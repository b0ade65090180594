"""A pipeline step's time, and the split of a layer list over hosts of different speeds.

**The step** is the schedule itself, played out operation by operation (:func:`simulate_schedule`). S
stages on S hosts, M micro-batches; stage s computes ``f_s`` forward and ``b_s`` backward per micro-batch.
Each stage runs the program ``torch.distributed.pipelining`` runs (:func:`stage_program`: GPipe, all
forwards then all backwards, each receive waited at once and the sends at the phase's end; 1F1B, ``S - s``
forwards of warm-up, then one backward and one forward in turn, each send fused with the next receive and
waited with it, then the backwards left), and gloo moves each message as its TCP pairs do: a send's data is
written only once the receiver has posted the matching receive and that notice has come back (behind what
the receiver's host has queued on its egress), the data then leaves on the sender's egress, one message
after another at the egress's rate (``send seconds``; a token bucket's credit spent first where the link
has one), and arrives a latency ``alpha`` later. So a stage cannot push its output ahead of a neighbour
that is not ready for it, and a gradient going back delays the notice for the next activation coming
forward. The step is when the last operation ends, plus ``after``: what follows the schedule (the stages'
optimizer step, the per-step scalar all-reduces, the replicas' gradient average). Against stages that only
sleep, on the emulator at 100 Mbit/s (``benchmarks/results/pipeline_links.md``, 10 configurations), this is
within 2.2% at the median and 6.5% at worst, where messages sent as soon as computed at the link's rate were
off by 16.7% at the median: 28% short with 128 KiB messages, 41% long with 32 KiB ones (which the link's
token bucket passes at once).

Why not the closed form of DAPPLE (Fan et al. PPoPP 2021), ``sum of stages + (M-1) x the slowest``,
with links as stages as PipeDream's planner treats them (Narayanan et al. SOSP 2019)? It assumes a
stage can run ahead as far as it likes. 1F1B holds at most ``S - s`` micro-batches in flight and waits
for each backward's gradient before its next forward, so a link's transfer time and latency sit in a
cycle between neighbours: on 4 x 100 Mbit/s the closed form was short by 14-27%
(``benchmarks/results/archive/pipeline_v1.md``). The simulation follows the schedule's order exactly and
costs O(S M log(S M)). With free links and equal stages both give ``(M + S - 1)(f + b)``:

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

import heapq
from collections.abc import Sequence

SCHEDULES = ("gpipe", "1f1b")


def schedule_actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s computations in order, ``("F"|"B", micro-batch)``, as ``ScheduleGPipe`` and
    ``Schedule1F1B`` run them (``torch/distributed/pipelining/schedules.py``; :func:`stage_program`)."""
    return [(what, m) for what, m in stage_program(schedule, stage, stages, microbatches) if what in ("F", "B")]


def stage_program(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple]:
    """Stage ``stage``'s step as ``torch.distributed.pipelining`` runs it (``ScheduleGPipe``,
    ``Schedule1F1B._step_microbatches``): ``("post", ops)`` issues point-to-point operations (``("send"|"recv",
    "F"|"B", micro-batch)``: a forward's output goes to the next stage, a backward's input gradient to the
    previous one) without waiting, ``("wait", ops)`` waits for them, ``("F"|"B", m)`` computes."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    S, M, s = stages, microbatches, stage
    fsend = lambda m: [("send", "F", m)] if s < S - 1 else []  # noqa: E731
    frecv = lambda m: [("recv", "F", m)] if s > 0 else []  # noqa: E731
    bsend = lambda m: [("send", "B", m)] if s > 0 else []  # noqa: E731
    brecv = lambda m: [("recv", "B", m)] if s < S - 1 else []  # noqa: E731
    prog: list[tuple] = []
    if schedule == "gpipe":  # each recv waited at once, the sends of a phase at its end
        for kind, send, recv in (("F", fsend, frecv), ("B", bsend, brecv)):
            for m in range(M):
                prog += [("post", recv(m)), ("wait", recv(m)), (kind, m), ("post", send(m))]
            prog.append(("wait", [op for m in range(M) for op in send(m)]))
        return prog
    warmup = min(M, S - s)
    sent: list = []      # the last forward sends fired in the warm-up, waited before the next
    pending: list = []   # sends made but not fired: fused with the next receives
    for i in range(warmup):
        prog += [("post", frecv(i)), ("wait", frecv(i)), ("F", i), ("wait", sent)]
        pending = fsend(i)
        if i != warmup - 1:
            prog.append(("post", pending))
            sent, pending = pending, []
    forward, backward = warmup, 0
    while True:
        fused = pending + brecv(backward)
        prog += [("post", fused), ("wait", fused), ("B", backward)]
        pending, backward = bsend(backward), backward + 1
        if forward == M:
            break
        fused = pending + frecv(forward)
        prog += [("post", fused), ("wait", fused), ("F", forward)]
        pending, forward = fsend(forward), forward + 1
    prog.append(("post", pending))
    sent = pending
    while backward < M:
        prog += [("post", brecv(backward)), ("wait", brecv(backward)), ("B", backward), ("wait", sent)]
        sent = bsend(backward)
        prog.append(("post", sent))
        backward += 1
    prog.append(("wait", sent))
    return prog


class Credit:
    """A link's token bucket in seconds of its rate: up to ``cap`` seconds gathered while it idles, at one per
    second; a message spends them first and pays the rate beyond (tc's tbf passes what its bucket holds at
    once). ``cap`` 0: no bucket, every message pays the rate.

    >>> link = Credit(0.5)
    >>> [round(link.take(t, s), 6) for t, s in ((0.0, 0.3), (0.1, 0.6), (10.0, 0.8))]  # the second: 0.2 + 0.1 s
    [0.0, 0.3, 0.3]
    """

    def __init__(self, cap: float) -> None:
        assert cap >= 0
        self.cap, self.tokens, self.idle_since = cap, cap, 0.0

    def take(self, start: float, seconds: float) -> float:
        """How long a message of ``seconds`` at the rate, starting to leave at ``start`` (calls in time order),
        takes to leave."""
        self.tokens = min(self.cap, self.tokens + max(0.0, start - self.idle_since))
        took = max(0.0, seconds - self.tokens)
        self.tokens = max(0.0, self.tokens - seconds)
        self.idle_since = start + took
        return took


class CpuQuota:
    """A host's CPU under a CFS bandwidth quota (the emulator's ``cpu:``; Linux's sched-bwc,
    Documentation/scheduler/sched-bwc.rst): time is cut into periods of ``cap / share`` seconds; each
    period grants ``cap`` seconds of running, at full speed, and a host that has spent them waits for the
    next period, whose grant replaces what was left (no carry-over). So work of a few milliseconds between
    idle gaps (a pipeline stage's micro-batch while its neighbours compute) runs at full speed when the
    period still holds it, and a host that computes without pause runs ``cap`` out of every period.
    Periods start at time 0 of the quota's clock; ``origin`` places a simulated step on it (steps played
    back to back: :func:`thinwire.sim.pipeline.predict_pipeline`). ``share`` 1: no quota.

    It replaced a token bucket of the same rate and size (the grant gathered continuously), which spread a
    throttled host's work evenly where the kernel stops it until the period ends: priced on the stored
    pipeline runs (``benchmarks/results/archive/pipeline_v5.json``, ``archive/pipeline_v4.json``: 7 rows each, two
    days), the largest error went from 22% to 19% and from 16% to 15%, the sum of their sizes from 166 to 149
    points.

    >>> q = CpuQuota(0.5, 1.0)  # periods of 2 s, 1 s of running in each
    >>> [round(q.run(t, w), 6) for t, w in ((0.0, 1.0), (1.0, 1.0), (10.0, 3.0))]  # 2nd waits out period 0
    [1.0, 2.0, 5.0]
    """

    def __init__(self, share: float, cap: float) -> None:
        assert 0 < share and cap >= 0
        self.share, self.cap = min(1.0, share), cap
        self.period = cap / self.share if self.share < 1.0 and cap > 0 else 0.0
        self.current, self.used = -1, 0.0   # the period last run in, and the running it has spent
        self.origin = 0.0                   # where the simulated step's time 0 falls on the quota's clock

    def run(self, start: float, seconds: float) -> float:
        """How long work of ``seconds`` at full speed, started at ``start`` (calls in time order), takes."""
        if self.share >= 1.0:
            return seconds
        if self.period <= 0.0:
            return seconds / self.share
        t, left = start + self.origin, seconds
        while left > 0.0:
            k = max(self.current, int(t // self.period))  # never back a period: t on its end may round down
            if k != self.current:
                self.current, self.used = k, 0.0
            ends = (k + 1) * self.period
            if min(self.cap - self.used, ends - t) <= 1e-12 * self.period:  # the grant spent (or t on the period's
                t, self.current, self.used = ends, k + 1, 0.0                 # end): the next period's
                continue
            ran = min(left, self.cap - self.used, ends - t)
            t, left, self.used = t + ran, left - ran, self.used + ran
        return t - start - self.origin


def simulate_schedule(*, forward_s: list[float], backward_s: list[float], send_forward_s: list[float],
                      send_backward_s: list[float], microbatches: int, schedule: str = "1f1b",
                      alpha: float = 0.0, credit_s: list[float] | None = None,
                      programs: Sequence[Sequence[tuple]] | None = None,
                      quota: list[tuple[float, float]] | None = None, busy_s: list[float] | None = None) -> float:
    """Seconds from the first action to the last (module docstring). Per stage k: ``forward_s[k]``,
    ``backward_s[k]`` per micro-batch; ``send_forward_s[k]``: its output's seconds on its host's egress
    (unused on the last stage), ``send_backward_s[k]``: its input gradient's (unused on the first).
    ``alpha``: each message's latency beyond its time on the egress. ``credit_s[r]``: rank r's token
    bucket in seconds of its egress (none: every message pays the rate), full at the start. ``quota[r]``:
    rank r's CPU quota as ``(share, cap)`` (:class:`CpuQuota`; then ``forward_s`` and ``backward_s`` are at
    full speed); none: every computation takes its time. ``busy_s``, when given, gets each stage's seconds
    of computing (quota waits included).

    ``programs``: one per rank, stage k on rank ``k % ranks`` (the interleaved schedule's, written out by
    :func:`thinwire.pipeline.programs.interleaved_programs`); by default each stage is a rank running
    :func:`stage_program` of ``schedule``. A message moves as gloo moves it (``gloo/transport/tcp/pair.cc``):
    the sender's data is written only once the receiver has posted its receive and that notice has come
    back, behind whatever the receiver's egress has queued before it (one FIFO per host, as tc's qdisc);
    the send then completes (the socket holds the message), the data leaves on the sender's egress, first
    come first served, and the receive completes a latency after it has left.

    Equal stages and free links give ``(M + S - 1)(f + b)``; a lone message within the bucket leaves at
    once (without the bucket, 5.0):

    >>> simulate_schedule(forward_s=[1, 1], backward_s=[1, 1], send_forward_s=[0.5, 0], send_backward_s=[0, 0.5],
    ...                   microbatches=1, credit_s=[0.5, 0.5])
    4.0
    """
    C = len(forward_s)
    assert C >= 1 and microbatches >= 1 and len(backward_s) == len(send_forward_s) == len(send_backward_s) == C
    if programs is None:
        programs = [_with_stage(stage_program(schedule, s, C, microbatches), s) for s in range(C)]
    R = len(programs)
    links = [Credit(c) for c in (credit_s if credit_s is not None else [0.0] * R)]
    cpus = [q if isinstance(q, CpuQuota) else CpuQuota(*q) for q in (quota if quota is not None else [(1.0, 0.0)] * R)]
    assert len(links) == len(cpus) == R and C % R == 0
    busy = [0.0] * C
    pc, egress = [0] * R, [0.0] * R
    done: dict[tuple, float] = {}         # op -> when it completes, once known
    posted: dict[tuple, float] = {}       # ("send", kind, k, m) -> when the sender fired it
    ready: dict[tuple, float] = {}        # ("send", kind, k, m) -> when the receiver's notice reached it
    blocked: dict[int, float] = {}        # rank -> since when it waits for operations not yet timed
    events: list[tuple[float, int, str, tuple]] = []
    seq = 0

    def push(at: float, what: str, key: tuple) -> None:
        nonlocal seq
        heapq.heappush(events, (at, seq, what, key))
        seq += 1

    def leave(r: int, at: float, seconds: float) -> float:
        """When a message handed to rank r's egress ``at`` (calls in time order) has left it."""
        start = max(egress[r], at)
        egress[r] = start + links[r].take(start, seconds)
        return egress[r]

    def write(kind: str, k: int, m: int, at: float) -> None:
        """Both ends are ready at ``at``: stage k's data goes out."""
        seconds = send_forward_s[k] if kind == "F" else send_backward_s[k]
        end = leave(k % R, at, seconds)
        done[("send", kind, k, m)] = at  # gloo sizes the socket's buffer to the message: it is written at once
        done[("recv", kind, k + 1 if kind == "F" else k - 1, m)] = end + alpha
        for w in list(blocked):
            push(blocked.pop(w), "run", (w,))  # it looks again at what it waits for

    def run(r: int, now: float) -> None:
        while pc[r] < len(programs[r]):
            what, arg = programs[r][pc[r]]
            if what == "post":
                for op, kind, k, m in arg:
                    if op == "send":
                        posted[(op, kind, k, m)] = now
                        if (op, kind, k, m) in ready:
                            write(kind, k, m, max(now, ready[(op, kind, k, m)]))
                    else:  # the notice leaves behind what this host's egress has queued, for the sending stage
                        push(max(now, egress[r]) + alpha, "notice", (kind, k - 1 if kind == "F" else k + 1, m))
            elif what == "wait":
                times = [done.get(op) for op in arg]
                if None in times:
                    blocked[r] = now
                    return
                if max(times, default=now) > now:
                    pc[r] += 1
                    push(max(times), "run", (r,))
                    return
            else:
                k, _ = arg
                pc[r] += 1
                took = cpus[r].run(now, forward_s[k] if what == "F" else backward_s[k])
                busy[k] += took
                push(now + took, "run", (r,))
                return
            pc[r] += 1

    for r in range(R):
        push(0.0, "run", (r,))
    end = 0.0
    while events:
        now, _, what, key = heapq.heappop(events)
        end = max(end, now)
        if what == "run":
            run(key[0], now)
        else:  # a receive's notice reached the sending stage's rank
            op = ("send", *key)
            ready[op] = now
            if op in posted:
                write(*key, max(now, posted[op]))
    assert all(pc[r] == len(programs[r]) for r in range(R)), "the schedule deadlocked"
    if busy_s is not None:
        busy_s[:] = busy
    return end


def _with_stage(program: list[tuple], s: int) -> list[tuple]:
    """:func:`stage_program`'s operations of stage ``s`` with the stage named in each (simulate_schedule's form)."""
    return [(what, [(op, kind, s, m) for op, kind, m in arg]) if what in ("post", "wait") else (what, (s, arg))
            for what, arg in program]


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
