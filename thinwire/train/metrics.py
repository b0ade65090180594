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

With ``tensorboard`` (``--tensorboard``) rank 0 also writes every record to TensorBoard event files
under ``OUT/tensorboard`` (``tensorboard --logdir OUT``): numbers of step records as ``train/KEY``,
of validation records as ``val/KEY``, both at the record's step; events (restarts, ``auto``'s
decisions) as text under ``events``.

``OUT/summary.json`` at the end: ``steps``, ``world_size`` (at the end), ``world_sizes`` (``[step, size]`` where
the run started and wherever a resume or an elastic restart changed it), ``wall_s``, ``val_loss`` (and
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

from thinwire.errors import ConfigError, ThinwireError, cannot_write

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


TENSORBOARD = "tensorboard"


def check_tensorboard() -> None:
    """``--tensorboard`` needs the ``tensorboard`` package (an optional extra): say how to get it."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("tensorboard", True, "used with the tensorboard package installed",
                          "pip install 'thinwire[tensorboard]' (or pip install tensorboard), or drop --tensorboard.") from None


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` (and TensorBoard event files with ``tensorboard``); a no-op
    on ranks other than 0."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool = False) -> None:
        self.enabled = enabled
        self._f = open(out / METRICS, "a", buffering=1) if enabled else None
        if self._f is not None and self._f.tell() > 0:  # a record cut short by a crash: the next starts a line
            with open(out / METRICS, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._f.write("\n")
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out / TENSORBOARD))

    def resumed_at(self, step: int) -> None:
        """A run resumed from ``step``: TensorBoard hides what an earlier process logged after it (the steps this
        one trains again), as :func:`thinwire.report.current` drops them from the plots."""
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = self._tb.log_dir
            self._tb.close()
            self._tb = SummaryWriter(log_dir=log_dir, purge_step=step + 1)

    def write(self, record: dict) -> None:
        if self._f is not None:
            try:
                if os.fstat(self._f.fileno()).st_nlink == 0:  # unlinked: the records would go nowhere, silently
                    raise ThinwireError(
                        f"{self._f.name} was deleted while this run wrote it (its run folder removed, or the file): "
                        "the run stopped rather than train on into records and checkpoints nobody keeps. Train "
                        "again into a new --out, or --resume a copy of the folder.")
                self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            except OSError as e:
                raise cannot_write(self._f.name, e) from None
        if self._tb is not None:
            self._board(record)

    def _board(self, record: dict) -> None:
        step = int(record.get("step", 0))
        if "event" in record:
            self.board_text("events", record, step)
            return
        group = "val" if any(k.startswith("val_") for k in record) else "train"
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._tb.add_scalar(f"{group}/{k}", v, step)

    def board_text(self, tag: str, record: dict, step: int) -> None:
        """``record`` as text under ``tag`` in the TensorBoard files (nothing without them)."""
        if self._tb is not None:
            self._tb.add_text(tag, json.dumps({k: _clean(v) for k, v in record.items()}, default=str), step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None


def write_summary(out: Path, summary: dict) -> None:
    tmp = out / (SUMMARY + ".tmp")
    try:
        tmp.write_text(json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2, default=str))
        os.replace(tmp, out / SUMMARY)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise cannot_write(out / SUMMARY, e) from None


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
