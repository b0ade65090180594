"""Training over the emulated links, and what happens when a host's link is cut mid-run.

Needs root; skipped elsewhere. The run uses a 10 s collective timeout so a cut link must end it
with an error naming the host within 20 s, its last checkpoint must load, and with
``--max-restarts`` and the link restored the job must finish.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_cli import ROOT
from thinwire.cluster import netns
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec
from thinwire.train import checkpoint as ckpt

pytestmark = [
    pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"),
]

TIMEOUT = 10


@pytest.fixture
def cluster(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: tf{os.getpid()}\ndefaults: {{bandwidth: 200mbit, cpu: 1.0}}\nhosts:\n  - {{name: h0}}\n  - {{name: h1}}\n")
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    yield spec, c
    c.down()
    assert not c.is_up()


def _start(spec: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "digits",
            "--steps", "300", "--checkpoint-every", "20", "--eval-every", "100", "--threads", "1",
            "--set", f"timeout_s={TIMEOUT}", "--out", str(out), *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_step(out: Path, step: int, proc: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and any(json.loads(l).get("step", 0) >= step for l in path.read_text().splitlines(keepends=True) if l.endswith("\n") and l.strip()):
            return
        time.sleep(0.2)
    raise AssertionError(f"run did not reach step {step}: {proc.poll()}")


def test_train_over_emulated_links(cluster, tmp_path):
    spec, _ = cluster
    out = tmp_path / "run"
    proc = _start(spec, out, "--compression", "int8")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_accuracy"] > 0.9
    assert summary["bytes_sent_total"] > 0 and (out / "hosts" / "h1.log").exists()


def test_a_second_job_on_a_busy_cluster_is_refused_in_one_line(cluster, tmp_path):
    """Its agents met the first job's rendezvous port taken (EADDRINUSE) and printed pages of tracebacks."""
    from tests.test_cli import assert_refused, thinwire

    spec, c = cluster
    other = next(h for h in c.hosts() if h.name == "h1").spawn(["sleep", "60"])
    try:
        assert_refused(thinwire("train", "--cluster", str(spec), "--workload", "digits", "--out", str(tmp_path / "run")),
                       rf"cluster: tf{os.getpid()} is running another job \(h1: pid [0-9]+.*\); wait for it")
    finally:
        other.kill()
        other.wait()
    assert not (tmp_path / "run").exists()


def test_cut_link_fails_fast_naming_the_host(cluster, tmp_path):
    spec, c = cluster
    out = tmp_path / "run"
    proc = _start(spec, out)
    _wait_step(out, 45, proc)
    c.set_link("h1", False)
    cut = time.time()
    _, err = proc.communicate(timeout=120)
    elapsed = time.time() - cut
    c.set_link("h1", True)
    assert proc.returncode == 2, err[-2000:]
    assert elapsed <= 2 * TIMEOUT, f"took {elapsed:.1f} s to notice the cut link"
    assert "h1" in err and "link down" in err, err[-2000:]
    last = ckpt.latest(out)
    assert last is not None and ckpt.load(last)["step"] >= 40


def test_restarts_after_link_restored(cluster, tmp_path):
    spec, c = cluster
    out = tmp_path / "run"
    proc = _start(spec, out, "--max-restarts", "2")
    _wait_step(out, 45, proc)
    c.set_link("h1", False)
    time.sleep(TIMEOUT + 3)  # the stuck collective times out meanwhile
    c.set_link("h1", True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["restarts"] >= 1
    events = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if "event" in l]
    assert any(e["event"] == "restart" for e in events)


def _left_in_hosts(c: EmulatedCluster) -> list[int]:
    """Processes still inside the hosts' namespaces or cgroups."""
    pids = set()
    for h in c.hosts():
        pids |= set(netns.run("ip", "netns", "pids", h.namespace, check=False).split())
        for procs in h.cgroup_procs:
            pids |= set(Path(procs).read_text().split())
    return sorted(map(int, pids))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_stop_signal_leaves_nothing_running_in_the_hosts(cluster, tmp_path, signum):
    """SIGTERM/SIGHUP to `train --cluster` stop every host's agent and worker; the cluster stays up as
    `thinwire cluster up` left it, and the checkpoints written so far load."""
    spec, c = cluster
    out = tmp_path / "run"
    proc = _start(spec, out)
    try:
        _wait_step(out, 25, proc)
        proc.send_signal(signum)
        proc.wait(timeout=60)  # thinwire itself; its output pipe may stay open while hosts run on
        deadline = time.monotonic() + 5  # the kernel drops exited tasks from cgroup.procs shortly after
        while _left_in_hosts(c) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left_in_hosts(c) == []
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signum, err[-3000:]
    assert f"thinwire: stopped by {signal.Signals(signum).name}" in err
    assert "Traceback" not in err, err[-3000:]  # the first host's agent, on the console, stops without torchrun's
    assert c.is_up()
    ckpt.load(ckpt.latest(out))


class _FailsOnRank2(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.calls = torch.nn.Linear(16, 2), 0

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == "2" and self.training and self.calls > 6:
            raise ValueError("rank 2's data had a bad sample")
        return self.lin(x)


def failing_rank():
    """A user workload whose third worker fails on its own at its seventh step."""
    from thinwire.workloads.base import Workload

    g = torch.Generator().manual_seed(0)
    data = [(x, int(x.sum() > 0)) for x in torch.randn(256, 16, generator=g)]
    return Workload(model=_FailsOnRank2(), train=data, val=data, loss=torch.nn.functional.cross_entropy,
                    task="classification", batch_size=12, steps=40)


def test_a_failed_run_names_the_host_whose_worker_failed_not_one_that_lost_it(tmp_path):
    """Once h2's worker fails, the others' workers lose their connections to it and leave first (in one line):
    the host named, and the log lines shown, must be h2's, with its error."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: tg{os.getpid()}\ndefaults: {{bandwidth: 1gbit, cpu: 0.6}}\nhosts:\n"
                    "  - {name: h0}\n  - {name: h1}\n  - {name: h2}\n")
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    try:
        r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload",
                            "tests.test_cluster_train:failing_rank", "--threads", "1", "--out", str(tmp_path / "run")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        c.down()
    assert r.returncode == 2, r.stderr[-3000:]
    error = r.stderr[r.stderr.index("thinwire: error:"):]
    assert "host h2 (" in error and "rank 2's data had a bad sample" in error, error
