"""A change of plan is a trial: kept only if the clock agrees that the new plan's steps are faster.

The model's inputs are measured, but on a host whose collectives are bound by its CPU rather than
its link, the transfer time per byte measured under one codec does not carry over to another. So
:class:`Trial` times the new plan's window of steps against the old plan's:

1. **Kept** when the new median step is at least ``keep_gain`` below the old one *and* the steps are
   faster by a one-sided Mann-Whitney U test at ``keep_p`` (:func:`p_faster`).
2. **Reverted** when the median is not ``keep_gain`` faster (or, at an early look after the new
   plan's first few steps, when those are surely slower: :meth:`Trial.surely_slower`); the codecs it tried are left out of
   those buckets until the link moves their way (:func:`forget_rejections`): a codec that sends
   fewer bytes than the plan in use until the link is ``rebalance_change`` slower than when it was
   rejected, one that sends more until it is that much faster.
3. **Timed again** otherwise (faster by the median but not surely): the old plan for a window, then
   the new one, testing all steps so far after each (the windows alternate, so a slow spell of the
   host falls on both plans); after ``trial_windows`` windows the medians decide.

The test costs ``O(n log n)`` for ``n`` steps; no communication (every rank holds the same
slowest-rank step times, merged by :mod:`thinwire.auto.agree`).

    >>> t = Trial(old={0: "bf16"}, new={0: "int8"}, steps={"old": [0.30] * 5, "new": []})
    >>> t.judge([0.14] * 5, keep_gain=0.05, keep_p=0.05, trial_windows=3).outcome
    'keep'
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Callable, Literal


@dataclasses.dataclass(frozen=True)
class Verdict:
    outcome: Literal["keep", "revert", "again"]
    reason: str
    plan: dict[int, str]     # the choices to send with now
    now: float               # the new plan's median step
    before: float            # the old plan's median step


@dataclasses.dataclass
class Trial:
    """The plans of a trial (bucket -> codec spec) and the step times timed under each."""

    old: dict[int, str]
    new: dict[int, str]
    steps: dict[str, list[float]]   # "old"/"new" -> step times
    arm: str = "new"                # the plan timed now
    windows: int = 0

    def judge(self, window: list[float], *, keep_gain: float, keep_p: float, trial_windows: int) -> Verdict:
        """Add a window of step times under the arm timed now and judge (see the module docstring)."""
        self.steps[self.arm] += window
        self.windows += 1
        new, old = self.steps["new"], self.steps["old"]
        now, before = statistics.median(new), statistics.median(old)
        p_value = p_faster(new, old)
        faster = now <= before * (1 - keep_gain)
        measured = f"measured step {now * 1e3:.1f} ms vs {before * 1e3:.1f} ms before"
        if faster and p_value <= keep_p:
            return Verdict("keep", f"kept: {measured}", dict(self.new), now, before)
        if not faster:
            return Verdict("revert", f"reverted: {measured}, not {keep_gain:.0%} faster", dict(self.old), now, before)
        if self.windows >= trial_windows:
            reason = f"kept: {measured} over {self.windows} alternating windows (p = {p_value:.2f})"
            return Verdict("keep", reason, dict(self.new), now, before)
        self.arm = "old" if self.arm == "new" else "new"
        reason = (f"trial: {measured}, not surely faster yet (p = {p_value:.2f} > {keep_p}): "
                  f"timing the {self.arm} plan again")
        return Verdict("again", reason, dict(self.new if self.arm == "new" else self.old), now, before)

    def surely_slower(self, window: list[float], *, keep_p: float) -> Verdict | None:
        """An early look at the new plan's first steps (``window``, which count toward its window):
        reverted at once when they are slower than the old plan's steps at significance ``keep_p``
        (one-sided Mann-Whitney U, at least 3 steps each); else None, and the window goes on. A
        model that mispredicts a codec on a CPU-bound host (every step of the trial 20-40% slower)
        then costs a few steps, not a whole window."""
        self.steps["new"] += window
        new, old = self.steps["new"], self.steps["old"]
        if len(new) < 3 or len(old) < 3 or (p_value := p_faster(old, new)) > keep_p:
            return None
        now, before = statistics.median(new), statistics.median(old)
        reason = (f"reverted early: measured step {now * 1e3:.1f} ms vs {before * 1e3:.1f} ms before over the trial's "
                  f"first {len(new)} steps, surely slower (p = {p_value:.3f})")
        return Verdict("revert", reason, dict(self.old), now, before)

    def changed(self) -> dict[int, str]:
        """The buckets whose codec the trial changed, with the codec it tried."""
        return {i: c for i, c in self.new.items() if self.old.get(i) != c}


def forget_rejections(tried: dict[int, dict[str, float]], bps: float, change: float,
                      bytes_of: Callable[[int, str], int], plan: Callable[[int], str]) -> None:
    """Let a rejected codec (``tried[bucket][spec]``: the link rate when it was rejected) be tried
    again only if the link moved its way by more than ``change`` since: slower for one that sends
    fewer bytes than the bucket's ``plan`` in use, faster for one that sends more."""
    for i, rejected in tried.items():
        current = bytes_of(i, plan(i))
        for spec, then in list(rejected.items()):
            stronger = bytes_of(i, spec) < current
            moved = bps / then - 1
            if moved < -change if stronger else moved > change:
                del rejected[spec]


def p_faster(now: list[float], before: list[float]) -> float:
    """One-sided Mann-Whitney U p-value that step times ``now`` are faster than ``before``; 0.0 when
    either window has fewer than 3 steps (too few to test: the median rule alone decides).

    The normal approximation with continuity and tie corrections, as ``scipy.stats.mannwhitneyu(now,
    before, alternative="less", method="asymptotic")`` computes it (a test checks they agree).
    Written out because importing ``scipy.stats`` takes most of a second of CPU, which every
    process would pay at its first verdict, mid-training, while the other ranks wait for it."""
    n1, n2 = len(now), len(before)
    if n1 < 3 or n2 < 3:
        return 0.0
    ranks = _ranks([*now, *before])
    u = n1 * n2 - (sum(ranks[:n1]) - n1 * (n1 + 1) / 2)  # the U of ``before``: large when ``now`` is fast
    n = n1 + n2
    ties = sum(t ** 3 - t for t in collections.Counter([*now, *before]).values())
    sd = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    if sd == 0:
        return 1.0
    z = (u - n1 * n2 / 2 - 0.5) / sd
    return 0.5 * math.erfc(z / math.sqrt(2))


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
