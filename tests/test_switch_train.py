"""``thinwire train --cluster SPEC --aggregation switch`` on an emulated cluster with an aggregator on its
switch (spec ``switch:``): int8 buckets summed there; the run ends, the aggregator's log counts the
buckets, and the loss matches the same run around the ring. A dead aggregator stops the run with an error
naming it. Needs root; skipped elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import ROOT
from thinwire.cluster.emulator import AGGREGATOR_GROUP, EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec

pytestmark = [
    pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"),
]


@pytest.fixture
def cluster(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: sw{os.getpid()}\ndefaults: {{bandwidth: 200mbit, cpu: 0.5}}\nswitch: {{cpu: 0.3}}\n"
                    "hosts:\n  - {name: h0}\n  - {name: h1}\n  - {name: h2}\n")
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    yield spec, c
    c.down()


def _train(spec: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "digits",
            "--compression", "int8", "--steps", "60", "--eval-every", "60", "--threads", "1", "--batch-size", "63",
            "--set", "timeout_s=20", "--out", str(out), *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_switch_aggregation_trains_like_the_ring(cluster, tmp_path):
    spec, c = cluster
    assert c.cgroups.limits(AGGREGATOR_GROUP)[0] == pytest.approx(0.3)
    runs = {}
    for how in ("switch", "ring"):
        proc = _train(spec, tmp_path / how, "--aggregation", how)
        _, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
        runs[how] = json.loads((tmp_path / how / "summary.json").read_text())
    log = (tmp_path / "switch" / "hosts" / "switch.log").read_text()
    assert "generation 0 done" in log, log[-2000:]
    served = int(log.split("generation 0 done, ")[1].split()[0])
    assert served >= 58  # every int8 bucket of steps 3..60 (the first 2 steps go in fp32, around the ring)
    # the same int8 rounding, summed in one place instead of around the ring: the same loss within noise
    assert abs(runs["switch"]["val_loss"] / runs["ring"]["val_loss"] - 1) < 0.05, (runs["switch"]["val_loss"], runs["ring"]["val_loss"])
    # each host sends its payload once instead of 2(p-1)/p = 1.33 times
    assert runs["switch"]["bytes_sent_total"] < 0.85 * runs["ring"]["bytes_sent_total"]


def test_a_dead_aggregator_stops_the_run_naming_it(cluster, tmp_path):
    spec, c = cluster
    proc = _train(spec, tmp_path / "run", "--aggregation", "switch", "--steps", "3000")
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(2)
    for pid in c.cgroups.pids(AGGREGATOR_GROUP):
        os.kill(pid, 9)
    t0 = time.time()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 60
    assert "aggregator on the switch stopped" in err and "last checkpoint is kept" in err, err[-3000:]


def test_with_restarts_left_a_dead_aggregator_costs_one_and_the_run_finishes_on_the_ring(cluster, tmp_path):
    spec, c = cluster
    out = tmp_path / "run"
    proc = _train(spec, out, "--aggregation", "switch", "--steps", "400", "--checkpoint-every", "20",
                  "--max-restarts", "1")
    deadline = time.time() + 120
    while time.time() < deadline and not any(
            json.loads(l).get("step", 0) >= 30 for l in ((out / "metrics.jsonl").read_text().splitlines(keepends=True)
                                                         if (out / "metrics.jsonl").exists() else []) if l.endswith("\n")):
        time.sleep(0.2)
    for pid in c.cgroups.pids(AGGREGATOR_GROUP):
        os.kill(pid, 9)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 400 and (out / "config-ring.yaml").exists()
    assert summary["restarts"] == 1  # the fallback's, though torchelastic's count started again
    events = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"event"' in l]
    resumed = [e for e in events if e["event"] in ("resume", "restart")]
    assert resumed and resumed[-1]["step"] >= 20  # from the last checkpoint, not from scratch
    starts = (out / "hosts" / "h1.log").read_text().count("--- thinwire: h1's agent started")
    assert starts == 2, starts  # the first attempt's lines are kept


def test_auto_with_the_switch_sends_through_the_aggregator_exactly_the_buckets_it_chose_to(cluster, tmp_path):
    """``--compression auto --aggregation switch`` on charlm (one 446K-value bucket, link-bound at 200 Mbit/s:
    the switch sends 1.33x fewer bytes than int8's ring at 3 hosts): auto's first decision sends int8 through
    the switch, the run ends, every decision names a candidate by route, and the aggregator summed buckets
    if and only if some decision sent int8 through it."""
    spec, _ = cluster
    out = tmp_path / "auto"
    proc = _train(spec, out, "--aggregation", "switch", "--compression", "auto:candidates=none|int8",
                  "--workload", "charlm", "--batch-size", "24")
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    decisions = summary["auto_decisions"]
    chosen = {c for d in decisions for c in d["choices"].values()}
    assert decisions and chosen <= {"none", "int8", "int8@switch"}, decisions
    assert decisions[0]["choices"] == {"0": "int8@switch"}, decisions  # the model prices the route it can take
    log = (out / "hosts" / "switch.log").read_text()
    served = int(log.split("generation 0 done, ")[1].split()[0])
    assert served > 0 and (served > 0) == ("int8@switch" in chosen), (served, decisions)
