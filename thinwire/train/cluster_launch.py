"""``thinwire train --cluster SPEC``: one worker per emulated host, every gradient byte on the shaped links.

Each host runs its own torchrun elastic agent inside its network namespace and cgroup, exactly as
separate machines would run ``torchrun --nnodes N``: c10d rendezvous at the first host's address,
``--local-addr`` set to the host's own address, and gloo bound to the host's interface
(``GLOO_SOCKET_IFNAME``), so collectives between workers cross the veths, bridges and tc shaping
of the emulated links. Rank 0 writes the run folder; the other hosts' agents log to
``OUT/hosts/NAME.log``. If any host fails, the others are stopped and the error names the host.

**Hosts that leave and come back** (``min_hosts``): the agents run with ``--nnodes MIN:MAX``. When
a host dies (``thinwire cluster kill``), the workers on the others fail when their collective with it times out,
their agents re-rendezvous without it (one of ``--max-restarts``) and the workers start again from
the last checkpoint at the smaller world size, the data re-split among them. When the host comes
back (``thinwire cluster restore``) its agent starts again; the running agents see a node waiting
and re-rendezvous with it (torchrun does not count that as a restart). The first host holds the
rendezvous store (c10d): it cannot leave, as with torchrun on real machines.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from thinwire.child import pythonpath as child_pythonpath
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.compress.switch import ENV as SWITCH_ENV
from thinwire.cluster.spec import load_cluster_spec
from thinwire.errors import LOST_PEER_SAYS, ThinwireError
from thinwire.train.distenv import HOST_CPUS_ENV, RESTARTS_BEFORE_ENV
from thinwire.signals import deferred
from thinwire.train.config import TrainConfig
from thinwire.train.progress import console

RDZV_PORT = 29400


def check_free(spec_path: str) -> None:
    """Refuse a launch onto a cluster whose hosts already run processes (another job, or a `cluster exec`): its
    rendezvous and the aggregator's ports are taken, and the two jobs' workers would share the hosts' quotas."""
    cluster = EmulatedCluster(load_cluster_spec(spec_path))
    if not cluster.is_up():
        raise ThinwireError(cluster.not_up(spec_path))
    busy = {h.name: pids for h in cluster.spec.hosts if (pids := cluster.cgroups.pids(h.name))}
    if busy:
        which = "; ".join(f"{name}: pid {', '.join(map(str, pids[:4]))}{' ...' if len(pids) > 4 else ''}"
                          for name, pids in busy.items())
        raise ThinwireError(f"cluster: {cluster.spec.name} is running another job ({which}); wait for it to finish, "
                            f"or stop it (Ctrl-C in its terminal), then start this one")


class AggregatorGone(ThinwireError):
    """The aggregator on the switch stopped while the workers still needed it."""


def launch_cluster(cfg: TrainConfig, config_path: Path, module: str = "thinwire.train.worker",
                   aggregator: bool | None = None) -> None:
    """Run the job on the emulated cluster (module docstring). With ``--aggregation switch`` and restarts
    left, a dead aggregator costs one restart: the job goes on around the ring from its last checkpoint
    (the config it then runs with is ``OUT/config-ring.yaml``). ``aggregator``: start the aggregator on the
    switch (default: with ``--aggregation switch``; ``thinwire doctor`` asks for it to try int8 through it)."""
    try:
        _launch(cfg, config_path, module, cfg.aggregation == "switch" if aggregator is None else aggregator)
    except AggregatorGone as e:
        if cfg.max_restarts < 1:
            raise AggregatorGone(f"{e} Go on around the ring with `thinwire train --resume {cfg.out} --cluster "
                                 f"{cfg.cluster} --aggregation ring ...`, or give --max-restarts 1 or more to have it "
                                 "done by itself.") from None
        import dataclasses

        from thinwire.train.config import save_config

        ring = dataclasses.replace(cfg, aggregation="ring", max_restarts=cfg.max_restarts - 1)
        path = Path(cfg.out) / "config-ring.yaml"
        save_config(ring, path)
        console.print(f"[yellow]{e} Going on around the ring from the last checkpoint (one of --max-restarts; "
                      f"config {path}).[/yellow]")
        # the hosts' logs keep the first attempt's lines; the summary counts the restart the fallback took
        _launch(ring, path, module, False, append_logs=True, restarts_before=1)


