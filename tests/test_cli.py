"""The CLI refuses bad input with one clear paragraph, a non-zero exit, and nothing overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def thinwire(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def assert_refused(proc: subprocess.CompletedProcess, pattern: str) -> None:
    import re

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert re.search(pattern, proc.stderr), proc.stderr


@pytest.mark.parametrize("args, pattern", [
    (["--nproc", "0"], r"nproc: must be an integer in \[1, 4096\], got 0"),
    (["--data", "/nonexistent/corpus"], r"data: path '/nonexistent/corpus' does not exist"),
    (["--workload", "digits", "--nproc", "3"], r"batch_size: must be divisible by the number of workers \(3\).*got 64. Use 66 or 63"),
    (["--workload", "nosuch"], r"workload: must be one of charlm, digits or package.module:function, got 'nosuch'"),
    (["--workload", "digits", "--set", "model.depth=3"], r"model.depth: must be one of the known fields"),
    (["--compression", "zstd"], r"compression: must be one of .*none.*got 'zstd'"),
])
def test_bad_input_is_refused(tmp_path, args, pattern):
    proc = thinwire("train", *args, "--out", str(tmp_path / "run"))
    assert_refused(proc, pattern)
    assert not (tmp_path / "run").exists()


CLUSTER_YAML = str(ROOT / "examples" / "clusters" / "pair-100mbit.yaml")


@pytest.mark.parametrize("command, args, kind", [
    ("train", ["--workload", "digits", "--steps", "2"], "folder"),
    ("profile", ["--workload", "digits", "--batch-sizes", "8"], "file"),
    ("plan", ["--workload", "digits", "--cluster", CLUSTER_YAML], "file"),
    ("simulate", ["--workload", "digits", "--cluster", CLUSTER_YAML], "folder"),
    ("doctor", ["--workload", "digits"], "folder"),
])
def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, command, args, kind):
    """A profile or a doctor run took its minutes, then died with a traceback on a path it could not write."""
    (tmp_path / "a_file").write_text("kept")
    proc = thinwire(command, *args, "--out", str(tmp_path / "a_file" / "out"))
    assert_refused(proc, rf"out: must be a {kind} that can be written, got '{tmp_path / 'a_file' / 'out'}'\. "
                         rf"'{tmp_path / 'a_file'}' cannot take new files \(it is not a folder\)")
    assert (tmp_path / "a_file").read_text() == "kept" and [p.name for p in tmp_path.iterdir()] == ["a_file"]
    if kind == "file":
        assert_refused(thinwire(command, *args, "--out", str(tmp_path)), rf"out: must be a file to write, got '{tmp_path}'")


def test_empty_data_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(thinwire("train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "r")),
                   r"data: folder '.*empty' holds no text files")
    (tmp_path / "tiny.txt").write_text("abc")
    assert_refused(thinwire("train", "--data", str(tmp_path / "tiny.txt"), "--out", str(tmp_path / "r")),
                   r"data: corpus '.*tiny.txt' has 3 bytes; charlm needs at least")


def test_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert_refused(thinwire("train", "--workload", "digits", "--out", str(out)), r"out: folder .* already holds a run")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.slow
def test_corrupt_checkpoint_and_foreign_model(tmp_path):
    out = tmp_path / "run"
    ok = thinwire("train", "--workload", "digits", "--steps", "4", "--checkpoint-every", "2", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    ckpt = sorted((out / "checkpoints").glob("step_*.pt"))[-1]
    assert_refused(thinwire("train", "--resume", str(out), "--workload", "digits", "--set", "model.channels=8", "--steps", "6"),
                   r"checkpoint .* belongs to a different model \(shape of conv1.weight")
    good = ckpt.read_bytes()
    ckpt.write_bytes(good[: len(good) // 2])
    assert_refused(thinwire("train", "--resume", str(out), "--steps", "6"), r"checkpoint .* is corrupt or truncated")
    assert ckpt.read_bytes() == good[: len(good) // 2]  # left as it was
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4


@pytest.mark.slow
def test_digits_two_workers_reach_95_percent(tmp_path):
    """The issue's acceptance run: digits, 2 workers through torchrun's agent, 300 steps."""
    out = tmp_path / "digits"
    proc = thinwire("train", "--workload", "digits", "--nproc", "2", "--steps", "300", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 300
    assert summary["val_accuracy"] >= 0.95
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    assert len(steps) == 300
    for key in ("loss", "samples", "step_time_s", "compute_s", "comm_wait_s", "bytes_sent"):
        assert key in steps[-1]
    # 2 ranks ring all-reduce fp32 gradients: 2*(p-1)/p * 4 bytes per parameter per step = 4 bytes/param
    params = sum(p.numel() for p in torch.load(sorted((out / "checkpoints").glob("*.pt"))[-1], weights_only=True)["model"].values())
    assert steps[-1]["bytes_sent"] == params * 4
