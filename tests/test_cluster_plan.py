"""``thinwire plan`` then ``thinwire train --plan`` on the emulated cluster it was made for (root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from tests.test_cli import ROOT, thinwire
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec

pytestmark = [
    pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"),
]


def test_plan_then_train_with_it(tmp_path):
    spec = tmp_path / "spec.yaml"
    # a batch of 60 digits is fastest on one host (which `train --plan` runs as well), and 600 at 50 Mbit/s on a
    # fast machine (CI: 62 ms alone, 82 on two hosts): 600 at 1 Gbit/s takes several
    spec.write_text(f"name: tp{os.getpid()}\ndefaults: {{bandwidth: 1gbit}}\nhosts:\n"
                    "  - {name: fast0, cpu: 0.8}\n  - {name: fast1, cpu: 0.8}\n  - {name: slow, cpu: 0.2}\n")
    plan = tmp_path / "plan.yaml"
    # the plan profiles the cluster (about 60 s alone): a loaded machine took over 300 s (a run beside CI's)
    made = thinwire("plan", "--cluster", str(spec), "--workload", "digits", "--batch-size", "600", "--out", str(plan),
                    timeout=900)
    assert made.returncode == 0, made.stderr[-2000:]
    chosen = yaml.safe_load(plan.read_text())["chosen"]
    assert len(chosen["hosts"]) >= 2, chosen
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    try:
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--plan", str(plan),
                               "--workload", "digits", "--steps", "40", "--eval-every", "40", "--threads", "1",
                               "--out", str(out)], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        c.down()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == len(chosen["hosts"])
    assert summary["samples"] == 40 * 600
    assert summary["compression"].startswith("plan[")
    wrong = thinwire("train", "--cluster", str(spec), "--plan", str(plan), "--workload", "charlm", "--out", str(tmp_path / "x"))
    assert wrong.returncode == 2 and "was made for another workload" in wrong.stderr


def test_profile_cluster_probes_measure_each_hosts_speed_and_the_hand_off_latency(tmp_path):
    """What ``thinwire profile --cluster`` adds for the models: every host's step speed with all hosts computing
    at once (a quota'd host runs at most its quota), and a point-to-point message's one-way time."""
    from thinwire.cluster.bench import _run_workers
    from thinwire.measure.hostspeed import host_speeds

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: hs{os.getpid()}\ndefaults: {{bandwidth: 1gbit}}\nhosts:\n"
                    "  - {name: half, cpu: 0.5}\n  - {name: fifth, cpu: 0.2}\n")
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    try:
        # a step shorter than a quota's 10 ms window (about 1.5 ms here): most steps fit between two pauses, so
        # the pace is the loop's time over its steps; a median step read the half-core host at 0.7-1.0
        rec = host_speeds(c, workload="digits", model={"hidden": 8}, data=None, batch=2, steps=8)
        one_way = _run_workers(c, ["half", "fifth"], [4], 9, 120.0, p2p=True)["one_way"]
    finally:
        c.down()
    assert rec.cluster == f"hs{os.getpid()}" and set(rec.speed) == {"half", "fifth"}
    # a quota is a ceiling (without one each host runs at ~1.0 here); the full-core reference is timed on the
    # same VM, which may be busy: 0.75 leaves it half the quota again
    assert 0 < rec.speed["fifth"] < rec.speed["half"] < 0.75
    assert rec.speed["fifth"] <= 0.65 * rec.speed["half"]
    assert len(one_way) == 9 and all(0 < t < 0.05 for t in one_way)


def test_host_speed_probe_on_a_host_too_small_for_the_step_names_its_memory_at_once(tmp_path):
    """The probe runs the whole model's step on every host; one killed by its memory limit stops the probe at
    once (the others would wait on the barrier) with an error that names the host, its limit and the fix."""
    from thinwire.errors import ThinwireError
    from thinwire.measure.hostspeed import host_speeds

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: hm{os.getpid()}\ndefaults: {{bandwidth: 1gbit, cpu: 0.5}}\nhosts:\n"
                    "  - {name: big}\n  - {name: small, memory: 96MiB}\n")
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    t0 = time.monotonic()
    try:
        with pytest.raises(ThinwireError, match=r"memory limit killed the step on small's 96 MiB.*--no-host-speed"):
            host_speeds(c, workload="digits", model={"hidden": 32}, data=None, batch=16, steps=8)
    finally:
        c.down()
    assert time.monotonic() - t0 < 120
