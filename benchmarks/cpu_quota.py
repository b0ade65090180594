"""How faithfully a CPU quota emulates a slower host: bursts of CPU work with idle gaps between them.

A training step on an emulated host is a burst of CPU work followed by a wait for the network. A
host at ``cpu`` cores should take ``work / cpu`` for each burst. The kernel's CFS bandwidth control
lets a group spend its quota at the start of each period, so after an idle gap a burst runs at
full speed until the quota is used. This script runs bursts of ``--work-ms`` CPU milliseconds
separated by ``--gaps`` idle milliseconds in a cgroup at ``--cpu`` cores, once with the emulator's
own limits (``thinwire.cluster.cgroup``, a 10 ms period) and once with the kernel's default 100 ms
period, and reports the median wall time per burst against the ideal ``work / cpu``.

Needs root (cgroups). Results: ``benchmarks/results/cpu_quota.md``. Usage::

    sudo .venv/bin/python benchmarks/cpu_quota.py          # about 30 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from thinwire.cluster.cgroup import HostCgroups

CHILD = textwrap.dedent("""
    import statistics, sys, time
    work, gap, n = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, int(sys.argv[3])
    walls = []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        while time.process_time() - c < work:
            pass
        walls.append(time.perf_counter() - t)
        time.sleep(gap)
    print(statistics.median(walls[3:]))
""")


def burst_wall(procs_files: list[str], work_ms: float, gap_ms: float, bursts: int) -> float:
    def join():
        for f in procs_files:
            Path(f).write_text(str(os.getpid()))
    out = subprocess.run([sys.executable, "-c", CHILD, str(work_ms), str(gap_ms), str(bursts)], preexec_fn=join,
                         capture_output=True, text=True, check=True)
    return float(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", type=float, default=0.25)
    ap.add_argument("--work-ms", type=float, default=48.0)
    ap.add_argument("--gaps", default="20,60", help="idle milliseconds between bursts, comma-separated")
    ap.add_argument("--bursts", type=int, default=25)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cpu_quota.md"))
    a = ap.parse_args()
    groups = HostCgroups(f"quota{os.getpid()}")
    groups.require("cpu", "--cpu")
    cpu = groups.controllers["cpu"]
    ideal = a.work_ms / a.cpu
    rows = []
    try:
        groups.create("h", a.cpu, None)
        d = cpu.parent / groups.dirname / "h"
        emulator = {f: (d / f).read_text().strip() for f in cpu.limit_files(a.cpu, None)}
        kernel_default = ({"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": str(round(a.cpu * 100_000))}
                          if cpu.version == 1 else {"cpu.max": f"{round(a.cpu * 100_000)} 100000"})
        for label, files in (("thinwire emulator", emulator), ("kernel default period", kernel_default)):
            for f, v in files.items():
                (d / f).write_text(v)
            for gap in (float(g) for g in a.gaps.split(",")):
                wall = burst_wall(groups.procs_files("h"), a.work_ms, gap, a.bursts) * 1e3
                rows.append((label, " ".join(f"{k}={v}" for k, v in files.items()), gap, wall))
                print(f"{label}: gap {gap:.0f} ms -> {wall:.0f} ms per burst (ideal {ideal:.0f})", flush=True)
    finally:
        groups.remove()
    lines = ["# CPU quota fidelity: bursts of CPU work between idle gaps", "",
             "Command: `sudo .venv/bin/python benchmarks/cpu_quota.py`  ",
             f"A cgroup at {a.cpu} cores (cgroup v{cpu.version}); bursts of {a.work_ms:.0f} ms of CPU work, median of "
             f"{a.bursts - 3}. Ideal wall time per burst: {ideal:.0f} ms.", "",
             "| limits | setting | idle gap (ms) | wall per burst (ms) | of ideal |", "|---|---|---:|---:|---:|"]
    lines += [f"| {lab} | `{s}` | {g:.0f} | {w:.0f} | {w / ideal:.2f} |" for lab, s, g, w in rows]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
