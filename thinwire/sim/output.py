"""What ``thinwire simulate`` shows: a rich table, JSON, a scaling-curve PNG and a bucket-timeline PNG."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from thinwire.sim.sweep import Point


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def table(points: list[Point], title: str) -> Table:
    t = Table(title=title, caption="times in ms; exposed: communication not hidden behind backward; "
              "wire: bytes each rank sends per step")
    for col in ("hosts", "b/host", "step", "compute", "exposed", "codec", "wire", "speedup", "eff.", "J/step",
                "mem/rank"):
        t.add_column(col, justify="right")
    mode = points[0].sync_mode if points else "allreduce"
    if mode != "allreduce":  # the mode's own step next to allreduce's (thinwire.perf.sync)
        for col in (f"step {mode}", "wire/step", f"speedup {mode}"):
            t.add_column(col, justify="right")
    for pt in points:
        pr = pt.prediction
        extra = ([_ms(pt.sync_step_s), _bytes(pt.sync_bytes_per_step), f"{pt.sync_speedup:.3g}"]
                 if mode != "allreduce" else [])
        t.add_row(str(pt.p), f"{pt.batch_per_host:.3g}", _ms(pr.step_s), _ms(pr.compute_s), _ms(pr.exposed_comm_s),
                  _ms(pr.codec_s), _bytes(pr.bytes_per_rank), f"{pt.speedup:.3g}", f"{pt.efficiency:.0%}",
                  f"{pt.energy_step.total_j:.3g}", _bytes(pt.memory.total), *extra)
    return t


def to_json(points: list[Point], meta: dict) -> str:
    return json.dumps({**meta, "points": [p.to_dict() for p in points]}, indent=2, default=str)


def plot_scaling(points: list[Point], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = [pt.p for pt in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ps, [pt.efficiency for pt in points], marker="o")
    a.set(xscale="log", xlabel="hosts", ylabel="scaling efficiency", ylim=(0, 1.05), title="efficiency")
    comp = [pt.prediction.compute_s * 1e3 for pt in points]
    expo = [pt.prediction.exposed_comm_s * 1e3 for pt in points]
    b.stackplot(ps, comp, expo, labels=["compute (slowest host)", "exposed comm + codec"], alpha=0.8)
    b.set(xscale="log", xlabel="hosts", ylabel="ms per step", title="step time")
    b.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(point: Point, path: Path, title: str) -> Path:
    """Gantt chart of one step: forward, backward, and each bucket's encode / wire / decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = point.prediction.timeline
    n = len(tl.buckets)
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.35 * n))
    ms = 1e3
    ax.broken_barh([(0, tl.pre_s * ms)], (n + 0.6, 0.8), color="tab:gray")
    ax.broken_barh([(tl.pre_s * ms, tl.backward_s * ms)], (n + 0.6, 0.8), color="tab:blue")
    end = tl.pre_s + max(tl.backward_s, tl.last_done_s)
    ax.broken_barh([(end * ms, tl.post_s * ms)], (n + 0.6, 0.8), color="tab:green")
    for i, bk in enumerate(tl.buckets):
        y, t0 = n - 1 - i + 0.6, (tl.pre_s + bk.start_s) * ms
        ax.broken_barh([(t0, bk.encode_s * ms), (t0 + bk.encode_s * ms, bk.comm_s * ms),
                        (t0 + (bk.encode_s + bk.comm_s) * ms, bk.decode_s * ms)], (y, 0.8),
                       color=["tab:orange", "tab:red", "tab:purple"])
    ax.set_yticks([n - 1 - i + 1 for i in range(n)] + [n + 1],
                  [f"bucket {i}" for i in range(n)] + ["compute"])
    ax.set_xlabel("ms (gray: data + forward, blue: backward, green: optimizer; orange/red/purple: "
                  "encode / wire / decode)", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
