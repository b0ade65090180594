"""``thinwire report`` draws loss and breakdown plots from several runs' metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from thinwire.errors import ThinwireError
from thinwire.report import report


def _run(folder, scale):
    folder.mkdir()
    lines = [{"event": "start", "step": 0}]
    for s in range(1, 41):
        lines.append({"step": s, "loss": scale / s, "samples": 32 * s, "wall_s": 0.1 * s, "step_time_s": 0.1,
                      "compute_s": 0.06, "comm_wait_s": 0.03 * scale, "bytes_sent": 100})
        if s % 10 == 0:
            lines.append({"step": s, "samples": 32 * s, "wall_s": 0.1 * s, "val_loss": scale / s + 0.1})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(l) for l in lines) + "\n")


def test_report_writes_pngs(tmp_path):
    _run(tmp_path / "a", 1.0)
    _run(tmp_path / "b", 2.0)
    paths = report([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "plots"))
    assert [p.name for p in paths] == ["loss.png", "breakdown.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_report_refuses_folder_without_metrics(tmp_path):
    with pytest.raises(ThinwireError, match=r"report: '.*' holds no metrics.jsonl"):
        report([str(tmp_path)])
