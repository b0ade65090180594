"""Resume is exact and a killed worker costs only the steps since the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_cli import ROOT, thinwire

pytestmark = pytest.mark.slow


def _final_model(out: Path) -> dict:
    path = sorted((out / "checkpoints").glob("step_*.pt"))[-1]
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("nproc, compression", [(1, "none"), (2, "topk:ratio=0.05")])
def test_resume_is_bit_identical(tmp_path, nproc, compression):
    common = ["--workload", "digits", "--nproc", str(nproc), "--compression", compression, "--eval-every", "5"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert thinwire("train", *common, "--steps", "12", "--out", str(straight)).returncode == 0
    first = thinwire("train", *common, "--steps", "6", "--out", str(split))
    assert first.returncode == 0, first.stderr
    second = thinwire("train", "--resume", str(split), "--steps", "12")
    assert second.returncode == 0, second.stderr
    a, b = _final_model(straight), _final_model(split)
    assert a["step"] == b["step"] == 12
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for ra, rb in zip(a["ranks"], b["ranks"]):  # error-feedback residuals continue identically
        for key, res in ra["comm"]["residuals"]["params"].items():
            assert torch.equal(res, rb["comm"]["residuals"]["params"][key]), key
    if compression != "none":
        assert a["ranks"][0]["comm"]["residuals"]["params"], "top-k must have left residuals"
    events = [json.loads(l).get("event") for l in (split / "metrics.jsonl").read_text().splitlines()]
    assert events.count("resume") == 1


def _worker_pids(config: Path) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"thinwire.train.worker" in cmd and str(config).encode() in cmd:
                pids.append(int(entry))
    return pids


def _last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(l).get("step", 0) for l in path.read_text().splitlines() if l.strip()]
    return max(steps, default=0)


def test_sigkill_worker_restarts_from_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--workload", "digits", "--nproc", "2",
                             "--max-restarts", "1", "--steps", "400", "--checkpoint-every", "50",
                             "--eval-every", "100", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 180
    while _last_step(out) < 120 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    victims = _worker_pids(out / "config.yaml")
    assert len(victims) == 2 and _last_step(out) < 400, "workers should be running mid-run"
    killed_at = _last_step(out)
    os.kill(victims[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 400 and summary["restarts"] == 1
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    restart = [r for r in records if r.get("event") == "restart"]
    assert len(restart) == 1
    assert killed_at - 50 <= restart[0]["step"] <= killed_at and restart[0]["step"] % 50 == 0
    final = _final_model(out)
    assert final["step"] == 400 and len(final["ranks"]) == 2
    assert not list((out / "checkpoints").glob(".*.tmp"))
