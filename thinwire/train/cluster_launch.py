"""``thinwire train --cluster SPEC``: one worker per emulated host, every gradient byte on the shaped links.

Each host runs its own torchrun elastic agent inside its network namespace and cgroup, exactly as
separate machines would run ``torchrun --nnodes N``: c10d rendezvous at the first host's address,
``--local-addr`` set to the host's own address, and gloo bound to the host's interface
(``GLOO_SOCKET_IFNAME``), so collectives between workers cross the veths, bridges and tc shaping
of the emulated links. Rank 0 writes the run folder; the other hosts' agents log to
``OUT/hosts/NAME.log``. If any host fails, the others are stopped and the error names the host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec
from thinwire.errors import ThinwireError
from thinwire.train.distenv import HOST_CPUS_ENV
from thinwire.signals import deferred
from thinwire.train.config import TrainConfig

RDZV_PORT = 29400


def launch_cluster(cfg: TrainConfig, config_path: Path, module: str = "thinwire.train.worker") -> None:
    spec = load_cluster_spec(cfg.cluster)
    cluster = EmulatedCluster(spec)
    if not cluster.is_up():
        raise ThinwireError(f"cluster: {spec.name!r} is not up. Start it first: thinwire cluster up {cfg.cluster}")
    hosts = cluster.hosts()
    cpus = {h.name: h.cpu for h in spec.hosts}  # each host's share: its processes cannot read their cgroup
    if cfg.plan:  # only the hosts the plan trains on
        from thinwire.plan.planfile import read_plan

        keep = set(read_plan(cfg.plan).hosts)
        hosts = [h for h in hosts if h.name in keep]
    logs = Path(cfg.out) / "hosts"
    logs.mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")] if p)
    procs = []
    for i, h in enumerate(hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}",
                "--rdzv-id", f"thinwire-{spec.name}", "--local-addr", h.address,
                # the store lives on the first host; c10d cannot tell by hostname inside a namespace
                "--rdzv-conf", f"is_host={1 if i == 0 else 0},join_timeout=120",
                "--max-restarts", str(cfg.max_restarts), "--monitor-interval", "0.5",
                "-m", module, str(config_path)]
        out = None if i == 0 else open(logs / f"{h.name}.log", "w")
        # a fresh store per rendezvous round (hosted by rank 0's worker): agents count restarts on their
        # own, so a prefix by restart count can differ between hosts after a membership change
        env = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               **({HOST_CPUS_ENV: str(cpus[h.name])} if cpus.get(h.name) else {})}
        procs.append((h, out, h.spawn(argv, env=env,
                                      stdout=out, stderr=subprocess.STDOUT if out else None)))
    _wait(cluster, procs, logs)


def _wait(cluster: EmulatedCluster, procs, logs: Path) -> None:
    try:
        while True:
            failed = [(h, p) for h, _, p in procs if p.poll() not in (None, 0)]
            if failed:
                h, p = failed[0]
                raise ThinwireError(f"cluster: {_diagnose(cluster, logs)}host {h.name} ({h.address}) failed with exit "
                                    f"code {p.returncode} and the other hosts were stopped. {_tail(logs / f'{h.name}.log')}")
            if all(p.poll() == 0 for _, _, p in procs):
                return
            time.sleep(0.2)
    finally:  # also on Ctrl-C, SIGTERM and SIGHUP (thinwire.signals); a second signal waits for it
        with deferred():
            _stop_hosts(procs)


STOP_GRACE_S = 5.0  # all agents together; a failure must still surface within a collective timeout or two


def _stop_hosts(procs) -> None:
    """Stop every host's agent (it stops its worker), within one shared grace period: an agent cut off
    from the rendezvous store may not answer SIGTERM, and waiting for each in turn would delay the
    error a cut link should give at once. What is still running after it is killed."""
    for _, out, p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for _, out, p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if out:
            out.close()


def _diagnose(cluster: EmulatedCluster, logs: Path) -> str:
    """Name the hosts that are unreachable: links down, or addresses the workers' errors mention."""
    down = [s.name for s in cluster.status() if not s.link_up]
    by_addr = {h.address: h.name for h in cluster.hosts()}
    text = " ".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
    named = sorted({name for addr, name in by_addr.items() if re.search(rf"\b{re.escape(addr)}\b.*(?:[Tt]imed out|reset|refused|closed)", text)})
    parts = []
    if down:
        parts.append(f"{', '.join(down)} unreachable (link down):")
    elif named:
        parts.append(f"the workers' errors name {', '.join(named)}:")
    return " ".join(parts) + " " if parts else ""


def _tail(path: Path, lines: int = 6) -> str:
    if not path.is_file():
        return "Its output is above."
    text = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    return "Last lines of its log " + str(path) + ":\n" + "\n".join(text[-lines:])
