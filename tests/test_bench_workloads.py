"""The benchmarks' own workload that is neither charlm nor digits (``benchmarks/workloads/denoise.py``): its data
split, its fixed noise, its checked options, and that it learns; and that `thinwire train` runs it as a
user's ``package.module:function`` workload."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from thinwire.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import denoise  # noqa: E402


def test_train_and_validation_patches_never_share_a_pixel_and_the_noise_is_fixed():
    wl = denoise.build(patch=8, stride=8)
    assert max(c + 8 for _, _, c in wl.train.corners) <= denoise.TRAIN_COLS < denoise.VAL_FROM
    assert min(c for _, _, c in wl.val.corners) >= denoise.VAL_FROM
    again = denoise.build(patch=8, stride=8)
    x1, y1 = wl.train.batch([0, 5, 7])
    x2, y2 = again.train.batch([0, 5, 7])
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(wl.train[5][0], x1[1])
    # the noisy input itself scores about noise^2
    x, y = wl.val.batch(list(range(len(wl.val))))
    assert torch.nn.functional.mse_loss(x, y).item() == pytest.approx(0.01, rel=0.05)


@pytest.mark.parametrize("opts, field", [({"width": 0}, "model.width"), ({"depth": 1}, "model.depth"),
                                         ({"patch": 5}, "model.patch"), ({"stride": 0}, "model.stride"),
                                         ({"noise": 0}, "model.noise")])
def test_bad_options_are_refused_naming_the_field(opts, field):
    with pytest.raises(ConfigError, match=field):
        denoise.build(**opts)


def test_a_few_steps_lower_the_validation_loss():
    torch.manual_seed(0)
    wl = denoise.build(width=16, depth=3)
    opt = torch.optim.Adam(wl.model.parameters(), lr=3e-3)
    xv, yv = wl.val.batch(list(range(0, len(wl.val), 7)))
    with torch.no_grad():
        before = wl.loss(wl.model(xv), yv).item()
    for step in range(40):
        x, y = wl.train.batch([(step * 32 + i) % len(wl.train) for i in range(32)])
        opt.zero_grad()
        wl.loss(wl.model(x), y).backward()
        opt.step()
    with torch.no_grad():
        assert wl.loss(wl.model(xv), yv).item() < 0.7 * before


def test_thinwire_train_runs_it_as_a_user_workload(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", "benchmarks.workloads.denoise:build",
                           "--set", "model.width=8", "--set", "model.depth=3", "--steps", "6", "--eval-every", "6",
                           "--nproc", "2", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2
    assert summary["workload"] == "benchmarks.workloads.denoise:build"
    # a validation pass over the workload's own set ran: a finite MSE on pixels in [0, 1] (learning is tested above)
    assert math.isfinite(summary["val_loss"]) and 0 < summary["val_loss"] < 1
