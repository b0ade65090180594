"""How fast each host of an emulated cluster runs the workload's step, all hosts at once.

A host's ``cpu`` in a cluster spec is a CFS quota: the host runs at full speed for ``cpu x period`` and
then waits out the rest of the period. The model's speed for it, ``cpu`` over one core's, holds for a
long loop of one kernel, but a training step's working set is refilled after every pause while other
hosts used the core: on this 2-core VM a transformer layer's forward and backward in a loop took up to
15% more CPU at a 0.5-core quota than alone, and 17-42% more at 0.25 (measured 2026-12-03, 4 hosts
computing at once). A pipeline whose slowest stage sits on a 0.25-core host was predicted 20-25% fast for
that reason (``benchmarks/results/archive/pipeline_v1.md``); this probe finds such a host at 0.17-0.19 of
a core (``benchmarks/results/pipeline.md``).

``host_speeds(cluster, ...)`` measures it: one process alone on this machine, then one in every host at
once (lined up on a barrier, as training lines them up every step), each running the workload's step
(:mod:`thinwire.measure.corun`'s copy: data, forward, backward, optimizer) for at least ``steps`` steps and
half a second's work alone (several seconds on a slow host: a quota pauses every 10 ms); a host's
speed is the mean step alone over its mean step there (the loop's time over its steps: where a step is
shorter than a quota's window, most steps fit between two pauses, and a median step read a 0.5-core host
at 0.7-1.0 of a core). The model uses these speeds in place of
``cpu`` and the co-run factor for the hosts of that cluster (:func:`thinwire.sim.inputs.measured_speeds`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

from thinwire.child import pythonpath
from thinwire.errors import ThinwireError
from thinwire.measure.corun import _run, kill_all
from thinwire.measure.file import HostSpeedRecord

MIN_WORK_S = 0.5  # seconds of steps each host runs, at one process alone's pace


def host_speeds(cluster, *, workload: str, model: dict, data: str | None, batch: int, threads: int = 1,
                steps: int = 12, timeout: float = 300.0, hosts: list[str] | None = None) -> HostSpeedRecord:
    """Each of ``hosts`` (default: all the spec's) relative to one process alone here (module docstring)."""
    hosts = hosts or cluster.spec.host_names
    argv = ["--workload", workload, "--model", json.dumps(model), "--batch", str(batch), "--threads", str(threads)] + \
        (["--data", data] if data else [])
    # a quota's pauses come every 10 ms: half a second of work alone (a few seconds on a slow host) averages them
    steps = max(steps, math.ceil(MIN_WORK_S / _run(1, [*argv, "--steps", str(steps)], timeout)))
    argv += ["--steps", str(steps)]
    alone = _run(1, argv, timeout, key="mean_s")
    env = {"PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as barrier:
        os.chmod(barrier, 0o777)
        cmd = [sys.executable, "-m", "thinwire.measure.corun", *argv, "--n", str(len(hosts)), "--barrier", barrier]
        procs = []
        oom_before = {h: cluster.oom_kills(h) for h in hosts}
        # output to files: the copies run unread until all end or one fails, so a pipe could fill
        logs = [tempfile.TemporaryFile("w+") for _ in hosts]
        try:
            procs += [cluster.host(h).spawn(cmd, env=env, stdout=log, stderr=subprocess.DEVNULL, text=True)
                      for h, log in zip(hosts, logs)]
            deadline = time.monotonic() + timeout
            # a copy that dies leaves the others waiting on the barrier: stop at the first failure
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.monotonic() > deadline:
                    raise ThinwireError(f"host speed probe: the hosts did not finish {steps} steps in {timeout:.0f} s")
                time.sleep(0.05)
            failed = [(h, p.returncode) for h, p in zip(hosts, procs) if p.poll()]
        finally:
            kill_all(procs)
            outs = []
            for log in logs:
                log.seek(0)
                outs.append(log.read())
                log.close()
    killed = [h for h in hosts if cluster.oom_kills(h) > oom_before[h]]
    if killed:
        limits = ", ".join(f"{h}'s {cluster.spec.host(h).memory / 2**20:.0f} MiB" for h in killed)
        raise ThinwireError(f"host speed probe: the memory limit killed the step on {limits}: the probe runs the "
                            "whole model's step on every host. A host's speed does not depend on its memory: probe "
                            "a copy of the spec without hosts[].memory, or skip the probe with --no-host-speed.")
    speed = {}
    for h, p, out in zip(hosts, procs, outs):
        lines = out.strip().splitlines()
        if failed or p.returncode != 0 or not lines:
            h, code = failed[0] if failed else (h, p.returncode)
            raise ThinwireError(f"host speed probe on {h!r} failed (exit {code}); run `thinwire cluster "
                                "status SPEC` and try again")
        speed[h] = alone / json.loads(lines[-1])["mean_s"]
    return HostSpeedRecord(cluster=cluster.spec.name, threads=threads, batch=batch, speed=speed)


def describe(rec: HostSpeedRecord) -> str:
    return ", ".join(f"{h} {v:.2f}" for h, v in rec.speed.items())