def _launch(cfg: TrainConfig, config_path: Path, module: str, with_aggregator: bool, append_logs: bool = False,
            restarts_before: int = 0) -> None:
    spec = load_cluster_spec(cfg.cluster)
    cluster = EmulatedCluster(spec)
    if not cluster.is_up():
        raise ThinwireError(cluster.not_up(cfg.cluster))
    hosts = cluster.hosts()
    cpus = {h.name: h.cpu for h in spec.hosts}  # each host's share: its processes cannot read their cgroup
    if cfg.plan:  # only the hosts the plan trains on
        from thinwire.plan.planfile import read_plan

        keep = set(read_plan(cfg.plan).hosts)
        hosts = [h for h in hosts if h.name in keep]
    down = sorted(cluster.killed_hosts() & {h.name for h in hosts})
    if down:
        raise ThinwireError(f"cluster: {', '.join(down)} killed (`thinwire cluster kill`); bring "
                            f"{'it' if len(down) == 1 else 'them'} back first: "
                            + "; ".join(f"thinwire cluster restore {cfg.cluster} {h}" for h in down))
    logs = Path(cfg.out) / "hosts"
    logs.mkdir(parents=True, exist_ok=True)
    pythonpath = child_pythonpath()
    nnodes = f"{cfg.min_hosts}:{len(hosts)}" if cfg.min_hosts else str(len(hosts))
    # elastic: a rendezvous round closes this long after the smallest allowed group has joined
    last_call = f",last_call_timeout={ELASTIC_LAST_CALL_S}" if cfg.min_hosts else ""
    agents = {}
    oom_before = {h.name: cluster.oom_kills(h.name) for h in spec.hosts if h.memory is not None}
    aggregator = _start_aggregator(cluster, len(hosts), cfg, logs, pythonpath) if with_aggregator else None
    for i, h in enumerate(hosts):
        argv = [sys.executable, "-m", "thinwire.train.host_agent", "--nnodes", nnodes, "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}",
                "--rdzv-id", f"thinwire-{spec.name}", "--local-addr", h.address,
                # the store lives on the first host; c10d cannot tell by hostname inside a namespace
                "--rdzv-conf", f"is_host={1 if i == 0 else 0},join_timeout=120{last_call}",
                "--max-restarts", str(cfg.max_restarts), "--monitor-interval", "0.5",
                "-m", module, str(config_path)]
        # a fresh store per rendezvous round (hosted by rank 0's worker): agents count restarts on their
        # own, so a prefix by restart count can differ between hosts after a membership change
        env = {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               **({HOST_CPUS_ENV: str(cpus[h.name])} if cpus.get(h.name) else {}),
               **({SWITCH_ENV: f"{aggregator.host.address}:{SWITCH_PORT}"} if aggregator else {}),
               **({RESTARTS_BEFORE_ENV: str(restarts_before)} if restarts_before else {})}
        agents[h.name] = Agent(h, argv, env, None if i == 0 else logs / f"{h.name}.log",
                               nic=bool(getattr(h, "nic_cpu", None)) and cfg.offload == "auto", append=append_logs)
    _wait(cluster, list(agents.values()), logs, min_hosts=cfg.min_hosts, aggregator=aggregator, oom_before=oom_before,
          timeout_s=cfg.timeout_s)


SWITCH_PORT = 29500


def _start_aggregator(cluster: EmulatedCluster, trainers: int, cfg: TrainConfig, logs: Path, pythonpath: str) -> "Agent":
    """The aggregator on the switch (spec ``switch:``), before any worker needs it; logs to OUT/hosts/switch.log."""
    host = cluster.aggregator()
    # -c, not -m: `-m thinwire.compress.switch` would import the module twice (the package imports it)
    argv = [sys.executable, "-c", "from thinwire.compress.switch import main; main()", "--address", host.address,
            "--port", str(SWITCH_PORT),
            "--trainers", str(trainers), "--timeout", str(cfg.timeout_s)]
    return Agent(host, argv, {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}, logs / "switch.log")


ELASTIC_LAST_CALL_S = 5


