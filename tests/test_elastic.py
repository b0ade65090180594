"""Hosts that leave and come back (issue 22): ``thinwire train --cluster SPEC --min-hosts N``.

The emulator test needs root (skipped elsewhere): a host is killed mid-run (``thinwire cluster
kill``: link down, its processes SIGKILLed), the others go on from the last checkpoint at the
smaller world size; it is restored and joins again; the run finishes all its steps and learns.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_cli import ROOT, assert_refused, thinwire
from thinwire.errors import ThinwireError
from thinwire.train import cluster_launch
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec


def _spec(tmp_path: Path, hosts: int = 3) -> Path:
    spec = tmp_path / "spec.yaml"
    names = "".join(f"  - {{name: h{i}}}\n" for i in range(hosts))
    spec.write_text(f"name: te{os.getpid()}\ndefaults: {{bandwidth: 1gbit, cpu: 0.6}}\nhosts:\n{names}")
    return spec


@pytest.mark.parametrize("extra, pattern", [
    (["--min-hosts", "2"], r"max_restarts: must be at least 1 with min_hosts, got 0.*Every host that leaves"),
    (["--min-hosts", "0", "--max-restarts", "1"], r"min_hosts: must be an integer in \[1, 4096\], got 0"),
    (["--min-hosts", "2", "--max-restarts", "1", "--batch-size", "64"],
     r"batch_size: must be divisible by every number of hosts the run may have \(2 to 3 with min_hosts 2\).*multiple of 6"),
    (["--min-hosts", "4", "--max-restarts", "1"], r"min_hosts: must be at most the 3 hosts of .*spec.yaml, got 4"),
])
def test_bad_elastic_input_is_refused_before_launch(tmp_path, extra, pattern):
    proc = thinwire("train", "--workload", "digits", "--cluster", str(_spec(tmp_path)), *extra,
                    "--out", str(tmp_path / "run"))
    assert_refused(proc, pattern)
    assert not (tmp_path / "run").exists()


def test_min_hosts_needs_a_cluster(tmp_path):
    proc = thinwire("train", "--workload", "digits", "--min-hosts", "1", "--max-restarts", "1",
                    "--out", str(tmp_path / "run"))
    assert_refused(proc, r"min_hosts: must be used with --cluster SPEC.*--nnodes MIN:MAX")


class _Proc:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code

    def terminate(self):
        pass

    def wait(self, timeout=None):
        return self.code


class _Cluster:
    spec = SimpleNamespace(hosts=[])

    def killed_hosts(self):
        return set()

    def status(self):
        return []

    def hosts(self):
        return []


def _agents(*codes):
    return [SimpleNamespace(host=SimpleNamespace(name=f"h{i}", address=f"10.0.0.{i + 1}"), proc=_Proc(c),
                            gone=False, killed=False, out=None, nic=False) for i, c in enumerate(codes)]


def test_a_host_that_comes_back_as_the_run_finishes_is_not_a_failure(tmp_path):
    # the first host's agent exited 0 (the run is done) and took the rendezvous store with it, so the
    # host that was restarted to rejoin fails: the run succeeded all the same
    agents = _agents(0, 0, 1)
    cluster_launch._wait(_Cluster(), agents, tmp_path, min_hosts=2)
    assert agents[2].gone


def test_the_host_whose_worker_failed_is_named_though_its_agent_is_slower_to_exit(tmp_path):
    # h2's worker raised; h0 (its output on the console, unread) and h1 lost it and their agents exited, while
    # h2's agent still tries to reach the rendezvous store that went with h0: h2 is the cause, named with its code
    agents = _agents(1, 1, None)
    agents[0].log = None
    for a, says in zip(agents[1:], ["thinwire[1]: stopped: lost another worker (Connection closed by peer)",
                                    "[rank2]: Traceback (most recent call last):\n[rank2]: ValueError: a bad sample"]):
        a.log = tmp_path / f"{a.host.name}.log"
        a.log.write_text(says + "\n")
    exits_at = time.monotonic() + 3  # longer than the 1.5 s the others' agents once got
    agents[2].proc.poll = lambda: None if time.monotonic() < exits_at else 1
    with pytest.raises(ThinwireError, match=r"host h2 .* failed with exit code 1 and the other hosts were stopped"):
        cluster_launch._wait(_Cluster(), agents, tmp_path)


def test_the_failed_hosts_message_shows_its_workers_error_though_the_agent_wrote_more_after_it(tmp_path):
    # as a CI run had it: h2's worker raised, then its agent's C++ frames and the rendezvous it could not shut
    # down filled the log's last lines; the message must still carry the worker's error and where it was raised
    agents = _agents(1, 1, 1)
    frames = "\n".join(f"frame #{i}: <unknown function> + 0x2724a (0x7fdee564524a in libc.so.6)" for i in range(30))
    logs = {"h0": "thinwire[0]: stopped: lost another worker (Connection closed by peer)",
            "h1": "thinwire[1]: stopped: lost another worker (Connection closed by peer)",
            "h2": "[rank2]: Traceback (most recent call last):\n"
                  '[rank2]:   File "/work/thinwire/train/loop.py", line 275, in _train_step\n'
                  "[rank2]:     part = self.wl.loss(self.ddp(xm), ym)\n"
                  '[rank2]:   File "/work/tests/test_cluster_train.py", line 170, in forward\n'
                  "[rank2]:     raise ValueError(\"rank 2's data had a bad sample\")\n"
                  "[rank2]:     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
                  "[rank2]: ValueError: rank 2's data had a bad sample\n"
                  "E1206 04:06:27 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 2130)\n"
                  f"{frames}\nthinwire: this host's agent lost the rendezvous store, which the first host's agent "
                  "holds (RendezvousConnectionError); its agent stopped"}
    for a in agents:
        a.log = tmp_path / f"{a.host.name}.log"
        a.log.write_text(logs[a.host.name] + "\n")
    with pytest.raises(ThinwireError) as e:
        cluster_launch._wait(_Cluster(), agents, tmp_path)
    said = str(e.value)
    assert "host h2 (" in said and "ValueError: rank 2's data had a bad sample" in said, said
    assert 'test_cluster_train.py", line 170, in forward' in said and "^^^" not in said, said
    assert said.rstrip().endswith("its agent stopped"), said  # the log's last lines follow


def test_a_host_failing_while_too_few_are_left_stops_the_run(tmp_path):
    with pytest.raises(ThinwireError, match=r"host h1 .* failed with exit code 1.* 1 host\(s\) left, fewer than min_hosts 2"):
        cluster_launch._wait(_Cluster(), _agents(None, 1, 1), tmp_path, min_hosts=2)
    with pytest.raises(ThinwireError, match=r"host h0 .* failed with exit code 1.*holds the rendezvous store"):
        cluster_launch._wait(_Cluster(), _agents(1, None, None), tmp_path, min_hosts=2)


def _events(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"event"' in line]


def _wait(pred, proc: subprocess.Popen, what: str, limit: float = 180) -> None:
    """Until ``pred()``; else fail with the tail of the run's stderr (``proc.log``, a file, so nothing blocks)."""
    deadline = time.time() + limit
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {limit} s (exit {proc.poll()}): {proc.log.read_text()[-6000:]}")


