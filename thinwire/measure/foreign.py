"""How much CPU other processes used while a validation run measured: a shared machine's noise, made visible.

An emulated cluster shares this machine's cores; any other busy process slows its hosts beyond
what the spec says, and the measured step time with them. :class:`ForeignCpu` compares the
machine's busy time (``user + nice + system`` of ``/proc/stat``; interrupt time, mostly our own
packets, is left out) with this process tree's own CPU time (``utime + stime + cutime + cstime`` of
``/proc/self/stat``: once the run's processes are reaped their time is included), and reports the
difference as the cores other processes used on average. Short-lived processes (a test suite's
workers) are counted too, which sampling ``/proc/PID`` would miss.
"""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK")


WARN_CORES = 0.25  # other processes' average cores while measuring above which profile and doctor warn


def busy_warning(cores: float, what: str) -> str | None:
    """The warning a measurement gets when other processes used ``cores`` meanwhile (None: quiet enough)."""
    if cores <= WARN_CORES:
        return None
    return (f"Other processes used {cores:.1f} of this machine's {os.cpu_count()} cores on average while {what}: its "
            "step and codec times are likely slower and noisier than this machine's own, and so is what is made from "
            "them. Run it again when the machine is quiet.")


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system = (int(v) for v in fields[:3])
    return (user + nice + system) / _TICK


def own_tree_s() -> float:
    """CPU seconds of this process and its reaped descendants."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ForeignCpu:
    """``with ForeignCpu() as fc: run and reap the children``; then ``fc.cores``: others' average cores."""

    def __enter__(self) -> "ForeignCpu":
        self.t0, self.busy0, self.own0, self.cores = time.monotonic(), machine_busy_s(), own_tree_s(), 0.0
        return self

    def sample(self) -> None:
        """Kept for callers that poll; the totals need no sampling."""

    def __exit__(self, *exc) -> None:
        foreign = (machine_busy_s() - self.busy0) - (own_tree_s() - self.own0)
        self.cores = max(0.0, foreign) / max(1e-9, time.monotonic() - self.t0)


def wait_quiet(max_cores: float, *, window_s: float = 5.0, timeout_s: float = 600.0) -> float:
    """Wait until other processes use at most ``max_cores`` over a ``window_s`` window (or give up after
    ``timeout_s``); returns the last window's foreign cores."""
    deadline = time.monotonic() + timeout_s
    while True:
        with ForeignCpu() as fc:
            time.sleep(window_s)
        if fc.cores <= max_cores or time.monotonic() > deadline:
            return fc.cores
