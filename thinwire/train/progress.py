"""What rank 0 shows on the console: a live progress bar and a final summary table."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class _Console(Console):
    """rich's console, but a closed stdout (``thinwire train ... | head``) ends the output, not the run: rich's
    own exits with status 1, which killed rank 0 at its next line, lost every step since the last checkpoint
    and, on several workers, read as a lost connection (each restart died the same way)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # prints after this one go nowhere too
        os.close(devnull)


console = _Console(stderr=False)


class ProgressBar:
    def __init__(self, total: int, start: int, enabled: bool, title: str) -> None:
        self.enabled = enabled
        self._p = None
        if enabled:
            self._p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                               console=console, transient=False, disable=not sys.stdout.isatty())
            self._p.start()
            self._task = self._p.add_task(title, total=total, completed=start, info="")

    def update(self, step: int, info: str) -> None:
        if self._p is not None:
            self._p.update(self._task, completed=step, info=info)

    def log(self, msg: str) -> None:
        if self.enabled:
            (self._p.console if self._p else console).print(msg)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


def summary_table(summary: dict) -> Table:
    t = Table(title="thinwire run summary", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    keys = ["out", "workload", "steps", "world_size", "samples", "wall_s", "val_loss", "val_bpb", "unigram_entropy_bits",
            "val_accuracy", "median_step_time_s", "median_comm_wait_s", "bytes_sent_total", "compression", "precision",
            "restarts"]
    for k in keys:
        if k in summary and summary[k] is not None:
            v = summary[k]
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    stages = (summary.get("pipeline") or {}).get("stage_compute")
    if stages:  # where a pipeline's step goes: each rank's compute per micro-batch, and its busy share
        t.add_row("stage compute", "\n".join(
            f"{'/'.join(map(str, r['stages']))} on {r['host']}: "
            f"{(r['forward_s_per_microbatch'] + r['backward_s_per_microbatch']) * 1e3:.1f} ms per micro-batch, "
            f"busy {r['busy']:.0%}" + (f", {r['cpu']:.2f} cores" if "cpu" in r else "") for r in stages))
    return t