def _max_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line).get("step", 0) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n") and line.strip()), default=0)


# long enough that the restored host rejoins mid-run: a step takes ~15 ms, the rejoin ~10 s (its agent's
# start, the 5 s last call); with 240 steps the run could end first (then the launcher must say it did)
STEPS = 1500


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups")
@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)")
def test_a_killed_host_leaves_the_rest_go_on_and_it_joins_again_when_restored(tmp_path):
    spec = _spec(tmp_path)
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "digits",
                             "--steps", str(STEPS), "--batch-size", "48", "--checkpoint-every", "20", "--eval-every", "500",
                             "--min-hosts", "2", "--max-restarts", "3", "--set", "timeout_s=20", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.log", "w"), text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.log = tmp_path / "stderr.log"
    try:
        _wait(lambda: _max_step(out) >= 45, proc, "step 45 with 3 hosts")
        c.kill_host("h2")
        assert c.killed_hosts() == {"h2"} and not c.cgroups.pids("h2")
        _wait(lambda: any(e["event"] == "restart" and e["world_size"] == 2 for e in _events(out)), proc,
              "a restart with 2 hosts")
        two = next(e for e in _events(out) if e["event"] == "restart" and e["world_size"] == 2)
        assert two["checkpoint_world_size"] == 3 and two["step"] >= 40  # at most the steps since the checkpoint lost
        _wait(lambda: _max_step(out) >= two["step"] + 20, proc, "20 steps with 2 hosts")
        c.restore_host("h2")
        _wait(lambda: any(e["event"] == "restart" and e["world_size"] == 3 and e["step"] > two["step"]
                          for e in _events(out)), proc, "h2 back: a restart with 3 hosts")
        proc.wait(timeout=300)
        assert proc.returncode == 0, proc.log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        c.down()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 3 and summary["val_accuracy"] > 0.9


def test_under_your_own_torchrun_a_worker_that_lost_a_peer_says_one_line():
    """`torchrun ... -m thinwire train`: the worker whose peer died printed gloo's whole traceback (the lost-peer
    line was only in `thinwire train`'s own workers)."""
    import subprocess
    import sys

    code = ("import thinwire.cli.train as t\n"
            "def lost(cfg):\n"
            "    raise RuntimeError('[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:45478: '\n"
            "                       'Connection reset by peer')\n"
            "t._train_here = lost\n"
            "class Env:\n"
            "    rank = 1\n"
            "t._train_as_worker(None, Env())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "thinwire[1]: stopped: lost another worker (Read error [127.0.0.1]:45478: Connection reset by peer)"
