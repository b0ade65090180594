"""The output contract every run writes, local, emulated or multi-node (rank 0 writes).

``OUT/metrics.jsonl``: one JSON object per line.

* step records: ``step``, ``loss`` (rank 0's training loss), ``samples`` (global samples so far),
  ``step_time_s``, ``compute_s`` (forward + backward + optimizer, without time blocked on
  communication), ``comm_wait_s`` (time from the last gradient being ready until backward returned,
  i.e. communication not hidden behind backward), ``bytes_sent`` (bytes rank 0 put on the wire in
  this step, counted by thinwire's collectives where they are issued), ``lr``, ``wall_s``;
  ``skipped: true`` when a non-finite gradient made the step be skipped.
* validation records: ``step``, ``samples``, ``val_loss``, plus ``val_bpb`` (language models) or
  ``val_accuracy`` (classification), ``wall_s``.
* event records: ``event`` (``start``, ``restart``, ``resume``), ``step``, ``restart_count``.

``OUT/summary.json`` at the end: ``steps``, ``world_size``, ``wall_s``, ``val_loss`` (and
``val_accuracy`` / ``val_bpb``), ``bytes_sent_total`` (rank 0), ``bytes_sent_total_all_ranks``,
``compression``, ``compression_stats`` (``counts`` over the whole run, resumes included), ``lr_horizon``,
``precision``, ``peak_memory_bytes``, ``precision_report`` (which layers run in
int8, the micro-batch plan under a memory budget), ``restarts``, ``workload`` info and the resolved
``config``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


class MetricsWriter:
    """Appends records to ``metrics.jsonl``; a no-op on ranks other than 0."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.enabled = enabled
        self._f = open(out / METRICS, "a", buffering=1) if enabled else None

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None


def write_summary(out: Path, summary: dict) -> None:
    tmp = out / (SUMMARY + ".tmp")
    tmp.write_text(json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2, default=str))
    os.replace(tmp, out / SUMMARY)


def read_metrics(out: Path) -> list[dict]:
    path = Path(out) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