class Agent:
    """One host's torchrun agent: started again when an elastic run's host comes back."""

    def __init__(self, host, argv: list[str], env: dict, log: Path | None, nic: bool = False, append: bool = False) -> None:
        self.host, self.argv, self.env, self.log = host, argv, env, log
        self.nic = nic  # its communication threads go to the host's offload engine (spec `nic:`, offload auto)
        self.out = None
        self.proc: subprocess.Popen | None = None
        self.gone = False    # left an elastic run
        self.killed = False  # ... by `thinwire cluster kill`: starts again once restored
        self.start(append)

    def start(self, append: bool = False) -> None:
        if self.out:
            self.out.close()
        self.out = None if self.log is None else open(self.log, "a" if append else "w")
        if self.out:  # where each start's lines begin (a host that came back, the ring after the aggregator)
            self.out.write(f"--- thinwire: {self.host.name}'s agent started {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
            self.out.flush()
        self.proc = self.host.spawn(self.argv, env=self.env, stdout=self.out,
                                    stderr=subprocess.STDOUT if self.out else None)
        self.gone = False


def _wait(cluster: EmulatedCluster, agents: list[Agent], logs: Path, min_hosts: int | None = None,
          aggregator: Agent | None = None, oom_before: dict[str, int] | None = None, timeout_s: float | None = None) -> None:
    """Until every agent has finished. Without ``min_hosts`` any failure stops the run. With it a host
    other than the first (which holds the rendezvous store) may fail and the run goes on while at
    least ``min_hosts`` are left: torchrun's agents restart the workers on the hosts that are left
    from the last checkpoint; a failed host killed with `thinwire cluster kill` starts again when
    `thinwire cluster restore` brings it back, and joins at the next rendezvous."""
    try:
        while True:
            if aggregator is not None and aggregator.proc.poll() is not None:  # before the workers it failed
                raise AggregatorGone(f"cluster: the aggregator on the switch stopped (exit code {aggregator.proc.poll()}) "
                                     f"and the hosts were stopped; the last checkpoint is kept. {_tail(logs / 'switch.log')}")
            for a in agents:
                code = a.proc.poll()
                if a.gone or code in (None, 0):
                    continue
                if min_hosts and a is not agents[0] and agents[0].proc.poll() == 0:
                    # the first host's agent exits 0 only once the run is done (its exit barrier): a host
                    # that came back too late to join fails when the rendezvous store goes with it
                    a.gone = True
                    console.print(f"host {a.host.name} came back as the run finished; it did not join")
                    continue
                left = [b for b in agents if not b.gone and b is not a and b.proc.poll() is None]
                if not min_hosts or a is agents[0] or len(left) < min_hosts:
                    if not min_hosts and all(h.link_up for h in cluster.status()):  # a cut link is named as such
                        a = _first_cause(agents, a)
                        code = a.proc.poll()
                    why = "" if not min_hosts else (
                        " It holds the rendezvous store, so it cannot leave." if a is agents[0] else
                        f" {len(left)} host(s) left, fewer than min_hosts {min_hosts}.")
                    how = f"failed with exit code {code}" if code is not None else "failed (its worker did)"
                    raise ThinwireError(f"cluster: {_diagnose(cluster, logs, oom_before or {})}host {a.host.name} ({a.host.address}) {how} "
                                        f"and the other hosts were stopped.{why} "
                                        f"{_tail(logs / f'{a.host.name}.log')}")
                a.gone, a.killed = True, a.host.name in cluster.killed_hosts()
                # a killed host's link went down first, as a machine that loses power: a collective in flight with
                # it hears nothing and ends only at its timeout
                later = f" once their collective with it times out (timeout_s, {timeout_s:g} s)" if a.killed and timeout_s else ""
                console.print(f"[yellow]host {a.host.name} left (exit code {code}); the {len(left)} others go on "
                              f"from the last checkpoint{later}[/yellow]" + (" (`thinwire cluster restore` brings it back)"
                                                                             if a.killed else ""))
            killed = cluster.killed_hosts() if any(a.gone and a.killed for a in agents) else set()
            for a in agents:  # a killed host that was restored starts again, while the run is still going
                if a.gone and a.killed and a.host.name not in killed and \
                        all(b.proc.poll() is None for b in agents if not b.gone):
                    console.print(f"host {a.host.name} is back: it joins at the next rendezvous")
                    a.start(append=True)
            if all(a.proc.poll() == 0 for a in agents if not a.gone):
                return

            for a in agents:  # hosts with an offload engine (spec `nic:`): threads a process group started
                if a.nic and not a.gone:
                    cluster.adopt_offloaded_threads(a.host.name)
            time.sleep(0.2)
    finally:  # also on Ctrl-C, SIGTERM and SIGHUP (thinwire.signals); a second signal waits for it
        with deferred():
            _stop_hosts(agents + ([aggregator] if aggregator is not None else []))


STOP_GRACE_S = 5.0  # all agents together; a failure must still surface within a collective timeout or two


def _stop_hosts(agents: list[Agent]) -> None:
    """Stop every host's agent (it stops its worker), within one shared grace period: an agent cut off
    from the rendezvous store may not answer SIGTERM, and waiting for each in turn would delay the
    error a cut link should give at once. What is still running after it is killed."""
    for a in agents:
        if a.proc.poll() is None:
            a.proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for a in agents:
        try:
            a.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.proc.kill()
            a.proc.wait()
        if a.out:
            a.out.close()


def _diagnose(cluster: EmulatedCluster, logs: Path, oom_before: dict[str, int]) -> str:
    """Name the hosts that are unreachable (links down, or addresses the workers' errors mention) and those whose
    memory limit killed a process since the launch (``oom_before``: each host's count then)."""
    down = [s.name for s in cluster.status() if not s.link_up]
    by_addr = {h.address: h.name for h in cluster.hosts()}
    text = " ".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
    named = sorted({name for addr, name in by_addr.items() if re.search(rf"\b{re.escape(addr)}\b.*(?:[Tt]imed out|reset|refused|closed)", text)})
    parts = []
    oom = [h for h in cluster.spec.hosts if h.memory is not None and cluster.oom_kills(h.name) > oom_before.get(h.name, 0)]
    if oom:
        parts.append("; ".join(f"{h.name}'s memory limit ({h.memory / 2**20:.0f} MiB) killed its worker" for h in oom)
                     + " (the cgroup's OOM killer): give it more memory, or split the model over hosts "
                     "(`thinwire plan --pipeline`, `--pipeline`);")
    if down:
        parts.append(f"{', '.join(down)} unreachable (link down):")
    elif named:
        parts.append(f"the workers' errors name {', '.join(named)}:")
    return " ".join(parts) + " " if parts else ""


CAUSE_GRACE_S = 10.0  # once one host's agent fails, how long at most the others get to fail too before one is named


def _first_cause(agents: list, failed):
    """The host whose worker failed first, not one that only lost its connection to it: the agent of a worker
    that lost a peer may exit before the agent of the worker that failed (whose agent may first spend seconds
    failing to reach the rendezvous store that went with the first host), so the first agent to exit is
    often not the cause. Prefers a host whose log shows its worker's own error (a traceback or thinwire's
    error line, not the line of a worker that lost a peer), exited or not, then a failed host whose log does
    not say it lost a peer, waiting up to ``CAUSE_GRACE_S`` for one, or until every agent has exited."""
    def text(b) -> str | None:  # None: its output went to the console, unread
        return None if b.log is None or not b.log.is_file() else b.log.read_text(errors="replace")

    def own_error(b) -> bool:
        t = text(b)
        return t is not None and LOST_PEER_SAYS not in t and ("Traceback (most recent call last)" in t or
                                                               "thinwire: error:" in t)

    deadline = time.monotonic() + CAUSE_GRACE_S
    while True:
        failed_ones = [b for b in agents if not b.gone and b.proc.poll() not in (None, 0)]
        cause = next((b for b in agents if not b.gone and b.proc.poll() != 0 and own_error(b)), None) or \
            next((b for b in failed_ones if (t := text(b)) is not None and LOST_PEER_SAYS not in t), None)
        if cause is not None or time.monotonic() >= deadline or all(b.proc.poll() is not None for b in agents):
            break
        time.sleep(0.1)
    while cause is not None and cause.proc.poll() is None and time.monotonic() < deadline + 5:
        time.sleep(0.1)  # its worker failed and its agent is on its way out: its exit code, for the message
    return cause or next((b for b in failed_ones if text(b) is None), failed)


def _tail(path: Path, lines: int = 6) -> str:
    """The log's last lines, after its worker's own error where the log has one: what the agent prints once
    its worker has failed (torch's C++ frames, the rendezvous it could not shut down) can fill the tail."""
    if not path.is_file():
        return "Its output is above."
    text = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    error = _worker_error(text)
    shown = "Its worker's error:\n" + "\n".join(error) + "\n" if error and not set(error) <= set(text[-lines:]) else ""
    return shown + "Last lines of its log " + str(path) + ":\n" + "\n".join(text[-lines:])


def _worker_error(lines: list[str]) -> list[str]:
    """The last error a worker printed: thinwire's error line, or a Python traceback's last frame and its
    exception line (the first line after the traceback's header that is not indented). torchrun prefixes a
    worker's lines with its rank (``[rank2]: ``)."""
    lines = [re.sub(r"^\[(?:rank|default)\d+\]: ?", "", l) for l in lines]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("thinwire: error:"):
            return [lines[i]]
        if lines[i].startswith("Traceback (most recent call last)"):
            end = next((k for k in range(i + 1, len(lines)) if not lines[k][:1].isspace()), None)
            if end is None:
                return []
            frame = next((k for k in range(end - 1, i, -1) if lines[k].lstrip().startswith("File ")), None)
            return [l.rstrip() for l in (lines[frame:end] if frame is not None else []) + [lines[end]]
                    if l.strip(" ^~")]
    return []
