"""Plots of one or several runs from their ``metrics.jsonl`` (the output contract).

* ``loss.png``: training loss (smoothed) and validation loss against step and against wall-clock
  time, one colour per run, so a compressed run can be compared with its fp32 control.
* ``breakdown.png``: median step time of each run split into compute, communication wait and other.

Any run can be plotted, finished, crashed or still being written: what cannot be drawn (a partial
last line, a line that is not UTF-8 or not JSON, a non-finite loss written as ``null`` or ``"inf"``)
is skipped, and each run with something skipped, or no step records at all, gets one note, logged as
a warning (``thinwire report`` prints it): ``run NAME: skipped 3 non-finite losses, 1 partial line``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import Counter
from pathlib import Path

from thinwire.errors import ThinwireError
from thinwire.train.metrics import METRICS, scan_metrics

log = logging.getLogger("thinwire.report")

# how a note names n skipped things: (one, several)
NOUNS = {"partial line": ("partial line", "partial lines"), "non-UTF-8 line": ("non-UTF-8 line", "non-UTF-8 lines"),
         "unreadable line": ("unreadable line", "unreadable lines"),
         "non-finite loss": ("non-finite loss", "non-finite losses"),
         "non-finite val_loss": ("non-finite val_loss", "non-finite val_losses"),
         "record without step or wall_s": ("record without step or wall_s", "records without step or wall_s"),
         "record redone": ("record of a step trained again after a resume or restart",
                           "records of steps trained again after a resume or restart")}


@dataclasses.dataclass
class Run:
    """What a plot can use of one run: (step, wall_s, loss) points and the step-time breakdown."""

    name: str
    train: list[tuple[float, float, float]]
    val: list[tuple[float, float, float]]
    times: list[tuple[float, float, float]]  # step_time_s, compute_s, comm_wait_s
    skipped: Counter


def _num(v) -> float | None:
    """A finite number, or None (``null``, ``"inf"``, ``"nan"``, a string, a bool, a missing key)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _points(records: list[dict], key: str, skipped: Counter) -> list[tuple[float, float, float]]:
    points = []
    for r in records:
        if key not in r:
            continue
        y, step, wall = _num(r[key]), _num(r.get("step")), _num(r.get("wall_s"))
        if y is None:
            skipped[f"non-finite {key}"] += 1
        elif step is None or wall is None:
            skipped["record without step or wall_s"] += 1
        else:
            points.append((step, wall, y))
    return points


def _times(records: list[dict]) -> list[tuple[float, float, float]]:
    rows = [tuple(_num(r.get(k)) for k in ("step_time_s", "compute_s", "comm_wait_s")) for r in records
            if "step_time_s" in r]
    return [row for row in rows if None not in row]


def current(records: list[dict], skipped: Counter) -> list[dict]:
    """The records of the run as it stands: a run that stopped and went on from a checkpoint at step S (its
    ``resume``, ``restart`` or, with no checkpoint, ``start`` event) trained the steps after S again, so the
    records of those steps written before that event are dropped (counted in ``skipped``)."""
    out: list[dict] = []
    for r in records:
        if r.get("event") in ("start", "resume", "restart") and isinstance(r.get("step"), (int, float)):
            kept = [o for o in out if "event" in o or not isinstance(o.get("step"), (int, float)) or o["step"] <= r["step"]]
            if len(kept) < len(out):
                skipped["record redone"] += len(out) - len(kept)
            out = kept
        out.append(r)
    return out


def read_run(path: str) -> Run:
    folder = Path(path)
    if not folder.exists():
        raise ThinwireError(f"report: {path!r} does not exist. Pass the --out folder of a run.")
    if not (folder / METRICS).is_file():
        raise ThinwireError(f"report: {path!r} holds no metrics.jsonl. Pass the --out folder of a run.")
    records, skipped = scan_metrics(folder)
    records = current(records, skipped)
    return Run(folder.resolve().name or str(path), _points(records, "loss", skipped),
               _points(records, "val_loss", skipped), _times(records), skipped)


def distinct_names(paths: list[str]) -> list[str]:
    """Each folder's name, with as many of its parents as it takes to tell it from the others
    (``a/run`` and ``b/run``); a folder given twice keeps one name."""
    parts = [Path(p).resolve().parts for p in paths]
    names = []
    for i, mine in enumerate(parts):
        others = {q for j, q in enumerate(parts) if q != mine}
        k = 1
        while k < len(mine) and any(q[-k:] == mine[-k:] for q in others):
            k += 1
        names.append("/".join(mine[-k:]) or str(paths[i]))
    return names


def note(run: Run) -> str | None:
    """``run NAME: skipped 3 non-finite losses, 1 partial line; no step records``, or None."""
    parts = [f"{n} {NOUNS[k][n != 1]}" for k, n in sorted(run.skipped.items())]
    text = f"skipped {', '.join(parts)}" if parts else ""
    if not run.train:
        text += ("; " if text else "") + "no step records with a finite loss to plot"
    return f"run {run.name}: {text}" if text else None


def _runs(paths: list[str]) -> list[Run]:
    runs = [read_run(p) for p in paths]
    for run, name in zip(runs, distinct_names(paths)):  # two runs named `run` would share one bar and one legend
        run.name = name
    for run in runs:
        if (text := note(run)) is not None:
            log.warning(text)
    return runs


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


PLOTS = ("loss.png", "breakdown.png")  # what report writes into its folder


def report(paths: list[str], out: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(paths)
    folder = Path(out or paths[0])
    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):  # every run; past the colours, the next line style tells them apart
        color, style = colors[i % len(colors)], ("-", "--", ":", "-.")[i // len(colors) % 4]
        sm = _smooth([p[2] for p in run.train], max(1, len(run.train) // 50))
        for ax, x in ((axes[0], 0), (axes[1], 1)):
            ax.plot([p[x] for p in run.train], sm, style, color=color, alpha=0.5, lw=1, label=f"{run.name} train")
            ax.plot([p[x] for p in run.val], [p[2] for p in run.val], "o" + style, color=color, lw=2, ms=3,
                    label=f"{run.name} val")
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
    for run in runs:  # a run without step times gets an empty bar (its note says why)
        med = [statistics.median(t[i] for t in run.times) if run.times else 0.0 for i in range(3)]
        names.append(run.name)
        parts["compute"].append(med[1] * 1e3)
        parts["comm wait"].append(med[2] * 1e3)
        parts["other"].append(max(0.0, med[0] - med[1] - med[2]) * 1e3)
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
