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
from collections import Counter
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
    """The readable records of ``OUT/metrics.jsonl`` (none without one); see :func:`scan_metrics`."""
    return scan_metrics(out)[0]


def scan_metrics(out: Path) -> tuple[list[dict], Counter]:
    """Every readable record of ``OUT/metrics.jsonl``, and how many lines were skipped, by reason.

    Reads a run finished, crashed or still being written, never raising on its content: a last line
    cut short (the run is writing it) is a ``partial line``, a line that is not UTF-8 a ``non-UTF-8
    line``, anything else that is not one JSON object an ``unreadable line``. Values are as written:
    a non-finite number is ``null`` (NaN) or a string such as ``"inf"``.
    """
    path = Path(out) / METRICS
    records: list[dict] = []
    skipped: Counter = Counter()
    if not path.is_file():
        return records, skipped
    lines = path.read_bytes().split(b"\n")  # after a final newline the last item is b""
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        record, why = _parse_line(raw)
        if why:
            skipped["partial line" if why == "unreadable line" and i == len(lines) - 1 else why] += 1
        else:
            records.append(record)
    return records, skipped


def _parse_line(raw: bytes) -> tuple[dict | None, str]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "non-UTF-8 line"
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):  # ValueError: bad JSON, or an integer of thousands of digits
        return None, "unreadable line"
    return (record, "") if isinstance(record, dict) else (None, "unreadable line")
