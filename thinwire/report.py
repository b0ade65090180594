"""Plots of one or several runs from their ``metrics.jsonl`` (the output contract).

* ``loss.png``: training loss (smoothed) and validation loss against step and against wall-clock
  time, one colour per run, so a compressed run can be compared with its fp32 control.
* ``breakdown.png``: median step time of each run split into compute, communication wait and other.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from thinwire.errors import ThinwireError
from thinwire.train.metrics import read_metrics


def _runs(paths: list[str]) -> list[tuple[str, list[dict]]]:
    runs = []
    for p in paths:
        records = read_metrics(Path(p))
        if not records:
            raise ThinwireError(f"report: {p!r} holds no metrics.jsonl with records. Pass the --out folder of a run.")
        runs.append((Path(p).name, records))
    return runs


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def report(paths: list[str], out: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(paths)
    folder = Path(out or paths[0])
    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (name, recs), color in zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        steps = [r for r in recs if "loss" in r and "step" in r]
        vals = [r for r in recs if "val_loss" in r]
        sm = _smooth([r["loss"] for r in steps], max(1, len(steps) // 50))
        for ax, x in ((axes[0], "step"), (axes[1], "wall_s")):
            ax.plot([r[x] for r in steps], sm, color=color, alpha=0.5, lw=1, label=f"{name} train")
            ax.plot([r[x] for r in vals], [r["val_loss"] for r in vals], "o-", color=color, lw=2, ms=3, label=f"{name} val")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall-clock time (s)")
    for ax in axes:
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    loss_png = folder / "loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)
    return [loss_png, _breakdown(runs, folder, plt)]


def _breakdown(runs, folder: Path, plt) -> Path:
    names, parts = [], {"compute": [], "comm wait": [], "other": []}
    for name, recs in runs:
        steps = [r for r in recs if "step_time_s" in r]
        med = {k: statistics.median(r[k] for r in steps) for k in ("step_time_s", "compute_s", "comm_wait_s")}
        names.append(name)
        parts["compute"].append(med["compute_s"] * 1e3)
        parts["comm wait"].append(med["comm_wait_s"] * 1e3)
        parts["other"].append(max(0.0, med["step_time_s"] - med["compute_s"] - med["comm_wait_s"]) * 1e3)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names) + 3), 4))
    bottom = [0.0] * len(names)
    for label, values in parts.items():
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("median step time (ms)")
    ax.legend()
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    path = folder / "breakdown.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
